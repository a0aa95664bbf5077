"""Run Intel Neural Compressor without letting its side effects reach the caller's process.

What ``onnx-neural-compressor`` 1.0 (with onnxruntime 1.32, transformers 5, scipy) does to the
process that imports and calls it, as measured here:

* its logger ``onnx_neural_compressor`` gets a stream handler of its own on stderr at import
  (``propagate=False``, level from ``$LOGLEVEL``, INFO by default): every call prints tables
  of quantized op counts and, when tuning, a dozen lines per trial;
* importing it imports ``transformers``, which logs "PyTorch was not found" on its own
  stderr handler; scipy's import adds process-wide warning filters;
* the import and every ``StaticQuantConfig`` set ``ORT_TENSORRT_UNAVAILABLE=1`` in
  ``os.environ``; ONNX Runtime's tools append ``onnxruntime/transformers`` to ``sys.path``;
* the weight-only algorithms ``print()`` a progress bar (``\\r``, no newline) to stdout;
* its tuning loop and the weight-only and SmoothQuant paths keep their scratch models in
  ``tempfile.TemporaryDirectory()`` folders of the *system* temporary folder; the tuning loop
  writes a new external-data file there for every trial and removes the folder only when it
  returns normally;
* ``exit(0)`` (SystemExit, status 0) in three places: static or dynamic quantization with no
  op type to quantize, a failing evaluation of the float model in the tuning loop (after
  ``print``-ing the traceback), and a tuning loop in which no trial met the tolerance.

:func:`contained` confines all of these for one call; :func:`import_inc` imports INC under it.
The working directory is moved into the call's folder too, although INC 1.0 writes nothing there
(its ``nc_workspace`` constant is unused on the ONNX path).
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from bitpress.plugin import QuantizationError, Relay, ToolMessages, import_contained
from bitpress.plugin import contained as host_contained

log = logging.getLogger(__name__)
#: INC's messages are re-emitted here (its ERROR at WARNING, WARNING at INFO, the rest at DEBUG)
inc_log = logging.getLogger("bitpress_inc.inc")

#: the loggers INC (and transformers, which it imports) give stream handlers of their own
INC_LOGGERS = ("onnx_neural_compressor", "transformers")
#: module globals the plugin changes during a call (the tuning loop's quantize step is wrapped)
INC_GLOBALS = (("onnx_neural_compressor.quantization.tuning", "_quantize"),)
#: imported once, under containment, before the first call
INC_MODULES = (
    "onnx_neural_compressor.quantization.algorithm_entry",
    "onnx_neural_compressor.quantization.config",
    "onnx_neural_compressor.quantization.tuning",
)

_lock = threading.RLock()
_imported = False


def _scratch_tempdir(folder: Path) -> Any:
    """A hook: ``tempfile``'s default folder is ``folder`` during the call (INC's scratch models)."""

    @contextmanager
    def hook(_relay: Relay) -> Iterator[None]:
        saved = tempfile.tempdir
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.tempdir = str(folder)
        try:
            yield
        finally:
            tempfile.tempdir = saved

    return hook


@contextmanager
def _inc_logger_level(_relay: Relay) -> Iterator[None]:
    """INC's logger at INFO during the call, so its records reach the relay whatever the root's level."""
    logger = logging.getLogger("onnx_neural_compressor")
    saved = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.setLevel(saved)


def contained(folder: Path) -> AbstractContextManager[ToolMessages]:
    """The host's containment with INC's loggers, globals, and scratch files under ``folder/tmp``."""
    return host_contained(
        folder,
        relay=inc_log,
        loggers=INC_LOGGERS,
        module_globals=INC_GLOBALS,
        hooks=(_scratch_tempdir(Path(folder) / "tmp"), _inc_logger_level),
    )


@contextmanager
def no_exit(what: str, messages: ToolMessages) -> Iterator[None]:
    """Turn INC's ``exit(0)`` into a QuantizationError with the last thing INC said."""
    try:
        yield
    except SystemExit as exc:
        said = [m for _level, m in messages.records if m.strip()]
        reason = said[-1] if said else "no message"
        raise QuantizationError(f"Intel Neural Compressor {what} stopped (exit({exc.code})): {reason}") from None


def import_inc() -> ModuleType:
    """Import INC's quantization modules under containment, once per process."""
    global _imported
    with _lock:
        if not _imported:
            with tempfile.TemporaryDirectory(prefix="bitpress-inc-import-") as tmp:
                # ONNX Runtime's quantization tools configure logging when first imported: here, contained
                import_contained(Path(tmp), ("onnxruntime.quantization", *INC_MODULES), relay=inc_log,
                                 loggers=INC_LOGGERS)
            _imported = True
        import onnx_neural_compressor.quantization as quantization

        return quantization


__all__ = ["INC_LOGGERS", "contained", "import_inc", "inc_log", "no_exit"]
