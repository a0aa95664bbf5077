"""Run a vendor toolkit without letting its side effects reach the caller's process or folders.

What the toolkits wrapped so far do to the process that calls them (each plugin's module
docstring has its own measured list): call ``logging.basicConfig(force=True)`` (closing the
caller's root handlers), give their loggers stream handlers of their own, log on the root
logger, ``print()`` progress, change warning filters for the whole process, write files into
the *working directory*, set environment variables, keep module globals (temporary folders)
that outlive the call, append to ``sys.path`` and reseed random generators.

:func:`contained` undoes or prevents each of these for the duration of a call; what the
toolkit said is kept in :class:`ToolMessages` and re-emitted, demoted, on one logger of the
plugin's (``relay``): the toolkit's ERROR at WARNING, WARNING at INFO, the rest at DEBUG.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import random
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# chdir, os.environ, sys.stdout and the logging patches are process-wide: one toolkit call at a time
_lock = threading.RLock()


@dataclass
class ToolMessages:
    """The toolkit's log records (and printed lines) from one contained call, as (level, text)."""

    records: list[tuple[int, str]] = field(default_factory=list)

    def matching(self, text: str) -> list[str]:
        return [m for _, m in self.records if text in m]

    def errors(self) -> list[str]:
        return [m for level, m in self.records if level >= logging.ERROR]


def demoted(level: int) -> int:
    """A toolkit's ERROR is our WARNING, its WARNING our INFO, the rest DEBUG: toolkits are chatty."""
    if level >= logging.ERROR:
        return logging.WARNING
    if level >= logging.WARNING:
        return logging.INFO
    return logging.DEBUG


class Relay(logging.Handler):
    """Stands in for the toolkit's own handlers; also a root-logger filter for records logged there."""

    def __init__(self, messages: ToolMessages, target: logging.Logger) -> None:
        super().__init__(logging.DEBUG)
        self.messages = messages
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage().strip()
        except Exception:  # a malformed toolkit message must not break the quantization
            text = str(record.msg).strip()
        self.messages.records.append((record.levelno, text))
        self.target.log(demoted(record.levelno), "%s", text)

    def filter(self, record: logging.LogRecord) -> bool:
        """On the root logger: take records logged on it directly (``logging.warning(...)``), pass the rest."""
        if record.name == "root":
            self.emit(record)
            return False
        return True


class PrintedLines(io.TextIOBase):
    """``sys.stdout`` during a call: what the toolkit prints goes to the relay logger at DEBUG."""

    def __init__(self, messages: ToolMessages, target: logging.Logger) -> None:
        super().__init__()
        self.messages = messages
        self.target = target
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        for line in lines:
            self._line(line)
        return len(text)

    def flush(self) -> None:
        self._line(self._pending)
        self._pending = ""

    def _line(self, line: str) -> None:
        if line.strip():
            self.messages.records.append((logging.INFO, line.strip()))
            self.target.debug("(printed) %s", line.rstrip())


def _ignored_basic_config(*args: Any, **kwargs: Any) -> None:
    log.debug("ignored logging.basicConfig(%s) called by a toolkit or a library it imports", kwargs or args)


class _DivertedLoggers:
    """The toolkit's named loggers, existing ones and those given handlers during the call, to the relay."""

    def __init__(self, relay: Relay, match: Callable[[str], bool]) -> None:
        self.relay = relay
        self.match = match
        #: logger -> (its handlers, propagate, level) before the call
        self.saved: dict[logging.Logger, tuple[list[logging.Handler], bool, int]] = {}
        self.original_add: Any = None

    def divert(self, logger: logging.Logger) -> None:
        if logger not in self.saved:
            self.saved[logger] = (list(logger.handlers), logger.propagate, logger.level)
        logger.handlers = [self.relay]
        logger.propagate = False

    def __enter__(self) -> _DivertedLoggers:
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if isinstance(logger, logging.Logger) and self.match(name):
                self.divert(logger)
        self.original_add = original = logging.Logger.addHandler
        diverted = self

        def add_handler(logger: logging.Logger, handler: logging.Handler) -> None:
            if diverted.match(logger.name):
                diverted.divert(logger)  # the toolkit's own handler never sees a record
                return
            original(logger, handler)

        logging.Logger.addHandler = add_handler  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        logging.Logger.addHandler = self.original_add  # type: ignore[method-assign]
        # loggers the toolkit created during the call and configured by assigning handlers
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if isinstance(logger, logging.Logger) and self.match(name) and logger not in self.saved:
                self.saved[logger] = ([], True, logging.NOTSET)
        for logger, (handlers, propagate, level) in self.saved.items():
            logger.handlers = handlers
            logger.propagate = propagate
            logger.setLevel(level)


def _matcher(loggers: Sequence[str] | Callable[[str], bool]) -> Callable[[str], bool] | None:
    if callable(loggers):
        return loggers
    prefixes = tuple(loggers)
    if not prefixes:
        return None
    return lambda name: any(name == p or name.startswith(p + ".") for p in prefixes)


def _get_global(path: str, attr: str) -> tuple[bool, Any]:
    module = sys.modules.get(path)
    if module is None or not hasattr(module, attr):
        return False, None
    return True, getattr(module, attr)


def restore_environ(saved: Mapping[str, str]) -> None:
    """Make ``os.environ`` equal ``saved`` again (keys added removed, values put back)."""
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@contextmanager
def contained(
    folder: Path,
    *,
    relay: logging.Logger,
    loggers: Sequence[str] | Callable[[str], bool] = (),
    capture_stdout: bool = True,
    module_globals: Sequence[tuple[str, str]] = (),
    environ: Mapping[str, str] | None = None,
    hooks: Sequence[Callable[[Relay], AbstractContextManager[Any]]] = (),
) -> Iterator[ToolMessages]:
    """Run the body (toolkit calls) with its side effects confined; yields the toolkit's messages.

    Inside: the working directory is ``folder/cwd``; ``logging.basicConfig`` is a no-op; the
    loggers named by ``loggers`` (names, each covering its children, or a predicate), records
    logged on the root logger itself and lines printed to ``sys.stdout`` (``capture_stdout``)
    feed ``relay``, demoted; warnings are recorded and logged at DEBUG; ``environ`` is set
    (``TQDM_DISABLE=1`` is always set: toolkits' progress bars would draw on the caller's
    terminal). ``hooks`` are further context managers, given the relay handler (a toolkit's
    own logger class, say). On exit the working directory, root logger, logging module
    settings, warning filters, environment, ``sys.path``, standard streams, random states and
    the listed ``module_globals`` (``(module, attribute)``) are put back.

    These are process-wide: another thread that uses them while the toolkit runs sees the stand-ins.
    """
    with _lock:
        cwd = Path(folder) / "cwd"
        cwd.mkdir(parents=True, exist_ok=True)
        messages = ToolMessages()
        handler = Relay(messages, relay)
        match = _matcher(loggers)

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
        saved_globals = {key: _get_global(*key) for key in module_globals}

        catcher = warnings.catch_warnings(record=True)
        caught = catcher.__enter__()
        stack = ExitStack()
        try:
            warnings.simplefilter("always")
            logging.basicConfig = _ignored_basic_config  # type: ignore[assignment]
            os.environ["TQDM_DISABLE"] = "1"
            os.environ.update(environ or {})
            os.chdir(cwd)
            root.addFilter(handler)
            if match is not None:
                stack.enter_context(_DivertedLoggers(handler, match))
            for hook in hooks:
                stack.enter_context(hook(handler))
            if capture_stdout:
                sys.stdout = PrintedLines(messages, relay)
            yield messages
        finally:
            if sys.stdout is not saved_streams[0]:
                sys.stdout.flush()
            stack.close()
            try:
                os.chdir(saved_cwd)
            except OSError:  # the caller's folder vanished meanwhile: not the toolkit's doing
                log.warning("could not return to %s after running the toolkit", saved_cwd)
            # warnings first: leaving catch_warnings restores filters and showwarning
            catcher.__exit__(None, None, None)
            for w in caught:
                relay.debug("warning during the toolkit call: %s: %s", w.category.__name__, w.message)
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
            restore_environ(saved_env)
            sys.path[:] = saved_path
            sys.stdout, sys.stderr, sys.stdin = saved_streams
            random.setstate(saved_random)
            if saved_np_random is not None:
                np.random.set_state(saved_np_random)
            for (path, attr), (had, value) in saved_globals.items():
                module = sys.modules.get(path)
                if had and module is not None:  # a module first imported during the call keeps its value
                    setattr(module, attr, value)


def import_contained(folder: Path, modules: Sequence[str], **kwargs: Any) -> ToolMessages:
    """Import ``modules`` under :func:`contained` (imports configure logging, add warning filters)."""
    kwargs.setdefault("capture_stdout", False)  # a module that keeps sys.stdout at import would keep our stand-in
    with contained(folder, **kwargs) as messages:
        for name in modules:
            importlib.import_module(name)
    return messages


__all__ = ["PrintedLines", "Relay", "ToolMessages", "contained", "demoted", "import_contained", "restore_environ"]
