"""Calibrated experts: GPTQ / AWQ statistics for each expert of a MoE node, from the tokens routed to it.

A MoE node's input ``x`` and router logits are read on the calibration data (an ONNX Runtime
session of the model as it is then: the dense weights already quantized, and - ``sequential`` -
the earlier MoE nodes already written as ``QMoE``). Each token goes to the top-``k`` experts of
its logits (the node's ``k``; softmax keeps the order), so expert ``e`` sees only its own rows of
``x``: its ``fc1`` / ``fc3`` are solved on their statistics, then its ``fc2`` on the activation
those rows give through the *quantized* ``fc1`` (GPTQ's order inside a layer).

An expert the calibration data routes fewer tokens to than ``expert_min_tokens`` (default: its
input width, below which its Hessian cannot have full rank) would be fitted to a handful of
tokens; it is rounded by the pass's calibration-free block solver instead, and the run report
names it with its token count.

AWQ's input scaling is not applied to experts: every expert reads the same ``x``, and QMoE has no
per-expert input scale to fold one into; its clipping search (the calibrated solver) is.
The routed rows of one node are held in memory (tokens x hidden, float32) while its experts are
solved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from bitpress.errors import QuantizationError, one_line
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx import layout
from bitpress.onnx.activations import prune, relocate, session_for
from bitpress.onnx.calibrated.stats import StatsAccumulator
from bitpress.onnx.tensors import np_dtype
from bitpress.onnx.weightonly import qmoe
from bitpress.onnx.weightonly.moe import ExpertGroup, attrs_of, input_of
from bitpress.onnx.weightonly.solving import Solved
from bitpress.quant.calibrated import CalibratedSolver, LayerStats, Target, output_error
from bitpress.quant.solver import BlockSolver, BlockSpec, QuantizedBlocks, dequantize

log = logging.getLogger("bitpress.onnx.calibrated")


@dataclass
class Starved:
    """An expert rounded without calibration: too few of the calibration tokens were routed to it."""

    node: str
    expert: int
    tokens: int
    needed: int

    def text(self) -> str:
        return f"{self.node} expert {self.expert}: {self.tokens} calibration tokens (< {self.needed})"


@dataclass
class ExpertsSolved:
    """One node's solved expert tensors, their errors, and the experts that fell back."""

    solved: dict[str, Solved]
    output_errors: dict[str, float] = field(default_factory=dict)  # role -> relative layer-output error
    starved: list[Starved] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # per expert


def capture(model: OnnxModel, group: ExpertGroup, feeds: list[dict[str, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The node's input ``x`` ``[tokens, hidden]`` and router logits ``[tokens, E]`` over every feed."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    graph = proto.graph
    wanted = [group.node.input[0], group.node.input[1]]
    del graph.output[:]
    graph.output.extend(onnx.ValueInfoProto(name=n) for n in wanted)
    prune(graph)
    base = relocate(proto, model)
    session = session_for(proto.SerializeToString(), base)
    names = {i.name for i in session.get_inputs()}
    xs, ls = [], []
    for feed in feeds:
        try:
            x, logits = session.run(wanted, {k: v for k, v in feed.items() if k in names})
        except Exception as exc:  # ORT raises its own pybind exception types
            raise QuantizationError(f"cannot run the model on the calibration data to reach {group.name}: "
                                    f"{one_line(exc)}") from None
        xs.append(np.asarray(x, np.float32).reshape(-1, group.hidden))
        ls.append(np.asarray(logits, np.float32).reshape(-1, group.experts))
    return np.concatenate(xs), np.concatenate(ls)


def routed(logits: np.ndarray, k: int) -> np.ndarray:
    """bool ``[tokens, E]``: the top-``k`` experts of each token (ties: the lower index, as a stable sort)."""
    order = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    mask = np.zeros(logits.shape, bool)
    np.put_along_axis(mask, order, True, axis=1)
    return mask


def activation(group: ExpertGroup, h1: np.ndarray, h3: np.ndarray | None) -> np.ndarray:
    """The expert's activation of its fc1 (and fc3) outputs, in the source's layout: fc2's input."""
    attrs = attrs_of(group.node)
    act = attrs.get("activation_type", b"relu")
    act = act.decode() if isinstance(act, bytes) else str(act)
    if act == "swiglu":
        alpha = float(attrs.get("activation_alpha", 1.0))
        beta = float(attrs.get("activation_beta", 0.0))
        if group.fusion == 1:
            g, lin = h1[:, 0::2], h1[:, 1::2]
        elif group.fusion == 2:
            g, lin = h1[:, : group.inter], h1[:, group.inter :]
        else:
            assert h3 is not None
            g, lin = h1, h3
        limit = attrs.get("swiglu_limit")
        if limit is not None:
            g, lin = np.minimum(g, float(limit)), np.clip(lin, -float(limit), float(limit))
        return g * _sigmoid(alpha * g) * (lin + beta)
    if act == "silu":
        return h1 * _sigmoid(h1)
    if act == "gelu":  # the tanh form: statistics only, within 1e-3 of the exact one
        return 0.5 * h1 * (1 + np.tanh(0.7978845608 * (h1 + 0.044715 * h1**3)))
    if act == "relu":
        return np.maximum(h1, 0)
    return h1


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * x))


def _stats(rows: np.ndarray, needs: frozenset[str]) -> LayerStats:
    acc = StatsAccumulator(needs | {"hessian"}, 1)
    acc.add(rows)
    return acc.result()


def solve_experts(
    model: OnnxModel, group: ExpertGroup, x: np.ndarray, logits: np.ndarray, solver: CalibratedSolver,
    fallback: BlockSolver, min_tokens: int | None,
) -> ExpertsSolved:
    """Every expert of ``group`` solved on the rows routed to it (or rounded by ``fallback`` when starved)."""
    spec = BlockSpec(group.bits, group.block_size, group.symmetric, False)
    k_top = int(attrs_of(group.node).get("k", 1))
    mask = routed(logits, k_top)
    readers = {role: qmoe.task(model, group, role).source.row_reader() for role in group.weights}
    biases = {role: model.array(b).astype(np.float32) for role in ("fc1", "fc3")
              if (b := input_of(group.node, {"fc1": 3, "fc3": 7}[role]))}
    out: dict[str, dict[str, Any]] = {}
    err_num = dict.fromkeys(group.weights, 0.0)
    err_den = dict.fromkeys(group.weights, 0.0)
    out_num = dict.fromkeys(group.weights, 0.0)
    out_den = dict.fromkeys(group.weights, 0.0)
    result = ExpertsSolved({})
    for role in group.weights:
        e, n, k = group.shape(role)
        nb = k // group.block_size
        out[role] = {"packed": np.empty((e * n, nb, group.block_size * group.bits // 8), np.uint8),
                     "scales": np.empty((e * n, nb), np.float32),
                     "zps": None if group.symmetric else np.empty((e * n, nb), np.uint8)}
    needed = group.hidden if min_tokens is None else min_tokens
    for ex in range(group.experts):
        rows = x[mask[:, ex]]
        result.tokens.append(len(rows))
        w = {}
        for role in group.weights:
            _, n, k = group.shape(role)
            w[role] = np.array(readers[role](ex * n, (ex + 1) * n), np.float32).reshape(n, k)
        starved = len(rows) < max(needed, 1)
        if starved:
            result.starved.append(Starved(group.name, ex, len(rows), needed))
        solved: dict[str, QuantizedBlocks] = {}
        first = [r for r in ("fc1", "fc3") if r in w]
        st1 = None if starved else _stats(rows, solver.needs)
        prep = None if st1 is None else solver.prepare(st1, spec)
        for role in first:
            solved[role] = _solve(w[role], spec, solver, prep, fallback, Target(group.weights[role], (group.name,)))
        deq = {r: dequantize(solved[r], group.bits).reshape(w[r].shape) for r in first}
        st2 = None
        if not starved:
            h1 = rows @ deq["fc1"].T + (biases["fc1"][ex] if "fc1" in biases else 0)
            h3 = None if "fc3" not in deq else rows @ deq["fc3"].T + (biases["fc3"][ex] if "fc3" in biases else 0)
            st2 = _stats(activation(group, h1, h3).astype(np.float32), solver.needs)
        prep2 = None if st2 is None else solver.prepare(st2, spec)
        solved["fc2"] = _solve(w["fc2"], spec, solver, prep2, fallback, Target(group.weights["fc2"], (group.name,)))
        deq["fc2"] = dequantize(solved["fc2"], group.bits).reshape(w["fc2"].shape)
        for role, q in solved.items():
            _, n, _ = group.shape(role)
            sl = slice(ex * n, (ex + 1) * n)
            out[role]["packed"][sl] = layout.pack_along_last(q.q, group.bits)
            out[role]["scales"][sl] = q.scales
            if out[role]["zps"] is not None:
                out[role]["zps"][sl] = q.zero_points
            d = deq[role] - w[role]
            err_num[role] += float(np.vdot(d, d))
            err_den[role] += float(np.vdot(w[role], w[role]))
            st = st2 if role == "fc2" else st1
            if st is not None:
                out_num[role] += output_error(st, d) * st.rows
                out_den[role] += output_error(st, w[role]) * st.rows
    for role, name in group.weights.items():
        _, _, k = group.shape(role)
        o = out[role]
        dtype = np_dtype(model.initializers()[name])
        rel = (err_num[role] / err_den[role]) ** 0.5 if err_den[role] else 0.0
        result.solved[role] = Solved(o["packed"], o["scales"], o["zps"], k, dtype, rel)
        if out_den[role]:
            result.output_errors[role] = (out_num[role] / out_den[role]) ** 0.5
    return result


def _solve(w: np.ndarray, spec: BlockSpec, solver: CalibratedSolver, prepared: Any, fallback: BlockSolver,
           target: Target) -> QuantizedBlocks:
    rows, k = w.shape
    if prepared is None:
        out = fallback(w.reshape(rows, k // spec.block_size, spec.block_size), spec)
    else:
        out = solver.solve(w, spec, prepared, target)
    if out.zero_points is not None and out.zero_points.dtype != np.uint8:
        raise QuantizationError(f"the solver returned float zero points for the experts of {target.weight}; QMoE "
                                "stores integer zero points")
    return out
