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

import io
import logging
import os
import random
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)
#: Quark's own messages are re-emitted here (its INFO at DEBUG, WARNING at INFO, ERROR at WARNING)
quark_log = logging.getLogger("bitpress_quark.quark")

# chdir, os.environ and the logging patch are process-wide: one Quark call at a time
_lock = threading.RLock()
#: sys.path entries Quark's import added; put back for each later call (lazy imports need them)
_quark_sys_path: list[str] = []
_imported = False


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


@dataclass
class QuarkMessages:
    """Quark's log records from one contained call, as (level, text)."""

    records: list[tuple[int, str]] = field(default_factory=list)

    def matching(self, text: str) -> list[str]:
        return [m for _, m in self.records if text in m]

    def errors(self) -> list[str]:
        return [m for level, m in self.records if level >= logging.ERROR]


class _Relay(logging.Handler):
    """Takes the place of the handlers of Quark's ``*_screen`` loggers while a call runs."""

    def __init__(self, messages: QuarkMessages) -> None:
        super().__init__(logging.DEBUG)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage().strip()
        except Exception:  # a malformed Quark message must not break the quantization
            text = str(record.msg).strip()
        self.messages.records.append((record.levelno, text))
        quark_log.log(_demoted(record.levelno), "%s", text)

    def filter(self, record: logging.LogRecord) -> bool:
        """As a filter on the root logger: take records logged on it directly, pass the rest.

        ONNX Runtime's quantizer, which Quark drives, calls ``logging.warning(...)`` (the root
        logger) for every tensor it skips; those reach the caller's handlers demoted like
        Quark's own messages. Records propagated from named loggers never meet this filter.
        """
        if record.name == "root":
            self.emit(record)
            return False
        return True


def _demoted(level: int) -> int:
    """Quark's ERROR is our WARNING, its WARNING our INFO, the rest DEBUG: it is chatty."""
    if level >= logging.ERROR:
        return logging.WARNING
    if level >= logging.WARNING:
        return logging.INFO
    return logging.DEBUG


class _PrintedLines(io.TextIOBase):
    """``sys.stdout`` during a call: ONNX Runtime's calibrators ``print()`` their progress."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        for line in lines:
            if line.strip():
                quark_log.debug("(printed) %s", line.rstrip())
        return len(text)

    def flush(self) -> None:
        if self._pending.strip():
            quark_log.debug("(printed) %s", self._pending.rstrip())
        self._pending = ""


def _ignored_basic_config(*args: Any, **kwargs: Any) -> None:
    log.debug("ignored logging.basicConfig(%s) called by Quark or a library it imports", kwargs or args)


class _ScreenLoggers:
    """Diverts Quark's ``ScreenLogger`` loggers, existing and created meanwhile, to a relay."""

    def __init__(self, relay: _Relay) -> None:
        self.relay = relay
        self.saved: dict[logging.Logger, list[logging.Handler]] = {}
        self.cls: Any = None
        self.original_init: Any = None

    def divert(self, logger: logging.Logger) -> None:
        mine = [h for h in logger.handlers if h is not self.relay]
        self.saved.setdefault(logger, []).extend(mine)
        logger.handlers = [self.relay]

    def start(self) -> None:
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

    def stop(self) -> None:
        if self.cls is not None:
            self.cls.__init__ = self.original_init
        for logger, handlers in self.saved.items():
            logger.handlers = handlers


@contextmanager
def contained(folder: Path, *, capture_stdout: bool = True) -> Iterator[QuarkMessages]:
    """Run the body (Quark calls) with its side effects confined; yields Quark's messages.

    Inside: the working directory is ``folder/cwd``; ``logging.basicConfig`` is a no-op; Quark's
    loggers, records logged on the root logger itself and lines printed to ``sys.stdout`` feed
    ``bitpress_quark.quark``; warnings are recorded and logged at DEBUG; tqdm is
    off (``TQDM_DISABLE``); torch builds extensions in :func:`extensions_dir`. On exit the
    working directory, root logger, logging module settings, warning filters, environment,
    ``sys.path``, standard streams, random states and Quark's ``TMP_DIR`` are put back.

    ``logging.basicConfig``, ``sys.stdout`` and the working directory are process-wide: another
    thread that uses them while Quark runs sees the stand-ins.
    """
    with _lock:
        cwd = Path(folder) / "cwd"
        cwd.mkdir(parents=True, exist_ok=True)
        messages = QuarkMessages()
        relay = _Relay(messages)
        screens = _ScreenLoggers(relay)

        saved_cwd = os.getcwd()
        root = logging.getLogger()
        saved_root = (list(root.handlers), root.level, list(root.filters), root.disabled, root.propagate)
        saved_logging = (logging.basicConfig, logging.root.manager.disable, logging.raiseExceptions,
                         logging.lastResort, logging.getLoggerClass(), logging.getLogRecordFactory())
        saved_env = dict(os.environ)
        saved_path = list(sys.path)
        saved_streams = (sys.stdout, sys.stderr, sys.stdin)
        saved_random = random.getstate()
        np = sys.modules.get("numpy")
        saved_np_random = np.random.get_state() if np is not None else None
        system_utils = sys.modules.get("quark.onnx.utils.system_utils")
        saved_tmp_dir = getattr(system_utils, "TMP_DIR", None)

        catcher = warnings.catch_warnings(record=True)
        caught = catcher.__enter__()
        try:
            warnings.simplefilter("always")
            logging.basicConfig = _ignored_basic_config  # type: ignore[assignment]
            os.environ["TQDM_DISABLE"] = "1"
            ext_dir = extensions_dir()
            if ext_dir is not None and not os.environ.get("TORCH_EXTENSIONS_DIR"):
                os.environ["TORCH_EXTENSIONS_DIR"] = str(ext_dir)
            for entry in _quark_sys_path:
                if entry not in sys.path:
                    sys.path.append(entry)
            os.chdir(cwd)
            root.addFilter(relay)
            screens.start()
            if capture_stdout:
                sys.stdout = _PrintedLines()
            yield messages
        finally:
            if sys.stdout is not saved_streams[0]:
                sys.stdout.flush()
            screens.stop()
            try:
                os.chdir(saved_cwd)
            except OSError:  # the caller's folder vanished meanwhile: not Quark's doing
                log.warning("could not return to %s after running Quark", saved_cwd)
            # warnings first: leaving catch_warnings restores filters and showwarning
            catcher.__exit__(None, None, None)
            for w in caught:
                log.debug("warning during Quark call: %s: %s", w.category.__name__, w.message)
            (logging.basicConfig, logging.root.manager.disable, logging.raiseExceptions,
             logging.lastResort, klass, factory) = saved_logging
            logging.setLoggerClass(klass)
            logging.setLogRecordFactory(factory)
            handlers, level, filters, disabled, propagate = saved_root
            for h in root.handlers:
                if h not in handlers:  # what a library added: close it, it never saw a record of ours
                    h.close()
            root.handlers[:] = handlers
            root.setLevel(level)
            root.filters[:] = filters
            root.disabled, root.propagate = disabled, propagate
            _restore_environ(saved_env)
            sys.path[:] = saved_path
            sys.stdout, sys.stderr, sys.stdin = saved_streams
            random.setstate(saved_random)
            if saved_np_random is not None:
                np.random.set_state(saved_np_random)
            system_utils = sys.modules.get("quark.onnx.utils.system_utils")
            if system_utils is not None:
                system_utils.TMP_DIR = saved_tmp_dir


def _restore_environ(saved: dict[str, str]) -> None:
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def import_quark() -> ModuleType:
    """``import quark.onnx`` inside :func:`contained` (the first time compiles its C++ library)."""
    global _imported
    with _lock:
        if _imported:
            return sys.modules["quark.onnx"]
        before = list(sys.path)
        t0 = time.perf_counter()
        with (
            tempfile.TemporaryDirectory(prefix="bitpress-quark-import-") as tmp,
            # no stdout capture: a module that keeps sys.stdout at import would keep our stand-in
            contained(Path(tmp), capture_stdout=False) as messages,
        ):
            # the ONNX Runtime module configures logging when first imported: import it here,
            # under containment, rather than in the middle of a later call
            import onnxruntime.quantization.matmul_nbits_quantizer  # noqa: F401
            import quark.onnx
            import quark.onnx.quantizers.matmul_nbits_quantizer

            added = [p for p in sys.path if p not in before]
        _quark_sys_path.extend(p for p in added if p not in _quark_sys_path)
        seconds = time.perf_counter() - t0
        where = extensions_dir() or Path("~/.cache/torch_extensions")
        if messages.matching("Compiling stable ABI custom ops"):
            # Quark says so on every import; only a slow import means it really compiled
            log.log(logging.INFO if seconds > 5 else logging.DEBUG,
                    "imported quark.onnx in %.1f s (C++ custom ops built or found in %s)", seconds, where)
        _imported = True
        return quark.onnx


__all__ = ["QuarkMessages", "contained", "extensions_dir", "import_quark", "quark_log"]
