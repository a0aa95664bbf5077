"""Plugins whose import crashes the process: found once in a child process, and remembered.

A plugin that raises while it is imported is listed as broken and the host goes on
(:class:`bitpress.plugins.Registry`). One that aborts or segfaults (a native extension built for
another CPU or library version) would end the host instead, before any command ran: ``bitpress
plugins`` could not even say which one it was. So, before importing plugins in its own process,
the host checks each installed plugin distribution once in a child process:

* the child (a fork of the host where that is safe: POSIX, no other thread but daemons; else a
  new interpreter) imports the plugins not yet checked, in order, and calls their
  ``bitpress_register_passes`` with a register that keeps nothing, writing a line to the host
  before and after each. Raising is fine (the host reports that itself); a child that dies names
  the plugin it was in, which is recorded as crashed ("its import crashes the process
  (SIGABRT)"), and the plugins after it are checked in a new child;
* verdicts are kept in ``plugin-imports.json`` in bitpress's cache folder (``$BITPRESS_CACHE_DIR``,
  else ``$XDG_CACHE_HOME/bitpress``, else ``~/.cache/bitpress``), per distribution: its name,
  version, ``.dist-info`` folder and that folder's modification time, and the file and
  modification time of the module the entry point names. Reinstalling, upgrading or editing that
  module checks it again. A later run reads the file and stats those paths: no child.

A check that does not finish within :data:`PROBE_TIMEOUT` seconds records nothing (the plugins
are then imported in the host, as without this check). Entry points whose distribution is
unknown are not checked.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import importlib.util
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CACHE_VAR = "BITPRESS_CACHE_DIR"
CACHE_FILE = "plugin-imports.json"
#: seconds one child may take to import the plugins it checks
PROBE_TIMEOUT = 300.0
#: entries kept in the cache file at most (the newest)
MAX_ENTRIES = 500
_MARK = b"\x00bitpress-probe "


@dataclass
class Crash:
    """A plugin whose import (or registration) crashed the child that checked it."""

    reason: str  # "its import crashes the process (SIGABRT)"
    detail: str  # what the child printed as it died (faulthandler's stack), for --verbose


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_VAR)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bitpress"


def crashed_plugins(entry_points: list[md.EntryPoint]) -> dict[int, Crash]:
    """Index in ``entry_points`` -> :class:`Crash` for those whose import crashes the process.

    Never fails discovery: where the check itself cannot run, the plugins are imported unchecked, as before.
    """
    try:
        return _crashed_plugins(entry_points)
    except Exception as exc:  # a cache folder that cannot be found, an odd distribution: check nothing
        log.debug("plugin imports not checked: %s", exc, exc_info=True)
        return {}


def _crashed_plugins(entry_points: list[md.EntryPoint]) -> dict[int, Crash]:
    keys = [_key(ep) for ep in entry_points]
    path = cache_dir() / CACHE_FILE
    entries = _read(path)
    unknown = [i for i, key in enumerate(keys) if key is not None and key not in entries]
    if unknown:
        found = _probe([entry_points[i] for i in unknown])
        new = {keys[i]: {**verdict, "path": _dist_path(entry_points[i]), "checked": time.time()}
               for i, verdict in zip(unknown, found, strict=True) if verdict is not None}
        entries.update(new)
        if new:
            # what another process wrote meanwhile is kept (another environment's plugins)
            _write(path, {**_read(path), **new}, {_dist_path(ep) for ep in entry_points}, set(filter(None, keys)))
    crashes = {}
    for i, key in enumerate(keys):
        entry = entries.get(key) if key is not None else None
        if entry and entry.get("crashed"):
            crashes[i] = Crash(str(entry.get("reason", "its import crashes the process")), str(entry.get("detail", "")))
    return crashes


# -- what identifies an installed plugin ----------------------------------------------------------------
def _dist_path(ep: md.EntryPoint) -> str | None:
    path = getattr(getattr(ep, "dist", None), "_path", None)  # the .dist-info folder (PathDistribution)
    return str(Path(path).absolute()) if path is not None else None


def _mtime(path: str | None) -> int | None:
    try:
        return os.stat(path).st_mtime_ns if path else None
    except OSError:
        return None


def _key(ep: md.EntryPoint) -> str | None:
    """The distribution, its version, where it is installed and when, and its module's file and mtime."""
    dist = getattr(ep, "dist", None)
    where = _dist_path(ep)
    if dist is None or where is None:
        return None
    try:
        # the top-level module: found without running it (a submodule's lookup would import its package)
        spec = importlib.util.find_spec(ep.value.split(":")[0].split(".")[0].strip())
        origin = spec.origin if spec is not None else None
    except (ImportError, ValueError, AttributeError):
        origin = None
    parts = [dist.metadata["Name"], dist.version, ep.name, ep.value, where, _mtime(where), origin, _mtime(origin)]
    return json.dumps(parts)


# -- the cache file ---------------------------------------------------------------------------------------
def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.debug("ignoring the plugin check cache %s: %s", path, exc)
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        return {}
    return {k: v for k, v in entries.items() if isinstance(k, str) and isinstance(v, dict)}


def _write(path: Path, entries: dict[str, dict[str, Any]], current_paths: set[str | None], current: set[str]) -> None:
    """Write the cache atomically, without entries of distributions that are gone or were replaced."""
    kept = {}
    for key, entry in entries.items():
        where = entry.get("path")
        if key not in current and (where in current_paths or not where or not os.path.isdir(where)):
            continue  # an older install of a plugin installed now, or a distribution that is gone
        kept[key] = entry
    newest = sorted(kept.items(), key=lambda kv: kv[1].get("checked", 0), reverse=True)[:MAX_ENTRIES]
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": 1, "entries": dict(newest)}, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache: plugins are checked again next time
        log.debug("cannot write the plugin check cache %s: %s", path, exc)
        tmp.unlink(missing_ok=True)


# -- the child ----------------------------------------------------------------------------------------------
def _probe(entry_points: list[md.EntryPoint]) -> list[dict[str, Any] | None]:
    """A verdict per entry point (``{"crashed": bool, ...}``), or None where the check did not finish."""
    verdicts: list[dict[str, Any] | None] = [None] * len(entry_points)
    start = 0
    while start < len(entry_points):
        batch = entry_points[start:]
        result = _run_child(batch)
        if result is None:  # no child, or it timed out: nothing more is known
            break
        done, stage, ended, tail = result
        for i in range(done):
            verdicts[start + i] = {"crashed": False}
        if done == len(batch):
            break
        if stage is None:  # died before it began: no plugin to blame
            log.debug("the plugin check ended before it began (%s)", ended)
            break
        what = "import" if stage == "import" else "bitpress_register_passes"
        verdicts[start + done] = {
            "crashed": True, "detail": "\n".join(tail),
            "reason": f"its {what} crashes the process ({ended}), seen in a separate process; not loaded until "
                      "it is reinstalled or changed",
        }
        log.debug("plugin %s: its %s crashed a check process (%s)", batch[done].name, what, ended)
        start += done + 1
    return verdicts


class _Child:
    """A checking child: a fork (``pid``) or a new interpreter (``proc``)."""

    def __init__(self, pid: int | None = None, proc: subprocess.Popen | None = None) -> None:
        self.pid, self.proc = pid, proc

    def wait(self) -> str:
        """How it ended, in words: ``SIGABRT``, ``exit code 3``."""
        from bitpress.envs.remote import signal_name

        if self.proc is not None:
            rc = self.proc.wait()
            return signal_name(-rc) if rc < 0 else f"exit code {rc}"
        assert self.pid is not None
        _, status = os.waitpid(self.pid, 0)
        if os.WIFSIGNALED(status):
            return signal_name(os.WTERMSIG(status))
        return f"exit code {os.WEXITSTATUS(status)}"

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
        elif self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.wait()


def _run_child(entry_points: list[md.EntryPoint]) -> tuple[int, str | None, str, list[str]] | None:
    """Check ``entry_points`` in one child: (how many finished, the stage the next one was in, how the child
    ended, its last output lines); None when no child could run or it timed out."""
    read_fd, write_fd = os.pipe()
    try:
        child = _fork_child(entry_points, read_fd, write_fd) if _can_fork() else _spawn_child(entry_points, write_fd)
    except OSError as exc:
        log.debug("no plugin check process (%s): plugins are imported here unchecked", exc)
        os.close(read_fd)
        os.close(write_fd)
        return None
    os.close(write_fd)
    try:
        done, stage, tail, finished = _read_child(read_fd)
    except BaseException:  # an interrupt: the child must not outlive the host
        child.kill()
        raise
    finally:
        os.close(read_fd)
    if not finished:
        log.warning("checking plugin imports took over %g s; importing them here unchecked", PROBE_TIMEOUT)
        child.kill()
        return None
    return done, stage, child.wait(), tail


def _can_fork() -> bool:
    """A fork copies this process as it is, with locks other threads hold: fork only from the main thread,
    with no other thread but daemons (progress-bar monitors). CPython holds the import lock across a fork."""
    if not hasattr(os, "fork") or threading.current_thread() is not threading.main_thread():
        return False
    return all(t.daemon for t in threading.enumerate() if t is not threading.current_thread())


def _read_child(fd: int) -> tuple[int, str | None, list[str], bool]:
    """What the child reported: (how many finished, the stage of the next one, its output as it died, ended)."""
    done, stage = 0, None
    tail: deque[str] = deque(maxlen=400)
    buf = b""
    deadline = time.monotonic() + PROBE_TIMEOUT
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return done, stage, _crash_report(list(tail)), False
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return done, stage, _crash_report(list(tail)), True
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(_MARK):
                event = line[len(_MARK):].decode("ascii", "replace").split()
                if event[0] == "done":
                    done, stage = int(event[1]) + 1, None
                else:
                    stage = event[0]  # "import" or "register"
            elif line.strip():
                tail.append(line.decode("utf-8", "replace"))


def _crash_report(lines: list[str], keep: int = 40) -> list[str]:
    """faulthandler's report (its first lines: the innermost frames, the plugin's), else the last lines."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    return lines[starts[-1]:starts[-1] + keep] if starts else lines[-keep:]


def _fork_child(entry_points: list[md.EntryPoint], read_fd: int, write_fd: int) -> _Child:
    pid = os.fork()
    if pid:
        return _Child(pid=pid)
    # the child: never returns into the host's code (no cleanup of the host's, no output of its own)
    try:
        os.close(read_fd)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        check(entry_points, write_fd)
    finally:
        os._exit(0)


def _spawn_child(entry_points: list[md.EntryPoint], write_fd: int) -> _Child:
    """A new interpreter with this process's import path, for where forking is not safe."""
    from bitpress.envs.remote import isolated_environ

    spec = json.dumps([[ep.name, ep.value] for ep in entry_points])
    code = "import sys; from bitpress.plugin_probe import spawned; spawned(sys.argv[1])"
    proc = subprocess.Popen([sys.executable, "-c", code, spec], stdin=subprocess.DEVNULL, stdout=write_fd,
                            stderr=write_fd, env=isolated_environ())
    return _Child(proc=proc)


def spawned(spec: str) -> None:
    """The spawned child's entry: the entry points named in ``spec`` (JSON ``[[name, value], ...]``)."""
    wanted = [tuple(x) for x in json.loads(spec)]
    found = {(ep.name, ep.value): ep for ep in md.entry_points(group="bitpress")}
    check([found[w] for w in wanted if w in found], 1)


#: the signals faulthandler reports
_FATAL_SIGNALS = tuple(getattr(signal, n) for n in ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS", "SIGILL")
                       if hasattr(signal, n))


def check(entry_points: list[md.EntryPoint], fd: int) -> None:
    """Import each plugin and call its ``bitpress_register_passes``, telling ``fd`` before and after each."""
    import faulthandler

    os.dup2(fd, 1)
    os.dup2(fd, 2)  # what the plugins print, and faulthandler's stack as the process dies
    # A fork inherits the host's handlers of fatal signals: a library's own (Ray's, a Python handler) may have
    # replaced faulthandler's while faulthandler still counts as enabled, and would die silently or not at all.
    # Back to the default action, then faulthandler's handlers installed afresh.
    faulthandler.disable()
    for sig in _FATAL_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    faulthandler.enable(file=2, all_threads=True)

    def mark(event: str) -> None:
        os.write(fd, _MARK + event.encode("ascii") + b"\n")

    for i, ep in enumerate(entry_points):
        mark(f"import {i}")
        try:
            plugin = ep.load()
            mark(f"register {i}")
            register = getattr(plugin, "bitpress_register_passes", None)
            if callable(register):
                register(register=lambda cls: None)
        except BaseException:  # raising is fine: the host reports it when it imports the plugin itself
            pass
        mark(f"done {i}")


__all__ = ["CACHE_FILE", "CACHE_VAR", "Crash", "cache_dir", "check", "crashed_plugins"]
