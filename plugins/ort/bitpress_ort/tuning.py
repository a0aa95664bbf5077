"""``ort_tune`` (Olive's ``OnnxQuantization``): a small search over static and dynamic int8.

Olive's pass tunes ``quant_mode`` x ``quant_format`` x ``per_channel`` x ``calibrate_method``
(and more) with its search strategies, scored by the user's evaluator. Here the search is a
bounded grid over those four settings, scored by ``bitpress eval``'s output error
(:class:`bitpress.evaluate.metrics.OutputAccumulator`: relative L2 error of every output
against the float model, the worst output counts) on calibration samples *held back* from
the calibration. Each setting takes Olive's spellings: a value, a list of values,
``SEARCHABLE_VALUES`` (Olive's search space) or ``DEFAULT_VALUE`` (the static pass's default).

Costs are shared: the model is staged and pre-processed once, and calibrated once per
calibration method (the ranges do not depend on the format or on per-channel weights). Every
trial is listed in the run report, and the best one is the output.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import onnx

from bitpress.plugin import (
    Feed,
    OutputAccumulator,
    PassContext,
    QuantizationError,
    ToolReport,
    UsageError,
    count_ops,
    option,
    record_report,
    split_feeds,
)
from bitpress_ort.calibration import CalibrationResult
from bitpress_ort.options import (
    DISTRIBUTION_REFUSED,
    FLOAT_MASKS_HELP,
    OrtCommonOptions,
    QuantFormatName,
    QuantTypeName,
    check_static_types,
    quant_type,
)
from bitpress_ort.passes import (
    DYNAMIC_OPS,
    _OrtPass,
    _quantizer_extra,
    calibration_plan,
    dynamic_config,
    selection,
    static_feeds,
)
from bitpress_ort.runner import (
    Staged,
    StaticConfig,
    calibrate_staged,
    check_loads,
    ort_version,
    prepare,
    quantize_dynamic_staged,
    quantize_static_from_cache,
    static_ops,
    take_result,
    with_float_masks,
)

log = logging.getLogger(__name__)

SEARCH = "SEARCHABLE_VALUES"
DEFAULT = "DEFAULT_VALUE"
Magic = Literal["SEARCHABLE_VALUES", "DEFAULT_VALUE"]
TunedMethod = Literal["MinMax", "Entropy", "Percentile"]
Mode = Literal["static", "dynamic"]

#: Olive's search space of each setting, and the static pass's default
SPACE: dict[str, tuple[list[Any], Any]] = {
    "quant_mode": (["dynamic", "static"], "static"),
    "quant_format": (["QOperator", "QDQ"], "QDQ"),
    "per_channel": ([False, True], False),
    "calibrate_method": (["MinMax", "Entropy", "Percentile"], "MinMax"),
}


@dataclass
class OrtTuneOptions(OrtCommonOptions):
    quant_mode: Magic | Mode | list[Mode] = option(
        SEARCH, "static, dynamic, a list of both, SEARCHABLE_VALUES (both) or DEFAULT_VALUE (static)")
    quant_format: Magic | QuantFormatName | list[QuantFormatName] = option(
        SEARCH, "static trials: QDQ, QOperator, a list, SEARCHABLE_VALUES (both) or DEFAULT_VALUE (QDQ)")
    per_channel: Magic | bool | list[bool] = option(  # type: ignore[assignment]
        SEARCH, "true, false, a list, SEARCHABLE_VALUES (both) or DEFAULT_VALUE (false)")
    calibrate_method: Magic | TunedMethod | list[TunedMethod] = option(
        SEARCH, "static trials: MinMax, Entropy, Percentile, a list, SEARCHABLE_VALUES (all three) or "
        "DEFAULT_VALUE (MinMax)")
    activation_type: QuantTypeName = option("QInt8", "activations of static trials: QInt8 or QUInt8")
    calibration_sampling_size: int = option(0, "samples used, the first N of --data (0: all), held-back ones included")
    calibration_chunk_size: int = option(
        0, "as for ort_static: samples per histogram merge (0: 256 MiB of activations)")
    calibration_num_bins: int = option(0, "as for ort_static: histogram bins (0: Entropy 512, Percentile 2048)")
    float_masks: bool = option(True, FLOAT_MASKS_HELP)
    held_back: float = option(0.25, "fraction of the samples kept out of calibration and used to score the trials")
    max_trials: int = option(16, "at most this many trials (the grid in order: dynamic first, as Olive lists it)")

    def validate(self) -> None:
        if not 0 < self.held_back < 1:
            raise ValueError(f"held_back must be between 0 and 1, got {self.held_back}")
        if self.max_trials < 1:
            raise ValueError(f"max_trials must be >= 1, got {self.max_trials}")
        for name in ("calibration_sampling_size", "calibration_chunk_size", "calibration_num_bins"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        space = self.space()
        if "Distribution" in space["calibrate_method"]:
            raise ValueError(DISTRIBUTION_REFUSED)
        if "static" in space["quant_mode"]:
            for fmt in space["quant_format"]:
                check_static_types(fmt, self.activation_type, self.weight_quant_type())
        if not trials_of(space):
            raise ValueError("the search space is empty")

    def space(self) -> dict[str, list[Any]]:
        """Each searched setting's values (duplicates dropped, order kept)."""
        out = {}
        for name, (search, default) in SPACE.items():
            value = getattr(self, name)
            values = search if value == SEARCH else [default] if value == DEFAULT else (
                value if isinstance(value, list) else [value])
            if not values:
                raise ValueError(f"{name}: an empty list; give values, SEARCHABLE_VALUES or DEFAULT_VALUE")
            out[name] = list(dict.fromkeys(values))
        return out


@dataclass(frozen=True)
class Setting:
    mode: str
    per_channel: bool
    quant_format: str | None = None
    method: str | None = None

    def label(self) -> str:
        pc = "per-channel" if self.per_channel else "per-tensor"
        if self.mode == "dynamic":
            return f"dynamic {pc}"
        return f"static {self.quant_format} {self.method} {pc}"


def trials_of(space: dict[str, list[Any]]) -> list[Setting]:
    """The grid, in Olive's order of values: dynamic trials, then static ones."""
    out = []
    for mode in space["quant_mode"]:
        if mode == "dynamic":
            out += [Setting("dynamic", pc) for pc in space["per_channel"]]
        else:
            out += [Setting("static", pc, fmt, m) for m, fmt, pc in itertools.product(
                space["calibrate_method"], space["quant_format"], space["per_channel"])]
    return out


@dataclass
class Trial:
    setting: Setting
    error: float = math.nan  # relative L2 error, worst output
    cosine: float = math.nan  # cosine similarity, worst output
    bytes: int = 0
    seconds: float = 0.0
    failed: str | None = None
    path: Path | None = None
    quantized_ops: dict[str, int] = field(default_factory=dict)

    def key(self) -> tuple[float, float]:
        """What the search minimizes: the error, then the size (failed trials last)."""
        return (math.inf, math.inf) if self.failed else (self.error, self.bytes)

    def to_json(self) -> dict[str, Any]:
        s = self.setting
        row: dict[str, Any] = {"trial": s.label(), "quant_mode": s.mode, "per_channel": s.per_channel,
                               "quant_format": s.quant_format, "calibrate_method": s.method,
                               "seconds": round(self.seconds, 3)}
        if self.failed:
            row["failed"] = self.failed
        else:
            row.update({"relative_l2": self.error, "cosine": self.cosine, "bytes": self.bytes})
        return row


@dataclass
class TuneReport(ToolReport):
    """The tuning's run report: the winning trial's line, then the table of every trial."""

    trials: list[Trial] = field(default_factory=list)
    best: int = -1
    held_back: int = 0

    def summary(self) -> str:
        head = super().summary()
        lines = [f"{head}; best of {len(self.trials)} trial(s) on {self.held_back} held-back sample(s):"]
        lines += [f"    {line}" for line in trial_table(self.trials, self.best)]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "trials": [t.to_json() for t in self.trials], "best": self.best,
                "held_back_samples": self.held_back, "metric": "relative_l2 of the worst output (bitpress eval)"}


def trial_table(trials: Sequence[Trial], best: int) -> list[str]:
    rows = [("", "trial", "rel. L2", "cosine", "size", "time")]
    for i, t in enumerate(trials):
        mark = "*" if i == best else ""
        if t.failed:
            rows.append((mark, t.setting.label(), "failed", t.failed[:60], "", f"{t.seconds:.1f} s"))
        else:
            rows.append((mark, t.setting.label(), f"{t.error:.4f}", f"{t.cosine:.5f}", f"{t.bytes / 1e6:.2f} MB",
                         f"{t.seconds:.1f} s"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _session(path: Path) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _outputs(path: Path, feeds: Sequence[Feed]) -> list[list[np.ndarray]]:
    sess = _session(path)
    return [sess.run(None, f) for f in feeds]


def score(path: Path, feeds: Sequence[Feed], reference: list[list[np.ndarray]], names: list[str]
          ) -> tuple[float, float]:
    """``bitpress eval``'s output metrics of ``path`` against ``reference``: (worst rel. L2, worst cosine)."""
    accs = [OutputAccumulator(n, False) for n in names]
    sess = _session(path)
    for feed, ref in zip(feeds, reference, strict=True):
        for acc, r, q in zip(accs, ref, sess.run(None, feed), strict=True):
            acc.add(r, q)
    results = [a.result() for a in accs]
    return max(r.relative_l2 for r in results), min(r.cosine for r in results)


def _model_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.iterdir() if p.is_file())


class OrtTunePass(_OrtPass):
    """Olive's OnnxQuantization: the best of a small grid of static and dynamic int8 settings."""

    name = "ort_tune"
    aliases: ClassVar[tuple[str, ...]] = ("OnnxQuantization",)
    algorithms = ("ort_tune",)
    needs_data = True  # the trials are scored on held-back samples, dynamic ones too
    summary = ("ONNX Runtime int8, tuned: the best of static (QDQ/QOperator x MinMax/Entropy/Percentile) and "
               "dynamic trials, scored by the output error on held-back samples")
    Options: ClassVar[type] = OrtTuneOptions

    def run(self, model: Any, context: PassContext) -> Any:
        model = self._onnx(model)
        o: OrtTuneOptions = self.options
        space = o.space()
        settings = trials_of(space)
        if len(settings) > o.max_trials:
            log.warning("%s: %d settings in the search space, max_trials=%d: the last %d are not tried",
                        self.name, len(settings), o.max_trials, len(settings) - o.max_trials)
            settings = settings[:o.max_trials]
        feeds = static_feeds(model, context, o.calibration_sampling_size, "ONNX Runtime tuned quantization")
        try:
            calib_feeds, held = split_feeds(feeds, o.held_back)
        except UsageError as exc:
            raise UsageError(f"{self.name}: {exc} (give more samples with --data)") from None
        reduce_range = self._reduce_range(o.reduce_range)
        statics = [s for s in settings if s.mode == "static"]
        ops, include, exclude = selection(model, o, static=True) if statics else ((), (), ())
        dyn_cfg = dynamic_config(o, model, reduce_range.value) if any(s.mode == "dynamic" for s in settings) else None
        t0 = time.perf_counter()
        staged = prepare(model, context, o.quant_preprocess)
        try:
            names = [v.name for v in _session(staged.ws.input).get_outputs()]
            reference = _outputs(staged.ws.input, held)
            trials = self._run_trials(staged, o, settings, calib_feeds, held, reference, names, context,
                                      (ops, include, exclude), reduce_range.value, dyn_cfg)
            kept = [i for i, t in enumerate(trials) if t.path is not None]
            if not kept:
                raise QuantizationError(f"{self.name}: every trial failed; the first: {trials[0].failed}")
            best = kept[0]
            winner = trials[best]
            for line in trial_table(trials, best):
                log.info("%s: %s", self.name, line)
            assert winner.path is not None
            mode = f"{winner.setting.label()} (tuned)"
            fmt = winner.setting.quant_format
            quantized = DYNAMIC_OPS if fmt is None else static_ops(fmt)
            result, found = take_result(staged, model, winner.path, mode, quantized)
            details = {"reduce_range": reduce_range.value, "reduce_range_reason": reduce_range.reason,
                       "quant_preprocess": staged.preprocessed, "quant_preprocess_reason": staged.preprocess_reason,
                       "calibration_samples": len(calib_feeds)}
            report = TuneReport("ONNX Runtime", ort_version(), mode, time.perf_counter() - t0, found, details,
                                trials=trials, best=best, held_back=len(held))
            record_report(context, self.name, model, report)
        except BaseException:
            staged.ws.discard()
            raise
        staged.drop_inputs()
        staged.ws.finish(result)
        model.close()
        return result

    def _run_trials(self, staged: Staged, o: OrtTuneOptions, settings: list[Setting], calib_feeds: list[Feed],
                    held: list[Feed], reference: list[list[np.ndarray]], names: list[str], context: PassContext,
                    nodes: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]], reduce_range: bool,
                    dyn_cfg: Any) -> list[Trial]:
        ops, include, exclude = nodes
        caches: dict[str, tuple[CalibrationResult, Path] | str] = {}  # method -> ranges and cache, or why it failed
        trials: list[Trial] = []
        best_key = (math.inf, math.inf)
        root = staged.ws.tmp / "trials"
        for i, s in enumerate(settings):
            trial = Trial(s)
            trials.append(trial)
            dest = root / f"{i:02d}" / "model.onnx"
            t0 = time.perf_counter()
            try:
                if s.mode == "dynamic":
                    quantize_dynamic_staged(staged, dataclasses.replace(dyn_cfg, per_channel=s.per_channel), dest)
                    quantized: tuple[str, ...] = DYNAMIC_OPS
                else:
                    assert s.method is not None and s.quant_format is not None
                    plan = calibration_plan(o, s.method, ops, include, exclude)  # type: ignore[arg-type]
                    if s.method not in caches:
                        try:
                            caches[s.method] = calibrate_staged(staged, calib_feeds, plan, context, name="tune")
                        except QuantizationError as exc:
                            caches[s.method] = str(exc)
                    calibrated = caches[s.method]
                    if isinstance(calibrated, str):
                        raise QuantizationError(calibrated)
                    calib, cache = calibrated
                    cfg_s = StaticConfig(s.quant_format, quant_type(o.activation_type), o.weight_quant_type(),
                                         s.per_channel, reduce_range, ops, include, exclude, _quantizer_extra(o), plan)
                    if o.float_masks:
                        cfg_s = with_float_masks(cfg_s, staged, calib)[0]
                    quantize_static_from_cache(staged, cfg_s, cache, dest)
                    quantized = static_ops(s.quant_format)
                counts = count_ops(onnx.load(str(dest), load_external_data=False))
                trial.quantized_ops = {op: counts[op] for op in quantized if counts[op]}
                if not trial.quantized_ops:
                    raise QuantizationError(f"quantized nothing (no {', '.join(quantized)})")
                check_loads(dest, s.label())
                trial.error, trial.cosine = score(dest, held, reference, names)
                trial.bytes = _model_bytes(dest)
                trial.path = dest
            except QuantizationError as exc:
                trial.failed = str(exc)
                log.warning("%s: trial %s failed: %s", self.name, s.label(), exc)
            trial.seconds = time.perf_counter() - t0
            # keep the best trial's files only: disk stays at two models
            if trial.path is not None and trial.key() < best_key:
                for other in trials[:-1]:
                    if other.path is not None:
                        shutil.rmtree(other.path.parent, ignore_errors=True)
                        other.path = None
                best_key = trial.key()
            elif trial.path is not None:
                shutil.rmtree(dest.parent, ignore_errors=True)
                trial.path = None
        return trials
