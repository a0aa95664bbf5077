"""``bitpress verify org/name[@revision][/path]``: the packages of a model repo on the Hub checked against their
``bitpress-manifest.json``, without downloading them.

The repo's files are listed once at one commit (sizes, git blob ids, LFS sha256); each manifest under the
path is read (a few kB) and every file it names is compared by :func:`bitpress.genai.manifest.compare`,
the rule a local folder is checked by: missing, truncated (shorter than recorded), longer, changed (same
size, other bytes). Files in LFS or Xet storage are compared by the sha256 the Hub lists; regular git
files (configs, tokenizer files, under 10 MB) are read and hashed. A publish index
(``bitpress-publish.json``) under the path names the packages that must be there: one listed as built
whose manifest is absent is reported missing as a whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from bitpress.errors import ModelLoadError
from bitpress.genai.manifest import MANIFEST, VerifyResult, compare, entries
from bitpress.hub_remote import HubTarget, RemoteTree, client, read, tree

log = logging.getLogger(__name__)

INDEX = "bitpress-publish.json"  # bitpress.genai.publish.INDEX (publish imports the workflow; this module does not)


@dataclass
class HubVerifyResult:
    """Every package found under a Hub path and what differs; ``missing_packages``: cells the publish index
    lists as built whose manifest is not on the Hub."""

    target: HubTarget
    commit: str | None
    packages: list[VerifyResult] = field(default_factory=list)
    missing_packages: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.packages) and all(p.ok for p in self.packages) and not self.missing_packages

    def problems(self) -> list[str]:
        out = [f"{p.folder}: " + "; ".join(p.problems()) for p in self.packages if not p.ok]
        if self.missing_packages:
            out.append(f"{len(self.missing_packages)} package(s) listed in {INDEX} but not on the Hub: "
                       + ", ".join(self.missing_packages))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"repo": self.target.repo_id, "revision": self.target.revision, "commit": self.commit,
                "path": self.target.path, "ok": self.ok, "packages": [p.to_json() for p in self.packages],
                "missing_packages": self.missing_packages}


def verify_hub(target: HubTarget, *, api: Any = None) -> HubVerifyResult:
    """Check every package under ``target`` (see the module's docstring)."""
    api = api or client(f"verifying {target}")
    listing = tree(api, target.repo_id, target.revision, under=target.path)
    return verify_listing(api, target, listing)


def verify_listing(api: Any, target: HubTarget, listing: RemoteTree) -> HubVerifyResult:
    """:func:`verify_hub` on a listing already read: every manifest under its path, read from the Hub."""
    assert listing.commit is not None
    res = HubVerifyResult(target, listing.commit)
    prefix = f"{listing.under}/" if listing.under else ""
    folders = sorted(p[: -len(MANIFEST)].rstrip("/") for p in listing.files
                     if p == prefix + MANIFEST or (p.startswith(prefix) and p.endswith("/" + MANIFEST)))
    if not folders and prefix + INDEX not in listing.files:
        raise ModelLoadError(f"{target} (commit {listing.commit[:12]}) holds no {MANIFEST}: nothing bitpress "
                             f"published is there ({len(listing.files)} file(s) listed)")
    for folder in folders:
        label = f"{target.repo_id}@{listing.commit[:12]}/{folder}".rstrip("/")
        where = f"{folder}/{MANIFEST}" if folder else MANIFEST
        try:
            data = json.loads(read(api, target.repo_id, listing.commit, where))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ModelLoadError(f"{label}/{MANIFEST} is not valid JSON: {exc}") from None
        res.packages.append(compare_folder(api, listing, folder, label, entries(data, f"{label}/{MANIFEST}")))
    res.missing_packages += _indexed_but_absent(api, listing, prefix, folders)
    return res


def compare_folder(api: Any, listing: RemoteTree, folder: str, label: str,
                   listed: list[tuple[str, int, str]]) -> VerifyResult:
    """The files of ``folder`` (a repo path) in ``listing`` against ``listed`` (name, size, sha256)."""
    base = f"{folder}/" if folder else ""

    def size(name: str) -> int | None:
        f = listing.files.get(base + name)
        return None if f is None else f.size

    def digest(name: str) -> str:
        f = listing.files[base + name]
        if f.sha256 is not None:
            return f.sha256
        return hashlib.sha256(read(api, listing.repo_id, str(listing.commit), f.path)).hexdigest()

    present = [p[len(base):] for p in listing.files if p.startswith(base)]
    nested = {p[: -len(MANIFEST)] for p in present if p.endswith("/" + MANIFEST)}
    present = [p for p in present if not any(p.startswith(n) for n in nested)]  # other packages' files
    return compare(label, listed, size, digest, present)


def _indexed_but_absent(api: Any, listing: RemoteTree, prefix: str, folders: list[str]) -> list[str]:
    """Cells a publish index at the top of the path lists as built whose manifest the Hub does not have."""
    where = prefix + INDEX
    if where not in listing.files:
        return []
    try:
        index = json.loads(read(api, listing.repo_id, str(listing.commit), where))
        cells = [c["folder"] for c in index.get("cells", []) if c.get("status") == "ok"]
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, AttributeError, KeyError, TypeError):
        log.warning("%s on the Hub is not a publish index: its cells are not checked", where)
        return []
    have = set(folders)
    return [c for c in cells if isinstance(c, str) and prefix + c not in have]
