"""Run AMD Quark without letting its side effects reach the caller's process or folders.

What ``amd-quark`` 0.13 (with torch 2.13 CPU) does to its host process, as measured here:

* ``import quark.onnx`` calls ``logging.basicConfig(level=INFO, force=True)``: it closes and
  removes every root handler and sets the root level to INFO. ONNX Runtime's
  ``matmul_nbits_quantizer``, which Quark imports, calls ``logging.basicConfig`` too.
* Quark's own loggers (``<module>_screen``) print coloured text to stderr through handlers of
  their own; its calibrators draw tqdm bars on stderr. ONNX Runtime's quantization code, which
  it drives, logs a warning on the root logger for every tensor it skips and its histogram
  calibrators ``print()`` to stdout.
* ``ModelQuantizer(...)`` runs ``warnings.simplefilter("ignore", UserWarning)`` (and
  ResourceWarning) for the whole process; importing torch adds warning filters as well.
* Static quantization appends ``quantized_info.csv`` to the *working directory*.
* The ``TmpDir`` option sets a module global (``quark.onnx.utils.system_utils.TMP_DIR``) that
  outlives the call: a later Quark call would recreate that folder.
* The import appends ``onnxruntime/transformers`` and ``setuptools/_vendor`` to ``sys.path``
  and (through joblib) sets ``KMP_INIT_AT_FORK=FALSE`` in ``os.environ``.
* The first import JIT-compiles a C++ library (``quark_custom_ops_stable_abi``, about 12 s on
  2 cores) into torch's extension folder, ``~/.cache/torch_extensions`` unless
  ``TORCH_EXTENSIONS_DIR`` says otherwise.

:func:`contained` undoes or prevents each of these for the duration of a Quark call.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from bitpress.plugin import ToolMessages
from bitpress.plugin import contained as host_contained

log = logging.getLogger(__name__)
#: Quark's own messages are re-emitted here (its INFO at DEBUG, WARNING at INFO, ERROR at WARNING)
quark_log = logging.getLogger("bitpress_quark.quark")

# one Quark call (or import) at a time: the sys.path bookkeeping below is process-wide
_lock = threading.RLock()
#: sys.path entries Quark's import added; put back for each later call (lazy imports need them)
_quark_sys_path: list[str] = []
#: the Quark packages imported under containment (quark.onnx, quark.torch)
_imported: set[str] = set()


def extensions_dir() -> Path | None:
    """Where Quark's JIT-compiled C++ library is built and cached.

    ``TORCH_EXTENSIONS_DIR`` when the user set it; else a folder inside this Python
    environment (``<sys.prefix>/var/bitpress-quark/torch_extensions``), so the build lives and
    dies with the environment instead of landing in the home folder. ``None`` (torch's default,
    ``~/.cache/torch_extensions``) when the environment is not writable.
    """
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    prefix = Path(sys.prefix)
    if os.access(prefix, os.W_OK):
        return prefix / "var" / "bitpress-quark" / "torch_extensions"
    return None


#: Quark's messages, as the host's containment collects them
QuarkMessages = ToolMessages


class _ScreenLoggers:
    """Diverts Quark's ``ScreenLogger`` loggers, existing and created meanwhile, to the relay."""

    def __init__(self, relay: logging.Handler) -> None:
        self.relay = relay
        self.saved: dict[logging.Logger, list[logging.Handler]] = {}
        self.cls: Any = None
        self.original_init: Any = None

    def divert(self, logger: logging.Logger) -> None:
        mine = [h for h in logger.handlers if h is not self.relay]
        self.saved.setdefault(logger, []).extend(mine)
        logger.handlers = [self.relay]

    def __enter__(self) -> _ScreenLoggers:
        # quark.common.utils.log imports only logging and os: importing it here is cheap and safe
        from quark.common.utils import log as qlog

        self.cls = qlog.ScreenLogger
        for instance in list(self.cls._instances):
            self.divert(instance.logger)
        self.original_init = original = self.cls.__init__
        divert = self.divert

        def init(instance: Any, name: str) -> None:
            original(instance, name)
            divert(instance.logger)

        self.cls.__init__ = init
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cls is not None:
            self.cls.__init__ = self.original_init
        for logger, handlers in self.saved.items():
            logger.handlers = handlers


@contextmanager
def contained(folder: Path, *, capture_stdout: bool = True) -> Iterator[QuarkMessages]:
    """Run the body (Quark calls) with its side effects confined; yields Quark's messages.

    The host's :func:`bitpress.toolkit.containment.contained` (working directory
    ``folder/cwd``, logging, warnings, environment, ``sys.path``, streams, random states), plus
    for Quark: its ``ScreenLogger`` loggers feed ``bitpress_quark.quark``; torch builds
    extensions in :func:`extensions_dir`; the ``sys.path`` entries Quark's import added are
    there for its lazy imports; Quark's ``TMP_DIR`` global is put back.
    """
    environ = {}
    ext_dir = extensions_dir()
    if ext_dir is not None and not os.environ.get("TORCH_EXTENSIONS_DIR"):
        environ["TORCH_EXTENSIONS_DIR"] = str(ext_dir)
    with _lock:
        saved_path = list(sys.path)
        try:
            for entry in _quark_sys_path:
                if entry not in sys.path:
                    sys.path.append(entry)
            with host_contained(
                folder, relay=quark_log, capture_stdout=capture_stdout, environ=environ,
                module_globals=(("quark.onnx.utils.system_utils", "TMP_DIR"),), hooks=(_ScreenLoggers,),
            ) as messages:
                yield messages
        finally:
            sys.path[:] = saved_path


def import_quark() -> ModuleType:
    """``import quark.onnx`` inside :func:`contained` (the first time compiles its C++ library)."""
    # the ONNX Runtime module configures logging when first imported: imported here, under containment, rather
    # than in the middle of a later call
    return _import("quark.onnx", ("onnxruntime.quantization.matmul_nbits_quantizer", "quark.onnx",
                                  "quark.onnx.quantizers.matmul_nbits_quantizer"))


def import_quark_torch() -> ModuleType:
    """``import quark.torch`` inside :func:`contained` (the first time compiles its hw_emulation library)."""
    return _import("quark.torch", ("quark.torch",))


def _import(name: str, modules: tuple[str, ...]) -> ModuleType:
    import importlib

    with _lock:
        if name in _imported:
            return sys.modules[name]
        before = list(sys.path)
        t0 = time.perf_counter()
        with (
            tempfile.TemporaryDirectory(prefix="bitpress-quark-import-") as tmp,
            # no stdout capture: a module that keeps sys.stdout at import would keep our stand-in
            contained(Path(tmp), capture_stdout=False) as messages,
        ):
            for module in modules:
                importlib.import_module(module)
            added = [p for p in sys.path if p not in before]
        _quark_sys_path.extend(p for p in added if p not in _quark_sys_path)
        seconds = time.perf_counter() - t0
        where = extensions_dir() or Path("~/.cache/torch_extensions")
        if messages.matching("Compiling stable ABI custom ops") or seconds > 5:
            # Quark says so on every import; only a slow import means it really compiled
            log.log(logging.INFO if seconds > 5 else logging.DEBUG,
                    "imported %s in %.1f s (C++ extensions built or found in %s)", name, seconds, where)
        _imported.add(name)
        return sys.modules[name]


__all__ = ["QuarkMessages", "contained", "extensions_dir", "import_quark", "import_quark_torch", "quark_log"]
