"""``bitpress-manifest.json``: every file of a written package, its size and sha256, and how it was made.

Written beside a package (:func:`write_manifest`) and checked against a local or downloaded copy
by :func:`verify` (``bitpress verify FOLDER``): the incomplete uploads users meet on the Hub
(a shard missing, a file cut short, a file replaced) are named one by one. Names in a manifest
are read from a file: each is checked to be relative and to stay inside the folder, links
resolved, before it is opened.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from bitpress import __version__, paths
from bitpress.errors import ModelLoadError, ValidationError

log = logging.getLogger(__name__)

MANIFEST = "bitpress-manifest.json"
FORMAT = "bitpress-manifest-v1"
_CHUNK = 1 << 20
#: distributions whose versions are recorded when installed (the toolkits a package may come from)
TOOLKITS = ("onnxruntime-genai", "onnxruntime", "onnx", "onnx-ir", "transformers", "torch", "mobius-onnx")


def sha256_of(path: Path) -> tuple[int, str]:
    """(size, hex sha256) of a file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def versions() -> dict[str, str]:
    out = {"bitpress": __version__}
    for dist in TOOLKITS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def write_manifest(folder: Path, *, made: dict[str, Any] | None = None, evaluation: dict[str, Any] | None = None,
                   files: list[Path] | None = None) -> Path:
    """Write ``folder/bitpress-manifest.json`` over ``files`` (default: every file of the folder)."""
    folder = Path(folder)
    entries = []
    chosen = sorted(files) if files is not None else sorted(p for p, _ in paths.walk(folder, "file of the package"))
    for p in chosen:
        rel = p.relative_to(folder).as_posix()
        if rel == MANIFEST:
            continue
        size, digest = sha256_of(p)
        entries.append({"path": rel, "size": size, "sha256": digest})
    data = {
        "format": FORMAT,
        "created": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": versions(),
        "made": made or {},
        "files": entries,
    }
    if evaluation:
        data["eval"] = evaluation
    out = folder / MANIFEST
    out.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return out


def add_evaluation(folder: Path, evaluation: dict[str, Any]) -> Path:
    """Record ``evaluation`` (figures of ``bitpress eval``) in ``folder``'s manifest; its file list stays."""
    path = Path(folder) / MANIFEST
    data = json.loads(path.read_text())
    data["eval"] = evaluation
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


@dataclass
class VerifyResult:
    folder: Path | str  # a local folder, or org/name@commit/path on the Hub
    checked: int = 0
    bytes: int = 0
    missing: list[str] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)  # shorter than recorded
    resized: list[str] = field(default_factory=list)  # longer than recorded
    changed: list[str] = field(default_factory=list)  # same size, other bytes
    unlisted: list[str] = field(default_factory=list)  # files the manifest does not name

    @property
    def ok(self) -> bool:
        return not (self.missing or self.truncated or self.resized or self.changed)

    def problems(self) -> list[str]:
        from bitpress.errors import summarize_names

        out = []
        for label, names in (("missing", self.missing), ("truncated", self.truncated),
                             ("longer than recorded", self.resized), ("changed (other bytes)", self.changed)):
            if names:
                out.append(f"{len(names)} {label}: {summarize_names(names, limit=5)}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "ok": self.ok, "checked": self.checked, "bytes": self.bytes,
                "missing": self.missing, "truncated": self.truncated, "longer": self.resized,
                "changed": self.changed, "unlisted": self.unlisted}


def entries(data: Any, where: str) -> list[tuple[str, int, str]]:
    """A manifest's files as (name, size, sha256), each name checked to be relative and to stay inside its
    folder; raises :class:`ModelLoadError` when ``data`` is not a manifest."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), list):
        raise ModelLoadError(f"{where} is not a {FORMAT} manifest")
    out = []
    for i, e in enumerate(data["files"]):
        at = f"{where} files[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("size"), int) or not isinstance(e.get("sha256"), str):
            raise ModelLoadError(f"{at} must hold path, size and sha256")
        out.append((paths.check_name(e.get("path"), f"{at}.path").as_posix(), e["size"], e["sha256"]))
    return out


def compare(label: Path | str, listed: list[tuple[str, int, str]], size: Callable[[str], int | None],
            digest: Callable[[str], str], present: list[str]) -> VerifyResult:
    """What differs between a manifest's files and a copy: ``size(name)`` (None: absent) and ``digest(name)``
    (sha256, asked only when the size matches) of the copy's files, ``present``: every file the copy has.
    Local folders and repos on the Hub are checked by this one rule."""
    res = VerifyResult(label)
    names = set()
    for name, want, sha in listed:
        names.add(name)
        got = size(name)
        if got is None:
            res.missing.append(name)
        elif got < want:
            res.truncated.append(name)
        elif got > want:
            res.resized.append(name)
        else:
            res.checked += 1
            res.bytes += got
            if digest(name) != sha:
                res.changed.append(name)
    res.unlisted = sorted(p for p in present if p not in names | {MANIFEST})
    return res


def verify(folder: Path) -> VerifyResult:
    """Check ``folder`` against its manifest; raises :class:`ModelLoadError` when there is none or it is
    malformed, and returns what differs (see :attr:`VerifyResult.ok`)."""
    folder = Path(folder)
    base = paths.resolve_root(folder)
    if paths.optional(folder, MANIFEST, "manifest") is None:
        raise ModelLoadError(f"{folder} has no {MANIFEST} (written with every package bitpress builds)")
    try:
        data = json.loads(paths.read_text(folder, MANIFEST, "manifest"))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"{folder / MANIFEST} is not valid JSON: {exc}") from None
    listed = entries(data, str(folder / MANIFEST))

    def size(name: str) -> int | None:
        if not paths.lexists(folder / name):
            return None
        return paths.inside(folder, name, "file of the package", base=base).stat().st_size  # links stay inside

    def digest(name: str) -> str:
        return sha256_of(paths.inside(folder, name, "file of the package", base=base))[1]

    present = [p.relative_to(folder).as_posix() for p, _ in paths.walk(folder, "file of the package")]
    return compare(folder, listed, size, digest, present)


def check(folder: Path) -> VerifyResult:
    """:func:`verify`, raising :class:`ValidationError` with every difference when there is one."""
    res = verify(folder)
    if not res.ok:
        raise ValidationError(f"{folder} does not match its manifest: " + "; ".join(res.problems()))
    return res
