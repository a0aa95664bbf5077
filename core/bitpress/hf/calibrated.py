"""Calibrated weight-only quantization of PyTorch (Hugging Face) models: GPTQ, AWQ, third parties'.

A plugin supplies a :class:`~bitpress.quant.calibrated.CalibratedSolver` (and optionally an
:class:`~bitpress.quant.calibrated.InputScaler`) by subclassing :class:`CalibratedHfPass`; the
host does the rest, the way AutoGPTQ does it but on CPU torch:

1. :func:`~bitpress.hf.quantize.plan` picks the targets (rules, overrides, category flags, ties);
2. the calibration batches (``--data``) run through the embedding only, to capture what the first
   decoder block receives (:func:`~bitpress.hf.layer_inputs.capture`);
3. for each block: its target linears' input statistics are collected over every batch, one set
   per distinct input (q/k/v share one); with a scaler, each input's scales are searched and
   applied exactly (:mod:`bitpress.hf.scaling`); each linear is solved and its weight replaced by a
   :class:`~bitpress.hf.qtensor.QuantTensor`; then (``sequential``) the block runs again, now
   quantized, and its outputs are the next block's inputs. ``sequential=False``: the next inputs
   are the float block's outputs (the statistics of the float model, one forward's cost);
4. targets outside the blocks (the LM head) get their statistics from one more forward in which
   the blocks replay their recorded outputs; embedding tables (no input statistics) are rounded
   by the pass's block solver, as are linears no calibration token reached (unrouted experts).

Memory: the hidden states of every batch (samples x seq_len x hidden floats, logged) plus one
block's statistics at a time. A tied LM head solved by a calibrated solver is the one table the
embedding reads too (one QuantTensor for both modules).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from threadpoolctl import threadpool_limits
from torch import nn

from bitpress.errors import QuantizationError
from bitpress.hf import scaling
from bitpress.hf.layer_inputs import (
    Batch,
    InputGroup,
    InputRecorder,
    LayerCall,
    call_layer,
    capture,
    find_layers,
    held_bytes,
    model_kwargs,
    stand_ins,
)
from bitpress.hf.qtensor import QuantSpec, QuantTensor
from bitpress.hf.quantize import Job, Plan, _untie_config, apply
from bitpress.interrupts import cancel_pending
from bitpress.onnx.weightonly import Report
from bitpress.quant.calibrated import (
    CalibratedSolver,
    InputScaler,
    LayerStats,
    Target,
    output_error,
    warn_rank_deficient,
)
from bitpress.quant.solver import BlockSolver, BlockSpec, QuantizedBlocks, dequantize

log = logging.getLogger(__name__)

#: weight elements handed to one ``solve`` call at most (slabs of rows; several run at once)
SLAB_ELEMENTS = 1 << 23
#: output rows the reported output error is computed on (evenly spaced; exact from the Hessian)
ERROR_ROWS = 256


@dataclass
class Method:
    """What a calibrated pass plugs in: the solver, an optional input scaler (AWQ), and the block
    solver for what has no input statistics (embedding tables, linears no token reached)."""

    solver: CalibratedSolver
    block_solver: BlockSolver
    scaler: InputScaler | None = None

    @property
    def needs(self) -> frozenset[str]:
        return frozenset(self.solver.needs) | (frozenset(self.scaler.needs) if self.scaler else frozenset())


@dataclass
class CalibratedReport(Report):
    """:class:`~bitpress.onnx.weightonly.Report` (``output_errors``: per weight ``||X (W - Q)|| / ||X W||``
    on the calibration tokens, its input as the solver saw it) plus how many inputs were scaled."""

    scaled_inputs: int = 0  # inputs an InputScaler scaled (folded exactly)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out["output_errors"] = dict(self.output_errors)
        out["scaled_inputs"] = self.scaled_inputs
        return out


@dataclass
class _Linear:
    name: str  # the module's name in the model
    module: nn.Module
    job: Job


# -- solving one weight -------------------------------------------------------------------------------
def _spec(job: Job) -> BlockSpec:
    s = job.settings
    return BlockSpec(s.bits, s.group_size, s.symmetric, job.zero_points == "float")


def _check_answer(res: QuantizedBlocks, rows: int, nb: int, spec: BlockSpec, name: str) -> None:
    if res.q.shape != (rows, nb, spec.block_size) or res.q.dtype != np.uint8 or (
            res.q.size and int(res.q.max()) >= 2**spec.bits):
        raise QuantizationError(f"the calibrated solver returned malformed integers for {name} "
                                f"(expected uint8 {[rows, nb, spec.block_size]} below {2**spec.bits})")
    if res.scales.shape != (rows, nb) or not np.isfinite(res.scales).all():
        raise QuantizationError(f"the calibrated solver returned malformed or non-finite scales for {name}")
    if spec.symmetric != (res.zero_points is None) or (
            res.zero_points is not None and res.zero_points.shape != (rows, nb)):
        raise QuantizationError(f"the calibrated solver's zero points for {name} do not match "
                                f"{'symmetric' if spec.symmetric else 'asymmetric'} blocks")


class _Solver:
    """Solves linears with one method: ``prepare`` once per input and layout, slabs on a thread pool."""

    def __init__(self, method: Method, report: CalibratedReport, jobs: int,
                 progress: Callable[[int], None] | None, scale_only: bool = False) -> None:
        self.method, self.report, self.jobs, self.progress = method, report, max(1, jobs), progress
        self.scale_only = scale_only
        self.thin: dict[int, tuple[str, int, int]] = {}  # inputs whose Hessian saw fewer tokens than channels

    def solve(self, items: list[tuple[_Linear, LayerStats | None]]) -> None:
        """Quantize each linear with its input's statistics (None: the block solver, no statistics)."""
        if self.scale_only:
            return
        for lin, stats in items:
            if stats is not None and stats.rank_deficient:  # one entry per input (its linears share the stats)
                self.thin.setdefault(id(stats), (lin.name, stats.rows, stats.channels))
        prepared: dict[tuple[int, BlockSpec], Any] = {}
        tasks: list[tuple[int, int, int]] = []  # (item, row0, row1)
        weights: list[np.ndarray] = []
        for i, (lin, stats) in enumerate(items):
            spec = _spec(lin.job)
            w = lin.job.param.detach().to(torch.float32).numpy()
            if not np.isfinite(w).all():
                raise QuantizationError(f"{lin.job.name} holds NaN or infinite values; cannot quantize it")
            rows, k = w.shape
            kp = -(-k // spec.block_size) * spec.block_size
            wp = np.zeros((rows, kp), np.float32)
            wp[:, :k] = w
            weights.append(wp)
            if stats is not None and (id(stats), spec) not in prepared:
                prepared[(id(stats), spec)] = self.method.solver.prepare(stats.padded(kp), spec)
            step = max(1, min(-(-rows // self.jobs), SLAB_ELEMENTS // kp))
            tasks += [(i, r, min(rows, r + step)) for r in range(0, rows, step)]

        def run(task: tuple[int, int, int]) -> QuantizedBlocks:
            i, r0, r1 = task
            lin, stats = items[i]
            spec, wp = _spec(lin.job), weights[i]
            if stats is None:
                return self.method.block_solver(wp[r0:r1].reshape(r1 - r0, -1, spec.block_size), spec, None)
            target = Target(lin.job.name, (lin.name,))
            return self.method.solver.solve(wp[r0:r1], spec, prepared[(id(stats), spec)], target)

        parts: dict[int, list[tuple[int, QuantizedBlocks]]] = {}
        # the slabs run on bitpress's threads: numpy's BLAS gets one thread each meanwhile (OpenBLAS's own
        # threads on top oversubscribe the cores); torch's forwards (OpenMP) are not affected
        limit = threadpool_limits(1, user_api="blas") if self.jobs > 1 else nullcontext()
        with limit, ThreadPoolExecutor(self.jobs) as pool, cancel_pending(pool):
            for task, res in zip(tasks, pool.map(run, tasks), strict=True):
                i, r0, r1 = task
                spec = _spec(items[i][0].job)
                _check_answer(res, r1 - r0, weights[i].shape[1] // spec.block_size, spec, items[i][0].job.name)
                parts.setdefault(i, []).append((r0, res))
        for i, (lin, stats) in enumerate(items):
            chunks = [res for _, res in sorted(parts.get(i, []), key=lambda t: t[0])]
            zps = [c.zero_points for c in chunks]
            blocks = QuantizedBlocks(np.concatenate([c.q for c in chunks]), np.concatenate([c.scales for c in chunks]),
                                     None if zps[0] is None else np.concatenate(zps))  # type: ignore[arg-type]
            self._store(lin, blocks, weights[i], stats)

    def _store(self, lin: _Linear, blocks: QuantizedBlocks, wp: np.ndarray, stats: LayerStats | None) -> None:
        job, s = lin.job, lin.job.settings
        k = int(job.param.shape[-1])
        qspec = QuantSpec(s.bits, s.group_size, s.symmetric, tuple(job.param.shape), job.param.dtype, job.zero_points)
        tensor = QuantTensor.from_blocks(blocks, qspec)
        w = wp[:, :k]
        deq = dequantize(blocks, s.bits).reshape(w.shape[0], -1)[:, :k]
        delta = w - deq
        den = float(np.einsum("ij,ij->", w, w, dtype=np.float64))
        rep = self.report
        num = float(np.einsum("ij,ij->", delta, delta, dtype=np.float64))
        rep.errors[job.name] = (num / den) ** 0.5 if den else 0.0
        if stats is not None:
            rows = np.unique(np.linspace(0, w.shape[0] - 1, min(w.shape[0], ERROR_ROWS)).astype(np.int64))
            ref = output_error(stats, w[rows])
            rep.record_output(job.name, (output_error(stats, delta[rows]) / ref) ** 0.5 if ref > 0 else 0.0)
        else:
            rep.notes.append(f"{job.name}: no calibration token reached it; rounded by the block solver")
        new = nn.Parameter(tensor, requires_grad=False)
        for ep in job.quantized:
            setattr(ep.module, ep.attr, new)  # every quantized endpoint (a tied table's both ends) shares it
        rep.quantized += 1
        rep.weights += job.param.numel()
        rep.stored_bytes += tensor.qweight.numel() + tensor.scales.numel() * 4 + (
            0 if tensor.qzeros is None else tensor.qzeros.numel() * tensor.qzeros.element_size())
        if self.progress is not None:
            self.progress(1)


# -- the layer-wise loop ------------------------------------------------------------------------------
def _linears(p: Plan) -> tuple[list[_Linear], list[Job]]:
    """The jobs solved from input statistics (a linear reads them) and the tables left to the block solver."""
    lins: list[_Linear] = []
    tables: list[Job] = []
    for job in p.jobs:
        kinds = {ep.kind for ep in job.quantized}
        if "experts" in kinds:
            raise QuantizationError(
                f"{job.name} is a fused experts tensor: calibrated passes solve nn.Linear weights only. Set "
                "moe: false here and quantize the experts with a following pass (e.g. {type: Rtn, moe: true})")
        ep = next((e for e in job.quantized if e.kind == "linear"), None)
        if ep is None:
            tables.append(job)
        else:
            lins.append(_Linear(ep.module_name, ep.module, job))
    return lins, tables


def _scale_group(block: nn.Module, prefix: str, group: InputGroup, members: list[_Linear], stats: LayerStats,
                 scaler: InputScaler, prober: scaling.Prober, calls: scaling.CallLog) -> LayerStats:
    """Search and apply one input's scales; the statistics the scaled weights see."""
    rel = [m.name[len(prefix) + 1:] if prefix else m.name for m in members]
    weights = [m.job.param.detach().to(torch.float32).numpy() for m in members]
    s = scaler.scales(weights, stats, [_spec(m.job) for m in members], [Target(m.job.name, (m.name,)) for m in members])
    if s is None:
        return stats
    s = np.asarray(s, dtype=np.float32)
    if s.shape != (stats.channels,) or not (np.isfinite(s).all() and (s > 0).all()):
        raise QuantizationError(f"the input scaler returned unusable scales for {members[0].job.name}: "
                                f"expected {stats.channels} positive finite values")
    k = stats.channels
    fold = scaling.find_fold(prober, block, rel, k, calls, group.first)
    if fold is None:
        log.info("%s: input left unscaled: nothing produces it that a per-channel scale folds into exactly "
                 "(a norm or a linear read by these linears only)", ", ".join(m.name for m in members))
        return stats
    st = scaling.as_tensor(s)
    scaling.scale_columns(block, rel, st)
    fold.apply(block, 1.0 / st)
    log.debug("%s: scales folded into %s (%s)", ", ".join(m.name for m in members), fold.name, fold.kind)
    return stats.scaled(s)


def _block_pass(block: nn.Module, prefix: str, lins: list[_Linear], calls: list[LayerCall], hidden: list[torch.Tensor],
                batches: list[Batch], method: Method, solver: _Solver, sequential: bool) -> list[torch.Tensor]:
    """Statistics, scales and solutions for one block; returns the next block's inputs."""
    rec = InputRecorder({lin.name: lin.module for lin in lins}, method.needs, len(batches),
                        keep_first=method.scaler is not None)
    log_calls = scaling.CallLog(block)
    outs: list[torch.Tensor] = []
    with torch.no_grad(), rec, log_calls:
        for b, batch in enumerate(batches):
            rec.new_batch(batch.valid)
            out = call_layer(block, calls[b], hidden[b])
            log_calls.active = False
            if not sequential:
                outs.append(out)
    by_name = {lin.name: lin for lin in lins}
    prober = scaling.Prober(block, LayerCall(hidden[0], calls[0].args, calls[0].kwargs, calls[0].key)) \
        if method.scaler is not None else None
    items: list[tuple[_Linear, LayerStats | None]] = []
    for group in rec.groups:
        members = [by_name[n] for n in group.names]
        stats = rec.stats(group)
        if stats is not None and method.scaler is not None and prober is not None:
            before = stats
            stats = _scale_group(block, prefix, group, members, stats, method.scaler, prober, log_calls)
            solver.report.scaled_inputs += stats is not before
        items += [(m, stats) for m in members]
    items += [(lin, None) for lin in lins if lin.name not in rec.group_of]  # never called
    solver.solve(items)
    if not sequential:
        return outs
    with torch.no_grad(), dequantized(lins):
        return [call_layer(block, calls[b], hidden[b]) for b in range(len(batches))]


@contextmanager
def dequantized(lins: list[_Linear]) -> Iterator[None]:
    """The linears' quantized weights as plain float tensors for a while (dequantized once, not per call)."""
    saved: list[tuple[nn.Module, torch.Tensor]] = []
    try:
        for lin in lins:
            w = lin.module._parameters.get("weight")
            if isinstance(w, QuantTensor):
                saved.append((lin.module, w))
                lin.module._parameters["weight"] = nn.Parameter(w.dequantize(), requires_grad=False)
        yield
    finally:
        for mod, w in saved:
            mod._parameters["weight"] = w  # type: ignore[assignment]


def _outside(model: nn.Module, lins: list[_Linear], layers: nn.ModuleList | None, final: list[torch.Tensor] | None,
             batches: list[Batch], method: Method, solver: _Solver) -> None:
    """Targets outside the blocks: statistics from a forward where the blocks replay their outputs."""
    rec = InputRecorder({lin.name: lin.module for lin in lins}, method.needs, len(batches))
    current = [0]

    def make(i: int) -> Callable[..., Any]:
        last = layers is not None and i == len(layers) - 1

        def forward(*args: Any, **kwargs: Any) -> Any:
            if last and final is not None:
                return final[current[0]]
            return args[0] if args else kwargs["hidden_states"]
        return forward

    with torch.no_grad(), rec:
        ctx = stand_ins(layers, make) if layers is not None else nullcontext()
        with ctx:
            for b, batch in enumerate(batches):
                current[0] = b
                rec.new_batch(batch.valid)
                model(**model_kwargs(model, batch))
    by_name = {lin.name: lin for lin in lins}
    items = [(by_name[n], rec.stats(g)) for g in rec.groups for n in g.names]
    items += [(lin, None) for lin in lins if lin.name not in rec.group_of]
    solver.solve(items)


def quantize_calibrated(model: nn.Module, p: Plan, method: Method, batches: list[Batch], *, sequential: bool = True,
                        jobs: int = 1, progress: Callable[[int], None] | None = None,
                        scale_only: bool = False, name: str = "calibrated quantization") -> CalibratedReport:
    """Quantize the jobs of ``p`` with ``method`` on ``batches``; returns what was done.

    ``scale_only``: apply the scaler's scales (folded exactly) and stop there: the weights stay
    float (AutoAWQ's ``export_compatible``); the model computes what it computed before.
    """
    report = CalibratedReport(skipped=dict(p.skipped))
    for what, why in p.notes.items():
        log.info("%s: %s", what, why)
    lins, tables = _linears(p)
    solver = _Solver(method, report, jobs, progress, scale_only)
    ids = {id(lin.module) for lin in lins}
    found = find_layers(model, ids)
    if found is None:
        log.warning("no decoder stack (a list of identical blocks) holds the targets: statistics come from the "
                    "float model in one forward (not sequential)")
        _outside(model, lins, None, None, batches, method, solver)
    else:
        prefix, layers = found
        calls = capture(model, layers, batches)
        hidden = [c.hidden for c in calls[0]]
        log.info("holding the hidden states of %d batches (%.1f MiB) across %d blocks of %s", len(batches),
                 held_bytes(calls[0]) / 2**20, len(layers), prefix)
        inside: set[int] = set()
        for i, block in enumerate(layers):
            bp = f"{prefix}.{i}" if prefix else str(i)
            mine = [lin for lin in lins if lin.name.startswith(bp + ".")]
            inside.update(id(lin.module) for lin in mine)
            if mine:
                hidden = _block_pass(block, bp, mine, calls[i], hidden, batches, method, solver, sequential)
            else:
                with torch.no_grad():
                    hidden = [call_layer(block, calls[i][b], hidden[b]) for b in range(len(batches))]
        rest = [lin for lin in lins if id(lin.module) not in inside]
        if rest:
            _outside(model, rest, layers, hidden, batches, method, solver)
    if tables and not scale_only:
        sub = apply(model, Plan(tables), method.block_solver, jobs=jobs, progress=progress)
        report.quantized += sub.quantized
        report.weights += sub.weights
        report.stored_bytes += sub.stored_bytes
        report.errors.update(sub.errors)
    if solver.thin:
        warn_rank_deficient(name, list(solver.thin.values()))
    if any(job.kept_float for job in p.jobs) and not scale_only:
        _untie_config(model, p)
    if not p.jobs:
        log.warning("no weights to quantize")
    return report
