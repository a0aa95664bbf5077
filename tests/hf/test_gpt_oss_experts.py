"""gpt-oss's transposed fused experts: quantized by ``moe: true`` along their input (middle) axis, saved, streamed,
and exported through mobius as QMoE holding bitpress's integers.

transformers 5.17's ``GptOssExperts`` store ``gate_up_proj`` ``[E, H, 2I]`` (gate / up interleaved on the last
axis), ``down_proj`` ``[E, I, H]`` and compute ``x @ w[e]``: each expert's weight is the ``[OUT, K]`` transpose,
which is what bitpress quantizes (blocks along K) and what QMoE holds.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

import bitpress
from bitpress.errors import ExportError, QuantizationError
from bitpress.hf import quantize as hfq
from bitpress.hf.qtensor import QuantTensor

#: tiny gpt-oss: hidden 64, 2 layers, 4 experts, top-2; intermediate 96 (not 64) so K and OUT of down_proj differ
#: and a transposition cannot pass unnoticed. YaRN with ``truncate: true``: mobius 0.1.0 ignores ``truncate: false``
#: (gpt-oss's default), which alone moves its float package's logits ~1.5e-3 from transformers' (measured); with
#: ``true`` its float package gives transformers' logits within ~1e-6, so what is left is bitpress's
CONFIG = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
          "num_experts_per_tok": 2, "max_position_embeddings": 256, "sliding_window": 16,
          "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": False,
          "bos_token_id": 1, "eos_token_id": 2,
          "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": True, "original_max_position_embeddings": 4096, "rope_theta": 150000.0}}
EXPERTS = ("gate_up_proj", "down_proj")
#: only the experts are quantized (mobius is handed a float checkpoint; routers always stay float)
RTN = {"type": "rtn_hf", "bits": 4, "group_size": 32, "sym": False, "moe": True,
       "modules_to_not_convert": ["self_attn", "mlp.router"]}
PROMPT = [5, 17, 42, 9, 300]


def build(seed: int = 0) -> Any:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**CONFIG)).eval()
    with torch.no_grad():  # weights large enough that rounding differences show in the logits
        for n, p in model.named_parameters():
            if "experts" in n or p.dim() == 2:
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GenerationConfig

    from bitpress.synthetic import write_tokenizer

    folder = tmp_path_factory.mktemp("gptoss") / "gptoss"
    build().save_pretrained(folder)
    write_tokenizer(folder, vocab=CONFIG["vocab_size"])
    GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=False).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def ckpt(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``rtn_hf moe: true`` (asymmetric: zero points too), streamed (the default for a safetensors folder)."""
    out = tmp_path_factory.mktemp("ckpt")
    bitpress.run({"input": str(src), "output": str(out), "passes": [RTN]})
    return out / src.name


def rtn(w: np.ndarray, bits: int = 4, block: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric blockwise RTN of ``w [rows, K]`` (ONNX Runtime's: range widened to 0, halves away from zero),
    float32: integers ``[rows, K]``, scales and zero points ``[rows, K / block]``."""
    rows, k = w.shape
    b = w.astype(np.float32).reshape(rows, k // block, block)
    qmax = np.float32(2**bits - 1)
    lo, hi = np.minimum(b.min(-1), np.float32(0)), np.maximum(b.max(-1), np.float32(0))
    scale = ((hi - lo) / qmax).astype(np.float32)
    zp = np.floor(np.clip(-lo / scale, 0, qmax) + np.float32(0.5))
    x = b * (np.float32(1) / scale)[..., None] + zp[..., None]
    q = np.clip(np.floor(x + np.float32(0.5)), 0, qmax)
    return q.reshape(rows, k).astype(np.uint8), scale, zp.astype(np.uint8)


def test_transposed_experts_are_the_rtn_of_each_experts_transpose(src: Path, ckpt: Path) -> None:
    """(a) every expert ``[K, OUT]`` is quantized as its ``[OUT, K]`` transpose, blocks along K; the checkpoint
    records it (``transposed``) and reads back in the stored layout."""
    from bitpress.hf.checkpoint import load_model

    floats = build()
    model, _ = load_model(ckpt)
    modules = json.loads((ckpt / "config.json").read_text())["quantization_config"]["modules"]
    assert sorted(modules) == [f"model.layers.{i}.mlp.experts.{a}" for i in (0, 1) for a in ("down_proj",
                                                                                           "gate_up_proj")]
    for i in (0, 1):
        for attr in EXPERTS:
            name = f"model.layers.{i}.mlp.experts.{attr}"
            assert modules[name]["transposed"] is True
            t = getattr(model.model.layers[i].mlp.experts, attr)
            w = getattr(floats.model.layers[i].mlp.experts, attr).detach().numpy()  # [E, K, OUT]
            assert isinstance(t, QuantTensor) and t.shape == w.shape and t.spec.transposed
            e, k, n = w.shape
            q, s, z = rtn(w.transpose(0, 2, 1).reshape(e * n, k))
            b = t.blocks()
            np.testing.assert_array_equal(b.q.reshape(e * n, k), q, err_msg=name)
            np.testing.assert_array_equal(b.scales, s, err_msg=name)
            np.testing.assert_array_equal(b.zero_points, z, err_msg=name)
            deq = ((q.reshape(e * n, -1, 32).astype(np.float32) - z[..., None]) * s[..., None]).reshape(e, n, k)
            np.testing.assert_array_equal(t.dequantize().numpy(), deq.transpose(0, 2, 1))  # the stored layout
            err = np.abs(deq.transpose(0, 2, 1) - w)
            assert err.max() <= 0.51 * np.repeat(s, 32, -1).max()  # half a step: blocks really run along K


def test_the_quantized_model_runs_on_the_dequantized_experts(ckpt: Path) -> None:
    """(b) the quantized PyTorch model's logits are those of the float model holding the dequantized experts."""
    from bitpress.hf.checkpoint import load_model
    from bitpress.hf.export import float_view

    model, _ = load_model(ckpt)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        got = model(ids).logits
        with float_view(model) as floats:
            assert not any(isinstance(p, QuantTensor) for p in floats.parameters())
            want = floats(ids).logits
        ref = build()(ids).logits
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert 0 < float((got - ref).norm() / ref.norm()) < 0.2  # 4-bit experts: near the float model (~0.1)


def test_streaming_gives_the_in_memory_bytes(src: Path, ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """Streamed (one expert matrix read at a time, chunks crossing experts) = loaded whole = a worker's solve."""
    from bitpress.hf import stream_checkpoint, streaming
    from bitpress.hf.rules import HfQuantOptions
    from bitpress_rtn.solver import rtn_solver

    def files(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}

    bitpress.run({"input": str(src), "output": str(tmp_path / "memory"), "passes": [{**RTN, "stream": False}]})
    monkeypatch.setattr(hfq, "CHUNK_ELEMENTS", 1000)  # 15 rows of 64: chunks end inside and across experts
    with caplog.at_level(logging.INFO, logger="bitpress.hf.streaming"):
        bitpress.run({"input": str(src), "output": str(tmp_path / "chunked"), "passes": [RTN]})
    assert "streaming gptoss" in caplog.text and "instead of streaming" not in caplog.text
    want = files(ckpt)
    assert files(tmp_path / "memory" / src.name) == want
    assert files(tmp_path / "chunked" / src.name) == want
    files_ = stream_checkpoint.CheckpointFiles(src)
    try:
        options = HfQuantOptions(moe=True, sym=False, group_size=32, modules_to_not_convert=["self_attn"])
        prepared = streaming.prepare(src, files_, options.rules(), float_zero_points=False)
        units = [u for u in prepared.units if u.job is not None]
        assert len(units) == 4 and all(u.job.transposed for u in units)  # type: ignore[union-attr]
        for unit in units:
            arrays, error = streaming.solve_remote(streaming.remote_task(files_, unit), rtn_solver)
            local = streaming._solve(files_, unit, rtn_solver)
            assert error == local.error and all((a == b).all() for a, b in zip(arrays, local.arrays, strict=True))
    finally:
        files_.close()


def _qmoe(package: Path) -> dict[int, dict[str, Any]]:
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(str(package / "model.onnx"))
    inits = {t.name: t for t in m.graph.initializer}
    out: dict[int, dict[str, Any]] = {}
    for n in m.graph.node:
        if n.op_type in ("QMoE", "MoE"):
            got: dict[str, Any] = {"op": n.op_type, "attrs": {a.name: helper.get_attribute_value(a)
                                                              for a in n.attribute}}
            for key, idx in {"w1": 2, "s1": 3, "w2": 5, "s2": 6, "z1": 11, "z2": 12}.items():
                name = n.input[idx] if len(n.input) > idx else ""
                got[key] = numpy_helper.to_array(inits[name], base_dir=str(package)) if name else None
            out[int(n.name.split("/layers.")[1].split("/")[0])] = got
    return out


def test_the_mobius_package_holds_bitpress_integers_and_gives_the_quantized_logits(ckpt: Path,
                                                                                    tmp_path: Path) -> None:
    """(c) each QMoE input is the checkpoint's stored bytes as they are (a transposed expert's rows are QMoE's: fc1
    gate0, up0, ... from the interleaved last axis, fc2 [E, H, I]); the package generates and gives the quantized
    PyTorch model's logits."""
    pytest.importorskip("mobius")
    pytest.importorskip("onnxruntime_genai")
    import onnxruntime_genai as og

    from bitpress.genai.export import generate_step
    from bitpress.hf.checkpoint import load_model

    bitpress.run({"input": str(ckpt), "output": str(tmp_path / "pkg"),
                  "passes": [{"type": "hf_to_genai", "exporter": "mobius", "accuracy_level": 1}]})
    package = tmp_path / "pkg" / ckpt.name
    got = _qmoe(package)
    assert set(got) == {0, 1}
    e, h, i = CONFIG["num_local_experts"], CONFIG["hidden_size"], CONFIG["intermediate_size"]
    with safe_open(str(ckpt / "model.safetensors"), framework="np") as st:
        for layer, g in got.items():
            assert g["op"] == "QMoE" and g["attrs"]["swiglu_fusion"] == 1 and g["attrs"]["accuracy_level"] == 1
            assert g["attrs"]["expert_weight_bits"] == 4 and g["attrs"]["block_size"] == 32
            # the activation's gpt-oss constants, read from mobius's loop
            assert g["attrs"]["activation_alpha"] == pytest.approx(1.702) and g["attrs"]["swiglu_limit"] == 7.0
            for fc, attr, (n, k) in (("1", "gate_up_proj", (2 * i, h)), ("2", "down_proj", (h, i))):
                name = f"model.layers.{layer}.mlp.experts.{attr}"
                qw, sc, zp = (st.get_tensor(f"{name}_{x}") for x in ("qweight", "scales", "qzeros"))
                np.testing.assert_array_equal(g[f"w{fc}"], qw.reshape(e, n, k // 2), err_msg=name)
                np.testing.assert_array_equal(g[f"s{fc}"], sc.reshape(e, n, k // 32), err_msg=name)
                # one zero point a byte in the checkpoint, two in QMoE (low nibble first, an odd count padded)
                zq = np.zeros((e, n, -(-k // 64) * 2), np.uint8)
                zq[..., : k // 32] = zp.reshape(e, n, k // 32)
                np.testing.assert_array_equal(g[f"z{fc}"], zq[..., 0::2] | (zq[..., 1::2] << 4), err_msg=name)
    assert generate_step(package, tokens=3)

    m = og.Model(str(package))
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=len(PROMPT) + 1)
    gen = og.Generator(m, params)
    gen.append_tokens(np.array([PROMPT], dtype=np.int32))
    logits = np.asarray(gen.get_output("logits"))[0, -1]
    model, _ = load_model(ckpt)
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0, -1].numpy()
    # float32 activations (accuracy_level 1): both sides compute (q - zp) * scale in float32 and mobius's float
    # gpt-oss graph gives transformers' logits within ~1e-6 with this config (YaRN truncate: true), so only
    # summation order differs (measured ~1e-6 on logits of magnitude ~2); 1e-4 is far below a 4-bit step's effect
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)


def test_a_wrong_mapping_is_caught_against_mobius_weights(ckpt: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """fc1 rows de-interleaved ([gate | up] instead of gate0, up0, ...) do not match mobius's float experts:
    ExportError naming the tensor, no package."""
    pytest.importorskip("mobius")
    from bitpress.genai import moe

    real = moe._transposed

    def wrong(root: str, mod: Any, params: dict[str, Any]) -> Any:
        fc1, fc2 = real(root, mod, params)
        order = np.concatenate([np.arange(0, fc1.q.shape[1], 2), np.arange(1, fc1.q.shape[1], 2)])
        zp = None if fc1.zero_points is None else fc1.zero_points[:, order]
        return moe.ExpertWeights(fc1.name, fc1.q[:, order], fc1.scales[:, order], zp, fc1.bits,
                                 fc1.group_size), fc2

    monkeypatch.setattr(moe, "_transposed", wrong)
    with pytest.raises(ExportError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj does not match "
                                          r"mobius's model/layers\.0/mlp/MoE fc1"):
        bitpress.run({"input": str(ckpt), "output": str(tmp_path / "pkg"),
                      "passes": [{"type": "hf_to_genai", "exporter": "mobius"}]})
    assert not (tmp_path / "pkg" / ckpt.name).exists()


def test_gpt_oss_with_the_builder_is_refused_before_the_build(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"builds gpt-oss only from its original MXFP4 checkpoint.*refused before "
                                          r"the build; use --exporter mobius"):
        bitpress.run({"input": str(ckpt), "output": str(tmp_path / "pkg"),
                      "passes": [{"type": "hf_to_genai", "exporter": "builder"}]})
    assert not (tmp_path / "pkg" / ckpt.name).exists()


@pytest.mark.parametrize(("change", "match"), [
    (lambda x: setattr(x, "is_concatenated", True), "is_concatenated=False"),
    (lambda x: setattr(x, "intermediate_size", 64), r"gate_up_proj is \[4, 64, 192\], not the \(E, K, OUT\) "
                                                    r"\[4, 64, 128\]"),
    (lambda x: setattr(x, "is_transposed", None), "does not report is_transposed"),
])
def test_a_transposed_layout_that_is_not_gpt_oss_s_is_refused(change: Any, match: str) -> None:
    """Only the known layout is quantized transposed: anything that differs is refused before any work."""
    from bitpress_rtn.hf_passes import RtnHfPass

    model = build()
    for layer in model.model.layers:
        change(layer.mlp.experts)
    p = RtnHfPass.from_config({"group_size": 32, "moe": True})
    with pytest.raises(QuantizationError, match=match):
        hfq.plan(model, p.options.rules())
    assert not any(isinstance(x, QuantTensor) for x in model.parameters())


def test_symmetric_transposed_experts_save_and_load(tmp_path: Path) -> None:
    """In memory, symmetric: the quantized model saved and loaded holds the same integers, still transposed."""
    from bitpress.hf.checkpoint import load_model, save_model
    from bitpress_rtn.hf_passes import RtnHfPass

    model = build()
    p = RtnHfPass.from_config({"group_size": 32, "moe": True, "modules_to_not_convert": ["self_attn"]})
    hfq.apply(model, hfq.plan(model, p.options.rules()), p.solver())
    save_model(model, tmp_path / "q")
    back, _ = load_model(tmp_path / "q")
    for a, b in zip(model.model.layers, back.model.layers, strict=True):
        for attr in EXPERTS:
            x, y = getattr(a.mlp.experts, attr), getattr(b.mlp.experts, attr)
            assert x.spec == y.spec and x.spec.transposed and x.spec.zero_points == "none"
            assert torch.equal(x.qweight, y.qweight) and torch.equal(x.scales, y.scales)
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([PROMPT])).logits, back(torch.tensor([PROMPT])).logits)
