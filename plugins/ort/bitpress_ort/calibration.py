"""Activation ranges from ONNX Runtime's calibrators, in bounded memory.

``quantize_static`` holds the model three times while it calibrates (its own copy, the
calibrator's copy, the calibration session), serializes the augmented model once more, and
its histogram calibrators (Entropy, Percentile, Distribution) keep every sample's outputs of
every calibrated tensor until the end. Here the same calibrator classes run differently:

* the calibrator's copy of the graph is loaded *without* its weights (the model is staged with
  external data; only the ONNX Runtime session reads them), and the augmented model is written
  beside the staged one so its external references resolve: weights are in memory once;
* only the inputs and outputs of the nodes that will be quantized are calibrated (ONNX Runtime
  calibrates every node of the quantized op types, excluded nodes too);
* samples are streamed in chunks: each chunk's outputs are merged into the histograms (or
  min/max) and dropped before the next one runs. The chunk size comes from the first sample's
  measured output size and a memory budget, or from ``calibration_chunk_size``.

The ranges are then written as ONNX Runtime's calibration cache, which ``quantize_static``
reads instead of calibrating (``calibration_cache_path``): the quantization itself is ONNX
Runtime's own, unchanged.

One repair of ONNX Runtime's histograms, logged: a tensor holding values that no float32
histogram spans (attention masks of -3.4e38 in decoders: numpy raises "Too many bins for data
range" and the whole calibration fails) gets its min/max range instead.
"""

from __future__ import annotations

import itertools
import logging
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bitpress.plugin import Feed, FeedReader, QuantizationError
from bitpress_ort.entropy import entropy_threshold

log = logging.getLogger(__name__)

#: activations held at once during histogram calibration when no chunk size is given
DEFAULT_CHUNK_BYTES = 256 << 20
#: a calibrated range this wide is an attention mask's (-3.4e38): one step of an int8 grid over it
#: is above 1e28, so every other value of the tensor rounds to zero
HUGE_RANGE = 1e30


@dataclass(frozen=True)
class CalibrationPlan:
    """What to calibrate and how: ONNX Runtime's calibrator settings plus the node selection."""

    method: str  # MinMax | Entropy | Percentile | Distribution
    op_types: frozenset[str]  # op types the quantizer quantizes
    nodes_to_quantize: frozenset[str] = frozenset()
    nodes_to_exclude: frozenset[str] = frozenset()
    symmetric: bool | None = None  # CalibTensorRangeSymmetric; None: the calibrator's default
    moving_average: bool = False
    averaging_constant: float = 0.01
    percentile: float = 99.999
    num_bins: int | None = None  # None: the method's default (see DEFAULT_BINS)
    num_quantized_bins: int = 128
    chunk_size: int = 0  # samples per chunk; 0: from DEFAULT_CHUNK_BYTES

    def selects(self, node: onnx.NodeProto) -> bool:
        if node.op_type not in self.op_types or node.name in self.nodes_to_exclude:
            return False
        return not self.nodes_to_quantize or node.name in self.nodes_to_quantize


#: histogram bins per method. ONNX Runtime's Entropy default (128 bins, as many as quantized
#: bins) leaves its KL search a single candidate, the full range: Entropy *is* MinMax there
#: (measured: every range identical). 512 bins give it 193 candidates.
DEFAULT_BINS = {"Entropy": 512, "Percentile": 2048, "Distribution": 2048}


@dataclass
class CalibrationResult:
    ranges: Any  # onnxruntime.quantization.calibrate.TensorsData
    tensors: int
    samples: int
    chunks: int
    #: tensors whose values no float32 histogram spans: given their min/max range
    minmax_fallback: list[str]
    bytes_per_sample: int
    #: tensors whose range exceeds HUGE_RANGE (attention masks)
    huge: list[str] = field(default_factory=list)


def _graph_only(model_path: Path) -> onnx.ModelProto:
    """ONNX Runtime's ``load_model_with_shape_infer`` without reading the external weights."""
    from onnxruntime.quantization.quant_utils import add_infer_metadata

    inferred = model_path.with_name(model_path.stem + "-inferred.onnx")
    onnx.shape_inference.infer_shapes_path(str(model_path), str(inferred))
    model = onnx.load(str(inferred), load_external_data=False)
    inferred.unlink()
    add_infer_metadata(model)
    return model


def _selector(plan: CalibrationPlan) -> Callable[[Any, onnx.ModelProto], tuple[set[str], dict[str, Any]]]:
    """``select_tensors_to_calibrate`` for the nodes the plan quantizes (not whole op types)."""
    float_types = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}

    def select(self: Any, model: onnx.ModelProto) -> tuple[set[str], dict[str, Any]]:
        value_infos = {vi.name: vi for vi in model.graph.value_info}
        value_infos.update({o.name: o for o in model.graph.output})
        value_infos.update({i.name: i for i in model.graph.input})
        initializers = {t.name for t in model.graph.initializer}
        tensors = set()
        for node in model.graph.node:
            if not plan.selects(node):
                continue
            for name in itertools.chain(node.input, node.output):
                vi = value_infos.get(name)
                if (vi is not None and name not in initializers and vi.type.HasField("tensor_type")
                        and vi.type.tensor_type.elem_type in float_types):
                    tensors.add(name)
        self.bitpress_selected = tensors  # what the augmentation added, counted for the report
        return tensors, value_infos

    return select


def _make_calibrator(model_path: Path, augmented: Path, plan: CalibrationPlan) -> Any:
    """ONNX Runtime's calibrator for ``plan.method``, as ``create_calibrator`` builds it."""
    from onnxruntime.quantization import calibrate

    bins = plan.num_bins or DEFAULT_BINS.get(plan.method)
    common = {"op_types_to_calibrate": sorted(plan.op_types), "augmented_model_path": str(augmented),
              "use_external_data_format": False}
    # the calibrator's copy of the graph, without weights (restored by the sandbox on exit)
    calibrate.load_model_with_shape_infer = _graph_only
    if plan.method == "MinMax":
        calibrator = calibrate.MinMaxCalibrater(
            str(model_path), **common, symmetric=bool(plan.symmetric), moving_average=plan.moving_average,
            averaging_constant=plan.averaging_constant)
    elif plan.method == "Entropy":
        calibrator = calibrate.EntropyCalibrater(
            str(model_path), **common, symmetric=bool(plan.symmetric), num_bins=bins,
            num_quantized_bins=plan.num_quantized_bins)
    elif plan.method == "Percentile":
        # ONNX Runtime's default for Percentile is symmetric (a histogram of |x|)
        calibrator = calibrate.PercentileCalibrater(
            str(model_path), **common, symmetric=True if plan.symmetric is None else plan.symmetric,
            num_bins=bins, percentile=plan.percentile)
    elif plan.method == "Distribution":
        calibrator = calibrate.DistributionCalibrater(str(model_path), **common, num_bins=bins)
    else:
        raise ValueError(f"unknown calibration method {plan.method!r}")
    calibrator.select_tensors_to_calibrate = types.MethodType(_selector(plan), calibrator)
    return calibrator


class _GuardedCollector:
    """ONNX Runtime's ``HistogramCollector``, one tensor at a time, surviving tensors numpy cannot histogram.

    Where ONNX Runtime's histogram of a tensor fails (values spanning more than float32 can:
    attention masks of -3.4e38 in Entropy's and Distribution's [-max|x|, max|x|] histograms), that
    tensor gets its observed min/max instead of the whole calibration failing. It also measures
    how many bytes one sample's calibrated outputs take (for the chunk size).
    """

    def __init__(self, base: Any) -> None:
        self.base = base
        self.minmax: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.bytes_per_sample = 0

    def collect(self, name_to_arr: dict[str, list[np.ndarray]]) -> None:
        samples = max((len(v) for v in name_to_arr.values()), default=0)
        if samples and not self.bytes_per_sample:
            self.bytes_per_sample = sum(a.nbytes for v in name_to_arr.values() for a in v) // samples
        # what HistogramCollector.collect dispatches to (it would also print a line per call)
        absolute = self.base.method == "percentile" and self.base.symmetric
        collect = self.base.collect_absolute_value if absolute else self.base.collect_value
        for name, arrays in name_to_arr.items():
            if name not in self.minmax:
                try:
                    collect({name: arrays})
                    continue
                except ValueError:  # numpy: "Too many bins for data range", or bins that overflow
                    pass
            lo, hi = _min_max(arrays)
            self._to_minmax(name, lo, hi, arrays[0].dtype)

    def _to_minmax(self, name: str, lo: float, hi: float, dtype: np.dtype) -> None:
        held = self.base.histogram_dict.pop(name, None)
        if held is not None:  # histogrammed so far: its min/max are entries 2 and 3
            lo, hi = min(lo, float(held[2])), max(hi, float(held[3]))
        if name in self.minmax:
            old_lo, old_hi = self.minmax[name]
            lo, hi = min(lo, float(old_lo)), max(hi, float(old_hi))
        self.minmax[name] = (np.array(lo, dtype=dtype), np.array(hi, dtype=dtype))

    def compute_collection_result(self) -> dict[str, Any]:
        from onnxruntime.quantization.calibrate import TensorData

        result = self.base.compute_collection_result() if self.base.histogram_dict else {}
        result.update({name: TensorData(lowest=lo, highest=hi) for name, (lo, hi) in self.minmax.items()})
        return result

    def __getattr__(self, name: str) -> Any:  # the calibrator reads the base's other attributes
        return getattr(self.base, name)


def _min_max(arrays: Sequence[np.ndarray]) -> tuple[float, float]:
    lows = [float(np.nanmin(a)) for a in arrays if a.size]
    highs = [float(np.nanmax(a)) for a in arrays if a.size]
    return (min(lows), max(highs)) if lows else (0.0, 0.0)


def _chunks(feeds: Sequence[Feed], first: int, size: Callable[[], int]) -> Iterable[list[Feed]]:
    """``feeds`` in chunks: ``first`` samples, then ``size()`` each (asked after each chunk)."""
    i = 0
    n = first
    while i < len(feeds):
        yield list(feeds[i:i + n])
        i += n
        n = max(1, size())


def calibrate(model_path: Path, feeds: Sequence[Feed], plan: CalibrationPlan, *, progress: Callable[[int], Any]
              ) -> CalibrationResult:
    """Run ``plan`` on ``model_path`` (staged with external data) over ``feeds``; call inside the sandbox."""
    augmented = model_path.with_name("augmented.onnx")
    calibrator = _make_calibrator(model_path, augmented, plan)
    try:
        calibrator.augment_graph()
        calibrator.create_inference_session()
        tensors = len(calibrator.bitpress_selected)
        if not tensors:
            raise QuantizationError(
                "no activation to calibrate: the options select no node whose inputs or outputs are float tensors")
        guard = None
        if plan.method != "MinMax":
            from onnxruntime.quantization.calibrate import HistogramCollector

            guard = _GuardedCollector(HistogramCollector(
                method=calibrator.method, symmetric=calibrator.symmetric, num_bins=calibrator.num_bins,
                num_quantized_bins=calibrator.num_quantized_bins, percentile=calibrator.percentile,
                scenario=calibrator.scenario))
            calibrator.collector = guard
            if plan.method == "Entropy":
                # the same search as ONNX Runtime's, without its Python loops (bitpress_ort.entropy)
                guard.base.get_entropy_threshold = entropy_threshold

        def next_size() -> int:
            if plan.chunk_size:
                return plan.chunk_size
            if guard is None or not guard.bytes_per_sample:
                return len(feeds)  # min/max: a few numbers per tensor and sample
            return max(1, DEFAULT_CHUNK_BYTES // guard.bytes_per_sample)

        first = plan.chunk_size or (1 if guard is not None else len(feeds))
        chunks = 0
        for chunk in _chunks(feeds, first, next_size):
            try:
                calibrator.collect_data(FeedReader(chunk))
            except (ValueError, RuntimeError) as exc:
                raise QuantizationError(f"ONNX Runtime's {plan.method} calibration failed: {_first_line(exc)}") from exc
            chunks += 1
            progress(len(chunk))
        try:
            ranges = calibrator.compute_data()
        except (ValueError, RuntimeError) as exc:
            raise QuantizationError(f"ONNX Runtime's {plan.method} calibration failed: {_first_line(exc)}") from exc
        fallback = sorted(guard.minmax) if guard is not None else []
        if fallback:
            log.warning(
                "%s calibration: %d tensor(s) hold values no float32 histogram spans (attention masks of "
                "-3.4e38, say); they get their min/max range: %s", plan.method, len(fallback),
                ", ".join(fallback[:5]) + (" ..." if len(fallback) > 5 else ""))
        return CalibrationResult(ranges, tensors, len(feeds), chunks, fallback,
                                 guard.bytes_per_sample if guard is not None else 0, huge_ranges(ranges))
    finally:
        # the session holds the weights: drop it before the quantizer loads them
        calibrator.infer_session = None
        del calibrator
        augmented.unlink(missing_ok=True)


def huge_ranges(ranges: Any) -> list[str]:
    """The tensors whose calibrated range reaches past :data:`HUGE_RANGE`."""
    out = []
    for name, data in ranges.items():
        lo, hi = data.range_value
        if max(float(np.max(np.abs(lo))), float(np.max(np.abs(hi)))) > HUGE_RANGE:
            out.append(name)
    return sorted(out)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def save_cache(ranges: Any, path: Path) -> Path:
    """Write ``ranges`` as ONNX Runtime's calibration cache (``quantize_static(calibration_cache_path=)``)."""
    from onnxruntime.quantization.calibrate import save_tensors_data

    save_tensors_data(ranges, path)
    return path


__all__ = ["DEFAULT_BINS", "HUGE_RANGE", "CalibrationPlan", "CalibrationResult", "calibrate", "huge_ranges",
           "save_cache"]
