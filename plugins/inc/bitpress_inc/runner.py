"""Hand an :class:`~bitpress.models.onnx_model.OnnxModel` to Intel Neural Compressor and take its result back.

One call: the options become INC configs (bad ones fail here, before the model is copied);
the model is saved into a private workspace; INC runs under containment on that copy
(optimized by ONNX Runtime first, as INC's own ``quantize`` does), through the same algorithm
entry points its ``quantize`` and tuning loop use; its output, corrected where INC 1.0 writes
something ONNX Runtime misreads (:mod:`bitpress_inc.fixes`), becomes the new model handle. Nothing
from ``onnx_neural_compressor`` is imported at module level.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from bitpress.plugin import (
    BitpressError,
    Feed,
    FeedReader,
    OnnxModel,
    PassContext,
    QuantizationError,
    ToolReport,
    UsageError,
    Workspace,
    calibration_feeds,
    count_ops,
    cpu_flags,
    dist_version,
    drop_unused_opsets,
    int8_saturates,
    record_report,
    split_feeds,
)
from bitpress_inc import configs
from bitpress_inc.fixes import broadcast_scalar_muls, repack_zero_points
from bitpress_inc.options import StaticOptions, TuningOptions, WeightOnlyOptions
from bitpress_inc.sandbox import contained, import_inc, no_exit
from bitpress_inc.tuning import OutputScorer, TuningResult, autotune

log = logging.getLogger(__name__)

TOOL = "Intel Neural Compressor"
DISTRIBUTION = "onnx-neural-compressor"
#: op types that show a mode did quantize something (INC writes the float model back otherwise)
QUANTIZED_OPS = {
    "QOperator": ("QLinear", "QGemm", "QAttention", "MatMulInteger", "QEmbedLayerNormalization"),
    "QDQ": ("DequantizeLinear",),
    "dynamic": ("MatMulInteger", "DynamicQuantizeLinear", "DynamicQuantizeMatMul", "QAttention"),
    "weight_only": ("MatMulNBits",),
}


@dataclass
class IncReport(ToolReport):
    """INC's run for ``bitpress quantize``'s summary: the usual line, then notes and tuning trials."""

    notes: list[str] = field(default_factory=list)
    tuning: TuningResult | None = None

    def summary(self) -> str:
        lines = [super().summary()]
        if self.tuning is not None:
            t = self.tuning
            verdict = "within" if t.met else "none within"
            lines.append(f"tuning: {len(t.trials)} trial(s), {verdict} tolerance {t.tolerance:g} "
                         f"(error on {t.held_back} held-back sample(s)); chose trial {t.best.index}")
            lines.extend(("* " if trial is t.best else "  ") + trial.line() for trial in t.trials)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n    ".join(lines)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        if self.tuning is not None:
            out["tuning"] = self.tuning.to_json()
        if self.notes:
            out["notes"] = list(self.notes)
        return out


@dataclass
class Job:
    """What one pass asks INC for."""

    pass_name: str
    approach: str  # static, dynamic, weight_only, auto
    options: Any
    tuning: TuningOptions | None


def _mode(job: Job) -> str:
    o = job.options
    if job.approach == "weight_only":
        w = o.woq()
        return f"int4 {w.algorithm} (group {w.group_size}, {w.scheme})"
    if job.approach == "dynamic":
        return "dynamic int8" + (" per channel" if o.per_channel else "")
    if job.approach == "auto":
        return "int8, static or dynamic as tuned"
    sq = o.smooth_quant()
    smooth = f" + SmoothQuant alpha {sq.SmoothQuantAlpha:g}" if sq.SmoothQuant else ""
    return f"static int8{smooth} ({o.quant_format}, {o.calibrate_method}" + (", per channel)" if o.per_channel else ")")


def _needs_data(job: Job) -> str | None:
    """Why the job needs calibration data (a phrase for the error), or None."""
    if job.tuning is not None:
        return "INC accuracy-aware tuning (it scores every trial on held-back samples)"
    if job.approach in ("static", "auto"):
        return "INC static quantization"
    if job.approach == "weight_only" and job.options.woq().algorithm == "AWQ":
        return "INC AWQ"
    return None


def _saturation_note(job: Job) -> str | None:
    if job.approach == "weight_only" or not int8_saturates():
        return None
    flags = [f for f in ("avx2", "avx512bw") if f in cpu_flags().flags]
    return (f"this CPU ({', '.join(flags) or 'x86, flags unknown'}, no VNNI) runs ONNX Runtime's int8 kernels with "
            "int16 pair sums that saturate with 8-bit weights, and INC 1.0 ignores reduce_range: expect more error "
            "here (per-channel weights most); ort_static / quark_static offer reduce_range")


def run(model: Any, context: PassContext, job: Job) -> OnnxModel:
    """Quantize ``model`` with INC as ``job`` says; the result is the new handle (``model`` is closed)."""
    if not isinstance(model, OnnxModel):
        raise UsageError(f"{job.pass_name} takes ONNX models, got {model.describe()}")
    why = _needs_data(job)
    feeds: list[Feed] = []
    held: list[Feed] = []
    if why is not None:
        feeds = calibration_feeds(model, context.data, who=why)
        if job.tuning is not None:
            if len(feeds) < 2:
                raise UsageError(f"{why}: needs at least 2 calibration samples (got {len(feeds)}); "
                                 "raise 'samples' in --data")
            feeds, held = split_feeds(feeds, job.tuning.held_back)
        feeds = feeds[: getattr(job.options, "calibration_sampling_size", len(feeds))]
    note = _saturation_note(job)
    if note:
        log.warning("%s: %s", job.pass_name, note)
    import_inc()
    t0 = time.perf_counter()
    with Workspace.open(model, context, prefix="inc", save_input=False) as ws:
        with contained(ws.folder) as messages, no_exit(_mode(job), messages):
            try:
                plan = _plan(job, model.proto, len(feeds))  # UsageErrors for the options, before the model is copied
                ws.save_input(model)
                if _folds_scales(job):
                    _prepare_folding(ws.input)
                if job.tuning is not None:
                    scorer = OutputScorer(ws.input, held, threads=context.jobs)
                    tuned = autotune(ws.input, plan.space, feeds, scorer, job.tuning, ws.folder / "best",
                                     optimize=job.options.optimize_model, base_ops=plan.base_ops,
                                     fix=repack_zero_points)
                    out = tuned.best_path
                else:
                    tuned = None
                    out = _quantize_once(ws, plan, feeds, job.options.optimize_model)
            except BitpressError:
                raise
            except Exception as exc:
                why = _first_line(exc).rstrip(".") + _hint(exc, job)
                raise QuantizationError(f"{TOOL} {_mode(job)} failed: {why}") from exc
        seconds = time.perf_counter() - t0
        ws.drop_input()
        result = ws.load(out, model)
        found = _check_quantized(result.proto, plan.marks, _mode(job))
        drop_unused_opsets(result.proto)
        mode = _mode(job) if tuned is None else _tuned_mode(tuned)
        report = IncReport(TOOL, dist_version(DISTRIBUTION), mode, seconds, found,
                           notes=[note] if note else [], tuning=tuned)
        record_report(context, job.pass_name, model, report)
    ws.finish(result)
    model.close()
    return result


def _tuned_mode(t: TuningResult) -> str:
    s = t.best.settings
    what = s.get("approach", "?")
    detail = ", ".join(f"{k}={v}" for k, v in s.items() if k != "approach")
    return f"{what} ({detail}), tuned: trial {t.best.index} of {len(t.trials)}, error {t.best.error:.4f}"


@dataclass
class Plan:
    """INC configs for one job: the single config, or the tuning space; the op types that show success."""

    config: Any
    space: list[Any]
    marks: tuple[str, ...]
    base_ops: dict[str, list[str]]
    kind: str  # static, dynamic, weight_only, auto


def _plan(job: Job, proto: onnx.ModelProto, samples: int) -> Plan:
    o = job.options
    has_data = bool(samples)
    if job.approach == "weight_only":
        w = o.woq()
        nodes = list(o.nodes_to_exclude)
        configs.check_nodes(proto, nodes, "nodes_to_exclude")
        if "MatMul" not in configs.model_op_types(proto):
            raise UsageError("nothing to quantize: weight-only quantization takes MatMul weights; the model has none")
        cfg = configs.woq_config(w, nodes)
        space = configs.woq_space(w, nodes, has_data) if job.tuning else []
        return Plan(cfg, space, QUANTIZED_OPS["weight_only"], {}, "weight_only")
    if job.approach == "dynamic":
        cfg = configs.dynamic_config(o, proto)
        space = configs.dynamic_space(o, proto) if job.tuning else []
        return Plan(cfg, space, QUANTIZED_OPS["dynamic"], {"dynamic": list(cfg.op_types_to_quantize)}, "dynamic")
    settings = configs.static_settings(o, proto, samples=max(1, samples))
    cfg = configs.static_config(settings, per_channel=o.per_channel, quant_last_matmul=o.quant_last_matmul)
    marks = QUANTIZED_OPS[o.quant_format]
    if job.approach == "static":
        space = configs.static_space(settings, o) if job.tuning else []
        return Plan(cfg, space, marks, {f"static/{o.quant_format}": list(settings.op_types)}, "static")
    # auto: the user's static and dynamic configs first, then INC's dynamic space (quick: no calibration),
    # then its static spaces in the chosen format and in the other
    other_format = "QDQ" if o.quant_format == "QOperator" else "QOperator"
    other = configs.static_settings(o, proto, other_format, samples=max(1, samples), strict=False)
    dynamic = configs.dynamic_space(o, proto, strict=False)
    static = configs.static_space(settings, o)
    space = [static[0], dynamic[0], *dynamic[1:], *static[1:], *configs.static_space(other, o)[1:]]
    marks = tuple(dict.fromkeys(QUANTIZED_OPS["QOperator"] + QUANTIZED_OPS["QDQ"] + QUANTIZED_OPS["dynamic"]))
    base = {f"static/{o.quant_format}": list(settings.op_types), f"static/{other_format}": list(other.op_types),
            "dynamic": list(dynamic[0].op_types_to_quantize)}
    return Plan(cfg, space, marks, base, "auto")


def _folds_scales(job: Job) -> bool:
    """Whether SmoothQuant or AWQ (which fold scales into the preceding node) may run."""
    if job.approach == "weight_only":
        return job.tuning is not None or job.options.woq().algorithm == "AWQ"
    if job.approach in ("static", "auto"):
        return job.options.smooth_quant().SmoothQuant
    return False


def _prepare_folding(path: Path) -> None:
    """The workspace's copy with scalar Mul constants broadcast (see fixes.broadcast_scalar_muls)."""
    proto = onnx.load(str(path), load_external_data=False)
    changed = broadcast_scalar_muls(proto)
    if changed:
        log.debug("gave %d Mul nodes a vector constant for INC's scale folding", changed)
        onnx.save_model(proto, str(path))


def _optimized(ws: Workspace) -> Path:
    """The input after ONNX Runtime's basic optimizations, as INC's ``quantize`` prepares it."""
    import onnxruntime as ort

    folder = ws.tmp / "optimized"
    folder.mkdir(parents=True, exist_ok=True)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.optimized_model_filepath = str(folder / "model.onnx")
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "model.onnx_data")
    opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(ws.input), opts, providers=["CPUExecutionProvider"])
    return folder / "model.onnx"


def _quantize_once(ws: Workspace, plan: Plan, feeds: list[Feed], optimize: bool) -> Path:
    from onnx_neural_compressor import constants
    from onnx_neural_compressor.quantization import algorithm_entry as algos

    source = str(_optimized(ws) if optimize else ws.input)
    cfg = plan.config
    reader = FeedReader(feeds)
    if cfg.name == constants.STATIC_QUANT:
        algos.static_quantize_entry(source, cfg, reader, model_output=str(ws.output))
    elif cfg.name == constants.SMOOTH_QUANT:
        algos.smooth_quant_entry(source, cfg, reader, model_output=str(ws.output))
    elif cfg.name == constants.DYNAMIC_QUANT:
        algos.dynamic_quantize_entry(source, cfg, model_output=str(ws.output))
    else:
        proto = (algos.awq_quantize_entry(source, cfg, reader) if cfg.name == constants.AWQ
                 else algos.rtn_quantize_entry(source, cfg))
        fixed = repack_zero_points(proto)
        if fixed:
            log.debug("re-packed the zero points of %d MatMulNBits nodes row by row (INC writes them flat)", fixed)
        _save(proto, ws.output, ws.external)
    return ws.output


def _save(proto: onnx.ModelProto, path: Path, external: bool) -> None:
    if external:
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(proto, str(path))


def _check_quantized(proto: onnx.ModelProto, marks: tuple[str, ...], mode: str) -> dict[str, int]:
    counts = count_ops(proto)
    found = {op: n for op, n in sorted(counts.items()) if op.startswith(marks)}
    if not found:
        raise QuantizationError(
            f"{TOOL} {mode} quantized nothing (no {', '.join(marks)} in its output): the model has no op INC "
            "quantizes in this mode, or the options exclude them all"
        )
    return found


def _hint(exc: Exception, job: Job) -> str:
    """What to do about the INC 1.0 failures known to have one."""
    options = job.options
    smooth = options.smooth_quant() if job.approach in ("static", "auto") else None
    if (smooth is not None and smooth.SmoothQuant and smooth.SmoothQuantFolding and isinstance(exc, ValueError)
            and "does not match tensor dimensions" in str(exc)):
        return ("; INC 1.0's SmoothQuant cannot fold its per-channel scales into a Mul by a scalar constant "
                "(BERT-style models have them): set extra_options SmoothQuantFolding: false")
    return ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["IncReport", "Job", "StaticOptions", "WeightOnlyOptions", "run"]
