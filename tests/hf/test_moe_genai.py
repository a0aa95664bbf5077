"""moe: true checkpoints to GenAI packages: bitpress's expert integers in the builder's QMoE nodes, exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("onnxruntime_genai.models.builder")
pytest.importorskip("onnx_ir")

from bitpress.errors import ExportError
from bitpress.onnx.layout import pack_along_last

#: tiny configs: hidden 64, 2 layers, 4 experts, top-2, vocab 512
COMMON = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False,
          "bos_token_id": 1, "eos_token_id": 2}
MODELS = {
    "lfm2moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                {"intermediate_size": 128, "moe_intermediate_size": 96, "num_experts": 4, "num_experts_per_tok": 2,
                 "num_dense_layers": 1, "layer_types": ["full_attention", "full_attention"]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 {"intermediate_size": 128, "moe_intermediate_size": 96, "num_experts": 4, "num_experts_per_tok": 2,
                  "head_dim": 16, "decoder_sparse_step": 1}),
}
#: everything but the experts stays float: the builder imports pre-quantized dense layers of Llama-shaped models only
DENSE = ["self_attn", "feed_forward.w", "mlp.gate."]


def _folder(name: str, root: Path) -> Path:
    import torch
    import transformers
    from transformers import GenerationConfig

    from bitpress.synthetic import write_tokenizer

    cfg_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**COMMON, **extra)).eval()
    with torch.no_grad():  # weights large enough that rounding differences show in the logits
        for n, p in model.named_parameters():
            if "experts" in n or p.dim() == 2:
                p.normal_(0, 0.1)
    folder = root / name
    model.save_pretrained(folder)
    write_tokenizer(folder, vocab=COMMON["vocab_size"])
    GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=False).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: _folder(name, root) for name in MODELS}


def _run(passes: list[dict[str, Any]], src: Path, out: Path) -> Path:
    import bitpress

    bitpress.run({"input": str(src), "output": str(out), "passes": passes})
    return out / src.name


def _rtn(**options: Any) -> dict[str, Any]:
    return {"type": "rtn_hf", "bits": 4, "group_size": 32, "moe": True, "modules_to_not_convert": DENSE, **options}


def _qmoe(package: Path) -> dict[int, dict[str, np.ndarray]]:
    """Per layer: the QMoE node's fc1 / fc2 weights, scales and zero points (None when absent), and attributes."""
    m = onnx.load(str(package / "model.onnx"))
    inits = {t.name: t for t in m.graph.initializer}
    out: dict[int, dict[str, Any]] = {}
    for n in m.graph.node:
        if n.op_type in ("QMoE", "MoE"):
            layer = int(n.name.split("/layers.")[1].split("/")[0])
            got: dict[str, Any] = {"op": n.op_type, "attrs": {a.name: helper.get_attribute_value(a)
                                                              for a in n.attribute}}
            for key, idx in {"w1": 2, "s1": 3, "w2": 5, "s2": 6, "z1": 11, "z2": 12}.items():
                name = n.input[idx] if len(n.input) > idx else ""
                got[key] = numpy_helper.to_array(inits[name], base_dir=str(package)) if name else None
            out[layer] = got
    return out


def _expected(ckpt: Path) -> dict[int, dict[str, Any]]:
    """bitpress's experts in QMoE form, from the checkpoint's QuantTensors (fc1 rows interleaved gate, up)."""
    from bitpress.hf.checkpoint import load_model

    model, _ = load_model(ckpt)
    out = {}
    for i, layer in enumerate(model.model.layers):
        block = getattr(layer, "feed_forward", None) or layer.mlp
        experts = getattr(block, "experts", None)
        if experts is None:
            continue
        got = {}
        for key, t in (("1", experts.gate_up_proj), ("2", experts.down_proj)):
            e, n, k = t.shape
            b = t.blocks()
            q = b.q.reshape(e, n, k)
            s = b.scales.reshape(e, n, -1)
            z = None if b.zero_points is None else b.zero_points.reshape(e, n, -1)
            if key == "1":  # [gate | up] -> gate0, up0, gate1, up1, ...
                order = np.stack([np.arange(n // 2), np.arange(n // 2) + n // 2], axis=1).reshape(-1)
                q, s = q[:, order], s[:, order]
                z = None if z is None else z[:, order]
            got[f"w{key}"] = pack_along_last(q, 4)
            got[f"s{key}"] = s
            got[f"z{key}"] = None if z is None else pack_along_last(z, 4)
        out[i] = got
    return out


def _logits_og(package: Path, prompt: list[int]) -> np.ndarray:
    import onnxruntime_genai as og

    m = og.Model(str(package))
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=len(prompt) + 1)
    gen = og.Generator(m, params)
    gen.append_tokens(np.array([prompt], dtype=np.int32))
    return np.asarray(gen.get_output("logits"))[0, -1]


def _logits_torch(ckpt: Path, prompt: list[int]) -> np.ndarray:
    import torch

    from bitpress.hf.checkpoint import load_model

    model, _ = load_model(ckpt)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].numpy()


@pytest.mark.parametrize("sym", [True, False])
def test_qmoe_holds_bitpress_expert_integers(tiny: dict[str, Path], tmp_path: Path, sym: bool) -> None:
    """LFM2-MoE (fused [E, 2I, H] experts), rtn_hf moe: true -> GenAI package: each QMoE input is the
    checkpoint's integers / scales / zero points; the package generates and gives the quantized model's logits."""
    from bitpress.genai.export import generate_step

    ckpt = _run([_rtn(sym=sym)], tiny["lfm2moe"], tmp_path / "ckpt")
    package = _run([{"type": "hf_to_genai", "accuracy_level": 1}], ckpt, tmp_path / "pkg")
    got, want = _qmoe(package), _expected(ckpt)
    assert set(got) == set(want) == {1}  # layer 0 is dense (num_dense_layers=1)
    for layer, w in want.items():
        g = got[layer]
        assert g["op"] == "QMoE"
        assert g["attrs"]["expert_weight_bits"] == 4 and g["attrs"]["block_size"] == 32
        assert g["attrs"]["swiglu_fusion"] == 1
        for key in ("w1", "s1", "w2", "s2"):
            np.testing.assert_array_equal(g[key], w[key], err_msg=f"layer {layer} {key}")
        for key in ("z1", "z2"):
            if sym:
                assert g[key] is None  # the implied 2**(bits-1), which symmetric weights have
            else:
                np.testing.assert_array_equal(g[key], w[key], err_msg=f"layer {layer} {key}")
    assert generate_step(package, tokens=3)
    prompt = [5, 17, 42, 9, 300]
    # fp32 activations and accuracy_level 1 (fp32 compute): both sides compute (q - zp) * scale in float32,
    # so only summation order differs (~1e-6 relative); 1e-4 leaves room and is far below a 4-bit step
    np.testing.assert_allclose(_logits_og(package, prompt), _logits_torch(ckpt, prompt), atol=1e-4, rtol=1e-4)


def test_a_wrong_mapping_is_caught_against_the_builder_weights(tiny: dict[str, Path], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """fc1 left [gate | up] (not interleaved) does not match the builder's weights: ExportError naming the tensor."""
    from bitpress.genai import moe

    monkeypatch.setattr(moe, "_interleave", lambda gate, up, name: moe.ExpertWeights(
        name, np.concatenate([gate.q, up.q], 1), np.concatenate([gate.scales, up.scales], 1), None, gate.bits,
        gate.group_size))
    ckpt = _run([_rtn()], tiny["lfm2moe"], tmp_path / "ckpt")
    with pytest.raises(ExportError, match=r"model\.layers\.1\.feed_forward\.experts\.gate_up_proj does not match "
                                          r"the builder's /model/layers\.1/moe/QMoE fc1 weights"):
        _run([{"type": "hf_to_genai"}], ckpt, tmp_path / "pkg")
    assert not (tmp_path / "pkg" / "lfm2moe").exists()


def _check_package(package: Path, ckpt: Path, sym: bool, layers: set[int]) -> None:
    """Every QMoE input is the checkpoint's integers / scales / zero points; the package generates and its
    last-token logits are the quantized PyTorch model's."""
    from bitpress.genai.export import generate_step

    got, want = _qmoe(package), _expected(ckpt)
    assert set(got) == set(want) == layers
    for layer, w in want.items():
        g = got[layer]
        assert g["op"] == "QMoE"
        assert g["attrs"]["expert_weight_bits"] == 4 and g["attrs"]["block_size"] == 32
        assert g["attrs"]["swiglu_fusion"] == 1
        for key in ("w1", "s1", "w2", "s2"):
            np.testing.assert_array_equal(g[key], w[key], err_msg=f"layer {layer} {key}")
        for key in ("z1", "z2"):
            if sym:
                assert g[key] is None  # the implied 2**(bits-1), which symmetric weights have
            else:
                np.testing.assert_array_equal(g[key], w[key], err_msg=f"layer {layer} {key}")
    assert generate_step(package, tokens=3)
    prompt = [5, 17, 42, 9, 300]
    # fp32 activations (QMoE accuracy_level 0 / 1 keeps them for 4-bit experts): both sides compute
    # (q - zp) * scale in float32, so only summation order differs (~1e-6 relative, measured ~1.5e-6 absolute on
    # logits of magnitude ~3); 1e-4 leaves room and is far below a 4-bit step's effect
    np.testing.assert_allclose(_logits_og(package, prompt), _logits_torch(ckpt, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("name", "sym"), [("mixtral", True), ("qwen3moe", False)])
def test_mobius_loops_become_qmoe_holding_bitpress_integers(tiny: dict[str, Path], tmp_path: Path, name: str,
                                                            sym: bool) -> None:
    """Mixtral (softmax, top-k, renormalized) and Qwen3-MoE (norm_topk_prob false: the full softmax aggregated
    through QMoE's router_weights) built by mobius: each loop over experts is one QMoE holding the checkpoint's
    integers exactly, and the package computes the quantized model's logits."""
    pytest.importorskip("mobius")
    ckpt = _run([_rtn(sym=sym)], tiny[name], tmp_path / "ckpt")
    package = _run([{"type": "hf_to_genai", "exporter": "mobius", "accuracy_level": 1}], ckpt, tmp_path / "pkg")
    m = onnx.load(str(package / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("QMoE") == 2 and "TopK" not in ops and "Equal" not in ops  # the loops are gone
    assert all(helper.get_attribute_value(a) == 1 for n in m.graph.node if n.op_type == "QMoE"
               for a in n.attribute if a.name == "accuracy_level")
    _check_package(package, ckpt, sym, {0, 1})


def test_a_wrong_mapping_is_caught_against_mobius_weights(tiny: dict[str, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """fc1 left [gate | up] (not interleaved) does not match mobius's float experts: ExportError naming the tensor,
    no package."""
    pytest.importorskip("mobius")
    from bitpress.genai import moe

    monkeypatch.setattr(moe, "_interleave", lambda gate, up, name: moe.ExpertWeights(
        name, np.concatenate([gate.q, up.q], 1), np.concatenate([gate.scales, up.scales], 1), None, gate.bits,
        gate.group_size))
    ckpt = _run([_rtn()], tiny["mixtral"], tmp_path / "ckpt")
    with pytest.raises(ExportError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj does not match "
                                          r"mobius's model/layers\.0/mlp/MoE fc1"):
        _run([{"type": "hf_to_genai", "exporter": "mobius"}], ckpt, tmp_path / "pkg")
    assert not (tmp_path / "pkg" / "mixtral").exists()


@pytest.mark.parametrize(("name", "passes", "exporter", "match"), [
    # refused before any work by the exporter choice (bitpress.genai.exporters), naming the other exporter
    ("mixtral", [_rtn()], "builder", "builder 0.18 does not build MixtralForCausalLM.*use --exporter mobius"),
    ("qwen3moe", [_rtn()], "builder", "builder 0.18 does not build Qwen3MoeForCausalLM.*use --exporter mobius"),
    ("lfm2moe", [_rtn()], "mobius", "mobius 0.1.0 does not build model_type 'lfm2_moe'.*use --exporter builder"),
    ("qwen3moe", [{**_rtn(), "modules_to_not_convert": ["mlp.gate."]}], "mobius", "quantized outside the experts"),
])
def test_the_wrong_exporter_or_quantized_dense_layers_are_refused(tiny: dict[str, Path], tmp_path: Path, name: str,
                                                                  passes: list[dict[str, Any]], exporter: str,
                                                                  match: str) -> None:
    ckpt = _run(passes, tiny[name], tmp_path / "ckpt")
    with pytest.raises(ExportError, match=match):
        _run([{"type": "hf_to_genai", "exporter": exporter}], ckpt, tmp_path / "pkg")


@pytest.mark.parametrize(("name", "passes", "match"), [
    ("lfm2moe", [_rtn(overrides={r"re:.*experts\.down_proj": {"bits": 8}})],
     "CPU QMoE needs one width and block size for both"),
    ("lfm2moe", [_rtn(group_size=16)], "CPU QMoE needs a block size of 32, 64, 128"),
    ("lfm2moe", [{**_rtn(), "modules_to_not_convert": ["mlp.gate."]}], "quantized outside the experts"),
])
def test_what_qmoe_cannot_hold_is_refused_before_the_build(tiny: dict[str, Path], tmp_path: Path, name: str,
                                                           passes: list[dict[str, Any]], match: str) -> None:
    ckpt = _run(passes, tiny[name], tmp_path / "ckpt")
    with pytest.raises(ExportError, match=match):
        _run([{"type": "hf_to_genai"}], ckpt, tmp_path / "pkg")


def test_the_traced_export_still_refuses_moe(tiny: dict[str, Path], tmp_path: Path) -> None:
    from bitpress.errors import QuantizationError
    from bitpress.hf.checkpoint import load_model
    from bitpress.hf.export import check_exportable

    ckpt = _run([_rtn()], tiny["lfm2moe"], tmp_path / "ckpt")
    model, _ = load_model(ckpt)
    with pytest.raises(QuantizationError, match=r"fused MoE experts.*hf_to_genai"):
        check_exportable(model)
