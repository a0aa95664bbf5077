"""Rtn / KQuant on PyTorch models: what is quantized, how it is stored, ties, composition."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from bitpress.errors import QuantizationError
from bitpress.hf import quantize as hfq
from bitpress.hf.qtensor import QuantTensor, pack_bits, unpack_bits
from bitpress.quant.solver import BlockSpec, dequantize
from bitpress_kquant.hf_passes import KQuantHfPass
from bitpress_rtn.hf_passes import RtnHfPass
from bitpress_rtn.solver import rtn_solver


def quantize(model: Any, cls: type = RtnHfPass, **options: Any) -> Any:
    p = cls.from_config(options)
    plan = hfq.plan(model, p.options.rules(), float_zero_points=p.float_zero_points())
    return hfq.apply(model, plan, p.solver())


def quantized_names(model: Any) -> set[str]:
    return {n for n, p in model.named_parameters(remove_duplicate=False) if isinstance(p, QuantTensor)}


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_bits_round_trips(bits: int) -> None:
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, (3, 2, 32), dtype=np.uint8)
    packed = pack_bits(q, bits)
    assert packed.shape == (3, 2, 32 * bits // 8)
    assert np.array_equal(unpack_bits(packed, bits), q)
    if bits == 4:  # MatMulNBits order: the lower K index in the low nibble
        assert packed[0, 0, 0] == (q[0, 0, 0] | (q[0, 0, 1] << 4))


def test_defaults_quantize_linears_only_and_keep_modules(llama: Any) -> None:
    model = llama(tied=False)
    classes = {n: type(m) for n, m in model.named_modules()}
    report = quantize(model, group_size=32)
    names = quantized_names(model)
    assert len(names) == 14 and all(".layers." in n for n in names)
    assert not isinstance(model.lm_head.weight, QuantTensor)
    assert not isinstance(model.model.embed_tokens.weight, QuantTensor)
    assert {n: type(m) for n, m in model.named_modules()} == classes  # no module was swapped
    assert report.quantized == 14 and "lm_head.weight" in report.skipped


def test_stored_integers_are_the_solvers_and_dequantize_exactly(llama: Any) -> None:
    model = llama(tied=False)
    w = model.model.layers[0].mlp.down_proj.weight.detach().clone()  # [64, 128]
    quantize(model, bits=4, group_size=32, sym=False)
    qt = model.model.layers[0].mlp.down_proj.weight
    assert isinstance(qt, QuantTensor) and isinstance(qt, torch.nn.Parameter)
    assert qt.shape == w.shape and qt.dtype == w.dtype and not qt.requires_grad
    expected = rtn_solver(w.numpy().reshape(64, 4, 32), BlockSpec(4, 32, False))
    got = qt.blocks()
    assert np.array_equal(got.q, expected.q) and np.array_equal(got.scales, expected.scales)
    assert np.array_equal(got.zero_points, expected.zero_points) and got.zero_points.dtype == np.uint8
    assert qt.qweight.shape == (64, 4, 16) and qt.qweight.dtype == torch.uint8
    assert torch.equal(qt.dequantize(), torch.from_numpy(dequantize(expected, 4).reshape(64, 128)))


def test_category_flags_opt_in_head_and_embeddings(llama: Any) -> None:
    model = llama(tied=False)
    quantize(model, lm_head=True, group_size=32)
    assert isinstance(model.lm_head.weight, QuantTensor)
    assert not isinstance(model.model.embed_tokens.weight, QuantTensor)
    model = llama(tied=False)
    quantize(model, embeds=True, group_size=32)
    assert isinstance(model.model.embed_tokens.weight, QuantTensor)
    assert not isinstance(model.lm_head.weight, QuantTensor)


def test_modules_to_not_convert_and_overrides_on_a_model(llama: Any) -> None:
    model = llama(tied=False)
    quantize(model, group_size=32, lm_head=True, modules_to_not_convert=["mlp.down_proj"],
             overrides={r"re:.*\.self_attn\..*": {"bits": 8, "group_size": 16}, "lm_head": {"sym": False}})
    layer = model.model.layers[1]
    assert not isinstance(layer.mlp.down_proj.weight, QuantTensor)
    assert (layer.self_attn.k_proj.weight.spec.bits, layer.self_attn.k_proj.weight.spec.group_size) == (8, 16)
    assert layer.mlp.up_proj.weight.spec.bits == 4
    assert model.lm_head.weight.spec.zero_points == "uint8"


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_model_runs_and_error_shrinks_with_bits(llama: Any, bits: int) -> None:
    ref = llama(tied=True)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    want = logits(ref, ids)
    model = llama(tied=True)
    report = quantize(model, bits=bits, group_size=32, lm_head=True, embeds=True)
    got = logits(model, ids)
    err = float((got - want).abs().max())
    mean_rel = sum(report.errors.values()) / len(report.errors)
    assert err > 0 and np.isfinite(err)
    assert mean_rel < {2: 0.6, 4: 0.12, 8: 0.01}[bits]


def test_tied_table_is_quantized_once_and_shared(llama: Any) -> None:
    model = llama(tied=True)
    assert model.model.embed_tokens.weight is model.lm_head.weight
    report = quantize(model, group_size=32, lm_head=True, embeds=True)
    assert isinstance(model.lm_head.weight, QuantTensor)
    assert model.model.embed_tokens.weight is model.lm_head.weight  # one tensor, both modules
    assert report.quantized == 15  # 14 linears + one table
    assert model.config.tie_word_embeddings is True


def test_one_sided_tie_keeps_the_other_side_float(llama: Any) -> None:
    model = llama(tied=True)
    table = model.lm_head.weight.detach().clone()
    quantize(model, group_size=32, embeds=True)  # the head's flag is off
    assert isinstance(model.model.embed_tokens.weight, QuantTensor)
    assert not isinstance(model.lm_head.weight, QuantTensor)
    assert torch.equal(model.lm_head.weight, table)
    assert model.config.tie_word_embeddings is False  # so a reload does not re-tie it

    model = llama(tied=True)
    quantize(model, group_size=32, lm_head=True, embeds=True, modules_to_not_convert=["embed_tokens"])
    assert isinstance(model.lm_head.weight, QuantTensor)
    assert torch.equal(model.model.embed_tokens.weight, table)


def test_incompatible_tied_layouts_are_rejected_before_any_work(llama: Any) -> None:
    model = llama(tied=True)
    before = {n: id(p) for n, p in model.named_parameters()}
    with pytest.raises(QuantizationError) as info:
        quantize(model, group_size=32, lm_head=True, embeds=True,
                 overrides={"model.embed_tokens": {"bits": 8}, "lm_head": {"bits": 4}})
    message = str(info.value)
    assert "tied weight model.embed_tokens.weight" in message and "one layout" in message
    assert "8 bits" in message and "4 bits" in message
    assert {n: id(p) for n, p in model.named_parameters()} == before  # nothing was touched
    assert not quantized_names(model)


def test_tied_table_group_size_is_fitted_to_its_width(llama: Any) -> None:
    model = llama(tied=True, hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    plan = hfq.plan(model, RtnHfPass.from_config({"lm_head": True, "embeds": True, "group_size": 32}).options.rules())
    job = next(j for j in plan.jobs if j.name == "model.embed_tokens.weight")
    assert job.settings.group_size == 16 and "group_size 32 -> 16" in plan.notes[job.name]


def test_kquant_float_zero_points_only_where_the_export_takes_them(llama: Any) -> None:
    model = llama(tied=True)
    quantize(model, KQuantHfPass, lm_head=True, embeds=True)
    assert model.model.layers[0].mlp.up_proj.weight.spec.zero_points == "float"
    assert model.lm_head.weight.spec.zero_points == "uint8"  # the table is also read by a Gather
    model = llama(tied=False)
    quantize(model, KQuantHfPass, bits=8)
    assert model.model.layers[0].mlp.up_proj.weight.spec.zero_points == "uint8"


def test_rtn_after_kquant_covers_what_kquant_skipped(llama: Any) -> None:
    model = llama(tied=True)
    quantize(model, KQuantHfPass)
    first = {n: p for n, p in model.named_parameters() if isinstance(p, QuantTensor)}
    assert len(first) == 14 and not isinstance(model.lm_head.weight, QuantTensor)
    report = quantize(model, RtnHfPass, group_size=32, lm_head=True, embeds=True)
    assert report.quantized == 1  # only the tied table
    assert all(report.skipped[n] == "already quantized (left as it is)" for n in first)
    for n, p in model.named_parameters():
        if n in first:
            assert p is first[n] and p.spec.zero_points == "float"  # KQuant's tensors, untouched
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.spec.zero_points == "none"  # RTN's symmetric table
    assert quantize(model, RtnHfPass, lm_head=True, embeds=True).quantized == 0


def test_quantized_parameters_refuse_in_place_writes(llama: Any) -> None:
    model = llama(tied=False)
    quantize(model, group_size=32)
    with pytest.raises(RuntimeError, match="cannot copy into a quantized parameter"), torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.copy_(torch.zeros(128, 64))


def test_tiny_tables_stay_float_in_encoders() -> None:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                 intermediate_size=128, max_position_embeddings=128)).eval()
    report = quantize(model, group_size=32, embeds=True)
    names = quantized_names(model)
    assert {"embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight"} <= names
    assert "embeddings.token_type_embeddings.weight" not in names  # 2 rows
    assert "2 rows" in report.skipped["embeddings.token_type_embeddings.weight"]
    assert "pooler.dense.weight" in names
