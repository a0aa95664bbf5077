"""Reading confined to the input model's folder.

Everything the host opens or copies by a name it found in the input (a folder listing, a
``genai_config.json`` file name, a safetensors shard index, an external-data location, a
tokenizer beside the model) goes through this module. A name is resolved with every symbolic
link followed (strictly: a dangling link is an error) and must land inside the folder, resolved
too; a link that stays inside is fine, one that leaves it is refused with an error naming the
file (:class:`~bitpress.errors.UnsafePathError`). Files are opened right after the check, without
following a link at the last step, and the opened file must be the one checked, so swapping a
file for a link between check and open is caught too.

A folder that is (or lies in) a Hugging Face hub cache snapshot (``<cache>/models--org--name/
snapshots/<rev>/``) has a stricter rule instead (:mod:`bitpress.hfcache`): no link to a folder is
followed, and a link is accepted only when it leads, hop by hop, to a blob of the repository
(``<cache>/models--org--name/blobs/<hash>``) or of the cache's marked shared store; the checked
blob is what is returned, listed and opened.

See docs/security.md.

May import: errors, hfcache.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import IO, Literal

from bitpress import hfcache
from bitpress.errors import ModelLoadError, UnsafePathError
from bitpress.hfcache import os_reason, readlink_text

log = logging.getLogger(__name__)

#: the longest name (bytes, UTF-8) a file may give for another file, and one part of it
MAX_NAME_BYTES = 4096
MAX_PART_BYTES = 255
#: the largest JSON config (genai_config.json, config.json, a shard index) read into memory
MAX_CONFIG_BYTES = 64 << 20

Kind = Literal["file", "dir", "any"]
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO must not hang (it is refused after fstat)


def resolve_root(root: str | os.PathLike[str]) -> Path:
    """The folder ``root`` with every link resolved; it must exist."""
    try:
        real = Path(root).resolve(strict=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the model folder {root}: {os_reason(exc)}") from None
    if not real.is_dir():
        raise ModelLoadError(f"{root} is not a folder")
    return real


def check_name(name: object, what: str) -> PurePosixPath:
    """A relative file name read from a file, checked lexically (no ``..``, not absolute, sane length).

    ``what`` says where the name came from (``genai_config.json model.decoder.filename``).
    """
    if not isinstance(name, str):
        raise ModelLoadError(f"{what} must be a file name (a string), got {kind_of(name)}")
    if not name:
        raise ModelLoadError(f"{what} is empty; expected a file name relative to the model's folder")
    if any(ord(c) < 32 or c == "\x7f" for c in name):
        raise ModelLoadError(f"{what} {name[:80]!r} contains control characters; expected a file name")
    encoded = name.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_NAME_BYTES:
        raise ModelLoadError(f"{what} is {len(encoded)} bytes long (at most {MAX_NAME_BYTES}); expected a file name")
    if (
        PurePosixPath(name).is_absolute()
        or PureWindowsPath(name).is_absolute()
        or PureWindowsPath(name).drive
        or name.startswith(("/", "\\"))
    ):
        raise UnsafePathError(
            f"{what} {name!r} is an absolute path; it must be relative to the model's folder (refused for safety)"
        )
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if ".." in parts:
        raise UnsafePathError(f"{what} {name!r} leaves the model's folder (refused for safety)")
    if not parts:
        raise ModelLoadError(f"{what} {name!r} names the folder itself; expected a file name")
    for part in parts:
        if len(part.encode("utf-8", "surrogatepass")) > MAX_PART_BYTES:
            raise ModelLoadError(f"{what}: a part of {name[:80]!r}... is longer than {MAX_PART_BYTES} bytes")
    return PurePosixPath(*parts)


def inside(root: str | os.PathLike[str], path: str | os.PathLike[str], what: str, *, kind: Kind = "file",
           base: Path | None = None) -> Path:
    """The real path of ``path`` (relative to ``root`` unless absolute), which must exist inside ``root``.

    Every level of links is resolved; the result must lie in the resolved ``root``
    (``base`` when the caller has it already) and be a regular file (``kind="file"``), a folder
    (``"dir"``) or either (``"any"``). Raises :class:`UnsafePathError` for a path that leaves the
    folder and :class:`ModelLoadError` for a missing, dangling or unreadable one. In a Hugging Face
    cache snapshot the rule of :func:`bitpress.hfcache.resolve` applies instead, and the result is
    the checked blob.
    """
    base = base if base is not None else resolve_root(root)
    p = Path(path)
    if not p.is_absolute():
        p = Path(root) / p
    snap = hfcache.snapshot_of(base)
    if snap is not None:
        return hfcache.resolve(snap, base, _relative(root, base, p, what), p, what, kind)
    try:
        real = p.resolve(strict=True)
    except FileNotFoundError:
        if _is_link(p):
            raise ModelLoadError(
                f"{what} {p} is a dangling symbolic link (to {readlink_text(p)}); remove it or copy the file in"
            ) from None
        raise ModelLoadError(f"{what} {p} not found") from None
    except (OSError, RuntimeError, ValueError) as exc:  # a link loop, a name too long, NUL bytes
        raise ModelLoadError(f"cannot read {what} {p}: {os_reason(exc)}") from None
    if not real.is_relative_to(base):
        via = f" (a symbolic link to {readlink_text(p)})" if _is_link(p) else " through a symbolic link"
        raise UnsafePathError(
            f"{what} {p}{via} resolves to {real}, outside the model's folder {base}; refused for safety "
            "(copy the file into the folder instead of linking to it)"
        )
    if kind != "any":
        try:
            mode = os.stat(real).st_mode
        except OSError as exc:
            raise ModelLoadError(f"cannot read {what} {p}: {os_reason(exc)}") from None
        if kind == "file" and not stat.S_ISREG(mode):
            raise ModelLoadError(f"{what} {p} is not a regular file")
        if kind == "dir" and not stat.S_ISDIR(mode):
            raise ModelLoadError(f"{what} {p} is not a folder")
    return real


def _relative(root: str | os.PathLike[str], base: Path, p: Path, what: str) -> Path:
    """``p`` as a name relative to the folder, read lexically (for a Hugging Face cache snapshot, where
    links are followed by :mod:`bitpress.hfcache` only): under ``root`` as given, or under ``base``."""
    try:
        return p.relative_to(root)  # joined to the folder as given: its own parts, unnormalized
    except ValueError:
        pass
    if ".." in p.parts:  # normalizing would go up lexically, where the system would follow a link
        raise UnsafePathError(f"{what} {p} leaves the model's folder {base} (refused for safety)")
    a = Path(os.path.abspath(p))
    for top in (Path(os.path.abspath(root)), base):
        if a.is_relative_to(top):
            return a.relative_to(top)
    raise UnsafePathError(f"{what} {p} is not inside the model's folder {base}; refused for safety")


def hf_snapshot(folder: str | os.PathLike[str]) -> hfcache.Snapshot | None:
    """The Hugging Face hub cache snapshot that ``folder`` (resolved here) is or lies in (:mod:`bitpress.hfcache`)."""
    try:
        real = Path(folder).resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    return hfcache.snapshot_of(real)


def optional(root: str | os.PathLike[str], name: str, what: str) -> Path | None:
    """:func:`inside` for a file that may be absent: None when there is no entry at all.

    A dangling link is not "absent": it is an error, like one that leaves the folder.
    """
    p = Path(root) / name
    if not lexists(p):
        return None
    return inside(root, name, what)  # relative to root (p is root-relative only when root is absolute)


def open_inside(root: str | os.PathLike[str], path: str | os.PathLike[str], what: str,
                base: Path | None = None) -> IO[bytes]:
    """Check ``path`` with :func:`inside`, then open it for reading: the file checked, not a swapped-in link."""
    real = inside(root, path, what, base=base)
    try:
        before = os.stat(real)
        fd = os.open(real, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the checked file became a link
            raise UnsafePathError(f"{what} {path} changed while it was being opened; refused for safety") from None
        raise ModelLoadError(f"cannot read {what} {path}: {os_reason(exc)}") from None
    try:
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(after.st_mode):
            raise UnsafePathError(f"{what} {path} changed while it was being opened; refused for safety")
        if _O_NONBLOCK:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(root: str | os.PathLike[str], path: str | os.PathLike[str], what: str, *,
               limit: int | None = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a file inside ``root``; a file over ``limit`` bytes is refused before it is read."""
    with open_inside(root, path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise ModelLoadError(f"{what} {path} is {size} bytes, more than the {limit} a file of its kind may hold")
        return f.read()


def read_text(root: str | os.PathLike[str], path: str | os.PathLike[str], what: str, *,
              limit: int | None = MAX_CONFIG_BYTES) -> str:
    """The text of a file inside ``root`` (UTF-8; a decoding error is a ModelLoadError)."""
    data = read_bytes(root, path, what, limit=limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{what} {path} is not UTF-8 text: {exc}") from None


def copy_inside(root: str | os.PathLike[str], src: str | os.PathLike[str], dst: str | os.PathLike[str],
                what: str = "file", base: Path | None = None) -> Path:
    """Copy the bytes (and times, mode) of ``src``, checked to be inside ``root``, to ``dst``.

    ``src`` may be a link that stays inside the folder: its target's bytes are copied.
    """
    dst = Path(dst)
    with open_inside(root, src, what, base=base) as fin, open(dst, "wb") as fout:
        _copy_fd(fin, fout)
        st = os.fstat(fin.fileno())
    try:
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    except OSError:  # metadata is a courtesy; the bytes are what counts
        pass
    return dst


def _copy_fd(fin: IO[bytes], fout: IO[bytes]) -> None:
    infd, outfd = fin.fileno(), fout.fileno()
    offset = 0
    if hasattr(os, "sendfile"):
        try:
            while True:
                n = os.sendfile(outfd, infd, offset, 1 << 30)
                if n == 0:
                    return
                offset += n
        except OSError:
            fin.seek(offset)
            fout.seek(offset)
    shutil.copyfileobj(fin, fout, 1 << 20)


def walk(root: str | os.PathLike[str], what: str = "file") -> list[tuple[Path, Path]]:
    """Every regular file under ``root``: ``(path as listed, real path)``, sorted, each checked.

    Any entry that is a link leaving the folder (a file or a folder), or a dangling link, is an
    error naming it. A linked folder that stays inside is not descended: its files are listed
    where they really are. FIFOs, sockets and devices are skipped.
    """
    base = resolve_root(root)
    out: list[tuple[Path, Path]] = []

    def fail(exc: OSError) -> None:
        raise ModelLoadError(f"cannot list {exc.filename or root}: {os_reason(exc)}") from None

    for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=fail):
        folder = Path(dirpath)
        for name in sorted(dirnames):
            p = folder / name
            if _is_link(p):
                inside(root, p, what, kind="dir", base=base)
                dirnames.remove(name)
        dirnames.sort()
        for name in sorted(filenames):
            entry = _listed(root, folder / name, what, base)
            if entry is not None:
                out.append(entry)
    out.sort(key=lambda e: e[0].as_posix())
    return out


def listdir(root: str | os.PathLike[str], what: str = "file") -> list[tuple[Path, Path]]:
    """The regular files at the top of ``root`` (not recursive), each checked as :func:`walk` does."""
    base = resolve_root(root)
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        raise ModelLoadError(f"cannot list {root}: {os_reason(exc)}") from None
    out = []
    for name in names:
        p = Path(root) / name
        if _is_link(p):
            real = inside(root, p, what, kind="any", base=base)
            if real.is_dir():
                continue
        entry = _listed(root, p, what, base)
        if entry is not None:
            out.append(entry)
    return out


def _listed(root: str | os.PathLike[str], p: Path, what: str, base: Path) -> tuple[Path, Path] | None:
    try:
        mode = os.lstat(p).st_mode
    except OSError as exc:
        raise ModelLoadError(f"cannot read {what} {p}: {os_reason(exc)}") from None
    if stat.S_ISLNK(mode):
        real = inside(root, p, what, kind="any", base=base)
        mode = os.stat(real).st_mode
    else:
        real = p.resolve()
    if stat.S_ISDIR(mode):
        return None
    if not stat.S_ISREG(mode):
        log.debug("skipping %s: not a regular file", p)
        return None
    return p, real


def _is_link(p: Path) -> bool:
    try:
        return p.is_symlink()
    except (OSError, ValueError):
        return False


def lexists(p: Path) -> bool:
    try:
        os.lstat(p)
    except (OSError, ValueError):
        return False
    return True


def kind_of(value: object) -> str:
    return {dict: "an object", list: "a list", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


#: files that mark a folder as a model of its own (a Hugging Face checkpoint, a GenAI package)
MODEL_MARKERS = ("config.json", "genai_config.json")


def run_output_model(folder: str | os.PathLike[str]) -> Path | None:
    """The one model folder inside ``folder``, when ``folder`` is what a run wrote (``quantize -o OUT``
    writes ``OUT/<input name>/``): no model file of its own (no ``config.json``, ``genai_config.json``
    or ``.onnx``) and exactly one entry, a real folder (not a link) that has one. None otherwise."""
    root = Path(folder)
    try:
        entries = list(root.iterdir())
    except OSError:
        return None
    if any(e.name in MODEL_MARKERS or e.name.endswith(".onnx") for e in entries) or len(entries) != 1:
        return None
    (inner,) = entries
    if _is_link(inner) or not inner.is_dir():
        return None
    if any((inner / m).is_file() for m in MODEL_MARKERS) or any(inner.glob("*.onnx")):
        return inner
    return None
