"""``bitpress publish CONFIG --push org/name``: a publish output uploaded to a model repo on the Hub, one commit
per package, then checked there against every package's manifest.

Before anything is sent, each package the publish index (``bitpress-publish.json``) lists as built is
checked against its own ``bitpress-manifest.json`` here (a package that does not match is never
uploaded), and the repo's files are listed once: a file whose size and hash (LFS sha256, else git blob
id) already match is not sent again. That is what makes a push resumable: an interrupted run (a network
failure, a refused commit) is run again and sends only what did not arrive; inside one package,
huggingface_hub itself resumes large files (the LFS objects or Xet chunks it had uploaded are not sent
twice). The index goes last, so a repo whose index is there has every package it lists. Then the
repo is listed again at the new commit and each pushed package compared with the manifest it was sent
with (:func:`bitpress.genai.remote.compare_folder`): a file the Hub lost, cut short or replaced is
named. ``dry_run`` lists, per package, the files that would be sent (new or changed) and those that
are already there, and sends nothing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bitpress.errors import ModelLoadError, ValidationError
from bitpress.genai.manifest import MANIFEST, VerifyResult, entries, sha256_of, verify
from bitpress.genai.remote import INDEX, compare_folder
from bitpress.hub import HubError, offline_mode
from bitpress.hub_remote import RemoteTree, client, create, git_oid, tree, upload

log = logging.getLogger(__name__)


@dataclass
class PlannedFile:
    name: str  # relative to the package's folder
    size: int
    state: str  # new | changed | same (on the Hub already, byte for byte)


@dataclass
class PackageUpload:
    folder: str  # the package's folder in the output and in the repo
    files: list[PlannedFile] = field(default_factory=list)
    status: str = "planned"  # planned | pushed | unchanged
    commit: str | None = None
    verified: VerifyResult | None = None

    @property
    def to_send(self) -> list[PlannedFile]:
        return [f for f in self.files if f.state != "same"]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"folder": self.folder, "status": self.status, "commit": self.commit,
                               "files": [f.__dict__ for f in self.files]}
        if self.verified is not None:
            out["verified"] = self.verified.to_json()
        return out


@dataclass
class PushResult:
    repo_id: str
    revision: str | None
    dry_run: bool
    packages: list[PackageUpload] = field(default_factory=list)
    commit: str | None = None  # the repo's commit after the push (before it, for a dry run)
    remote_checked: bool = True  # False: a dry run that could not list the repo (offline)

    @property
    def bytes_to_send(self) -> int:
        return sum(f.size for p in self.packages for f in p.to_send)

    @property
    def ok(self) -> bool:
        return all(p.verified is None or p.verified.ok for p in self.packages)

    def to_json(self) -> dict[str, Any]:
        return {"repo": self.repo_id, "revision": self.revision, "dry_run": self.dry_run, "commit": self.commit,
                "remote_checked": self.remote_checked, "ok": self.ok, "bytes_to_send": self.bytes_to_send,
                "packages": [p.to_json() for p in self.packages]}


def built_packages(output: Path) -> list[str]:
    """The folders the publish index of ``output`` lists as built."""
    index = Path(output) / INDEX
    if not index.is_file():
        raise ModelLoadError(f"{output} has no {INDEX}: build it with `bitpress publish CONFIG` first")
    try:
        data = json.loads(index.read_text())
        cells = [c["folder"] for c in data["cells"] if c.get("status") == "ok"]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{index} is not a publish index: {exc}") from None
    if not cells:
        raise ModelLoadError(f"{index} lists no package that was built: nothing to push")
    return cells


def push(output: Path, repo_id: str, *, revision: str | None = None, private: bool | None = None,
         dry_run: bool = False, packages: list[str] | None = None) -> PushResult:
    """Upload the built packages of ``output`` (default: those its index lists) to ``repo_id`` (see the module)."""
    output = Path(output)
    names = packages if packages is not None else built_packages(output)
    listed = {name: _local(output, name) for name in names}  # every package checked before anything is sent
    result = PushResult(repo_id, revision, dry_run)
    if dry_run and offline_mode():
        result.remote_checked = False
        remote = RemoteTree(repo_id, revision, None, exists=False)
        api = None
    else:
        api = client(f"pushing {output} to {repo_id}")
        remote = tree(api, repo_id, revision, missing_ok=True)
    result.commit = remote.commit
    index = output / INDEX
    top = PackageUpload("", [_state(remote, INDEX, INDEX, index, None)]) if index.is_file() else None
    for name, files in listed.items():
        result.packages.append(PackageUpload(name, [_state(remote, f"{name}/{rel}", rel, output / name / rel, sha)
                                                    for rel, sha in files]))
    if dry_run:
        return result
    assert api is not None
    if not remote.exists:
        create(api, repo_id, private=private)
    elif private is not None:
        log.info("%s exists: its visibility is left as it is", repo_id)
    done: list[str] = []
    for pkg in [*result.packages, *([top] if top else [])]:  # the index last
        send = pkg.to_send
        if not send:
            pkg.status = "unchanged"
            done.append(pkg.folder or INDEX)
            continue
        size = sum(f.size for f in send)
        what = pkg.folder or INDEX
        log.info("uploading %s: %d file(s), %.1f MB", what, len(send), size / 1e6)
        try:
            pkg.commit = upload(api, repo_id, output / pkg.folder, [f.name for f in send], path_in_repo=pkg.folder,
                                revision=revision, message=f"bitpress publish: {what} ({len(send)} file(s))")
        except HubError as exc:
            there = (f"{len(done)} package(s) are on the Hub ({', '.join(done)})" if done
                     else "no package is on the Hub yet")
            raise HubError(f"{exc}; {there}; run the same command again to resume: what is on the Hub already is "
                           "not sent again") from exc
        pkg.status = "pushed"
        done.append(what)
    after = tree(api, repo_id, revision)  # the files as the Hub now has them, at one commit
    result.commit = after.commit
    for pkg in result.packages:
        label = f"{repo_id}@{str(after.commit)[:12]}/{pkg.folder}"
        pkg.verified = compare_folder(api, after, pkg.folder, label, _expected(output, pkg.folder, listed[pkg.folder]))
    return result


def _local(output: Path, name: str) -> list[tuple[str, str | None]]:
    """(name, sha256) of every file a package has, from its manifest, after checking the folder against it:
    a package that does not match its manifest is refused before anything is sent."""
    folder = output / name
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: listed in {output / INDEX} but not there: build it again "
                             "(`bitpress publish CONFIG`)")
    res = verify(folder)
    if not res.ok:
        raise ValidationError(f"{folder} does not match its {MANIFEST}, so it is not uploaded: "
                              + "; ".join(res.problems()) + " (rebuild it: `bitpress publish CONFIG --overwrite`)")
    if res.unlisted:
        raise ValidationError(f"{folder} holds file(s) its {MANIFEST} does not list ({', '.join(res.unlisted[:5])}): "
                              "they would be uploaded unchecked; remove them or rebuild the package")
    data = json.loads((folder / MANIFEST).read_text())
    return [(rel, sha) for rel, _, sha in entries(data, str(folder / MANIFEST))] + [(MANIFEST, None)]


def _expected(output: Path, name: str, files: list[tuple[str, str | None]]) -> list[tuple[str, int, str]]:
    """What the Hub must hold for a package: its manifest's files, and the manifest itself."""
    out = []
    for rel, sha in files:
        path = output / name / rel
        if sha is None:
            out.append((rel, *sha256_of(path)))
        else:
            out.append((rel, path.stat().st_size, sha))
    return out


def _state(remote: RemoteTree, repo_path: str, rel: str, local: Path, sha256: str | None) -> PlannedFile:
    """Whether the Hub has ``local`` at ``repo_path`` already (size, then LFS sha256 or git blob id)."""
    size = local.stat().st_size
    there = remote.files.get(repo_path)
    if there is None:
        return PlannedFile(rel, size, "new")
    if there.size != size:
        return PlannedFile(rel, size, "changed")
    if there.sha256 is not None:
        sha = sha256_of(local)[1] if sha256 is None else sha256
        same = there.sha256 == sha
    else:
        same = there.git_oid == git_oid(local)
    return PlannedFile(rel, size, "same" if same else "changed")

