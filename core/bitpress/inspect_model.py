"""``bitpress inspect``: what a model holds, without running it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import onnx

from bitpress.models.onnx_model import OnnxModel
from bitpress.models.onnx_package import OnnxPackage
from bitpress.onnx.lazy_load import INLINE_PREFIX
from bitpress.onnx.save import check_model_file
from bitpress.onnx.tensors import (
    external_ref,
    is_external,
    iter_graphs,
    iter_tensors,
    tensor_nbytes,
)

QUANTIZED_OPS = {
    "MatMulNBits", "GatherBlockQuantized", "MatMulBnb4", "MatMulInteger", "QLinearMatMul",
    "QLinearConv", "DynamicQuantizeMatMul", "DequantizeLinear", "QuantizeLinear",
    "DynamicQuantizeLinear", "QGemm", "QMoE",
}


def experts_of(graph: onnx.GraphProto) -> list[dict[str, Any]]:
    """Every ``com.microsoft`` MoE / QMoE node: experts, widths, routing, activation, and how they are stored."""
    from bitpress.onnx.kernels import node_path

    shapes = {t.name: [int(d) for d in t.dims] for t in graph.initializer}
    dtypes = {t.name: t.data_type for t in graph.initializer}
    out = []
    for node in graph.node:
        if node.domain != "com.microsoft" or node.op_type not in ("MoE", "QMoE"):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        act = attrs.get("activation_type", b"relu")
        fc1 = shapes.get(node.input[2], []) if len(node.input) > 2 else []
        fc2 = shapes.get(node.input[5 if node.op_type == "QMoE" else 4], []) if len(node.input) > 4 else []
        entry: dict[str, Any] = {
            "node": node.name or node.output[0], "op": node.op_type, "experts": fc1[0] if fc1 else None,
            "hidden": fc2[1] if len(fc2) > 1 else None, "top_k": int(attrs.get("k", 1)),
            "activation": act.decode() if isinstance(act, bytes) else str(act),
        }
        if node.op_type == "QMoE":
            path = node_path(node, dtypes)
            entry.update(bits=int(attrs.get("expert_weight_bits", 4)), block_size=int(attrs.get("block_size", 0)),
                         accuracy_level=int(attrs.get("accuracy_level", 0)),
                         zero_points=len(node.input) > 11 and bool(node.input[11]),
                         kernel=path.label if path is not None else None)
        else:
            name = onnx.TensorProto.DataType.Name(dtypes.get(node.input[2], 0)).lower() if fc1 else None
            entry["dtype"] = "float32" if name == "float" else name
        out.append(entry)
    return out


def inspect_onnx(model: OnnxModel, *, check: bool = True) -> dict[str, Any]:
    ops: Counter[str] = Counter()
    quantized: Counter[str] = Counter()
    for g in iter_graphs(model.graph):
        for node in g.node:
            key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}:{node.op_type}"
            ops[key] += 1
            if node.op_type in QUANTIZED_OPS:
                quantized[node.op_type] += 1
    by_dtype: Counter[str] = Counter()
    data_files: Counter[str] = Counter()
    for t in iter_tensors(model.proto):
        by_dtype[onnx.TensorProto.DataType.Name(t.data_type).lower()] += tensor_nbytes(t)
        if is_external(t) and not external_ref(t).location.startswith(INLINE_PREFIX):
            data_files[external_ref(t).location] += tensor_nbytes(t)
    checker = "skipped"
    if check:
        try:
            check_model_file(model.source)  # a model in a Hugging Face cache snapshot too (its files are links)
            checker = "ok"
        except Exception as exc:
            checker = "fails: " + (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return {
        "model": str(model.source),
        "opsets": {o.domain or "ai.onnx": o.version for o in model.proto.opset_import},
        "nodes": sum(ops.values()),
        "ops": dict(ops.most_common()),
        "quantized_nodes": dict(quantized),
        "experts": experts_of(model.graph),
        "weight_bytes_by_dtype": dict(by_dtype),
        "external_data": dict(data_files),
        "checker": checker,
    }


def inspect_path(model: Any, *, check: bool = True) -> list[dict[str, Any]]:
    if isinstance(model, OnnxPackage):
        return [inspect_onnx(model.component(rel), check=check) for rel in model.onnx_files]
    if isinstance(model, OnnxModel):
        return [inspect_onnx(model, check=check)]
    own = getattr(model, "inspect", None)  # a plugin's model kind reports itself (``lines`` to print)
    if callable(own):
        return [own()]
    return [{"model": str(getattr(model, "source", Path("?"))), "kind": model.kind}]
