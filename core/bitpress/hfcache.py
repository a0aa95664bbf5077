"""Hugging Face hub cache snapshots as input folders, still confined (issue 32).

huggingface_hub keeps a downloaded repository as ``<cache>/models--org--name/`` with ``blobs/``
(the files, named by their hash: 40 hex digits for a git sha1, 64 for a sha256), ``refs/`` and
``snapshots/<rev>/``, whose files are relative symbolic links ``../../blobs/<hash>`` (one more
``../`` per sub-folder). Recent releases may move a blob into a cache-wide store
``<cache>/blobs/<2 hex>/<sha256>``, marked by the file ``<cache>/blobs/.huggingface-shared-blobs``
(content ``1\\n``), and leave ``models--org--name/blobs/<hash>`` as a relative link to it.

:mod:`bitpress.paths` asks :func:`snapshot_of` whether an input folder (resolved) is such a snapshot
or a sub-folder of one; inside it, :func:`resolve` replaces the "every link followed, must land in
the folder" rule by a stricter one. A name is walked part by part without following any link to
a folder; its last part is a regular file of the snapshot, or a link that :func:`follow` accepts:
hop by hop, each hop's folder checked to be a real folder where the link text says (no ``..``
trick through a linked folder), the chain ends in a regular file whose name is a hash, in the
repository's own ``blobs/`` or in the marked shared store of the same cache, and the operating
system resolves the link to that very file. Anything else (a link elsewhere, to another
repository's blobs, to a name that is not a hash, a dangling link, a link to a FIFO, a device or a
folder, a link chain of another shape) is refused with an error naming the file and its target.

May import: errors.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePath

from bitpress.errors import ModelLoadError, UnsafePathError

REPO_PREFIX = "models--"
SNAPSHOTS = "snapshots"
BLOBS = "blobs"
SHARED_MARKER = ".huggingface-shared-blobs"
#: what huggingface_hub writes in the marker (its SHARED_BLOBS_LAYOUT_VERSION); another layout is not trusted
SHARED_MARKER_TEXT = b"1\n"
#: a per-repository blob: a git sha1 (40 hex) or a sha256 (64 hex), lower case as huggingface_hub writes them
REPO_BLOB_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
#: a shared-store entry: the sha256 (Xet hash) of the file
SHARED_BLOB_NAME = re.compile(r"[0-9a-f]{64}")
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


@dataclass(frozen=True)
class Snapshot:
    """``folder`` is ``<cache>/models--org--name/snapshots/<rev>``, every link in it resolved."""

    folder: Path

    @property
    def repo(self) -> Path:
        return self.folder.parent.parent

    @property
    def cache(self) -> Path:
        return self.repo.parent

    @property
    def blobs(self) -> Path:
        """The repository's own blobs."""
        return self.repo / BLOBS

    @property
    def store(self) -> Path:
        """The cache-wide shared blob store (used only when marked)."""
        return self.cache / BLOBS


def snapshot_of(folder: str | os.PathLike[str]) -> Snapshot | None:
    """The snapshot that ``folder`` (an absolute path, links resolved) is or lies in; None if none.

    Recognised by the layout alone: ``.../models--<name>/snapshots/<rev>`` (the nearest such
    ancestor). Reads nothing.
    """
    p = Path(folder)
    for anc in (p, *p.parents):
        parent = anc.parent
        if (parent.name == SNAPSHOTS and parent.parent.name.startswith(REPO_PREFIX)
                and len(parent.parent.name) > len(REPO_PREFIX) and anc.name not in ("", ".", "..")):
            return Snapshot(anc)
    return None


def resolve(snap: Snapshot, base: Path, rel: PurePath, shown: Path, what: str, kind: str) -> Path:
    """The real path of ``base / rel`` (``base``: the input folder, resolved, inside ``snap``).

    ``shown`` is the name as the caller has it (for messages), ``kind`` is ``"file"``, ``"dir"``
    or ``"any"`` (a FIFO, socket or device of the snapshot itself is returned for ``"any"``: the
    listing skips it, as it does in any folder).
    """
    parts = rel.parts
    if any(part in ("", ".", "..") for part in parts) or rel.is_absolute():
        raise UnsafePathError(f"{what} {shown} leaves the model's folder {base} (refused for safety)")
    cur = base
    mode = os.lstat(base).st_mode if not parts else 0
    for i, part in enumerate(parts):
        cur = cur / part
        last = i == len(parts) - 1
        try:
            mode = os.lstat(cur).st_mode
        except FileNotFoundError:
            raise ModelLoadError(f"{what} {shown} not found") from None
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {what} {shown}: {os_reason(exc)}") from None
        if stat.S_ISLNK(mode):
            if not last:
                raise UnsafePathError(
                    f"{what} {shown}: {cur} is a symbolic link to a folder ({readlink_text(cur)}) in a Hugging Face "
                    "cache snapshot, where only links to blob files are accepted; refused for safety"
                )
            cur = follow(snap, cur, shown, what)
            mode = os.lstat(cur).st_mode
            break
        if not last and not stat.S_ISDIR(mode):
            raise ModelLoadError(f"{what} {shown} not found ({cur} is not a folder)")
    if kind == "file" and not stat.S_ISREG(mode):
        raise ModelLoadError(f"{what} {shown} is not a regular file")
    if kind == "dir" and not stat.S_ISDIR(mode):
        raise ModelLoadError(f"{what} {shown} is not a folder")
    return cur


def follow(snap: Snapshot, link: Path, shown: Path, what: str) -> Path:
    """The blob that the link ``link`` (a link in ``snap``, its folder real) leads to; see the module docstring.

    Accepted chains: ``link -> <repo>/blobs/<hash>`` (a regular file), ``link -> <repo>/blobs/<hash>
    -> <cache>/blobs/<xx>/<sha256>`` and ``link -> <cache>/blobs/<xx>/<sha256>`` (the last two only
    with the shared store's marker). Raises :class:`UnsafePathError` for anything else, and
    :class:`ModelLoadError` for a link to a missing blob of the repository.
    """
    target = readlink_text(link)

    def refuse(why: str, cls: type[ModelLoadError] = UnsafePathError) -> ModelLoadError:
        if cls is not UnsafePathError:  # a blob of the repository that is missing: a broken download
            return cls(f"{what} {shown} is a symbolic link to {target} {why}")
        return cls(
            f"{what} {shown} is a symbolic link to {target} {why}; in a Hugging Face cache snapshot a link must "
            f"lead to a blob of its own repository ({snap.blobs}/<hash>) or of the cache's shared blob store; "
            "refused for safety"
        )

    hop = _hop(link, target, refuse)
    if hop.parent == snap.blobs:
        if not REPO_BLOB_NAME.fullmatch(hop.name):
            raise refuse(f"(in the repository's blobs, but {hop.name[:80]!r} is not a hash)")
        mode = _lstat_mode(hop)
        if mode is None:
            raise refuse("(a dangling link: the blob is missing; download the file again)", ModelLoadError)
        if stat.S_ISLNK(mode):  # a blob moved to the shared store: one more hop, into the store only
            first, second = hop, readlink_text(hop)
            hop = _hop(first, second, refuse)
            if not _in_store(snap, hop):
                raise refuse(f"(through {first}, a link to {second}, which is not a blob of the cache's marked "
                             "shared store)")
            mode = _lstat_mode(hop)
            if mode is None:
                raise refuse(f"(through {first}, a link to {hop}, which is missing: a dangling link)", ModelLoadError)
    elif _in_store(snap, hop):
        mode = _lstat_mode(hop)
        if mode is None:
            raise refuse("(a dangling link: the shared blob is missing)", ModelLoadError)
    elif hop.parent.parent == snap.store:
        raise refuse(f"(it leads to {hop}, in {snap.store}, which is not huggingface_hub's shared blob store: "
                     f"no {SHARED_MARKER} marker of layout 1, or not a <2 hex>/<sha256> name)")
    else:
        raise refuse(f"(it leads to {hop}, not a blob of the repository)")
    if not stat.S_ISREG(mode):
        raise refuse(f"(it leads to {hop}, which is not a regular file: {_kind(mode)})")
    # the operating system must resolve the link to the very file checked above
    try:
        real = Path(os.path.realpath(link, strict=True))
    except (OSError, RuntimeError, ValueError) as exc:
        raise refuse(f"(it cannot be resolved: {os_reason(exc)})") from None
    if real != hop:
        raise refuse(f"(checked as {hop}, but it resolves to {real})")
    return hop


def _hop(link: Path, target: str, refuse: Callable[..., ModelLoadError]) -> Path:
    """Where the link text ``target`` of ``link`` points, written out; its folder must be a real folder
    that is where the text says (the operating system resolves it the same way, no linked folder on it)."""
    if not target or "\0" in target:
        raise refuse("(an empty or invalid link)")
    lexical = Path(os.path.normpath(os.path.join(link.parent, target)))
    try:
        folder = os.path.realpath(lexical.parent)
    except (OSError, ValueError) as exc:
        raise refuse(f"(it cannot be resolved: {os_reason(exc)})") from None
    if Path(folder) != lexical.parent:
        raise refuse(f"(through a linked folder: its folder {lexical.parent} is really {folder})")
    return lexical


def _in_store(snap: Snapshot, p: Path) -> bool:
    """``p`` is ``<cache>/blobs/<xx>/<sha256>`` with ``xx`` its first two digits, and the store is marked."""
    return (p.parent.parent == snap.store and SHARED_BLOB_NAME.fullmatch(p.name) is not None
            and p.parent.name == p.name[:2] and shared_store_marked(snap.cache))


def shared_store_marked(cache: Path) -> bool:
    """``<cache>/blobs`` is a real folder holding the marker (a regular file saying layout 1), as
    huggingface_hub's own ``is_shared_blobs_dir`` requires."""
    store = cache / BLOBS
    mode = _lstat_mode(store)
    if mode is None or not stat.S_ISDIR(mode):
        return False
    try:
        fd = os.open(store / SHARED_MARKER, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        return os.read(fd, 64) == SHARED_MARKER_TEXT
    except OSError:
        return False
    finally:
        os.close(fd)


def _lstat_mode(p: Path) -> int | None:
    try:
        return os.lstat(p).st_mode
    except (OSError, ValueError):
        return None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return name
    return "not a file"


def readlink_text(p: Path) -> str:
    """Where the link ``p`` points, as written, for a message ("?" when it cannot be read)."""
    try:
        return os.readlink(p)
    except (OSError, ValueError):
        return "?"


def os_reason(exc: BaseException) -> str:
    """An exception as the short reason a message gives (an OS error's strerror, else its first line)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


__all__ = ["Snapshot", "follow", "os_reason", "readlink_text", "resolve", "shared_store_marked", "snapshot_of"]
