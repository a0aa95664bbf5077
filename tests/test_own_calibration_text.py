"""Calibration text the model writes itself (``generated``, ``source: generated``): sampling, the KV cache
path against full reruns, the default share of GPTQ / AWQ, and refusals.

Models come from test_calibration_text: a ``GroupQueryAttention`` decoder (builder-style growing cache,
or a sliding-window layer whose fixed-capacity cache the sampler does not feed back) and a decoder
whose cache is a ``Concat`` of past and new keys, in a package with the decoder in a sub-folder.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from test_calibration_text import BOS, VOCAB, build_gqa_decoder, concat_package, write_text, write_tokenizer

import bitpress
from bitpress.calibration import generate
from bitpress.calibration.data import DataConfig, iter_feeds, own_windows
from bitpress.errors import BitpressError, ConfigError
from bitpress.genai.kvcache import cache_plan, kv_hints
from bitpress.genai.package import find_genai_config
from bitpress.models.onnx_model import OnnxModel
from bitpress.models.onnx_package import OnnxPackage
from bitpress.onnx.inputs import input_specs

pytest.importorskip("tokenizers")

__all__ = ["concat_package"]  # a fixture used here


def _gqa(tmp_path: Path, sliding: tuple[int, ...] = ()) -> Path:
    folder = tmp_path / ("gqa-sliding" if sliding else "gqa")
    path = build_gqa_decoder(folder, sliding=sliding)
    write_tokenizer(folder)
    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # an ONNX Runtime without GroupQueryAttention's sliding-window cache
        pytest.skip(f"this ONNX Runtime cannot run the test model: {str(exc).splitlines()[0]}")
    return folder


def _sample(model: OnnxModel, count: int, seq_len: int = 12, seed: int = 0) -> np.ndarray:
    folder = model.source.parent
    specs = input_specs(model.proto)
    plan = cache_plan(model.proto, kv_hints(find_genai_config(folder, getattr(model, "package_root", None))),
                      specs=specs)
    tok = (getattr(model, "package_root", None) or folder) / "tokenizer.json"
    return own_windows(model, specs, plan, tok, DataConfig(source="generated", samples=count, seq_len=seq_len,
                                                           seed=seed))


def _uncached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generate, "_present_for", lambda past, outputs: None)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max()
    e = np.exp(x)
    return e / e.sum()


@pytest.mark.parametrize("kind", ["gqa", "concat"])
def test_the_cached_path_samples_what_full_reruns_sample(kind: str, tmp_path: Path, concat_package: Path,
                                                          monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    model = (OnnxModel.load(_gqa(tmp_path) / "model.onnx") if kind == "gqa"
             else OnnxPackage.load(concat_package).component("decoder/model.onnx"))
    dec = generate.decoder(model, input_specs(model.proto), cache_plan(
        model.proto, kv_hints(find_genai_config(model.source.parent, getattr(model, "package_root", None)))))
    assert dec.cached and len(dec.past_of) >= 2  # every past input fed back from its present output
    with caplog.at_level(logging.WARNING, logger="bitpress"):
        cached = _sample(model, 10, seed=3)
    assert "disagrees" not in caplog.text
    assert cached.shape == (10, 12) and (cached[:, 0] == BOS).all() and (cached < VOCAB).all()
    _uncached(monkeypatch)
    full = _sample(model, 10, seed=3)
    np.testing.assert_array_equal(cached, full)
    assert len({tuple(r) for r in cached}) == 10  # sampled, not one greedy text repeated
    assert not np.array_equal(_sample(model, 10, seed=4), full)  # the seed decides


def test_samples_follow_the_models_distribution(tmp_path: Path) -> None:
    """The first sampled token's frequencies against the model's softmax after BOS (total variation)."""
    folder = _gqa(tmp_path)
    model = OnnxModel.load(folder / "model.onnx")
    n = 3000
    got = _sample(model, n, seq_len=2)[:, 1]
    sess = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    feed = {"input_ids": np.array([[BOS]]), "attention_mask": np.ones((1, 1), np.int64),
            "position_ids": np.zeros((1, 1), np.int64)}
    for i in range(2):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = np.zeros((1, 1, 0, 16), np.float32)
    p = _softmax(sess.run(["logits"], feed)[0][0, -1])
    freq = np.bincount(got, minlength=VOCAB) / n
    assert 0.5 * np.abs(freq - p).sum() < 0.08  # greedy or a wrong temperature would be far off
    assert p.max() < 0.5  # the test model's distribution is spread: greedy would fail the bound above


def test_a_cache_that_disagrees_is_dropped_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    model = OnnxModel.load(_gqa(tmp_path) / "model.onnx")
    step = generate._Decoder.step

    def wrong(self: Any, token: np.ndarray, length: int, past: dict) -> Any:
        logits, grown = step(self, token, length, past)
        return logits + np.linspace(0, 5, logits.shape[1]), grown

    monkeypatch.setattr(generate._Decoder, "step", wrong)
    with caplog.at_level(logging.WARNING, logger="bitpress"):
        got = _sample(model, 9, seed=1)
    assert "disagrees with a full run" in caplog.text
    monkeypatch.undo()
    _uncached(monkeypatch)
    np.testing.assert_array_equal(got, _sample(model, 9, seed=1))


def test_a_fixed_capacity_cache_is_sampled_by_full_reruns(tmp_path: Path) -> None:
    model = OnnxModel.load(_gqa(tmp_path, sliding=(0,)) / "model.onnx")
    plan = cache_plan(model.proto, kv_hints(find_genai_config(model.source.parent, None)))
    assert not generate.decoder(model, input_specs(model.proto), plan).cached
    got = _sample(model, 3, seq_len=10)
    assert got.shape == (3, 10) and (got[:, 0] == BOS).all()


def test_feeds_mix_the_text_and_the_models_own_windows(tmp_path: Path) -> None:
    folder = _gqa(tmp_path)
    model = OnnxModel.load(folder / "model.onnx")
    text = write_text(tmp_path / "calib.txt", 400, 0)
    config = DataConfig(source=str(text), samples=6, seq_len=12, generated=2)
    feeds = list(iter_feeds(model.proto, config, folder, handle=model))
    assert len(feeds) == 6
    ids = [f["input_ids"][0] for f in feeds]
    words = np.concatenate([i[1:] for i in ids[:4]])
    assert (words >= 3).all() and (words < VOCAB // 2).all()  # the text's half of the vocabulary
    own = np.stack(ids[4:])
    np.testing.assert_array_equal(own, _sample(model, 2, seed=0))
    assert (own[:, 1:] >= VOCAB // 2).any()  # the model's text is not the text's
    with pytest.raises(BitpressError, match="cannot run the model to write its own calibration text here"):
        list(iter_feeds(model.proto, config, folder))


def test_data_config_checks_generated() -> None:
    assert DataConfig.from_value({"source": "a.txt", "samples": 8, "generated": 3}).own == 3
    assert DataConfig(source="generated", samples=5).own == 5
    assert DataConfig(source="a.txt", samples=8).own == 0
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError, match="generated must be a whole number"):
            DataConfig(source="a.txt", generated=bad)
    with pytest.raises(ConfigError, match=r"generated \(9\) is more than samples \(8\)"):
        DataConfig(source="a.txt", samples=8, generated=9)
    with pytest.raises(ConfigError, match="is not a text"):
        DataConfig(source="calib.npz", generated=2)
    # a calibrated pass's default: half of the samples, given a text and no generated
    assert DataConfig(source="a.txt", samples=9).with_own_text("gptq").generated == 4
    assert DataConfig(source="a.txt", samples=8, generated=0).with_own_text("gptq").generated == 0
    assert DataConfig(source="random").with_own_text("gptq").generated is None
    assert DataConfig(source="a.txt", generated=200).enough_for(64, "gptq").samples == 200


def test_gptq_takes_half_its_samples_from_the_model_unless_told(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    folder = _gqa(tmp_path)
    text = write_text(tmp_path / "calib.txt", 400, 0)
    for generated, want in ((None, "4 of the 8 samples, a calibrated pass's default beside a text"), (0, None)):
        caplog.clear()
        data: dict[str, Any] = {"source": str(text), "samples": 8, "seq_len": 12}
        if generated is not None:
            data["generated"] = generated
        with caplog.at_level(logging.INFO, logger="bitpress"):
            bitpress.quantize(folder, tmp_path / f"out-{generated}", algorithm="gptq", precision="int4",
                              options={"block_size": 16}, data=data)
        if want:
            assert want in caplog.text and "the model writes 4 windows of 12 tokens" in caplog.text
        else:
            assert "the model writes" not in caplog.text


def test_source_generated_from_the_command_line(tmp_path: Path, run_cli: Any) -> None:
    folder = _gqa(tmp_path)
    out = tmp_path / "out"
    code, _, err = run_cli("-v", "quantize", "-m", folder, "-o", out, "--algorithm", "gptq", "--precision", "int4",
                           "--option", "block_size=16", "--data", "generated", "--seq-len", "12", "--samples", "4")
    assert code == 0, err
    assert "the model writes 4 windows of 12 tokens" in err
    assert (out / "genai_config.json").read_bytes() == (folder / "genai_config.json").read_bytes()
    text = write_text(tmp_path / "calib.txt", 400, 0)
    for generated, want in (("0", None), ("3", "the model writes 3 windows of 12 tokens")):
        code, _, err = run_cli("-v", "quantize", "-m", folder, "-o", tmp_path / f"out{generated}", "--algorithm",
                               "gptq", "--precision", "int4", "--option", "block_size=16", "--data", text,
                               "--seq-len", "12", "--samples", "4", "--generated", generated)
        assert code == 0, err
        assert (want in err) if want else ("the model writes" not in err), err[-2000:]
    code, _, err = run_cli("quantize", "-m", folder, "-o", tmp_path / "bad", "--algorithm", "gptq", "--data", text,
                           "--samples", "4", "--generated", "5")
    assert code != 0 and err.count("bitpress: error:") == 1 and "generated (5) is more than samples (4)" in err


def test_a_tokenizer_without_bos_starts_from_its_end_of_text_token(tmp_path: Path) -> None:
    from bitpress.calibration.text import load_tokenizer, start_tokens

    folder = tmp_path / "tok"
    path = write_tokenizer(folder, bos=None)
    tok = load_tokenizer(path)
    assert start_tokens(tok, path) == (2,)  # "</s>", a usual name for it
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "w7"}))
    assert start_tokens(tok, path) == (7,)


def test_a_model_that_cannot_write_is_calibrated_on_the_text_alone(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The default share falls back to the text for an encoder; a share the user asked for is refused."""
    from bitpress.synthetic import build_encoder

    folder = tmp_path / "enc"
    build_encoder(folder / "model.onnx", hidden=VOCAB, layers=1, vocab=VOCAB)  # as wide as the vocabulary
    write_tokenizer(folder)
    text = write_text(tmp_path / "calib.txt", 400, 0)
    data: dict[str, Any] = {"source": str(text), "samples": 4, "seq_len": 12}
    with caplog.at_level(logging.INFO, logger="bitpress"):
        bitpress.quantize(folder / "model.onnx", tmp_path / "q.onnx", algorithm="gptq", precision="int4",
                          options={"block_size": 16}, data=data)
    assert "calibrating on calib.txt alone: the model's own calibration text needs a language model" in caplog.text
    with pytest.raises(BitpressError, match="needs a language model"):
        bitpress.quantize(folder / "model.onnx", tmp_path / "q2.onnx", algorithm="gptq", precision="int4",
                          options={"block_size": 16}, data={**data, "generated": 2})
    assert not (tmp_path / "q2.onnx").exists()


def test_a_passs_default_share_is_not_part_of_the_config() -> None:
    """``asdict`` copies (sent to plugin environments) read back; only a pass's default falls back."""
    import dataclasses

    auto = DataConfig(source="a.txt", samples=8).with_own_text("gptq")
    assert auto.fallback and auto.generated == 4
    copy = DataConfig.from_value(dataclasses.asdict(auto))
    assert copy == auto and not copy.fallback and copy.generated == 4
    assert not DataConfig(source="a.txt", samples=8, generated=4).fallback


def test_without_data_gptq_calibrates_on_the_models_own_text(tmp_path: Path, run_cli: Any) -> None:
    """No --data (Olive's AutoAWQQuantizer / GptqQuantizer examples give none): the model's own text, said in a
    warning; a model that cannot write stops in one line asking for data; a pass that cannot use own text still
    needs data."""
    from bitpress.synthetic import build_encoder

    folder = _gqa(tmp_path)
    code, out, err = run_cli("quantize", "-m", folder, "-o", tmp_path / "out", "--algorithm", "gptq", "--precision",
                             "int4", "--option", "block_size=16")
    assert code == 0, err
    assert "no calibration data given: gptq calibrates on text the model writes itself" in err
    assert "calibrates on text the model writes itself" in next(line for line in out.splitlines()
                                                                if line.startswith("note: "))  # the run report too
    enc = tmp_path / "enc"
    build_encoder(enc / "model.onnx", hidden=VOCAB, layers=1, vocab=VOCAB)
    write_tokenizer(enc)
    code, _, err = run_cli("quantize", "-m", enc / "model.onnx", "-o", tmp_path / "q.onnx", "--algorithm", "gptq",
                           "--precision", "int4", "--option", "block_size=16")
    assert code != 0 and err.count("bitpress: error:") == 1 and "give calibration data (--data" in err, err
    assert not (tmp_path / "q.onnx").exists()


def test_a_whole_olive_workflow_file_runs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Olive's file shape: input_model, passes as a mapping (one nested under Olive's older ``config``),
    data_configs naming a Hub dataset, systems / evaluators / engine sections: the passes run, the sections read
    past and the dataset not downloaded, each said in a warning; gptq calibrates on the model's own text."""
    folder = _gqa(tmp_path)
    workflow = {
        "input_model": {"type": "ONNXModel", "model_path": str(folder)},
        "systems": {"local_system": {"type": "LocalSystem", "accelerators": [{"device": "cpu"}]}},
        "data_configs": [{"name": "wikitext2_train", "type": "HuggingfaceContainer",
                          "load_dataset_config": {"data_name": "wikitext", "subset": "wikitext-2-raw-v1"}}],
        "evaluators": {"common_evaluator": {"metrics": [{"name": "latency", "type": "latency"}]}},
        "passes": {"gptq": {"type": "gptq", "data_config": "wikitext2_train", "precision": "int4",
                            "config": {"block_size": 16}}},
        "engine": {"log_severity_level": 0, "cache_dir": "cache"},
        "output_dir": str(tmp_path / "out"),
    }
    with caplog.at_level(logging.WARNING):
        bitpress.run(workflow)
    text = caplog.text
    assert "Olive workflow sections engine, evaluators, systems read past" in text
    assert "Olive's data_config wikitext2_train (dataset wikitext) is not loaded" in text
    assert "no calibration data given: gptq calibrates on text the model writes itself" in text
    assert (tmp_path / "out" / "genai_config.json").is_file() and (tmp_path / "out" / "model.onnx").is_file()


def test_olive_tokenizer_dir_is_the_calibration_tokenizer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Olive's per-pass ``tokenizer_dir`` (NVModelOptQuantization's) is bitpress's ``--tokenizer``: relative to the
    config file, used for a text given as data, and for the model's own text without data; two different ones,
    or one against ``data: tokenizer``, are refused in one line."""
    import shutil

    from bitpress.workflow.config import build_workflow, load_config

    folder = _gqa(tmp_path)
    (tmp_path / "tok").mkdir()
    shutil.move(folder / "tokenizer.json", tmp_path / "tok" / "tokenizer.json")
    write_text(tmp_path / "calib.txt", 400, 0)

    def config(**data: Any) -> Path:
        path = tmp_path / "w.json"
        entry = {"type": "gptq", "precision": "int4", "block_size": 16, "tokenizer_dir": "tok"}
        path.write_text(json.dumps({"input": "gqa", "output": "out", "passes": [entry],
                                    **({"data": data} if data else {})}))
        return path

    wf = build_workflow(load_config(config(source="calib.txt", samples=4, seq_len=16)))
    assert wf.data.tokenizer == str(tmp_path / "tok") and wf.tokenizer is None
    own = build_workflow(load_config(config()))
    assert own.data is None and own.tokenizer == str(tmp_path / "tok")
    with pytest.raises(ConfigError, match=r"tokenizer_dir=.*tok contradicts data.tokenizer=.*other"):
        build_workflow(load_config(config(source="calib.txt", tokenizer="other")))
    two = {"input": str(folder), "output": str(tmp_path / "o"),
           "passes": [{"type": "rtn", "tokenizer_dir": "a"}, {"type": "rtn", "bits": 8, "tokenizer_dir": "b"}]}
    with pytest.raises(ConfigError, match=r"passes\[1\].tokenizer_dir=b differs from passes\[0\].tokenizer_dir=a"):
        build_workflow(two)
    with caplog.at_level(logging.WARNING):  # the model's own text, read with that tokenizer
        bitpress.run(config())
    assert "calibrates on text the model writes itself" in caplog.text
    assert (tmp_path / "out" / "model.onnx").is_file()
    bitpress.run(config(source="calib.txt", samples=4, seq_len=16), overwrite=True)  # the text, read with it
    assert (tmp_path / "out" / "model.onnx").is_file()
    shutil.rmtree(tmp_path / "tok")  # the tokenizer was what it read: without it, the run stops in one line
    with pytest.raises(BitpressError, match="tok"):
        bitpress.run(config(source="calib.txt", samples=4, seq_len=16), overwrite=True)
