"""Where a Hub id's model came from, in every kind of output; ``bitpress inspect`` of a Hub cache snapshot.

No network: the Hub cache is built by hand in a temporary folder, offline (the ``cache`` fixture and
``make_cache`` of tests/test_hub_ids.py; the shared blob store through huggingface_hub's own code, as
tests/test_hf_cache.py does). A Hugging Face checkpoint written by a ``*_hf`` pass records the repo,
revision and commit in the ``quantization_config`` of its config.json, an ``hf_to_onnx`` export in the
``bitpress`` metadata of each graph, as ONNX outputs do. ``bitpress inspect`` of a model whose files are
links into the cache's blobs runs the ONNX checker on what it can check: a good model is not reported
broken (the checker refuses linked external data), a broken one still is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx
import pytest
import test_hub_ids
from test_hf_cache import REV, cache_folder
from test_hub_ids import COMMIT, REPO, bitpress_metadata, make_cache, run_cli

import bitpress
from bitpress.cli import main
from bitpress.synthetic import build_decoder

cache = test_hub_ids.cache  # the offline Hub cache fixture, shared

SOURCE = {"hub": REPO, "revision": None, "commit": COMMIT, "subfolder": None, "kind": "safetensors"}


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A tiny Llama checkpoint's files (config.json, model.safetensors, ...)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    saved = tmp_path_factory.mktemp("llama") / "saved"
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(saved)
    return {p.name: p.read_bytes() for p in saved.iterdir() if p.is_file()}


# -- Hugging Face checkpoints -----------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "loaded"])
def test_a_checkpoint_quantized_from_a_hub_id_records_the_commit(cache: Path, llama_files: dict[str, bytes],
                                                                 stream: bool, tmp_path: Path) -> None:
    import transformers

    from bitpress.hf.model import HfModel

    make_cache(cache, REPO, llama_files)
    passes = [{"type": "rtn_hf", "stream": stream}]
    result = bitpress.run({"input": REPO, "output": "out", "passes": passes})
    assert result.source == SOURCE
    out = (Path("out") / REPO.split("/")[1]).absolute()
    config_file = out / "config.json"
    qc = json.loads(config_file.read_text())["quantization_config"]
    assert qc["quant_method"] == "bitpress" and qc["modules"]
    assert qc["source"] == SOURCE
    assert [p["pass"] for p in qc["passes"]] == ["rtn_hf"]
    assert config_file.stat().st_nlink == 1  # its own file, not one shared with a scratch copy
    # still read by bitpress (the quantized weights restored) and by transformers
    assert HfModel.load(out).torch_model() is not None
    assert transformers.AutoConfig.from_pretrained(out).model_type == "llama"
    # from a local folder: no source, and the same config otherwise
    local = tmp_path / "local"
    local.mkdir()
    for name, data in llama_files.items():
        (local / name).write_bytes(data)
    assert bitpress.run({"input": str(local), "output": "out-local", "passes": passes}).source is None
    local_qc = json.loads((Path("out-local") / "local" / "config.json").read_text())["quantization_config"]
    assert local_qc == {k: v for k, v in qc.items() if k != "source"}


# -- hf_to_onnx exports -----------------------------------------------------------------------------------
def test_an_export_from_a_hub_id_records_the_commit(cache: Path, llama_files: dict[str, bytes],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(cache, REPO, llama_files)
    code, result, err = run_cli(["export", REPO, "-o", "pkg", "--runtime", "onnx", "--json"], capsys)
    assert code == 0, err
    assert result["source"] == SOURCE
    record = bitpress_metadata(Path("pkg") / REPO.split("/")[1] / "model.onnx")
    assert record["source"] == SOURCE
    assert [p["pass"] for p in record["passes"]] == ["hf_to_onnx"]


def test_a_quantized_split_export_records_the_commit_in_every_graph(cache: Path, llama_files: dict[str, bytes]) -> None:
    make_cache(cache, REPO, llama_files)
    passes = [{"type": "rtn_hf", "group_size": 32}, {"type": "hf_to_onnx", "split_embedding": True}]
    result = bitpress.run({"input": REPO, "output": "out", "passes": passes})
    out = Path("out") / REPO.split("/")[1]
    graphs = sorted(out.glob("*.onnx"))
    assert [g.name for g in graphs] == ["decoder.onnx", "embedding.onnx"]
    for graph in graphs:
        assert bitpress_metadata(graph)["source"] == SOURCE == result.source


# -- bitpress inspect of a snapshot -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def decoder_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``model.onnx`` with its weights in ``model.onnx.data``."""
    return build_decoder(tmp_path_factory.mktemp("dec") / "model.onnx", external_data=True, hidden=64, layers=1,
                         heads=4, vocab=128).parent


def inspect(target: Path, capsys: pytest.CaptureFixture[str]) -> list[dict]:
    code = main(["inspect", str(target), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    return report if isinstance(report, list) else [report]


#: the data file's blob in the repo's blobs, as the model's; or moved to the cache's shared store
@pytest.mark.parametrize("shared", [(), ("model.onnx.data",)], ids=["repo_blobs", "shared_store"])
def test_inspect_a_snapshot_with_external_data(decoder_folder: Path, tmp_path: Path, shared: tuple[str, ...],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    cache_dir = tmp_path / "hub"
    snap = cache_folder(decoder_folder, cache_dir, shared=shared)
    assert (snap / "model.onnx").is_symlink() and (snap / "model.onnx.data").is_symlink()
    blobs = {Path(os.path.realpath(snap / n)).parent for n in ("model.onnx", "model.onnx.data")}
    assert len(blobs) == (2 if shared else 1)
    plain = inspect(decoder_folder / "model.onnx", capsys)[0]
    assert plain["checker"] == "ok"
    for target in (snap / "model.onnx", snap):
        (rep,) = inspect(target, capsys)
        assert rep["checker"] == "ok", rep["checker"]
        assert {k: v for k, v in rep.items() if k != "model"} == {k: v for k, v in plain.items() if k != "model"}
        assert rep["model"] == str(snap / "model.onnx")
    assert sorted(os.listdir(snap)) == ["model.onnx", "model.onnx.data"]  # nothing written into the cache


def test_the_checker_on_a_snapshot_passes_a_good_model_and_fails_a_broken_one(
        decoder_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Adapted, not skipped: what the checker refuses in a folder it refuses in a snapshot, and nothing else. A
    saved model the checker refuses is refused unless its input fails too: an input in a snapshot passes."""
    import shutil

    from bitpress.errors import ValidationError
    from bitpress.onnx.save import check_saved

    bad = tmp_path / "bad"
    shutil.copytree(decoder_folder, bad)
    proto = onnx.load(str(bad / "model.onnx"), load_external_data=False)
    for value in ("a", "b"):  # ONNX Runtime and bitpress load it; the checker refuses it
        proto.metadata_props.add(key="note", value=value)
    onnx.save(proto, str(bad / "model.onnx"))
    bad_snap = cache_folder(bad, tmp_path / "hub-bad", shared=("model.onnx.data",))
    (rep,) = inspect(bad_snap / "model.onnx", capsys)
    assert rep["checker"].startswith("fails: ") and "duplicate keys in metadata_props" in rep["checker"]
    assert "symbolic link" not in rep["checker"]

    good_snap = cache_folder(decoder_folder, tmp_path / "hub", shared=("model.onnx.data",))
    assert good_snap.name == REV
    with pytest.raises(ValidationError, match="fails the ONNX checker"):
        check_saved(bad / "model.onnx", reference=good_snap / "model.onnx")
    assert check_saved(bad / "model.onnx", reference=bad_snap / "model.onnx")  # both fail: a note, not an error
