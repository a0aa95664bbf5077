"""An ONNX model's inputs as the feeds need them: name, numpy dtype and shape (dims or their names).

Shared by everything that builds feeds (calibration data, ``bitpress eval``, ``bitpress bench``,
KV-cache plans); imports nothing of bitpress's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

_NP = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.BOOL: np.bool_,
    onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.INT8: np.int8,
}


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: type
    shape: tuple[int | str | None, ...]


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dtype = _NP.get(tt.elem_type, np.float32)
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        specs.append(InputSpec(vi.name, dtype, shape))
    return specs


def vocab_size(model: onnx.ModelProto) -> int:
    """Rows of the first Gather table read by the ids (the embedding), else 100."""
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type in ("Gather", "GatherBlockQuantized") and node.input[0] in inits:
            return int(inits[node.input[0]].dims[0])
    return 100
