"""Per-tensor quantization error: each quantized weight of QUANTIZED against its float original.

A quantized node (``MatMulNBits``, ``GatherBlockQuantized``, ``MatMulBnb4``) is matched to the
reference's float weight by the name of its quantized initializer (bitpress, ONNX Runtime's
quantizers and the GenAI builder name it ``<weight>_Q4`` / ``_Q8`` / ``_Bnb4``; a tied table's
gather data is ``<weight>_Q4_gather``), else by node name (``<float node>_Q4``) and the weight that
float node reads, through a ``Transpose`` for tied LM heads. The quantized bytes are dequantized
with :mod:`bitpress.onnx.layout` (and :mod:`bitpress.onnx.bnb4` for NF4/FP4) and compared in the
orientation the float graph uses them.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import helper

from bitpress.evaluate.result import TensorError
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx import layout
from bitpress.onnx.bnb4 import dequantize_bnb4
from bitpress.onnx.correction import Correction, find_corrections, matmul_nbits_weight
from bitpress.onnx.graph import MS_DOMAIN, consumers, producers

log = logging.getLogger(__name__)

QUANTIZED_OPS = ("MatMulNBits", "GatherBlockQuantized", "MatMulBnb4")
_TENSOR_SUFFIX = re.compile(r"_(?:Q\d+|Bnb4)(?:_gather)?$")
_NODE_SUFFIX = re.compile(r"_(?:Q\d+|Bnb4)$")
_PASS_THROUGH = ("Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten")


def sqnr_db(weight: np.ndarray, dequantized: np.ndarray) -> tuple[float, float, float]:
    """``(SQNR dB, relative error, max abs error)`` of ``dequantized`` against ``weight``."""
    w = weight.astype(np.float64, copy=False).reshape(-1)
    e = dequantized.astype(np.float64, copy=False).reshape(-1) - w
    signal, noise = float(w @ w), float(e @ e)
    max_abs = float(np.abs(e).max()) if e.size else 0.0
    if noise == 0.0:
        return math.inf, 0.0, max_abs
    if signal == 0.0:
        return -math.inf, math.inf, max_abs
    return 10.0 * math.log10(signal / noise), math.sqrt(noise / signal), max_abs


def tensor_errors(
    quantized: OnnxModel, reference: OnnxModel, advance: Callable[[int], Any] | None = None
) -> list[TensorError]:
    """One row per quantized tensor of ``quantized``, in the order its first node appears."""
    qgraph, rgraph = quantized.graph, reference.graph
    q_inits = quantized.initializers()
    r_inits = reference.initializers()
    q_prods = producers(qgraph)
    r_prods = producers(rgraph)
    r_cons = consumers(rgraph)
    r_nodes = {n.name: n for n in rgraph.node if n.name}
    nodes = [n for n in qgraph.node if n.domain == MS_DOMAIN and n.op_type in QUANTIZED_OPS]
    fixes = find_corrections(qgraph)  # float zero points written as block-sum corrections
    rows: dict[str, TensorError] = {}
    for node in nodes:
        source = _source_initializer(node.input[0] if node.op_type == "GatherBlockQuantized" else node.input[1],
                                     q_inits, q_prods)
        key = source or f"<{node.name}>"
        if key in rows:
            # a tied table stored once and read by the LM head and the embedding: one tensor, one row
            rows[key].nodes.append(node.name)
            if advance:
                advance(1)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        row = TensorError([node.name], node.op_type, source or "", None,
                          bits=_bits(node.op_type, attrs), block_size=attrs.get("block_size"))
        rows[key] = row
        try:
            _fill(row, node, attrs, source, quantized, reference, q_inits, r_inits, r_prods, r_cons, r_nodes,
                  fixes.get(node.name))
        except (ValueError, KeyError) as exc:
            # a layout this module does not know: report the tensor, keep going
            row.note = f"cannot dequantize: {exc}"
            log.info("%s: %s", node.name, row.note)
        if advance:
            advance(1)
    return list(rows.values())


def _bits(op_type: str, attrs: dict[str, Any]) -> int | None:
    if op_type == "MatMulBnb4":
        return 4
    return int(attrs.get("bits", 4))


def _source_initializer(name: str, inits: dict[str, onnx.TensorProto], prods: dict[str, onnx.NodeProto]) -> str | None:
    """The initializer behind ``name``, through Reshapes (a tied table's gather view of B)."""
    for _ in range(8):
        if name in inits:
            return name
        node = prods.get(name)
        if node is None or node.op_type not in _PASS_THROUGH:
            return None
        name = node.input[0]
    return None


def _fill(
    row: TensorError, node: onnx.NodeProto, attrs: dict[str, Any], source: str | None,
    quantized: OnnxModel, reference: OnnxModel, q_inits: dict[str, onnx.TensorProto],
    r_inits: dict[str, onnx.TensorProto], r_prods: dict[str, onnx.NodeProto],
    r_cons: dict[str, list[onnx.NodeProto]], r_nodes: dict[str, onnx.NodeProto], fix: Correction | None = None,
) -> None:
    if source is None:
        row.note = "its quantized data is not an initializer"
        return
    weight = _match(node, source, r_inits, r_prods, r_nodes)
    if weight is None:
        row.note = "no float weight found in the reference (matched by initializer and node name)"
        return
    row.weight = weight
    w = np.asarray(reference.array(weight)).astype(np.float32)
    row.shape = [int(d) for d in w.shape]
    deq = _dequantize(node, attrs, source, quantized, q_inits, row, fix)
    if deq is None:
        return
    # a gather dequantizes to the table as stored, [vocab, hidden]; A @ W uses W as [K, N], which the
    # float graph stores as [N, K] when it reads it through Transpose, by Gemm(transB=1) or by Gather
    rows_first = node.op_type != "GatherBlockQuantized" and _stored_rows_first(weight, r_cons)
    float_w = w.T if rows_first else w
    if float_w.shape != deq.shape and float_w.T.shape == deq.shape:
        float_w = float_w.T
    if float_w.shape != deq.shape:
        row.note = f"the float weight is {list(w.shape)} but the quantized one dequantizes to {list(deq.shape)}"
        return
    row.sqnr_db, row.relative_error, row.max_abs_error = sqnr_db(float_w, deq)


def _match(
    node: onnx.NodeProto, source: str, r_inits: dict[str, onnx.TensorProto],
    r_prods: dict[str, onnx.NodeProto], r_nodes: dict[str, onnx.NodeProto],
) -> str | None:
    base = _TENSOR_SUFFIX.sub("", source)
    if base != source and base in r_inits:
        return base
    ref = r_nodes.get(_NODE_SUFFIX.sub("", node.name))
    if ref is None:
        return None
    idx = 0 if ref.op_type == "Gather" else 1
    if len(ref.input) <= idx:
        return None
    name = ref.input[idx]
    if name not in r_inits and name in r_prods and r_prods[name].op_type == "Transpose":
        name = r_prods[name].input[0]
    return name if name in r_inits else None


def _stored_rows_first(weight: str, cons: dict[str, list[onnx.NodeProto]]) -> bool:
    """Whether the float graph stores this matmul weight as [N, K] (output rows first)."""
    for n in cons.get(weight, []):
        if n.op_type in ("Transpose", "Gather"):
            return True
        if n.op_type == "Gemm" and any(a.name == "transB" and a.i for a in n.attribute):
            return True
    return False


def _dequantize(
    node: onnx.NodeProto, attrs: dict[str, Any], source: str, model: OnnxModel,
    inits: dict[str, onnx.TensorProto], row: TensorError, fix: Correction | None = None,
) -> np.ndarray | None:
    def arr(i: int) -> np.ndarray | None:
        if len(node.input) <= i or not node.input[i]:
            return None
        name = node.input[i]
        if name not in inits:
            raise ValueError(f"input {i} ({name}) is not an initializer")
        return np.asarray(model.array(name))

    if node.op_type == "MatMulNBits":
        if arr(4) is not None:
            row.note = "act-order weights (g_idx) are not compared"
            return None
        return matmul_nbits_weight(node, lambda name: np.asarray(model.array(name)), fix)
    data = np.asarray(model.array(source))
    if node.op_type == "GatherBlockQuantized":
        bits, bs = int(attrs.get("bits", 4)), int(attrs.get("block_size", 128))
        if int(attrs.get("gather_axis", 0)) != 0 or int(attrs.get("quantize_axis", 1)) not in (1, -1):
            row.note = "only gather_axis 0 / quantize_axis 1 tables are compared"
            return None
        if data.dtype != np.uint8:
            row.note = f"{data.dtype} gather data is not compared (uint8 only)"
            return None
        vocab = int(data.shape[0])
        packed = data.reshape(vocab, -1)
        scales = arr(2)
        assert scales is not None
        zp = arr(3)
        t = layout.GatherBlockQuantizedTensors(
            packed, scales.reshape(vocab, -1), None if zp is None else zp.reshape(vocab, -1),
            packed.shape[1] * 8 // bits, bits, bs,
        )
        return layout.dequantize_gather_block_quantized(t)
    # MatMulBnb4
    absmax = arr(2)
    assert absmax is not None
    quant = {0: "fp4", 1: "nf4"}.get(int(attrs.get("quant_type", 1)))
    if quant is None:
        row.note = f"unknown quant_type {attrs.get('quant_type')}"
        return None
    return dequantize_bnb4(data, absmax, int(attrs["K"]), int(attrs["N"]), int(attrs["block_size"]), quant)
