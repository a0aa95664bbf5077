"""quarot_hf / spinquant_hf: rotations of Hugging Face decoders; same function, one tied table, compose with the
HF quantizers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

pytest.importorskip("bitpress_rotate")

from bitpress.errors import BitpressError, UsageError
from bitpress_rotate.hf import RotationError, rotate_model

BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def _build(family: str, tied: bool, dtype: Any = None, seed: int = 0, bias: bool = True) -> Any:
    """A tiny decoder of ``family`` with norm scales and biases far from their initial values (``bias``: the
    Llama's attention and MLP biases)."""
    import torch
    import transformers as tr

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": bias, "mlp_bias": bias}),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
               "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16})}
    config_cls, model_cls, extra = classes[family]
    torch.manual_seed(seed)
    config = getattr(tr, config_cls)(**BASE, **extra, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                                     pad_token_id=0)
    model = getattr(tr, model_cls)(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) * 1.5 + 0.1)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif p.dim() == 2:
                p.normal_(0, 0.1, generator=g)
    return model.to(dtype) if dtype is not None else model


def _logits(model: Any, ids: Any) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(ids).logits.double().numpy()


@pytest.mark.parametrize(("family", "tied"), [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False),
                                               ("gemma", True)])
@pytest.mark.parametrize("mode", ["hadamard", "random"])
def test_rotation_leaves_the_float_function_unchanged(family: str, tied: bool, mode: str) -> None:
    """Logits before and after the rotation agree to float64 rounding (the tied head's product is float32);
    the rotated weights are not the originals (something was rotated)."""
    import torch

    model = _build(family, tied, torch.float64)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    q_before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    result = rotate_model(model, mode, seed=3)
    after = _logits(model, ids)
    np.testing.assert_allclose(after, before, atol=2e-6 * np.abs(before).max())
    assert not torch.allclose(model.model.layers[0].self_attn.q_proj.weight, q_before)
    assert result.heads == 2 * BASE["num_key_value_heads"] and result.norms == 5
    assert result.online == (["lm_head"] if tied else [])
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied  # one table stays one


def test_refusals_name_the_reason() -> None:
    """Sandwich norms (Gemma 3), a quantized model, a second rotation: refused before any change."""
    import torch

    gemma3 = _build("gemma3", True)
    state = {k: v.clone() for k, v in gemma3.state_dict().items()}
    with pytest.raises(RotationError, match=r"sandwich norms.*quarot pass on the graph"):
        rotate_model(gemma3)
    assert all(torch.equal(state[k], v) for k, v in gemma3.state_dict().items())
    llama = _build("llama", True)
    rotate_model(llama)
    with pytest.raises(RotationError, match="rotated already"):
        rotate_model(llama)


def _folder(tmp_path: Path, family: str = "llama", tied: bool = True, bias: bool = True) -> Path:
    pytest.importorskip("tokenizers")
    from test_genai_export import _tokenized_folder

    return _tokenized_folder(_build(family, tied, bias=bias), tmp_path / f"{family}-{'tied' if tied else 'untied'}")


def _run(passes: list[dict[str, Any]], src: Path, out: Path) -> Path:
    import bitpress

    bitpress.run({"input": str(src), "output": str(out), "passes": passes})
    return out / src.name


def test_rotated_checkpoint_keeps_one_table_and_its_product(tmp_path: Path) -> None:
    """QuaRot (Olive's name) on a tied HF folder: the checkpoint stores the table once plus the head's product,
    names it in quantization_config.online, and loads back (bitpress) to the float model's logits."""
    import torch
    from safetensors import safe_open

    from bitpress.hf.checkpoint import load_model

    src = _folder(tmp_path)
    out = _run([{"type": "QuaRot", "seed": 1}], src, tmp_path / "rot")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["online"] == ["lm_head"] and qc["modules"] == {} and qc["passes"][0]["pass"] == "quarot_hf"
    with safe_open(str(out / "model.safetensors"), framework="pt") as sf:
        keys = set(sf.keys())
        assert tuple(sf.get_tensor("lm_head.bitpress_online_input").shape) == (64, 64)
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    ids = torch.tensor([[5, 17, 42, 9, 100]])
    original, _ = load_model(src)
    rotated, _ = load_model(out)
    np.testing.assert_allclose(_logits(rotated, ids), _logits(original, ids), atol=1e-4)
    assert not torch.allclose(rotated.model.embed_tokens.weight, original.model.embed_tokens.weight)
    from bitpress.hf.model import HfModel
    from bitpress.hf.streaming import why_not

    assert "online product" in (why_not(HfModel.load(out)) or "")  # streaming would drop it: loaded whole


def test_a_damaged_product_is_refused_on_load(tmp_path: Path) -> None:
    from bitpress.hf.checkpoint import load_model

    out = _run([{"type": "quarot_hf"}], _folder(tmp_path), tmp_path / "rot")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["online"] = ["model.layers.0.mlp.down_proj"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BitpressError, match=r"down_proj\.bitpress_online_input is not in the checkpoint"):
        load_model(out)


def test_hf_input_routes_olive_types_by_kind(tmp_path: Path) -> None:
    """``QuaRot`` names the ONNX pass, but on a Hugging Face input it is quarot_hf (and a Gemma 3 is refused
    in one line naming the ONNX form)."""
    from bitpress.workflow.config import build_workflow

    src = _folder(tmp_path)
    wf = build_workflow({"input": str(src), "output": str(tmp_path / "o"), "passes": [{"type": "QuaRot"}]})
    assert [s.pass_.name for s in wf.steps] == ["quarot_hf"]
    gemma3 = _tokenized_folder_of(_build("gemma3", True), tmp_path / "g3")
    with pytest.raises(UsageError, match="quarot_hf: cannot rotate g3: layer 0 has norms that write"):
        _run([{"type": "QuaRot"}], gemma3, tmp_path / "g3out")
    assert not (tmp_path / "g3out").exists()


def _tokenized_folder_of(model: Any, folder: Path) -> Path:
    from test_genai_export import _tokenized_folder

    return _tokenized_folder(model, folder)


@pytest.mark.parametrize("tied", [True, False])
def test_quarot_then_rtn_exports_to_onnx_with_the_product_kept_float(tmp_path: Path, tied: bool) -> None:
    """QuaRot -> Rtn int4 -> hf_to_onnx: ONNX Runtime's logits are the quantized PyTorch model's; the tied head's
    product is one float MatMul marked keep_float, every other weight a MatMulNBits / GatherBlockQuantized."""
    import onnxruntime as ort
    import torch

    from bitpress.hf import hf_to_onnx
    from bitpress.hf.checkpoint import load_model
    from bitpress.onnx.graph import keeps_float

    src = _folder(tmp_path, tied=tied)
    ckpt = _run([{"type": "QuaRot"}, {"type": "Rtn", "bits": 4, "group_size": 32, "lm_head": True,
                                       "embeds": tied}], src, tmp_path / "q")
    hf_to_onnx(ckpt, tmp_path / "onnx", accuracy_level=1)  # float math: compared with PyTorch
    graph = onnx.load(str(tmp_path / "onnx" / "model.onnx"))
    floats = [n for n in graph.graph.node if n.op_type == "MatMul"
              and any(i.endswith("bitpress_online_input") for i in n.input)]
    assert len(floats) == int(tied) and all(keeps_float(n) for n in floats)
    assert sum(n.op_type == "MatMulNBits" for n in graph.graph.node) == 2 * 7 + 1
    ids = np.array([[5, 17, 42, 9, 100]], dtype=np.int64)
    sess = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    quantized, _ = load_model(ckpt)
    np.testing.assert_allclose(got, _logits(quantized, torch.from_numpy(ids)), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("exporter", ["builder", "mobius"])
def test_genai_package_of_a_rotated_tied_model_carries_the_product(tmp_path: Path, exporter: str) -> None:
    """QuaRot -> Rtn int4 -> hf_to_genai: the package has the product before its LM head (float, keep_float),
    generates, and its logits are the quantized PyTorch model's. (No Llama biases: mobius 0.1.0 drops them.)"""
    pytest.importorskip("onnxruntime_genai.models.builder")
    if exporter == "mobius":
        pytest.importorskip("mobius")
    from test_genai_export import _logits_og, _logits_torch

    from bitpress.onnx.graph import keeps_float

    ckpt = _run([{"type": "QuaRot"}, {"type": "Rtn", "bits": 4, "group_size": 32, "lm_head": True,
                                       "embeds": True}], _folder(tmp_path, bias=False), tmp_path / "q")
    package = _run([{"type": "hf_to_genai", "exporter": exporter, "accuracy_level": 1}], ckpt, tmp_path / "pkg")
    graph = onnx.load(str(package / "model.onnx"), load_external_data=False).graph
    products = [n for n in graph.node if n.op_type == "MatMul" and keeps_float(n)]
    assert len(products) == 1
    assert not [n.name for n in graph.node if n.op_type == "MatMul" and not keeps_float(n)
                and any(i.endswith(".weight") for i in n.input)]  # nothing else float
    prompt = [5, 17, 42, 9]
    np.testing.assert_allclose(_logits_og(package, prompt), _logits_torch(ckpt, prompt), atol=2e-4, rtol=1e-4)


# -- SpinQuant ------------------------------------------------------------------------------------------------
def test_cayley_steps_stay_orthogonal_and_descend() -> None:
    """Cayley SGD on f(X) = ||X - T||^2 over orthogonal X: every iterate orthogonal, the distance to T shrinks."""
    import torch

    from bitpress_rotate.matrices import orthogonal
    from bitpress_rotate.spinquant import cayley_step

    rng = np.random.default_rng(0)
    x = torch.from_numpy(orthogonal(32, "random", rng))
    skew = torch.from_numpy(rng.standard_normal((32, 32)))
    target = x @ torch.linalg.matrix_exp(0.1 * (skew - skew.T))  # on the same component of the group
    start = float((x - target).norm())
    for step in range(60):
        cayley_step(x, 2 * (x - target), 0.2 * (1 - step / 60))
        assert float((x.T @ x - torch.eye(32, dtype=x.dtype)).abs().max()) < 1e-10
    assert float((x - target).norm()) < 0.25 * start


def _kl_to(reference: Any, model: Any, ids: Any) -> float:
    import torch

    with torch.no_grad():
        p = torch.log_softmax(reference(ids).logits.double(), -1)
        q = torch.log_softmax(model(ids).logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_spinquant_keeps_the_function_and_beats_quarot_after_rtn(tmp_path: Path) -> None:
    """SpinQuant (Olive's name) then Rtn int4: the rotated float checkpoint computes the float model's logits; the
    quantized one is closer to the float model (KL on the calibration windows) than QuaRot + the same Rtn."""
    import torch

    import bitpress
    from bitpress.hf.checkpoint import load_model

    src = _folder(tmp_path, bias=False)
    data = {"source": "random", "samples": 16, "seq_len": 32, "seed": 4}
    rtn = {"type": "Rtn", "bits": 4, "group_size": 16}
    spin = {"type": "SpinQuant", "w_group_size": 16, "training_args": {"max_steps": 40, "learning_rate": 0.1}}
    for name, passes in (("spin-float", [spin]), ("spin", [spin, rtn]), ("quarot", [{"type": "QuaRot"}, rtn])):
        bitpress.run({"input": str(src), "output": str(tmp_path / name), "passes": passes, "data": data})
    ids = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(4))
    original, _ = load_model(src)
    rotated_float, _ = load_model(tmp_path / "spin-float" / src.name)
    np.testing.assert_allclose(_logits(rotated_float, ids), _logits(original, ids), atol=1e-4)
    spin_kl = _kl_to(original, load_model(tmp_path / "spin" / src.name)[0], ids)
    quarot_kl = _kl_to(original, load_model(tmp_path / "quarot" / src.name)[0], ids)
    assert spin_kl < 0.95 * quarot_kl, (spin_kl, quarot_kl)  # 0.88 measured


def test_spinquant_from_identity_starts_from_the_folded_model(tmp_path: Path) -> None:
    """rotate_mode identity: with no steps the weights are the model's with the norms folded (no rotation); trained,
    the result after Rtn is closer to the float model than Rtn on that start."""
    import torch

    import bitpress
    from bitpress.hf.checkpoint import load_model

    src = _folder(tmp_path, bias=False)
    data = {"source": "random", "samples": 16, "seq_len": 32, "seed": 4}
    rtn = {"type": "Rtn", "bits": 4, "group_size": 16}
    spin = {"type": "SpinQuant", "rotate_mode": "identity", "w_group_size": 16,
            "training_args": {"max_steps": 40, "learning_rate": 0.05}}
    still = {**spin, "training_args": {"max_steps": 0}}
    for name, passes in (("spin", [spin, rtn]), ("folded", [still, rtn]), ("still", [still])):
        bitpress.run({"input": str(src), "output": str(tmp_path / name), "passes": passes, "data": data})
    ids = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(4))
    original, _ = load_model(src)
    unrotated, _ = load_model(tmp_path / "still" / src.name)
    np.testing.assert_allclose(unrotated.model.layers[0].mlp.down_proj.weight.detach().numpy(),
                               original.model.layers[0].mlp.down_proj.weight.detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(_logits(unrotated, ids), _logits(original, ids), atol=1e-4)
    spin_kl = _kl_to(original, load_model(tmp_path / "spin" / src.name)[0], ids)
    folded_kl = _kl_to(original, load_model(tmp_path / "folded" / src.name)[0], ids)
    assert spin_kl < 0.95 * folded_kl, (spin_kl, folded_kl)  # 0.85 measured


def test_spinquant_trains_for_int8_activations() -> None:
    """a_bits 8 (per token): the training's own measure (fixed windows) goes down; the result is orthonormal."""
    import torch

    from bitpress.hf.online import attach
    from bitpress_rotate.hf import fold_norms, layout
    from bitpress_rotate.spinquant import SpinQuantOptions, train_rotation

    model = _build("qwen2", True)
    lay = layout(model)
    g = fold_norms(model, lay)
    attach(model, "lm_head", torch.diag(g).float())
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    opts = SpinQuantOptions(a_bits=8, w_bits=4, w_group_size=16, training_args={"max_steps": 30, "learning_rate": 0.1})
    opts.validate()
    r1, r2s, training = train_rotation(model, lay, g, [(ids, None)], opts)
    assert training.last_loss < 0.95 * training.first_loss, training
    assert float((r1.T @ r1 - torch.eye(64, dtype=r1.dtype)).abs().max()) < 1e-12 and len(r2s or []) == 2


@pytest.mark.parametrize(("options", "message"), [
    ({"a_bits": 5}, "a_bits must be 4, 8 or 16"),
    ({"w_group_size": 48}, "w_group_size must be a power of two"),
    ({"training_args": {"learning_rate": 3}}, r"learning_rate must be in \(0, 1\]"),
    ({"training_args": {"max_steps": -1}}, "max_steps must be a whole number"),
    ({"device": "gpu"}, "device must be auto, cpu, cuda or cuda:N"),
])
def test_spinquant_options_are_checked(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    with pytest.raises(BitpressError, match=message):
        _run([{"type": "SpinQuant", **options}], _folder(tmp_path), tmp_path / "o")


def test_spinquant_device_cpu_trains_the_same_rotation_as_auto_without_a_gpu(tmp_path: Path) -> None:
    """device: cpu and auto (no GPU here) give the same checkpoint; a GPU asked for that torch cannot use is refused
    in one line saying why and what to give instead, before anything is written."""
    import torch

    src = _folder(tmp_path, bias=False)
    steps = {"training_args": {"max_steps": 2}}
    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA GPU: auto trains there")
    cpu = _run([{"type": "spinquant_hf", "device": "cpu", **steps}], src, tmp_path / "cpu")
    auto = _run([{"type": "spinquant_hf", **steps}], src, tmp_path / "auto")
    assert (cpu / "model.safetensors").read_bytes() == (auto / "model.safetensors").read_bytes()
    for device in ("cuda", "cuda:1"):
        with pytest.raises(BitpressError, match=rf"device {device} asked for, but torch cannot use a CUDA GPU here "
                                                r"\(.*\); use device: cpu"):
            _run([{"type": "spinquant_hf", "device": device, **steps}], src, tmp_path / "gpu")
        assert not (tmp_path / "gpu").exists()


def test_spinquant_without_data_trains_on_the_models_own_text(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                               ) -> None:
    """No data: the model's own text (logged); Olive TrainingArguments keys bitpress does not read are named."""
    import logging

    caplog.set_level(logging.INFO)
    out = _run([{"type": "spinquant_hf", "training_args": {"max_steps": 2, "output_dir": "x", "bf16": True}}],
               _folder(tmp_path, bias=False), tmp_path / "o")
    text = caplog.text
    assert "no calibration data given: training on 32 windows of the model's own text" in text
    assert "training_args bf16, output_dir ignored" in text
    assert "2 Cayley steps on 32 windows" in text
    assert json.loads((out / "config.json").read_text())["quantization_config"]["passes"][0]["float"] is True


def test_gptq_hf_runs_after_a_rotation(tmp_path: Path) -> None:
    """A rotation leaves the model float: gptq_hf takes it (its history entry says so)."""
    import bitpress

    src = _folder(tmp_path, bias=False)
    bitpress.run({"input": str(src), "output": str(tmp_path / "o"), "data": {"source": "random", "samples": 8},
                  "passes": [{"type": "QuaRot"}, {"type": "gptq_hf", "bits": 4, "group_size": 32}]})
    qc = json.loads((tmp_path / "o" / src.name / "config.json").read_text())["quantization_config"]
    assert [p["pass"] for p in qc["passes"]] == ["quarot_hf", "gptq_hf"] and qc["online"] == ["lm_head"]


@pytest.mark.parametrize("symmetric", [True, False])
def test_training_rounds_on_the_rtn_grid(symmetric: bool) -> None:
    """The fake quantizer SpinQuant trains through gives exactly what the rtn solver stores."""
    import torch

    from bitpress.quant.solver import BlockSpec
    from bitpress_rotate.spinquant import fake_quant
    from bitpress_rtn.solver import rtn_solver

    w = np.random.default_rng(0).standard_normal((8, 4, 32)).astype(np.float32)
    r = rtn_solver(w, BlockSpec(4, 32, symmetric))
    zero = 8 if r.zero_points is None else r.zero_points.reshape(8, 4, 1)
    stored = (r.q.astype(np.float32) - zero) * r.scales.reshape(8, 4, 1)
    trained = fake_quant(torch.from_numpy(w.reshape(8, 128)), 4, 32, symmetric).numpy().reshape(8, 4, 32)
    np.testing.assert_array_equal(trained, stored)


@pytest.mark.parametrize("example", [{"type": "QuaRot", "rotate_mode": "hadamard"},
                                     {"type": "SpinQuant", "rotate_mode": "hadamard", "a_bits": 8}])
def test_the_seed_olive_examples_run_as_written(tmp_path: Path, example: dict[str, Any]) -> None:
    """Olive's documented QuaRot and SpinQuant configurations, on a Hugging Face model, without data: the same
    function afterwards."""
    import torch

    from bitpress.hf.checkpoint import load_model

    src = _folder(tmp_path, bias=False)
    out = _run([dict(example)], src, tmp_path / "o")
    ids = torch.tensor([[5, 17, 42, 9, 100]])
    np.testing.assert_allclose(_logits(load_model(out)[0], ids), _logits(load_model(src)[0], ids), atol=1e-4)


def test_spinquant_on_a_bf16_checkpoint_trains_a_float32_copy(tmp_path: Path) -> None:
    """A bf16 model: trained on a float32 copy, the rotation written into the bf16 weights (one rounding), the
    function kept to bf16 precision; without value heads (rotate_heads false) too."""
    import torch

    import bitpress
    from bitpress.hf.checkpoint import load_model

    pytest.importorskip("tokenizers")
    from test_genai_export import _tokenized_folder

    src = _tokenized_folder(_build("llama", True, dtype=torch.bfloat16, bias=False), tmp_path / "bf16")
    spin = {"type": "SpinQuant", "rotate_heads": False, "w_group_size": 16, "training_args": {"max_steps": 3}}
    bitpress.run({"input": str(src), "output": str(tmp_path / "o"), "passes": [spin],
                  "data": {"source": "random", "samples": 4, "seq_len": 16}})
    out, _ = load_model(tmp_path / "o" / src.name)
    assert out.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids = torch.tensor([[5, 17, 42, 9, 100]])
    ref = _logits(load_model(src)[0].float(), ids)  # float32 math: only the weights' rounding differs
    got = _logits(out.float(), ids)
    np.testing.assert_allclose(got, ref, atol=0.02 * np.abs(ref).max())

