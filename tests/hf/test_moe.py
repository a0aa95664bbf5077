"""Mixture-of-experts: fail-closed by default, fused (E, OUT, K) experts, per-expert lists, refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from bitpress.errors import QuantizationError
from bitpress.hf import checkpoint
from bitpress.hf import quantize as hfq
from bitpress.hf.export import check_exportable
from bitpress.hf.qtensor import QuantTensor
from bitpress.quant.solver import BlockSpec
from bitpress_kquant.hf_passes import KQuantHfPass
from bitpress_rtn.hf_passes import RtnHfPass
from bitpress_rtn.solver import rtn_solver


def quantize(model: Any, cls: type = RtnHfPass, **options: Any) -> Any:
    p = cls.from_config({"group_size": 32, **options})
    return hfq.apply(model, hfq.plan(model, p.options.rules(), float_zero_points=p.float_zero_points()), p.solver())


def quantized(model: Any) -> set[str]:
    return {n for n, p in model.named_parameters() if isinstance(p, QuantTensor)}


def param_ids(model: Any) -> dict[str, int]:
    return {n: id(p) for n, p in model.named_parameters()}


class ExpertMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(64, 96, bias=False)
        self.w2 = nn.Linear(96, 64, bias=False)


def with_expert_lists(model: Any) -> Any:
    """Per-expert nn.ModuleList experts (the classic Mixtral layout) in every layer."""
    for layer in model.model.layers:
        layer.mlp.experts = nn.ModuleList([ExpertMLP() for _ in range(4)])
    return model


def test_moe_is_fail_closed_by_default(mixtral: Any) -> None:
    model = mixtral()
    quantize(model)
    names = quantized(model)
    assert names and all("self_attn" in n for n in names)
    listed = with_expert_lists(mixtral())
    quantize(listed)
    assert not any("experts" in n for n in quantized(listed))  # plain nn.Linear under experts: still skipped


def test_fused_experts_are_quantized_along_k_when_the_layout_is_known(mixtral: Any) -> None:
    ref = mixtral()
    model = mixtral()
    w = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()  # (E=4, OUT=192, K=64)
    quantize(model, moe=True, overrides={r"re:.*\.experts\.down_proj": {"bits": 8}})
    experts = model.model.layers[0].mlp.experts
    gu, down = experts.gate_up_proj, experts.down_proj
    assert isinstance(gu, QuantTensor) and gu.shape == (4, 192, 64) and gu.spec.bits == 4
    assert isinstance(down, QuantTensor) and down.spec.bits == 8 and down.shape == (4, 64, 96)
    expected = rtn_solver(w.reshape(4 * 192, 2, 32).numpy(), BlockSpec(4, 32, True))
    assert np.array_equal(gu.blocks().q, expected.q)
    assert not isinstance(model.model.layers[0].mlp.gate.weight, QuantTensor)  # the router is no nn.Linear
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = ref(input_ids=ids).logits
    assert torch.isfinite(got).all() and float((got - want).abs().max()) < 0.1


def test_per_expert_lists_are_quantized_with_moe(mixtral: Any) -> None:
    model = with_expert_lists(mixtral())
    quantize(model, KQuantHfPass, moe=True)
    names = quantized(model)
    assert {f"model.layers.0.mlp.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w2")} <= names


@pytest.mark.parametrize(("flag", "message"), [(True, "transposed as \\(E, K, OUT\\)"),
                                               (None, "does not report is_transposed"),
                                               ("no", "does not report is_transposed")])
def test_unverifiable_fused_layouts_are_refused_before_any_parameter_is_touched(
    mixtral: Any, flag: Any, message: str
) -> None:
    model = mixtral()
    for layer in model.model.layers:
        if flag is None:
            del layer.mlp.experts.is_transposed
        else:
            layer.mlp.experts.is_transposed = flag
    before = param_ids(model)
    with pytest.raises(QuantizationError, match=message):
        quantize(model, moe=True)
    assert param_ids(model) == before and not quantized(model)
    # excluded experts are never looked at: no error, the rest is quantized
    quantize(model, moe=True, modules_to_not_convert=["experts"])
    assert quantized(model) and not any("experts" in n for n in quantized(model))


def test_moe_config_without_a_resolvable_experts_subtree_is_refused(mixtral: Any) -> None:
    model = mixtral()
    for layer in model.model.layers:
        layer.mlp.specialists = layer.mlp.experts
        del layer.mlp.experts
    before = param_ids(model)
    with pytest.raises(QuantizationError, match="experts subtree"):
        quantize(model)  # even with moe=false: the experts could otherwise pass for plain weights
    assert param_ids(model) == before


def test_fused_experts_save_reload_and_are_not_exported(mixtral: Any, tmp_path: Path) -> None:
    model = mixtral()
    quantize(model, moe=True)
    with pytest.raises(QuantizationError, match=r"^4 tensors are fused MoE experts, quantized in 3-D \(model\."
                       r"layers\.0\.mlp\.experts\.gate_up_proj, .* and 1 more\): .*does not export"):
        check_exportable(model)
    checkpoint.save_model(model, tmp_path / "q")
    again, qc = checkpoint.load_model(tmp_path / "q")
    gu = again.model.layers[1].mlp.experts.gate_up_proj
    assert isinstance(gu, QuantTensor) and qc["modules"]["model.layers.1.mlp.experts.gate_up_proj"]["shape"] == [
        4, 192, 64]
    assert torch.equal(gu.qweight, model.model.layers[1].mlp.experts.gate_up_proj.qweight)

    plain = mixtral()
    quantize(plain)  # experts float: refused all the same, the routing cannot be traced
    with pytest.raises(QuantizationError, match="mixture-of-experts models are not exported"):
        check_exportable(plain)


# -- fail-closed per block: every expert of every block, whatever each block calls its experts -------------
class Router(nn.Module):
    """A MoE block of another shape: a gate Linear (one output per expert) beside expert containers."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        if shape == "block_sparse_moe_lists":  # w1 / w2 / w3 lists of per-expert linears
            self.gate = nn.Linear(64, 4, bias=False)
            self.w1 = nn.ModuleList([nn.Linear(64, 96, bias=False) for _ in range(4)])
            self.w2 = nn.ModuleList([nn.Linear(96, 64, bias=False) for _ in range(4)])
            self.w3 = nn.ModuleList([nn.Linear(64, 96, bias=False) for _ in range(4)])
        elif shape == "moe_experts_list":
            self.gate = nn.Linear(64, 4, bias=False)
            self.experts_list = nn.ModuleList([ExpertMLP() for _ in range(4)])
        elif shape == "list_beside_router":  # no telling name at all: a list of identical MLPs beside a router
            self.router = nn.Linear(64, 4, bias=False)
            self.specialists = nn.ModuleList([ExpertMLP() for _ in range(4)])
        else:  # as many identical MLPs as the config has experts, router not an nn.Linear
            self.specialists = nn.ModuleList([ExpertMLP() for _ in range(4)])


#: layer 1's MoE block: where it sits, and where its expert linears are
SHAPES = {
    "block_sparse_moe_lists": ("block_sparse_moe", "model.layers.1.block_sparse_moe.w"),
    "moe_experts_list": ("mlp.moe", "model.layers.1.mlp.moe.experts_list."),
    "list_beside_router": ("mlp", "model.layers.1.mlp.specialists."),
    "list_of_config_experts": ("mlp", "model.layers.1.mlp.specialists."),
}


def mixed_model(mixtral: Any, shape: str) -> Any:
    """Layer 0: ``mlp.experts.N.*`` (per-expert list); layer 1: another container (SHAPES)."""
    model = mixtral()
    model.model.layers[0].mlp.experts = nn.ModuleList([ExpertMLP() for _ in range(4)])
    layer = model.model.layers[1]
    where, _ = SHAPES[shape]
    if where == "block_sparse_moe":
        del layer.mlp
        layer.block_sparse_moe = Router(shape)
    elif where == "mlp.moe":
        layer.mlp = nn.Module()
        layer.mlp.moe = Router(shape)
    else:
        layer.mlp = Router(shape)
    return model


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_expert_of_every_block_is_excluded_with_moe_false(mixtral: Any, shape: str) -> None:
    model = mixed_model(mixtral, shape)
    _, experts_prefix = SHAPES[shape]
    expert_linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)
                      and (n.startswith("model.layers.0.mlp.experts.") or n.startswith(experts_prefix))}
    assert len(expert_linears) == (20 if shape == "block_sparse_moe_lists" else 16)
    quantize(model)
    names = quantized(model)
    assert names and all("self_attn" in n for n in names), names  # no expert, in either layer
    model = mixed_model(mixtral, shape)
    quantize(model, moe=True)
    names = quantized(model)
    assert {f"{n}.weight" for n in expert_linears} <= names  # moe=true: every expert linear, in both layers
    assert not any(n.endswith(("gate.weight", "router.weight")) for n in names)  # routers stay float


def test_a_router_without_experts_beside_it_is_refused_before_anything_is_touched(mixtral: Any) -> None:
    model = mixtral()
    layer = model.model.layers[1]  # layer 0 keeps `experts`; layer 1 calls its fused experts something else
    layer.mlp.specialists = layer.mlp.experts
    del layer.mlp.experts
    before = param_ids(model)
    for moe in (False, True):
        with pytest.raises(QuantizationError) as info:
            quantize(model, moe=moe)
        message = str(info.value)
        assert message.startswith("model.layers.1.mlp has a router but no experts found beside it"), message
        assert "router model.layers.1.mlp.gate, modules: gate, specialists" in message
        assert param_ids(model) == before and not quantized(model)


def test_plain_torch_blocks_without_a_config_are_fail_closed_too() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(64, 64, bias=False)
            self.gate = nn.Linear(64, 3, bias=False)
            self.ffn = nn.ModuleList([ExpertMLP() for _ in range(3)])

    model = nn.Sequential(Block(), Block())
    assert set(hfq.find_experts(model).roots) == {"0.ffn", "1.ffn"}
    quantize(model)
    assert quantized(model) == {"0.proj.weight", "1.proj.weight"}
    quantize(model, moe=True)
    assert {f"{b}.ffn.{e}.{w}.weight" for b in "01" for e in range(3) for w in ("w1", "w2")} <= quantized(model)
    assert not any(".gate." in n for n in quantized(model))


def test_identical_lists_that_are_not_experts_stay_linears(llama: Any) -> None:
    model = llama(tied=False, num_hidden_layers=4)
    assert not hfq.find_experts(model).roots  # decoder layers are not MLPs; no router, no config count
    quantize(model)
    assert "model.layers.3.mlp.down_proj.weight" in quantized(model)


def test_fused_layout_errors_are_one_sentence_for_all_tensors(mixtral: Any) -> None:
    model = mixtral()
    for layer in model.model.layers:
        layer.mlp.experts.is_transposed = True
    with pytest.raises(QuantizationError) as info:
        quantize(model, moe=True)
    message = str(info.value)
    assert message.startswith("4 fused expert tensors (model.layers.0.mlp.experts.gate_up_proj, "), message
    assert "and 1 more): MixtralExperts stores fused experts transposed" in message
    assert message.count("transposed as (E, K, OUT)") == 1
