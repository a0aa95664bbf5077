"""Hugging Face Hub ids where bitpress did not take them before: publish configs, ``bitpress.evaluate``, sweep
``models:`` and Olive-style ``input_model.model_path``.

No network: every test points huggingface_hub at a cache in a temporary folder, built by hand in its own
layout (tests/test_hub_ids.py's ``make_cache``), with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
import pytest
import test_hub_ids
import yaml
from test_hub_ids import COMMIT, OTHER, REPO, make_cache

from bitpress.synthetic import build_decoder

cache = test_hub_ids.cache  # the offline Hub cache fixture, shared

hf_constants = pytest.importorskip("huggingface_hub.constants")

TOK = "acme/tiny-tokenizer"
TOK_COMMIT = "1111111111111111111111111111111111111111"


@pytest.fixture(scope="module")
def decoder_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = build_decoder(tmp_path_factory.mktemp("decoder") / "model.onnx", hidden=32, layers=1, heads=2, vocab=64)
    return path.read_bytes()


def tokenizer_bytes(vocab: int = 64) -> bytes:
    """A WordLevel tokenizer.json: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``w3`` ... ``w<vocab-1>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str().encode()


def source_of(path: Path) -> dict[str, Any]:
    model = onnx.load(str(path), load_external_data=False)
    return json.loads(next(p.value for p in model.metadata_props if p.key == "bitpress"))["source"]


# -- publish -----------------------------------------------------------------------------------------
CHECKPOINT = {"model.safetensors": b"not read by the fake runs", "config.json": b"{}", "tokenizer.json": b"{}",
              "README.md": b"not taken"}


@pytest.fixture
def fake_runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``workflow.runner.run`` replaced: each call recorded, its folder output made as the runner names it."""
    from bitpress.workflow import runner

    calls: list[dict[str, Any]] = []

    def run(config: dict[str, Any], *, progress: Any = None, origin: dict[str, Any] | None = None,
            **_: Any) -> None:
        calls.append({"config": config, "origin": origin})
        name = origin["hub"].rsplit("/", 1)[-1] if origin else Path(config["input"]).name
        made = Path(config["output"]) / name
        made.mkdir(parents=True)
        (made / "genai_config.json").write_text("{}")

    monkeypatch.setattr(runner, "run", run)
    return calls


def test_publish_config_input_and_variant_tokenizer_from_the_hub(cache: Path, tmp_path: Path,
                                                                  fake_runs: list[dict[str, Any]]) -> None:
    from bitpress.genai.publish import INDEX, load_publish_config, publish

    snapshot = make_cache(cache, REPO, {f"hf/{k}": v for k, v in CHECKPOINT.items()})
    tok = make_cache(cache, TOK, {"tokenizer.json": b"{}", "tokenizer_config.json": b"{}"}, commit=TOK_COMMIT)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "calib.txt").write_text("w3 w4 w5")
    (conf / "publish.yaml").write_text(yaml.safe_dump({
        "input": REPO, "subfolder": "hf", "output": "published",
        "matrix": {"dtypes": ["f32"], "eps": ["cpu"],
                   "variants": {"int4": {"passes": [{"type": "rtn_hf"}],
                                         "data": {"source": "calib.txt", "tokenizer": TOK}}}},
    }))
    config = load_publish_config(conf / "publish.yaml")
    assert config["input"] == REPO  # the Hub ids kept as written, for publish to resolve
    assert config["matrix"]["variants"]["int4"]["data"]["tokenizer"] == TOK
    result = publish(config)
    record = {"hub": REPO, "revision": None, "commit": COMMIT, "subfolder": "hf", "kind": "safetensors"}
    assert result.source == record and not result.failed, [c.reason for c in result.cells]
    assert [c["origin"] for c in fake_runs] == [record] * 3  # f32 cell, the variant's passes, its cell
    assert fake_runs[0]["config"]["input"] == str(snapshot / "hf")
    assert Path(fake_runs[1]["config"]["data"]["tokenizer"]) == tok
    assert fake_runs[1]["config"]["data"]["source"] == str(conf / "calib.txt")
    assert fake_runs[2]["config"]["input"].endswith("tiny-decoder")  # the checkpoint named after the repo
    index = json.loads((conf / "published" / INDEX).read_text())
    assert index["source"] == record and {c["status"] for c in index["cells"]} == {"ok"}
    assert (conf / "published" / "int4" / "cpu" / "genai_config.json").is_file()


def test_publish_a_local_folder_named_like_a_hub_id_wins(cache: Path, tmp_path: Path,
                                                         fake_runs: list[dict[str, Any]]) -> None:
    from bitpress.genai.publish import load_publish_config, publish

    make_cache(cache, REPO, CHECKPOINT)
    conf = tmp_path / "conf"
    (conf / REPO).mkdir(parents=True)
    (conf / "publish.yaml").write_text(yaml.safe_dump({"input": REPO, "output": "out",
                                                       "matrix": {"dtypes": ["f32"], "eps": ["cpu"]}}))
    config = load_publish_config(conf / "publish.yaml")
    assert config["input"] == str(conf / REPO)
    result = publish(config)
    assert result.source is None and fake_runs[0]["origin"] is None
    assert fake_runs[0]["config"]["input"] == str(conf / REPO)


def test_publish_a_hub_repo_without_a_checkpoint_is_refused_before_anything_is_built(
        cache: Path, decoder_bytes: bytes, fake_runs: list[dict[str, Any]]) -> None:
    from bitpress.errors import ModelLoadError
    from bitpress.genai.publish import publish

    make_cache(cache, REPO, {"model.onnx": decoder_bytes, "config.json": b"{}"})
    with pytest.raises(ModelLoadError, match="no safetensors checkpoint"):
        publish({"input": REPO, "output": "out", "matrix": {"dtypes": ["f32"], "eps": ["cpu"]}})
    assert not fake_runs and not Path("out").exists()


@pytest.mark.slow
def test_publish_from_the_hub_records_the_commit_in_every_manifest(cache: Path, tmp_path: Path) -> None:
    """The real GenAI builder: a tiny Llama checkpoint in the cache, one float cell."""
    pytest.importorskip("onnxruntime_genai.models.builder")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from bitpress.genai.manifest import MANIFEST, verify
    from bitpress.genai.publish import INDEX, publish

    torch.manual_seed(0)
    saved = tmp_path / "saved"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )).eval().save_pretrained(saved)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, 256)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                         pad_token="<pad>").save_pretrained(saved)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(saved)
    make_cache(cache, REPO, {p.name: p.read_bytes() for p in saved.iterdir() if p.is_file()})
    result = publish({"input": REPO, "output": "published", "matrix": {"dtypes": ["f32"], "eps": ["cpu"]}})
    assert not result.failed, [c.reason for c in result.cells]
    pkg = Path("published/f32/cpu")
    made = json.loads((pkg / MANIFEST).read_text())["made"]
    assert made["input"]["hub"] == REPO and made["input"]["commit"] == COMMIT
    assert verify(pkg).ok
    assert json.loads(Path("published", INDEX).read_text())["source"]["commit"] == COMMIT


# -- bitpress.evaluate --------------------------------------------------------------------------------
def test_evaluate_takes_hub_ids_and_says_which_commits(cache: Path, decoder_bytes: bytes) -> None:
    import bitpress

    make_cache(cache, REPO, {"model.onnx": decoder_bytes})
    bitpress.quantize(REPO, "q", algorithm="rtn")
    make_cache(cache, "acme/tiny-decoder-q", {"model.onnx": Path("q/model.onnx").read_bytes()}, commit=OTHER)
    make_cache(cache, TOK, {"tokenizer.json": tokenizer_bytes()}, commit=TOK_COMMIT)
    Path("text.txt").write_text(" ".join(f"w{3 + i % 60}" for i in range(40)))
    result = bitpress.evaluate("acme/tiny-decoder-q", REPO, text="text.txt", tokenizer=TOK, seq_len=8,
                               max_windows=2, speed=False, weights=False)
    assert {k: v["commit"] for k, v in result.sources.items()} == {
        "quantized": OTHER, "reference": COMMIT, "tokenizer": TOK_COMMIT}
    assert result.sources["tokenizer"]["kind"] == "tokenizer"
    assert result.perplexity is not None and result.perplexity.windows == 2
    out = result.to_json()
    assert out["sources"]["reference"] == {"hub": REPO, "revision": None, "commit": COMMIT, "subfolder": None,
                                           "kind": "onnx"}
    assert any(n.startswith("reference: ") and COMMIT in n for n in out["notes"])
    # a local path: no sources
    assert bitpress.evaluate("q/model.onnx", "q/model.onnx", samples=1, seq_len=8, speed=False,
                             weights=False).sources == {}


def test_evaluate_subfolder_and_the_repo_roots_tokenizer(cache: Path, decoder_bytes: bytes,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import bitpress
    from bitpress.cli import main

    make_cache(cache, REPO, {"onnx/model.onnx": decoder_bytes, "tokenizer.json": tokenizer_bytes()})
    Path("text.txt").write_text(" ".join(f"w{3 + i % 60}" for i in range(40)))
    # no tokenizer given: the one at the repo's root (the subfolder has none)
    result = bitpress.evaluate(REPO, REPO, subfolder="onnx", text="text.txt", seq_len=8, max_windows=1,
                               speed=False, weights=False)
    assert result.sources["quantized"]["subfolder"] == "onnx" and result.perplexity is not None
    assert main(["eval", REPO, "--reference", REPO, "--subfolder", "onnx", "--samples", "1", "--seq-len", "8",
                 "--no-speed", "--no-weights", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["sources"]["reference"]["commit"] == COMMIT
    assert f"note: reference: {REPO} at commit {COMMIT} (subfolder onnx)" in err


# -- sweep models ---------------------------------------------------------------------------------------
def test_sweep_models_may_be_hub_ids(cache: Path, decoder_bytes: bytes, tmp_path: Path) -> None:
    import bitpress
    from bitpress.sweep.config import load_sweep_config, parse_sweep

    snapshot = make_cache(cache, REPO, {"model.onnx": decoder_bytes})
    make_cache(cache, "acme/deep", {"onnx/model.onnx": decoder_bytes}, commit=OTHER)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "sweep.yaml").write_text(yaml.safe_dump({
        "models": [REPO, {"model": "acme/deep", "subfolder": "onnx"}], "passes": ["rtn"], "eval": False,
        "output": "out", "threads": 1,
    }))
    raw = load_sweep_config(conf / "sweep.yaml")
    assert raw["models"][0] == REPO and raw["models"][1]["model"] == "acme/deep"
    cfg = parse_sweep(raw)
    assert cfg.models[0] == snapshot.resolve()
    assert cfg.sources[str(snapshot.resolve())]["commit"] == COMMIT
    assert cfg.sources[str(cfg.models[1])] == {"hub": "acme/deep", "revision": None, "commit": OTHER,
                                               "subfolder": "onnx", "kind": "onnx"}
    result = bitpress.sweep(conf / "sweep.yaml", jobs=1)
    assert not result.failed, [r["error"] for r in result.rows]
    rows = {r["source"]["hub"]: r for r in result.rows}
    assert rows[REPO]["source"]["commit"] == COMMIT and rows["acme/deep"]["source"]["commit"] == OTHER
    assert sorted(result.names.values()) == ["acme/deep/onnx", REPO]  # named by repo, not the cache's commit
    assert source_of(conf / "out" / rows[REPO]["output"] / "model.onnx")["commit"] == COMMIT
    saved = [json.loads(line) for line in (conf / "out" / "results.jsonl").read_text().splitlines()]
    assert {r["source"]["commit"] for r in saved} == {COMMIT, OTHER}


def test_a_sweeps_eval_tokenizer_may_be_a_hub_id(cache: Path, decoder_bytes: bytes, tmp_path: Path) -> None:
    from bitpress.errors import BitpressError
    from bitpress.sweep.config import load_sweep_config, parse_sweep

    snapshot = make_cache(cache, TOK, {"tokenizer.json": tokenizer_bytes()}, commit=TOK_COMMIT)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "model.onnx").write_bytes(decoder_bytes)  # no tokenizer beside it: eval.tokenizer is needed
    (conf / "corpus.txt").write_text(" ".join(f"w{3 + i % 60}" for i in range(400)))
    (conf / "sweep.yaml").write_text(yaml.safe_dump({
        "models": ["model.onnx"], "passes": ["rtn"], "output": "out",
        "eval": {"text": "corpus.txt", "tokenizer": TOK, "windows": 1, "seq_len": 16},
    }))
    raw = load_sweep_config(conf / "sweep.yaml")
    assert raw["eval"]["tokenizer"] == TOK  # kept as written: a Hub id, not a path beside the config
    cfg = parse_sweep(raw)
    assert cfg.eval is not None and Path(cfg.eval.tokenizer) == snapshot
    raw["eval"]["tokenizer"] = "acme/no-such-tokenizer"
    with pytest.raises(BitpressError, match="acme/no-such-tokenizer"):
        parse_sweep(raw)


# -- Olive-style input_model ---------------------------------------------------------------------------
def test_olive_input_model_path_may_be_a_hub_id(cache: Path, decoder_bytes: bytes, tmp_path: Path) -> None:
    import bitpress
    from bitpress.api import resolve_config

    snapshot = make_cache(cache, REPO, {"onnx/model.onnx": decoder_bytes})
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "olive.yaml").write_text(yaml.safe_dump({
        "input_model": {"type": "ONNXModel", "model_path": REPO}, "subfolder": "onnx", "output_dir": "out",
        "passes": {"q": {"type": "rtn"}},
    }))
    config, source = resolve_config(conf / "olive.yaml")
    assert config["input_model"] == {"type": "ONNXModel", "model_path": str(snapshot / "onnx")}
    assert source is not None and source.commit == COMMIT and "subfolder" not in config
    result = bitpress.run(conf / "olive.yaml")
    assert result.source["commit"] == COMMIT and result.source["subfolder"] == "onnx"
    assert source_of(conf / "out" / "model.onnx")["commit"] == COMMIT
    # input: wins over input_model, as build_workflow reads them
    assert resolve_config({"input": "local.onnx", "input_model": {"model_path": REPO}, "output": "o"})[1] is None


def test_olive_tokenizer_dir_may_be_a_hub_id(cache: Path, decoder_bytes: bytes, tmp_path: Path) -> None:
    """Olive's per-pass ``tokenizer_dir`` (the calibration text's tokenizer) as a Hub id: its tokenizer files."""
    import bitpress
    from bitpress.api import resolve_config

    tok = make_cache(cache, TOK, {"tokenizer.json": tokenizer_bytes()}, commit=TOK_COMMIT)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "model.onnx").write_bytes(decoder_bytes)
    (conf / "calib.txt").write_text(" ".join(f"w{3 + i % 60}" for i in range(600)))
    (conf / "olive.yaml").write_text(yaml.safe_dump({
        "input_model": {"type": "ONNXModel", "model_path": "model.onnx"}, "output_dir": "out",
        "data": {"source": "calib.txt", "samples": 2, "seq_len": 16},
        "passes": {"q": {"type": "gptq", "tokenizer_dir": TOK}},
    }))
    config, _ = resolve_config(conf / "olive.yaml")
    assert Path(config["passes"]["q"]["tokenizer_dir"]) == tok
    result = bitpress.run(conf / "olive.yaml")
    assert (conf / "out" / "model.onnx").is_file() and [name for name, _, _ in result.reports] == ["gptq"]
