"""The options of the ONNX Runtime passes: Olive's names, spellings and defaults.

Olive's ``OnnxStaticQuantization`` / ``OnnxDynamicQuantization`` spell their values as ONNX
Runtime's enums do (``QDQ``, ``QOperator``, ``MinMax``, ``QInt8``), and so do these options, so
an Olive pass config runs unchanged. Two defaults differ from Olive's, each for a measured
reason: ``reduce_range`` is ``auto`` (decided by the CPU, as the Quark plugin does; Olive's
``false`` loses accuracy on AVX2 CPUs without VNNI) and ``quant_preprocess`` is ``auto`` (Olive:
always on; here off where ONNX Runtime's constant folding would store a tied weight twice).

Everything is checked here, before any work: unknown ``extra_options`` keys (ONNX Runtime
ignores them silently), type combinations ONNX Runtime refuses, and the modes that do not do
what they claim (``calibrate_method=Distribution`` for int8).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Literal

from bitpress.plugin import option

#: ONNX Runtime's QuantType names (Olive's OnnxQuantization) or Olive 0.9's precision names
QuantTypeName = Literal["QInt8", "QUInt8", "int8", "uint8"]
CalibrateMethod = Literal["MinMax", "Entropy", "Percentile", "Distribution"]
QuantFormatName = Literal["QDQ", "QOperator"]

REDUCE_RANGE_HELP = (
    "7-bit weights: true avoids the int16 saturation of ONNX Runtime's int8 kernels on x86 CPUs without VNNI "
    "(AVX2, AVX-512 without VNNI) at a small cost elsewhere; auto: true on such CPUs, false where the CPU has "
    "avx512_vnni/avx_vnni/amx_int8 or an Arm dot product (choose for the CPU the model will run on)"
)
PREPROCESS_HELP = (
    "ONNX Runtime's quantization pre-processing (symbolic shape inference, basic graph optimization: "
    "BatchNormalization folded into Conv, constants folded); auto: on, except where constant folding would "
    "store a weight twice (a tied embedding / LM head)"
)

FLOAT_MASKS_HELP = (
    "leave in float the nodes that read or write a tensor whose calibrated range passes 1e30 (attention masks "
    "of -3.4e38): an int8 grid over such a range rounds every other value of the tensor to zero "
    "(ONNX Runtime quantizes them; false does as it does)"
)

#: ``extra_options`` keys ONNX Runtime 1.32's quantizers and calibrators read
ORT_EXTRA_OPTIONS = frozenset({
    "extra.Sigmoid.nnapi", "ActivationSymmetric", "ActivationRestrictedAsymmetric", "WeightSymmetric",
    "EnableSubgraph", "ForceQuantizeNoInputCheck", "MatMulConstBOnly", "AddQDQPairToWeight",
    "OpTypesToExcludeOutputQuantization", "DedicatedQDQPair", "QDQOpTypePerChannelSupportToAxis",
    "CalibTensorRangeSymmetric", "CalibStridedMinMax", "CalibMovingAverage", "CalibMovingAverageConstant",
    "CalibMaxIntermediateOutputs", "CalibPercentile", "SmoothQuant", "SmoothQuantAlpha", "SmoothQuantFolding",
    "UseQDQContribOps", "MinimumRealRange", "TensorQuantOverrides", "QDQKeepRemovableActivations",
    "QDQDisableWeightAdjustForInt32Bias", "DefaultTensorType", "QuantizeBias", "BlockSize",
})
#: keys about calibration: this plugin's calibration reads them, ONNX Runtime's quantizer does not
CALIBRATION_KEYS = frozenset({"CalibTensorRangeSymmetric", "CalibMovingAverage", "CalibMovingAverageConstant",
                              "CalibPercentile"})
#: calibration keys made redundant by the streamed calibration (every chunk is merged as it comes)
STREAMING_KEYS = frozenset({"CalibStridedMinMax", "CalibMaxIntermediateOutputs"})
#: static-only keys that dynamic quantization does not read
_STATIC_ONLY = CALIBRATION_KEYS | STREAMING_KEYS | frozenset({"SmoothQuant", "SmoothQuantAlpha", "SmoothQuantFolding"})
_BOOL_KEYS = frozenset({"ActivationSymmetric", "ActivationRestrictedAsymmetric", "WeightSymmetric", "EnableSubgraph",
                        "ForceQuantizeNoInputCheck", "MatMulConstBOnly", "AddQDQPairToWeight", "DedicatedQDQPair",
                        "CalibTensorRangeSymmetric", "CalibMovingAverage", "UseQDQContribOps",
                        "QDQKeepRemovableActivations", "QDQDisableWeightAdjustForInt32Bias", "SmoothQuant",
                        "SmoothQuantFolding", "extra.Sigmoid.nnapi", "QuantizeBias"})

#: why calibrate_method=Distribution is refused for int8 (measured, see tests/plugins/test_ort.py)
DISTRIBUTION_REFUSED = (
    "calibrate_method=Distribution is ONNX Runtime's calibration for float8 types: for int8 its ranges are "
    "[-max|x|, max|x|], which is MinMax with extra_options {\"ActivationSymmetric\": true} (identical models, "
    "measured), and without that option ONNX Runtime's quantizer drops the Relu after such a range (relative "
    "error 1.25 on a conv net, measured); use calibrate_method=MinMax with extra_options "
    "{\"ActivationSymmetric\": true}"
)


def quant_type(name: str) -> str:
    """``QInt8`` / ``QUInt8`` for either spelling."""
    return {"int8": "QInt8", "uint8": "QUInt8"}.get(name, name)


def check_extra_options(extra: dict[str, Any], *, static: bool) -> None:
    """Unknown keys, wrong value types and keys this plugin cannot honour raise ValueError."""
    for key, value in extra.items():
        if key not in ORT_EXTRA_OPTIONS:
            close = difflib.get_close_matches(key, sorted(ORT_EXTRA_OPTIONS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"extra_options: {key!r} is not an ONNX Runtime quantization option{hint}; ONNX "
                             "Runtime would ignore it silently")
        if key in _BOOL_KEYS and not isinstance(value, bool):
            raise ValueError(f"extra_options: {key} must be true or false, got {value!r}")
        if not static and key in _STATIC_ONLY:
            raise ValueError(f"extra_options: {key} is about calibration, which dynamic quantization does not do")
    if extra.get("SmoothQuant"):
        raise ValueError(
            "extra_options: SmoothQuant runs Intel Neural Compressor inside ONNX Runtime's quantizer; use the "
            "INC plugin's inc_static pass (extra_options SmoothQuant, SmoothQuantAlpha) instead")
    for key in ("SmoothQuantAlpha", "SmoothQuantFolding"):
        if key in extra:
            raise ValueError(f"extra_options: {key} is a SmoothQuant setting; SmoothQuant is the INC plugin's")
    if "CalibPercentile" in extra:
        p = extra["CalibPercentile"]
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 100:
            raise ValueError(f"extra_options: CalibPercentile must be a number in (0, 100], got {p!r}")
    if "CalibMovingAverageConstant" in extra:
        c = extra["CalibMovingAverageConstant"]
        if isinstance(c, bool) or not isinstance(c, int | float) or not 0 <= c <= 1:
            raise ValueError(f"extra_options: CalibMovingAverageConstant must be a number in [0, 1], got {c!r}")
    for key in STREAMING_KEYS & extra.keys():
        v = extra[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"extra_options: {key} must be a positive integer, got {v!r}")


@dataclass
class OrtCommonOptions:
    """Options of both static and dynamic quantization."""

    weight_type: QuantTypeName = option("QInt8", "weights: QInt8 (signed) or QUInt8 (also spelled int8, uint8)")
    precision: Literal["int8", "uint8"] | None = option(
        None, "Olive 0.9's name for weight_type (int8 or uint8); when set, it is the weight type")
    per_channel: bool = option(False, "one weight scale per output channel instead of one per tensor")
    reduce_range: Literal["auto"] | bool = option("auto", REDUCE_RANGE_HELP)
    op_types_to_quantize: list[str] = option([], "only these op types (default: every op type ONNX Runtime quantizes)")
    op_types_to_exclude: list[str] = option([], "op types left in float (op_types_to_quantize takes precedence)")
    nodes_to_quantize: list[str] = option([], "only these nodes (names)")
    nodes_to_exclude: list[str] = option([], "nodes left in float (names)")
    quant_preprocess: Literal["auto"] | bool = option("auto", PREPROCESS_HELP)
    activation_symmetric: bool | None = option(
        None, "symmetric activation ranges (Olive's name for extra_options ActivationSymmetric)")
    weight_symmetric: bool | None = option(
        None, "symmetric weights (extra_options WeightSymmetric); unset: ONNX Runtime's default, symmetric for QInt8")
    extra_options: dict[str, Any] = option(
        {}, "ONNX Runtime's extra_options (ActivationSymmetric, WeightSymmetric, MatMulConstBOnly, "
        "CalibPercentile, CalibMovingAverage, TensorQuantOverrides, ...); unknown keys are refused")

    def validate(self) -> None:
        check_extra_options(self.extra_options, static=self._static())
        if (self.precision is not None and self.weight_type != "QInt8"
                and quant_type(self.weight_type) != quant_type(self.precision)):
            raise ValueError(f"precision={self.precision} contradicts weight_type={self.weight_type}: give one of them")
        for name, key in (("activation_symmetric", "ActivationSymmetric"), ("weight_symmetric", "WeightSymmetric")):
            value = getattr(self, name)
            if value is not None and key in self.extra_options and self.extra_options[key] != value:
                raise ValueError(f"{name}={value} contradicts extra_options {key}={self.extra_options[key]}")

    def weight_quant_type(self) -> str:
        return quant_type(self.precision or self.weight_type)

    def quantizer_extra(self) -> dict[str, Any]:
        """``extra_options`` for ONNX Runtime, the named options folded in."""
        extra = dict(self.extra_options)
        for name, key in (("activation_symmetric", "ActivationSymmetric"), ("weight_symmetric", "WeightSymmetric")):
            if getattr(self, name) is not None:
                extra[key] = getattr(self, name)
        return extra

    def _static(self) -> bool:
        return False


@dataclass
class OrtStaticOptions(OrtCommonOptions):
    quant_format: QuantFormatName = option(
        "QDQ", "QDQ: QuantizeLinear/DequantizeLinear around float ops (ONNX Runtime fuses them into int8 kernels); "
        "QOperator: QLinearMatMul, QLinearConv, QGemm, QLinearAdd... ops")
    activation_type: QuantTypeName = option("QInt8", "activations: QInt8 or QUInt8")
    calibrate_method: CalibrateMethod = option(
        "MinMax", "activation ranges: MinMax, Entropy (KL divergence), Percentile (extra_options CalibPercentile, "
        "default 99.999); Distribution is refused for int8 (see `bitpress passes show ort_static`)")
    calibration_sampling_size: int = option(0, "calibration samples used, the first N of --data (0: all)")
    calibration_chunk_size: int = option(
        0, "samples run between two merges of the histograms (bounds the activations held in memory); 0: as many "
        "as fit in 256 MiB of calibrated activations, measured on the first sample")
    calibration_num_bins: int = option(
        0, "histogram bins of Entropy / Percentile (0: Entropy 512, Percentile 2048; ONNX Runtime's Entropy default "
        "of 128 makes it MinMax)")
    float_masks: bool = option(True, FLOAT_MASKS_HELP)

    def _static(self) -> bool:
        return True

    def validate(self) -> None:
        if self.calibrate_method == "Distribution":
            raise ValueError(DISTRIBUTION_REFUSED)
        check_static_types(self.quant_format, quant_type(self.activation_type), self.weight_quant_type())
        for name in ("calibration_sampling_size", "calibration_chunk_size", "calibration_num_bins"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.calibration_num_bins and self.calibrate_method == "Entropy" and self.calibration_num_bins < 256:
            raise ValueError(
                f"calibration_num_bins={self.calibration_num_bins}: Entropy compares thresholds of 128 quantized bins; "
                "with fewer than 256 histogram bins it has (almost) one candidate, the MinMax range")
        if self.calibration_num_bins and self.calibration_num_bins < 16:
            raise ValueError(f"calibration_num_bins must be 0 or at least 16, got {self.calibration_num_bins}")


def check_static_types(quant_format: str, activation_type: str, weight_type: str) -> None:
    """ONNX Runtime refuses QInt8 activations with QUInt8 weights (``check_static_quant_arguments``)."""
    if quant_type(activation_type) == "QInt8" and quant_type(weight_type) == "QUInt8":
        raise ValueError("activation_type=QInt8 with weight_type=QUInt8 is not a format ONNX Runtime supports; "
                         "use QUInt8 activations, or QInt8 weights")


@dataclass
class OrtDynamicOptions(OrtCommonOptions):
    """Dynamic quantization: activations are always QUInt8 (DynamicQuantizeLinear)."""


__all__ = [
    "CALIBRATION_KEYS",
    "DISTRIBUTION_REFUSED",
    "FLOAT_MASKS_HELP",
    "ORT_EXTRA_OPTIONS",
    "OrtCommonOptions",
    "OrtDynamicOptions",
    "OrtStaticOptions",
    "check_extra_options",
    "check_static_types",
    "quant_type",
]
