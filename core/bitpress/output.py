"""Putting a finished output in place: one run per output, and moves that never replace what appeared.

:func:`bitpress.workflow.runner.run_workflow` assembles an output in a temporary folder beside its
final place (``.<name>.bitpress-XXXXXXXX``) and moves it there at the end. This module holds
what makes that last step safe against other programs and other bitpress runs:

* :class:`OutputLock`: ``.<name>.bitpress-lock`` beside the output, held (``flock``, exclusive)
  from before the temporary folder is made until the run ends, then removed. A second run on
  the same output fails at once, naming the process that holds it. A lock file left by a run
  that died (``kill -9``) holds no ``flock`` any more: the next run takes it over and logs it.
  Where ``flock`` is missing or refused (some network file systems), the file is created with
  ``O_CREAT | O_EXCL`` instead, and a left-over one whose recorded process is gone
  (``os.kill(pid, 0)``) is taken over.
* :func:`place_file` / :func:`rename_noreplace`: moves that fail with ``FileExistsError`` when
  anything (file, folder, link) is at the destination, instead of replacing it. Files:
  ``os.link`` then unlink (``link`` never replaces). Folders: ``renameat2(RENAME_NOREPLACE)``
  on Linux; elsewhere, or where the file system refuses it, the name is reserved with
  ``os.mkdir`` (which never replaces either) and the folder renamed onto that empty
  reservation (POSIX ``rename`` replaces an empty folder only, never a non-empty one or a file).
* :func:`commit_files` / :func:`commit_folder`: the final move. Without ``overwrite`` nothing
  that is there is ever deleted or replaced: an output that appeared during the run fails the
  run, and what this run made is discarded. With ``overwrite`` the old output is moved aside
  first (into the temporary folder), the new one moved in, and the old one deleted with the
  temporary folder; if moving the new one in fails, the old one is put back.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
import sys
import uuid
from pathlib import Path

from bitpress.errors import OutputError

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".bitpress-lock"

#: errors of writing (a full disk, a read-only file system, permissions) that are the user's to fix
WRITE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM", "EFBIG") if hasattr(errno, name)
)
_NO_LINK = frozenset(
    getattr(errno, name) for name in ("EPERM", "EOPNOTSUPP", "ENOTSUP", "EMLINK", "ENOSYS", "EXDEV", "EACCES")
    if hasattr(errno, name)
)
#: creating a file or folder fails so where the folder exists but takes no new entries (/proc, some FUSE mounts)
_NO_NEW_FILES = frozenset(
    getattr(errno, name) for name in ("ENOENT", "EINVAL", "EOPNOTSUPP", "ENOTSUP") if hasattr(errno, name)
)
_NO_FLOCK = frozenset(getattr(errno, n) for n in ("ENOLCK", "EOPNOTSUPP", "ENOTSUP", "EINVAL") if hasattr(errno, n))


def final_path(out: Path) -> Path:
    """Where ``out`` really goes: absolute, ``.`` and ``..`` folded, the parent's links resolved."""
    absolute = Path(os.path.abspath(out))
    if not absolute.name:
        raise OutputError(f"the output {out} is a file system root; choose a file or folder inside one")
    return absolute.parent.resolve() / absolute.name


def data_files(target: Path) -> list[Path]:
    """The external-data files of a single-file output: ``<name>.data``, ``<name>.data.NN`` (any there)."""
    prefix = target.name + ".data"
    try:
        with os.scandir(target.parent) as entries:
            return sorted(target.parent / e.name for e in entries if e.name.startswith(prefix))
    except (FileNotFoundError, NotADirectoryError):
        return []


# -- which kind of output: one rule for quantize, run, export and publish -------------------------------
#: an output whose name ends in this is one model file; any other name is a folder (docs/security.md)
MODEL_FILE_SUFFIX = ".onnx"


def names_a_file(out: Path) -> bool:
    """Whether ``out`` is named like a model file (``*.onnx``, any case)."""
    return out.suffix.lower() == MODEL_FILE_SUFFIX


def check_output_name(out: Path, folder: bool, why: str) -> None:
    """A folder output named like a model file is refused: ``out.onnx`` always means a file.

    ``why``: what makes this output a folder, for the message (``the input is a folder``).
    """
    if folder and names_a_file(out):
        raise OutputError(
            f"the output {out} ends in {MODEL_FILE_SUFFIX}, which names one model file, but {why}, so the output "
            f"is a folder; give a folder name (one without {MODEL_FILE_SUFFIX})"
        )


def check_existing_kind(target: Path, shown: Path, folder: bool) -> None:
    """What is already at the output's place must be of the output's kind, with ``--overwrite`` or without.

    ``--overwrite`` replaces an earlier output; it never replaces a folder with a file (``-o out.onnx``
    where ``out.onnx/`` is a folder) nor a file with a folder. Links are names, not outputs: the
    other checks handle them.
    """
    try:
        st = os.lstat(target)
    except (FileNotFoundError, NotADirectoryError):
        return
    if not folder and stat.S_ISDIR(st.st_mode):
        raise OutputError(
            f"the output {shown} is an existing folder, but a name ending in {MODEL_FILE_SUFFIX} is written as one "
            "model file, and a folder is never replaced by a file (--overwrite or not); remove the folder or "
            f"choose another name (a name without {MODEL_FILE_SUFFIX} is a folder output, written inside it)"
        )
    if folder and stat.S_ISREG(st.st_mode):
        raise OutputError(
            f"the output {shown} is an existing file, but this run writes a folder there, and a file is never "
            "replaced by a folder (--overwrite or not); remove the file or choose another name"
        )


# -- before anything is created ------------------------------------------------------------------------
def check_parent(target: Path, shown: Path) -> None:
    """The output's folder exists or can be made, and can be written: checked before anything is created."""
    p = target.parent
    while not os.path.lexists(p):
        p = p.parent
    if not p.is_dir():
        what = "a file" if p.is_file() else "not a folder"
        raise OutputError(f"cannot write the output {shown}: {p} is {what}, not a folder")
    if hasattr(os, "statvfs") and hasattr(os, "ST_RDONLY"):
        with contextlib.suppress(OSError):
            if os.statvfs(p).f_flag & os.ST_RDONLY:
                raise OutputError(f"cannot write the output {shown}: {p} is on a read-only file system")
    effective = os.access in os.supports_effective_ids
    if not os.access(p, os.W_OK | os.X_OK, effective_ids=effective):
        raise OutputError(f"cannot write the output {shown}: permission denied on the folder {p}")


def make_parents(parent: Path, shown: Path) -> list[Path]:
    """Create ``parent`` and the folders above it that are missing; returns those created, deepest first."""
    missing = []
    p = parent
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    created: list[Path] = []
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                if not d.is_dir():
                    raise OutputError(f"cannot write the output {shown}: {d} is not a folder") from None
                continue
            created.insert(0, d)
    except OSError as exc:
        remove_created(created)
        raise write_error(exc, shown, creating=True) or exc from None
    except BaseException:
        remove_created(created)
        raise
    return created


def remove_created(created: list[Path]) -> None:
    """Remove the (empty) folders :func:`make_parents` made, deepest first; stop at one that is not empty."""
    for d in created:
        try:
            d.rmdir()
        except OSError:
            break


def write_error(exc: OSError, shown: Path, creating: bool = False) -> OutputError | None:
    """A clean error for a full disk, a read-only file system or a permission refused; else None.

    ``creating``: ``exc`` came from creating the output's first entries (its parent folders, the lock
    file); an existing folder that takes no new entries (``/proc``: ENOENT) is then a clean error too.
    """
    reason = exc.strerror or os.strerror(exc.errno or 0)
    where = os.fsdecode(exc.filename) if exc.filename is not None else None
    code = errno.errorcode.get(exc.errno or 0, "")
    if creating and exc.errno in _NO_NEW_FILES and where is not None:
        folder = Path(where).absolute().parent
        if folder.is_dir() and _writing(where, shown):
            return OutputError(
                f"cannot write the output {shown}: files cannot be created in the folder {folder} ({reason} ({code})); "
                "choose an output folder on a writable file system; nothing was written"
            )
    if exc.errno not in WRITE_ERRNOS:
        return None
    if exc.errno in (errno.EACCES, errno.EPERM) and where is not None and not _writing(where, shown):
        return OutputError(f"{reason} ({code}): {where}")  # e.g. a file of the input that cannot be read
    detail = f" ({where})" if where else ""
    return OutputError(f"cannot write the output {shown}: {reason} ({code}){detail}; nothing was written")


def _writing(where: str, shown: Path) -> bool:
    """Whether the path an error names is where the output is being written (not a file of the input)."""
    try:
        return Path(where).absolute().is_relative_to(final_path(shown).parent)
    except (OSError, ValueError, OutputError):
        return False


# -- the lock ------------------------------------------------------------------------------------------------
class OutputLock:
    """``.<name>.bitpress-lock`` beside the output: one bitpress run per output at a time."""

    def __init__(self, target: Path, shown: Path) -> None:
        self.path = target.parent / f".{target.name}{LOCK_SUFFIX}"
        self.shown = shown
        self.fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX
            fcntl = None  # type: ignore[assignment]
        try:
            if fcntl is not None:
                try:
                    self._acquire_flock(fcntl)
                    return
                except _NoFlock:
                    log.debug("flock is not available for %s: using an exclusively created lock file", self.path)
            self._acquire_exclusive()
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OutputError(f"cannot lock the output {self.shown}: {self.path} is a symbolic link; "
                                  "remove it") from None
            raise write_error(exc, self.shown, creating=True) or exc from None

    def _open_flags(self) -> int:
        return os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)

    def _acquire_flock(self, fcntl: object) -> None:
        for _ in range(50):
            fd = os.open(self.path, self._open_flags() | os.O_CREAT, 0o644)
            held = False
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OutputError(f"cannot lock the output {self.shown}: {self.path} is not a regular file")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[attr-defined]
                except BlockingIOError:
                    raise self._busy(_read_pid(fd)) from None
                except OSError as exc:
                    if exc.errno in _NO_FLOCK:
                        raise _NoFlock from exc
                    raise
                # a run that finishes removes the file, then lets go of it: the file locked must
                # still be the one at the path, else lock again whatever is there now
                st = os.fstat(fd)
                try:
                    now = os.lstat(self.path)
                except FileNotFoundError:
                    continue
                if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
                    continue
                pid = _read_pid(fd)
                if pid is not None and pid != os.getpid():
                    state = "still running but no longer holding it" if _alive(pid) else "no longer running"
                    log.warning("taking over the lock %s left by process %d (%s)", self.path, pid, state)
                _write_pid(fd)
                self.fd, held = fd, True
                return
            finally:
                if not held:
                    os.close(fd)
        raise OutputError(f"cannot lock the output {self.shown}: {self.path} keeps changing")

    def _acquire_exclusive(self) -> None:
        for _ in range(5):
            try:
                fd = os.open(self.path, self._open_flags() | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                pid = _pid_in(self.path)
                if pid is not None and not _alive(pid):
                    log.warning("taking over the stale lock %s of process %d, which is no longer running",
                                self.path, pid)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)
                    continue
                raise self._busy(pid) from None
            _write_pid(fd)
            self.fd = fd
            return
        raise OutputError(f"cannot lock the output {self.shown}: {self.path} keeps changing")

    def _busy(self, pid: int | None) -> OutputError:
        who = f"another bitpress run (process {pid})" if pid is not None else "another bitpress run"
        return OutputError(
            f"{who} is writing the output {self.shown} (lock {self.path}); wait for it to finish or choose "
            "another output"
        )

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            st, now = os.fstat(fd), os.lstat(self.path)
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(self.path)  # removed while still held: a waiting run then locks a new file
        except OSError:
            pass
        finally:
            os.close(fd)


class _NoFlock(Exception):
    pass


def _write_pid(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0)
    except OSError:
        return None
    return _parse_pid(text)


def _pid_in(path: Path) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        return _read_pid(fd)
    finally:
        os.close(fd)


def _parse_pid(text: bytes) -> int | None:
    try:
        pid = int(text.split(b"\n", 1)[0].strip())
    except ValueError:
        return None
    return pid if pid > 0 else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # another user's process, or a platform that cannot tell: assume it runs
    return True


# -- moves that never replace ------------------------------------------------------------------------------
_libc: object = None


def _renameat2_noreplace(src: Path, dst: Path) -> bool:
    """``renameat2(src, dst, RENAME_NOREPLACE)``; False where the OS or file system lacks it.

    Raises ``FileExistsError`` when anything is at ``dst``, and other ``OSError`` as rename does.
    """
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    fn = getattr(_libc, "renameat2", None) if _libc else None
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    at_fdcwd, rename_noreplace = -100, 1
    if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, getattr(errno, "EOPNOTSUPP", -1), getattr(errno, "ENOTSUP", -1)):
        return False
    raise OSError(code, os.strerror(code), str(dst))


def place_file(src: Path, dst: Path) -> None:
    """Move the file ``src`` to ``dst``; ``FileExistsError`` (nothing changed) if anything is at ``dst``."""
    try:
        os.link(src, dst, follow_symlinks=False)  # never replaces
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
        # no hard links here (FAT, some FUSE and network file systems)
        if _renameat2_noreplace(src, dst):
            return
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        os.close(fd)  # the name is ours now: replacing our own empty reservation is safe
        try:
            os.replace(src, dst)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(dst)
            raise
        return
    os.unlink(src)


def rename_noreplace(src: Path, dst: Path) -> None:
    """Move the folder ``src`` to ``dst``; ``FileExistsError`` (nothing changed) if anything is at ``dst``."""
    if _renameat2_noreplace(src, dst):
        return
    os.mkdir(dst)  # the reservation: fails if anything is there
    try:
        os.rename(src, dst)  # onto our own empty folder (rename replaces an empty folder only)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(dst)
        raise


def is_empty_dir(path: Path) -> bool:
    try:
        if path.is_symlink() or not path.is_dir():
            return False
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def appeared(shown: Path, what: Path | None = None) -> OutputError:
    thing = f"the output {shown}" if what is None or what.name == shown.name else f"{what.name} (of the output {shown})"
    return OutputError(
        f"{thing} appeared while this run was working (another program wrote it); it was left as it is and this "
        "run's result was discarded; remove it or pass --overwrite (overwrite=True from Python) to replace it"
    )


def commit_folder(staged: Path, target: Path, shown: Path, overwrite: bool, aside: Path) -> None:
    """Move the finished folder ``staged`` to ``target`` (see the module's docstring)."""
    old = None
    if overwrite and os.path.lexists(target):
        os.rename(target, aside)  # the old output stays whole until the new one is in place
        old = aside
    try:
        try:
            rename_noreplace(staged, target)
        except FileExistsError:
            if not is_empty_dir(target):
                raise
            os.rename(staged, target)  # an empty folder (the run was allowed to fill it): replaced atomically
    except OSError as exc:
        if old is not None:
            _restore(old, target)
        if isinstance(exc, FileExistsError) or exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR,
                                                                errno.EISDIR):
            raise appeared(shown) from None
        raise


def commit_files(files: list[Path], target: Path, shown: Path, overwrite: bool, aside: Path) -> list[Path]:
    """Move a single-file output (its data files first, the model last) beside ``target``; returns their places."""
    order = sorted(files, key=lambda p: p.name == target.name)
    moved_aside: list[Path] = []
    if overwrite:
        aside.mkdir(exist_ok=True)
        for p in [target, *data_files(target)]:
            if os.path.lexists(p):
                os.rename(p, aside / p.name)  # kept until the new files are in
                moved_aside.append(p)
    placed: list[tuple[Path, int]] = []
    try:
        for f in order:
            dst = target.with_name(f.name)
            if overwrite:
                os.replace(f, dst)
            else:
                place_file(f, dst)
            placed.append((dst, os.lstat(dst).st_ino))
    except OSError as exc:
        for dst, ino in reversed(placed):  # what this run put there, and nothing else
            with contextlib.suppress(OSError):
                if os.lstat(dst).st_ino == ino:
                    os.unlink(dst)
        for p in moved_aside:
            _restore(aside / p.name, p)
        if isinstance(exc, FileExistsError) or exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
            raise appeared(shown, Path(os.fsdecode(exc.filename2 or exc.filename or target))) from None
        raise
    return [dst for dst, _ in placed]


def _restore(old: Path, target: Path) -> None:
    """Put an old output that was moved aside back; if that fails, keep it beside the output and say where."""
    try:
        os.replace(old, target)
        return
    except OSError as exc:
        kept = target.with_name(f"{target.name}.kept-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(old, kept)
        except OSError:
            raise OutputError(f"could not put the previous output back at {target} ({exc}); it is at {old}") from None
        raise OutputError(f"could not put the previous output back at {target} ({exc}); it was kept as {kept}") \
            from None
