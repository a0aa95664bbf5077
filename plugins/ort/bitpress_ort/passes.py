"""The ONNX Runtime passes: static int8, dynamic int8 and the tuning search over both.

Importing this module imports nothing of ``onnxruntime.quantization``: ONNX Runtime's
quantization modules are imported inside ``run()``, under :func:`bitpress_ort.sandbox.contained`.
"""

from __future__ import annotations

import difflib
import logging
import time
from typing import Any, ClassVar, Literal

from bitpress.plugin import (
    Feed,
    OnnxModel,
    Pass,
    PassContext,
    ReduceRange,
    ToolReport,
    UsageError,
    calibration_feeds,
    iter_graphs,
    record_report,
    resolve_reduce_range,
)
from bitpress_ort.calibration import CalibrationPlan
from bitpress_ort.options import (
    CALIBRATION_KEYS,
    STREAMING_KEYS,
    OrtCommonOptions,
    OrtDynamicOptions,
    OrtStaticOptions,
    quant_type,
)
from bitpress_ort.runner import (
    DYNAMIC_OPS,
    DynamicConfig,
    Staged,
    StaticConfig,
    calibrate_staged,
    ort_version,
    prepare,
    quantize_dynamic_staged,
    quantize_static_from_cache,
    static_ops,
    take_result,
    with_float_masks,
)
from bitpress_ort.sandbox import import_ort

log = logging.getLogger(__name__)

REQUIRES = ("onnxruntime", "ml_dtypes")
INSTALL_HINT = 'pip install "onnxruntime>=1.20" ml_dtypes sympy'

#: op types ONNX Runtime 1.32 quantizes by default (its registries), for option checks before work
STATIC_OP_TYPES = frozenset({
    "Add", "ArgMax", "AveragePool", "BatchNormalization", "Clip", "Concat", "Conv", "ConvTranspose", "CumSum",
    "EmbedLayerNormalization", "Flatten", "Gather", "GatherElements", "Gemm", "GlobalAveragePool",
    "InstanceNormalization", "LayerNormalization", "LeakyRelu", "MatMul", "MaxPool", "Mul", "Pad", "Relu",
    "Reshape", "Resize", "Sigmoid", "Slice", "Softmax", "Split", "Squeeze", "TopK", "Transpose", "Unsqueeze",
    "Where",
})
DYNAMIC_OP_TYPES = frozenset({"Attention", "Conv", "EmbedLayerNormalization", "Gather", "LSTM", "MatMul", "Transpose"})


def _registry_ops(static: bool) -> frozenset[str]:
    """The op types ONNX Runtime's registries list (imported lazily; the constants above if that fails)."""
    try:
        import_ort()  # its import has side effects: contained
        from onnxruntime.quantization.registry import IntegerOpsRegistry, QDQRegistry, QLinearOpsRegistry
    except ImportError:
        return STATIC_OP_TYPES if static else DYNAMIC_OP_TYPES
    return frozenset(QLinearOpsRegistry) | frozenset(QDQRegistry) if static else frozenset(IntegerOpsRegistry)


class _OrtPass(Pass):
    requires: ClassVar[tuple[str, ...]] = REQUIRES
    install_hint: ClassVar[str | None] = INSTALL_HINT
    precisions = ("int8",)

    def _onnx(self, model: Any) -> OnnxModel:
        if not isinstance(model, OnnxModel):
            raise UsageError(f"{self.name} takes ONNX models, got {model.describe()}")
        return model

    def _reduce_range(self, value: Literal["auto"] | bool) -> ReduceRange:
        choice = resolve_reduce_range(value)
        log.info("%s: %s", self.name, choice.summary())
        return choice


def selection(model: OnnxModel, o: OrtCommonOptions, *, static: bool) -> tuple[tuple[str, ...], tuple[str, ...],
                                                                              tuple[str, ...]]:
    """``(op types, nodes to quantize, nodes to exclude)`` for ONNX Runtime; bad names raise UsageError."""
    present_ops = {n.op_type for g in iter_graphs(model.proto.graph) for n in g.node}
    names = {n.name for g in iter_graphs(model.proto.graph) for n in g.node}
    supported = _registry_ops(static)
    mode = "static" if static else "dynamic"
    for option_name, values in (("op_types_to_quantize", o.op_types_to_quantize),
                                ("op_types_to_exclude", o.op_types_to_exclude)):
        for op in values:
            if op not in supported:  # a typo, or an op type ONNX Runtime never quantizes: say so
                close = difflib.get_close_matches(op, sorted(supported), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise UsageError(f"{option_name}: ONNX Runtime's {mode} quantization does not quantize op type "
                                 f"{op!r}{hint}; it quantizes {', '.join(sorted(supported))}")
        absent = sorted(set(values) - present_ops)
        if absent:  # a recipe for several models may name op types this one lacks
            log.info("%s: the model has no %s nodes", option_name, ", ".join(absent))
    for option_name, values in (("nodes_to_quantize", o.nodes_to_quantize), ("nodes_to_exclude", o.nodes_to_exclude)):
        unknown = sorted(set(values) - names)
        if unknown:
            raise UsageError(f"{option_name}: the model has no node named {', '.join(map(repr, unknown[:5]))}")
    # Olive: op_types_to_quantize takes precedence over op_types_to_exclude
    ops = set(o.op_types_to_quantize) if o.op_types_to_quantize else set(supported) - set(o.op_types_to_exclude)
    if not ops & present_ops:
        raise UsageError("the options leave no op type of this model to quantize "
                         f"(it has {', '.join(sorted(present_ops))})")
    return tuple(sorted(ops)), tuple(o.nodes_to_quantize), tuple(o.nodes_to_exclude)


def _quantizer_extra(o: OrtCommonOptions) -> dict[str, Any]:
    """``extra_options`` for ONNX Runtime's quantizer: the calibration keys are this plugin's."""
    return {k: v for k, v in o.quantizer_extra().items() if k not in CALIBRATION_KEYS | STREAMING_KEYS}


def calibration_plan(o: OrtStaticOptions, method: str, ops: tuple[str, ...], nodes_to_quantize: tuple[str, ...],
                     nodes_to_exclude: tuple[str, ...]) -> CalibrationPlan:
    extra = o.extra_options
    chunk = o.calibration_chunk_size or next((int(extra[k]) for k in sorted(STREAMING_KEYS) if k in extra), 0)
    return CalibrationPlan(
        method=method, op_types=frozenset(ops), nodes_to_quantize=frozenset(nodes_to_quantize),
        nodes_to_exclude=frozenset(nodes_to_exclude),
        symmetric=extra.get("CalibTensorRangeSymmetric"),
        moving_average=bool(extra.get("CalibMovingAverage", False)),
        averaging_constant=float(extra.get("CalibMovingAverageConstant", 0.01)),
        percentile=float(extra.get("CalibPercentile", 99.999)),
        num_bins=o.calibration_num_bins or None, chunk_size=chunk)


def static_config(o: OrtStaticOptions, model: OnnxModel, reduce_range: bool, *, quant_format: str | None = None,
                  per_channel: bool | None = None, method: str | None = None) -> StaticConfig:
    ops, include, exclude = selection(model, o, static=True)
    method = method or o.calibrate_method
    return StaticConfig(
        quant_format=quant_format or o.quant_format, activation_type=quant_type(o.activation_type),
        weight_type=o.weight_quant_type(),
        per_channel=o.per_channel if per_channel is None else per_channel, reduce_range=reduce_range,
        op_types=ops, nodes_to_quantize=include, nodes_to_exclude=exclude,
        extra_options=_quantizer_extra(o),
        plan=calibration_plan(o, method, ops, include, exclude))


def dynamic_config(o: OrtCommonOptions, model: OnnxModel, reduce_range: bool, *, per_channel: bool | None = None
                   ) -> DynamicConfig:
    ops, include, exclude = selection(model, o, static=False)
    return DynamicConfig(
        weight_type=o.weight_quant_type(), per_channel=o.per_channel if per_channel is None else per_channel,
        reduce_range=reduce_range, op_types=ops, nodes_to_quantize=include, nodes_to_exclude=exclude,
        extra_options=_quantizer_extra(o))


def static_feeds(model: OnnxModel, context: PassContext, sampling_size: int, who: str) -> list[Feed]:
    feeds = calibration_feeds(model, context.data, who=who)
    if sampling_size and sampling_size < len(feeds):
        feeds = feeds[:sampling_size]
    return feeds


def _details(staged: Staged, reduce_range: ReduceRange, **more: Any) -> dict[str, Any]:
    return {"reduce_range": reduce_range.value, "reduce_range_reason": reduce_range.reason,
            "quant_preprocess": staged.preprocessed, "quant_preprocess_reason": staged.preprocess_reason,
            "step_seconds": {k: round(v, 3) for k, v in staged.seconds.items()}, **more}


def _finish(staged: Staged, model: OnnxModel, result: OnnxModel) -> OnnxModel:
    staged.drop_inputs()
    staged.ws.finish(result)
    model.close()
    return result


# -- static int8 ------------------------------------------------------------------------------------
class OrtStaticPass(_OrtPass):
    """ONNX Runtime static int8: calibrated activation ranges, QDQ or QOperator output."""

    name = "ort_static"
    aliases: ClassVar[tuple[str, ...]] = ("OnnxStaticQuantization",)
    algorithms = ("ort_static", "ort_int8")
    needs_data = True
    summary = "ONNX Runtime static int8 (QDQ or QOperator; MinMax / Entropy / Percentile calibration)"
    Options: ClassVar[type] = OrtStaticOptions

    def run(self, model: Any, context: PassContext) -> Any:
        model = self._onnx(model)
        o: OrtStaticOptions = self.options
        feeds = static_feeds(model, context, o.calibration_sampling_size, "ONNX Runtime static quantization")
        reduce_range = self._reduce_range(o.reduce_range)
        cfg = static_config(o, model, reduce_range.value)
        t0 = time.perf_counter()
        staged = prepare(model, context, o.quant_preprocess)
        try:
            calib, cache = calibrate_staged(staged, feeds, cfg.plan, context)
            floated: list[str] = []
            if o.float_masks:
                cfg, floated = with_float_masks(cfg, staged, calib)
            elif calib.huge:
                log.warning("%d tensor(s) have calibrated ranges past 1e30 (attention masks) and are quantized to "
                            "int8, which rounds their other values to zero: %s", len(calib.huge),
                            ", ".join(calib.huge[:4]))
            staged.seconds["quantize"] = quantize_static_from_cache(staged, cfg, cache, staged.ws.output)
            result, found = take_result(staged, model, staged.ws.output, cfg.mode, static_ops(cfg.quant_format))
            details = _details(staged, reduce_range, calibration={
                "method": cfg.plan.method, "samples": calib.samples, "chunks": calib.chunks,
                "tensors": calib.tensors, "minmax_fallback": calib.minmax_fallback, "huge_ranges": calib.huge},
                float_masks=floated)
            record_report(context, self.name, model, ToolReport(
                "ONNX Runtime", ort_version(), cfg.mode, time.perf_counter() - t0, found, details))
        except BaseException:
            staged.ws.discard()
            raise
        return _finish(staged, model, result)


# -- dynamic int8 -----------------------------------------------------------------------------------
class OrtDynamicPass(_OrtPass):
    """ONNX Runtime dynamic int8: int8 weights, activations quantized at run time (no data)."""

    name = "ort_dynamic"
    aliases: ClassVar[tuple[str, ...]] = ("OnnxDynamicQuantization",)
    algorithms = ("ort_dynamic",)
    needs_data = False
    summary = "ONNX Runtime dynamic int8 (MatMulInteger / ConvInteger + DynamicQuantizeLinear, no calibration data)"
    Options: ClassVar[type] = OrtDynamicOptions

    def run(self, model: Any, context: PassContext) -> Any:
        model = self._onnx(model)
        o: OrtDynamicOptions = self.options
        reduce_range = self._reduce_range(o.reduce_range)
        cfg = dynamic_config(o, model, reduce_range.value)
        t0 = time.perf_counter()
        staged = prepare(model, context, o.quant_preprocess)
        try:
            staged.seconds["quantize"] = quantize_dynamic_staged(staged, cfg, staged.ws.output)
            result, found = take_result(staged, model, staged.ws.output, cfg.mode, DYNAMIC_OPS)
            record_report(context, self.name, model, ToolReport(
                "ONNX Runtime", ort_version(), cfg.mode, time.perf_counter() - t0, found,
                _details(staged, reduce_range)))
        except BaseException:
            staged.ws.discard()
            raise
        return _finish(staged, model, result)


PASSES: tuple[type[Pass], ...] = (OrtStaticPass, OrtDynamicPass)
