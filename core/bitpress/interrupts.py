"""Signals as exceptions: SIGINT, SIGTERM and SIGHUP stop a run the way Ctrl-C does.

:func:`handle_signals` (used by the CLI around each command) installs handlers that raise
:class:`bitpress.errors.Interrupted` in the main thread, so every ``finally`` cleanup of the
library runs (the run's temporary folder, its lock, spill files, a plugin environment's worker
process), and puts the previous handlers back afterwards.

Two rules keep the cleanup itself whole:

* inside :func:`deferred` (the final move of an output into place, and the cleanup after a
  run) a signal is recorded, not raised; it is raised when the block ends;
* only the first signal raises: later ones, while that exception unwinds, are ignored (the
  cleanup is then never cut short; SIGKILL still stops everything).

Without :func:`handle_signals` (bitpress used as a library) nothing changes: Python's own
SIGINT handler raises ``KeyboardInterrupt`` and the same ``finally`` blocks run.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

from bitpress.errors import Interrupted

log = logging.getLogger(__name__)

#: the signals the CLI turns into :class:`Interrupted` (those this platform has)
SIGNALS: tuple[int, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class Caught:
    """What :func:`handle_signals` saw: the first signal it turned into :class:`Interrupted`, if any.

    An exception raised from a signal handler can land inside library code that does not expect
    one (a ``threading`` lock being released, a C extension's callback) and come out as another
    error; the CLI reads ``signum`` to report such a run as interrupted all the same.
    """

    def __init__(self) -> None:
        self.signum: int | None = None


class _State:
    depth = 0  #: nesting of :func:`deferred` blocks (main thread only)
    pending: int | None = None  #: a signal that came inside a deferred block
    raised = False  #: an Interrupted was raised already: later signals are ignored
    installed = 0  #: nesting of :func:`handle_signals`
    caught: Caught | None = None
    written: object = None  #: an output a run finished and put in place (said when a signal comes after)


def note_written(output: object) -> None:
    """Record that ``output`` is complete and in place: an interruption from now on says so."""
    _State.written = output


def _record(signum: int) -> None:
    _State.raised = True
    if _State.caught is not None and _State.caught.signum is None:
        _State.caught.signum = signum


def _handler(signum: int, frame: Any) -> None:
    if _State.raised:
        log.debug("signal %s ignored: already stopping", signum)
        return
    if _State.depth:
        if _State.pending is None:
            _State.pending = signum
        return
    _record(signum)
    raise Interrupted(signum, written=_State.written)


@contextlib.contextmanager
def handle_signals(caught: Caught | None = None, signals: tuple[int, ...] = SIGNALS) -> Iterator[Caught]:
    """Turn ``signals`` into :class:`Interrupted` while the block runs (main thread only; else a no-op).

    A signal ignored when the block starts (``nohup`` ignores SIGHUP) stays ignored. Yields
    ``caught`` (a new :class:`Caught` by default), which records the first signal.
    """
    caught = caught if caught is not None else Caught()
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous: dict[int, Any] = {}
    try:
        for sig in signals:
            try:
                if signal.getsignal(sig) is signal.SIG_IGN:
                    continue  # ignored on purpose (`nohup` ignores SIGHUP): stays ignored
                previous[sig] = signal.signal(sig, _handler)
            except (OSError, ValueError):  # not settable here
                continue
        if _State.installed == 0:
            _State.raised, _State.pending, _State.caught, _State.written = False, None, caught, None
        _State.installed += 1
        yield caught
    finally:
        _State.installed -= 1
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        if _State.installed == 0:
            _State.raised, _State.pending, _State.caught, _State.written = False, None, None, None


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold back signals (those :func:`handle_signals` handles) until the block ends, then raise.

    An exception already leaving the block is kept when no signal came; when one did, the
    :class:`Interrupted` is raised from it.
    """
    main = threading.current_thread() is threading.main_thread()
    if main:
        _State.depth += 1
    try:
        yield
    finally:
        if main:
            _State.depth -= 1
            if _State.depth == 0 and _State.pending is not None and not _State.raised:
                signum, _State.pending = _State.pending, None
                _record(signum)
                raise Interrupted(signum, written=_State.written)


@contextlib.contextmanager
def cancel_pending(pool: Any) -> Iterator[Any]:
    """On an error or a signal in the block, drop the work ``pool`` (an executor) has not started.

    ``with ThreadPoolExecutor(n) as pool, cancel_pending(pool):`` — the executor's own exit then
    waits only for the tasks already running (threads cannot be interrupted), not for the queue.
    """
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
