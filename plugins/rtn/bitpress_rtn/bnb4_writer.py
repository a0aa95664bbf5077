"""Rewrites float32 MatMul weights as ``com.microsoft.MatMulBnb4`` (NF4 / FP4 codebooks).

Uses the host's planner for selection, tied and shared weights (a table also read by a
Gather is left float: MatMulBnb4 has no Gather twin, and splitting the tie is never done).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx
from onnx import helper

from bitpress.plugin import (
    BNB4_QUANT_TYPES,
    MS_DOMAIN,
    Estimate,
    Group,
    OnnxModel,
    PassContext,
    Plan,
    QuantizationError,
    Report,
    WeightOnlyOptions,
    bnb4_path,
    dequantize_bnb4,
    plan,
    planned_report,
    quantize_bnb4,
)

log = logging.getLogger(__name__)


def bnb4_plan(model: OnnxModel, opts: Any) -> Plan:
    """The host's plan with bnb4's selection; float16/bfloat16 weights stay as they are."""
    selection = WeightOnlyOptions(
        bits=4, block_size=opts.block_size, is_symmetric=True, op_types=["MatMul"],  # absmax: no zero points
        nodes_to_include=opts.nodes_to_include, nodes_to_exclude=opts.nodes_to_exclude,
    )
    p = plan(model, selection)
    inits = model.initializers()
    kept = []
    for group in p.groups:
        if inits[group.weight].data_type != onnx.TensorProto.FLOAT:
            p.skipped[group.weight] = "MatMulBnb4 runs on float32 models only (ORT CPU); kept as is"
        else:
            kept.append(group)
    p.groups = kept
    return p


def bnb4_estimate(opts: Any) -> Estimate:
    """MatMulBnb4's cost: 4-bit codes, two per byte, and a float32 absmax per block of the flat weight."""

    def estimate(group: Group, tensor: onnx.TensorProto) -> tuple[int, str, str]:
        numel = int(np.prod(tensor.dims))
        return (numel + 1) // 2 + 4 * -(-numel // opts.block_size), "none", f"MatMulBnb4 {opts.precision}"

    return estimate


def quantize_bnb4_model(model: Any, opts: Any, context: PassContext, planned: Plan | None = None) -> Report:
    if not isinstance(model, OnnxModel):
        raise QuantizationError(f"bnb4 quantizes ONNX models, got {model.kind}")
    p = planned if planned is not None else bnb4_plan(model, opts)
    report = planned_report(model, p, bnb4_estimate(opts), lambda group: bnb4_path("cpu"))
    report.planned = False
    for warning in p.unmatched:
        log.warning("%s: %s", model.source.name, warning)
    inits = model.initializers()
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    new_inits = []
    with context.step(len(p.groups), "quantizing") as advance:
        for group in p.groups:
            tensor = inits[group.weight]
            w = np.asarray(model.array(tensor), dtype=np.float32)
            if group.uses[0].kind == "matmul_t":
                w = w.T  # B = Transpose(T): the MatMul weight is T^T
            k, n = w.shape
            packed, absmax = quantize_bnb4(w, opts.block_size, opts.precision)
            b_name, s_name = f"{group.weight}_Bnb4", f"{group.weight}_absmax"
            new_inits += [model.make_tensor(b_name, packed), model.make_tensor(s_name, absmax.astype(np.float32))]
            for u in group.uses:
                replace[id(u.node)] = helper.make_node(
                    "MatMulBnb4", [u.node.input[0], b_name, s_name], list(u.node.output),
                    name=f"{u.node.name}_Bnb4", domain=MS_DOMAIN, K=k, N=n, block_size=opts.block_size,
                    quant_type=BNB4_QUANT_TYPES[opts.precision],
                )
                if u.transpose is not None:
                    drop.add(id(u.transpose))
            report.quantized += 1
            report.weights += k * n
            report.stored_bytes += packed.nbytes + absmax.size * 4  # absmax is written as float32
            deq = dequantize_bnb4(packed, absmax, k, n, opts.block_size, opts.precision)
            report.record(group.weight, float(np.linalg.norm(deq - w) / (np.linalg.norm(w) or 1.0)))
            del deq
            advance(1)
    nodes = []
    for node in model.graph.node:
        if id(node) not in drop:
            nodes.append(replace.get(id(node), node))
    copies = [onnx.NodeProto() for _ in nodes]
    for dst, src in zip(copies, nodes, strict=True):
        dst.CopyFrom(src)
    del model.graph.node[:]
    model.graph.node.extend(copies)
    model.graph.initializer.extend(new_inits)
    model.remove_unused_initializers()
    if not p.groups:
        log.warning("no weights to quantize in %s: %s", model.source.name, report.summary())
    return report
