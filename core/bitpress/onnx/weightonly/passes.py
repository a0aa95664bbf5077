"""The weight-only pass: plan, solve in parallel, write; and its report."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import tempfile
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from bitpress.errors import QuantizationError
from bitpress.executors import ExecutorSpec, open_executor
from bitpress.interrupts import cancel_pending
from bitpress.memory import trim_heap
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.weightonly import qmoe
from bitpress.onnx.weightonly.moe import ExpertGroup
from bitpress.onnx.weightonly.planning import Group, Plan, WeightOnlyOptions, plan
from bitpress.onnx.weightonly.reading import current_chunk_elements
from bitpress.onnx.weightonly.report import Estimate, KernelOf, Report, nbits_estimate, nbits_kernel, planned_report
from bitpress.onnx.weightonly.solving import Solved, SolveTask, result_of, solve_task, task_of
from bitpress.onnx.weightonly.writing import Writer
from bitpress.passes import Pass, PassContext
from bitpress.quant.solver import BlockSolver, PackingKernel

log = logging.getLogger("bitpress.onnx.weightonly")

#: one solve: a dense weight, or one expert tensor (a MoE node's fc1 / fc2 / fc3)
Job = Group | tuple[ExpertGroup, str]

#: the largest block size an int8 weight gets by default (see :meth:`WeightOnlyPass.precision_defaults`)
INT8_BLOCK_SIZE = 32


def quantize_weights(
    model: OnnxModel, opts: WeightOnlyOptions, solver: BlockSolver, context: PassContext, *,
    float_zero_points: bool = False, importance: dict[str, np.ndarray] | None = None,
    kernel: PackingKernel | None = None, planned: Plan | None = None,
) -> Report:
    """Quantize every planned weight of ``model`` in place; tensors are solved in parallel.

    ``kernel``: the solver's optional packing fast path (see :class:`PackingKernel`).
    ``planned``: the plan to carry out (default: :func:`plan` of ``opts``), the one ``--plan`` shows.
    The report holds one row per candidate weight, with what the run measured.
    """
    p = planned if planned is not None else plan(model, opts)
    report = planned_report(model, p, nbits_estimate(float_zero_points, opts.float_zero_point_form),
                            nbits_kernel(opts, float_zero_points))
    log_plan(report, p, model)
    report.planned = False
    if not p.groups and not p.experts.groups:
        log.warning("no weights to quantize in %s: %s", model.source.name, report.summary())
        return report
    level = opts.resolved_accuracy_level()
    writer = Writer(model, level, opts.float_zero_point_form)
    spec = ExecutorSpec.from_value(context.executor)
    remote = spec.type != "threads"
    # a worker process reads its weight from where it lies (a file range) and must be told the chunk
    # size; threads share this process's CHUNK_ELEMENTS
    chunk = current_chunk_elements() if remote else None

    def task(job: Job) -> SolveTask:
        if isinstance(job, Group):
            imp = importance.get(job.weight) if importance is not None else None
            return task_of(model, job, float_zero_points, imp, chunk)
        return qmoe.task(model, job[0], job[1], chunk)

    # every dense weight, and every expert tensor of a MoE node (written when the node's last one is solved)
    jobs: list[Job] = [*p.groups, *((g, role) for g in p.experts.groups for role in g.weights)]
    experts_done: dict[int, dict[str, Solved]] = {}
    # bounded in-flight work: at most ``workers + 1`` tensors solved but not yet written
    # an error or a signal drops the queued tensors; the executor waits only for those being solved
    with context.step(len(jobs), "quantizing") as advance, open_executor(spec, jobs=context.jobs) as pool, \
            cancel_pending(pool):
        if remote:
            pool.check_shared(external_files(model, p))
        workers = pool.workers
        pending: dict[Future[Solved], Job] = {}
        todo = iter(sorted(jobs, key=lambda j: -_numel(model, j)))
        done_all = False
        while pending or not done_all:
            while not done_all and len(pending) < workers + 1:
                job = next(todo, None)
                if job is None:
                    done_all = True
                    break
                pending[pool.submit(solve_task, task(job), solver, kernel)] = job
            if not pending:
                break
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                job = pending.pop(fut)
                solved = fut.result()
                if isinstance(job, Group):
                    weight = job.weight
                    writer.write(result_of(job, solved))  # protobuf edits stay on this thread
                else:  # an expert tensor: the node is written once all of its tensors are solved
                    eg, role = job
                    weight = eg.weights[role]
                    mine = experts_done.setdefault(id(eg), {})
                    mine[role] = solved
                    if len(mine) == len(eg.weights):
                        qmoe.write(writer, eg, experts_done.pop(id(eg)), level)
                report.weights += solved.packed.shape[0] * solved.k
                report.quantized += 1
                report.record(weight, solved.error)
                advance(1)
                del solved
            del finished, fut  # the futures hold the results: drop them before trimming
            trim_heap()
    writer.finish()
    report.stored_bytes = writer.stored_bytes
    return report


def external_files(model: OnnxModel, p: Plan) -> list[Path]:
    """The files holding the planned weights' external data (what remote workers read)."""
    from bitpress.onnx.tensors import is_external

    inits = model.initializers()
    names = [g.weight for g in p.groups] + [w for g in p.experts.groups for w in g.weights.values()]
    files = {model.resolver.path(inits[w])[0] for w in names if is_external(inits[w])}
    return sorted(files)


def log_plan(report: Report, p: Plan, model: OnnxModel) -> None:
    """The plan's warnings (patterns matching nothing), decisions (at -v) and its expected cost."""
    for warning in p.unmatched:
        log.warning("%s: %s", model.source.name, warning)
    for what, why in p.skipped.items():
        log.info("not quantized: %s: %s", what, why)
    for what, why in p.notes.items():
        log.info("%s: %s", what, why)
    if p.groups:
        log.info("plan for %s: %s", model.source.name, report.summary())


def _numel(model: OnnxModel, job: Job) -> int:
    t = model.initializers()[job.weight if isinstance(job, Group) else job[0].weights[job[1]]]
    return int(np.prod(t.dims))


class WeightOnlyPass(Pass):
    """Base of the native weight-only passes: subclasses provide :meth:`solver`.

    ``float_zero_points``: whether the algorithm's optimum is a float offset (HQQ, k-quant).
    Subclasses may extend :class:`WeightOnlyOptions` with their own fields.
    """

    model_kinds: ClassVar[tuple[str, ...]] = ("onnx",)
    precisions: ClassVar[tuple[str, ...]] = ("int4", "int8")
    Options: ClassVar[type] = WeightOnlyOptions
    #: the solver weights its error by activation statistics when calibration data is given
    uses_importance: ClassVar[bool] = False
    distributes: ClassVar[bool] = True
    experts: ClassVar[str | None] = "QMoE"

    def solver(self) -> BlockSolver:
        raise NotImplementedError

    @classmethod
    def precision_defaults(cls, precision: str) -> dict[str, Any]:
        """int8: blocks of at most :data:`INT8_BLOCK_SIZE` unless the user sets ``block_size``.

        At ``accuracy_level`` 4 (the cpu default, the only fast kernels for 8-bit weights) ONNX Runtime
        quantizes the activations to int8 in blocks of the weight's block size; with 8-bit weights that
        rounding is most of the error. Measured on SmolLM2 (docs/quality.md): rtn int8 with blocks of 128
        +1.3% perplexity, with blocks of 32 -0.04%, for 9 bits per weight instead of 8.25.
        """
        names = {f.name: f for f in dataclasses.fields(cls.Options)} if dataclasses.is_dataclass(cls.Options) else {}
        block = names.get("block_size")
        if precision == "int8" and block is not None and isinstance(block.default, int) \
                and block.default > INT8_BLOCK_SIZE:
            return {"block_size": INT8_BLOCK_SIZE}
        return {}

    def packing_kernel(self) -> PackingKernel | None:
        """An optional fused quantize-and-pack kernel giving exactly the solver's answer, faster."""
        return None

    def weight_plan(self, model: OnnxModel, data: Any = None) -> Plan:
        """What this pass will quantize, and how: the plan the run carries out and ``--plan`` shows.

        ``data``: the calibration data (``--data``), which a ``bpw`` budget measures sensitivity on.
        Presets that pick settings per weight (``q4_k_m``) override this, never :meth:`run`, so
        the dry run and the real one cannot disagree.
        """
        return self.budgeted(model, plan(model, self.options), data)

    def planned(self, model: OnnxModel, data: Any = None) -> Plan:
        """:meth:`weight_plan` with the calibration data, also for a plugin's override written before it took
        ``data`` (``weight_plan(self, model)``)."""
        if "data" in inspect.signature(self.weight_plan).parameters:
            return self.weight_plan(model, data)
        return self.weight_plan(model)

    def budgeted(self, model: OnnxModel, p: Plan, data: Any = None) -> Plan:
        """``p`` with each weight's layout chosen within the ``bpw`` budget (unchanged without one)."""
        budget = getattr(self.options, "bpw", None)
        if budget is None or not p.groups:
            return p
        from bitpress.onnx.weightonly.budget import allocate
        from bitpress.selection import NameMatcher

        user = NameMatcher(list(self.options.overrides), what="overrides key")
        fixed = {g.weight for g in p.groups if user and any(user.matches(u.node.name, g.weight) for u in g.uses)}

        def sensitivity(layouts: dict[str, tuple[int, int]]) -> dict[str, float]:
            from bitpress.calibration.data import DataConfig, iter_feeds
            from bitpress.onnx.weightonly.sensitivity import measure

            config = DataConfig.from_value(data if data is not None else "random")
            n = self.options.bpw_samples
            config = dataclasses.replace(config, samples=n, generated=None if config.generated is None
                                         else min(config.generated, n))
            if data is None:
                log.info("%s: bpw: sensitivity measured on %d samples of random token ids; --data (a text like "
                         "the model's use) measures it where it matters", model.source.name, config.count)
            feeds = iter_feeds(model.proto, config, model.source.parent, root=getattr(model, "package_root", None),
                               warn=data is not None, handle=model)
            return measure(model, p.groups, layouts, feeds)

        allocate(model, p, float(budget), self.estimate(), self.kernel(), measure=sensitivity, fixed=fixed)
        return p

    def estimate(self) -> Estimate:
        """The cost of each planned weight's layout (bytes, zero-point kind, ops written)."""
        return nbits_estimate(self.float_zero_points(), self.options.float_zero_point_form)

    def kernel(self) -> KernelOf:
        """The ONNX Runtime kernel each planned weight will run on, on the options' target."""
        return nbits_kernel(self.options, self.float_zero_points())

    def plan_report(self, model: OnnxModel, data: Any = None) -> Report:
        """A dry run: the per-weight table of what :meth:`run` would do; reads no weight data (a ``bpw``
        budget measures the weights' sensitivity on ``data``)."""
        if not isinstance(model, OnnxModel):
            raise QuantizationError(f"{self.name} quantizes ONNX models, got {model.kind}")
        p = self.planned(model, data)
        report = planned_report(model, p, self.estimate(), self.kernel())
        for warning in p.unmatched:
            log.warning("%s: %s", model.source.name, warning)
        return report

    def _importance(self, model: OnnxModel, context: PassContext, p: Plan | None = None) -> dict[str, np.ndarray]:
        from bitpress.calibration.data import DataConfig, iter_feeds
        from bitpress.onnx.activations import channel_importance

        p = p if p is not None else self.planned(model, context.data)
        readers = {g.weight: [u.node.input[0] for u in g.uses if not u.is_gather] for g in p.groups}
        readers = {w: acts for w, acts in readers.items() if acts}
        feeds = iter_feeds(model.proto, DataConfig.from_value(context.data), model.source.parent,
                           root=getattr(model, "package_root", None), handle=model)
        if context.workdir is not None:
            return channel_importance(model, readers, feeds, context.workdir)
        with tempfile.TemporaryDirectory(prefix="bitpress-calibration-") as tmp:
            return channel_importance(model, readers, feeds, Path(tmp))

    def float_zero_points(self) -> bool:
        return bool(getattr(self.options, "float_zero_points", False))

    def run(self, model: Any, context: PassContext) -> Any:
        if not isinstance(model, OnnxModel):
            raise QuantizationError(f"{self.name} quantizes ONNX models, got {model.kind}")
        p = self.planned(model, context.data)
        importance = None
        if self.uses_importance and context.data is not None:
            importance = self._importance(model, context, p)
        report = quantize_weights(
            model, self.options, self.solver(), context, float_zero_points=self.float_zero_points(),
            importance=importance, kernel=self.packing_kernel(), planned=p,
        )
        context.extras.setdefault("reports", []).append((self.name, model.source, report))
        log.info("%s: %s", self.name, report.summary())
        return model
