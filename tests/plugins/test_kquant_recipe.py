"""The Q4_K_M recipe: llama.cpp's use_more_bits layers, found in each exporter's names."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bitpress_kquant.recipe import HIGH_BITS, q4_k_m_overrides, use_more_bits

# llama.cpp (src/llama-quant.cpp): i < n/8 || i >= 7*n/8 || (i - n/8) % 3 == 2, integer math.
# Worked by hand: n=4 -> n/8 = 0, 7n/8 = 3; n=24 -> 3, 21; n=32 -> 4, 28.
PICKED = {
    4: [2, 3],
    24: [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23],
    32: [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31],
}


@pytest.mark.parametrize("n", sorted(PICKED))
def test_use_more_bits_matches_llama_cpp(n: int) -> None:
    assert [i for i in range(n) if use_more_bits(i, n)] == PICKED[n]


def _torch(i: int) -> dict[str, list[str]]:
    p = f"/model/layers.{i}"
    return {
        "v": [f"{p}/self_attn/v_proj/MatMul"],
        "down": [f"{p}/mlp/down_proj/MatMul"],
        "other": [
            f"{p}/self_attn/q_proj/MatMul",
            f"{p}/self_attn/k_proj/MatMul",
            f"{p}/self_attn/o_proj/MatMul",
            f"{p}/mlp/gate_proj/MatMul",
            f"{p}/mlp/up_proj/MatMul",
            f"{p}/self_attn/MatMul",  # the attention scores, no weight
        ],
    }


def _torch_init(i: int) -> dict[str, list[str]]:
    p = f"model.layers.{i}"
    return {
        "v": [f"{p}.self_attn.v_proj.weight"],
        "down": [f"{p}.mlp.down_proj.weight"],
        "other": [f"{p}.self_attn.{x}_proj.weight" for x in "qko"]
        + [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up")]
        + [f"{p}.input_layernorm.weight"],
    }


def _torch_dynamo(i: int) -> dict[str, list[str]]:
    # The dynamo exporter flattens module paths with underscores.
    p = f"model_layers_{i}"
    return {
        "v": [f"{p}_self_attn_v_proj_weight"],
        "down": [f"{p}_mlp_down_proj_weight"],
        "other": [f"{p}_self_attn_q_proj_weight", f"{p}_mlp_up_proj_weight"],
    }


def _genai(i: int) -> dict[str, list[str]]:
    p = f"/model/layers.{i}"
    return {
        "v": [f"{p}/attn/v_proj/MatMul", f"model.layers.{i}.attn.v_proj.MatMul.weight"],
        "down": [f"{p}/mlp/down_proj/MatMul", f"model.layers.{i}.mlp.down_proj.MatMul.weight"],
        "other": [f"{p}/attn/{x}_proj/MatMul" for x in "qko"]
        + [f"{p}/mlp/gate_proj/MatMul", f"{p}/mlp/up_proj/MatMul"],
    }


def _genai_fused(i: int) -> dict[str, list[str]]:
    # Packed QKV counts as attention-value-like, as in current llama.cpp (attn_qkv).
    p = f"/model/layers.{i}"
    return {
        "v": [f"{p}/attn/qkv_proj/MatMul"],
        "down": [f"{p}/mlp/down_proj/MatMul"],
        "other": [f"{p}/attn/o_proj/MatMul", f"{p}/mlp/gate_up_proj/MatMul"],
    }


def _mobius(i: int) -> dict[str, list[str]]:
    # onnxscript GraphBuilder: scopes joined by "/", then "<Op>_node_<count>".
    p = f"model/layers.{i}"
    return {
        "v": [f"{p}/self_attn/v_proj/MatMul_node_{40 * i + 7}"],
        "down": [f"{p}/mlp/down_proj/MatMul_node_{40 * i + 31}"],
        "other": [f"{p}/self_attn/q_proj/MatMul_node_{40 * i + 3}", f"{p}/mlp/up_proj/MatMul"],
    }


def _gguf(i: int) -> dict[str, list[str]]:
    p = f"blk.{i}"
    return {
        "v": [f"{p}.attn_v.weight"],
        "down": [f"{p}.ffn_down.weight"],
        "other": [f"{p}.attn_q.weight", f"{p}.attn_output.weight", f"{p}.ffn_up.weight"],
    }


def _gpt2(i: int) -> dict[str, list[str]]:
    p = f"/transformer/h.{i}"
    return {
        "v": [f"{p}/attn/c_attn/MatMul"],
        "down": [f"{p}/mlp/c_proj/MatMul"],
        "other": [f"{p}/attn/c_proj/MatMul", f"{p}/mlp/c_fc/MatMul"],
    }


STYLES: dict[str, tuple[Callable[[int], dict[str, list[str]]], list[str], list[str]]] = {
    # style: (per-layer names, heads, other unlayered names)
    "torch": (_torch, ["/lm_head/MatMul"], ["/model/embed_tokens/Gather"]),
    "torch-init": (_torch_init, ["lm_head.weight"], ["model.embed_tokens.weight"]),
    "torch-dynamo": (_torch_dynamo, ["lm_head_weight"], ["model_norm_weight"]),
    "genai": (_genai, ["/lm_head/MatMul", "lm_head.MatMul.weight"], []),
    "genai-fused": (_genai_fused, ["/lm_head/MatMul"], []),
    "mobius": (_mobius, ["lm_head/MatMul_node_999", "lm_head.weight"], []),
    "gguf": (_gguf, ["output.weight"], ["token_embd.weight", "output_norm.weight"]),
    "gpt2": (_gpt2, ["/lm_head/MatMul"], ["transformer.wte.weight"]),
}


@pytest.mark.parametrize("n", sorted(PICKED))
@pytest.mark.parametrize("style", list(STYLES))
def test_exporter_names(style: str, n: int) -> None:
    per_layer, heads, others = STYLES[style]
    names = [*others]
    expected = set(heads)
    for i in range(n):
        groups = per_layer(i)
        names += groups["v"] + groups["down"] + groups["other"]
        if i in PICKED[n]:
            expected |= set(groups["v"] + groups["down"])
    names += heads
    out = q4_k_m_overrides(names)
    assert set(out) == expected
    assert set(out.values()) == {HIGH_BITS}


def test_layer_count_from_max_index() -> None:
    # Only a few layers' names given: the count still comes from the largest index (31 -> 32).
    names = [f"/model/layers.{i}/self_attn/v_proj/MatMul" for i in (0, 5, 6, 27, 31)]
    picked = {int(n.split("/")[2].split(".")[1]) for n in q4_k_m_overrides(names)}
    assert picked == {0, 6, 27, 31}
    # An explicit count wins over the inferred one.
    picked = {int(n.split("/")[2].split(".")[1]) for n in q4_k_m_overrides(names, n_layers=48)}
    assert picked == {i for i in (0, 5, 6, 27, 31) if use_more_bits(i, 48)}


def test_tied_embedding_takes_the_head_bits() -> None:
    # llama.cpp: with no separate output tensor, the token embedding gets the head's type.
    body = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(8)]
    tied = q4_k_m_overrides([*body, "model.embed_tokens.weight"])
    assert tied == {"model.embed_tokens.weight": HIGH_BITS}
    untied = q4_k_m_overrides([*body, "model.embed_tokens.weight", "lm_head.weight"])
    assert untied == {"lm_head.weight": HIGH_BITS}


def test_bert_like_names_get_nothing() -> None:
    names = [
        f"/bert/encoder/layer.{i}/{part}/MatMul"
        for i in range(12)
        for part in (
            "attention/self/query",
            "attention/self/key",
            "attention/self/value",
            "attention/output/dense",
            "intermediate/dense",
            "output/dense",
        )
    ] + ["/pooler/dense/MatMul", "/classifier/MatMul"]
    assert q4_k_m_overrides(names) == {}


def test_unrecognised_and_edge_names() -> None:
    names = [
        "/model/layers.3/self_attn/o_proj/MatMul",  # attn_output stays Q4_K in Q4_K_M
        "/model/layers.3/mlp/gate_up_proj/MatMul",
        "/model/layers.3/self_attn/MatMul_1",
        "/model/layers.3/attn/o_proj/MatMul/output_0",  # a value, not a head
        "/model/norm/Mul",
        "MatMul_123",
        "onnx::MatMul_4567",
        "",
    ]
    assert q4_k_m_overrides(names) == {}
    assert q4_k_m_overrides([]) == {}


def test_other_spellings() -> None:
    names = [
        "transformer.h.0.self_attention.query_key_value.weight",  # Falcon / BLOOM
        "gpt_neox.layers.0.mlp.dense_4h_to_h.weight",
        "model.layers.0.mlp.fc2.weight",  # phi-2
        "layers.0.feed_forward.w2.weight",  # Meta's Llama
        "model.layers.0.block_sparse_moe.experts.3.w2.weight",  # Mixtral experts
        "model.layers.0.self_attn.kv_b_proj.weight",  # DeepSeek MLA (llama.cpp attn_kv_b)
        "transformer.blocks.0.attn.Wqkv.weight",  # MPT
        "gpt_neox.embed_out.weight",
        "transformer.output_layer.weight",  # ChatGLM
        # layer 1 of 8 is in the first eighth only for n >= 16: not picked here.
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.7.self_attn.o_proj.weight",
    ]
    out = q4_k_m_overrides(names)
    assert set(out) == set(names[:9])
