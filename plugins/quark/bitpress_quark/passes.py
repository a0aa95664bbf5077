"""The Quark passes: static int8, dynamic int8 and int4 weight-only (MatMulNBits).

Importing this module imports neither ``quark`` nor ``torch``: the host lists these passes
(as unavailable, with the install command) wherever the plugin is installed. Quark is
imported inside ``run()``, under :func:`bitpress_quark.sandbox.contained`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import onnx

from bitpress.plugin import (
    OnnxModel,
    Pass,
    PassContext,
    ReduceRange,
    UsageError,
    check_block_size,
    iter_graphs,
    option,
    resolve_accuracy_level,
    resolve_reduce_range,
)
from bitpress_quark.runner import calibration_feeds, placeholder_feeds, reject_fallback, run_quark

#: shown when Quark is missing; an environment of its own because Quark pins onnx<=1.22.0
INSTALL_HINT = (
    'bitpress env create quark (an isolated environment, recommended: Quark pins onnx<=1.22.0) '
    'or pip install "bitpress[quark]"'
)
REQUIRES = ("quark", "torch", "onnxruntime")

#: option value -> (module, enum, member) of Quark 0.13's calibration methods (all run on CPU)
CALIBRATION_METHODS: dict[str, tuple[str, str, str]] = {
    "minmax": ("onnxruntime.quantization.calibrate", "CalibrationMethod", "MinMax"),
    "percentile": ("onnxruntime.quantization.calibrate", "CalibrationMethod", "Percentile"),
    "entropy": ("onnxruntime.quantization.calibrate", "CalibrationMethod", "Entropy"),
    "distribution": ("onnxruntime.quantization.calibrate", "CalibrationMethod", "Distribution"),
    "layerwise_percentile": ("quark.onnx.calibration.methods", "LayerWiseMethod", "LayerWisePercentile"),
    # power-of-two scales (for AMD NPUs); fine on CPU, but coarser than float scales
    "minmse": ("quark.onnx.calibration.methods", "PowerOfTwoMethod", "MinMSE"),
    "nonoverflow": ("quark.onnx.calibration.methods", "PowerOfTwoMethod", "NonOverflow"),
}
CalibrationName = Literal[
    "minmax", "percentile", "entropy", "distribution", "layerwise_percentile", "minmse", "nonoverflow"
]
Int8Type = Literal["int8", "uint8"]
REDUCE_RANGE_HELP = (
    "7-bit weights: true avoids the int16 saturation of ONNX Runtime's int8 kernels on x86 CPUs without VNNI "
    "(AVX2, AVX-512 without VNNI) at a small cost elsewhere; auto: true on such CPUs, false where the CPU has "
    "avx512_vnni/avx_vnni/amx_int8 or an Arm dot product (choose for the CPU the model will run on)"
)

log = logging.getLogger(__name__)


def _enum(module: str, enum: str, member: str) -> Any:
    import importlib

    return getattr(getattr(importlib.import_module(module), enum), member)


def _quant_type(name: str) -> Any:
    from onnxruntime.quantization.quant_utils import QuantType

    return QuantType.QInt8 if name == "int8" else QuantType.QUInt8


def _op_types(model: OnnxModel, chosen: list[str], exclude: list[str], supported: set[str]) -> list[str]:
    """Quark's ``op_types_to_quantize`` for include/exclude lists ([] = all Quark supports)."""
    if not exclude:
        return list(chosen)
    base = set(chosen) if chosen else supported
    present = {n.op_type for g in iter_graphs(model.proto.graph) for n in g.node}
    unknown = sorted(set(exclude) - present)
    if unknown:
        raise UsageError(f"op_types_to_exclude: the model has no {', '.join(unknown)} nodes")
    left = sorted(base - set(exclude))
    if not left:
        raise UsageError("op_types_to_exclude leaves no op type to quantize")
    return left


class _QuarkPass(Pass):
    requires: ClassVar[tuple[str, ...]] = REQUIRES
    install_hint: ClassVar[str | None] = INSTALL_HINT

    def _onnx(self, model: Any) -> OnnxModel:
        if not isinstance(model, OnnxModel):
            raise UsageError(f"{self.name} takes ONNX models, got {model.describe()}")
        return model

    def _reduce_range(self, value: Literal["auto"] | bool) -> ReduceRange:
        """The ``reduce_range`` option resolved for this CPU (``auto``), logged."""
        choice = resolve_reduce_range(value)
        log.info("%s: %s", self.name, choice.summary())
        return choice

    def _report(self, context: PassContext, model: OnnxModel, choice: ReduceRange) -> None:
        """Put the ``reduce_range`` decision in the run report, beside Quark's own line."""
        context.extras.setdefault("reports", []).append((self.name, model.source, choice))


# -- static int8 ------------------------------------------------------------------------------------
@dataclass
class QuarkStaticOptions:
    quant_format: Literal["qdq", "qoperator"] = option(
        "qdq", "qdq: QuantizeLinear/DequantizeLinear around float ops; qoperator: QLinearMatMul, QGemm, "
        "QLinearConv, QLinearAdd... ops"
    )
    calibration_method: CalibrationName = option(
        "minmax", "activation ranges: minmax, percentile, entropy, distribution, layerwise_percentile; "
        "minmse and nonoverflow give power-of-two scales (for AMD NPUs)"
    )
    percentile: float = option(99.999, "calibration_method=percentile: the percentile of activations kept")
    per_channel: bool = option(False, "one weight scale per output channel instead of one per tensor")
    reduce_range: Literal["auto"] | bool = option("auto", REDUCE_RANGE_HELP)
    activation_type: Int8Type = option("int8", "activations: int8 or uint8")
    weight_type: Int8Type = option("int8", "weights: int8 or uint8")
    op_types_to_quantize: list[str] = option([], "only these op types (default: every op type Quark quantizes)")
    op_types_to_exclude: list[str] = option([], "op types left in float")
    nodes_to_quantize: list[str] = option([], "only these nodes (names)")
    nodes_to_exclude: list[str] = option([], "nodes left in float: names, or Quark patterns like '^/layers.0/.*'")
    optimize_model: bool = option(
        True, "let Quark run ONNX Runtime's graph optimizations first (fuses GELU, folds constants)"
    )

    def validate(self) -> None:
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")


class QuarkStaticPass(_QuarkPass):
    """AMD Quark static int8: calibrated activation ranges, QDQ or QOperator output."""

    name = "quark_static"
    algorithms = ("quark_static", "quark_int8")
    precisions = ("int8",)
    needs_data = True
    summary = "AMD Quark static int8 (QDQ or QOperator; MinMax/Percentile/Entropy/... calibration)"
    Options: ClassVar[type] = QuarkStaticOptions

    def run(self, model: Any, context: PassContext) -> Any:
        model = self._onnx(model)
        o: QuarkStaticOptions = self.options
        feeds = calibration_feeds(model, context.data)
        reduce_range = self._reduce_range(o.reduce_range)

        def make_config(quark_onnx: Any, tmp: Path, external: bool, src: Path) -> Any:
            from onnxruntime.quantization.quant_utils import QuantFormat
            from quark.onnx.quantization.config.config import Config
            from quark.onnx.quantization.config.legacy import QuantizationConfig
            from quark.onnx.quantizers.registry import QDQRegistry, QLinearOpsRegistry

            qoperator = o.quant_format == "qoperator"
            supported = set(QLinearOpsRegistry) | (set() if qoperator else set(QDQRegistry))
            extra: dict[str, Any] = {"TmpDir": str(tmp)}
            if o.calibration_method == "percentile":
                extra["Percentile"] = o.percentile
            # the legacy QuantizationConfig: Quark 0.13's QConfig always writes QDQ and has no
            # dynamic mode, so one config type serves all three passes
            return Config(global_quant_config=QuantizationConfig(
                calibrate_method=_enum(*CALIBRATION_METHODS[o.calibration_method]),
                quant_format=QuantFormat.QOperator if qoperator else QuantFormat.QDQ,
                activation_type=_quant_type(o.activation_type),
                weight_type=_quant_type(o.weight_type),
                op_types_to_quantize=_op_types(model, o.op_types_to_quantize, o.op_types_to_exclude, supported),
                nodes_to_quantize=list(o.nodes_to_quantize),
                nodes_to_exclude=list(o.nodes_to_exclude),
                per_channel=o.per_channel,
                reduce_range=reduce_range.value,
                optimize_model=o.optimize_model,
                use_external_data_format=external,
                execution_providers=["CPUExecutionProvider"],
                include_cle=False,  # cross-layer equalization: not asked for, it rewrites weights
                print_summary=False,  # its summary writes quantized_info.csv
                ignore_warnings=False,
                extra_options=extra,
            ))

        ops = ("QLinearMatMul", "QGemm", "QLinearConv", "QLinearAdd", "QLinearMul", "QLinearConcat",
               "QLinearSoftmax", "QLinearSigmoid", "QLinearAveragePool", "QLinearGlobalAveragePool",
               "MatMulInteger", "QuantizeLinear") if o.quant_format == "qoperator" else ("DequantizeLinear",)
        result = run_quark(
            model, context, pass_name=self.name, mode=f"static int8 ({o.quant_format}, {o.calibration_method})",
            make_config=make_config, feeds=feeds, quantized_ops=ops,
            check_messages=reject_fallback(o.calibration_method),
        )
        self._report(context, model, reduce_range)
        return result


# -- dynamic int8 -------------------------------------------------------------------------------------
@dataclass
class QuarkDynamicOptions:
    weight_type: Int8Type = option("int8", "weights: int8 or uint8 (activations are always uint8)")
    per_channel: bool = option(False, "one weight scale per output channel instead of one per tensor")
    reduce_range: Literal["auto"] | bool = option("auto", REDUCE_RANGE_HELP)
    op_types_to_quantize: list[str] = option([], "only these op types (default: MatMul, Conv, Gather, ... as Quark)")
    op_types_to_exclude: list[str] = option([], "op types left in float")
    nodes_to_quantize: list[str] = option([], "only these nodes (names)")
    nodes_to_exclude: list[str] = option([], "nodes left in float: names, or Quark patterns like '^/layers.0/.*'")


class QuarkDynamicPass(_QuarkPass):
    """AMD Quark dynamic int8: int8 weights, activations quantized at run time (no data)."""

    name = "quark_dynamic"
    algorithms = ("quark_dynamic",)
    precisions = ("int8",)
    needs_data = False
    summary = "AMD Quark dynamic int8 (MatMulInteger + DynamicQuantizeLinear, no calibration data)"
    Options: ClassVar[type] = QuarkDynamicOptions

    def run(self, model: Any, context: PassContext) -> Any:
        model = self._onnx(model)
        o: QuarkDynamicOptions = self.options
        reduce_range = self._reduce_range(o.reduce_range)

        def make_config(quark_onnx: Any, tmp: Path, external: bool, src: Path) -> Any:
            from quark.onnx.quantization.config.config import Config
            from quark.onnx.quantization.config.legacy import QuantizationConfig
            from quark.onnx.quantizers.registry import IntegerOpsRegistry

            return Config(global_quant_config=QuantizationConfig(
                use_dynamic_quant=True,
                weight_type=_quant_type(o.weight_type),
                per_channel=o.per_channel,
                reduce_range=reduce_range.value,
                op_types_to_quantize=_op_types(
                    model, o.op_types_to_quantize, o.op_types_to_exclude, set(IntegerOpsRegistry)
                ),
                nodes_to_quantize=list(o.nodes_to_quantize),
                nodes_to_exclude=list(o.nodes_to_exclude),
                use_external_data_format=external,
                ignore_warnings=False,
                extra_options={"TmpDir": str(tmp)},
            ))

        result = run_quark(
            model, context, pass_name=self.name, mode="dynamic int8", make_config=make_config, feeds=None,
            quantized_ops=("DynamicQuantizeLinear", "MatMulInteger", "ConvInteger"),
        )
        self._report(context, model, reduce_range)
        return result


# -- int4 weight-only -----------------------------------------------------------------------------
@dataclass
class QuarkInt4Options:
    algorithm: Literal["default", "hqq"] = option(
        "default", "default: round to nearest per block (ONNX Runtime's kernel); hqq: half-quadratic "
        "optimization of scales and zero points (always asymmetric, float zero points)"
    )
    block_size: int = option(128, "weights per block along K: a power of two from 16 to 256")
    symmetric: bool | None = option(
        None, "default algorithm only: symmetric (no zero points); unset: symmetric for default, "
        "asymmetric for hqq"
    )
    accuracy_level: int | None = option(
        None, "MatMulNBits compute precision hint: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 activations; "
        "null: 4, what runs fastest on CPU (bitpress.onnx.kernels)"
    )
    optimize_model: bool = option(
        True, "let Quark run ONNX Runtime's graph optimizations first (fuses GELU, folds constants)"
    )

    def validate(self) -> None:
        check_block_size(self.block_size)
        if self.accuracy_level is not None and not 0 <= self.accuracy_level <= 4:
            raise ValueError(f"accuracy_level must be 0 to 4, got {self.accuracy_level}")
        if self.algorithm == "hqq" and self.symmetric:
            raise ValueError("algorithm=hqq is always asymmetric: drop symmetric=true")


class QuarkInt4Pass(_QuarkPass):
    """AMD Quark int4 weight-only quantization of MatMul weights to com.microsoft MatMulNBits."""

    name = "quark_int4"
    algorithms = ("quark_int4",)
    precisions = ("int4",)
    needs_data = False
    summary = "AMD Quark int4 weight-only MatMulNBits (DEFAULT round-to-nearest or HQQ)"
    Options: ClassVar[type] = QuarkInt4Options

    def run(self, model: Any, context: PassContext) -> Any:
        model = self._onnx(model)
        o: QuarkInt4Options = self.options
        symmetric = o.algorithm == "default" if o.symmetric is None else o.symmetric
        level = resolve_accuracy_level(o.accuracy_level, "cpu")

        def make_config(quark_onnx: Any, tmp: Path, external: bool, src: Path) -> Any:
            from quark.onnx.quantization.config.config import Config
            from quark.onnx.quantization.config.legacy import QuantizationConfig

            params = {"Algorithm": o.algorithm.upper(), "GroupSize": o.block_size, "Symmetric": symmetric,
                      "Bits": 4, "AccuracyLevel": level}
            return Config(global_quant_config=QuantizationConfig(
                optimize_model=o.optimize_model,
                use_external_data_format=external,
                include_cle=False,
                print_summary=False,
                ignore_warnings=False,
                extra_options={"UseMatMulNBits": True, "MatMulNBitsParams": params, "TmpDir": str(tmp)},
            ))

        return run_quark(
            model, context, pass_name=self.name, mode=f"int4 {o.algorithm} (block {o.block_size})",
            make_config=make_config,
            # Quark's reader check wants one sample; the DEFAULT and HQQ paths never run it
            feeds=placeholder_feeds(model), quantized_ops=("MatMulNBits",),
            post=_set_accuracy_level(level),
        )


def _set_accuracy_level(level: int) -> Callable[[onnx.ModelProto], None]:
    """Quark's HQQ path drops ``AccuracyLevel``: put it on the MatMulNBits nodes that lack it."""

    def post(proto: onnx.ModelProto) -> None:
        if level == 0:
            return
        for g in iter_graphs(proto.graph):
            for node in g.node:
                if node.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in node.attribute):
                    node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))

    return post


PASSES = (QuarkStaticPass, QuarkDynamicPass, QuarkInt4Pass)
