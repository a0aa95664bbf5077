"""ONNX Runtime's quantization tools, run without their side effects on the caller's process.

What ``onnxruntime.quantization`` (1.32) does to the process that calls it, as measured here:

* It logs on the *root* logger (``logging.warning(...)``): "Please consider to run
  pre-processing before quantization" twice per call, and a line for every tensor it skips
  ("Quantization parameters for tensor ... not specified", "Ignore MatMul due to non constant
  B"); the caller's root handlers print them.
* Its histogram calibrators (Entropy, Percentile, Distribution) ``print()`` their progress to
  stdout; the pre-processing logs on ``onnxruntime.quantization.shape_inference``.
* ``import onnxruntime.quantization`` appends ``onnxruntime/transformers`` to ``sys.path``
  (``onnxruntime.transformers`` imports its own modules by their bare names).
* The pre-processing's symbolic shape inference lives in ``onnxruntime.tools``, whose package
  imports torch whenever torch is installed (for a PyTorch export helper the pre-processing
  never calls): 1.5 s and 220 MB of resident memory here, and torch's warning filters for the
  whole process. :func:`import_ort` imports it with torch hidden (``sys.modules["torch"] =
  None`` for the import only, when torch is not imported yet); ``onnxruntime.tools`` then lacks
  that helper (``infer_input_info``) for the rest of the process.
* Shape inference writes ``<model>-inferred.onnx`` next to the model it reads; static
  quantization writes its augmented model to a temporary folder.

:func:`contained` confines these (the host's :func:`bitpress.toolkit.containment.contained`):
ONNX Runtime's records and printed lines are re-emitted on ``bitpress_ort.ort``, demoted;
warning filters, ``sys.path`` and the working directory are put back after each call, and the
``sys.path`` entries its import added are put back in place for the next call (ONNX Runtime
imports some modules lazily by those bare names).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bitpress.plugin import ToolMessages, import_contained
from bitpress.plugin import contained as host_contained

#: ONNX Runtime's messages, demoted (its WARNING at INFO, the rest at DEBUG)
ort_log = logging.getLogger("bitpress_ort.ort")

#: module globals the calibration patches during a call (restored on exit)
PATCHED_GLOBALS = (("onnxruntime.quantization.calibrate", "load_model_with_shape_infer"),)
MODULES = (
    "onnxruntime.quantization",
    "onnxruntime.quantization.calibrate",
    "onnxruntime.quantization.quant_utils",
    "onnxruntime.quantization.registry",
    "onnxruntime.quantization.shape_inference",
    "onnxruntime.tools.symbolic_shape_infer",
)

_lock = threading.RLock()
_sys_path: list[str] = []
_imported = False


def import_ort(folder: Path | None = None) -> None:
    """Import ONNX Runtime's quantization modules under containment (once per process).

    ``folder``: where the import's working directory is (a temporary folder when ``None``).
    """
    global _imported
    with _lock:
        if _imported:
            return
        if folder is None:
            with tempfile.TemporaryDirectory(prefix="bitpress-ort-import-") as tmp:
                import_ort(Path(tmp))
            return
        before = list(sys.path)
        hide_torch = "torch" not in sys.modules
        if hide_torch:
            sys.modules["torch"] = None  # type: ignore[assignment]  # find_spec("torch") is None now
        try:
            import_contained(folder, MODULES, relay=ort_log, loggers=("onnxruntime",))
        finally:
            if hide_torch and sys.modules.get("torch", 0) is None:
                del sys.modules["torch"]
        # what the import added is gone again: keep it for the calls that need it
        _sys_path.extend(p for p in _added(before) if p not in _sys_path)
        _imported = True


def _added(before: list[str]) -> list[str]:
    import importlib.util

    spec = importlib.util.find_spec("onnxruntime.transformers")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return [p for p in locations if p not in before]


@contextmanager
def contained(folder: Path) -> Iterator[ToolMessages]:
    """The body (ONNX Runtime quantization calls) with its side effects confined; yields its messages."""
    import_ort(folder)
    with host_contained(folder, relay=ort_log, loggers=("onnxruntime",), module_globals=PATCHED_GLOBALS) as messages:
        for entry in _sys_path:
            if entry not in sys.path:
                sys.path.append(entry)
        yield messages


__all__ = ["PATCHED_GLOBALS", "contained", "import_ort", "ort_log"]
