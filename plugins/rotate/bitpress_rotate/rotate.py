"""Rotating an ONNX decoder offline: QuaRot's R1 (the residual stream) and R2 (each value head).

The plan comes from :func:`bitpress_rotate.stream.find_stream`; this module turns it into one list
of matrix products per weight (``left``: ``A @ S``, ``right``: ``S @ B`` on the stored ``S``, maybe
on a span of rows or columns, maybe block by block per head), applies each weight's list once in
float64 and rounds to the weight's own type once. Left and right products commute, so the order
the roles add them in does not matter.

Online products: a float ``MatMul`` by a hidden x hidden matrix, marked to stay float
(:data:`KEEP_FLOAT`), where no weight can absorb a per-channel scale: before a tied LM head (the
table is shared with the embedding, which needs ``E Q``: the head gets ``Q^T diag(g) Q``) and after a
norm that writes into the stream (``diag(g) Q``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from bitpress.plugin import KEEP_FLOAT
from bitpress_rotate.matrices import orthogonal
from bitpress_rotate.stream import Matrix, Stream, norm_scale

log = logging.getLogger(__name__)

#: rows or columns rotated at a time (bounds float64 temporaries on large tables)
CHUNK = 8192


@dataclass
class Op:
    side: str  # "left": A @ S; "right": S @ B
    matrix: np.ndarray
    span: tuple[int, int] | None = None  # rows (left) / columns (right) it applies to
    block: bool = False  # applied block-diagonally over the span


@dataclass
class Rotation:
    """What :func:`rotate` did."""

    hidden: int
    mode: str
    seed: int
    weights: int = 0
    norms: int = 0
    heads: int = 0  # attention layers whose value heads were rotated (R2)
    online: list[str] = field(default_factory=list)  # the float products inserted
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        online = f", {len(self.online)} online float product(s) of {self.hidden}x{self.hidden}" if self.online else ""
        return (f"rotated {self.weights} weights ({self.mode}, seed {self.seed}, hidden {self.hidden}): "
                f"{self.norms} norm scales folded, value heads of {self.heads} attention layers rotated{online}")


def _apply(array: np.ndarray, ops: list[Op]) -> np.ndarray:
    out = np.array(array, dtype=np.float64)
    rows, cols = out.shape
    for op in ops:
        lo, hi = op.span if op.span is not None else ((0, rows) if op.side == "left" else (0, cols))
        m = op.matrix
        if op.side == "left":
            for c in range(0, cols, CHUNK):
                part = out[lo:hi, c:c + CHUNK]
                if op.block:
                    b = m.shape[0]
                    shaped = part.reshape((hi - lo) // b, b, part.shape[1])
                    out[lo:hi, c:c + CHUNK] = np.einsum("ij,hjc->hic", m, shaped).reshape(part.shape)
                else:
                    out[lo:hi, c:c + CHUNK] = m @ part
        else:
            for r in range(0, rows, CHUNK):
                part = out[r:r + CHUNK, lo:hi]
                if op.block:
                    b = m.shape[0]
                    shaped = part.reshape(part.shape[0], (hi - lo) // b, b)
                    out[r:r + CHUNK, lo:hi] = (shaped @ m).reshape(part.shape)
                else:
                    out[r:r + CHUNK, lo:hi] = part @ m
    return out


def _apply_vector(vector: np.ndarray, ops: list[Op]) -> np.ndarray:
    return _apply(np.asarray(vector, dtype=np.float64).reshape(1, -1), ops).reshape(-1)


def _insert_after(graph: onnx.GraphProto, anchor: onnx.NodeProto, node: onnx.NodeProto) -> None:
    for i, n in enumerate(graph.node):
        if n is anchor:
            graph.node.insert(i + 1, node)
            return
    raise AssertionError("anchor node not in graph")


def rotate(model: Any, stream: Stream, mode: str = "hadamard", seed: int = 0, heads: bool = True) -> Rotation:
    """Rotate ``model`` (a :class:`bitpress.plugin.OnnxModel`) in place as ``stream`` plans it."""
    graph = model.graph
    rng = np.random.default_rng(seed)
    hidden = stream.hidden
    q = orthogonal(hidden, mode, rng)
    ops: dict[str, list[Op]] = {}
    result = Rotation(hidden, mode, seed, notes=list(stream.notes))

    def add(m: Matrix | str, op: Op) -> None:
        ops.setdefault(m.stored if isinstance(m, Matrix) else m, []).append(op)

    # the stream's writers: E Q, W Q (and their biases)
    t = stream.table
    add(t, Op("left", q.T) if t.transposed else Op("right", q))
    for w in stream.writers:
        add(w.matrix, Op("left", q.T) if w.matrix.transposed else Op("right", q))
        if w.bias is not None:
            add(w.bias, Op("right", q))

    ones: dict[tuple[int, int], str] = {}

    def unit_scale(node: onnx.NodeProto, index: int, gamma: np.ndarray) -> None:
        dtype = _scale_dtype(model, node.input[index])
        key = (gamma.size, dtype)
        if key not in ones:
            name = _unique(graph, f"quarot.ones_{gamma.size}")
            model.set_initializer(name, np.ones(gamma.size, dtype=helper.tensor_dtype_to_np_dtype(dtype)))
            ones[key] = name
        old = node.input[index]
        node.input[index] = ones[key]
        _drop_if_dead(graph, old)

    head_norm, head = stream.tied_head if stream.tied_head is not None else (None, None)
    head_gamma = None
    for norm in stream.norms:
        gamma = norm_scale(graph, norm.node, norm.scale_input, model.array)
        for m in norm.readers:
            if head is not None and m is head:
                head_gamma = gamma
                continue
            add(m, Op("right", gamma[:, None] * q) if m.transposed else Op("left", q.T * gamma[None, :]))
        if norm.stream_bias is not None:
            add(norm.stream_bias, Op("right", q))
        unit_scale(norm.node, norm.scale_input, gamma)
        result.norms += 1

    dtype = int(model.initializers()[t.stored].data_type)
    if head is not None and head_norm is not None and head_gamma is not None:
        # logits = x^ diag(g) E^T = (x^ Q) (Q^T diag(g) Q) (E Q)^T: one table, one small product
        _online(model, result, head_norm.node, q.T @ (head_gamma[:, None] * q), dtype,
                before=head.node, what="tied LM head")
    for nw in stream.norm_writers:
        gamma = norm_scale(graph, nw.node, nw.scale_input, model.array)
        unit_scale(nw.node, nw.scale_input, gamma)
        _online(model, result, nw.node, gamma[:, None] * q, dtype, before=None, what="sandwich norm")
        result.norms += 1

    if heads:
        for v in stream.values:
            r2 = orthogonal(v.head_dim, mode, rng)
            lo, hi = v.columns
            add(v.matrix, Op("left", r2.T, (lo, hi), True) if v.matrix.transposed else Op("right", r2, (lo, hi), True))
            if v.bias is not None:
                add(v.bias, Op("right", r2, (lo, hi), True))
            o = v.output
            k = model_dims(model, o)[0]
            add(o, Op("right", r2, (0, k), True) if o.transposed else Op("left", r2.T, (0, k), True))
            result.heads += 1

    for name, weight_ops in ops.items():
        array = model.array(name)
        rotated = _apply_vector(array, weight_ops) if array.ndim == 1 else _apply(array, weight_ops)
        model.set_initializer(name, rotated.astype(array.dtype))
        result.weights += array.ndim == 2
    model.remove_unused_initializers()  # the norms' scales, now folded
    model.modified = True
    return result


def model_dims(model: Any, m: Matrix) -> tuple[int, int]:
    a, b = (int(d) for d in model.initializers()[m.stored].dims)
    return (b, a) if m.transposed else (a, b)


def _scale_dtype(model: Any, name: str) -> int:
    t = model.initializers().get(name)
    if t is not None:
        return int(t.data_type)
    for n in model.graph.node:
        if name in n.output:
            for i in n.input:
                if i in model.initializers():
                    return int(model.initializers()[i].data_type)
    return onnx.TensorProto.FLOAT


def _unique(graph: onnx.GraphProto, base: str) -> str:
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    taken |= {n.name for n in graph.node}
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name


def _drop_if_dead(graph: onnx.GraphProto, value: str) -> None:
    """Remove the node computing ``value`` (Gemma's ``1 + w``) once nothing reads it."""
    if any(value in n.input for n in graph.node) or value in {o.name for o in graph.output}:
        return
    for i, n in enumerate(graph.node):
        if value in n.output and len(n.output) == 1:
            del graph.node[i]
            return


def _online(model: Any, result: Rotation, after: onnx.NodeProto, matrix: np.ndarray, dtype: int, *,
            before: onnx.NodeProto | None, what: str) -> None:
    """Insert ``y = x @ matrix`` (float, kept float by the quantizers) on the output of ``after``."""
    graph = model.graph
    source = after.output[0]
    weight = _unique(graph, f"{after.name or source}/quarot_online.weight")
    model.set_initializer(weight, matrix.astype(helper.tensor_dtype_to_np_dtype(dtype)))
    out = _unique(graph, f"{source}/quarot_online")
    name = _unique(graph, f"{after.name or source}/quarot_online")
    node = helper.make_node("MatMul", [source, weight], [out], name=name)
    entry = node.metadata_props.add()
    entry.key, entry.value = KEEP_FLOAT, f"QuaRot's online rotation ({what}): a float hidden x hidden product"
    readers = [before] if before is not None else [n for n in graph.node if source in n.input]
    for r in readers:
        for i, name in enumerate(r.input):
            if name == source:
                r.input[i] = out
    _insert_after(graph, after, node)
    result.online.append(node.name)
