"""Where a decoder's residual stream runs in an ONNX graph, and which weights read and write it.

QuaRot's rotation ``Q`` (hidden x hidden, orthogonal) multiplies the residual stream: every value
on it becomes ``x Q``. The graph computes the same function when

* the token table's rows become ``E Q`` (the embedding Gather writes the stream),
* every weight that writes into the stream (``o_proj``, ``down_proj``: MatMul, maybe + bias,
  added to the stream by ``Add`` or ``SkipSimplifiedLayerNormalization``) becomes ``W Q``,
* every RMS norm that reads the stream loses its scale ``g`` (an RMS norm commutes with ``Q``,
  which keeps the sum of squares; a per-channel scale does not) and every MatMul reading the
  norm's output becomes ``Q^T diag(g) W``.

:func:`find_stream` walks the graph from the embedding and returns that plan as a
:class:`Stream`, or raises :class:`StreamError` naming the node it cannot rotate through. It reads
no weight. What it accepts: the layouts of the ONNX Runtime GenAI model builder and of mobius for
pre-norm decoders (Llama, Qwen, Mistral, Phi-3 ...): ``SimplifiedLayerNormalization`` /
``RMSNormalization`` / ``SkipSimplifiedLayerNormalization`` norms whose scale is a weight (or a
weight plus a constant, Gemma's ``1 + w``), MatMul weights (direct or through a Transpose), and
scalar ``Mul`` on the stream (Gemma's embedding scale). A norm that writes into the stream
(Gemma 2/3's post-attention and post-feed-forward norms) is accepted too: its output is
``(y / rms(y)) g``, so it keeps a unit scale and a small float product ``diag(g) Q`` follows it
(:attr:`Stream.online`), the same trick the tied head uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

NORMS = ("SimplifiedLayerNormalization", "RMSNormalization")
SKIP_NORM = "SkipSimplifiedLayerNormalization"
ATTENTION = ("GroupQueryAttention",)
FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
               onnx.TensorProto.DOUBLE)


class StreamError(ValueError):
    """The graph has something on its residual stream that the rotation cannot pass through."""


@dataclass
class Matrix:
    """A 2-D weight as a MatMul reads it: ``stored`` is the initializer; ``transposed`` when read
    through a ``Transpose`` (the initializer is ``[N, K]``, the product uses ``[K, N]``)."""

    node: onnx.NodeProto
    stored: str
    transposed: bool
    transpose_node: onnx.NodeProto | None = None


@dataclass
class Norm:
    """An RMS norm reading the stream; its scale input is replaced by ones."""

    node: onnx.NodeProto
    scale_input: int  # index of the scale among the node's inputs
    readers: list[Matrix] = field(default_factory=list)
    #: SkipSimplifiedLayerNormalization's bias (added to the sum, so on the stream): rotated
    stream_bias: str | None = None


@dataclass
class Writer:
    """A MatMul (and its bias) whose output is added into the stream."""

    matrix: Matrix
    bias: str | None = None


@dataclass
class NormWriter:
    """A norm whose output is added into the stream (a sandwich norm): keeps ``g`` online."""

    node: onnx.NodeProto
    scale_input: int


@dataclass
class HeadValue:
    """The value projection of an attention node and the heads it holds (for the per-head rotation)."""

    matrix: Matrix
    bias: str | None
    columns: tuple[int, int]  # the value's columns in the (maybe packed q|k|v) output
    head_dim: int
    output: Matrix  # the o_proj reading the attention output


@dataclass
class Stream:
    """What :func:`find_stream` found: the roles of every weight on the residual stream."""

    hidden: int
    table: Matrix  # the embedding Gather's table (``transposed``: stored [hidden, vocab])
    norms: list[Norm]
    writers: list[Writer]
    norm_writers: list[NormWriter]
    #: the head MatMul when it reads the embedding table itself (tied): it gets an online product
    tied_head: tuple[Norm, Matrix] | None
    values: list[HeadValue]
    #: notes on what was left out (a layer whose value projection is not a plain MatMul: no per-head rotation)
    notes: list[str] = field(default_factory=list)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _label(node: onnx.NodeProto) -> str:
    return f"{node.op_type} {node.name or node.output[0]}"


class _Graph:
    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.inits = {t.name: t for t in graph.initializer}
        self.prods = {o: n for n in graph.node for o in n.output if o}
        self.cons: dict[str, list[onnx.NodeProto]] = {}
        for n in graph.node:
            for i in n.input:
                if i:
                    self.cons.setdefault(i, []).append(n)
        self.inputs = {i.name for i in graph.input} - set(self.inits)
        self.outputs = {o.name for o in graph.output}

    def constant(self, name: str) -> np.ndarray | None:
        """The value of a small constant (an initializer or a Constant node), or None."""
        if name in self.inits:
            t = self.inits[name]
            if t.data_location == onnx.TensorProto.EXTERNAL:
                return None
            return numpy_helper.to_array(t)
        p = self.prods.get(name)
        if p is not None and p.op_type == "Constant":
            value = _attrs(p).get("value")
            if isinstance(value, onnx.TensorProto):
                return numpy_helper.to_array(value)
            for key in ("value_float", "value_int"):
                if key in _attrs(p):
                    return np.asarray(_attrs(p)[key])
        return None

    def matrix(self, node: onnx.NodeProto, index: int) -> Matrix | None:
        """The 2-D float weight ``node`` reads at ``index`` (directly or through a Transpose), or None."""
        name = node.input[index] if index < len(node.input) else ""
        t = self.inits.get(name)
        if t is not None:
            return Matrix(node, name, False) if len(t.dims) == 2 and t.data_type in FLOAT_TYPES else None
        p = self.prods.get(name)
        if p is not None and p.op_type == "Transpose":
            src = self.inits.get(p.input[0])
            if src is not None and len(src.dims) == 2 and src.data_type in FLOAT_TYPES \
                    and list(_attrs(p).get("perm", [1, 0])) == [1, 0]:
                return Matrix(node, src.name, True, p)
        return None

    def dims(self, m: Matrix) -> tuple[int, int]:
        """``(K, N)`` of the product's weight."""
        a, b = (int(d) for d in self.inits[m.stored].dims)
        return (b, a) if m.transposed else (a, b)


def _scale_reads(g: _Graph, node: onnx.NodeProto, index: int) -> None:
    name = node.input[index] if index < len(node.input) else ""
    if not name:
        raise StreamError(f"{_label(node)} has no scale input")
    if name in g.inits:
        return
    p = g.prods.get(name)
    if p is not None and p.op_type == "Add" and any(i in g.inits for i in p.input) \
            and all(i in g.inits or g.constant(i) is not None for i in p.input):
        return
    raise StreamError(f"{_label(node)}: its scale {name!r} is not a weight (or a weight plus a constant)")


def norm_scale(g: onnx.GraphProto | _Graph, node: onnx.NodeProto, index: int, read) -> np.ndarray:
    """The effective scale vector of a norm (float64): a weight, or Add(weight, constant)."""
    gg = g if isinstance(g, _Graph) else _Graph(g)
    name = node.input[index]
    if name in gg.inits:
        return np.asarray(read(name), dtype=np.float64)
    p = gg.prods[name]
    parts = [np.asarray(read(i) if i in gg.inits else gg.constant(i), dtype=np.float64) for i in p.input]
    return parts[0] + parts[1]


def _writer(g: _Graph, value: str, via: onnx.NodeProto, hidden: int) -> Writer | NormWriter:
    p = g.prods.get(value)
    if p is None:
        raise StreamError(f"{_label(via)} adds {value!r} to the residual stream, and no node computes it")
    bias = None
    if p.op_type == "Add":
        consts = [i for i in p.input if i in g.inits]
        others = [i for i in p.input if i not in g.inits]
        if len(consts) == 1 and len(others) == 1 and g.prods.get(others[0]) is not None \
                and g.prods[others[0]].op_type == "MatMul" and len(g.cons.get(others[0], [])) == 1:
            bias, p = consts[0], g.prods[others[0]]
    if p.op_type in NORMS:
        if len(g.cons.get(p.output[0], [])) != 1 or p.output[0] in g.outputs:
            raise StreamError(f"{_label(p)} writes into the residual stream and is read elsewhere too")
        _scale_reads(g, p, 1)
        return NormWriter(p, 1)
    if p.op_type != "MatMul":
        raise StreamError(f"{_label(via)} adds the output of {_label(p)} to the residual stream; "
                          "only MatMul (+ bias) and RMS norm outputs can be rotated")
    m = g.matrix(p, 1)
    if m is None:
        raise StreamError(f"{_label(p)} writes into the residual stream without a 2-D float weight")
    if g.dims(m)[1] != hidden:
        raise StreamError(f"{_label(p)} writes {g.dims(m)[1]} channels into a stream of {hidden}")
    if len(g.cons.get(p.output[0], [])) != 1 or p.output[0] in g.outputs:
        raise StreamError(f"the output of {_label(p)} is read elsewhere than the residual stream")
    return Writer(m, bias)


def _readers(g: _Graph, norm: onnx.NodeProto, hidden: int) -> list[Matrix]:
    out = norm.output[0]
    if out in g.outputs:
        raise StreamError(f"the graph outputs {_label(norm)}'s result; a rotation would change it")
    for extra in list(norm.output)[1:3]:
        if extra and (g.cons.get(extra) or extra in g.outputs):
            raise StreamError(f"{_label(norm)}'s statistics output {extra!r} is used")
    found = []
    for c in g.cons.get(out, []):
        m = g.matrix(c, 1) if c.op_type == "MatMul" and c.input[0] == out else None
        if m is None:
            raise StreamError(f"{_label(c)} reads the output of {_label(norm)}; only MatMul weights can absorb "
                              "the rotation")
        if g.dims(m)[0] != hidden:
            raise StreamError(f"{_label(c)} reads {g.dims(m)[0]} channels from a stream of {hidden}")
        found.append(m)
    return found


def _embedding(g: _Graph) -> Matrix:
    found = []
    for n in g.graph.node:
        if n.op_type == "Gather" and len(n.input) == 2 and n.input[1] in g.inputs and _attrs(n).get("axis", 0) == 0:
            m = g.matrix(n, 0)
            if m is not None:
                found.append(m)
    if len(found) != 1:
        raise StreamError(
            f"expected one token embedding (a Gather of a weight table by a graph input), found {len(found)}"
            + (": " + ", ".join(_label(m.node) for m in found) if found else
               "; QuaRot's ONNX form rotates decoders that take input_ids")
        )
    return found[0]


def _scalar(g: _Graph, node: onnx.NodeProto, value: str) -> bool:
    other = [i for i in node.input if i != value]
    if len(other) != 1:
        return False
    c = g.constant(other[0])
    return c is not None and c.size == 1


def find_stream(graph: onnx.GraphProto) -> Stream:
    """The rotation plan of a decoder graph; StreamError naming what blocks it."""
    g = _Graph(graph)
    table = _embedding(g)
    a, b = (int(d) for d in g.inits[table.stored].dims)
    hidden = a if table.transposed else b
    norms: list[Norm] = []
    writers: list[Writer] = []
    norm_writers: list[NormWriter] = []
    pending = [table.node.output[0]]
    seen: set[str] = set()
    done: set[int] = set()
    while pending:
        value = pending.pop()
        if value in seen:
            continue
        seen.add(value)
        if value in g.outputs:
            raise StreamError(f"the graph outputs the residual stream ({value!r}); a rotation would change it")
        for c in g.cons.get(value, []):
            if id(c) in done:
                continue
            done.add(id(c))
            if c.op_type == "Mul" and _scalar(g, c, value):
                pending.append(c.output[0])
            elif c.op_type in NORMS and c.input[0] == value:
                _scale_reads(g, c, 1)
                norms.append(Norm(c, 1, _readers(g, c, hidden)))
            elif c.op_type == SKIP_NORM and c.domain == "com.microsoft" and value in c.input[:2]:
                other = c.input[1] if c.input[0] == value else c.input[0]
                w = _writer(g, other, c, hidden)
                (norm_writers if isinstance(w, NormWriter) else writers).append(w)
                _scale_reads(g, c, 2)
                bias = c.input[3] if len(c.input) > 3 and c.input[3] else None
                if bias is not None and bias not in g.inits:
                    raise StreamError(f"{_label(c)}: its bias {bias!r} is not a weight")
                norms.append(Norm(c, 2, _readers(g, c, hidden), bias))
                if len(c.output) > 3 and c.output[3]:
                    pending.append(c.output[3])
            elif c.op_type == "Add" and len(c.input) == 2 and c.input[0] != c.input[1]:
                other = c.input[1] if c.input[0] == value else c.input[0]
                if other in seen:  # both sides on the stream (x + x'): stays rotated
                    pending.append(c.output[0])
                    continue
                w = _writer(g, other, c, hidden)
                (norm_writers if isinstance(w, NormWriter) else writers).append(w)
                pending.append(c.output[0])
            else:
                raise StreamError(f"{_label(c)} reads the residual stream; the rotation cannot pass through it")
    if not norms:
        raise StreamError("no RMS norm reads the residual stream (SimplifiedLayerNormalization, RMSNormalization "
                          "or SkipSimplifiedLayerNormalization); QuaRot needs RMS-normed pre-norm decoders")
    tied = None
    for norm in norms:
        for m in norm.readers:
            if m.stored == table.stored:
                if m.transposed == table.transposed:
                    raise StreamError(f"{_label(m.node)} reads the embedding table in the Gather's orientation")
                tied = (norm, m)
    _check_roles(g, table, norms, writers, tied)
    values, notes = _values(g)
    return Stream(hidden, table, norms, writers, norm_writers, tied, values, notes)


def _check_roles(g: _Graph, table: Matrix, norms: list[Norm], writers: list[Writer],
                 tied: tuple[Norm, Matrix] | None) -> None:
    """Every rotated weight has one role and no reader outside the plan (the tied table: two)."""
    roles: dict[str, list[onnx.NodeProto]] = {table.stored: [table.node]}
    for m in [r for n in norms for r in n.readers] + [w.matrix for w in writers]:
        roles.setdefault(m.stored, []).append(m.node)
    for name, nodes in roles.items():
        expected = 2 if name == table.stored and tied is not None else 1
        readers = _readers_of(g, name)
        if len(nodes) != expected or len(readers) != expected or name in g.outputs:
            named = ", ".join(sorted({_label(n) for n in readers}))
            raise StreamError(f"weight {name!r} is read by {named or 'a graph output'}; rotating it would change "
                              "a node outside the residual stream")


def _values(g: _Graph) -> tuple[list[HeadValue], list[str]]:
    """The value projection of each attention read by one output MatMul (R2, per head).

    R2 leaves the output projection's result unchanged, so it applies whatever follows that
    projection (the stream, or a sandwich norm).
    """
    values, notes = [], []
    for att in g.graph.node:
        if att.op_type not in ATTENTION:
            continue
        readers = g.cons.get(att.output[0], [])
        o = g.matrix(readers[0], 1) if len(readers) == 1 and readers[0].op_type == "MatMul" else None
        if o is None or att.output[0] in g.outputs or len(_readers_of(g, o.stored)) != 1:
            notes.append(f"{_label(att)}: its output is not read by one MatMul of its own; no per-head rotation")
            continue
        attrs = _attrs(att)
        heads, kv_heads = int(attrs.get("num_heads", 0)), int(attrs.get("kv_num_heads", 0))
        k_out = g.dims(o)[0]
        if not heads or not kv_heads or k_out % heads:
            notes.append(f"{_label(att)}: head counts not understood; no per-head rotation")
            continue
        head_dim = k_out // heads
        packed = len(att.input) < 2 or not att.input[1]
        source = att.input[0] if packed else (att.input[2] if len(att.input) > 2 else "")
        p = g.prods.get(source)
        bias = None
        if p is not None and p.op_type == "Add":
            consts = [i for i in p.input if i in g.inits]
            others = [i for i in p.input if i not in g.inits]
            if len(consts) == 1 and len(others) == 1 and len(g.cons.get(others[0], [])) == 1:
                bias, p = consts[0], g.prods.get(others[0])
        m = g.matrix(p, 1) if p is not None and p.op_type == "MatMul" else None
        if m is None or len(g.cons.get(source, [])) != 1 or len(_readers_of(g, m.stored)) != 1 \
                or (bias is not None and len(g.cons.get(bias, [])) != 1):
            notes.append(f"{_label(att)}: the value is not one MatMul's output; no per-head rotation")
            continue
        n = g.dims(m)[1]
        width = kv_heads * head_dim
        if packed:
            if n != (heads + 2 * kv_heads) * head_dim:
                notes.append(f"{_label(att)}: packed q|k|v width {n} does not match its heads; no per-head rotation")
                continue
            columns = (n - width, n)
        else:
            if n != width:
                notes.append(f"{_label(att)}: value width {n} does not match its heads; no per-head rotation")
                continue
            columns = (0, n)
        values.append(HeadValue(m, bias, columns, head_dim, o))
    return values, notes


def _readers_of(g: _Graph, weight: str) -> list[onnx.NodeProto]:
    """The nodes that read ``weight``, directly or through a Transpose."""
    out = []
    for c in g.cons.get(weight, []):
        out.extend(g.cons.get(c.output[0], []) if c.op_type == "Transpose" else [c])
    return out
