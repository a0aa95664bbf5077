"""The calibrated weight-only pass: stage by stage, observe each input, solve its weights, go on.

For every stage of :func:`~bitpress.onnx.calibrated.stages.plan_stages`, each calibration
sample's frontier values go through an ONNX Runtime session of the stage's nodes; the
activations that end the stage are reduced to :class:`~bitpress.quant.calibrated.LayerStats`
on the way. Then the weights reading them are solved (after an optional input scaling, AWQ),
written, and - ``sequential`` - the later stages compute with their dequantized values.
"""

from __future__ import annotations

import logging
import resource
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from threadpoolctl import threadpool_limits

from bitpress.errors import QuantizationError, UsageError
from bitpress.memory import release_free_memory
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.calibrated.frontier import FrontierStore
from bitpress.onnx.calibrated.scaling import InputScaling, apply_scalings
from bitpress.onnx.calibrated.solve import (
    ROW_CHUNK_ELEMENTS,
    Solved,
    computed_weight,
    read_rows,
    solve_calibrated,
    spec_of,
    weight_shape,
)
from bitpress.onnx.calibrated.stages import StagePlan, order_activations, plan_stages
from bitpress.onnx.calibrated.stats import StatsAccumulator, combine
from bitpress.onnx.calibrated.subgraph import stage_session
from bitpress.onnx.calibrated.substitutes import SubstituteStore
from bitpress.onnx.weightonly import Group, Plan, WeightOnlyOptions, WeightOnlyPass
from bitpress.onnx.weightonly.passes import log_plan
from bitpress.onnx.weightonly.report import Report, planned_report
from bitpress.onnx.weightonly.solving import solve_group
from bitpress.onnx.weightonly.writing import Writer
from bitpress.options import option
from bitpress.passes import PassContext
from bitpress.quant.calibrated import CalibratedSolver, InputScaler, LayerStats, Target, warn_rank_deficient

log = logging.getLogger("bitpress.onnx.calibrated")


@dataclass
class CalibratedOptions(WeightOnlyOptions):
    sequential: bool = option(
        True, "inputs of each layer from the model with the earlier layers already quantized (false: from the "
        "float model, as ONNX Runtime's GPTQ does; no faster: every node runs once either way)"
    )
    memory_mb: int = option(
        1024, "calibration activations held in memory between layers before the rest go to the work folder"
    )
    expert_min_tokens: int | None = option(
        None, "MoE experts: an expert the calibration data routes fewer tokens to is rounded by the calibration-free "
        "solver instead (named in the report); default: the expert's input width (a full-rank Hessian)"
    )

    def validate(self) -> None:
        super().validate()
        if self.memory_mb < 16:
            raise ValueError(f"memory_mb must be at least 16, got {self.memory_mb}")
        if self.expert_min_tokens is not None and (not isinstance(self.expert_min_tokens, int)
                                                   or isinstance(self.expert_min_tokens, bool)
                                                   or self.expert_min_tokens < 0):
            raise ValueError(f"expert_min_tokens must be a non-negative integer, got {self.expert_min_tokens!r}")


class CalibratedPass(WeightOnlyPass):
    """Base of calibrated weight-only passes (GPTQ, AWQ): subclasses give :meth:`calibrated_solver`.

    :meth:`input_scaler` (optional) picks per-channel input scales first (AWQ); weights no
    activation reaches (embedding tables read only by ``Gather``) are rounded by
    :meth:`solver`, a plain block solver.
    """

    needs_data: ClassVar[bool] = True
    own_text_default: ClassVar[bool] = True
    distributes: ClassVar[bool] = False  # layer by layer on this machine's threads (docs/scaling.md)
    experts: ClassVar[str | None] = "QMoE, per expert"
    Options: ClassVar[type] = CalibratedOptions

    def calibrated_solver(self, group: Group) -> CalibratedSolver:
        """The solver for ``group``'s weight; weights reading one input share :meth:`~CalibratedSolver.prepare`
        when they get the same solver object (return one instance unless the weights need different ones)."""
        raise NotImplementedError

    def input_scaler(self) -> InputScaler | None:
        return None

    def run(self, model: Any, context: PassContext) -> Any:
        if not isinstance(model, OnnxModel):
            raise QuantizationError(f"{self.name} quantizes ONNX models, got {model.kind}")
        if context.data is None:
            raise UsageError(f"{self.name} needs calibration data: give --data (a .txt file with --tokenizer, "
                             "a .npz file or folder, or random)")
        p = self.planned(model, context.data)
        report = planned_report(model, p, self.estimate(), self.kernel())
        log_plan(report, p, model)
        report.planned = False
        if not p.groups and not p.experts.groups:
            log.warning("no weights to quantize in %s: %s", model.source.name, report.summary())
            return model
        # numpy's BLAS gets one thread: the solves run on bitpress's threads (--jobs) and ONNX Runtime on its
        # own; OpenBLAS's threads on top oversubscribe the cores (measured 10-60x slower on a busy machine)
        with threadpool_limits(1, user_api="blas"):
            if context.workdir is not None:
                self._calibrate(model, p, report, context, Path(context.workdir) / "calibration")
            else:
                with tempfile.TemporaryDirectory(prefix="bitpress-calibration-") as tmp:
                    self._calibrate(model, p, report, context, Path(tmp))
        context.extras.setdefault("reports", []).append((self.name, model.source, report))
        log.info("%s: %s", self.name, report.summary())
        return model

    # -- the run -------------------------------------------------------------------------------
    def _calibrate(self, model: OnnxModel, p: Plan, report: Report, context: PassContext, folder: Path) -> None:
        opts = self.options
        started = time.perf_counter()
        self._dtypes: dict[str, np.dtype] = {}  # each activation's element type, seen on the way
        widest = max([weight_shape(model, g)[1] for g in p.groups] + [g.hidden for g in p.experts.groups])
        feeds = list(_feeds(model, context, widest, self.name))
        if not feeds:
            raise QuantizationError("the calibration data yielded no samples")
        expert_feeds = list(feeds) if p.experts.groups else []
        scaler = self.input_scaler()
        solvers = {g.weight: self.calibrated_solver(g) for g in p.groups}
        needs = frozenset().union(*(s.needs for s in solvers.values()), scaler.needs if scaler else frozenset())
        consts = set(model.initializers())  # a MatMul of two constants has no activation to observe
        acts_of = {g.weight: sorted({u.node.input[0] for u in g.uses if not u.is_gather} - consts) for g in p.groups}
        tables = [g for g in p.groups if not acts_of[g.weight]]
        order = order_activations(model.graph, {a for acts in acts_of.values() for a in acts})
        # one stage per input, float inputs or not: every node runs once, statistics are held one input at a time
        splan = plan_stages(model.graph, [[a] for a in order])
        node_index = {id(n): i for i, n in enumerate(model.graph.node)}
        # the stage after which each weight is solved, and the last stage that computes with it
        done_at = {g.weight: max(_stage_of(splan, a) for a in acts_of[g.weight]) if acts_of[g.weight] else -1
                   for g in p.groups}
        used_until = {g.weight: max([splan.stage_of_node.get(node_index[id(n)], -1)
                                     for u in g.uses for n in (u.node, u.transpose) if n is not None])
                      for g in p.groups}
        writer = Writer(model, opts.resolved_accuracy_level(), opts.float_zero_point_form)
        store = FrontierStore(folder, opts.memory_mb << 20)
        substitutes = SubstituteStore(folder / "substitutes") if opts.sequential else None
        scalings: list[InputScaling] = []
        thin: list[tuple[str, int, int]] = []  # inputs whose Hessian has fewer tokens than channels
        n = len(feeds)
        try:
            for s, feed in enumerate(feeds):
                for name in splan.feeds:
                    if name not in feed:
                        raise QuantizationError(f"the calibration data has no input {name!r}")
                    store.put(s, name, feed[name])
            del feeds
            # tables no activation reaches (the embedding): rounded first, so every stage sees them quantized
            for g in tables:
                res = solve_group(model, g, self.solver(), self.float_zero_points(), None, None)
                if substitutes is not None and used_until[g.weight] >= 0:
                    _write_dequantized(model, g, res, substitutes)
                writer.write(res)
                report.quantized += 1
                report.weights += res.packed.shape[0] * res.k
                report.record(g.weight, res.error)
            with context.step(len(splan.stages), "calibrating") as advance:
                for j, stage in enumerate(splan.stages):
                    t0 = time.perf_counter()
                    stats = self._observe(model, splan, j, store, n, needs, substitutes)
                    thin += [(a, st.rows, st.channels) for a, st in stats.items() if st.rank_deficient]
                    t1 = time.perf_counter()
                    groups = [g for g in p.groups if done_at[g.weight] == j]
                    self._solve_stage(model, groups, acts_of, stats, store, n, scaler, solvers, writer, report,
                                      substitutes, scalings, used_until, j, context)
                    log.debug("stage %d/%d: %d nodes observed in %.2f s, %d weights solved in %.2f s; frontier "
                              "%.1f MB", j + 1, len(splan.stages), len(stage.nodes), t1 - t0, len(groups),
                              time.perf_counter() - t1, store.resident / 2**20)
                    for w in [w for w, last in used_until.items() if substitutes is not None and last <= j
                              and w in substitutes]:
                        substitutes.discard(w)
                    store.drop(stage.release, n)
                    release_free_memory()
                    advance(1)
        finally:
            store.close()
            if substitutes is not None:
                substitutes.close()
        if thin:
            warn_rank_deficient(self.name, thin)
        writer.finish()
        report.stored_bytes = writer.stored_bytes
        apply_scalings(model, scalings, {g.weight for g in p.groups})
        for sc in scalings:
            log.info("input %s scaled: %s", sc.activation, sc.how)
        if p.experts.groups:
            self._experts(model, p, report, expert_feeds, context)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        log.info("%s: %d samples, %d stages, %.1f s; frontier peak %.0f MB in memory, %.0f MB spilled; peak RSS "
                 "%.0f MB", self.name, n, len(splan.stages), time.perf_counter() - started, store.peak / 2**20,
                 store.spilled / 2**20, peak)

    def _experts(self, model: OnnxModel, p: Plan, report: Report, feeds: list[dict[str, np.ndarray]],
                 context: PassContext) -> None:
        """Each MoE node's experts on the tokens routed to them (:mod:`bitpress.onnx.calibrated.experts`), in graph
        order, each node's QMoE written before the next node's inputs are read (``sequential``)."""
        from bitpress.onnx.calibrated import experts
        from bitpress.onnx.weightonly import qmoe

        opts = self.options
        level = opts.resolved_accuracy_level()
        groups = p.experts.groups
        starved: list[experts.Starved] = []
        # sequential: each node's QMoE is written before the next node's inputs are read; otherwise every node is
        # written at the end, so each reads its inputs from the model with the experts still float
        writer = None if opts.sequential else Writer(model, level, opts.float_zero_point_form)
        with context.step(len(groups), "calibrating experts") as advance:
            for g in groups:
                # the graph's nodes were rewritten (copied) by the writers since planning: this node as it is now
                g.node = next(n for n in model.graph.node if n.op_type == g.node.op_type
                              and list(n.output) == list(g.node.output))
                x, logits = experts.capture(model, g, feeds)
                # the solver of the node's weight, asked as for any weight (the plugin's contract takes a Group)
                solver = self.calibrated_solver(Group(g.weights["fc1"], [], g.bits, g.block_size, g.symmetric))
                done = experts.solve_experts(model, g, x, logits, solver, self.solver(), opts.expert_min_tokens)
                del x, logits
                node_writer = writer or Writer(model, level, opts.float_zero_point_form)
                qmoe.write(node_writer, g, done.solved, level)
                if writer is None:
                    node_writer.finish()
                    report.stored_bytes += node_writer.stored_bytes
                for role, solved in done.solved.items():
                    name = g.weights[role]
                    report.quantized += 1
                    report.weights += solved.packed.shape[0] * solved.k
                    report.record(name, solved.error)
                    if role in done.output_errors:
                        report.record_output(name, done.output_errors[role])
                starved += done.starved
                log.info("%s: experts of %s solved on %s routed calibration tokens", self.name, g.name,
                         "/".join(map(str, done.tokens)))
                advance(1)
        if writer is not None:
            writer.finish()
            report.stored_bytes += writer.stored_bytes
        if starved:
            shown = "; ".join(s.text() for s in starved[:6]) + (f"; and {len(starved) - 6} more" if len(starved) > 6
                                                                 else "")
            note = (f"{self.name}: {len(starved)} expert(s) got too few calibration tokens and were rounded by the "
                    f"calibration-free solver ({shown}); more or more varied --data reaches them (expert_min_tokens "
                    "sets the bar)")
            report.notes.append(note)
            context.extras.setdefault("notes", []).append(note)
            log.warning("%s", note)

    def _observe(
        self, model: OnnxModel, splan: StagePlan, j: int, store: FrontierStore, n: int, needs: frozenset[str],
        substitutes: SubstituteStore | None,
    ) -> dict[str, LayerStats]:
        stage = splan.stages[j]
        acc = {a: StatsAccumulator(needs, n) for a in stage.activations}
        keep = [o for o in stage.outputs if o not in stage.release]
        session = None
        mapped: dict[str, np.ndarray] = {}  # substitutes the stage reads, memory-mapped for its runs
        if stage.nodes:
            example = {name: store.get(0, name) for name in stage.inputs}
            specs = {} if substitutes is None else {w: substitutes.spec(w) for w in substitutes.names()}
            session, fed = stage_session(model, stage, example, specs)
            mapped = {w: substitutes.open(w) for w in fed} if substitutes is not None else {}
        for s in range(n):
            values: dict[str, np.ndarray] = {}
            if session is not None:
                feed = {name: np.asarray(store.get(s, name)) for name in stage.inputs}
                try:
                    values = dict(zip(stage.outputs, session.run(stage.outputs, {**feed, **mapped}), strict=True))
                except Exception as exc:  # ORT raises its own pybind exception types
                    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in feed.items())
                    raise QuantizationError(
                        f"cannot run the model on the calibration data (stage {j + 1}, inputs {shapes}): "
                        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
                    ) from None
            for name in keep:
                store.put(s, name, values[name])
            for a in stage.activations:
                value = values[a] if a in values else store.get(s, a)
                self._dtypes[a] = np.dtype(value.dtype)
                acc[a].add(value)
            del values
        del session, mapped
        return {a: st.result() for a, st in acc.items()}

    def _solve_stage(
        self, model: OnnxModel, groups: list[Group], acts_of: dict[str, list[str]], stats: dict[str, LayerStats],
        store: FrontierStore, n: int, scaler: InputScaler | None, solvers: dict[str, CalibratedSolver],
        writer: Writer, report: Report, substitutes: SubstituteStore | None, scalings: list[InputScaling],
        used_until: dict[str, int], j: int, context: PassContext,
    ) -> None:
        if not groups:
            return
        fzp = self.float_zero_points()
        scales: dict[str, np.ndarray] = {}
        if scaler is not None:
            for act in sorted({a for g in groups for a in acts_of[g.weight]}):
                s = self._input_scales(model, act, groups, acts_of, stats[act], scaler, fzp)
                if s is None:
                    continue
                # later stages read x unscaled and compute with Q / s (the substitutes): no frontier change
                scales[act] = s
                readers = frozenset(u.node.output[0] for g in groups if act in acts_of[g.weight] for u in g.uses)
                scalings.append(InputScaling(act, (1.0 / s).astype(np.float32), self._dtypes[act], readers))
                stats[act] = stats[act].scaled(s)

        def work(job: tuple[Group, Any, LayerStats, np.ndarray | None]) -> Solved:
            g, prep, st, sc = job
            later = substitutes if substitutes is not None and used_until[g.weight] > j else None
            return solve_calibrated(model, g, solvers[g.weight], prep, st, spec_of(g, fzp), scales=sc,
                                    substitutes=later)

        workers = max(1, min(int(context.jobs), len(groups)))
        with ThreadPoolExecutor(workers) as pool:
            jobs = self._prepare(model, groups, acts_of, stats, scales, solvers, fzp)
            for solved in pool.map(work, jobs):
                res = solved.result
                writer.write(res)
                report.quantized += 1
                report.weights += res.packed.shape[0] * res.k
                report.record(res.group.weight, res.error)
                if solved.output_error is not None:
                    report.record_output(res.group.weight, solved.output_error)

    def _prepare(
        self, model: OnnxModel, groups: list[Group], acts_of: dict[str, list[str]], stats: dict[str, LayerStats],
        scales: dict[str, np.ndarray], solvers: dict[str, CalibratedSolver], fzp: bool,
    ) -> list[tuple[Group, Any, LayerStats, np.ndarray | None]]:
        """Each group's solver prepared for its input (once per input, layout and solver: q/k/v share it)."""
        prepared: dict[tuple[Any, ...], Any] = {}
        jobs: list[tuple[Group, Any, LayerStats, np.ndarray | None]] = []
        for g in groups:
            acts = acts_of[g.weight]
            st = combine([stats[a] for a in acts])
            sc = scales.get(acts[0]) if len(acts) == 1 else None
            spec = spec_of(g, fzp)
            _, k = weight_shape(model, g)
            kp = -(-k // spec.block_size) * spec.block_size
            key = (id(solvers[g.weight]), tuple(acts), spec)
            if key not in prepared:
                prepared[key] = solvers[g.weight].prepare(st.padded(kp), spec)
            jobs.append((g, prepared[key], st, sc))
        return jobs

    def _input_scales(
        self, model: OnnxModel, act: str, groups: list[Group], acts_of: dict[str, list[str]], stats: LayerStats,
        scaler: InputScaler, fzp: bool,
    ) -> np.ndarray | None:
        mine = [g for g in groups if act in acts_of[g.weight]]
        if any(len(acts_of[g.weight]) > 1 or any(u.is_gather for u in g.uses) for g in mine):
            log.info("input %s not scaled: a weight reading it is also read elsewhere (tied or shared)", act)
            return None
        weights = [read_rows(model, g, 0, weight_shape(model, g)[0]) for g in mine]
        s = scaler.scales(weights, stats, [spec_of(g, fzp) for g in mine],
                          [Target(g.weight, tuple(u.node.name for u in g.uses)) for g in mine])
        if s is None:
            return None
        s = np.asarray(s, dtype=np.float32)
        if s.shape != (stats.channels,) or not np.isfinite(s).all() or (s <= 0).any():
            raise QuantizationError(f"the input scaler returned invalid scales for {act} (shape {s.shape}; they must "
                                    "be positive and finite, one per input channel)")
        return s


def _stage_of(splan: StagePlan, activation: str) -> int:
    for j, st in enumerate(splan.stages):
        if activation in st.activations:
            return j
    raise QuantizationError(f"internal error: activation {activation} has no stage")


def _write_dequantized(model: OnnxModel, group: Group, res: Any, substitutes: SubstituteStore) -> None:
    """A rounded table's values as the quantized model reads them, in its stored orientation and dtype,
    into ``substitutes`` by slabs of rows."""
    from bitpress.onnx import layout
    from bitpress.onnx.tensors import np_dtype
    from bitpress.quant.solver import QuantizedBlocks

    tensor = model.initializers()[group.weight]
    dtype = np_dtype(tensor)
    b = res.blocks
    rows = res.packed.shape[0]
    step = max(1, ROW_CHUNK_ELEMENTS // max(res.k, 1))
    with substitutes.writer(group.weight, tuple(int(d) for d in tensor.dims), dtype,
                            transposed=not group.uses[0].rows_are_table_rows) as out:
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            q = layout.unpack_along_last(res.packed[r0:r1], group.bits, group.block_size)
            zps = None if b.zero_points is None else b.zero_points[r0:r1]
            deq = computed_weight(QuantizedBlocks(q, b.scales[r0:r1], zps), group.bits, dtype)
            out.write(r0, deq.reshape(r1 - r0, -1)[:, : res.k])


def _feeds(model: OnnxModel, context: PassContext, widest: int, who: str) -> Any:
    """The calibration feeds; as many samples as the widest input (``widest`` channels) needs when not given,
    half of them the model's own text beside a text unless ``generated`` says otherwise."""
    from bitpress.calibration.data import DataConfig, iter_feeds

    config = DataConfig.from_value(context.data).enough_for(widest, who).with_own_text(who)
    return iter_feeds(model.proto, config, model.source.parent, root=getattr(model, "package_root", None),
                      handle=model)


def rounding_solver(name: str, bits: int, block_size: int, symmetric: bool) -> tuple[Any, bool]:
    """The block solver of the registered weight-only pass ``name`` (``rtn``, ``kquant``, ``hqq``, a
    third party's) with these settings, and whether it writes float zero points.

    For calibrated passes whose final rounding is any block solver (AWQ's ``quantizer``).
    """
    from dataclasses import fields

    from bitpress.plugins import get_registry

    cls = get_registry().get_pass(name)
    if not (isinstance(cls, type) and issubclass(cls, WeightOnlyPass)) or issubclass(cls, CalibratedPass):
        raise UsageError(f"quantizer {name!r} is not a block-solver pass; use rtn, kquant, hqq or another "
                         "plain weight-only pass (see bitpress passes list)")
    reason = cls.unavailable_reason()
    if reason:
        raise UsageError(f"quantizer {name!r} is unavailable: {reason}")
    known = {f.name for f in fields(cls.Options)}
    values = {k: v for k, v in {"bits": bits, "block_size": block_size, "is_symmetric": symmetric}.items()
              if k in known}
    inst = cls.from_config(values, strict=True)
    return inst.solver(), inst.float_zero_points()
