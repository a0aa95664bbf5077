"""Run AIMET without letting its side effects reach the caller's process or folders.

What ``aimet-onnx`` 2.42 (torch 2.13 CPU) does to its host process, as measured here
(``tests/plugins/test_aimet.py`` has a test for each):

* ``import aimet_onnx`` runs ``logging.config.dictConfig`` on its bundled config, which first
  *closes every logging handler of the process* (``logging.config._clearExistingHandlers``):
  a caller's ``FileHandler(mode="w")`` writes nothing afterwards.
* That config gives AIMET's 19 area loggers (``Quant``, ``Utils``, ``SeqMse``, ``Test`` ...,
  names of AimetLogger.LogAreas) a handler that writes to the process's *stdout* (bound at
  import, so redirecting ``sys.stdout`` later does not catch it): a line per layer and per
  weight-scale adjustment, which would corrupt ``bitpress quantize --json``.
* SeqMSE and AdaRound draw tqdm bars on stderr and start tqdm's ``tqdm_monitor`` thread,
  which outlives the call; ``TQDM_DISABLE`` cannot stop them once tqdm is imported (tqdm reads
  it at import), and even a disabled tqdm starts the thread, so their ``progress_bar`` is
  replaced by a plain iterator for the call.
* SeqMSE writes the whole model, AdaRound its cached calibration data, and QuantSim its
  session model (when given no ``path``) into the *system* temporary folder (``tempfile``),
  not the run's work folder: with large models that fills ``/tmp``.
* SeqMSE draws from (reseeds) NumPy's global random state; AdaRound sets
  ``TORCHINDUCTOR_CACHE_DIR`` in ``os.environ``; the import sets ``KMP_DUPLICATE_LIB_OK``
  and ``KMP_INIT_AT_FORK`` (scikit-learn, joblib) and appends ``onnxruntime/transformers`` to
  ``sys.path``; it adds 11 warning filters; torch and AIMET warn (``UserWarning``) on stderr.
* torch's intra-op thread count is process-wide: AdaRound runs with :func:`torch_threads`
  (``--jobs``), restored after (with two threads on two busy cores AdaRound ran 8x slower
  than with one: OpenMP spin-waits).

:func:`contained` prevents or undoes each of these for the duration of an AIMET call, on top of
the host's :func:`bitpress.toolkit.containment.contained`.
"""

from __future__ import annotations

import logging
import logging.config
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from bitpress.plugin import Relay, ToolMessages, import_contained
from bitpress.plugin import contained as host_contained

log = logging.getLogger(__name__)
#: AIMET's own messages are re-emitted here (its INFO at DEBUG, WARNING at INFO, ERROR at WARNING)
aimet_log = logging.getLogger("bitpress_aimet.aimet")

#: AimetLogger.LogAreas of aimet-onnx 2.42: the loggers its logging config sets up
AIMET_LOGGERS = (
    "Quant", "Svd", "Test", "Utils", "CompRatioSelect", "ChannelPruning", "Winnow", "ConnectedGraph",
    "CrossLayerEqualization", "MixedPrecision", "BatchNormFolding", "ModelPreparer", "LayerOutputs",
    "QuantAnalyzer", "SeqMse", "AdaScale", "FPTQuant", "SpinQuant", "LlmTopology",
)
#: modules that import ``progress_bar`` by name (tqdm bars on stderr, a monitor thread)
PROGRESS_MODULES = ("aimet_onnx.adaround.adaround_weight", "aimet_onnx.sequential_mse.seq_mse")
#: what the call sets that must not outlive it
MODULE_GLOBALS = (("tempfile", "tempdir"), *((m, "progress_bar") for m in PROGRESS_MODULES))

_lock = threading.RLock()
_imported = False


class _QuietBar:
    """Stands in for ``progress_bar(iterable, desc=...)``: iterates, draws nothing.

    Not a disabled tqdm: any tqdm instance, disabled or not, starts tqdm's monitor thread.
    """

    def __init__(self, iterable: Any = None, *args: Any, **kwargs: Any) -> None:
        self.iterable = iterable if iterable is not None else ()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)

    def __len__(self) -> int:
        return len(self.iterable)

    def __enter__(self) -> _QuietBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, name: str) -> Any:  # update(), set_postfix(), close() ...: no-ops
        return lambda *a, **k: None


@contextmanager
def _keep_handlers(relay: Relay) -> Iterator[None]:
    """``logging.config.dictConfig`` without closing the process's handlers first."""
    original = getattr(logging.config, "_clearExistingHandlers", None)
    if original is None:  # a Python without it: nothing to prevent
        yield
        return

    def keep() -> None:
        log.debug("kept the process's logging handlers that AIMET's logging.config.dictConfig would close")

    logging.config._clearExistingHandlers = keep  # type: ignore[attr-defined]
    try:
        yield
    finally:
        logging.config._clearExistingHandlers = original  # type: ignore[attr-defined]


def _silent_progress() -> None:
    for name in PROGRESS_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "progress_bar"):
            module.progress_bar = _QuietBar  # type: ignore[attr-defined]


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for the body, put back after."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, count))
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextmanager
def contained(folder: Path, *, capture_stdout: bool = True) -> Iterator[ToolMessages]:
    """Run the body (AIMET calls) with its side effects confined; yields AIMET's messages.

    On top of the host's containment (working directory ``folder/cwd``, logging, warnings,
    environment, ``sys.path``, streams, random states): AIMET's loggers feed
    ``bitpress_aimet.aimet``; ``dictConfig`` closes no handler; ``tempfile`` puts temporary
    files in ``folder/tmp``; SeqMSE's and AdaRound's progress bars are off.
    """
    tmp = Path(folder) / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    with (
        _lock,
        host_contained(
            folder, relay=aimet_log, loggers=AIMET_LOGGERS, capture_stdout=capture_stdout,
            module_globals=MODULE_GLOBALS, environ={"TMPDIR": str(tmp)}, hooks=(_keep_handlers,),
        ) as messages,
    ):
        tempfile.tempdir = str(tmp)
        _silent_progress()
        yield messages


def import_aimet(folder: Path) -> ModuleType:
    """``import aimet_onnx`` (and the modules the pass uses) under containment, once per process.

    ``folder`` (a scratch folder of the run) is the import's working directory.
    """
    global _imported
    with _lock:
        if not _imported:
            import_contained(
                Path(folder) / "import", ["aimet_onnx", "aimet_onnx.quantsim", *PROGRESS_MODULES], relay=aimet_log,
                loggers=AIMET_LOGGERS, hooks=(_keep_handlers,),
            )
            _imported = True
        return sys.modules["aimet_onnx"]


__all__ = ["AIMET_LOGGERS", "aimet_log", "contained", "import_aimet", "torch_threads"]
