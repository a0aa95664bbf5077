"""Weights their node cannot read: refused when a model is loaded, naming the node and the weight.

A ``MatMul`` whose weight is a STRING tensor, or a ``Gemm`` whose weight is 3-D, is not a model
ONNX Runtime opens; without this check a run would carry it through every pass and fail only at
the final ONNX Runtime check of its output. :func:`check_weight_reads` looks at the nodes whose
weights passes quantize (``MatMul``, ``Gemm``, ``Gather`` of the standard domain, main graph)
and that read an initializer:

* the initializer's element type must be one the operator's schema allows for that input (the
  test ONNX Runtime makes when it opens the model): no graph inference is needed for it;
* when every input of the node has a known type (initializers, graph inputs, and values ONNX's
  own type and shape inference derives from them), ONNX's inference function for the node runs
  on the node alone, strictly: incompatible dimensions (``[2, 3, 32] x [2, 64, 64]``), a 1-D or
  3-D ``Gemm`` weight, a float16 weight under a float input are refused.

Declared ``value_info`` and graph output shapes are left out of the inference: ONNX Runtime does
not fail a model on them, so neither does this check. Weights that are valid but not 2-D (a
matrix-vector ``MatMul``, a batched one) pass here; the planner keeps them in float and says why.
"""

from __future__ import annotations

import functools
import re

import onnx
from onnx import helper, shape_inference

from bitpress.errors import ModelLoadError

#: the ops whose weights passes quantize (bitpress.onnx.weightonly.planning)
WEIGHT_OPS = frozenset({"MatMul", "Gemm", "Gather"})


def check_weight_reads(proto: onnx.ModelProto) -> None:
    """Raise :class:`ModelLoadError` naming the first weight-reading node ONNX Runtime would refuse."""
    graph = proto.graph
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    inits = {t.name: t for t in graph.initializer}
    nodes = [n for n in graph.node if n.domain in ("", "ai.onnx") and n.op_type in WEIGHT_OPS
             and any(name in inits for name in n.input)]
    if not nodes or opset is None:
        return
    for node in nodes:
        problem = _type_problem(node, opset, inits)
        if problem:
            raise ModelLoadError(problem)
    known = _inferred_types(proto)
    for node in nodes:
        problem = _inference_problem(proto, node, inits, known)
        if problem:
            raise ModelLoadError(problem)


def _where(node: onnx.NodeProto) -> str:
    return f"{node.op_type} node {node.name[:80]!r}" if node.name else f"a {node.op_type} node"


def _describe(name: str, value: onnx.ValueInfoProto | onnx.TensorProto) -> str:
    if isinstance(value, onnx.TensorProto):
        elem, dims = value.data_type, [int(d) for d in value.dims]
    else:
        tt = value.type.tensor_type
        elem = tt.elem_type
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim] \
            if tt.HasField("shape") else None
    try:
        kind = onnx.TensorProto.DataType.Name(elem)
    except ValueError:
        kind = str(elem)
    shape = "" if dims is None else f" {dims}"
    return f"{name[:80]!r} ({kind}{shape})"


@functools.lru_cache(maxsize=256)
def _allowed_types(op_type: str, opset: int) -> tuple[tuple[str, frozenset[str]], ...] | None:
    """Per formal input of ``op_type`` at ``opset``: its name and the tensor types it takes (None: unknown op)."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except Exception:  # an op or version this onnx does not know: ONNX Runtime's business, not this check's
        return None
    constraints = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
    return tuple((p.name, constraints.get(p.type_str, frozenset({p.type_str}))) for p in schema.inputs)


def _type_problem(node: onnx.NodeProto, opset: int, inits: dict[str, onnx.TensorProto]) -> str | None:
    formals = _allowed_types(node.op_type, opset)
    if not formals:
        return None
    for i, name in enumerate(node.input):
        tensor = inits.get(name)
        if tensor is None or i >= len(formals):
            continue
        formal, allowed = formals[i]
        try:
            kind = f"tensor({onnx.TensorProto.DataType.Name(tensor.data_type).lower()})"
        except ValueError:
            continue  # an unknown data type is refused by the tensor checks
        if kind not in allowed:
            return (f"{_where(node)} cannot read its weight {_describe(name, tensor)}: {node.op_type} takes "
                    f"{', '.join(sorted(t[7:-1] for t in allowed))} as input {formal}; ONNX Runtime refuses "
                    "such a model")
    return None


def _inferred_types(proto: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Graph inputs and the values ONNX's (lenient) inference derives from them and the initializers.

    Declared value_info and graph outputs are dropped first: only what the inputs imply counts.
    """
    light = onnx.ModelProto()
    light.CopyFrom(proto)  # the graph: large weights are external references (lazy loading), not data
    light.graph.ClearField("value_info")
    light.graph.ClearField("output")
    known = {vi.name: vi for vi in proto.graph.input}
    try:
        inferred = shape_inference.infer_shapes(light, check_type=False, strict_mode=False, data_prop=False)
    except Exception:  # inference gave up on this graph: check with the declared inputs alone
        return known
    for vi in inferred.graph.value_info:
        known.setdefault(vi.name, vi)
    return known


def _typed(value: onnx.ValueInfoProto) -> bool:
    return value.type.HasField("tensor_type") and value.type.tensor_type.elem_type != 0


def _inference_problem(
    proto: onnx.ModelProto, node: onnx.NodeProto, inits: dict[str, onnx.TensorProto],
    known: dict[str, onnx.ValueInfoProto],
) -> str | None:
    """ONNX's inference function of ``node`` alone, strict, on its inputs' known types; None when it passes
    (or when an input's type is unknown: nothing can be concluded then)."""
    graph_inputs = {vi.name for vi in proto.graph.input}
    inputs: list[onnx.ValueInfoProto] = []
    described: list[str] = []
    for name in node.input:
        if not name:
            continue  # an optional input left out
        if name in inits and name not in graph_inputs:
            tensor = inits[name]
            value = helper.make_tensor_value_info(name, tensor.data_type, [int(d) for d in tensor.dims])
        else:
            value = known.get(name)
            if value is None or not _typed(value):
                return None
        if any(v.name == name for v in inputs):
            continue
        inputs.append(value)
        described.append(_describe(name, value))
    one = helper.make_model(helper.make_graph([node], "node", inputs, []), opset_imports=list(proto.opset_import),
                            ir_version=proto.ir_version)
    try:
        shape_inference.infer_shapes(one, check_type=True, strict_mode=True, data_prop=False)
    except shape_inference.InferenceError as exc:
        weights = [n for n in node.input if n in inits]
        return (f"{_where(node)} cannot read its weight {', '.join(repr(w[:80]) for w in weights)} "
                f"(inputs {', '.join(described)}): {_reason(str(exc))}; ONNX Runtime refuses such a model")
    except Exception:  # anything else (an IR or opset this onnx cannot check): no verdict
        return None
    return None


_PREFIXES = re.compile(r"^\s*(\[\w+\]\s*|Inference error\(s\):\s*|\(op_type:[^)]*\):\s*)+")


def _reason(text: str) -> str:
    """ONNX's inference message without its ``[ShapeInferenceError] (op_type:..., node name: ...)`` prefixes,
    on one line."""
    first = " ".join(text.split())
    first = _PREFIXES.sub("", first)
    first = re.sub(r"\s*in node \w+ \([^)]*\)\.?$", "", first).rstrip(". ")
    return first[:300] or "ONNX's type and shape inference refuses it"


__all__ = ["WEIGHT_OPS", "check_weight_reads"]
