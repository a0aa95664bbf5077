"""One stage as an ONNX Runtime session: its nodes, its frontier inputs, weights by reference."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper

from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.activations import gather_without_transpose, relocate_tensor, session_for
from bitpress.onnx.calibrated.stages import Stage, node_reads
from bitpress.onnx.tensors import is_external

_ELEM = {np.dtype(k): v for k, v in {
    np.float32: onnx.TensorProto.FLOAT, np.float16: onnx.TensorProto.FLOAT16, np.float64: onnx.TensorProto.DOUBLE,
    np.int64: onnx.TensorProto.INT64, np.int32: onnx.TensorProto.INT32, np.int8: onnx.TensorProto.INT8,
    np.uint8: onnx.TensorProto.UINT8, np.bool_: onnx.TensorProto.BOOL, np.int16: onnx.TensorProto.INT16,
}.items()}


def value_info(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
    """A graph input typed like ``value``, every dimension symbolic (samples may differ in length)."""
    return helper.make_tensor_value_info(name, _elem(value.dtype), [f"{name}_d{i}" for i in range(value.ndim)])


def _elem(dtype: np.dtype) -> int:
    elem = _ELEM.get(np.dtype(dtype))
    if elem is None and np.dtype(dtype) == np.dtype("V2"):
        elem = onnx.TensorProto.BFLOAT16
    if elem is None:
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return elem


def stage_session(
    model: OnnxModel, stage: Stage, example: dict[str, np.ndarray],
    substitutes: Mapping[str, tuple[tuple[int, ...], np.dtype]],
) -> tuple[Any, list[str]]:
    """An ONNX Runtime session computing ``stage.outputs`` from ``stage.inputs``, and the
    substitutes it reads.

    ``example``: one sample's frontier values (their types); ``substitutes``: weights computed
    with in their dequantized form (``name -> (shape, dtype)`` as stored): the session takes them
    as extra inputs, to be fed with each run (memory maps: ONNX Runtime reads them in place).
    """
    graph = model.graph
    nodes = [graph.node[i] for i in stage.nodes]
    reads = {n for node in nodes for n in node_reads(node)}
    inits = model.initializers()
    base = model.resolver.base_dir.resolve()
    tensors = []
    fed: list[str] = []
    for name in sorted(reads):
        if name in stage.inputs or name not in inits:
            continue
        if name in substitutes:
            fed.append(name)
            continue
        t = onnx.TensorProto()
        t.CopyFrom(inits[name])
        if is_external(t):
            relocate_tensor(t, model, base)
        tensors.append(t)
    extra = []
    for name in fed:
        shape, dtype = substitutes[name]
        extra.append(helper.make_tensor_value_info(name, _elem(dtype), list(shape)))
    g = helper.make_graph(
        nodes, "bitpress_stage", [value_info(n, example[n]) for n in stage.inputs] + extra,
        [onnx.ValueInfoProto(name=n) for n in stage.outputs], tensors,
    )
    proto = helper.make_model(g, opset_imports=list(model.proto.opset_import), ir_version=model.proto.ir_version)
    proto.functions.extend(model.proto.functions)
    gather_without_transpose(proto.graph, tables=[n for n in fed if len(substitutes[n][0]) == 2])
    return session_for(proto.SerializeToString(), base), fed
