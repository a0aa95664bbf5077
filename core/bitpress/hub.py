"""Hugging Face Hub ids as inputs: ``org/name[@revision]`` (and a subfolder) made a folder of the local Hub cache.

A string is a Hub id only when no local file or folder of that name exists (a local path always
wins), it has the Hub's shape (``org/name``, an optional ``@revision``; checked with huggingface_hub's
own validator) and it does not look like a path (``./x``, ``/x``, ``~/x``, a model-file suffix, a first
part that is a local folder): a mistyped local path is an error naming what was tried, never a
download. :func:`resolve` turns one into the snapshot folder of the Hub cache that holds what the run
needs (``allow_patterns`` chosen by the model's kind, :data:`PATTERNS`):

* offline (``HF_HUB_OFFLINE=1``, or huggingface_hub's own offline setting), from the cache only
  (``snapshot_download(..., local_files_only=True)``); the kind is read from the cached snapshot;
* online, the kind is read from the repo's file list and only those files are downloaded into the cache.

The resolved commit is kept (:class:`HubModel`): the run records it in its report and in the
output's metadata. Every failure is a :class:`HubError` saying what to do (download first, the
revision that does not exist, ``pip install "bitpress[hub]"``).

May import: errors.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from bitpress.errors import ModelLoadError, one_line

HUB_INSTALL_HINT = 'pip install "bitpress[hub]"'

#: tokenizer files (any of them may be there; a run needs those of its model's tokenizer)
TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                      "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
                      "sentencepiece.bpe.model", "chat_template.json", "chat_template.jinja")
#: the files each kind of model needs, relative to its folder (the repo's root or the subfolder); a GenAI
#: package is its whole folder
PATTERNS: dict[str, tuple[str, ...]] = {
    "onnx": ("*.onnx", "*.onnx.data", "*.data", "*.onnx_data", "*.json", *TOKENIZER_PATTERNS),
    "genai-package": ("*",),
    "safetensors": ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                    *TOKENIZER_PATTERNS),
    "tokenizer": (*TOKENIZER_PATTERNS, "config.json"),
}
#: names ending so are files, never Hub ids (a typo of ``model/decoder.onnx`` is not a repo)
_FILE_SUFFIXES = (".onnx", ".gguf", ".safetensors", ".json", ".npz", ".txt", ".data", ".yaml", ".yml", ".bin")
#: the Hub's repo-id rule, for when huggingface_hub is not installed (it is the same as its validator's)
_REPO_ID = re.compile(r"^[\w.\-]{1,96}/[\w.\-]{1,96}$")


class HubError(ModelLoadError):
    """A Hub id cannot be made a local folder: not cached while offline, no such repo or revision, no client."""


@dataclass(frozen=True)
class HubId:
    """``org/name`` and the revision asked for (None: the default branch), as written."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass
class HubModel:
    """A Hub id resolved: the snapshot folder of the cache, the commit it is, and what was taken from it."""

    repo_id: str
    revision: str | None
    commit: str
    subfolder: str | None
    kind: str
    snapshot: Path
    offline: bool
    allow_patterns: list[str] = field(default_factory=list)
    #: why the cache alone was read: "offline", or the Hub could not be reached (and why)
    why_cache: str = ""

    @property
    def path(self) -> Path:
        """The local folder the run reads: the snapshot, or its subfolder."""
        return self.snapshot / self.subfolder if self.subfolder else self.snapshot

    @property
    def tokenizer_dir(self) -> Path | None:
        """Where the model's tokenizer is: its own folder, else (a subfolder without one) the repo's root."""
        for folder in (self.path, self.snapshot):
            if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
                return folder
        return None

    def record(self) -> dict[str, Any]:
        """What the output's metadata and the run report keep: the same for equal runs (no local path)."""
        return {"hub": self.repo_id, "revision": self.revision, "commit": self.commit,
                "subfolder": self.subfolder, "kind": self.kind}

    def __str__(self) -> str:
        sub = f" (subfolder {self.subfolder})" if self.subfolder else ""
        return f"{self.repo_id}@{self.commit}{sub}"


# -- recognising a Hub id ---------------------------------------------------------------------------
def parse(text: object) -> HubId | None:
    """``org/name[@revision]`` as a :class:`HubId`, or None when ``text`` does not have the Hub's shape.

    Only strings: a :class:`os.PathLike` is a local path whatever it says.
    """
    if not isinstance(text, str) or not text or text != text.strip():
        return None
    if text.startswith(("/", "./", "../", "~", "\\")) or "\\" in text or "\0" in text:
        return None
    repo_id, at, revision = text.partition("@")
    if at and (not revision or any(c.isspace() for c in revision) or ".." in revision):
        return None
    if repo_id.count("/") != 1 or repo_id.lower().endswith(_FILE_SUFFIXES):
        return None
    if not _valid_repo_id(repo_id):
        return None
    return HubId(repo_id, revision or None)


def _valid_repo_id(repo_id: str) -> bool:
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:  # the shape alone: resolving says to install the client
        return bool(_REPO_ID.fullmatch(repo_id)) and "--" not in repo_id and ".." not in repo_id
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def local_path(value: str | os.PathLike[str], base: str | os.PathLike[str] | None = None) -> Path:
    """``value`` as a local path (relative ones to ``base`` when given)."""
    p = Path(value).expanduser() if isinstance(value, str) and value.startswith("~") else Path(value)
    return Path(base) / p if base is not None and not p.is_absolute() else p


def hub_id(value: object, base: str | os.PathLike[str] | None = None) -> HubId | None:
    """The Hub id ``value`` names, or None: a local path (existing, or shaped like one), or not a string.

    A string whose first part is an existing local folder (``models/llama`` beside ``models/``) is a
    local path that is missing, not a Hub id: a typo is never looked up on the Hub.
    """
    if not isinstance(value, str):
        return None
    local = local_path(value, base)
    if os.path.lexists(local):
        return None
    found = parse(value)
    if found is None:
        return None
    org = local_path(found.repo_id.split("/", 1)[0], base)
    if os.path.isdir(org):
        return None
    return found


# -- resolving ----------------------------------------------------------------------------------------
def resolve(value: str | os.PathLike[str], *, subfolder: str | None = None, what: str = "model",
            base: str | os.PathLike[str] | None = None, kind: str | None = None) -> tuple[Path, HubModel | None]:
    """The local path ``value`` names, and the :class:`HubModel` when it is a Hub id (None for a local path).

    A local path is returned as it is (joined to ``base`` when relative, ``subfolder`` appended);
    whether it exists is for the loader to say. ``kind``: ``"tokenizer"`` for a tokenizer, else
    the model's kind is found from its files. ``what`` names the value in messages (``--reference``).
    """
    sub = _subfolder(subfolder, what)
    found = hub_id(value, base)
    if found is None:
        local = local_path(value, base)
        return (local / sub if sub else local), None
    model = download(found, subfolder=sub, what=what, kind=kind, tried=local_path(value, base))
    return model.path, model


def _subfolder(subfolder: str | None, what: str) -> str | None:
    if subfolder is None:
        return None
    if not isinstance(subfolder, str):
        raise HubError(f"{what}: the subfolder must be a folder name (a string), got {type(subfolder).__name__}")
    sub = subfolder.replace("\\", "/").strip("/")
    parts = [p for p in sub.split("/") if p not in ("", ".")]
    if ".." in parts or sub.startswith("~") or Path(subfolder).is_absolute():
        raise HubError(f"{what}: the subfolder {subfolder!r} must be a folder inside the model (no .., not absolute)")
    return "/".join(parts) or None


def offline_mode() -> bool:
    """Whether the Hub may not be reached: ``HF_HUB_OFFLINE`` now, or huggingface_hub's setting (read at import)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
        return True
    from huggingface_hub import constants

    check = getattr(constants, "is_offline_mode", None)
    return bool(check() if callable(check) else constants.HF_HUB_OFFLINE)


def download(hub: HubId, *, subfolder: str | None = None, what: str = "model", kind: str | None = None,
             tried: Path | None = None) -> HubModel:
    """:func:`resolve` for a Hub id: the snapshot folder with the files a run of ``kind`` needs, from the
    cache when offline, downloaded into it otherwise."""
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise HubError(f"{what} {hub}: {_not_local(tried)}; it reads as a Hugging Face Hub id, which needs the "
                       f"huggingface_hub client: {HUB_INSTALL_HINT}") from None
    if offline_mode():
        return _from_cache(hub, subfolder, what, kind, tried, reason="offline")
    return _from_hub(hub, subfolder, what, kind, tried)


def _from_hub(hub: HubId, subfolder: str | None, what: str, kind: str | None, tried: Path | None) -> HubModel:
    from huggingface_hub import HfApi, snapshot_download

    try:
        info = HfApi().model_info(hub.repo_id, revision=hub.revision)
        files = [s.rfilename for s in info.siblings or []]
        found, allow = select(files, subfolder, kind, f"{what} {hub}")
        folder = snapshot_download(hub.repo_id, revision=hub.revision, allow_patterns=allow)
    except HubError:
        raise
    except Exception as exc:  # huggingface_hub's and httpx's errors, mapped to one line each
        if is_connection_error(exc):  # the Hub cannot be reached: the cache may still have it
            return _from_cache(hub, subfolder, what, kind, tried, reason=f"the Hub could not be reached "
                               f"({type(exc).__name__}: {one_line(exc, 200)})")
        raise _error(exc, hub, what, tried) from exc
    return HubModel(hub.repo_id, hub.revision, Path(folder).name, subfolder, found, Path(folder), False, allow)


def _from_cache(hub: HubId, subfolder: str | None, what: str, kind: str | None, tried: Path | None,
                reason: str) -> HubModel:
    from huggingface_hub import snapshot_download

    try:
        # where the snapshot is (patterns that match nothing: a folder only partly downloaded is found too)
        folder = Path(snapshot_download(hub.repo_id, revision=hub.revision, local_files_only=True, allow_patterns=[]))
        files = _cached_files(hub, folder)
        found, allow = select(files, subfolder, kind, f"{what} {hub} (the cached snapshot {folder.name})")
        # again with the files this run needs: an incomplete snapshot (the cached file list says so) is refused
        snapshot_download(hub.repo_id, revision=hub.revision, local_files_only=True, allow_patterns=allow)
    except HubError:
        raise
    except Exception as exc:  # as above
        raise _error(exc, hub, what, tried, offline=reason) from exc
    return HubModel(hub.repo_id, hub.revision, folder.name, subfolder, found, folder, True, allow, reason)


def _cached_files(hub: HubId, folder: Path) -> list[str]:
    """The repo's files at that commit: the cached file list huggingface_hub keeps, else the snapshot's files."""
    try:
        from huggingface_hub import get_cached_repo_tree
    except ImportError:  # older huggingface_hub
        get_cached_repo_tree = None
    if get_cached_repo_tree is not None:
        try:
            return [f.path for f in get_cached_repo_tree(hub.repo_id, revision=folder.name)]
        except Exception:  # no cached list: the snapshot's own files
            pass
    out = []
    for dirpath, _, names in os.walk(folder):  # the snapshot's entries (links into ../../blobs) as names only
        rel = Path(dirpath).relative_to(folder)
        out += [(rel / n).as_posix() for n in names]
    return sorted(out)


def select(files: list[str], subfolder: str | None, kind: str | None, where: str) -> tuple[str, list[str]]:
    """The model's kind (from the top of ``subfolder``) and the repo files to take, as exact ``allow_patterns``.

    A GenAI package (``genai_config.json``) is its whole folder; an ONNX model, a safetensors checkpoint
    or a tokenizer the files of :data:`PATTERNS` at the top of the folder (plus the root's tokenizer
    files when a subfolder has none).
    """
    prefix = f"{subfolder}/" if subfolder else ""
    inside = {f[len(prefix):]: f for f in files if f.startswith(prefix)}
    if not inside:
        raise HubError(f"{where} has no folder {subfolder}" if subfolder else f"{where} holds no files")
    top = [r for r in inside if "/" not in r]
    if kind is None:
        if "genai_config.json" in top:
            kind = "genai-package"
        elif any(r.endswith(".onnx") for r in top):
            kind = "onnx"
        elif any(r.endswith(".safetensors") for r in top):
            kind = "safetensors"
        else:
            raise HubError(f"{where} holds no ONNX model, GenAI package or safetensors checkpoint at "
                           f"{'the top of ' + subfolder if subfolder else 'its root'}{_where_models(files, prefix)}")
    patterns = PATTERNS[kind]
    if kind == "genai-package":
        chosen = [full for r, full in inside.items() if not r.startswith(".")]
    else:
        chosen = [inside[r] for r in top if any(fnmatch(r, p) for p in patterns)]
        if prefix and not any(r in TOKENIZER_PATTERNS[:2] for r in top):  # the repo's tokenizer at its root
            chosen += [f for f in files if "/" not in f and f in TOKENIZER_PATTERNS]
    if kind == "tokenizer" and not chosen:
        raise HubError(f"{where} has no tokenizer files ({', '.join(TOKENIZER_PATTERNS[:2])})")
    return kind, [glob.escape(f) for f in sorted(set(chosen))]


def _where_models(files: list[str], prefix: str) -> str:
    """``; models are in onnx/, cpu-int4/: pass --subfolder onnx`` for a repo whose models are deeper."""
    folders = sorted({f.rsplit("/", 1)[0] for f in files if f.startswith(prefix) and "/" in f[len(prefix):]
                      and (f.endswith((".onnx", ".safetensors")) or f.endswith("/genai_config.json"))})
    if not folders:
        return ""
    shown = ", ".join(f"{d}/" for d in folders[:5]) + (" ..." if len(folders) > 5 else "")
    return f"; models are in {shown}: pass --subfolder {folders[0]} (subfolder: in a config)"


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the Hub could not be reached (offline mode included; a proxy refusal is not)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(exc, OfflineModeIsEnabled):
        return True
    try:
        import httpx
    except ImportError:
        return isinstance(exc, ConnectionError | TimeoutError)
    return isinstance(exc, httpx.ConnectError | httpx.TimeoutException | ConnectionError | TimeoutError) and not \
        isinstance(exc, httpx.ProxyError)


def _not_local(tried: Path | None) -> str:
    return f"no local file or folder {tried} exists" if tried is not None else "not a local path"


def _download_hint(hub: HubId) -> str:
    rev = f" --revision {hub.revision}" if hub.revision else ""
    return f"`hf download {hub.repo_id}{rev}` (huggingface-cli download in older huggingface_hub)"


def _error(exc: BaseException, hub: HubId, what: str, tried: Path | None, offline: str | None = None) -> HubError:
    """huggingface_hub's error as a :class:`HubError` that says what was tried and what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:  # older huggingface_hub
        IncompleteSnapshotError = ()
    head = f"{what} {hub}: {_not_local(tried)}, and as a Hugging Face Hub id"
    if IncompleteSnapshotError and isinstance(exc, IncompleteSnapshotError):
        return HubError(f"{head} its cached snapshot misses files this run needs ({one_line(exc, 300)}); "
                        f"download them with {_download_hint(hub)}, or run once without HF_HUB_OFFLINE")
    if isinstance(exc, LocalEntryNotFoundError):
        rev = f" at revision {hub.revision}" if hub.revision else ""
        if offline == "offline":
            why, fix = "the Hub is offline (HF_HUB_OFFLINE)", "or unset HF_HUB_OFFLINE to download it now"
        else:  # the client could not reach the Hub (while listing, or while downloading a file)
            why = offline or f"the download failed ({one_line(exc, 200)})"
            fix = f"or check the network (the Hub is reached at {constants.ENDPOINT}; HF_ENDPOINT) and run again"
        return HubError(f"{head} it is not in the Hugging Face cache{rev} ({constants.HF_HUB_CACHE}) and {why}: "
                        f"download it first with {_download_hint(hub)}, {fix}")
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{head} the repo has no revision {hub.revision!r} (a branch, tag or commit hash)")
    if isinstance(exc, GatedRepoError):
        return HubError(f"{head} the repo is gated: accept its terms on huggingface.co, then log in "
                        "(`hf auth login` or HF_TOKEN)")
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(f"{head} no such model repo on the Hub (or it is private: log in with `hf auth login` or "
                        "set HF_TOKEN); check the name")
    if isinstance(exc, HFValidationError):
        return HubError(f"{head} it is not valid: {one_line(exc, 200)}")
    return HubError(f"{head} it could not be fetched: {type(exc).__name__}: {one_line(exc, 300)}")


def describe(model: HubModel) -> str:
    """One line for the run report: which repo, revision and commit, and whether it came from the cache only."""
    rev = f" (revision {model.revision})" if model.revision and model.revision != model.commit else ""
    sub = f", subfolder {model.subfolder}" if model.subfolder else ""
    how = f"the local Hugging Face cache ({model.why_cache or 'offline'})" if model.offline \
        else "the Hugging Face Hub, via the local cache"
    return f"input {model.repo_id}{rev} at commit {model.commit}{sub}, from {how}"
