"""Hostile inputs: nothing outside the input model's folder is read, and malformed files give one error line.

The contract (docs/security.md):

* **Reading is confined to the input's folder.** Every file the host opens or copies by a name
  it found in the input (a folder listing, a ``genai_config.json`` file name, a safetensors shard
  index, an external-data location, a tokenizer beside the model) must resolve, through every
  level of symbolic links, to a file inside the folder. A link that stays inside is fine.
* **Malformed input** (lying headers, impossible dims, unknown types, bad UTF-8, huge sparse
  files, wrong-shape configs) gives one ``bitpress: error:`` line and exit code 1, never an
  ``internal error``, quickly.
* A failed run leaves nothing behind and the input is unchanged (checksums before and after).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bitpress import paths
from bitpress.errors import ModelLoadError, UnsafePathError
from bitpress.plugins import Registry

SECRET = b"TOP SECRET: never copy me\n"


# -- helpers ---------------------------------------------------------------------------------------------------
@pytest.fixture
def registry(make_registry) -> Registry:
    return make_registry()


@pytest.fixture
def cli(run_cli, registry: Registry) -> Callable[..., tuple[int, str, str]]:
    return lambda *argv: run_cli(*argv, registry=registry)


def one_error_line(err: str, *contains: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got:\n{err}"
    line = lines[0]
    assert line.startswith("bitpress: error: "), line
    assert "internal error" not in err and "Traceback" not in err
    for text in contains:
        assert text in line, f"{text!r} not in {line!r}"
    return line


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".bitpress-" in p.name or p.name.startswith("spill-")]


def tree_bytes(root: Path) -> bytes:
    """Every byte of every regular file under ``root`` (links not followed): the secret must not be in the output."""
    out = b""
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out += p.read_bytes()
    return out


def quantize_fails(cli, tmp_path: Path, sha256_tree, model: Path, *contains: str, output: str = "out",
                   within: float | None = None) -> str:
    """Run quantize on ``model``: exit 1, one error line, nothing written, the input unchanged.

    ``within``: the run (not the checksums around it) must take less than this many seconds.
    """
    before = checksums(tmp_path, sha256_tree)
    t0 = time.perf_counter()
    code, out, err = cli("quantize", "-m", model, "-o", tmp_path / output, "--algorithm", "rtn", "--precision", "int4")
    seconds = time.perf_counter() - t0
    assert code == 1, err
    line = one_error_line(err, *contains)
    assert out == ""
    assert not (tmp_path / output).exists()
    assert not leftovers(tmp_path)
    assert checksums(tmp_path, sha256_tree) == before
    if within is not None:
        assert seconds < within, f"took {seconds:.2f} s"
    return line


def checksums(root: Path, sha256_tree) -> dict[str, Any]:
    """sha256_tree, except that huge (sparse) files are recorded by size and mtime, not read."""
    huge = {p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p.stat().st_size > (64 << 20)}
    if not huge:
        return sha256_tree(root)
    stash = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in huge}
    out: dict[str, Any] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p in stash:
            out[rel] = stash[p]
        elif p.is_symlink():
            out[rel] = f"-> {p.readlink()}"
        elif p.is_file():
            out[rel] = sha256_tree(p)
        elif p.is_dir():
            out[rel + "/"] = "dir"
    return out


def outside_secret(tmp_path: Path) -> Path:
    secret = tmp_path / "outside" / "secret.bin"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_bytes(SECRET)
    return secret


# -- 1. GenAI folders: symlinks leaving the folder -------------------------------------------------------------
def _escape(kind: str, pkg: Path, tmp_path: Path) -> str:
    """Make ``pkg`` hostile in one way; returns text the error must contain (the file's name)."""
    secret = outside_secret(tmp_path)
    if kind == "companion-relative":
        (pkg / "tokenizer.json").unlink()
        (pkg / "tokenizer.json").symlink_to(Path("..") / "outside" / "secret.bin")
        return "tokenizer.json"
    if kind == "companion-absolute":
        (pkg / "extra.txt").symlink_to(secret)
        return "extra.txt"
    if kind == "etc-passwd":
        (pkg / "extra.txt").symlink_to("/etc/passwd")
        return "extra.txt"
    if kind == "sub-model":
        shutil.move(pkg / "model.onnx", tmp_path / "elsewhere.onnx")
        (pkg / "model.onnx").symlink_to(Path("..") / "elsewhere.onnx")
        return "model.onnx"
    if kind == "genai-config":
        shutil.move(pkg / "genai_config.json", tmp_path / "outside" / "genai_config.json")
        (pkg / "genai_config.json").symlink_to(tmp_path / "outside" / "genai_config.json")
        return "genai_config.json"
    if kind == "chain":  # in-folder link -> in-folder link -> outside: every level is resolved
        (pkg / "hop2").symlink_to(Path("..") / "outside" / "secret.bin")
        (pkg / "hop1").symlink_to("hop2")
        (pkg / "vocab.txt").symlink_to("hop1")
        return "hop"
    if kind == "nested":
        (pkg / "sub" / "deeper").mkdir(parents=True)
        (pkg / "sub" / "deeper" / "merges.txt").symlink_to(Path("../../..") / "outside" / "secret.bin")
        return "merges.txt"
    if kind == "linked-folder":
        (pkg / "assets").symlink_to(tmp_path / "outside", target_is_directory=True)
        return "assets"
    if kind == "through-linked-folder":  # an in-folder link whose parent is a link leaving the folder
        (pkg / "up").symlink_to("..", target_is_directory=True)
        (pkg / "vocab.json").symlink_to(Path("up") / "outside" / "secret.bin")
        return "pkg/up"  # the first entry leaving the folder is named
    if kind == "dangling":
        (pkg / "special.json").symlink_to(tmp_path / "nowhere" / "x.json")
        return "special.json"
    if kind == "loop":
        (pkg / "a.json").symlink_to("b.json")
        (pkg / "b.json").symlink_to("a.json")
        return ".json"
    raise AssertionError(kind)


ESCAPES = ["companion-relative", "companion-absolute", "etc-passwd", "sub-model", "genai-config", "chain", "nested",
           "linked-folder", "through-linked-folder", "dangling", "loop"]


@pytest.mark.parametrize("kind", ESCAPES)
def test_genai_folder_link_leaving_it_is_refused(
    kind: str, tmp_path: Path, cli, sha256_tree, genai_folder: Path
) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    name = _escape(kind, pkg, tmp_path)
    quantize_fails(cli, tmp_path, sha256_tree, pkg, name)


@pytest.mark.parametrize("kind", ["companion-relative", "sub-model", "genai-config"])
def test_genai_folder_link_refused_by_inspect(kind: str, tmp_path: Path, cli, genai_folder: Path) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    name = _escape(kind, pkg, tmp_path)
    code, out, err = cli("inspect", pkg)
    assert code == 1
    one_error_line(err, name)
    assert SECRET.decode().strip() not in out


@pytest.mark.parametrize("kind", ["companion-relative", "sub-model", "nested", "linked-folder"])
def test_escape_error_is_unsafe_path_error(kind: str, tmp_path: Path, genai_folder: Path) -> None:
    from bitpress.models.onnx_package import OnnxPackage

    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    _escape(kind, pkg, tmp_path)
    with pytest.raises(UnsafePathError, match="outside the model's folder"):
        OnnxPackage.load(pkg)


def test_companion_swapped_for_a_link_after_loading_is_refused(tmp_path: Path, genai_folder: Path) -> None:
    """The check is repeated right before each copy: a file swapped for a link after load is not read."""
    from bitpress.models.onnx_package import OnnxPackage

    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    package = OnnxPackage.load(pkg)
    secret = outside_secret(tmp_path)
    (pkg / "tokenizer.json").unlink()
    (pkg / "tokenizer.json").symlink_to(secret)
    with pytest.raises(UnsafePathError, match=r"tokenizer\.json"):
        package.companion_files([])
    out = tmp_path / "copy.json"
    with pytest.raises(UnsafePathError, match=r"tokenizer\.json"):
        package.copy_file(pkg / "tokenizer.json", out)
    assert not out.exists()


# -- 2. genai_config.json file names ---------------------------------------------------------------------------
@pytest.mark.parametrize(("section", "filename", "message"), [
    ("decoder", "../../x.onnx", "leaves the model's folder"),
    ("decoder", "sub/../../x.onnx", "leaves the model's folder"),
    ("decoder", "..\\x.onnx", "leaves the model's folder"),
    ("decoder", "/etc/passwd", "absolute"),
    ("decoder", "ABSOLUTE", "absolute"),
    ("decoder", "C:\\models\\x.onnx", "absolute"),
    ("embedding", "../outside/secret.bin", "leaves the model's folder"),
    ("vision", "/tmp/x.onnx", "absolute"),
])
def test_genai_config_file_name_leaving_folder_is_refused(
    section: str, filename: str, message: str, tmp_path: Path, cli, sha256_tree, genai_folder: Path
) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    secret = outside_secret(tmp_path)
    shutil.copy(pkg / "model.onnx", tmp_path / "x.onnx")  # the named file really exists outside
    if filename == "ABSOLUTE":
        filename = str(secret)
    cfg = json.loads((pkg / "genai_config.json").read_text())
    cfg["model"].setdefault(section, {})["filename"] = filename
    (pkg / "genai_config.json").write_text(json.dumps(cfg))
    quantize_fails(cli, tmp_path, sha256_tree, pkg, "genai_config.json", message)


def test_genai_config_file_name_through_a_link_is_refused(
    tmp_path: Path, cli, sha256_tree, genai_folder: Path
) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(pkg / "model.onnx", outside / "model.onnx")
    (pkg / "models").symlink_to(outside, target_is_directory=True)
    cfg = json.loads((pkg / "genai_config.json").read_text())
    cfg["model"]["vision"] = {"filename": "models/model.onnx"}
    (pkg / "genai_config.json").write_text(json.dumps(cfg))
    quantize_fails(cli, tmp_path, sha256_tree, pkg, "models")


# -- 3. links that stay inside the folder are fine ------------------------------------------------------------
@pytest.mark.parametrize("style", ["relative", "absolute", "chain", "into-subfolder"])
def test_in_folder_links_are_accepted(style: str, tmp_path: Path, cli, genai_folder: Path) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    real = pkg / "tok" / "tokenizer.json"
    real.parent.mkdir()
    shutil.move(pkg / "tokenizer.json", real)
    link = pkg / "tokenizer.json"
    if style == "relative":
        link.symlink_to(Path("tok") / "tokenizer.json")
    elif style == "absolute":
        link.symlink_to(real)
    elif style == "chain":
        (pkg / "hop").symlink_to(Path("tok") / "tokenizer.json")
        link.symlink_to("hop")
    else:
        (pkg / "tok2").symlink_to("tok", target_is_directory=True)  # a linked folder inside: listed where it is
        link.symlink_to(Path("tok2") / "tokenizer.json")
    out = tmp_path / "out"
    code, _, err = cli("quantize", "-m", pkg, "-o", out, "--algorithm", "rtn", "--precision", "int4")
    assert code == 0, err
    copied = out / "tokenizer.json"
    assert copied.is_file() and not copied.is_symlink()
    assert copied.read_bytes() == real.read_bytes()
    assert (out / "tok" / "tokenizer.json").read_bytes() == real.read_bytes()
    assert not leftovers(tmp_path)


def test_in_folder_linked_model_is_accepted(tmp_path: Path, cli, genai_folder: Path) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    (pkg / "real").mkdir()
    shutil.move(pkg / "model.onnx", pkg / "real" / "model.onnx")
    (pkg / "model.onnx").symlink_to(Path("real") / "model.onnx")
    code, _, err = cli("quantize", "-m", pkg, "-o", tmp_path / "out", "--algorithm", "rtn", "--precision", "int4")
    assert code == 0, err
    onnx.checker.check_model(str(tmp_path / "out" / "model.onnx"))


# -- 4. genai_config.json of the wrong shape ----------------------------------------------------------------------
@pytest.mark.parametrize(("config", "message"), [
    ("[]", "must hold a JSON object"),
    ('"model"', "must hold a JSON object"),
    ("3", "must hold a JSON object"),
    ("null", "must hold a JSON object"),
    ("{}", "no 'model' section"),
    ('{"model": []}', "'model' must be an object"),
    ('{"model": "llama"}', "'model' must be an object"),
    ('{"model": {}}', "no 'model.decoder'"),
    ('{"model": {"decoder": 1}}', "'model.decoder' must be an object"),
    ('{"model": {"decoder": {"filename": 3}}}', "must be a file name"),
    ('{"model": {"decoder": {"filename": null}}}', "must be a file name"),
    ('{"model": {"decoder": {"filename": ["model.onnx"]}}}', "must be a file name"),
    ('{"model": {"decoder": {"filename": ""}}}', "empty"),
    ('{"model": {"decoder": {"filename": "model\\u0000.onnx"}}}', "control characters"),
    ('{"model": {"decoder": {"filename": "missing.onnx"}}}', "which is not in"),
    ('{"model": {"decoder": {"filename": "model.onnx"}, "vision": {"filename": {"a": 1}}}}', "must be a file name"),
    ('{"model": {"decoder": {"pipeline": [{"x": {"filename": "../y.onnx"}}]}}}', "leaves the model's folder"),
    ('{"model": {"decoder": {"filename": "model.onnx"}}, "processor": {"config_filename": "/etc/passwd"}}',
     "absolute"),
    ('{"model": {"decoder": ', "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
])
def test_genai_config_of_wrong_shape(
    config: str, message: str, tmp_path: Path, cli, sha256_tree, genai_folder: Path
) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    (pkg / "genai_config.json").write_text(config)
    quantize_fails(cli, tmp_path, sha256_tree, pkg, "genai_config.json", message)


def test_genai_config_long_name_and_bad_text(tmp_path: Path, cli, sha256_tree, genai_folder: Path) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    cfg = json.loads((pkg / "genai_config.json").read_text())
    cfg["model"]["decoder"]["filename"] = "a" * 5000 + ".onnx"
    (pkg / "genai_config.json").write_text(json.dumps(cfg))
    quantize_fails(cli, tmp_path, sha256_tree, pkg, "bytes long")
    cfg["model"]["decoder"]["filename"] = "d/" + "a" * 300 + ".onnx"
    (pkg / "genai_config.json").write_text(json.dumps(cfg))
    quantize_fails(cli, tmp_path, sha256_tree, pkg, "longer than")
    (pkg / "genai_config.json").write_bytes(b'{"model": {"decoder": {"filename": "\xff\xfe.onnx"}}}')
    quantize_fails(cli, tmp_path, sha256_tree, pkg, "not UTF-8")
    os.truncate(pkg / "genai_config.json", 1 << 30)  # sparse: costs no disk
    quantize_fails(cli, tmp_path, sha256_tree, pkg, "genai_config.json", "more than", within=2.0)


# -- 5. eval and calibration data: tokenizers and configs beside the model ---------------------------------------
def _text(tmp_path: Path) -> Path:
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"tok{i % 200 + 3}" for i in range(400)))
    return text


@pytest.mark.parametrize("where", ["quantized", "reference"])
def test_eval_tokenizer_link_leaving_folder_is_refused(
    where: str, tmp_path: Path, cli, sha256_tree, genai_folder: Path
) -> None:
    pytest.importorskip("tokenizers")
    q, r = tmp_path / "q", tmp_path / "r"
    shutil.copytree(genai_folder, q)
    shutil.copytree(genai_folder, r)
    hostile = q if where == "quantized" else r
    if where == "reference":
        (q / "tokenizer.json").unlink()  # else the quantized model's own tokenizer is found first
    # a tokenizer that works, outside; the model's folder links to it
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(hostile / "tokenizer.json", outside / "tokenizer.json")
    (hostile / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    text = _text(tmp_path)
    before = sha256_tree(tmp_path)
    code, _, err = cli("eval", q, "--reference", r, "--text", text, "--seq-len", "8", "--no-weights")
    assert code == 1, err
    one_error_line(err, "tokenizer.json")
    assert sha256_tree(tmp_path) == before


def test_eval_data_tokenizer_link_leaving_folder_is_refused(
    tmp_path: Path, cli, sha256_tree, genai_folder: Path
) -> None:
    """--data text.txt: the tokenizer found beside the model (not given by the user) must stay inside."""
    pytest.importorskip("tokenizers")
    q = tmp_path / "q"
    shutil.copytree(genai_folder, q)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(q / "tokenizer.json", outside / "tokenizer.json")
    (q / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    text = _text(tmp_path)
    before = sha256_tree(tmp_path)
    code, _, err = cli("eval", q, "--reference", q, "--data", text, "--seq-len", "8", "--samples", "1",
                       "--no-weights")
    assert code == 1, err
    one_error_line(err, "tokenizer.json")
    assert sha256_tree(tmp_path) == before


@pytest.mark.parametrize("kind", ["filename", "genai-link", "model-link", "shape"])
def test_eval_folder_names_are_confined(kind: str, tmp_path: Path, cli, genai_folder: Path) -> None:
    q = tmp_path / "q"
    shutil.copytree(genai_folder, q)
    outside = outside_secret(tmp_path).parent
    cfg_path = q / "genai_config.json"
    if kind == "filename":
        shutil.copy(q / "model.onnx", tmp_path / "x.onnx")
        cfg = json.loads(cfg_path.read_text())
        cfg["model"]["decoder"]["filename"] = "../x.onnx"
        cfg_path.write_text(json.dumps(cfg))
        expect = "leaves the model's folder"
    elif kind == "genai-link":
        shutil.move(cfg_path, outside / "genai_config.json")
        cfg_path.symlink_to(outside / "genai_config.json")
        expect = "genai_config.json"
    elif kind == "model-link":
        cfg = json.loads(cfg_path.read_text())
        del cfg["model"]["decoder"]["filename"]
        cfg_path.write_text(json.dumps(cfg))
        shutil.move(q / "model.onnx", outside / "model.onnx")
        (q / "model.onnx").symlink_to(outside / "model.onnx")
        expect = "model.onnx"
    else:
        cfg_path.write_text('{"model": ["decoder"]}')
        expect = "'model' must be an object"
    code, _, err = cli("eval", q, "--reference", q, "--samples", "1", "--seq-len", "8", "--no-weights")
    assert code == 1, err
    one_error_line(err, expect)


def test_calibration_tokenizer_beside_model_is_confined(tmp_path: Path, tiny_decoder: Path) -> None:
    """bitpress.calibration.data: a text file's tokenizer found in the model's folder must be inside it."""
    pytest.importorskip("tokenizers")
    from bitpress.calibration.data import DataConfig, iter_feeds

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    shutil.copy(tiny_decoder, model_dir / "model.onnx")
    outside = tmp_path / "outside"
    outside.mkdir()
    from bitpress.synthetic import _tokenizer_files

    (outside / "tokenizer.json").write_text(json.dumps(_tokenizer_files(256, 128)["tokenizer.json"]))
    (model_dir / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    proto = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    with pytest.raises(UnsafePathError, match="tokenizer"):
        list(iter_feeds(proto, DataConfig(source=str(_text(tmp_path)), seq_len=8, samples=1), model_dir))


# -- 6. Hugging Face folders --------------------------------------------------------------------------------------
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
                "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 1, "vocab_size": 16, "max_position_embeddings": 32}


def safetensors_bytes(header: Any, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def good_safetensors() -> bytes:
    return safetensors_bytes({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                              "b": {"dtype": "I8", "shape": [4], "data_offsets": [16, 20]},
                              "__metadata__": {"format": "pt"}}, b"\0" * 20)


def hf_folder(root: Path, *, weights: bytes | None = None) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    (root / "model.safetensors").write_bytes(good_safetensors() if weights is None else weights)
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "generation_config.json").write_text("{}")
    return root


def test_hf_folder_check_passes_on_a_good_folder(tmp_path: Path) -> None:
    from bitpress.models.hf_files import check_folder

    folder = hf_folder(tmp_path / "hf")
    assert [p.name for p in check_folder(folder)] == ["model.safetensors"]


@pytest.mark.parametrize("kind", ["tokenizer", "generation-config", "config", "weights", "subfolder", "dangling"])
def test_hf_folder_link_leaving_it_is_refused(kind: str, tmp_path: Path, cli, sha256_tree) -> None:
    folder = hf_folder(tmp_path / "hf")
    secret = outside_secret(tmp_path)
    name = {"tokenizer": "tokenizer.json", "generation-config": "generation_config.json", "config": "config.json",
            "weights": "model.safetensors", "subfolder": "merges.txt", "dangling": "tokenizer_config.json"}[kind]
    if kind == "subfolder":
        (folder / "extra").mkdir()
        (folder / "extra" / name).symlink_to(secret)
    elif kind == "dangling":
        (folder / name).symlink_to(tmp_path / "nowhere.json")
    else:
        target = secret.parent / name
        shutil.move(folder / name, target)
        (folder / name).symlink_to(os.path.relpath(target, folder))
    quantize_fails(cli, tmp_path, sha256_tree, folder, name)


@pytest.mark.parametrize(("weight_map", "message"), [
    ({"a": "../outside/x.safetensors"}, "leaves the model's folder"),
    ({"a": "ABSOLUTE"}, "absolute"),
    ({"a": "LINK"}, "outside the model's folder"),
    ({"a": 3}, "must be a file name"),
    ({"a": "missing.safetensors"}, "which is not in"),
    ({}, "weight_map"),
    ([], "weight_map"),
])
def test_hf_shard_index_is_confined(
    weight_map: Any, message: str, tmp_path: Path, cli, sha256_tree
) -> None:
    folder = hf_folder(tmp_path / "hf")
    (folder / "model.safetensors").unlink()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.safetensors").write_bytes(good_safetensors())
    if isinstance(weight_map, dict):
        for k, v in weight_map.items():
            if v == "ABSOLUTE":
                weight_map[k] = str(outside / "x.safetensors")
            elif v == "LINK":
                (folder / "model-00001.safetensors").symlink_to(outside / "x.safetensors")
                weight_map[k] = "model-00001.safetensors"
                (folder / "model-00001.safetensors").unlink()  # the listing would catch it first: test the index
                (folder / "shards").symlink_to(outside, target_is_directory=True)
                weight_map[k] = "shards/x.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    quantize_fails(cli, tmp_path, sha256_tree, folder, message)


def test_hf_shard_index_names_are_checked_before_any_listing(tmp_path: Path) -> None:
    """check_index on its own refuses a shard reached through a linked folder (no listing involved)."""
    from bitpress.models.hf_files import check_index

    folder = hf_folder(tmp_path / "hf")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.safetensors").write_bytes(good_safetensors())
    (folder / "shards").symlink_to(outside, target_is_directory=True)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "shards/x.safetensors"}}))
    with pytest.raises(UnsafePathError, match="outside the model's folder"):
        check_index(folder, index)


def test_hf_adapter_folder_is_refused(tmp_path: Path, cli, sha256_tree) -> None:
    folder = hf_folder(tmp_path / "hf")
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "other")}))
    quantize_fails(cli, tmp_path, sha256_tree, folder, "adapter")


def test_hf_companions_checked_again_when_copied(tmp_path: Path) -> None:
    from bitpress.models.hf_files import companion_files

    folder = hf_folder(tmp_path / "hf")
    assert [p.name for p in companion_files(folder)] == ["generation_config.json", "tokenizer.json"]
    secret = outside_secret(tmp_path)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(secret)
    with pytest.raises(UnsafePathError, match=r"tokenizer\.json"):
        companion_files(folder)
    with pytest.raises(UnsafePathError, match=r"tokenizer\.json"):
        paths.copy_inside(folder, folder / "tokenizer.json", tmp_path / "copy.json")
    assert not (tmp_path / "copy.json").exists()


F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize(("weights", "message"), [
    (b"", "is empty"),
    (b"\x01\x02\x03", "too short"),
    (struct.pack("<Q", 0), "header claims 0 bytes"),
    (struct.pack("<Q", 1 << 62) + b"{}", "header claims"),
    (struct.pack("<Q", 200) + b'{"a": 1}', "header claims 200 bytes"),
    (safetensors_bytes(b"\xff\xfe not json"), "not JSON"),
    (safetensors_bytes(b"[1, 2]"), "not a JSON object"),
    (safetensors_bytes({}), "holds no tensors"),
    (safetensors_bytes({"__metadata__": {"format": "pt"}}), "holds no tensors"),
    (safetensors_bytes({"a": {**F32_2x2, "dtype": "F33"}}, b"\0" * 16), "unknown dtype"),
    (safetensors_bytes({"a": {**F32_2x2, "dtype": 7}}, b"\0" * 16), "unknown dtype"),
    (safetensors_bytes({"a": {**F32_2x2, "shape": [-2, -2]}}, b"\0" * 16), "negative dimension"),
    (safetensors_bytes({"a": {**F32_2x2, "shape": "2x2"}}, b"\0" * 16), "not a list of integers"),
    (safetensors_bytes({"a": {**F32_2x2, "shape": [2, 2.5]}}, b"\0" * 16), "not a list of integers"),
    (safetensors_bytes({"a": {**F32_2x2, "shape": [4, 4]}}, b"\0" * 16), "needs 64 bytes"),
    (safetensors_bytes({"a": {**F32_2x2, "dtype": "F16"}}, b"\0" * 16), "needs 8 bytes"),
    (safetensors_bytes({"a": {**F32_2x2, "shape": [1 << 40, 1 << 40]}}, b"\0" * 16), "needs"),
    (safetensors_bytes({"a": {**F32_2x2, "data_offsets": [0, 1 << 40]}}, b"\0" * 16), "needs 16 bytes"),
    (safetensors_bytes({"a": {**F32_2x2, "data_offsets": [1 << 40, (1 << 40) + 16]}}, b"\0" * 16), "gap"),
    (safetensors_bytes({"a": {**F32_2x2, "data_offsets": [-16, 0]}}, b"\0" * 16), "negative"),
    (safetensors_bytes({"a": {**F32_2x2, "data_offsets": [16, 0]}}, b"\0" * 16), "reversed"),
    (safetensors_bytes({"a": {**F32_2x2, "data_offsets": [0]}}, b"\0" * 16), "malformed data_offsets"),
    (safetensors_bytes({"a": {**F32_2x2, "data_offsets": [0, 16]}}, b"\0" * 8), "truncated"),
    (safetensors_bytes({"a": F32_2x2, "b": {**F32_2x2, "data_offsets": [8, 24]}}, b"\0" * 24), "overlaps"),
    (safetensors_bytes({"a": F32_2x2, "b": F32_2x2}, b"\0" * 16), "overlaps"),
    (safetensors_bytes(b'{"a": ' + json.dumps(F32_2x2).encode() + b', "a": '
                       + json.dumps(F32_2x2).encode() + b"}", b"\0" * 16), "twice"),
    (safetensors_bytes({"a": "F32"}, b"\0" * 16), "not described by an object"),
    (safetensors_bytes({"a": F32_2x2, "__metadata__": {"n": 1}}, b"\0" * 16), "__metadata__"),
])
def test_lying_safetensors_header_is_refused(
    weights: bytes, message: str, tmp_path: Path, cli, sha256_tree
) -> None:
    folder = hf_folder(tmp_path / "hf", weights=weights)
    quantize_fails(cli, tmp_path, sha256_tree, folder, "model.safetensors", message)


def test_huge_sparse_safetensors_is_refused_quickly(tmp_path: Path, cli, sha256_tree) -> None:
    folder = hf_folder(tmp_path / "hf")
    os.truncate(folder / "model.safetensors", 4 << 30)  # header + 4 GB of zeros the header does not describe
    quantize_fails(cli, tmp_path, sha256_tree, folder, "model.safetensors", within=2.0)


@pytest.mark.parametrize("config", ["[]", "{", '"x"'])
def test_hf_config_of_wrong_shape(config: str, tmp_path: Path, cli, sha256_tree) -> None:
    folder = hf_folder(tmp_path / "hf")
    (folder / "config.json").write_text(config)
    quantize_fails(cli, tmp_path, sha256_tree, folder, "config.json")


def test_hf_in_folder_link_is_copied_as_its_target(tmp_path: Path, cli) -> None:
    """A real Hugging Face folder (torch): an in-folder linked tokenizer is fine and copied as bytes."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = {k: v for k, v in LLAMA_CONFIG.items() if k not in ("architectures", "model_type")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, "hidden_size": 64,
                                                                       "intermediate_size": 128,
                                                                       "num_attention_heads": 4,
                                                                       "num_key_value_heads": 2,
                                                                       "vocab_size": 64}))
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    (folder / "assets").mkdir()
    (folder / "assets" / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "tokenizer.json").symlink_to(Path("assets") / "tokenizer.json")
    out = tmp_path / "out"
    code, _, err = cli("quantize", "-m", folder, "-o", out, "--algorithm", "rtn", "--precision", "int4")
    assert code == 0, err
    copied = out / "hf" / "tokenizer.json"
    assert copied.is_file() and not copied.is_symlink()
    assert copied.read_text() == '{"version": "1.0"}'

    # the same folder with the link leaving it: refused, nothing written
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(outside_secret(tmp_path))
    code, _, err = cli("quantize", "-m", folder, "-o", tmp_path / "out2", "--algorithm", "rtn", "--precision", "int4")
    assert code == 1
    one_error_line(err, "tokenizer.json", "outside the model's folder")
    assert not (tmp_path / "out2").exists()


# -- 7. malformed ONNX ----------------------------------------------------------------------------------------------
def base_model(*, weight: onnx.TensorProto | None = None, output: str = "y", extra_inits: list | None = None,
               metadata: dict[str, str] | None = None) -> onnx.ModelProto:
    w = weight if weight is not None else numpy_helper.from_array(
        np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096, "W")
    node = helper.make_node("MatMul", ["x", w.name], [output], name="mm")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, 64])], [w, *(extra_inits or [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for k, v in (metadata or {}).items():
        helper.set_model_props(model, {k: v})
    return model


def _weight(**changes: Any) -> onnx.TensorProto:
    t = numpy_helper.from_array(np.ones((64, 64), np.float32), "W")
    for key, value in changes.items():
        if key == "dims":
            del t.dims[:]
            t.dims.extend(value)
        elif key == "raw_data":
            t.raw_data = value
        elif key == "float_data":
            t.ClearField("raw_data")
            t.float_data.extend(value)
        else:
            setattr(t, key, value)
    return t


def _external(folder: Path, entries: dict[str, str], *, data: bytes = b"\0" * (64 * 64 * 4)) -> onnx.TensorProto:
    (folder / "w.bin").write_bytes(data)
    t = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[64, 64])
    t.data_location = TensorProto.EXTERNAL
    for k, v in entries.items():
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def _twice(t: onnx.TensorProto) -> onnx.TensorProto:
    e = t.external_data.add()
    e.key, e.value = "location", "../outside/secret.bin"
    return t


def _replace(data: bytes, old: bytes, new: bytes) -> bytes:
    assert len(old) == len(new) and data.count(old) >= 1, old
    return data.replace(old, new)


MALFORMED: dict[str, tuple[Callable[[Path], bytes], str]] = {
    # dims that disagree with the data
    "raw-too-short": (lambda d: base_model(weight=_weight(raw_data=b"\0" * 100)).SerializeToString(), "need 16384"),
    "raw-too-long-lazy": (lambda d: base_model(weight=_weight(dims=[32, 64])).SerializeToString(), "need 8192"),
    "float-data-count": (lambda d: base_model(weight=_weight(float_data=[1.0] * 7)).SerializeToString(),
                         "holds 7 values"),
    "no-data": (lambda d: base_model(weight=onnx.TensorProto(name="W", data_type=1, dims=[64, 64]))
                .SerializeToString(), "holds 0 values"),
    "string-raw": (lambda d: base_model(extra_inits=[onnx.TensorProto(name="s", data_type=8, dims=[1],
                                                                      raw_data=b"ab")]).SerializeToString(), "STRING"),
    # negative or overflowing dims
    "negative-dim": (lambda d: base_model(weight=_weight(dims=[-64, -64])).SerializeToString(), "negative"),
    "negative-one-dim": (lambda d: base_model(weight=_weight(dims=[-1, 64 * 64 * 4 * -1])).SerializeToString(),
                         "negative"),
    "overflow-dims": (lambda d: base_model(weight=_weight(dims=[1 << 32, 1 << 32, 1 << 32, 1 << 32]))
                      .SerializeToString(), "not a real tensor"),
    "wrap-around-dims": (lambda d: base_model(weight=_weight(dims=[1 << 62, 4, 64 * 64])).SerializeToString(),
                         "not a real tensor"),
    # unknown data types
    "dtype-999": (lambda d: base_model(weight=_weight(data_type=999)).SerializeToString(), "unknown data type 999"),
    "dtype-undefined": (lambda d: base_model(weight=_weight(data_type=0)).SerializeToString(), "unknown data type 0"),
    "dtype-negative": (lambda d: base_model(weight=_weight(data_type=-5)).SerializeToString(), "unknown data type"),
    # external references
    "ext-negative-offset": (lambda d: base_model(weight=_external(d, {"location": "w.bin", "offset": "-4096"}))
                            .SerializeToString(), "malformed external offset"),
    "ext-negative-length": (lambda d: base_model(weight=_external(d, {"location": "w.bin", "length": "-1"}))
                            .SerializeToString(), "malformed external offset"),
    "ext-huge-offset": (lambda d: base_model(weight=_external(d, {"location": "w.bin", "offset": "9" * 30}))
                        .SerializeToString(), "malformed external offset"),
    "ext-float-offset": (lambda d: base_model(weight=_external(d, {"location": "w.bin", "offset": "1e3"}))
                         .SerializeToString(), "malformed external offset"),
    "ext-offset-past-end": (lambda d: base_model(weight=_external(d, {"location": "w.bin", "offset": str(1 << 40)}))
                            .SerializeToString(), "truncated"),
    "ext-length-mismatch": (lambda d: base_model(weight=_external(d, {"location": "w.bin", "length": "16"}))
                            .SerializeToString(), "does not match"),
    "ext-long-location": (lambda d: base_model(weight=_external(d, {"location": "a" * 5000}))
                          .SerializeToString(), "bytes long"),
    "ext-long-part": (lambda d: base_model(weight=_external(d, {"location": "d/" + "a" * 300}))
                      .SerializeToString(), "bytes long"),
    "ext-nul": (lambda d: base_model(weight=_external(d, {"location": "w.bin\x00.txt"})).SerializeToString(),
                "control characters"),
    "ext-empty": (lambda d: base_model(weight=_external(d, {"location": ""})).SerializeToString(), "location"),
    "ext-twice": (lambda d: base_model(weight=_twice(_external(d, {"location": "w.bin"}))).SerializeToString(),
                  "'location' twice"),
    "ext-dir": (lambda d: (d / "wdir").mkdir() or base_model(weight=_external(d, {"location": "wdir"}))
                .SerializeToString(), "missing"),
    # over-long names
    "long-output-name": (lambda d: base_model(output="y" * 70_000).SerializeToString(), "characters long"),
    # names that are not UTF-8 (protobuf would hand them over as bytes)
    "utf8-initializer": (lambda d: _replace(base_model(weight=_weight(name="WWWW"))
                                            .SerializeToString(), b"WWWW", b"W\xff\xfeW"), "not valid UTF-8"),
    "utf8-output": (lambda d: _replace(base_model(output="OUTQ").SerializeToString(), b"OUTQ", b"OU\xc3\x28"),
                    "not valid UTF-8"),
    "utf8-metadata": (lambda d: _replace(base_model(metadata={"KEYZ": "v"}).SerializeToString(), b"KEYZ",
                                         b"K\x80YZ"), "not valid UTF-8"),
    # duplicate initializer names
    "duplicate-initializer": (lambda d: base_model(extra_inits=[numpy_helper.from_array(np.zeros(4, np.float32),
                                                                                        "W")]).SerializeToString(),
                              "two initializers named 'W'"),
    # the wire format itself
    "field-zero": (lambda d: b"\x00" * 4096, "field number 0"),
    "graph-varint-field": (lambda d: b"\x08\x08" + b"\x3a\x02" + b"\x08\x01", "wire type"),
    "truncated-varint": (lambda d: b"\x08\xff\xff\xff", "truncated"),
    "overlong-varint": (lambda d: b"\x08" + b"\xff" * 12 + b"\x01", "malformed varint"),
    "length-past-end": (lambda d: b"\x08\x08\x3a\xff\xff\xff\x0f" + b"\x0a\x00", "truncated"),
    "group-wire-type": (lambda d: b"\x0b\x0c", "wire type"),
    "ir-version-as-string": (lambda d: b"\x0a\x01x", "wire type"),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_onnx_gives_one_error_line(kind: str, tmp_path: Path, cli, sha256_tree) -> None:
    build, message = MALFORMED[kind]
    folder = tmp_path / "in"
    folder.mkdir()
    model = folder / "model.onnx"
    model.write_bytes(build(folder))
    quantize_fails(cli, tmp_path, sha256_tree, model, message, output="out/q.onnx")


@pytest.mark.parametrize("kind", ["raw-too-short", "utf8-initializer", "dtype-999", "ext-negative-offset",
                                  "field-zero", "duplicate-initializer"])
def test_malformed_onnx_in_inspect_and_genai_folder(kind: str, tmp_path: Path, cli, genai_folder: Path) -> None:
    build, message = MALFORMED[kind]
    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    (pkg / "model.onnx").write_bytes(build(pkg))
    code, _, err = cli("inspect", pkg)
    assert code == 1
    one_error_line(err, message)


def test_malformed_onnx_raises_model_load_error(tmp_path: Path) -> None:
    from bitpress.models.onnx_model import OnnxModel

    for kind, (build, message) in MALFORMED.items():
        folder = tmp_path / kind
        folder.mkdir()
        (folder / "model.onnx").write_bytes(build(folder))
        try:
            OnnxModel.load(folder / "model.onnx")
        except ModelLoadError as exc:
            assert message in str(exc), (kind, str(exc))
        else:
            raise AssertionError(f"{kind}: loaded without an error")


# -- 8. huge but empty files ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("size", "prefix"), [
    (4 << 30, False),          # 4 GB of zeros: over protobuf's 2 GiB
    ((3 << 29), False),        # 1.5 GB of zeros: under it, refused at its first byte
    ((3 << 29), True),         # a real model followed by 1.5 GB of zeros
    (64 << 30, False),         # 64 GB
])
def test_huge_sparse_onnx_is_refused_quickly(
    size: int, prefix: bool, tmp_path: Path, cli, sha256_tree, tiny_decoder: Path
) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    model = folder / "model.onnx"
    if prefix:
        shutil.copy(tiny_decoder, model)
    else:
        model.touch()
    os.truncate(model, size)  # sparse: no disk used
    quantize_fails(cli, tmp_path, sha256_tree, model, "not a valid ONNX model", output="out/q.onnx", within=2.0)


def test_huge_sparse_model_in_a_genai_folder(tmp_path: Path, cli, sha256_tree, genai_folder: Path) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    os.truncate(pkg / "model.onnx", 4 << 30)
    quantize_fails(cli, tmp_path, sha256_tree, pkg, "not a valid ONNX model", within=2.0)


# -- 9. output names -----------------------------------------------------------------------------------------------
def test_over_long_output_name_is_refused(tmp_path: Path, cli, sha256_tree, tiny_decoder: Path) -> None:
    shutil.copy(tiny_decoder, tmp_path / "model.onnx")
    before = sha256_tree(tmp_path)
    for name in ("q" * 250 + ".onnx", "d" * 300):
        code, _, err = cli("quantize", "-m", tmp_path / "model.onnx", "-o", tmp_path / name, "--algorithm", "rtn")
        assert code == 1, err
        one_error_line(err, "bytes long")
    assert sha256_tree(tmp_path) == before


# -- 10. weights of odd shapes and types (issue #27) -------------------------------------------------------------------
def _odd_model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
               inits: list[onnx.TensorProto], *, opset: int = 17, ir: int = 8) -> onnx.ModelProto:
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir
    return model


def _w(shape: list[int], name: str = "W", dtype: Any = np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.random.default_rng(0).standard_normal(shape).astype(dtype), name)


def _vi(name: str, shape: list[Any] | None, elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _mm(a: str = "x", b: str = "W", out: str = "y", name: str = "mm") -> onnx.NodeProto:
    return helper.make_node("MatMul", [a, b], [out], name=name)


K = 256
#: valid models whose weights are not one 2-D matrix: the run keeps them in float, and the output loads
ODD_VALID: dict[str, tuple[Callable[[], onnx.ModelProto], str]] = {
    "1d": (lambda: _odd_model([_mm()], [_vi("x", [2, K])], [_vi("y", [2])], [_w([K])]), "1-D, a matrix-vector"),
    "1d-symbolic": (lambda: _odd_model([_mm()], [_vi("x", ["n", K])], [_vi("y", ["n"])], [_w([K])]), "1-D"),
    "1d-scalar-output": (lambda: _odd_model([_mm()], [_vi("x", [K])], [_vi("y", [])], [_w([K])]), "1-D"),
    "1d-left-operand": (lambda: _odd_model([_mm("W", "x")], [_vi("x", [K, 8])], [_vi("y", [8])], [_w([K])]), ""),
    "1d-after-a-2d": (lambda: _odd_model(
        [_mm("x", "W2", "h", "mm0"), _mm("h", "W", "y", "mm1")], [_vi("x", ["b", "s", K])], [_vi("y", ["b", "s"])],
        [_w([K, K], "W2"), _w([K])]), "1-D"),
    "1d-also-an-input-ir3": (lambda: _odd_model([_mm()], [_vi("x", [2, K]), _vi("W", [K])], [_vi("y", [2])],
                                                [_w([K])], opset=9, ir=3), "1-D"),
    "1d-value-info": (lambda: _with_value_info(_odd_model([_mm("x", "W", "h"), helper.make_node("Relu", ["h"], ["y"])],
                                                          [_vi("x", [2, K])], [_vi("y", [2])], [_w([K])])), "1-D"),
    "1d-float16": (lambda: _odd_model([_mm()], [_vi("x", [2, K], TensorProto.FLOAT16)],
                                      [_vi("y", [2], TensorProto.FLOAT16)], [_w([K], dtype=np.float16)]), "1-D"),
    "3d-batched": (lambda: _odd_model([_mm()], [_vi("x", [2, 3, 64])], [_vi("y", [2, 3, 64])], [_w([2, 64, 64])]),
                   "3-D, a batched MatMul"),
    "3d-broadcast": (lambda: _odd_model([_mm()], [_vi("x", [3, 64])], [_vi("y", [2, 3, 64])], [_w([2, 64, 64])]),
                     "3-D"),
    "3d-symbolic": (lambda: _odd_model([_mm()], [_vi("x", ["a", "b", "c"])], [_vi("y", ["a", "b", 64])],
                                       [_w([2, 64, 64])]), "3-D"),
    "3d-gather-table": (lambda: _odd_model(
        [helper.make_node("Gather", ["W", "i"], ["y"], name="gather")], [_vi("i", [5], TensorProto.INT64)],
        [_vi("y", [5, 64, 64])], [_w([128, 64, 64])]), "Gather table is not a 2-D float initializer"),
    "int32-weight": (lambda: _odd_model([_mm()], [_vi("x", [2, 64], TensorProto.INT32)],
                                        [_vi("y", [2, 64], TensorProto.INT32)],
                                        [numpy_helper.from_array(np.ones((64, 64), np.int32), "W")]),
                     "INT32, not float"),
}


def _with_value_info(model: onnx.ModelProto) -> onnx.ModelProto:
    model.graph.value_info.extend([_vi("W", [K]), _vi("h", [2])])
    return model


@pytest.mark.parametrize("storage", ["inline", "external"])
@pytest.mark.parametrize("kind", list(ODD_VALID))
def test_odd_weights_stay_float_and_the_output_loads(kind: str, storage: str, tmp_path: Path, cli) -> None:
    """Valid ONNX whose weights are not one [K, N] matrix (a matrix-vector or batched MatMul, a 3-D table):
    the plan says why each stays float, and the output passes the ONNX checker and loads in ONNX Runtime
    whenever its input does (checked for file and external-data storage, and --external-data outputs)."""
    import onnxruntime as ort

    build, reason = ODD_VALID[kind]
    model = tmp_path / "in" / "model.onnx"
    model.parent.mkdir()
    onnx.save(build(), model, save_as_external_data=storage == "external", size_threshold=0,
              location="model.onnx.data")
    onnx.checker.check_model(str(model))  # the input is valid: the output must be as well
    code, out, err = cli("quantize", "-m", model, "-o", tmp_path / "o" / "q.onnx", "--algorithm", "rtn", "--plan")
    assert code == 0, err
    assert reason in out
    for flags in ([], ["--external-data"]):
        dest = tmp_path / f"out{len(flags)}" / "q.onnx"
        code, out, err = cli("quantize", "-m", model, "-o", dest, "--algorithm", "rtn", *flags)
        assert code == 0, err
        assert "error" not in err
        onnx.checker.check_model(str(dest))
        onnx.checker.check_model(str(dest), full_check=True)
        ort.InferenceSession(str(dest), providers=["CPUExecutionProvider"])


#: models ONNX Runtime refuses because of a weight: refused when loaded, naming the node and the weight
UNREADABLE: dict[str, tuple[Callable[[], onnx.ModelProto], tuple[str, ...]]] = {
    "string": (lambda: _odd_model([_mm()], [_vi("x", [3, 64])], [_vi("y", [3, 64])],
                                  [helper.make_tensor("W", TensorProto.STRING, [64, 64], [b"a"] * 4096)]),
               ("MatMul node 'mm'", "'W' (STRING [64, 64])", "as input B")),
    "bool": (lambda: _odd_model([_mm()], [_vi("x", [3, 64])], [_vi("y", [3, 64])],
                                [numpy_helper.from_array(np.ones((64, 64), bool), "W")]), ("'W' (BOOL [64, 64])",)),
    "int8": (lambda: _odd_model([_mm()], [_vi("x", [3, 64])], [_vi("y", [3, 64])],
                                [numpy_helper.from_array(np.ones((64, 64), np.int8), "W")]), ("'W' (INT8",)),
    "float16-under-float": (lambda: _odd_model([_mm()], [_vi("x", [3, 64])], [_vi("y", [3, 64])],
                                               [_w([64, 64], dtype=np.float16)]), ("inconsistent type",)),
    "3d-k-mismatch": (lambda: _odd_model([_mm()], [_vi("x", [2, 3, 32])], [_vi("y", [2, 3, 64])], [_w([2, 64, 64])]),
                      ("'W' (FLOAT [2, 64, 64])", "'x' (FLOAT [2, 3, 32])", "Incompatible dimensions")),
    "3d-batch-mismatch": (lambda: _odd_model([_mm()], [_vi("x", [3, 3, 64])], [_vi("y", [3, 3, 64])],
                                             [_w([2, 64, 64])]), ("Incompatible dimensions",)),
    "3d-gemm": (lambda: _odd_model([helper.make_node("Gemm", ["x", "W"], ["y"], name="gemm")], [_vi("x", [3, 64])],
                                   [_vi("y", [3, 64])], [_w([2, 64, 64])]),
                ("Gemm node 'gemm'", "expected to have rank 2 but has rank 3")),
    "1d-gemm": (lambda: _odd_model([helper.make_node("Gemm", ["x", "W"], ["y"], name="gemm")], [_vi("x", [3, 64])],
                                   [_vi("y", [3])], [_w([64])]), ("rank 2 but has rank 1",)),
    "behind-another-node": (lambda: _odd_model(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), _mm("r", "W")], [_vi("x", [2, 3, 32])],
        [_vi("y", [2, 3, 64])], [_w([2, 64, 64])]), ("'r' (FLOAT [2, 3, 32])", "Incompatible dimensions")),
}


@pytest.mark.parametrize("kind", list(UNREADABLE))
def test_weight_its_node_cannot_read_is_refused_up_front(kind: str, tmp_path: Path, cli, sha256_tree) -> None:
    """Not at the final ONNX Runtime check of the output, after every pass: when the input is loaded, in one
    line naming the node and the weight (quantize, --plan and inspect alike)."""
    import onnxruntime as ort

    build, needles = UNREADABLE[kind]
    model = tmp_path / "in" / "model.onnx"
    model.parent.mkdir()
    onnx.save(build(), model)
    with pytest.raises(Exception):  # noqa: B017 - ONNX Runtime's own exception types
        ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    line = quantize_fails(cli, tmp_path, sha256_tree, model, "is not a valid ONNX model", "ONNX Runtime refuses",
                          *needles, output="out/q.onnx")
    assert "saved model" not in line
    for argv in (("quantize", "-m", model, "-o", tmp_path / "p.onnx", "--algorithm", "rtn", "--plan"),
                 ("inspect", model)):
        code, _, err = cli(*argv)
        assert code == 1
        one_error_line(err, *needles)


def test_onnx_runtime_text_is_folded_into_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime's messages can span lines: the error keeps all of it, on one line."""
    import onnxruntime as ort

    from bitpress.errors import ValidationError
    from bitpress.onnx import save

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("[ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model failed:\nThis is an invalid model.\n"
                           "  Type Error: Type 'tensor(string)' of input parameter (W) is invalid.\n")

    monkeypatch.setattr(ort, "InferenceSession", refuse)
    with pytest.raises(ValidationError) as info:
        save.open_session(tmp_path / "m.onnx")
    assert "\n" not in str(info.value)
    assert "INVALID_GRAPH" in str(info.value) and "Type 'tensor(string)'" in str(info.value)


# -- 11. the helper itself --------------------------------------------------------------------------------------------
def test_paths_inside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f.txt").write_text("x")
    (root / "in").symlink_to(Path("sub") / "f.txt")
    (root / "out").symlink_to(outside_secret(tmp_path))
    (root / "dangling").symlink_to("nope")
    assert paths.inside(root, "in", "file") == (root / "sub" / "f.txt").resolve()
    assert paths.inside(root, root / "sub", "folder", kind="dir") == (root / "sub").resolve()
    with pytest.raises(UnsafePathError, match="out"):
        paths.inside(root, "out", "file")
    with pytest.raises(ModelLoadError, match="dangling"):
        paths.inside(root, "dangling", "file")
    with pytest.raises(ModelLoadError, match="not a regular file"):
        paths.inside(root, "sub", "file")
    with pytest.raises(ModelLoadError, match="not found"):
        paths.inside(root, "missing", "file")
    assert paths.optional(root, "missing", "file") is None
    with pytest.raises(UnsafePathError):
        paths.read_bytes(root, "out", "file")
    with pytest.raises(ModelLoadError, match="dangling"):
        paths.walk(root)
    (root / "dangling").unlink()
    with pytest.raises(UnsafePathError, match="out"):
        paths.walk(root)
    (root / "out").unlink()
    assert [p.name for p, _ in paths.walk(root)] == ["in", "f.txt"]
    with pytest.raises(UnsafePathError, match="leaves"):
        paths.check_name("a/../../b", "name")
    with pytest.raises(UnsafePathError, match="absolute"):
        paths.check_name("/a", "name")
    assert str(paths.check_name("a\\b.onnx", "name")) == "a/b.onnx"


def test_paths_open_refuses_a_file_swapped_for_a_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the check and the open the file becomes a link: the open does not follow it."""
    root = tmp_path / "root"
    root.mkdir()
    target = root / "tokenizer.json"
    target.write_text("{}")
    secret = outside_secret(tmp_path)
    real_inside = paths.inside

    def inside_then_swap(*args: Any, **kwargs: Any) -> Path:
        found = real_inside(*args, **kwargs)
        target.unlink()
        target.symlink_to(secret)
        return found

    monkeypatch.setattr(paths, "inside", inside_then_swap)
    with pytest.raises(UnsafePathError, match="changed"):
        paths.read_bytes(root, target, "tokenizer")


def test_fifo_in_folder_does_not_hang(tmp_path: Path, cli, genai_folder: Path) -> None:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    pkg = tmp_path / "pkg"
    shutil.copytree(genai_folder, pkg)
    os.mkfifo(pkg / "pipe.json")
    (pkg / "tokenizer.json").unlink()
    os.mkfifo(pkg / "tokenizer.json")
    code, _, err = cli("quantize", "-m", pkg, "-o", tmp_path / "out", "--algorithm", "rtn", "--precision", "int4")
    assert code == 0, err  # special files are not copied (never opened)
    assert not (tmp_path / "out" / "pipe.json").exists()
    assert SECRET not in tree_bytes(tmp_path / "out")
