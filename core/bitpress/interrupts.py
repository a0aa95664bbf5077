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

A signal sent to the process reaches whichever of its threads does not block it: often a
native thread (OpenBLAS's, ONNX Runtime's), always one when the main thread blocks every
signal for a moment (``subprocess`` does, around its ``vfork``). Python then runs the handler
only when the main thread next executes Python code: a main thread asleep in ``time.sleep``, a
lock or a pipe read would sleep on. While :func:`handle_signals` is active, a relay thread
(:class:`_Relay`, reading the byte Python's C handler writes to ``signal.set_wakeup_fd``)
therefore sends each such signal once more, to the main thread itself
(``signal.pthread_kill``): its blocking call ends with ``EINTR`` and the handler runs at once.
The main thread then sees the signal twice; the second is ignored as above.

Without :func:`handle_signals` (bitpress used as a library) nothing changes: Python's own
SIGINT handler raises ``KeyboardInterrupt`` and the same ``finally`` blocks run.
"""

from __future__ import annotations

import contextlib
import logging
import os
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
    calls = 0  #: how often :func:`_handler` ran (tests read it)
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
    _State.calls += 1
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
    relay: _Relay | None = None
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
            relay = _Relay.start(tuple(previous))
        _State.installed += 1
        yield caught
    finally:
        _State.installed -= 1
        if _State.installed == 0 and relay is not None:
            relay.stop()  # before the handlers go: a signal it relayed meets ours, not the default action
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        if _State.installed == 0:
            _State.raised, _State.pending, _State.caught, _State.written = False, None, None, None


class _Relay:
    """Send the main thread each handled signal that may have reached another thread (see the module's notes).

    Python's C handler writes the signal's number to the wakeup descriptor in whatever thread the
    signal reached; this thread (which blocks the signals itself, so it is never the one chosen)
    reads it and sends the signal to the main thread with ``pthread_kill``. The signals it sends
    come back through the descriptor as well: ``echoes`` counts them so that they are not sent
    again. Only where nothing else uses the wakeup descriptor (an asyncio loop would) and
    ``pthread_kill`` exists (POSIX).
    """

    _forked_hook = False
    active: _Relay | None = None

    def __init__(self, signals: tuple[int, ...], read_fd: int, write_fd: int) -> None:
        self.signals = frozenset(signals)
        self.read_fd, self.write_fd = read_fd, write_fd
        self.main = threading.main_thread().ident
        self.echoes: dict[int, int] = {}
        self.closing = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="bitpress-signal-relay", daemon=True)

    @classmethod
    def start(cls, signals: tuple[int, ...]) -> _Relay | None:
        if not signals or not hasattr(signal, "pthread_kill") or not hasattr(signal, "pthread_sigmask"):
            return None
        read_fd, write_fd = os.pipe()
        try:
            os.set_blocking(write_fd, False)  # the C handler must never wait
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (OSError, ValueError):
            os.close(read_fd)
            os.close(write_fd)
            return None
        if previous != -1:  # someone else's (an event loop's): leave it theirs
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return None
        if not cls._forked_hook:  # a forked child must not write into this process's relay
            os.register_at_fork(after_in_child=cls._after_fork)
            cls._forked_hook = True
        relay = cls(signals, read_fd, write_fd)
        cls.active = relay
        relay.thread.start()
        return relay

    @classmethod
    def _after_fork(cls) -> None:
        relay, cls.active = cls.active, None
        if relay is None:
            return
        with contextlib.suppress(OSError, ValueError):
            _release_wakeup_fd(relay.write_fd)
        for fd in (relay.read_fd, relay.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        relay.lock = threading.Lock()  # it may have been held by the relay thread, which the child lacks

    def _loop(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)  # never the thread a signal is sent to
        while True:
            try:
                data = os.read(self.read_fd, 512)
            except InterruptedError:
                continue
            except OSError:
                return
            with self.lock:
                if not data or self.closing:
                    return
                for signum in data:
                    if signum not in self.signals or self.main is None:
                        continue
                    if self.echoes.get(signum, 0) > 0:  # the byte of a signal this thread sent
                        self.echoes[signum] -= 1
                        continue
                    self.echoes[signum] = self.echoes.get(signum, 0) + 1
                    try:
                        signal.pthread_kill(self.main, signum)
                    except (OSError, ValueError):  # the main thread is gone: nothing left to wake
                        self.echoes[signum] -= 1

    def stop(self) -> None:
        """Stop relaying (main thread). A signal already sent to the main thread is delivered while it waits here."""
        with self.lock:
            self.closing = True
        with contextlib.suppress(OSError):
            os.write(self.write_fd, b"\0")  # wake the relay thread: it sees ``closing``
        self.thread.join(timeout=5)
        with contextlib.suppress(OSError, ValueError):
            _release_wakeup_fd(self.write_fd)
        if _Relay.active is self:
            _Relay.active = None
        if not self.thread.is_alive():
            os.close(self.read_fd)
        os.close(self.write_fd)


def _release_wakeup_fd(ours: int) -> None:
    """No wakeup descriptor where ``ours`` is set; one that replaced it (an event loop's) stays."""
    current = signal.set_wakeup_fd(-1)
    if current not in (ours, -1):
        signal.set_wakeup_fd(current)


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
