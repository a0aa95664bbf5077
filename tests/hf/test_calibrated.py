"""Calibrated passes on PyTorch models: sequential statistics, gptq_hf and awq_hf, composition, export."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import bitpress
from bitpress.errors import BitpressError, UsageError
from bitpress.hf import hf_to_onnx
from bitpress.hf import quantize as hfq
from bitpress.hf.calibrated import Method, quantize_calibrated
from bitpress.hf.layer_inputs import Batch, calibration_batches
from bitpress.hf.model import HfModel
from bitpress.hf.qtensor import QuantTensor
from bitpress.quant.calibrated import LayerStats, Target
from bitpress.quant.solver import BlockSpec, QuantizedBlocks
from bitpress_awq.hf_passes import AwqHfPass
from bitpress_gptq.hf_passes import GptqHfPass
from bitpress_rtn.hf_passes import RtnHfPass
from bitpress_rtn.solver import rtn_solver

Q = "model.layers.{}.self_attn.q_proj"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def batches(n: int = 3, seq: int = 24, seed: int = 0, pad: bool = False) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    out = [Batch(torch.randint(0, 256, (2, seq), generator=gen)) for _ in range(n)]
    if pad:  # the last 5 tokens of one row are padding: they must not count
        mask = torch.ones(2, seq, dtype=torch.int64)
        mask[1, -5:] = 0
        out[0] = Batch(out[0].input_ids, mask)
    return out


class Recording:
    """A calibrated solver that keeps the statistics it is given and rounds to nearest."""

    needs = frozenset({"hessian", "mean_abs", "mean_sq", "sample"})

    def __init__(self) -> None:
        self.seen: dict[str, LayerStats] = {}

    def prepare(self, stats: LayerStats, spec: BlockSpec) -> LayerStats:
        return stats

    def solve(self, w: np.ndarray, spec: BlockSpec, prepared: LayerStats, target: Target) -> QuantizedBlocks:
        self.seen[target.nodes[0]] = prepared
        return rtn_solver(w.reshape(len(w), -1, spec.block_size), spec)


def plan(model: Any, cls: type = GptqHfPass, **options: Any) -> Any:
    return hfq.plan(model, cls.from_config({"group_size": 32, **options}).options.rules())


def inputs_by_hand(model: Any, module: str, data: list[Batch]) -> np.ndarray:
    """Every calibration token's input row of ``module`` (padding left out), in a plain forward."""
    rows: list[np.ndarray] = []
    current: list[torch.Tensor | None] = [None]

    def hook(mod: Any, args: tuple[Any, ...]) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])
        v = current[0]
        rows.append((x if v is None else x[v.reshape(-1)]).numpy().astype(np.float64))

    handle = model.get_submodule(module).register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for b in data:
                current[0] = b.valid
                model(input_ids=b.input_ids, attention_mask=b.attention_mask if b.attention_mask is not None
                      else torch.ones_like(b.input_ids), use_cache=False)
    finally:
        handle.remove()
    return np.concatenate(rows)


def hessian(x: np.ndarray) -> np.ndarray:
    return x.T @ x / len(x)


def test_statistics_are_sequential_and_shared_per_input(llama: Any) -> None:
    data = batches(pad=True)
    seq_model, rec = llama(tied=False), Recording()
    quantize_calibrated(seq_model, plan(seq_model), Method(rec, rtn_solver), data, sequential=True)
    float_model, rec_f = llama(tied=False), Recording()
    reference = llama(tied=False)  # stays float
    quantize_calibrated(float_model, plan(float_model), Method(rec_f, rtn_solver), data, sequential=False)

    # layer 1 sees the model with layer 0 quantized (the quantized model, computed by hand)
    x1 = inputs_by_hand(seq_model, Q.format(1), data)
    got = rec.seen[Q.format(1)]
    assert got.rows == len(x1) == 3 * 2 * 24 - 5  # the padding tokens are left out
    np.testing.assert_allclose(got.hessian, hessian(x1), rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(got.mean_abs, np.abs(x1).mean(0), rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(got.mean_sq, np.square(x1).mean(0), rtol=2e-4, atol=1e-7)
    assert got.sample is not None and got.sample.shape[1] == 64 and len(got.sample) <= got.rows
    # sequential: false takes the float model's inputs, which differ from the quantized ones
    x1_float = inputs_by_hand(reference, Q.format(1), data)
    np.testing.assert_allclose(rec_f.seen[Q.format(1)].hessian, hessian(x1_float), rtol=2e-4, atol=1e-6)
    diff = np.abs(rec_f.seen[Q.format(1)].hessian - got.hessian).max()
    assert diff > 1e-3 * np.abs(got.hessian).max()
    # layer 0 reads the embedding in both modes
    np.testing.assert_allclose(rec.seen[Q.format(0)].hessian, rec_f.seen[Q.format(0)].hessian, rtol=1e-5, atol=1e-7)
    # one set of statistics per distinct input: q/k/v share one, gate/up another
    s = rec.seen
    assert s[Q.format(0)] is s["model.layers.0.self_attn.k_proj"] is s["model.layers.0.self_attn.v_proj"]
    assert s["model.layers.0.mlp.gate_proj"] is s["model.layers.0.mlp.up_proj"]
    assert s["model.layers.0.self_attn.o_proj"] is not s[Q.format(0)]
    assert len({id(v) for v in s.values()}) == 8  # 4 distinct inputs per layer


def output_error(w: torch.Tensor, q: torch.Tensor, h: np.ndarray) -> float:
    d = (w - q).numpy().astype(np.float64)
    return float(np.einsum("rk,kj,rj->", d, h, d))


def layer_output_errors(float_model: Any, qmodel: Any, data: list[Batch]) -> list[float]:
    """Per decoder layer: ||layer_q(x) - layer(x)|| on the float model's inputs of that layer."""
    from bitpress.hf.layer_inputs import call_layer, capture

    calls = capture(float_model, float_model.model.layers, data)
    hidden = [c.hidden for c in calls[0]]
    errs = []
    with torch.no_grad():
        for i, (fl, ql) in enumerate(zip(float_model.model.layers, qmodel.model.layers, strict=True)):
            outs = [call_layer(fl, calls[i][b], hidden[b]) for b in range(len(data))]
            qouts = [call_layer(ql, calls[i][b], hidden[b]) for b in range(len(data))]
            errs.append(sum(float(torch.sum((o - q) ** 2)) for o, q in zip(outs, qouts, strict=True)))
            hidden = outs
    return errs


def test_gptq_beats_rtn_on_every_linear_and_layer(llama: Any) -> None:
    data = batches()
    ref = llama(tied=False)
    gptq = llama(tied=False)
    report = quantize_calibrated(gptq, plan(gptq), GptqHfPass.from_config({"group_size": 32}).method(), data)
    rtn = llama(tied=False)
    hfq.apply(rtn, plan(rtn, RtnHfPass, sym=False), rtn_solver)
    assert report.quantized == 14 and len(report.output_errors) == 14
    for i in range(2):
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}"
            h = hessian(inputs_by_hand(ref, name, data))
            w = ref.get_submodule(name).weight.detach()
            e_gptq = output_error(w, gptq.get_submodule(name).weight.dequantize(), h)
            e_rtn = output_error(w, rtn.get_submodule(name).weight.dequantize(), h)
            assert e_gptq < 0.9 * e_rtn, (name, e_gptq, e_rtn)
    for e_g, e_r in zip(layer_output_errors(ref, gptq, data), layer_output_errors(ref, rtn, data), strict=True):
        assert e_g < e_r


def test_awq_beats_rtn_on_every_layer(llama: Any) -> None:
    data = batches()
    ref, awq, rtn = llama(tied=False), llama(tied=False), llama(tied=False)
    report = quantize_calibrated(awq, plan(awq, AwqHfPass), AwqHfPass.from_config({"group_size": 32}).method(), data)
    hfq.apply(rtn, plan(rtn, RtnHfPass, sym=False), rtn_solver)
    assert report.quantized == 14 and report.scaled_inputs == 6  # o_proj: v_proj is narrower (GQA)
    for e_a, e_r in zip(layer_output_errors(ref, awq, data), layer_output_errors(ref, rtn, data), strict=True):
        assert e_a < e_r


class RandomScales:
    """An input scaler drawing random scales (the folds must be exact whatever the scales)."""

    needs = frozenset({"mean_abs"})

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def scales(self, weights: list[np.ndarray], stats: LayerStats, specs: list[BlockSpec],
               targets: list[Target]) -> np.ndarray:
        return np.exp(self.rng.uniform(-1.5, 1.5, stats.channels)).astype(np.float32)


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


@pytest.mark.parametrize(("kv_heads", "scaled"), [(2, 6), (4, 8)])
def test_awq_folds_leave_the_float_model_unchanged(llama: Any, kv_heads: int, scaled: int) -> None:
    model = llama(tied=False, num_key_value_heads=kv_heads)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(5))
    before = logits(model, ids)
    norm = model.model.layers[0].input_layernorm.weight.detach().clone()
    up = model.model.layers[1].mlp.up_proj.weight.detach().clone()
    method = Method(Recording(), rtn_solver, RandomScales())
    report = quantize_calibrated(model, plan(model), method, batches(), scale_only=True)
    # every input was scaled (o_proj too when v_proj is as wide as its input), the weights stay float
    assert report.scaled_inputs == scaled and report.quantized == 0
    assert not any(isinstance(p, QuantTensor) for p in model.parameters())
    assert not torch.allclose(model.model.layers[0].input_layernorm.weight, norm)  # folded into the norm
    assert not torch.allclose(model.model.layers[1].mlp.up_proj.weight, up)  # down_proj's into up_proj's rows
    after = logits(model, ids)
    assert float((after - before).abs().max()) < 1e-4 * float(before.abs().max())


def data_config(source: str = "random") -> dict[str, Any]:
    return {"source": source, "samples": 3, "seq_len": 16, "batch": 2}


@pytest.fixture(scope="module")
def registry() -> Any:
    """The installed plugins; registers the calibrated HF passes when their plugins do not yet."""
    from bitpress.plugins import Registry, get_registry

    reg = get_registry()
    if "gptq_hf" in reg.passes and "awq_hf" in reg.passes:
        return reg

    class Shim:
        @bitpress.hookimpl
        def bitpress_register_passes(self, register: Callable[[type], None]) -> None:
            for cls in (GptqHfPass, AwqHfPass):
                if cls.name not in reg.passes:
                    register(cls)

    reg = Registry()
    reg.register(Shim(), name="calibrated-hf-shim")
    return reg


def test_gptq_then_rtn_composes_and_the_reverse_is_refused(llama_untied_folder: Path, tmp_path: Path,
                                                           registry: Any) -> None:
    passes = [{"type": "Gptq", "group_size": 32}, {"type": "Rtn", "embeds": True, "group_size": 32}]
    res = bitpress.run({"input": str(llama_untied_folder), "output": str(tmp_path / "a"), "passes": passes,
                        "data": data_config()}, registry=registry)
    handle = HfModel.load(Path(res.output) / llama_untied_folder.name)
    model = handle.torch_model()
    assert [h["pass"] for h in handle.history] == ["gptq_hf", "rtn_hf"]
    quantized = {n for n, p in model.named_parameters() if isinstance(p, QuantTensor)}
    assert len(quantized) == 15 and "model.embed_tokens.weight" in quantized  # gptq: 14 linears, rtn: the table
    with pytest.raises(BitpressError, match="Run gptq_hf first"):
        bitpress.run({"input": str(llama_untied_folder), "output": str(tmp_path / "b"),
                      "passes": passes[::-1], "data": data_config()}, registry=registry)
    assert not (tmp_path / "b" / llama_untied_folder.name).exists()
    # the same order found from the steps alone, before any pass runs (the workflow's pre-run check)
    from bitpress.hf.calibrated_pass import check_order
    from bitpress_kquant.hf_passes import KQuantHfPass

    check_order([GptqHfPass(), RtnHfPass()])
    for first, then in ((RtnHfPass, GptqHfPass), (KQuantHfPass, AwqHfPass)):
        with pytest.raises(UsageError, match=f"Run {then.name} first"):
            check_order([first(), then()])


def test_gptq_hf_export_runs_in_onnx_runtime(llama_tied_folder: Path, tmp_path: Path, registry: Any) -> None:
    passes = [{"type": "gptq_hf", "group_size": 32, "lm_head": True, "embeds": True}]
    res = bitpress.run({"input": str(llama_tied_folder), "output": str(tmp_path / "q"), "passes": passes,
                        "data": data_config()}, registry=registry)
    folder = Path(res.output) / llama_tied_folder.name
    model = HfModel.load(folder).torch_model()
    # the tied table: solved by GPTQ from the head's inputs, one tensor read by both ends
    assert isinstance(model.lm_head.weight, QuantTensor) and model.lm_head.weight is model.model.embed_tokens.weight
    onnx_path = hf_to_onnx(folder, tmp_path / "onnx", accuracy_level=0)[0]  # float32: compared with torch
    ops = [n.op_type for n in onnx.load(str(onnx_path), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 15 and ops.count("GatherBlockQuantized") == 1
    ids = np.random.default_rng(1).integers(0, 256, (2, 11), dtype=np.int64)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    np.testing.assert_allclose(got, logits(model, torch.from_numpy(ids)).numpy(), atol=1e-4)


def test_calibration_data_from_text_and_npz(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(200)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "model"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(words[i % 200] for i in range(7, 400)))
    got = calibration_batches({"source": str(text), "samples": 3, "seq_len": 16, "batch": 2}, folder, 256)
    # samples * batch windows, stacked into as few forwards as BATCH_TOKENS allows
    assert [tuple(b.input_ids.shape) for b in got] == [(6, 16)]
    assert got[0].input_ids[0, :3].tolist() == [7, 8, 9]  # the model folder's tokenizer, in order
    assert got[0].input_ids[1, 0].item() == 7 + 16
    long = calibration_batches({"source": str(text), "samples": 3, "seq_len": 128, "batch": 1}, folder, 256)
    assert [tuple(b.input_ids.shape) for b in long] == [(3, 128)]
    ids = np.arange(40, dtype=np.int64).reshape(4, 10)
    mask = np.ones_like(ids)
    mask[3, 6:] = 0
    np.savez(tmp_path / "c.npz", input_ids=ids, attention_mask=mask)
    got = calibration_batches({"source": str(tmp_path / "c.npz"), "samples": 8, "batch": 2}, None, 256)
    assert len(got) == 2 and got[1].valid is not None and got[1].tokens == 16
    with pytest.raises(UsageError, match="outside the model's vocabulary"):
        calibration_batches({"source": str(tmp_path / "c.npz")}, None, 32)
    with pytest.raises(UsageError, match="needs a tokenizer"):
        calibration_batches({"source": str(text)}, None, 256)


def test_gptq_hf_takes_enough_samples_for_the_widest_linear(llama_untied_folder: Path, tmp_path: Path,
                                                            registry: Any, caplog: pytest.LogCaptureFixture) -> None:
    """No ``samples``: 2 tokens per input channel of the widest linear (the MLP's down projection)."""
    import json

    from bitpress.calibration.data import samples_for

    config = json.loads((llama_untied_folder / "config.json").read_text())
    widest = max(config["hidden_size"], config["intermediate_size"])
    want = samples_for(widest, 16, 2)
    with caplog.at_level(logging.INFO, logger="bitpress"):
        bitpress.run({"input": str(llama_untied_folder), "output": str(tmp_path / "a"),
                      "passes": [{"type": "Gptq", "group_size": 32}],
                      "data": {"source": "random", "seq_len": 16, "batch": 2}}, registry=registry)
    assert f"gptq_hf: calibrating on up to {want} samples of 16 tokens ({want * 32} tokens for layer inputs up to " \
           f"{widest} wide" in caplog.text


def test_gptq_hf_names_inputs_with_too_few_tokens(llama_untied_folder: Path, tmp_path: Path, registry: Any,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="bitpress"):
        bitpress.run({"input": str(llama_untied_folder), "output": str(tmp_path / "a"),
                      "passes": [{"type": "Gptq", "group_size": 32}],
                      "data": {"source": "random", "samples": 1, "seq_len": 8}}, registry=registry)
    warned = [r.getMessage() for r in caplog.records if "rank-deficient" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("gptq_hf: ") and "saw 8 calibration tokens" in warned[0]
