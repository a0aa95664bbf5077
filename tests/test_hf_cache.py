"""Hugging Face hub cache snapshots as inputs, still confined (issue 32, bitpress.hfcache; docs/security.md).

The caches are built offline in ``tmp_path`` with huggingface_hub's own code: ``repo_folder_name``,
``_get_pointer_path``, ``_create_symlink`` (relative links ``../../blobs/<hash>``, or regular files in
its no-symlink mode), ``_cache_commit_hash_for_specific_revision`` (``refs/main``) and
``publish_blob_to_shared_store`` (the cache-wide store ``<cache>/blobs/<xx>/<sha256>`` with its
marker, the repo's blob left as a link into it); huggingface_hub's ``scan_cache_dir`` and
``try_to_load_from_cache`` read them back. From a snapshot folder an ONNX model with external data
is quantized (``bitpress.quantize``, the CLI, a pass that hands the graph to ONNX Runtime as bytes)
and evaluated, and a safetensors checkpoint is quantized with ``rtn_hf`` (streamed and loaded whole):
the same results as from a plain folder. Every way out of the repository's blobs is refused, one
case each, through a folder input (the listing) and a single ``.onnx`` input (the external-data
location), with an error naming the file and where it points.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

import bitpress
from bitpress import hfcache, paths
from bitpress.errors import ModelLoadError, UnsafeExternalDataError, UnsafePathError
from bitpress.plugins import Registry
from bitpress.synthetic import build_decoder

hf_download = pytest.importorskip("huggingface_hub.file_download")
hf_shared = pytest.importorskip("huggingface_hub.utils._shared_blobs")
from huggingface_hub import constants as hf_constants  # noqa: E402
from huggingface_hub import scan_cache_dir, try_to_load_from_cache  # noqa: E402

REPO = "org/name"
REV = "0123456789abcdef0123456789abcdef01234567"
DECODER = {"hidden": 64, "layers": 1, "heads": 4, "vocab": 128}
FEEDS = {"input_ids": np.arange(8, dtype=np.int64).reshape(1, 8) % 128}
LFS = (".onnx", ".data", ".safetensors")


# -- a cache, written by huggingface_hub's own code --------------------------------------------------
def git_sha1(data: bytes) -> str:
    """The Hub's etag of a file kept in git (not LFS): the git blob hash."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def storage(cache: Path, repo: str = REPO) -> Path:
    return cache / hf_download.repo_folder_name(repo_id=repo, repo_type="model")


def add_file(cache: Path, name: str, data: bytes, *, repo: str = REPO, shared: bool = False) -> Path:
    """Cache ``name`` of ``repo`` at ``REV`` as ``hf_hub_download`` leaves it; returns the snapshot's entry.

    LFS files (weights) are named by their sha256, others by their git sha1. ``shared``: the blob
    is then published to the cache-wide store, as a Xet download is.
    """
    folder = storage(cache, repo)
    etag = hashlib.sha256(data).hexdigest() if name.endswith(LFS) else git_sha1(data)
    blob = folder / "blobs" / etag
    blob.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        blob.write_bytes(data)
        if shared:
            assert hf_shared.publish_blob_to_shared_store(
                blob_path=str(blob), xet_hash=hashlib.sha256(b"xet" + data).hexdigest(), cache_dir=cache,
                expected_size=len(data))
    pointer = hf_download._get_pointer_path(str(folder), REV, name)
    os.makedirs(os.path.dirname(pointer), exist_ok=True)
    hf_download._create_symlink(str(blob), pointer, new_blob=True)
    hf_download._cache_commit_hash_for_specific_revision(str(folder), "main", REV)
    return Path(pointer)


def cache_folder(src: Path, cache: Path, sub: str = "", *, shared: tuple[str, ...] = ()) -> Path:
    """Every file of the folder ``src`` cached under ``sub/`` of the repo's snapshot; returns that folder."""
    for f in sorted(src.iterdir()):
        add_file(cache, f"{sub}/{f.name}" if sub else f.name, f.read_bytes(), shared=f.name in shared)
    return storage(cache) / "snapshots" / REV / sub


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain folder: ``model.onnx`` with its weights in ``model.onnx.data``."""
    return build_decoder(tmp_path_factory.mktemp("src") / "model.onnx", external_data=True, **DECODER).parent


#: how the snapshot holds the files: links into the repo's blobs; the data file's blob moved to the shared
#: store; regular files (huggingface_hub where links are not supported)
LAYOUTS = ("repo_blobs", "shared_store", "no_symlinks")


def make_snapshot(source: Path, tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    if layout == "no_symlinks":
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_SYMLINKS", True)
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_SYMLINKS_WARNING", True)
    shared = ("model.onnx.data",) if layout == "shared_store" else ()
    snap = cache_folder(source, cache, "onnx", shared=shared)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_SYMLINKS", False)
    return snap


@pytest.fixture
def registry(make_registry: Callable[..., Registry]) -> Registry:
    return make_registry()


def rtn(model: Path, out: Path, registry: Registry, **options: Any) -> Any:
    return bitpress.quantize(model, out, algorithm="rtn", precision="int4", options={"block_size": 32, **options},
                             registry=registry)


def logits(model: Path) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(["logits"], FEEDS)[0]


def errors(result: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for _, _, report in result.reports:
        out.update(report.errors)
    return out


# -- the layout is huggingface_hub's ---------------------------------------------------------------
def test_the_cache_is_huggingface_hubs_own(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snap = make_snapshot(source, tmp_path, "shared_store", monkeypatch)
    cache = tmp_path / "hub"
    info = scan_cache_dir(cache)
    (repo,) = info.repos
    assert repo.repo_id == REPO and [r.commit_hash for r in repo.revisions] == [REV]
    assert {f.file_name for f in next(iter(repo.revisions)).files} == {"model.onnx", "model.onnx.data"}
    assert try_to_load_from_cache(REPO, "onnx/model.onnx", cache_dir=cache) == str(snap / "model.onnx")
    onnx_hash = hashlib.sha256((source / "model.onnx").read_bytes()).hexdigest()
    assert os.readlink(snap / "model.onnx") == f"../../../blobs/{onnx_hash}"
    data_blob = storage(cache) / "blobs" / hashlib.sha256((source / "model.onnx.data").read_bytes()).hexdigest()
    xet = hashlib.sha256(b"xet" + (source / "model.onnx.data").read_bytes()).hexdigest()
    assert os.readlink(data_blob) == f"../../blobs/{xet[:2]}/{xet}"
    assert hf_shared.is_shared_blobs_dir(cache / "blobs")
    # recognised by its layout: the snapshot and any folder in it, nothing above it
    found = hfcache.snapshot_of(snap.resolve())
    assert found is not None and found.folder == snap.parent.resolve() and found.cache == cache.resolve()
    assert hfcache.snapshot_of(storage(cache).resolve()) is None
    # listed and opened as the blobs the links were checked to lead to
    listed = {p.name: real for p, real in paths.walk(snap)}
    assert listed == {"model.onnx": (storage(cache) / "blobs" / onnx_hash).resolve(),
                      "model.onnx.data": (cache / "blobs" / xet[:2] / xet).resolve()}
    assert paths.read_bytes(snap, "model.onnx.data", "data", limit=None) == (source / "model.onnx.data").read_bytes()


# -- ONNX: quantize and evaluate from a snapshot -----------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_onnx_from_a_snapshot(source: Path, tmp_path: Path, layout: str, registry: Registry,
                                       monkeypatch: pytest.MonkeyPatch,
                                       sha256_tree: Callable[[Path], dict[str, str]]) -> None:
    snap = make_snapshot(source, tmp_path, layout, monkeypatch)
    before = sha256_tree(tmp_path / "hub")
    plain = rtn(source / "model.onnx", tmp_path / "plain.onnx", registry)
    from_file = rtn(snap / "model.onnx", tmp_path / "from_file.onnx", registry)
    from_folder = rtn(snap, tmp_path / "from_folder", registry)
    assert errors(from_file) == errors(plain) == errors(from_folder) and errors(plain)
    want = logits(tmp_path / "plain.onnx")
    assert np.array_equal(logits(tmp_path / "from_file.onnx"), want)
    assert np.array_equal(logits(tmp_path / "from_folder" / "model.onnx"), want)
    # the output holds the quantized weights only: the input's data file is not carried as a companion
    assert sorted(os.listdir(tmp_path / "from_folder")) == ["model.onnx", "model.onnx.data"]
    assert os.path.getsize(tmp_path / "from_folder" / "model.onnx.data") < os.path.getsize(source / "model.onnx.data")
    assert sha256_tree(tmp_path / "hub") == before  # the cache is never modified


def test_quantize_and_eval_from_a_snapshot_on_the_command_line(source: Path, tmp_path: Path, run_cli,
                                                              registry: Registry,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    snap = make_snapshot(source, tmp_path, "repo_blobs", monkeypatch)
    code, _, err = run_cli("quantize", "-m", snap, "-o", tmp_path / "out", "--algorithm", "rtn", "--precision", "int4",
                           registry=registry)
    assert code == 0, err
    code, out, err = run_cli("eval", tmp_path / "out", "--reference", snap, "--samples", "1", "--seq-len", "8",
                             registry=registry)
    assert code == 0, err
    assert "reference" in out.lower() and "logits" in out, out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_evaluate_against_a_snapshot(source: Path, tmp_path: Path, layout: str, registry: Registry,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    snap = make_snapshot(source, tmp_path, layout, monkeypatch)
    rtn(source / "model.onnx", tmp_path / "q.onnx", registry)
    from_snapshot = bitpress.evaluate(tmp_path / "q.onnx", snap / "model.onnx", samples=2, seq_len=8, weights=True)
    from_plain = bitpress.evaluate(tmp_path / "q.onnx", source / "model.onnx", samples=2, seq_len=8, weights=True)
    a, b = from_snapshot.to_json(), from_plain.to_json()
    assert a["outputs"] == b["outputs"] and a["tensors"] == b["tensors"] and a["weights_compared"] > 0
    folder = bitpress.evaluate(tmp_path / "q.onnx", snap, samples=2, seq_len=8).to_json()
    assert folder["outputs"] == a["outputs"]


def test_external_data_split_across_blob_folders_reaches_onnx_runtime(
        source: Path, tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The .onnx in the repo's blobs, its data in the shared store: ONNX Runtime, handed the graph as bytes,
    maps the weights from the folder holding both (the cache), under the checked blobs' names; nothing
    is carried inline, and a pass that runs the model that way (``bpw``) gives what it gives from a folder."""
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.activations import relocate, session_for

    snap = make_snapshot(source, tmp_path, "shared_store", monkeypatch)
    cache = (tmp_path / "hub").resolve()
    model = OnnxModel.load(snap / "model.onnx")
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    with caplog.at_level(logging.DEBUG, logger="bitpress.onnx.activations"):
        base = relocate(proto, model)
    assert base == cache and "carried inline" not in caplog.text
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert {Path(loc).parent.parent.as_posix() for loc in locations} == {"blobs"}  # <cache>/blobs/<xx>/<hash>
    got = session_for(proto.SerializeToString(), base).run(["logits"], FEEDS)[0]
    assert np.array_equal(got, logits(source / "model.onnx"))
    plain = rtn(source / "model.onnx", tmp_path / "plain.onnx", registry, bpw=6.0)
    staged = rtn(snap, tmp_path / "snap", registry, bpw=6.0)
    assert errors(staged) == errors(plain)
    assert np.array_equal(logits(tmp_path / "snap" / "model.onnx"), logits(tmp_path / "plain.onnx"))


def test_genai_package_in_a_snapshot_subfolder(tmp_path: Path, registry: Registry) -> None:
    """A package kept as ``cpu-int4/`` of a repo: its config, model and tokenizer all read through blob links."""
    from bitpress.synthetic import build_genai_folder

    pkg = build_genai_folder(tmp_path / "pkg", hidden=64, layers=1)
    snap = cache_folder(pkg, tmp_path / "hub", "cpu-int4")
    assert (snap / "genai_config.json").is_symlink() and (snap / "tokenizer.json").is_symlink()
    plain = rtn(pkg, tmp_path / "plain", registry)
    cached = rtn(snap, tmp_path / "cached", registry)
    assert errors(plain) == errors(cached)
    assert sorted(os.listdir(tmp_path / "cached")) == sorted(os.listdir(pkg))
    for name in os.listdir(pkg):
        assert (tmp_path / "cached" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    assert bitpress.evaluate(tmp_path / "cached", snap, samples=1, seq_len=8).to_json()["outputs"]


# -- Hugging Face checkpoints from a snapshot --------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "loaded"])
def test_rtn_hf_from_a_snapshot(tmp_path: Path, stream: bool) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    src = tmp_path / "llama"
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(src)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    snap = cache_folder(src, tmp_path / "hub")
    assert (snap / "model.safetensors").is_symlink()
    passes = [{"type": "rtn_hf", "stream": stream}]
    a = bitpress.run({"input": str(src), "output": str(tmp_path / "plain"), "passes": passes})
    b = bitpress.run({"input": str(snap), "output": str(tmp_path / "snap"), "passes": passes})
    assert [r[2].errors for r in a.reports] == [r[2].errors for r in b.reports]
    plain, cached = tmp_path / "plain" / src.name, tmp_path / "snap" / snap.name
    assert sorted(os.listdir(plain)) == sorted(os.listdir(cached))
    for name in os.listdir(plain):
        assert not (cached / name).is_symlink()
        assert (cached / name).read_bytes() == (plain / name).read_bytes(), name


# -- every way out is refused ------------------------------------------------------------------------
def _swap(link: Path, target: str | Path) -> str:
    link.unlink()
    link.symlink_to(target)
    return str(target)


def _absolute(snap: Path, cache: Path, data: bytes) -> str:
    return _swap(snap / "model.onnx.data", "/etc/passwd" if os.path.exists("/etc/passwd") else "/dev/null")


def _other_repo(snap: Path, cache: Path, data: bytes) -> str:
    add_file(cache, "w.data", data, repo="org/other")
    other = storage(cache, "org/other") / "blobs" / hashlib.sha256(data).hexdigest()
    return _swap(snap / "model.onnx.data", os.path.relpath(other, snap))


def _not_a_hash(snap: Path, cache: Path, data: bytes) -> str:
    (storage(cache) / "blobs" / "model.onnx.data").write_bytes(data)
    return _swap(snap / "model.onnx.data", "../../../blobs/model.onnx.data")


def _directory_link(snap: Path, cache: Path, data: bytes) -> str:
    """``weights/`` a link to the repo's blobs folder, the graph naming ``weights/<hash>``."""
    h = hashlib.sha256(data).hexdigest()
    proto = onnx.load(str(snap / "model.onnx"), load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = f"weights/{h}"
    (snap / "model.onnx").unlink()
    (snap / "model.onnx").write_bytes(proto.SerializeToString())
    (snap / "model.onnx.data").unlink()
    (snap / "weights").symlink_to("../../../blobs")
    return "../../../blobs"


def _dangling(snap: Path, cache: Path, data: bytes) -> str:
    return _swap(snap / "model.onnx.data", "../../../blobs/" + "0" * 64)


def _dotdot(snap: Path, cache: Path, data: bytes) -> str:
    """Out of the cache through ``..``, to a file named by the right hash."""
    h = hashlib.sha256(data).hexdigest()
    outside = cache.parent / "outside" / h
    outside.parent.mkdir()
    outside.write_bytes(data)
    return _swap(snap / "model.onnx.data", f"../../../blobs/../../../outside/{h}")


def _fifo(snap: Path, cache: Path, data: bytes) -> str:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    blob = storage(cache) / "blobs" / ("f" * 64)
    os.mkfifo(blob)
    return _swap(snap / "model.onnx.data", f"../../../blobs/{blob.name}")


def _through_a_linked_blobs_folder(snap: Path, cache: Path, data: bytes) -> str:
    """The repo's ``blobs`` itself a link to a folder elsewhere holding a hash-named file."""
    elsewhere = cache.parent / "elsewhere"
    blobs = storage(cache) / "blobs"
    shutil.move(blobs, elsewhere)
    blobs.symlink_to(elsewhere)
    return "../../../blobs/"  # the .onnx is refused first, then its data


def _blob_linking_to_another_repo(snap: Path, cache: Path, data: bytes) -> str:
    """The repo's blob is a link, not into the shared store but to another repository's blob."""
    add_file(cache, "w.data", data, repo="org/other")
    h = hashlib.sha256(data).hexdigest()
    _swap(storage(cache) / "blobs" / h, f"../../models--org--other/blobs/{h}")
    return f"../../../blobs/{h}"


def _unmarked_store(snap: Path, cache: Path, data: bytes) -> str:
    """A store-shaped folder without huggingface_hub's marker."""
    h = hashlib.sha256(b"xet" + data).hexdigest()
    entry = cache / "blobs" / h[:2] / h
    entry.parent.mkdir(parents=True)
    entry.write_bytes(data)
    return _swap(snap / "model.onnx.data", os.path.relpath(entry, snap))


ESCAPES = {
    "absolute": _absolute, "other_repo": _other_repo, "not_a_hash": _not_a_hash,
    "directory_link": _directory_link, "dangling": _dangling, "dotdot": _dotdot, "fifo": _fifo,
    "linked_blobs_folder": _through_a_linked_blobs_folder, "blob_to_other_repo": _blob_linking_to_another_repo,
    "unmarked_store": _unmarked_store,
}


@pytest.mark.parametrize("entry", ["folder", "file"])
@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_escape_from_a_snapshot_is_refused(source: Path, tmp_path: Path, case: str, entry: str,
                                           registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    snap = make_snapshot(source, tmp_path, "repo_blobs", monkeypatch)
    target = ESCAPES[case](snap, tmp_path / "hub", (source / "model.onnx.data").read_bytes())
    model = snap if entry == "folder" else snap / "model.onnx"
    with pytest.raises(ModelLoadError) as info:
        rtn(model, tmp_path / "out", registry)
    message = str(info.value)
    assert target in message, message  # names what the link points to
    assert {"directory_link": "weights", "linked_blobs_folder": "model.onnx"}.get(case, "model.onnx.data") in message
    if case == "dangling":
        assert "dangling" in message
    else:
        assert isinstance(info.value, UnsafePathError), message
        assert "refused for safety" in message
        if entry == "file" and case != "linked_blobs_folder":  # refused as the data file, by its location
            assert isinstance(info.value, UnsafeExternalDataError), message
    assert not (tmp_path / "out").exists()


def test_escape_is_one_error_line_on_the_command_line(source: Path, tmp_path: Path, run_cli,
                                                      registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    snap = make_snapshot(source, tmp_path, "repo_blobs", monkeypatch)
    target = _absolute(snap, tmp_path / "hub", b"")
    code, _, err = run_cli("quantize", "-m", snap, "-o", tmp_path / "out", "--algorithm", "rtn", "--precision",
                           "int4", registry=registry)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("bitpress: error: ") and target in lines[0] and "model.onnx.data" in lines[0]
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_a_blob_swapped_for_a_link_after_the_check_is_not_opened(source: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The checked blob is what is opened (``O_NOFOLLOW``, same inode): a swap in between is refused."""
    snap = make_snapshot(source, tmp_path, "repo_blobs", monkeypatch)
    secret = tmp_path / "secret"
    secret.write_bytes(b"TOP SECRET")
    real_inside = paths.inside

    def inside_then_swap(*args: Any, **kwargs: Any) -> Path:
        blob = real_inside(*args, **kwargs)
        assert blob.parent.name == "blobs"
        blob.unlink()
        blob.symlink_to(secret)
        return blob

    monkeypatch.setattr(paths, "inside", inside_then_swap)
    with pytest.raises(UnsafePathError, match="changed"):
        paths.read_bytes(snap, "model.onnx.data", "data", limit=None)


def test_links_in_a_snapshot_follow_the_stricter_rule_only(tmp_path: Path) -> None:
    """Inside a snapshot even a link that stays in the folder is refused: only links to blobs are huggingface_hub's."""
    cache = tmp_path / "hub"
    snap = add_file(cache, "config.json", b"{}").parent
    (snap / "alias.json").symlink_to("config.json")
    with pytest.raises(UnsafePathError, match=r"alias\.json"):
        paths.walk(snap)
    (snap / "alias.json").unlink()
    assert [p.name for p, _ in paths.walk(snap)] == ["config.json"]
    # a folder that only looks like a cache elsewhere: its links may reach its own blobs and no further
    assert hfcache.snapshot_of(Path("/x/models--a--b/snapshots/r/onnx")) == hfcache.Snapshot(
        Path("/x/models--a--b/snapshots/r"))
    assert hfcache.snapshot_of(Path("/x/models--/snapshots/r")) is None
    assert hfcache.snapshot_of(Path("/x/datasets--a--b/snapshots/r")) is None
