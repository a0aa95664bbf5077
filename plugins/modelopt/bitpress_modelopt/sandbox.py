"""Run NVIDIA ModelOpt without letting its side effects reach the caller's process or folders.

What ``nvidia-modelopt`` 0.47.0 (ONNX path, CPU, torch 2.13 CPU, onnxruntime 1.32) does to the
process that calls it, as measured here:

* ``import modelopt.onnx.quantization`` imports torch (some 2000 modules), adds warning filters
  (torch's, sympy's) and appends ``onnxruntime/transformers`` to ``sys.path`` (ONNX Runtime's
  transformer tools import their siblings as top-level modules). Its logging set-up gives the
  ``modelopt.onnx`` logger a handler on the *current* ``sys.stdout`` with ``propagate=True``: every
  INFO line is printed on stdout and also reaches the caller's root handlers.
* Every ``quantize()`` call runs that set-up again (``configure_logging``, imported by name into
  ``quantize``, ``int4``, ``int8`` and ``fp8``), so the handler and ``propagate=True`` come back.
* int4: ``patch_gs_modules()`` replaces ``OnnxExporter.export_tensor_proto`` /
  ``export_value_info_proto`` of onnx-graphsurgeon and adds ``gs.make_constant`` /
  ``gs.make_variable``, for the whole process.
* int8: ``configure_ort()`` patches ONNX Runtime's quantization tool for the whole process:
  ``CalibraterBase.__init__`` / ``create_inference_session`` / ``select_tensors_to_calibrate``,
  ``MinMaxCalibrater``, ``HistogramCalibrater`` and ``HistogramCollector`` methods,
  ``calibrate.create_calibrator``, ``QDQQuantizer.check_opset_version``,
  ``BaseQuantizer.adjust_tensor_ranges``; it deletes some 20 op types (Gather, Softmax,
  Reshape...) from ``QDQRegistry`` / ``QLinearOpsRegistry``. A later ``quantize_static`` of ONNX
  Runtime in the same process would run ModelOpt's code and quantize fewer op types.
* Progress bars (tqdm) on stderr. tqdm 4.66+ reads ``TQDM_*`` variables when it is imported, so
  ``TQDM_DISABLE`` set later (the host's containment sets it) does not stop them, and tqdm first
  imported *under* that setting keeps every bar of the process off; ONNX Runtime's entropy
  calibrator ``print()``\\ s its progress.
* AWQ and int8 write the model again, with extra outputs (a full copy), into the *system* temporary
  folder (``tempfile.mkstemp``), not beside the input.
* The first int4 export JIT-builds ModelOpt's packing extension with cppimport (some 10 s) into
  ModelOpt's own ``modelopt/onnx/quantization/src`` folder; that imports setuptools, which appends
  ``setuptools/_vendor`` to ``sys.path``.
* Nothing measured in ``os.environ``, the working directory or the random states (the host's
  containment restores them anyway).

:func:`contained` undoes or prevents each of these for the duration of a call; the call runs
inside :func:`bitpress.toolkit.containment.contained` (working directory, root logger, warnings,
environment, ``sys.path``, streams, random states).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy

from bitpress.plugin import Relay, ToolMessages
from bitpress.plugin import contained as host_contained

log = logging.getLogger(__name__)
#: ModelOpt's messages are re-emitted here (its INFO at DEBUG, WARNING at INFO, ERROR at WARNING)
modelopt_log = logging.getLogger("bitpress_modelopt.modelopt")

#: what ModelOpt says on every CPU-only machine (it looks for NVIDIA GPUs and cupy): kept at DEBUG
EXPECTED_ON_CPU = ("Failed to get GPU count", "Using slower INT4 ONNX quantization using numpy")
#: the loggers ModelOpt and what it drives log on: its own (``modelopt.onnx`` and children), and
#: cppimport and what it uses (``compilers.C.base`` logs each g++ command line at INFO, filelock its locks)
LOGGERS = ("modelopt", "cppimport", "compilers", "distutils", "setuptools", "filelock")
MODELOPT_LOGGER = "modelopt.onnx"
#: packages whose module and class attributes ModelOpt patches during a call: put back after it
PATCHED_PACKAGES = ("onnxruntime.quantization", "onnx_graphsurgeon")
#: what the import step imports: the API, the modules patched above, and the int4 extension
#: (its first import JIT-builds the packing library: better once, here, than in a call)
IMPORTS = (
    "onnxruntime.quantization", "onnxruntime.quantization.calibrate", "onnx_graphsurgeon",
    "modelopt.onnx.quantization", "modelopt.onnx.quantization.int4", "modelopt.onnx.quantization.int8",
    "modelopt.onnx.quantization.extensions",
)


class _ExpectedOnCpu(logging.Filter):
    """Relayed messages that only say there is no NVIDIA GPU here go to DEBUG (ModelOpt logs the GPU
    count probe as an ERROR on every int8 calibration)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and any(text in record.getMessage() for text in EXPECTED_ON_CPU):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


modelopt_log.addFilter(_ExpectedOnCpu())

# one ModelOpt call (or import) at a time: the patches below are process-wide
_lock = threading.RLock()
#: sys.path entries ModelOpt's import added; put back for each call (lazy imports need them)
_modelopt_sys_path: list[str] = []
_imported = False


# -- the pieces ---------------------------------------------------------------------------------------
class _Detached(logging.Logger):
    """A logger whose records never propagate, whatever ``propagate`` is set to meanwhile."""

    @property  # type: ignore[override]
    def propagate(self) -> bool:
        return False

    @propagate.setter
    def propagate(self, value: bool) -> None:
        pass  # ModelOpt's configure_logging sets True after every (diverted) addHandler


@contextmanager
def detached_loggers(relay: Relay) -> Iterator[None]:
    """ModelOpt's ``modelopt.onnx`` logger keeps ``propagate`` off during the call.

    The host diverts its handlers to the relay, but ModelOpt's ``configure_logging`` (at import
    and in every ``quantize()``) then sets ``propagate=True``: each record would also go up to the
    ``modelopt`` logger (diverted as well: relayed twice) and, were that one not a diverted logger,
    to the caller's root handlers, undemoted. :func:`contained` creates the logger before the
    host's containment saves the loggers' settings (they are put back as they were).
    """
    logger = logging.getLogger(MODELOPT_LOGGER)
    original = logger.__class__
    logger.__class__ = _Detached
    try:
        yield
    finally:
        logger.__class__ = original


@contextmanager
def silent_tqdm(relay: Relay) -> Iterator[None]:
    """Every tqdm bar created during the call is disabled (``TQDM_DISABLE`` is read at import)."""
    std = sys.modules.get("tqdm.std")
    if std is None:
        yield
        return
    cls = std.tqdm
    original = cls.__dict__["__init__"]
    init = cls.__init__

    def quiet_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        init(self, *args, **kwargs)

    cls.__init__ = quiet_init
    try:
        yield
    finally:
        cls.__init__ = original


class _PackageState:
    """Module and class attributes of the loaded modules of some packages, to put back later.

    For each module: its attributes (values replaced or added are put back or removed; a
    submodule imported meanwhile is kept), the contents of its module-level dicts (registries),
    and the ``__dict__`` of every class it defines.
    """

    def __init__(self, prefixes: Sequence[str]) -> None:
        self.prefixes = tuple(prefixes)
        self.modules: list[tuple[types.ModuleType, dict[str, Any]]] = []
        self.dicts: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
        self.classes: list[tuple[type, dict[str, Any]]] = []
        seen_dicts: set[int] = set()
        seen_classes: set[int] = set()
        for name, module in list(sys.modules.items()):
            if not isinstance(module, types.ModuleType) or not self._ours(name):
                continue
            attrs = dict(vars(module))
            self.modules.append((module, attrs))
            for key, value in attrs.items():
                if key.startswith("__"):
                    continue
                if type(value) is dict and id(value) not in seen_dicts:
                    seen_dicts.add(id(value))
                    self.dicts.append((value, dict(value)))
                elif isinstance(value, type) and id(value) not in seen_classes and self._ours(value.__module__):
                    seen_classes.add(id(value))
                    self.classes.append((value, dict(vars(value))))

    def _ours(self, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in self.prefixes)

    def changes(self) -> list[str]:
        """What differs from the snapshot, as ``module.attr`` / ``Class.attr`` (for tests and logs)."""
        out = []
        for module, attrs in self.modules:
            now = vars(module)
            out += [f"{module.__name__}.{k}" for k in now.keys() - attrs.keys()
                    if not isinstance(now[k], types.ModuleType)]
            out += [f"{module.__name__}.{k}" for k, v in attrs.items() if k in now and now[k] is not v]
        for d, items in self.dicts:
            if d.keys() != items.keys() or any(d[k] is not v for k, v in items.items()):
                out.append(f"dict of {len(items)} entries")
        for cls, attrs in self.classes:
            now, where = vars(cls), f"{cls.__module__}.{cls.__qualname__}"
            out += [f"{where}.{k}" for k in set(now) ^ set(attrs)]
            out += [f"{where}.{k}" for k, v in attrs.items() if k in now and now[k] is not v]
        return sorted(out)

    def restore(self) -> None:
        for module, attrs in self.modules:
            now = vars(module)
            for key in [k for k in now if k not in attrs and not isinstance(now[k], types.ModuleType)]:
                delattr(module, key)
            for key, value in attrs.items():
                if now.get(key, _MISSING) is not value:
                    setattr(module, key, value)
        for d, items in self.dicts:
            if d.keys() != items.keys() or any(d[k] is not v for k, v in items.items()):
                d.clear()
                d.update(items)
        for cls, attrs in self.classes:
            now = dict(vars(cls))
            for key in [k for k in now if k not in attrs]:
                delattr(cls, key)
            for key, value in attrs.items():
                if key not in ("__dict__", "__weakref__") and now.get(key, _MISSING) is not value:
                    setattr(cls, key, value)


_MISSING = object()


def restored_packages(prefixes: Sequence[str] = PATCHED_PACKAGES) -> Callable[[Relay], Any]:
    """A containment hook: ModelOpt's patches of ONNX Runtime and onnx-graphsurgeon undone on exit."""

    @contextmanager
    def hook(relay: Relay) -> Iterator[_PackageState]:
        state = _PackageState(prefixes)
        try:
            yield state
        finally:
            changed = state.changes()
            if changed:
                modelopt_log.debug("undoing ModelOpt's patches of %s", ", ".join(changed))
            state.restore()

    return hook


class _HostArray(numpy.ndarray):
    """A numpy array that also answers cupy's ``.get()`` (a copy to the host: here, itself)."""

    def get(self) -> numpy.ndarray:
        return numpy.asarray(self)


class _NumpyForCupy(types.ModuleType):
    """numpy, with ``asarray`` giving :class:`_HostArray`: what ModelOpt's int4 code calls ``np``."""

    def __init__(self) -> None:
        super().__init__("numpy")

    def __getattr__(self, name: str) -> Any:
        return getattr(numpy, name)

    @staticmethod
    def asarray(*args: Any, **kwargs: Any) -> numpy.ndarray:
        return numpy.asarray(*args, **kwargs).view(_HostArray)


#: the module global the AWQ fix replaces (put back by the host's containment)
INT4_NUMPY = ("modelopt.onnx.quantization.int4", "np")


@contextmanager
def awq_fusion_on_cpu(relay: Relay) -> Iterator[bool]:
    """Make awq_lite's scale fusion run without cupy; yields whether the fix was applied.

    ModelOpt 0.47.0 imports cupy as ``np`` in ``int4.py`` when CUDA is there, numpy otherwise;
    folding AWQ's pre-quant scales into the preceding Mul / LayerNorm weights (``awqlite_fuse_nodes``,
    its default) then calls ``.get()`` (cupy's device-to-host copy) on the result, which numpy
    arrays lack: ``AttributeError: 'numpy.ndarray' object has no attribute 'get'``. During the call
    ``int4.np`` is numpy whose ``asarray`` returns arrays that also have ``.get()``; nothing else
    changes (the arrays are numpy arrays, the arithmetic is numpy's).
    """
    module = sys.modules.get(INT4_NUMPY[0])
    applied = module is not None and not getattr(module, "has_cupy", True) and module.np is numpy
    if applied:
        module.np = _NumpyForCupy()
    yield applied  # put back by the host's containment (module_globals=INT4_NUMPY)


@contextmanager
def temp_dir(folder: Path) -> Iterator[None]:
    """``tempfile``'s folder is ``folder`` during the call (ModelOpt's model copies go there)."""
    folder.mkdir(parents=True, exist_ok=True)
    tempfile.tempdir = str(folder)  # put back by the host's containment (module_globals)
    yield


# -- the whole containment -----------------------------------------------------------------------------
@contextmanager
def contained(folder: Path, *, capture_stdout: bool = True, awq_fix: bool = True) -> Iterator[ToolMessages]:
    """Run the body (ModelOpt calls) with its side effects confined; yields ModelOpt's messages.

    The host's containment (working directory ``folder/cwd``, root logger, warnings, environment,
    ``sys.path``, streams, random states) plus, for ModelOpt: its loggers feed
    ``bitpress_modelopt.modelopt`` and never the caller's handlers; tqdm bars are off; the system
    temporary folder is ``folder/tmp``; ModelOpt's patches of ONNX Runtime's quantization tool and of
    onnx-graphsurgeon are undone on exit; the ``sys.path`` entries its import added are there for
    its lazy imports; ``awq_fix``: :func:`awq_fusion_on_cpu`.
    """
    hooks: list[Callable[[Relay], Any]] = [detached_loggers, silent_tqdm, restored_packages()]
    for name in (*LOGGERS, MODELOPT_LOGGER):
        # the host diverts (and afterwards restores) the loggers that exist when the call starts, or
        # get a handler during it: children created meanwhile (cppimport.checksum...) then stop at
        # these instead of reaching the root handlers; modelopt.onnx is saved before it is detached
        logging.getLogger(name)
    if awq_fix:
        hooks.append(awq_fusion_on_cpu)
    with _lock, host_contained(
        folder, relay=modelopt_log, loggers=LOGGERS, capture_stdout=capture_stdout,
        module_globals=(("tempfile", "tempdir"), INT4_NUMPY), hooks=hooks,
    ) as messages, temp_dir(Path(folder) / "tmp"):
        for entry in _modelopt_sys_path:
            if entry not in sys.path:
                sys.path.append(entry)
        yield messages


def import_modelopt() -> types.ModuleType:
    """``import modelopt.onnx.quantization`` inside :func:`contained`; returns that module."""
    global _imported
    with _lock:
        if _imported:
            return sys.modules["modelopt.onnx.quantization"]
        import importlib

        # tqdm reads TQDM_* when first imported: imported under the containment (which sets
        # TQDM_DISABLE=1) it would keep every later bar of this process off; silent_tqdm quiets
        # ModelOpt's bars instead, during its calls only
        importlib.import_module("tqdm")
        before = list(sys.path)
        t0 = time.perf_counter()
        with (
            tempfile.TemporaryDirectory(prefix="bitpress-modelopt-import-") as tmp,
            # no stdout capture: ModelOpt's logging set-up keeps the sys.stdout of import time
            contained(Path(tmp), capture_stdout=False, awq_fix=False),
        ):
            for name in IMPORTS:
                importlib.import_module(name)
            added = [p for p in sys.path if p not in before]
        _modelopt_sys_path.extend(p for p in added if p not in _modelopt_sys_path)
        log.debug("imported modelopt.onnx.quantization in %.1f s", time.perf_counter() - t0)
        _imported = True
        return sys.modules["modelopt.onnx.quantization"]


__all__ = ["contained", "import_modelopt", "modelopt_log", "restored_packages"]
