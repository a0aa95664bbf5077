"""Planning a workflow (``--plan``): what a run would do to every weight, without running it.

The plan of each step comes from the pass itself (:meth:`WeightOnlyPass.plan_report`, built on
the same :func:`bitpress.onnx.weightonly.plan` the real run carries out), on the input model
(or each chosen component of a folder). Nothing is written and no output folder is created.
Passes that are not weight-only passes of the host (Quark's, which run in their own
environment; Hugging Face checkpoint passes) have no plan, and the result says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bitpress.errors import ModelLoadError, UsageError
from bitpress.models.onnx_model import OnnxModel
from bitpress.models.onnx_package import OnnxPackage
from bitpress.plugins import Registry, canonical_precision, get_registry
from bitpress.workflow.config import PassStep, Workflow, build_workflow, load_config, select_pass


@dataclass
class StepPlan:
    """The plan of one pass on one model (a file, or a component of a folder)."""

    pass_name: str
    label: str
    model: Path
    report: Any = None  # a bitpress.onnx.weightonly.Report with planned=True, or None
    reason: str | None = None  # why there is no plan
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pass": self.pass_name, "step": self.label, "model": str(self.model),
                               "has_plan": self.report is not None}
        if self.report is not None:
            out["summary"] = self.report.summary()
            out.update(self.report.to_json())
        else:
            out["reason"] = self.reason
        if self.notes:
            out["notes"] = list(self.notes) + list(out.get("notes", []))
        return out


@dataclass
class PlanResult:
    input: Path
    steps: list[StepPlan]

    def to_json(self) -> list[dict[str, Any]]:
        return [s.to_json() for s in self.steps]


def plan_workflow(wf: Workflow, registry: Registry | None = None) -> PlanResult:
    """The per-weight plan of every step of ``wf`` on its input; writes nothing."""
    registry = registry or get_registry()
    src = wf.input
    if not src.exists():
        raise ModelLoadError(f"model not found: {src}")
    model = registry.hook.bitpress_load_model(source=src, options={})
    if model is None:
        raise UsageError(f"no plugin can load {src}")
    if isinstance(model, OnnxPackage):
        targets = [(model.root / rel, model.component(rel)) for rel in model.select(wf.components)]
    else:
        targets = [(src, model)]
    steps = []
    try:
        for i, step in enumerate(wf.steps):
            pass_ = step.pass_
            planner = getattr(pass_, "plan_report", None)
            for path, target in targets:
                entry = StepPlan(pass_.name, step.label, path)
                kind = "onnx" if isinstance(target, OnnxModel) else getattr(target, "kind", "?")
                if planner is None:
                    from bitpress.envs import where

                    runs = where(type(pass_))
                    entry.reason = (
                        f"{pass_.name} has no plan: --plan lists what the host's weight-only passes (rtn, hqq, "
                        f"kquant, q4_k_m, bnb4, ...) would do to each weight; {pass_.name} "
                        + (f"runs in {runs} and " if runs != "here" else "")
                        + ("decides while it runs" if type(pass_).plugin == "bitpress" else
                           "decides inside its own toolkit")
                    )
                elif kind not in pass_.model_kinds or not isinstance(target, OnnxModel):
                    entry.reason = f"{pass_.name} does not accept {kind} models"
                else:
                    entry.report = planner(target, data=wf.data)
                    if i > 0:
                        entry.notes.append("planned on the input model: --plan does not run the earlier passes")
                steps.append(entry)
    finally:
        for _, target in targets:
            if isinstance(target, OnnxModel):
                target.close()
    return PlanResult(src, steps)


def plan_quantize(
    model: str | Path, *, algorithm: str, precision: str | None = None, options: dict[str, Any] | None = None,
    components: list[str] | None = None, registry: Registry | None = None, strict: bool = True, data: Any = None,
) -> PlanResult:
    """``bitpress quantize --plan``: the plan of the pass :func:`bitpress.quantize` would run.

    ``strict``: as :func:`bitpress.quantize`'s (False: ``options`` are ``--option`` strings). ``data``: the
    calibration data (``--data``), on which a ``bpw`` budget measures each weight's sensitivity.
    """
    from bitpress.workflow.config import _data

    registry = registry or get_registry()
    path = Path(model)
    cls = select_pass(registry, algorithm, precision, path)
    precision = canonical_precision(cls, precision)
    step = PassStep(cls.from_config(options or {}, precision, strict=strict), f"{algorithm}/{precision or '-'}")
    wf = Workflow(input=path, output=path.with_name(path.name + ".plan"), steps=[step], components=components,
                  data=_data(data))
    return plan_workflow(wf, registry)


def plan_run(config: dict[str, Any] | str | Path, *, registry: Registry | None = None, data: Any = None) -> PlanResult:
    """``bitpress run --plan``: the plan of every pass of a workflow config (``data``: ``--data``, over the
    config's ``data:``)."""
    from bitpress.workflow.config import _data

    config = dict(config) if isinstance(config, dict) else load_config(Path(config))
    wf = build_workflow(config, registry)
    if data is not None:
        wf.data = _data(data)
    return plan_workflow(wf, registry)


# -- text ------------------------------------------------------------------------------------------
def weight_table_lines(report: Any) -> list[str]:
    """The per-weight table of a weight-only report (planned or measured), as aligned lines."""
    rows = getattr(report, "rows", None) or []
    if not rows:
        return []
    measured = any(r.error is not None for r in rows)
    kernels = any(r.kernel for r in rows)
    head = (["WEIGHT", "OPS", "SHAPE", "BITS", "BLOCK", "SYM", "ZERO PTS", "BITS/W"] + (["KERNEL"] if kernels else [])
            + (["ERROR"] if measured else []))
    table = [[*head, "NOTE"]]
    for r in rows:
        shape = "x".join(str(d) for d in r.shape) or "-"
        ops = r.kind + (" (tied)" if r.tied else f" x{len(r.ops)}" if len(r.ops) > 1 else "")
        if r.experts:
            ops = f"{r.kind} {r.experts} experts" + (f" -> {r.writes}" if r.quantized and r.writes else "")
        if r.quantized:
            cells = [str(r.bits), str(r.block_size), "yes" if r.symmetric else "no", r.zero_points or "-",
                     f"{r.expected_bits:.2f}" if r.expected_bits is not None else "-"]
        else:
            bits = {"float32": "32", "float16": "16", "bfloat16": "16"}.get(r.dtype, "-")
            cells = [r.dtype or "float", "-", "-", "-", bits]
        if kernels:
            cells.append((r.kernel or "-") if r.quantized else "float")
        if measured:
            cells.append(f"{r.error:.4f}" if r.error is not None else "-")
        note = r.reason if not r.quantized else (r.note or "")
        if r.tied:
            note = "; ".join(x for x in ["one table for " + " + ".join(r.ops), note] if x)
        table.append([r.weight, ops, shape, *cells, note or ""])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
            for row in table]


def plan_lines(result: PlanResult) -> list[str]:
    """``--plan`` as text: per step and model, the weight table and what it costs."""
    lines = []
    for step in result.steps:
        lines.append(f"{step.pass_name} ({step.label}) on {step.model.name}: "
                     + (step.report.summary() if step.report is not None else step.reason or "no plan"))
        extra = list(step.report.unmatched) + list(step.report.notes) if step.report is not None else []
        for note in step.notes + extra:
            lines.append(f"  note: {note}")
        if step.report is not None:
            lines += ["  " + line for line in weight_table_lines(step.report)]
    lines.append("nothing was written (--plan)")
    return lines
