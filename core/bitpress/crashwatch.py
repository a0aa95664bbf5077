"""Naming the plugin when a native crash ends the process (plugins run in the CLI's process by default).

An abort or a segfault in a plugin cannot be caught where it happens: the process is gone. The
CLI therefore (:func:`enable`):

* turns on :mod:`faulthandler` on stderr: Python's stack of every thread is printed as the
  process dies, so the plugin's module and line are on screen;
* starts, the first time plugin code runs, a tiny watcher process (``python -I -S``, standard
  library only, in a session of its own) holding the read end of a pipe. Before plugin code
  runs the host writes a line naming the plugin and what it does (``plugin faulty, in pass
  faulty``), and another when it returns; the run's temporary folder, lock file and the
  folders it created are announced the same way. When the pipe ends without the host's
  goodbye, the host died: the watcher removes what the run had made (the lock only when no
  process holds it) and prints one ``bitpress: error:`` line naming the plugin that was running
  and suggesting ``--isolate``.

What this does not do: keep the process alive (``--isolate`` does that), or change its exit
status (the shell sees the signal). The watcher costs one short-lived process per command that
runs plugin code, and two pipe writes per call into a plugin. Library use (no CLI) is unchanged:
nothing is started and nothing printed. A plugin that forks and leaves children running keeps
the pipe open: the watcher then speaks only once those are gone.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

from bitpress.interrupts import deferred

log = logging.getLogger(__name__)

#: the watcher (standard library only: it starts in milliseconds with ``-I -S``); argv[1] is the host's pid
_WATCHER = r'''
import os, shutil, sys, time
host = int(sys.argv[1])
active, cleanup, buf, bye = {}, {}, b"", False
while True:
    try:
        chunk = os.read(0, 65536)
    except InterruptedError:
        continue
    if not chunk:
        break
    buf += chunk
    *lines, buf = buf.split(b"\n")
    for line in lines:
        op, _, rest = line.partition(b" ")
        key, _, value = rest.partition(b" ")
        if op == b"B":
            bye = True
        elif op == b"E":
            active[key] = value.decode("utf-8", "replace")
        elif op == b"L":
            active.pop(key, None)
        elif op == b"R":
            kind, _, path = value.partition(b" ")
            cleanup[key] = (kind, bytes.fromhex(path.decode("ascii")))
        elif op == b"F":
            cleanup.pop(key, None)
if bye:
    sys.exit(0)


def died_of():
    """The host's wait status while it is a zombie (Linux: /proc/PID/stat, field 52), else None."""
    for _ in range(50):
        try:
            with open(f"/proc/{host}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            return None
        if fields[0] == b"Z" and len(fields) > 49:
            return int(fields[49])
        time.sleep(0.01)
    return None


def unlock(path):
    """Remove a lock file the dead host held: only when no process holds it now and it names the host."""
    import fcntl
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st, now = os.fstat(fd), os.lstat(path)
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino) and os.pread(fd, 64, 0).split(b"\n")[0].strip() == \
                str(host).encode():
            os.unlink(path)
    finally:
        os.close(fd)


status = died_of()
for kind, path in reversed(list(cleanup.values())):
    try:
        if kind == b"tree":
            shutil.rmtree(path)
        elif kind == b"lock":
            unlock(path)
        elif kind == b"dir":
            os.rmdir(path)
    except OSError:
        pass
how = "ended abruptly"
if status is not None and status & 0x7F:
    import signal
    try:
        name = signal.Signals(status & 0x7F).name
    except ValueError:
        name = f"signal {status & 0x7F}"
    how = f"died of {name}"
elif status is not None:
    how = f"ended abruptly (exit code {(status >> 8) & 0xFF})"
made = " its temporary files were removed and" if cleanup else ""
if active:
    plugin, _, action = list(active.values())[-1].partition("\t")
    hint = ("rerun with --isolate (isolate: true in a config) to run passes in a worker process, where such a crash "
            "is a clean error") if "in pass " in action or "around pass " in action else \
        "fix or uninstall it (see `bitpress plugins`)"
    text = (f"bitpress: error: the process {how} while plugin {plugin} was running ({action}); Python's stack of the "
            f"crash is above;{made} nothing was written; {hint}")
else:
    text = f"bitpress: error: the process {how} outside plugin code;{made} nothing was written"
try:
    os.write(2, (text + "\n").encode("utf-8", "replace"))
except OSError:
    pass
'''


class _State:
    enabled = False
    faulthandler_ours = False
    proc: subprocess.Popen | None = None
    failed = False  #: the watcher could not be started (or died): stop trying
    lock = threading.Lock()
    ids = itertools.count(1)
    #: what the host has announced, by key: replayed to a watcher started later
    active: ClassVar[dict[int, str]] = {}
    cleanup: ClassVar[dict[int, str]] = {}


def enable() -> None:
    """The CLI, before a command: faulthandler on stderr, and plugin code watched from now on."""
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable(file=sys.stderr, all_threads=True)
            _State.faulthandler_ours = True
        except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor (captured)
            pass
    _State.enabled = True


def disable() -> None:
    """The CLI, after the command (also when it failed): tell the watcher all is well, and let it end."""
    with _State.lock:
        proc, _State.proc = _State.proc, None
        _State.enabled = _State.failed = False
        _State.active.clear()
        _State.cleanup.clear()
        if proc is not None:
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.write(b"B\n")
                proc.stdin.close()
    if proc is not None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if _State.faulthandler_ours:
        faulthandler.disable()
        _State.faulthandler_ours = False


@contextlib.contextmanager
def plugin_code(plugin: str, action: str) -> Iterator[None]:
    """Mark the block as plugin ``plugin`` doing ``action`` (``in pass rtn``): named if the process dies in it."""
    if not _State.enabled:
        yield
        return
    key = next(_State.ids)
    text = f"{_clean(plugin)}\t{_clean(action)}"
    _send(key, "E", text, _State.active)
    try:
        yield
    finally:
        _send(key, "L", None, _State.active)


def remove_if_crashed(path: Path, kind: str) -> int | None:
    """Have the watcher remove ``path`` if the process dies: ``tree`` (a temporary folder), ``lock`` (the
    output's lock file, when no process holds it) or ``dir`` (an empty folder the run made). Returns a key
    for :func:`forget` (None when not watching)."""
    if not _State.enabled:
        return None
    key = next(_State.ids)
    _send(key, "R", f"{kind} {os.fsencode(os.path.abspath(path)).hex()}", _State.cleanup)
    return key


def forget(key: int | None) -> None:
    """``path`` of :func:`remove_if_crashed` is the run's no more (removed, or the finished output)."""
    if key is not None and _State.enabled:
        _send(key, "F", None, _State.cleanup)


def _clean(text: str) -> str:
    return " ".join(str(text).split())[:300]


def _send(key: int, op: str, value: str | None, table: dict[int, str]) -> None:
    """Record the line in the host's own table (replayed to a watcher started later) and send it.

    A signal (Ctrl-C) waits until the line is sent: raised inside, it could leave a started watcher unknown to
    :func:`disable`, which would then report the interrupted run as a crash."""
    with deferred(), _State.lock:
        if value is None:
            table.pop(key, None)
        else:
            table[key] = f"{op} {key} {value}"
        proc = _State.proc
        if proc is None:
            # started when plugin code first runs, with everything announced so far (this line too)
            if op == "E":
                _start()
            return
        assert proc.stdin is not None
        try:
            proc.stdin.write(f"{op} {key}{'' if value is None else ' ' + value}\n".encode("utf-8", "replace"))
            proc.stdin.flush()
        except (OSError, ValueError):  # the watcher is gone (killed): the run goes on unwatched
            _State.proc, _State.failed = None, True


def _start() -> None:
    """The watcher, told what the host has announced so far (called with the lock held)."""
    if _State.failed or not sys.executable:
        return
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHER, str(os.getpid())], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=None, close_fds=True, start_new_session=os.name == "posix",
        )
    except Exception as exc:  # best effort: whatever keeps the watcher from starting, the run goes on unwatched
        log.debug("no crash watcher (%s): a native crash in a plugin will not be named", exc)
        _State.failed = True
        return
    _State.proc = proc
    assert proc.stdin is not None
    try:
        for line in [*_State.cleanup.values(), *_State.active.values()]:
            proc.stdin.write(f"{line}\n".encode("utf-8", "replace"))
        proc.stdin.flush()
    except OSError:
        _State.proc, _State.failed = None, True


__all__ = ["disable", "enable", "forget", "plugin_code", "remove_if_crashed"]
