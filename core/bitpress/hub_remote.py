"""A model repo on the Hugging Face Hub seen from here, for ``bitpress publish --push`` and ``bitpress verify
org/name``: its files at one commit with their sizes and hashes (:func:`tree`), a small file's bytes
(:func:`read`), the repo created (:func:`create`) and a folder's files committed (:func:`upload`).

Hashes: the Hub lists every file's git blob id and size, and for files kept in LFS (or Xet storage) the
sha256 of the content; regular git files (configs, tokenizers: under 10 MB) have no sha256 in the
listing, so they are compared by git blob id (:func:`git_oid` of the local file) or read. Every failure
of the client is one :class:`~bitpress.hub.HubError` saying what to do (log in, the rights a token
needs, a repo or revision that does not exist, the Hub unreachable, ``HF_HUB_OFFLINE``).

May import: errors, hub.
"""

from __future__ import annotations

import glob
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bitpress.errors import one_line
from bitpress.hub import HUB_INSTALL_HINT, HubError, is_connection_error, offline_mode, parse

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
#: the Hub refuses regular (non-LFS) git files above this size, so reading one to hash it stays small
REGULAR_MAX = 10 * 1024 * 1024


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    git_oid: str  # the git blob sha1 the Hub lists for every file
    sha256: str | None  # LFS / Xet files: the content's sha256; regular git files: None


@dataclass
class RemoteTree:
    """A repo's files under ``under`` at ``commit`` (``exists`` False: no such repo yet, no files)."""

    repo_id: str
    revision: str | None
    commit: str | None
    under: str = ""
    files: dict[str, RemoteFile] = field(default_factory=dict)
    exists: bool = True


@dataclass(frozen=True)
class HubTarget:
    """``org/name[@revision][/path]``: a folder of a model repo at a revision (None: the default branch)."""

    repo_id: str
    revision: str | None
    path: str  # "" for the repo's root

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.repo_id}{rev}" + (f"/{self.path}" if self.path else "")


def parse_target(text: str, revision: str | None = None) -> HubTarget | None:
    """``org/name[@revision][/path]`` as a :class:`HubTarget`, or None when it does not have that shape.
    ``revision`` (``--revision``) is used when the text names none; naming two different ones is an error."""
    parts = text.strip("/").split("/")
    if len(parts) < 2 or any(p in ("", ".", "..") for p in parts[2:]):
        return None
    found = parse("/".join(parts[:2]))
    if found is None:
        return None
    if found.revision and revision and found.revision != revision:
        raise HubError(f"{text}: names revision {found.revision} and --revision {revision}: give one")
    return HubTarget(found.repo_id, found.revision or revision, "/".join(parts[2:]))


def git_oid(path: Path) -> str:
    """The git blob id (sha1 of ``blob <size>\\0`` and the bytes) of a local file, as the Hub lists it."""
    size = path.stat().st_size
    h = hashlib.sha1(b"blob %d\0" % size)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def client(purpose: str) -> Any:
    """huggingface_hub's :class:`HfApi` (its endpoint and token from the environment, as ``hf`` uses them)."""
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise HubError(f"{purpose} needs the huggingface_hub client: {HUB_INSTALL_HINT}") from None
    if offline_mode():
        raise HubError(f"{purpose} needs the Hub, and HF_HUB_OFFLINE is set: unset it (the Hub is reached at "
                       f"{_endpoint()})")
    return HfApi()


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def tree(api: Any, repo_id: str, revision: str | None = None, *, under: str = "",
         missing_ok: bool = False) -> RemoteTree:
    """Every file of ``repo_id`` under ``under`` at ``revision`` (the commit it resolves to, read once, so the
    listing is of one commit). ``missing_ok``: a repo that does not exist is an empty, non-existing tree."""
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

    what = f"{repo_id}{'@' + revision if revision else ''}"
    try:
        commit = api.model_info(repo_id, revision=revision).sha
        out = RemoteTree(repo_id, revision, commit, under.strip("/"))
        try:
            entries = api.list_repo_tree(repo_id, path_in_repo=out.under or None, revision=commit, recursive=True)
            for e in entries:
                if not hasattr(e, "size"):  # a folder
                    continue
                lfs = getattr(e, "lfs", None)
                sha = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)) if lfs else None
                out.files[e.path] = RemoteFile(e.path, int(e.size), e.blob_id, sha)
        except EntryNotFoundError:  # no such folder: no files there
            pass
    except Exception as exc:
        if missing_ok and isinstance(exc, RepositoryNotFoundError) and not _is_auth(exc):
            return RemoteTree(repo_id, revision, None, under.strip("/"), exists=False)
        raise error(exc, f"listing {what}") from exc
    return out


def read(api: Any, repo_id: str, commit: str, path: str, limit: int = REGULAR_MAX) -> bytes:
    """The bytes of a (small) file of the repo at ``commit``, not kept on disk."""
    from urllib.parse import quote

    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = f"{api.endpoint}/{repo_id}/resolve/{quote(commit, safe='')}/{quote(path)}"
    try:
        r = get_session().get(url, headers=build_hf_headers(token=api.token), follow_redirects=True)
        hf_raise_for_status(r)
    except Exception as exc:
        raise error(exc, f"reading {path} of {repo_id}@{commit[:12]}") from exc
    if len(r.content) > limit:
        raise HubError(f"{repo_id}: {path} is {len(r.content)} bytes, more than a manifest or regular file holds")
    return r.content


def create(api: Any, repo_id: str, *, private: bool | None = None) -> None:
    """The model repo, created when it does not exist (an existing one is used as it is)."""
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    except Exception as exc:
        raise error(exc, f"creating the model repo {repo_id}") from exc


def upload(api: Any, repo_id: str, folder: Path, names: list[str], *, path_in_repo: str, revision: str | None,
           message: str) -> str:
    """Commit ``names`` (relative to ``folder``) to ``path_in_repo`` of the repo, in one upload: large files
    through the Hub's LFS or Xet storage, by huggingface_hub (which resumes what it had sent when run again).
    Returns the commit."""
    try:
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), path_in_repo=path_in_repo or None,
                                 allow_patterns=[glob.escape(n) for n in names], revision=revision,
                                 repo_type="model", commit_message=message)
    except Exception as exc:
        raise error(exc, f"uploading {path_in_repo or folder.name} to {repo_id}") from exc
    return str(getattr(info, "oid", "") or "")


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _is_auth(exc: BaseException) -> bool:
    return _status(exc) in (401, 403)


def error(exc: BaseException, doing: str) -> HubError:
    """A client failure while ``doing`` something, as one :class:`HubError` that says what to do."""
    if isinstance(exc, HubError):
        return exc
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    status = _status(exc)
    server = ""
    response = getattr(exc, "response", None)
    if response is not None:
        server = response.headers.get("X-Error-Message") or ""
    said = f" (the Hub said: {one_line(server, 200)})" if server else ""
    if isinstance(exc, OfflineModeIsEnabled):
        return HubError(f"{doing}: HF_HUB_OFFLINE is set: unset it to reach the Hub")
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{doing}: no such revision (a branch, tag or commit hash){said}")
    if isinstance(exc, GatedRepoError):
        return HubError(f"{doing}: the repo is gated: accept its terms on the Hub, then log in (`hf auth login` "
                        "or HF_TOKEN)")
    if status == 401:
        return HubError(f"{doing}: the Hub refused the credentials{said}: log in with `hf auth login` or set "
                        "HF_TOKEN to a token (a write token to upload)")
    if status == 403:
        return HubError(f"{doing}: the token may not do this{said}: uploading needs a token with write access "
                        "to the repo's namespace (`hf auth login`, HF_TOKEN)")
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(f"{doing}: no such model repo on the Hub (or it is private: log in with `hf auth login` "
                        "or set HF_TOKEN); check the name")
    if isinstance(exc, HFValidationError):
        return HubError(f"{doing}: {one_line(exc, 200)}")
    if is_connection_error(exc):  # the same rule as a Hub id's download
        return HubError(f"{doing}: the Hub at {_endpoint()} could not be reached ({type(exc).__name__}: "
                        f"{one_line(exc, 200)}); check the network (HF_ENDPOINT) and run again")
    code = f"HTTP {status}: " if status else f"{type(exc).__name__}: "
    return HubError(f"{doing}: {code}{one_line(exc, 300)}")
