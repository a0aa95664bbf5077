"""Dividing one MatMul input by per-channel scales exactly (AWQ): folded into its producer, or a ``Mul``.

The weights that read ``x`` are quantized as ``W * s`` (rows of ``[K, N]`` scaled); the model
must then compute ``(x / s) @ (W * s)``. When ``x`` feeds nothing but those MatMuls and its
producer has a per-channel factor of its own that nothing else reads, ``1 / s`` is folded into
it: the gamma (and beta) of ``LayerNormalization``, ``SimplifiedLayerNormalization``,
``SkipLayerNormalization``, ``SkipSimplifiedLayerNormalization``, ``RMSNormalization``; the 1-D
weight of an RMSNorm written as ``Mul(normalized, weight)``; the columns of a float ``MatMul``
weight. Otherwise a ``Mul`` by ``1 / s`` is inserted in front of those MatMuls. Either way the
float model's outputs are unchanged (to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.graph import consumers, producers
from bitpress.onnx.tensors import np_dtype

#: producer op -> the inputs holding its per-channel output factors (gamma first, then beta)
_NORMS = {
    "LayerNormalization": (1, 2),
    "SimplifiedLayerNormalization": (1,),
    "RMSNormalization": (1,),
    "SkipLayerNormalization": (2, 3),
    "SkipSimplifiedLayerNormalization": (2,),
}


@dataclass
class InputScaling:
    activation: str
    inv_scales: np.ndarray  # float32 [K]: what x is multiplied by
    dtype: np.dtype  # x's element type (the inserted Mul's factor has it)
    #: output names of the MatMul / Gemm nodes that read the scaled weights (kept by the writer)
    readers: frozenset[str]
    how: str = ""  # after :func:`apply_scalings`: how it was done


def _is_reader(node: onnx.NodeProto, readers: frozenset[str]) -> bool:
    out = node.output[0] if node.output else ""
    return out in readers or out.removesuffix("_MatMulNBits") in readers


def fold_target(
    model: OnnxModel, sc: InputScaling, quantized: set[str],
) -> tuple[onnx.NodeProto, tuple[str, ...]] | None:
    """The producer of the activation and the initializers to divide by ``s``, when folding is exact:
    the scaled MatMuls are its only readers and the factors are the producer's own."""
    graph = model.graph
    activation, k = sc.activation, sc.inv_scales.shape[0]
    if activation in {o.name for o in graph.output}:
        return None
    cons = consumers(graph)
    if any(not _is_reader(n, sc.readers) for n in cons.get(activation, [])):
        return None
    from bitpress.onnx.weightonly.planning import subgraph_reads_of

    if activation in subgraph_reads_of(graph):
        return None
    prod = producers(graph).get(activation)
    if prod is None:
        return None
    inits = model.initializers()

    def private(name: str, shape: tuple[int, ...]) -> bool:
        t = inits.get(name)
        return (t is not None and tuple(int(d) for d in t.dims) == shape and name not in quantized
                and len(cons.get(name, [])) == 1 and t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16))

    op = prod.op_type
    if op in _NORMS and prod.output[0] == activation:
        names = tuple(prod.input[i] for i in _NORMS[op] if i < len(prod.input) and prod.input[i])
        if names and all(private(n, (k,)) for n in names):
            return prod, names
        return None
    if op == "Mul" and prod.domain in ("", "ai.onnx"):
        for name in prod.input:
            if private(name, (k,)):
                return prod, (name,)
        return None
    if op == "MatMul" and prod.domain in ("", "ai.onnx") and len(prod.input) == 2:
        w = inits.get(prod.input[1])
        shape = tuple(int(d) for d in w.dims) if w is not None else ()
        if len(shape) == 2 and shape[1] == k and private(prod.input[1], shape):
            return prod, (prod.input[1],)
    return None


def apply_scalings(model: OnnxModel, scalings: list[InputScaling], quantized: set[str]) -> None:
    """Carry out every planned division, after the quantized weights are written."""
    for sc in scalings:
        target = fold_target(model, sc, quantized)
        if target is not None:
            prod, names = target
            for name in names:
                t = model.initializers()[name]
                a = np.asarray(model.array(t), dtype=np.float32)
                scaled = a * sc.inv_scales if a.ndim == 1 else a * sc.inv_scales[None, :]
                model.set_initializer(name, scaled.astype(np_dtype(t)))
            sc.how = f"folded into {prod.op_type} {prod.name or prod.output[0]}"
            continue
        _insert_mul(model, sc)
        sc.how = "Mul inserted"
    model.modified = True


def _insert_mul(model: OnnxModel, sc: InputScaling) -> None:
    """``Mul(x, 1 / s)`` read by the scaled MatMuls only; every other reader keeps ``x``."""
    graph = model.graph
    act = sc.activation
    scaled = f"{act}_awq_scaled"
    factor = f"{act}_awq_inv_scales"
    model.set_initializer(factor, sc.inv_scales.astype(sc.dtype))
    first = None
    for i, node in enumerate(graph.node):
        if act in node.input and _is_reader(node, sc.readers):
            node.input[:] = [scaled if n == act else n for n in node.input]
            first = i if first is None else first
    mul = helper.make_node("Mul", [act, factor], [scaled], name=f"{act}_awq_Mul")
    nodes = list(graph.node)
    nodes.insert(first if first is not None else len(nodes), mul)
    del graph.node[:]
    graph.node.extend(nodes)
