"""INC's accuracy-aware tuning loop (``tuning.autotune``), scored by bitpress's output error.

INC's loop quantizes one config of a search space after the other, calls an evaluation
function on each result and stops at the first whose score is within ``tolerable_loss`` of the
float model's (``score >= baseline * (1 - tolerable_loss)``), or after ``max_trials``. bitpress
gives it :class:`OutputScorer`: the relative L2 error of every output against the float model
on held-back calibration samples (``bitpress eval``'s metric), the worst output counting,
reported to INC as ``1 - error`` with a baseline of exactly 1; so a trial passes when its error is
at most ``tolerance``.

What INC's loop does not do, this driver does: every trial is recorded (settings, error, time)
and logged; the best trial's files are kept (INC returns the *last* trial when ``max_trials``
ends the loop, and calls ``exit(0)`` when its space runs out before a trial passes); stale
trial files are removed from INC's folder as the loop goes (it writes a new external-data file
per trial and removes none until the end).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from bitpress.plugin import Feed, FeedReader, OutputAccumulator, QuantizationError, count_ops
from bitpress_inc import configs
from bitpress_inc.options import TuningOptions

log = logging.getLogger(__name__)


def session(path: Path | str, threads: int) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = max(1, threads)
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


class OutputScorer:
    """Relative L2 error of a model's outputs against the float model's, on fixed feeds."""

    def __init__(self, reference: Path, feeds: list[Feed], threads: int = 1) -> None:
        self.feeds = feeds
        self.threads = threads
        ref = session(reference, threads)
        self.names = [o.name for o in ref.get_outputs()]
        self.reference = [ref.run(None, f) for f in feeds]

    def errors(self, path: Path | str) -> dict[str, float]:
        """Per output: ``||y_q - y|| / ||y||`` over all held-back samples."""
        quant = session(path, self.threads)
        acc = {n: OutputAccumulator(n, False) for n in self.names}
        for feed, ref in zip(self.feeds, self.reference, strict=True):
            for name, r, q in zip(self.names, ref, quant.run(self.names, feed), strict=True):
                acc[name].add(r, q)
        return {n: a.result().relative_l2 for n, a in acc.items()}

    def error(self, path: Path | str) -> float:
        """The worst output's error (NaN / inf outputs count as infinitely wrong)."""
        values = self.errors(path).values()
        return max((v if math.isfinite(v) else math.inf) for v in values)


@dataclass
class Trial:
    index: int
    settings: dict[str, Any]
    error: float
    seconds: float
    quantized_ops: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"trial": self.index, **self.settings, "error": round(self.error, 6) if math.isfinite(self.error)
                else None, "seconds": round(self.seconds, 3), "quantized_ops": self.quantized_ops}

    def line(self) -> str:
        return f"trial {self.index}: {configs.summary_text(self.settings)}: error {self.error:.4f}"


@dataclass
class TuningResult:
    trials: list[Trial]
    best: Trial
    best_path: Path
    tolerance: float
    max_trials: int
    baseline_error: float
    held_back: int

    @property
    def met(self) -> bool:
        return self.best.error <= self.tolerance

    def to_json(self) -> dict[str, Any]:
        return {"tolerance": self.tolerance, "max_trials": self.max_trials, "met": self.met,
                "chosen": self.best.index, "held_back_samples": self.held_back,
                "float_baseline_error": self.baseline_error, "trials": [t.to_json() for t in self.trials]}


def _data_files(model_path: Path) -> set[str]:
    proto = onnx.load(str(model_path), load_external_data=False)
    return {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}


def _keep(model_path: Path, dest: Path) -> Path:
    """Copy a trial's model and its external data into ``dest`` (replacing what is there)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in _data_files(model_path):
        shutil.copy2(model_path.parent / name, dest / name)
    shutil.copy2(model_path, dest / "model.onnx")
    return dest / "model.onnx"


def _prune(model_path: Path) -> None:
    """Remove the external-data files of earlier trials from INC's evaluation folder."""
    live = _data_files(model_path) | {model_path.name}
    for f in model_path.parent.iterdir():
        if f.is_file() and f.name not in live and f.suffix in ("", ".data", ".onnx_data") and f.name != "config.json":
            f.unlink()


def autotune(
    model: Path,
    space: list[Any],
    feeds: list[Feed],
    scorer: OutputScorer,
    tuning: TuningOptions,
    keep_dir: Path,
    *,
    optimize: bool,
    base_ops: dict[str, list[str]],
    fix: Callable[[onnx.ModelProto], Any],
) -> TuningResult:
    """Run INC's ``autotune`` over ``space`` on ``model`` (a path); the best trial's model is kept in ``keep_dir``."""
    import onnxruntime as ort
    from onnx_neural_compressor.quantization import tuning as inc_tuning

    trials: list[Trial] = []
    current: dict[str, Any] = {}
    state: dict[str, Any] = {"baseline": None, "best": None, "failure": None}
    quantize = inc_tuning._quantize

    def quantize_trial(model_input: Any, quant_config: Any, calibration_data_reader: Any = None) -> Any:
        current.update(config=quant_config, started=time.perf_counter())
        q_model = quantize(model_input, quant_config, calibration_data_reader=calibration_data_reader)
        if q_model is None:
            raise QuantizationError(f"INC's tuning loop has no algorithm for config {type(quant_config).__name__}")
        fix(q_model)
        current["seconds"] = time.perf_counter() - current["started"]
        current["ops"] = dict(count_ops(q_model))
        return q_model

    def eval_fn(path: str) -> float:
        log.debug("tuning: scoring %s", path)
        try:
            if state["baseline"] is None:
                state["baseline"] = scorer.error(path)  # the float model as INC optimized it
                log.info("tuning: the float model scores %.2e against itself (graph optimizations)", state["baseline"])
                return 1.0
            error = scorer.error(path)
            trial = Trial(len(trials), configs.describe(current["config"], base_ops), error,
                          current.get("seconds", 0.0), _quantized(current.get("ops", {})))
            trials.append(trial)
            log.info("tuning: %s", trial.line())
            if state["best"] is None or error < state["best"].error:
                state["best"] = trial
                _keep(Path(path), keep_dir)
            _prune(Path(path))
            return 1.0 - error if math.isfinite(error) else -math.inf
        except BaseException as exc:
            state["failure"] = exc
            raise

    inc_tuning._quantize = quantize_trial  # put back by the containment (sandbox.INC_GLOBALS)
    config = inc_tuning.TuningConfig(config_set=space, tolerable_loss=tuning.tolerance, max_trials=tuning.max_trials)
    level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        inc_tuning.autotune(str(model), config, eval_fn=eval_fn, calibration_data_reader=FeedReader(feeds),
                            optimization_level=level)
    except SystemExit:
        # INC: the space ran out before a trial met the tolerance (or the float model's evaluation failed)
        if state["failure"] is not None:
            raise QuantizationError(f"scoring the float model failed: {state['failure']}") from state["failure"]
    if state["best"] is None:
        raise QuantizationError("INC's tuning loop ran no trial (every config of the space was skipped)")
    return TuningResult(trials, state["best"], keep_dir / "model.onnx", tuning.tolerance, tuning.max_trials,
                        float(state["baseline"] or 0.0), len(scorer.feeds))


def _quantized(ops: dict[str, int]) -> dict[str, int]:
    marks = ("QLinear", "QGemm", "QAttention", "MatMulInteger", "ConvInteger", "DynamicQuantize", "MatMulNBits",
             "QuantizeLinear", "DequantizeLinear")
    return {k: v for k, v in sorted(ops.items()) if k.startswith(marks)}


__all__ = ["OutputScorer", "Trial", "TuningResult", "autotune"]
