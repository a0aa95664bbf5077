"""Calibration text a Hugging Face model writes itself (``generated``): sampled with the model's KV cache
as a full rerun samples it, from the model's distribution, within the tokenizer's vocabulary."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import bitpress
from bitpress.calibration.data import DataConfig
from bitpress.calibration.generate import BATCH
from bitpress.hf.layer_inputs import calibration_batches, own_windows

pytest.importorskip("tokenizers")

WORDS = 200  # the tokenizer's vocabulary; the model's is 256 (an export's padding rows)


def _tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, WORDS)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>"}))
    return folder / "tokenizer.json"


def _reference(model: Any, rows: int, seq: int, seed: int) -> np.ndarray:
    """The sampler's rule without the cache: every step reruns the whole prefix, the same draws."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty((rows, seq), dtype=torch.int64)
    with torch.no_grad():
        for lo in range(0, rows, BATCH):
            ids = out[lo: min(rows, lo + BATCH)]
            ids[:, 0] = 1
            for t in range(1, seq):
                logits = model(input_ids=ids[:, :t].clone()).logits[:, -1].double()[:, :WORDS]
                u = torch.rand(logits.shape, generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0)
                ids[:, t] = torch.argmax(logits - torch.log(-torch.log(u)), dim=1)
    return out.numpy()


def test_own_windows_with_the_cache_equal_full_reruns(llama: Any, tmp_path: Path) -> None:
    model = llama(tied=True, seed=2)
    tok = _tokenizer(tmp_path / "tok")
    cfg = DataConfig(source="generated", samples=10, seq_len=9, seed=5)
    got = own_windows(model, tok, cfg)
    assert got.shape == (10, 9) and (got[:, 0] == 1).all() and (got < WORDS).all()
    np.testing.assert_array_equal(got, _reference(model, 10, 9, 5))
    assert len({tuple(r) for r in got}) == 10
    assert not model.training


def test_own_windows_follow_the_models_distribution(llama: Any, tmp_path: Path) -> None:
    model = llama(tied=False, seed=3)
    tok = _tokenizer(tmp_path / "tok")
    n = 3000
    got = own_windows(model, tok, DataConfig(source="generated", samples=n, seq_len=2))[:, 1]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1]])).logits[0, -1, :WORDS].double()
    p = torch.softmax(logits, 0).numpy()
    freq = np.bincount(got, minlength=WORDS) / n
    assert 0.5 * np.abs(freq - p).sum() < 0.12  # greedy would put all of it on one token
    assert p.max() < 0.5


def test_calibration_batches_mix_text_and_own_windows(llama: Any, tmp_path: Path) -> None:
    model = llama(tied=True, seed=2)
    folder = tmp_path / "m"
    _tokenizer(folder)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{3 + i % 50}" for i in range(400)))
    batches = calibration_batches({"source": str(text), "samples": 5, "seq_len": 8, "generated": 2}, folder, 256,
                                  model)
    ids = torch.cat([b.input_ids for b in batches]).numpy()
    assert ids.shape == (5, 8)
    assert (ids[:3, 1:] < 53).all()  # the text's words
    np.testing.assert_array_equal(ids[3:], own_windows(model, folder / "tokenizer.json", DataConfig(
        source="generated", samples=2, seq_len=8)))
    with pytest.raises(bitpress.BitpressError, match="needs a causal language model"):
        calibration_batches({"source": "generated", "samples": 2, "seq_len": 8}, folder, 256, None)


def test_gptq_hf_takes_half_its_samples_from_the_model(llama: Any, save_hf: Any, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    folder = save_hf(llama(tied=True, seed=4), tmp_path / "m")
    _tokenizer(folder)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{3 + i % 50}" for i in range(800)))
    with caplog.at_level(logging.INFO, logger="bitpress"):
        bitpress.run({"input": str(folder), "output": str(tmp_path / "out"),
                      "passes": [{"type": "Gptq", "group_size": 32}],
                      "data": {"source": str(text), "samples": 6, "seq_len": 16}})
    assert "the model writes 3 windows of 16 tokens" in caplog.text
    assert "3 of the 6 samples, a calibrated pass's default beside a text" in caplog.text


def test_a_tokenizer_without_a_start_token_falls_back_to_the_text(llama: Any, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "m"
    folder.mkdir()
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{3 + i % 50}" for i in range(400)))
    model = llama(tied=True)
    auto = DataConfig(source=str(text), samples=4, seq_len=8).with_own_text("gptq_hf")
    with caplog.at_level(logging.INFO, logger="bitpress"):
        batches = calibration_batches(auto, folder, 256, model)
    assert sum(b.input_ids.shape[0] for b in batches) == 4
    assert "calibrating on calib.txt alone" in caplog.text and "names no BOS or end-of-text token" in caplog.text
    with pytest.raises(bitpress.BitpressError, match="names no BOS or end-of-text token"):
        calibration_batches({"source": str(text), "samples": 4, "seq_len": 8, "generated": 1}, folder, 256, model)


def test_the_seed_autoawq_example_runs_without_data(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Olive's ``{type: AutoAWQQuantizer, bits: 4}`` as the seed writes it, with no data: the model's own text,
    said in a warning."""
    import test_rotation_hf as rotation_hf

    caplog.set_level(logging.WARNING)
    src = rotation_hf._folder(tmp_path, bias=False)
    out = rotation_hf._run([{"type": "AutoAWQQuantizer", "bits": 4, "group_size": 32}], src, tmp_path / "o")
    assert "no calibration data given: awq_hf calibrates on text the model writes itself" in caplog.text
    assert json.loads((out / "config.json").read_text())["quantization_config"]["passes"][0]["pass"] == "awq_hf"
