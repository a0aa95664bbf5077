"""What a weight-only pass does to each weight: planned before the run (``--plan``), measured after it.

One :class:`Report` serves both: :func:`planned_report` builds it from the same
:func:`~bitpress.onnx.weightonly.planning.plan` the run uses (one :class:`WeightRow` per
candidate weight: ops, shape, bits, block size, zero points, tie, or why it stays float, and the
bits per weight its layout will store), and the run fills in what it measured (bytes written,
relative error).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx

from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx import kernels
from bitpress.onnx.tensors import np_dtype
from bitpress.onnx.weightonly.moe import ExpertGroup
from bitpress.onnx.weightonly.planning import FLOAT_TYPES, Group, Plan, WeightOnlyOptions, zero_point_kind
from bitpress.onnx.weightonly.writing import planned_bytes

#: (group, tensor) -> (bytes stored, zero-point kind, ops written): a layout's cost, known before solving
Estimate = Callable[[Group, onnx.TensorProto], tuple[int, str, str]]
#: group -> the ONNX Runtime kernel its MatMul will run on (:mod:`bitpress.onnx.kernels`)
KernelOf = Callable[[Group], kernels.KernelPath]


@dataclass
class WeightRow:
    """One weight (or a node skipped before its weight was known) and what the pass does with it."""

    weight: str
    ops: list[str]  # "MatMul /model/layers.0/mlp/down_proj/MatMul", one per reading node
    shape: list[int]
    dtype: str
    quantized: bool  # planned (or, after a run, done)
    bits: int | None = None
    block_size: int | None = None
    symmetric: bool | None = None
    zero_points: str | None = None  # none / uint8 / float
    writes: str | None = None  # the ops that will read it: MatMulNBits, GatherBlockQuantized, ...
    kernel: str | None = None  # the ONNX Runtime kernel it will run on (bitpress.onnx.kernels), on the target
    slow: bool = False  # that kernel dequantizes the weight on every call (slower than float)
    tied: bool = False  # one table read by Gather and MatMul (embedding + LM head), stored once
    experts: int | None = None  # a MoE node's expert tensor: how many experts it holds (written as QMoE)
    reason: str | None = None  # why it stays float
    note: str | None = None  # a setting the planner adjusted, or why a preset chose these bits
    expected_bits: float | None = None  # bits per weight its layout stores (integers + scales + zero points)
    error: float | None = None  # measured relative error (after a run)
    #: calibrated passes: ||x (W - Q)|| / ||x W|| over the calibration tokens (the layer's output error)
    output_error: float | None = None

    @property
    def kind(self) -> str:
        """The reading ops, compact: ``Gather+MatMul``."""
        return "+".join(dict.fromkeys(op.split(" ", 1)[0] for op in self.ops)) or "?"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    quantized: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)  # weight -> relative error
    output_errors: dict[str, float] = field(default_factory=dict)  # weight -> relative layer-output error
    weights: int = 0  # float weights quantized
    stored_bytes: int = 0  # bytes of integers, scales and zero points written for them
    #: one row per candidate weight (empty for reports that do not plan, e.g. the Hugging Face passes)
    rows: list[WeightRow] = field(default_factory=list)
    planned: bool = False  # True: a dry run (--plan); nothing was quantized
    planned_groups: int = 0  # weights the plan quantizes
    planned_weights: int = 0  # their elements
    planned_bytes: int = 0  # the bytes their layouts store
    #: elements and bytes of every other float initializer (float weights left, norms, biases, tables)
    float_left_weights: int | None = None
    float_left_bytes: int = 0
    unmatched: list[str] = field(default_factory=list)  # selection patterns that matched nothing
    notes: list[str] = field(default_factory=list)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.stored_bytes / self.weights if self.weights else 0.0

    @property
    def expected_bits_per_weight(self) -> float:
        """Bits per quantized weight the plan's layouts store: bits + scales and zero points per block."""
        return 8 * self.planned_bytes / self.planned_weights if self.planned_weights else 0.0

    def model_bits_per_weight(self, planned: bool | None = None) -> float | None:
        """Bits per float parameter over the whole graph: quantized weights as stored, the rest as they are."""
        if self.float_left_weights is None:
            return None
        planned = self.planned if planned is None else planned
        if planned:
            q_bytes, q_weights = self.planned_bytes, self.planned_weights
        else:
            q_bytes, q_weights = self.stored_bytes, self.weights
        total = q_weights + self.float_left_weights
        return 8 * (q_bytes + self.float_left_bytes) / total if total else None

    def _cost(self, planned: bool) -> str:
        bpw = self.expected_bits_per_weight if planned else self.bits_per_weight
        text = f"{bpw:.2f} bits per weight"
        if not planned and self.planned_weights and abs(bpw - self.expected_bits_per_weight) > 0.005:
            text += f", {self.expected_bits_per_weight:.2f} planned"
        model = self.model_bits_per_weight(planned)
        if model is not None:
            left = _count(self.float_left_weights or 0)
            text += f"; {model:.2f} over every float tensor, {left} parameters left float"
        return text

    def summary(self) -> str:
        n = self.planned_groups if self.planned else self.quantized
        if n == 0:
            text = "would quantize no weights" if self.planned else "quantized no weights"
            why = self.unmatched[:1] or ([f"{len(self.skipped)} left in float (see -v)"] if self.skipped else [])
            if not self.skipped and not self.unmatched:
                why = ["nothing matched the selection" if self.rows else "the model has no MatMul/Gemm/Gather weights"]
            return f"{text}: the weights stay float ({'; '.join(why)})"
        verb = "would quantize" if self.planned else "quantized"
        text = f"{verb} {n} weights ({self._cost(self.planned)})"
        if self.errors:
            worst = max(self.errors.items(), key=lambda kv: kv[1])
            mean = sum(self.errors.values()) / len(self.errors)
            text += f", relative weight error mean {mean:.4f}, worst {worst[1]:.4f} ({worst[0]})"
        if self.output_errors:
            worst = max(self.output_errors.items(), key=lambda kv: kv[1])
            mean = sum(self.output_errors.values()) / len(self.output_errors)
            text += f", layer-output error on the calibration data mean {mean:.4f}, worst {worst[1]:.4f} ({worst[0]})"
        if self.skipped:
            text += f"; {len(self.skipped)} left in float (see -v)"
        if self.unmatched:
            text += f"; {len(self.unmatched)} selection pattern(s) matched nothing"
        return text

    def to_json(self) -> dict[str, Any]:
        model_bpw = self.model_bits_per_weight()
        return {
            "planned": self.planned,
            "quantized": self.planned_groups if self.planned else self.quantized,
            "quantized_elements": self.planned_weights if self.planned else self.weights,
            "stored_bytes": self.planned_bytes if self.planned else self.stored_bytes,
            "bits_per_weight": round(self.expected_bits_per_weight if self.planned else self.bits_per_weight, 4),
            "expected_bits_per_weight": round(self.expected_bits_per_weight, 4),
            "model_bits_per_weight": None if model_bpw is None else round(model_bpw, 4),
            "float_left_elements": self.float_left_weights,
            "left_float": len(self.skipped),
            "unmatched_patterns": list(self.unmatched),
            "notes": list(self.notes),
            "weights": [r.to_json() for r in self.rows],
        }

    # -- filled in by the run -------------------------------------------------------------------------
    def record(self, weight: str, error: float) -> None:
        self.errors[weight] = error
        for row in self.rows:
            if row.weight == weight:
                row.error = error

    def record_output(self, weight: str, error: float) -> None:
        self.output_errors[weight] = error
        for row in self.rows:
            if row.weight == weight:
                row.output_error = error


def nbits_estimate(float_zero_points: bool, float_zero_point_form: str = "correction") -> Estimate:
    """The cost of the host's MatMulNBits / GatherBlockQuantized layouts (a block-sum correction stores
    as many bytes as the float zero points it replaces)."""

    def estimate(group: Group, tensor: onnx.TensorProto) -> tuple[int, str, str]:
        zp = zero_point_kind(group, float_zero_points)
        ops = dict.fromkeys("GatherBlockQuantized" if u.is_gather else "MatMulNBits" for u in group.uses)
        corrected = zp == "float" and float_zero_point_form == "correction" and "MatMulNBits" in ops
        if corrected:
            ops["correction"] = None
        return planned_bytes(group, tensor, zp, corrected), zp, "+".join(ops)

    return estimate


def nbits_kernel(opts: WeightOnlyOptions, float_zero_points: bool) -> KernelOf:
    """The kernel each group written by the host's :class:`~bitpress.onnx.weightonly.Writer` runs on."""
    level = opts.resolved_accuracy_level()

    def kernel(group: Group | ExpertGroup) -> kernels.KernelPath:
        if isinstance(group, ExpertGroup):
            return kernels.qmoe_path(group.bits, level, target=opts.target)
        if all(u.is_gather for u in group.uses):
            return kernels.KernelPath("gather")
        zp = zero_point_kind(group, float_zero_points)
        corrected = zp == "float" and opts.float_zero_point_form == "correction"
        return kernels.matmul_nbits_path(group.bits, level, "uint8" if corrected else zp, target=opts.target,
                                         corrected=corrected)

    return kernel


def planned_report(model: OnnxModel, p: Plan, estimate: Estimate, kernel: KernelOf | None = None) -> Report:
    """A :class:`Report` of what ``p`` will do to ``model`` (``planned=True``); reads no weight data.

    ``kernel``: the ONNX Runtime kernel of each planned group (the plan's ``kernel`` column)."""
    inits = model.initializers()
    groups = {g.weight: g for g in p.groups}
    rows: list[WeightRow] = []
    report = Report(skipped=dict(p.skipped), planned=True, unmatched=list(p.unmatched))
    seen: set[str] = set()
    slow: dict[tuple[str, str | None, str | None], list[str]] = {}
    for weight, uses in p.uses.items():
        tensor = inits[weight]
        seen.add(weight)
        ops = [f"{u.node.op_type} {u.node.name or u.node.output[0]}" for u in uses]
        tied = any(u.is_gather for u in uses) and any(not u.is_gather for u in uses)
        row = WeightRow(weight, ops, [int(d) for d in tensor.dims], _dtype_name(tensor), weight in groups,
                        tied=tied, note=p.notes.get(weight))
        g = groups.get(weight)
        if g is not None:
            nbytes, zp, writes = estimate(g, tensor)
            numel = int(np.prod(tensor.dims))
            row.bits, row.block_size, row.symmetric, row.zero_points, row.writes = (
                g.bits, g.block_size, g.symmetric, zp, writes)
            row.expected_bits = 8 * nbytes / numel if numel else 0.0
            if kernel is not None:
                path = kernel(g)
                row.kernel, row.slow = path.label, path.slow
                if path.slow:
                    slow.setdefault((path.label, path.reason, path.fix), []).append(weight)
            report.planned_groups += 1
            report.planned_weights += numel
            report.planned_bytes += nbytes
        else:
            row.reason = p.skipped.get(weight) or p.excluded.get(weight) or "not selected"
        rows.append(row)
    for what, why in p.skipped.items():  # nodes skipped before a weight was known (Gemm transA, 3-D weights...)
        if what not in seen:
            node = next((n for n in model.graph.node if (n.name or n.output[0]) == what), None)
            ops = [f"{node.op_type} {what}"] if node is not None else []
            rows.append(WeightRow(what, ops, [], "", False, reason=why))
    quantized = set(groups) | _expert_rows(p, inits, rows, report, kernel, slow)
    report.rows = rows
    report.notes += p.advice
    for (label, reason, fix), weights in slow.items():
        report.notes.append(
            f"{len(weights)} weight(s) will run on ONNX Runtime's slow path ({label}; {weights[0]}"
            + (f" and {len(weights) - 1} more" if len(weights) > 1 else "") + f"): {reason}"
            + (f"; to avoid it: {fix}" if fix else ""))
    left_n = left_b = 0
    for name, t in inits.items():
        if name in quantized or t.data_type not in FLOAT_TYPES:
            continue
        n = int(np.prod(t.dims)) if len(t.dims) else 1
        left_n += n
        left_b += n * np_dtype(t).itemsize
    report.float_left_weights, report.float_left_bytes = left_n, left_b
    return report


def _expert_rows(p: Plan, inits: dict[str, onnx.TensorProto], rows: list[WeightRow], report: Report,
                 kernel: KernelOf | None, slow: dict[tuple[str, str | None, str | None], list[str]]) -> set[str]:
    """One row per expert tensor of each MoE node (planned, excluded or left float); the planned weights."""
    planned: set[str] = set()
    for g in p.experts.groups:
        path = kernel(g) if kernel is not None else None  # type: ignore[arg-type]
        for role, weight in g.weights.items():
            tensor = inits[weight]
            numel = g.numel(role)
            nbytes = g.stored_bytes(role, 2 if tensor.data_type == onnx.TensorProto.FLOAT16 else 4)
            row = WeightRow(weight, [f"{g.node.op_type} {g.name} ({role})"], [int(d) for d in tensor.dims],
                            _dtype_name(tensor), True, g.bits, g.block_size, g.symmetric,
                            "none" if g.symmetric else "uint8", "QMoE", experts=g.experts, note=g.note,
                            expected_bits=8 * nbytes / numel if numel else 0.0)
            if path is not None:
                row.kernel, row.slow = path.label, path.slow
                if path.slow:
                    slow.setdefault((path.label, path.reason, path.fix), []).append(weight)
            rows.append(row)
            planned.add(weight)
            report.planned_groups += 1
            report.planned_weights += numel
            report.planned_bytes += nbytes
    for weight, node in p.experts.tensors.items():
        if weight in planned:
            continue
        name = node.name or node.output[0]
        tensor = inits[weight]
        reason = p.experts.excluded.get(name) or p.experts.skipped.get(name) or "not selected"
        rows.append(WeightRow(weight, [f"{node.op_type} {name}"], [int(d) for d in tensor.dims], _dtype_name(tensor),
                              False, experts=int(tensor.dims[0]), reason=reason))
    for name, why in p.experts.skipped.items():
        report.skipped[name] = why
        if not any((n.name or n.output[0]) == name for n in p.experts.tensors.values()):
            rows.append(WeightRow(name, [f"MoE {name}"], [], "", False, reason=why))
    return planned


def _dtype_name(tensor: onnx.TensorProto) -> str:
    name = onnx.TensorProto.DataType.Name(tensor.data_type).lower()
    return "float32" if name == "float" else name


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)
