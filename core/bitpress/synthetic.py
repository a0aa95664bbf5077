"""Random-weight transformer ONNX models built with ``onnx.helper`` and numpy only.

Used by the test suite, ``bitpress demo`` and the benchmarks. The graphs mimic what
``torch.onnx.export`` produces for Hugging Face models (node and initializer names, MatMul
weights stored ``[in, out]``, decomposed RMSNorm, Erf GELU), pass ``onnx.checker`` and run
on ONNX Runtime's CPU provider in float32 and float16.

Weights are generated chunk by chunk from a seed derived from ``(seed, tensor name, chunk)``,
so a tensor's values do not depend on the model layout, on other tensors, or on whether the
model is stored inline or with external data. Each chunk is written as soon as it is
generated (to ``<model>.onnx.data`` with ``external_data=True``, else appended to the
serialized model as a protobuf field), so even multi-GB models build with a peak memory of
a few chunks. ``python -m bitpress.synthetic decoder out.onnx --preset bench-4gb`` builds
one from the shell.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "PRESETS",
    "build_decoder",
    "build_encoder",
    "build_genai_folder",
    "build_preset",
    "random_inputs",
]

OPSET = 21  # decomposed RMSNorm keeps to ops every ORT >= 1.20 runs
IR_VERSION = 10  # the lowest IR that carries opset 21
BATCH = "batch_size"  # dim names torch.onnx.export uses for HF models
SEQ = "sequence_length"

_CHUNK = 1 << 20  # elements per generated chunk; fixed so values never depend on it
_EXTERNAL_MIN_BYTES = 1024  # onnx's own size_threshold: smaller tensors stay inline
_PROTOBUF_LIMIT = 2**31 - 1

_DTYPES: dict[str, tuple[type[np.floating], int]] = {
    "float32": (np.float32, TensorProto.FLOAT),
    "float16": (np.float16, TensorProto.FLOAT16),
}

# kwargs for build_decoder (see build_preset); sizes are the fp32 files as built.
PRESETS: dict[str, dict[str, Any]] = {
    # 465,125 bytes; what `bitpress demo` and most tests use
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256},
    # 447,298,376 bytes: Llama-3-like layout (GQA 16/4 heads, untied head), one file
    "bench-447mb": {
        "hidden": 1024, "layers": 4, "heads": 16, "kv_heads": 4, "intermediate": 2912,
        "vocab": 32000, "tied": False,
    },
    # 52,123 + 4,572,463,104 bytes (.onnx + .data; > 4 GiB, so offsets overflow 32 bits):
    # Llama-2-7B shapes, 5 layers, tied head
    "bench-4gb": {
        "hidden": 4096, "layers": 5, "heads": 32, "intermediate": 11008, "vocab": 32000,
        "tied": True, "external_data": True,
    },
}


# ---------------------------------------------------------------------------------------------
# weights: specs collected while the graph is built, generated afterwards


@dataclass(frozen=True)
class _WeightSpec:
    name: str
    shape: tuple[int, ...]
    std: float
    mean: float
    np_dtype: type[np.floating]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.np_dtype).itemsize


def _gen_chunk(seed: int, spec: _WeightSpec, index: int) -> np.ndarray:
    """Chunk ``index`` of a weight; SFC64 + float32 normals are the fastest numpy offers."""
    key = zlib.crc32(spec.name.encode())
    rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, key, index])))
    count = min(_CHUNK, spec.size - index * _CHUNK)
    out = rng.standard_normal(count, dtype=np.float32)
    out *= np.float32(spec.std)
    if spec.mean:
        out += np.float32(spec.mean)
    # ONNX raw data is little-endian whatever the host is
    return out.astype(np.dtype(spec.np_dtype).newbyteorder("<"), copy=False)


def _iter_chunks(
    pool: ThreadPoolExecutor, seed: int, spec: _WeightSpec, window: int
) -> Iterator[np.ndarray]:
    """A weight's chunks in order, at most ``window`` generated ahead (bounds memory)."""
    n_chunks = max(1, -(-spec.size // _CHUNK))
    pending: deque[Future[np.ndarray]] = deque()
    for i in range(n_chunks):
        pending.append(pool.submit(_gen_chunk, seed, spec, i))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _align(offset: int, nbytes: int) -> int:
    # like onnx's writer: big tensors start on 64 KiB so ORT can mmap them
    granule = 65536 if nbytes >= 1 << 20 else 64
    return -(-offset // granule) * granule


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_header(message: Any, field_name: str, length: int) -> bytes:
    """Tag + length of a length-delimited protobuf field, its payload written separately."""
    number = message.DESCRIPTOR.fields_by_name[field_name].number
    return _varint(number << 3 | 2) + _varint(length)


def _initializer_header(tensor: TensorProto, payload: int) -> bytes:
    """Bytes that, appended to a serialized ModelProto, add ``tensor`` to its initializers.

    Protobuf merges a repeated occurrence of a message field (``ModelProto.graph``) into the
    first one and concatenates repeated fields (``GraphProto.initializer``), so each weight
    can be appended after the graph is written. ``payload`` bytes (the raw data, already
    framed by the caller) follow the returned header.
    """
    body = tensor.SerializeToString()
    tensor_len = len(body) + payload
    graph_part = _field_header(onnx.GraphProto(), "initializer", tensor_len)
    graph_len = len(graph_part) + tensor_len
    return _field_header(onnx.ModelProto(), "graph", graph_len) + graph_part + body


def _write_weights(
    model_file: BinaryIO, specs: Sequence[_WeightSpec], seed: int, data_path: Path | None
) -> None:
    """Append every weight to ``model_file`` (after the serialized model), chunk by chunk.

    With ``data_path``, tensors of 1 KiB and more go to that file and only their references
    to the model; either way no more than a few chunks are in memory at once.
    """
    # numpy's generators release the GIL; beyond ~4 threads the disk is the bottleneck
    workers = min(4, os.cpu_count() or 1)
    data: BinaryIO | None = data_path.open("wb") if data_path is not None else None
    try:
        with ThreadPoolExecutor(workers) as pool:
            offset = 0
            for spec in specs:
                t = TensorProto(name=spec.name, dims=spec.shape)
                t.data_type = _DTYPES[np.dtype(spec.np_dtype).name][1]
                if data is None or spec.nbytes < _EXTERNAL_MIN_BYTES:
                    raw = _field_header(t, "raw_data", spec.nbytes)
                    model_file.write(_initializer_header(t, len(raw) + spec.nbytes) + raw)
                    out = model_file
                else:
                    assert data_path is not None
                    start = _align(offset, spec.nbytes)
                    data.write(b"\0" * (start - offset))
                    offset = start + spec.nbytes
                    t.data_location = TensorProto.EXTERNAL
                    # relative location: the model keeps working when its folder moves
                    for key, value in (("location", data_path.name), ("offset", start),
                                       ("length", spec.nbytes)):
                        t.external_data.add(key=key, value=str(value))
                    model_file.write(_initializer_header(t, 0))
                    out = data
                for chunk in _iter_chunks(pool, seed, spec, workers + 1):
                    out.write(memoryview(chunk).cast("B"))
    finally:
        if data is not None:
            data.close()


# ---------------------------------------------------------------------------------------------
# graph building


@dataclass
class _Graph:
    """Nodes named like torch.onnx exports: ``{scope}/{Op}``, then ``{scope}/{Op}_1``..."""

    dtype: str
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    weights: list[_WeightSpec] = field(default_factory=list)
    consts: dict[tuple, TensorProto] = field(default_factory=dict)
    _names: Counter[str] = field(default_factory=Counter)

    @property
    def np_dtype(self) -> type[np.floating]:
        return _DTYPES[self.dtype][0]

    @property
    def onnx_dtype(self) -> int:
        return _DTYPES[self.dtype][1]

    def op(self, op_type: str, inputs: Sequence[str], scope: str, **attrs: Any) -> str:
        return self.op_n(op_type, inputs, scope, 1, **attrs)[0]

    def op_n(
        self, op_type: str, inputs: Sequence[str], scope: str, n_out: int, **attrs: Any
    ) -> list[str]:
        base = f"{scope}/{op_type}"
        k = self._names[base]
        self._names[base] += 1
        name = base if k == 0 else f"{base}_{k}"
        outs = [f"{name}_output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs

    def weight(
        self, name: str, shape: Sequence[int], std: float, mean: float = 0.0,
        np_dtype: type[np.floating] | None = None,
    ) -> str:
        self.weights.append(
            _WeightSpec(name, tuple(int(s) for s in shape), std, mean, np_dtype or self.np_dtype)
        )
        return name

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        """A small constant initializer, shared by every node that needs the same value."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self.consts:
            name = f"/Constant_{len(self.consts)}_output_0"
            self.consts[key] = numpy_helper.from_array(arr, name)
        return self.consts[key].name

    def fconst(self, value: float | Sequence[float]) -> str:
        return self.const(value, self.np_dtype)

    def to_float(self, x: str, scope: str) -> str:
        """Upcast to float32 where HF computes in float32 (norms, softmax); no-op in fp32."""
        return x if self.dtype == "float32" else self.op("Cast", [x], scope, to=TensorProto.FLOAT)

    def from_float(self, x: str, scope: str) -> str:
        return x if self.dtype == "float32" else self.op("Cast", [x], scope, to=self.onnx_dtype)

    def linear(self, x: str, scope: str, w_name: str, n_in: int, n_out: int) -> str:
        """MatMul with an ``[in, out]`` weight, as torch exports ``nn.Linear`` on 3-D input."""
        w = self.weight(w_name, (n_in, n_out), 0.02)
        return self.op("MatMul", [x, w], scope)

    def model(
        self, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
        name: str, meta: dict[str, Any], seed: int, path: Path, external_data: bool,
    ) -> Path:
        """Generate the weights, assemble the model and save it to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        total = sum(s.nbytes for s in self.weights)
        if not external_data and total > _PROTOBUF_LIMIT - (64 << 20):
            raise ValueError(
                f"{name}: {total / 1e9:.2f} GB of weights do not fit in one protobuf file; "
                "pass external_data=True"
            )
        data_path = path.with_name(path.name + ".data") if external_data else None
        graph = helper.make_graph(
            self.nodes, name, inputs, outputs, initializer=list(self.consts.values())
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            ir_version=IR_VERSION,
            producer_name="bitpress.synthetic",
        )
        helper.set_model_props(model, {"bitpress.synthetic": json.dumps(meta, sort_keys=True)})
        with path.open("wb") as f:
            f.write(model.SerializeToString())
            _write_weights(f, self.weights, seed, data_path)
        return path


def _rms_norm(g: _Graph, x: str, scope: str, w_name: str, hidden: int, eps: float) -> str:
    """LlamaRMSNorm as torch exports it: float32 Pow/ReduceMean/Add/Sqrt/Div, then weight."""
    h = g.to_float(x, scope)
    sq = g.op("Pow", [h, g.const(2.0, np.float32)], scope)
    var = g.op("ReduceMean", [sq, g.const([-1])], scope, keepdims=1)
    std = g.op("Sqrt", [g.op("Add", [var, g.const(eps, np.float32)], scope)], scope)
    normed = g.from_float(g.op("Div", [h, std], scope), scope)
    w = g.weight(w_name, (hidden,), 0.05, mean=1.0)
    return g.op("Mul", [w, normed], scope)


def _seq_len(g: _Graph, ref: str, scope: str) -> str:
    """The sequence length (dim 1 of ``ref``) as a 1-element int64 tensor."""
    return g.op("Shape", [ref], scope, start=1, end=2)


def _rotary(g: _Graph, ref: str, head_dim: int, theta: float) -> tuple[str, str]:
    """cos/sin ``[seq, head_dim]`` computed in float32 from positions 0..seq-1."""
    scope = "/model/rotary_emb"
    s = g.op("Squeeze", [_seq_len(g, ref, scope)], scope)
    pos = g.op("Range", [g.const(0), s, g.const(1)], scope)
    pos = g.op("Unsqueeze", [g.op("Cast", [pos], scope, to=TensorProto.FLOAT), g.const([1])], scope)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = g.op("Mul", [pos, g.const(inv_freq, np.float32)], scope)
    emb = g.op("Concat", [freqs, freqs], scope, axis=-1)
    cos = g.from_float(g.op("Cos", [emb], scope), scope)
    sin = g.from_float(g.op("Sin", [emb], scope), scope)
    return cos, sin


def _apply_rotary(g: _Graph, x: str, cos: str, sin: str, scope: str, head_dim: int) -> str:
    """``x * cos + rotate_half(x) * sin`` on ``[B, heads, S, head_dim]``."""
    half = head_dim // 2
    x1, x2 = g.op_n("Split", [x, g.const([half, half])], scope, 2, axis=-1)
    rot = g.op("Concat", [g.op("Neg", [x2], scope), x1], scope, axis=-1)
    return g.op(
        "Add",
        [g.op("Mul", [x, cos], scope), g.op("Mul", [rot, sin], scope)],
        scope,
    )


def _split_heads(g: _Graph, x: str, scope: str, n_heads: int, head_dim: int) -> str:
    """``[B, S, n*d]`` -> ``[B, n, S, d]``."""
    x = g.op("Reshape", [x, g.const([0, 0, n_heads, head_dim])], scope)
    return g.op("Transpose", [x], scope, perm=[0, 2, 1, 3])


def _attention(
    g: _Graph, q: str, k: str, v: str, mask: str, scope: str, head_dim: int, hidden: int
) -> str:
    """Scaled dot product on ``[B, h, S, d]``; scores + additive mask + softmax in float32."""
    kt = g.op("Transpose", [k], scope, perm=[0, 1, 3, 2])
    scores = g.op("MatMul", [q, kt], scope)
    scores = g.op("Mul", [scores, g.fconst(1.0 / math.sqrt(head_dim))], scope)
    scores = g.op("Add", [g.to_float(scores, scope), mask], scope)
    probs = g.from_float(g.op("Softmax", [scores], scope, axis=-1), scope)
    ctx = g.op("MatMul", [probs, v], scope)
    ctx = g.op("Transpose", [ctx], scope, perm=[0, 2, 1, 3])
    return g.op("Reshape", [ctx, g.const([0, 0, hidden])], scope)


# ---------------------------------------------------------------------------------------------
# decoder


@dataclass(frozen=True)
class _DecoderConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    dtype: str
    head_via_transpose: bool
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _default_intermediate(hidden: int) -> int:
    return max(32, round(2.7 * hidden / 32) * 32)


def _decoder_config(
    hidden: int, layers: int, heads: int, kv_heads: int | None, intermediate: int | None,
    vocab: int, tied: bool, dtype: str, head_via_transpose: bool,
) -> _DecoderConfig:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    kv_heads = heads if kv_heads is None else kv_heads
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden}, heads={heads}, kv_heads={kv_heads} do not divide")
    if (hidden // heads) % 2:
        raise ValueError(f"head size {hidden // heads} must be even for rotary embeddings")
    return _DecoderConfig(
        hidden, layers, heads, kv_heads,
        _default_intermediate(hidden) if intermediate is None else intermediate,
        vocab, tied, dtype, head_via_transpose,
    )


def _causal_mask(g: _Graph, ref: str) -> str:
    """Additive float32 ``[S, S]`` mask: 0 on and below the diagonal, float32 min above."""
    scope = "/model"
    s = _seq_len(g, ref, scope)
    square = g.op("Concat", [s, s], scope, axis=0)
    fill = helper.make_tensor("value", TensorProto.FLOAT, [1], [float(np.finfo(np.float32).min)])
    full = g.op("ConstantOfShape", [square], scope, value=fill)
    return g.op("Trilu", [full, g.const(1)], scope, upper=1)


def _decoder_layer(
    g: _Graph, cfg: _DecoderConfig, i: int, x: str, cos: str, sin: str, mask: str
) -> str:
    pre, scope = f"model.layers.{i}", f"/model/layers.{i}"
    d, h, kvh = cfg.head_dim, cfg.heads, cfg.kv_heads
    attn = f"{scope}/self_attn"

    n = _rms_norm(g, x, f"{scope}/input_layernorm", f"{pre}.input_layernorm.weight",
                  cfg.hidden, cfg.eps)
    q = g.linear(n, f"{attn}/q_proj", f"{pre}.self_attn.q_proj.weight", cfg.hidden, h * d)
    k = g.linear(n, f"{attn}/k_proj", f"{pre}.self_attn.k_proj.weight", cfg.hidden, kvh * d)
    v = g.linear(n, f"{attn}/v_proj", f"{pre}.self_attn.v_proj.weight", cfg.hidden, kvh * d)
    q = _apply_rotary(g, _split_heads(g, q, attn, h, d), cos, sin, attn, d)
    k = _apply_rotary(g, _split_heads(g, k, attn, kvh, d), cos, sin, attn, d)
    v = _split_heads(g, v, attn, kvh, d)
    if kvh != h:  # repeat_kv: [B, kvh, S, d] -> [B, kvh, rep, S, d] -> [B, h, S, d]
        rep = g.const([1, 1, h // kvh, 1, 1])
        k, v = (
            g.op("Reshape", [
                g.op("Expand", [g.op("Unsqueeze", [t, g.const([2])], attn), rep], attn),
                g.const([0, h, -1, d]),
            ], attn)
            for t in (k, v)
        )
    ctx = _attention(g, q, k, v, mask, attn, d, h * d)
    o = g.linear(ctx, f"{attn}/o_proj", f"{pre}.self_attn.o_proj.weight", h * d, cfg.hidden)
    x = g.op("Add", [x, o], scope)

    n = _rms_norm(g, x, f"{scope}/post_attention_layernorm",
                  f"{pre}.post_attention_layernorm.weight", cfg.hidden, cfg.eps)
    mlp = f"{scope}/mlp"
    gate = g.linear(n, f"{mlp}/gate_proj", f"{pre}.mlp.gate_proj.weight",
                    cfg.hidden, cfg.intermediate)
    up = g.linear(n, f"{mlp}/up_proj", f"{pre}.mlp.up_proj.weight", cfg.hidden, cfg.intermediate)
    act = f"{mlp}/act_fn"
    silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], act)], act)
    down = g.linear(g.op("Mul", [silu, up], mlp), f"{mlp}/down_proj",
                    f"{pre}.mlp.down_proj.weight", cfg.intermediate, cfg.hidden)
    return g.op("Add", [x, down], scope)


def _embed(g: _Graph, cfg: _DecoderConfig, ids: str) -> str:
    table = g.weight("model.embed_tokens.weight", (cfg.vocab, cfg.hidden),
                     1.0 / math.sqrt(cfg.hidden))
    return g.op("Gather", [table, ids], "/model/embed_tokens")


def _lm_head(g: _Graph, cfg: _DecoderConfig, x: str, ids_or_embeds: str) -> str:
    """Logits ``[B, S, vocab]`` in one of three layouts (see ``build_decoder``)."""
    scope = "/lm_head"
    table = "model.embed_tokens.weight"
    if not cfg.tied:
        w = g.weight("lm_head.weight", (cfg.hidden, cfg.vocab), 1.0 / math.sqrt(cfg.hidden))
        return g.op("MatMul", [x, w], scope)
    if cfg.head_via_transpose:
        wt = g.op("Transpose", [table], scope, perm=[1, 0])
        return g.op("MatMul", [x, wt], scope)
    # Gemm wants 2-D A: [B*S, hidden] @ table[vocab, hidden]^T, then back to [B, S, vocab]
    flat = g.op("Reshape", [x, g.const([-1, cfg.hidden])], scope)
    logits = g.op("Gemm", [flat, table], scope, transB=1)
    bs = g.op("Shape", [ids_or_embeds], scope, start=0, end=2)
    out_shape = g.op("Concat", [bs, g.const([cfg.vocab])], scope, axis=0)
    return g.op("Reshape", [logits, out_shape], scope)


def _decoder_body(g: _Graph, cfg: _DecoderConfig, x: str, ref: str) -> str:
    """Layers, final norm and LM head from hidden states ``x``; ``ref`` is a [B, S, ...] input."""
    cos, sin = _rotary(g, ref, cfg.head_dim, cfg.rope_theta)
    mask = _causal_mask(g, ref)
    for i in range(cfg.layers):
        x = _decoder_layer(g, cfg, i, x, cos, sin, mask)
    x = _rms_norm(g, x, "/model/norm", "model.norm.weight", cfg.hidden, cfg.eps)
    return _lm_head(g, cfg, x, ref)


def _ids_input() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("input_ids", TensorProto.INT64, [BATCH, SEQ])


def _rename_output(g: _Graph, tensor: str, name: str) -> None:
    for node in g.nodes:
        node.output[:] = [name if o == tensor else o for o in node.output]


def build_decoder(
    path: str | os.PathLike[str],
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab: int = 256,
    tied: bool = True,
    dtype: str = "float32",
    seed: int = 0,
    external_data: bool = False,
    head_via_transpose: bool = True,
) -> Path:
    """A Llama-like causal LM: ``input_ids`` int64 ``[B, S]`` -> ``logits`` ``[B, S, vocab]``.

    Per layer: RMSNorm, q/k/v/o MatMuls (weights ``[in, out]``), rotary embeddings, causal
    attention (GQA when ``kv_heads < heads``), RMSNorm, SwiGLU MLP, residual adds.
    ``intermediate`` defaults to ~2.7 * hidden rounded to 32; any size is accepted.

    LM head layouts (the embedding table ``model.embed_tokens.weight`` is ``[vocab, hidden]``):

    * ``tied`` and ``head_via_transpose``: ``/lm_head/Transpose`` of the table ->
      ``[hidden, vocab]`` feeding ``/lm_head/MatMul``.
    * ``tied`` without it: ``/lm_head/Gemm`` (``transB=1``) reads the ``[vocab, hidden]`` table
      itself, on activations reshaped to ``[B*S, hidden]``.
    * not ``tied``: a separate ``lm_head.weight`` ``[hidden, vocab]`` and ``/lm_head/MatMul``.

    ``dtype="float16"`` stores weights, activations and ``logits`` in fp16 (norms and softmax
    upcast to fp32 as HF does). ``external_data`` streams weights into ``<name>.onnx.data``.
    """
    cfg = _decoder_config(hidden, layers, heads, kv_heads, intermediate, vocab, tied, dtype,
                          head_via_transpose)
    g = _Graph(dtype)
    x = _embed(g, cfg, "input_ids")
    _rename_output(g, _decoder_body(g, cfg, x, "input_ids"), "logits")
    out = helper.make_tensor_value_info("logits", g.onnx_dtype, [BATCH, SEQ, vocab])
    meta = {"kind": "decoder", **cfg.__dict__, "seed": seed}
    return g.model([_ids_input()], [out], "decoder", meta, seed, Path(path), external_data)


def build_preset(name: str, path: str | os.PathLike[str], **overrides: Any) -> Path:
    """``build_decoder`` with ``PRESETS[name]``; keyword arguments override the preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return build_decoder(path, **{**PRESETS[name], **overrides})


# ---------------------------------------------------------------------------------------------
# encoder


def _layer_norm(g: _Graph, x: str, scope: str, prefix: str, hidden: int) -> str:
    w = g.weight(f"{prefix}.weight", (hidden,), 0.05, mean=1.0)
    b = g.weight(f"{prefix}.bias", (hidden,), 0.02)
    return g.op("LayerNormalization", [x, w, b], scope, axis=-1, epsilon=1e-12)


def _dense_matmul(g: _Graph, x: str, scope: str, prefix: str, n_in: int, n_out: int) -> str:
    """torch's 3-D ``nn.Linear``: MatMul on an ``[in, out]`` weight, then Add bias."""
    y = g.linear(x, scope, f"{prefix}.weight", n_in, n_out)
    return g.op("Add", [g.weight(f"{prefix}.bias", (n_out,), 0.02), y], scope)


def _dense_gemm(
    g: _Graph, x: str, scope: str, prefix: str, n_in: int, n_out: int, bs: str
) -> str:
    """2-D ``nn.Linear``: Gemm(transB=1) on an ``[out, in]`` weight between two Reshapes."""
    w = g.weight(f"{prefix}.weight", (n_out, n_in), 0.02)
    b = g.weight(f"{prefix}.bias", (n_out,), 0.02)
    flat = g.op("Reshape", [x, g.const([-1, n_in])], scope)
    y = g.op("Gemm", [flat, w, b], scope, transB=1)
    shape = g.op("Concat", [bs, g.const([n_out])], scope, axis=0)
    return g.op("Reshape", [y, shape], scope)


def _gelu(g: _Graph, x: str, scope: str) -> str:
    """Exact GELU as torch exports it: x * 0.5 * (1 + erf(x / sqrt(2)))."""
    e = g.op("Erf", [g.op("Div", [x, g.fconst(math.sqrt(2.0))], scope)], scope)
    y = g.op("Mul", [x, g.op("Add", [e, g.fconst(1.0)], scope)], scope)
    return g.op("Mul", [y, g.fconst(0.5)], scope)


def build_encoder(
    path: str | os.PathLike[str],
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    intermediate: int | None = None,
    vocab: int = 512,
    dtype: str = "float32",
    seed: int = 0,
    external_data: bool = False,
    max_positions: int = 512,
) -> Path:
    """A BERT-like encoder: ``input_ids``, ``attention_mask`` -> ``last_hidden_state``.

    Word + position embeddings and LayerNorm, then per layer: query/key/value as MatMul + Add
    (``[in, out]`` weights), the attention output dense as Gemm(transB=1) on ``[out, in]``
    weights over ``[B*S, hidden]``, LayerNorm, intermediate MatMul, Erf GELU, output dense
    Gemm, LayerNorm. Both linear forms therefore appear in every layer.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not a multiple of heads={heads}")
    inter = 4 * hidden if intermediate is None else intermediate
    d = hidden // heads
    g = _Graph(dtype)

    scope = "/embeddings"
    words = g.weight("embeddings.word_embeddings.weight", (vocab, hidden), 0.02)
    x = g.op("Gather", [words, "input_ids"], f"{scope}/word_embeddings")
    s = g.op("Squeeze", [_seq_len(g, "input_ids", scope)], scope)
    pos_ids = g.op("Unsqueeze", [g.op("Range", [g.const(0), s, g.const(1)], scope),
                                 g.const([0])], scope)
    table = g.weight("embeddings.position_embeddings.weight", (max_positions, hidden), 0.02)
    x = g.op("Add", [x, g.op("Gather", [table, pos_ids], f"{scope}/position_embeddings")], scope)
    x = _layer_norm(g, x, f"{scope}/LayerNorm", "embeddings.LayerNorm", hidden)

    # [B, S] 1/0 mask -> additive float32 [B, 1, 1, S]
    m = g.op("Cast", [g.op("Unsqueeze", ["attention_mask", g.const([1, 2])], "")], "",
             to=TensorProto.FLOAT)
    m = g.op("Sub", [g.const(1.0, np.float32), m], "")
    mask = g.op("Mul", [m, g.const(np.finfo(np.float32).min, np.float32)], "")
    bs = g.op("Shape", ["input_ids"], "")

    for i in range(layers):
        pre, sc = f"encoder.layer.{i}", f"/encoder/layer.{i}"
        att = f"{sc}/attention/self"
        q, k, v = (
            _split_heads(g, _dense_matmul(g, x, f"{att}/{n}", f"{pre}.attention.self.{n}",
                                          hidden, hidden), att, heads, d)
            for n in ("query", "key", "value")
        )
        ctx = _attention(g, q, k, v, mask, att, d, hidden)
        o = _dense_gemm(g, ctx, f"{sc}/attention/output/dense",
                        f"{pre}.attention.output.dense", hidden, hidden, bs)
        x = g.op("Add", [o, x], f"{sc}/attention/output")
        x = _layer_norm(g, x, f"{sc}/attention/output/LayerNorm",
                        f"{pre}.attention.output.LayerNorm", hidden)
        h = _dense_matmul(g, x, f"{sc}/intermediate/dense", f"{pre}.intermediate.dense",
                          hidden, inter)
        h = _gelu(g, h, f"{sc}/intermediate/intermediate_act_fn")
        h = _dense_gemm(g, h, f"{sc}/output/dense", f"{pre}.output.dense", inter, hidden, bs)
        x = g.op("Add", [h, x], f"{sc}/output")
        x = _layer_norm(g, x, f"{sc}/output/LayerNorm", f"{pre}.output.LayerNorm", hidden)

    _rename_output(g, x, "last_hidden_state")
    inputs = [
        _ids_input(),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [BATCH, SEQ]),
    ]
    out = helper.make_tensor_value_info("last_hidden_state", g.onnx_dtype, [BATCH, SEQ, hidden])
    meta = {"kind": "encoder", "hidden": hidden, "layers": layers, "heads": heads,
            "intermediate": inter, "vocab": vocab, "dtype": dtype, "seed": seed}
    return g.model(inputs, [out], "encoder", meta, seed, Path(path), external_data)


# ---------------------------------------------------------------------------------------------
# ONNX Runtime GenAI package


def _tokenizer_files(vocab: int, context: int) -> dict[str, Any]:
    """A minimal Hugging Face fast tokenizer (WordLevel) with Llama-style special tokens."""
    specials = ["<unk>", "<s>", "</s>"]
    words = specials + [f"tok{i}" for i in range(len(specials), vocab)]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, t in enumerate(specials)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(words)},
                  "unk_token": "<unk>"},
    }
    special_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "pad_token": "</s>"}
    config = {**special_map, "add_bos_token": True, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": context,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config,
            "special_tokens_map.json": special_map}


def build_genai_folder(
    folder: str | os.PathLike[str],
    *,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 256,
    split_embedding: bool = False,
    seed: int = 0,
    heads: int | None = None,
    dtype: str = "float32",
) -> Path:
    """An ONNX Runtime GenAI-style package folder (not runnable by onnxruntime_genai: no KV cache).

    ``model.onnx`` (input_ids -> logits, tied head) + ``genai_config.json`` + tokenizer files,
    or with ``split_embedding`` ``embedding/model.onnx`` (input_ids -> inputs_embeds) and
    ``decoder/model.onnx`` (inputs_embeds -> logits, untied head). The config lists exactly the
    inputs and outputs the models have.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    heads = heads or (hidden // 16 if hidden % 16 == 0 else 1)
    cfg = _decoder_config(hidden, layers, heads, None, None, vocab, not split_embedding, dtype,
                          True)
    context = 2048
    dec: dict[str, Any] = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "head_size": cfg.head_dim,
        "hidden_size": hidden,
        "num_attention_heads": cfg.heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": cfg.kv_heads,
    }
    model_cfg: dict[str, Any] = {
        "bos_token_id": 1, "context_length": context, "eos_token_id": 2, "pad_token_id": 2,
        "type": "llama", "vocab_size": vocab, "decoder": dec,
    }
    meta = {"kind": "genai-decoder", **cfg.__dict__, "seed": seed}
    if split_embedding:
        g = _Graph(dtype)
        _rename_output(g, _embed(g, cfg, "input_ids"), "inputs_embeds")
        emb_out = helper.make_tensor_value_info("inputs_embeds", g.onnx_dtype,
                                                [BATCH, SEQ, hidden])
        g.model([_ids_input()], [emb_out], "embedding", {**meta, "kind": "genai-embedding"},
                seed, folder / "embedding" / "model.onnx", False)
        g = _Graph(dtype)
        _rename_output(g, _decoder_body(g, cfg, "inputs_embeds", "inputs_embeds"), "logits")
        dec_in = helper.make_tensor_value_info("inputs_embeds", g.onnx_dtype,
                                               [BATCH, SEQ, hidden])
        logits = helper.make_tensor_value_info("logits", g.onnx_dtype, [BATCH, SEQ, vocab])
        g.model([dec_in], [logits], "decoder", meta, seed, folder / "decoder" / "model.onnx",
                False)
        model_cfg["embedding"] = {
            "filename": "embedding/model.onnx",
            "inputs": {"input_ids": "input_ids"},
            "outputs": {"embeddings": "inputs_embeds"},
        }
        dec.update(filename="decoder/model.onnx", inputs={"inputs_embeds": "inputs_embeds"},
                   outputs={"logits": "logits"})
    else:
        g = _Graph(dtype)
        x = _embed(g, cfg, "input_ids")
        _rename_output(g, _decoder_body(g, cfg, x, "input_ids"), "logits")
        logits = helper.make_tensor_value_info("logits", g.onnx_dtype, [BATCH, SEQ, vocab])
        g.model([_ids_input()], [logits], "decoder", meta, seed, folder / "model.onnx", False)
        dec.update(filename="model.onnx", inputs={"input_ids": "input_ids"},
                   outputs={"logits": "logits"})
    genai = {
        "model": model_cfg,
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True,
            "length_penalty": 1.0, "max_length": context, "min_length": 0,
            "no_repeat_ngram_size": 0, "num_beams": 1, "num_return_sequences": 1,
            "past_present_share_buffer": False, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }
    (folder / "genai_config.json").write_text(json.dumps(genai, indent=4) + "\n")
    write_tokenizer(folder, vocab=vocab, context=context)
    return folder


def write_tokenizer(folder: str | os.PathLike[str], *, vocab: int = 256, context: int = 128) -> Path:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json of a minimal fast tokenizer
    (WordLevel, ``<unk>`` 0, ``<s>`` 1 added as BOS, ``</s>`` 2, ``tok3`` ...) in ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in _tokenizer_files(vocab, context).items():
        (folder / name).write_text(json.dumps(content, indent=4) + "\n")
    return folder / "tokenizer.json"


# ---------------------------------------------------------------------------------------------
# inputs


def _ids_range(model: onnx.ModelProto, input_name: str) -> int:
    """Rows of the table an ids input is gathered from (the vocab), else metadata, else 2."""
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[1] == input_name and node.input[0] in dims:
            return int(dims[node.input[0]][0])
    for prop in model.metadata_props:
        if prop.key == "bitpress.synthetic":
            return int(json.loads(prop.value).get("vocab", 2))
    return 2


def random_inputs(
    model_path: str | os.PathLike[str], *, batch: int = 1, seq: int = 8, seed: int = 0
) -> dict[str, np.ndarray]:
    """Feeds for every graph input: ids in ``[0, vocab)``, ones for masks, positions
    ``0..seq-1``, standard normal floats otherwise. Symbolic dims named like batch/sequence
    (or in positions 0/1) become ``batch``/``seq``."""
    model = onnx.load(str(model_path), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        ttype = inp.type.tensor_type
        np_dtype = helper.tensor_dtype_to_np_dtype(ttype.elem_type)
        shape = []
        for pos, dim in enumerate(ttype.shape.dim):
            if dim.HasField("dim_value"):
                shape.append(dim.dim_value)
            elif "batch" in dim.dim_param.lower():
                shape.append(batch)
            elif any(w in dim.dim_param.lower() for w in ("seq", "len")):
                shape.append(seq)
            else:
                shape.append(batch if pos == 0 else seq if pos == 1 else 1)
        name = inp.name.lower()
        if "mask" in name:
            arr = np.ones(shape, dtype=np_dtype)
        elif "position" in name and np.issubdtype(np_dtype, np.integer):
            arr = np.broadcast_to(np.arange(shape[-1], dtype=np_dtype), shape).copy()
        elif "ids" in name and np.issubdtype(np_dtype, np.integer):
            arr = rng.integers(0, _ids_range(model, inp.name), size=shape).astype(np_dtype)
        elif np.issubdtype(np_dtype, np.floating):
            arr = rng.standard_normal(shape, dtype=np.float32).astype(np_dtype)
        else:
            arr = np.zeros(shape, dtype=np_dtype)
        feeds[inp.name] = arr
    return feeds


# ---------------------------------------------------------------------------------------------
# command line: python -m bitpress.synthetic decoder out.onnx --preset bench-447mb


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bitpress.synthetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=["decoder", "encoder", "genai"])
    p.add_argument("path", type=Path)
    p.add_argument("--preset", choices=list(PRESETS), help="decoder preset")
    p.add_argument("--dtype", choices=list(_DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--external-data", action="store_true", help="decoder and encoder only")
    args = p.parse_args(argv)
    extra: dict[str, Any] = {"seed": args.seed}
    if args.dtype:
        extra["dtype"] = args.dtype
    if args.external_data:
        if args.kind == "genai":
            p.error("--external-data applies to decoder and encoder")
        extra["external_data"] = True
    builders: dict[str, Callable[..., Path]] = {
        "decoder": build_decoder, "encoder": build_encoder, "genai": build_genai_folder,
    }
    if args.kind == "decoder" and args.preset:
        out = build_preset(args.preset, args.path, **extra)
    else:
        out = builders[args.kind](args.path, **extra)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
