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

from bitpress.errors import QuantizationError
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.graph import MS_DOMAIN
from bitpress.onnx.weightonly import Report, WeightOnlyOptions, plan
from bitpress.passes import PassContext
from bitpress_rtn.bnb4 import BNB4_QUANT_TYPES, quantize_bnb4

log = logging.getLogger(__name__)


def quantize_bnb4_model(model: Any, opts: Any, context: PassContext) -> Report:
    if not isinstance(model, OnnxModel):
        raise QuantizationError(f"bnb4 quantizes ONNX models, got {model.kind}")
    selection = WeightOnlyOptions(
        bits=4, block_size=opts.block_size, op_types=["MatMul"],
        nodes_to_include=opts.nodes_to_include, nodes_to_exclude=opts.nodes_to_exclude,
    )
    p = plan(model, selection)
    report = Report(skipped=dict(p.skipped))
    inits = model.initializers()
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    new_inits = []
    with context.step(len(p.groups), "quantizing") as advance:
        for group in p.groups:
            tensor = inits[group.weight]
            if tensor.data_type != onnx.TensorProto.FLOAT:
                report.skipped[group.weight] = "MatMulBnb4 runs on float32 models only (ORT CPU); kept as is"
                advance(1)
                continue
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
    return report
