"""llama.cpp's Q4_K_M mixture, mapped onto the names ONNX exporters give MatMul weights.

Q4_K_M quantizes most tensors to Q4_K and gives Q6_K (here: 8 bits, the next width the ONNX
writers take) to three kinds of tensor (llama.cpp ``src/llama-quant.cpp``,
``llama_tensor_get_type_impl``):

* the output head (``output.weight``; with tied embeddings, the token embedding instead);
* attention-value-like tensors (``attn_v``, and, through ``category_is_attn_v``, fused
  ``attn_qkv`` and MLA's ``attn_kv_b``) in the layers ``use_more_bits`` picks;
* ``ffn_down`` in the layers ``use_more_bits`` picks (the same rule; Falcon's variant is not
  modelled).

``use_more_bits(i, n)`` is ``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2`` in integer
arithmetic: the first and last eighth of the stack and every third layer in between.

Fused QKV: current llama.cpp counts ``attn_qkv`` as attention-value-like, so a fused
projection is widened in exactly the layers a separate ``v_proj`` would be, and that is
what this recipe does. (Before the tensor-category refactor llama.cpp gave ``attn_qkv``
Q5_K in every layer instead; 5 bits has no ONNX counterpart here.)

Names recognised (node names and initializer names alike; ``/`` and ``.`` both separate):

* torch.onnx (TorchScript exporter): ``/model/layers.3/self_attn/v_proj/MatMul``,
  ``/model/layers.3/mlp/down_proj/MatMul``, ``/lm_head/MatMul``; initializers such as
  ``model.layers.3.self_attn.v_proj.weight``. Underscore-flattened names from the dynamo
  exporter (``model_layers_3_self_attn_v_proj``) match too.
* ONNX Runtime GenAI model builder: ``/model/layers.3/attn/v_proj/MatMul`` (or fused
  ``/model/layers.3/attn/qkv_proj/MatMul``), ``/model/layers.3/mlp/down_proj/MatMul``,
  ``/lm_head/MatMul``; initializers ``model.layers.3.attn.v_proj.MatMul.weight``.
* mobius (onnxscript ``nn`` modules): parameters keep the Hugging Face names
  (``model.layers.3.self_attn.v_proj.weight``, ``lm_head.weight``) and node names are the
  module scopes joined by ``/`` plus ``<Op>_node_<n>``
  (``model/layers.3/self_attn/v_proj/MatMul_node_12``). Read from onnxscript's
  ``GraphBuilder`` naming, not from an exported model.
* Other common spellings: fused ``query_key_value`` / ``c_attn`` / ``qkv`` / ``Wqkv``,
  ``kv_b_proj``; FFN-down ``dense_4h_to_h``, ``fc2``, and ``c_proj`` / ``w2`` / ``fc_out``
  under ``mlp`` / ``feed_forward`` / ``experts.<n>``; heads ``embed_out``, ``output_layer``;
  GGUF names (``blk.3.attn_v.weight``, ``blk.3.ffn_down.weight``, ``output.weight``).
  Layer containers: ``layers``, ``layer``, ``h``, ``blocks``, ``block``, ``blk``.

The layer count is the largest layer index seen plus one (all names count, recognised or
not); llama.cpp counts ``attn_v`` tensors and the model's ``n_layer``, which agree for
models whose every layer has attention. Encoder-decoder models share one count across both
stacks. Encoders without a head (BERT and the like) simply match nothing but their FFN-down
and value tensors, if their names are among the above.
"""

from __future__ import annotations

import re

__all__ = ["HIGH_BITS", "is_head", "q4_k_m_overrides", "use_more_bits"]

HIGH_BITS = 8  # llama.cpp's Q6_K; MatMulNBits takes 4 or 8

# A name component starts after a separator (or the start) and ends before one (or the end).
_B = r"(?:^|[./_])"
_E = r"(?=[./_]|$)"
_LAYER = re.compile(_B + r"(?:layers|layer|h|blocks|block|blk)[./_](\d+)" + _E, re.IGNORECASE)
_ATTN_V = re.compile(
    _B
    + r"(?:v_proj|qkv_proj|query_key_value|c_attn|w?qkv|kv_b_proj|attn_v|attn_qkv|attn_kv_b)"
    + _E,
    re.IGNORECASE,
)
_FFN_DOWN = re.compile(
    _B
    + r"(?:down_proj|dense_4h_to_h|fc2|ffn_down(?:_exps|_shexp)?"
    + r"|(?:mlp|feed_forward|ffn|experts[./_]\d+)[./_](?:c_proj|w2|fc_out))"
    + _E,
    re.IGNORECASE,
)
_HEAD = re.compile(_B + r"(?:lm_head|embed_out|output_layer)" + _E, re.IGNORECASE)
_EMBED = re.compile(
    _B + r"(?:embed_tokens|wte|word_embeddings|tok_embeddings|token_embd|embed_in)" + _E,
    re.IGNORECASE,
)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule: first and last eighth of the layers, and every third one between."""
    eighth = n_layers // 8
    return i_layer < eighth or i_layer >= 7 * n_layers // 8 or (i_layer - eighth) % 3 == 2


def _layer_index(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def is_head(name: str) -> bool:
    """Whether ``name`` is the output head (``lm_head``, ``output.weight``, ...)."""
    return name.lstrip("/") == "output.weight" or _HEAD.search(name) is not None


_is_head = is_head


def q4_k_m_overrides(names: list[str], n_layers: int | None = None) -> dict[str, int]:
    """The names among ``names`` that Q4_K_M widens, each mapped to :data:`HIGH_BITS`.

    ``names`` are MatMul node names and/or weight initializer names from one model.
    Names left out of the result keep the default width (4 bits), unrecognised ones
    included. ``n_layers`` overrides the layer count inferred from the names.
    """
    layers = {name: _layer_index(name) for name in names}
    if n_layers is None:
        seen = [i for i in layers.values() if i is not None]
        n_layers = max(seen) + 1 if seen else 0
    # llama.cpp gives a tied token embedding the head's type; tied means no head tensor.
    tied = not any(_is_head(n) for n, i in layers.items() if i is None)

    out: dict[str, int] = {}
    for name, i in layers.items():
        if i is None:
            if _is_head(name) or (tied and _EMBED.search(name)):
                out[name] = HIGH_BITS
        elif (_ATTN_V.search(name) or _FFN_DOWN.search(name)) and use_more_bits(i, n_layers):
            out[name] = HIGH_BITS
    return out
