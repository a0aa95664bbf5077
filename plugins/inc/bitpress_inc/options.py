"""Options of the INC passes, with Olive's names (``IncQuantization`` and friends) and INC's.

Nested mappings (``weight_only_config``, ``extra_options``, ``tuning``) are parsed into small
dataclasses by the same typed parser as top-level options, so a wrong key or type fails
before any work, naming the option. What INC 1.0 accepts but does not do is refused here too,
with the reason (see :data:`REFUSED`): it would otherwise run and silently do something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from bitpress.plugin import OptionError, check_block_size, option, parse_options

Approach = Literal["static", "dynamic", "weight_only", "auto"]
Int8Type = Literal["int8", "uint8"]

#: why a setting INC 1.0 accepts is refused (each is shown by a test in tests/plugins/test_inc.py)
REFUSED = {
    "gptq": (
        "INC 1.0's GPTQ propagates no rounding error (its update reads a column of the upper-triangular "
        "inverse Cholesky factor, zero below the diagonal), so its int4 weights are round-to-nearest and do "
        "not depend on the calibration data; use algorithm RTN or AWQ here, or bitpress's own GPTQ pass "
        "({type: gptq}, which runs on the same data)"
    ),
    "entropy": (
        "INC 1.0's Entropy calibrator builds 128 histogram bins for 128 quantized bins, so its only candidate "
        "threshold is the full range: it gives exactly MinMax's scales; use MinMax or Percentile (or "
        "ort_static / quark_static for a working entropy calibration)"
    ),
    "reduce_range": (
        "INC 1.0's quantizers ignore reduce_range (weights keep the full int8 range); use ort_static / "
        "ort_dynamic or quark_static / quark_dynamic for 7-bit weights"
    ),
    "bits": (
        "INC 1.0 writes MatMulNBits only for 4-bit weights; other widths come out as float weights rounded "
        "to the grid (a model no smaller than the input)"
    ),
    "dynamic_conv": (
        "INC 1.0's dynamic quantizer fails on Conv with a bias (DynamicQuantizer has no "
        "_dynamic_quantize_bias); Conv stays float in dynamic mode (use static for conv nets)"
    ),
}


# -- nested mappings ----------------------------------------------------------------------------------
@dataclass
class WeightOnlyConfig:
    """``weight_only_config``: Olive's keys (bits, group_size, scheme, algorithm) and two of INC's AWQ."""

    bits: int = option(4, "weight bits: 4 (MatMulNBits)")
    group_size: int = option(32, "weights per block along K: a power of two from 16 to 256")
    scheme: str = option("asym", "asym: uint4 with zero points; sym: no zero points (either case)")
    algorithm: str = option(
        "RTN", "RTN: round to nearest; AWQ: activation-aware scales (needs data); GPTQ: refused, see docs "
        "(either case, as Olive's configs write them)"
    )
    accuracy_level: int | None = option(
        None, "MatMulNBits compute precision hint: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 activations; "
        "null: 4, what runs fastest on CPU (bitpress.onnx.kernels)"
    )
    enable_auto_scale: bool = option(True, "AWQ: search per-channel activation-aware scales")
    enable_mse_search: bool = option(True, "AWQ: search a clipping ratio per weight by output MSE")

    def validate(self) -> None:
        self.algorithm, self.scheme = self.algorithm.upper(), self.scheme.lower()
        if self.algorithm not in ("RTN", "AWQ", "GPTQ"):
            raise ValueError(f"algorithm must be RTN or AWQ (GPTQ is refused), got {self.algorithm!r}")
        if self.scheme not in ("sym", "asym"):
            raise ValueError(f"scheme must be sym or asym, got {self.scheme!r}")
        if self.bits != 4:
            raise ValueError(f"bits={self.bits}: {REFUSED['bits']}")
        check_block_size(self.group_size, "group_size")
        if self.accuracy_level is not None and not 0 <= self.accuracy_level <= 4:
            raise ValueError(f"accuracy_level must be 0 to 4, got {self.accuracy_level}")
        if self.algorithm == "GPTQ":
            raise ValueError(f"algorithm GPTQ is refused: {REFUSED['gptq']}")


@dataclass
class SmoothQuantOptions:
    """``extra_options``: INC's / ONNX Runtime's SmoothQuant keys (as Olive passes them)."""

    SmoothQuant: bool = option(False, "migrate activation outliers into the weights before static quantization")
    SmoothQuantAlpha: float = option(0.5, "0..1: how much of the difficulty moves to the weights")
    SmoothQuantFolding: bool = option(True, "fold the inserted scaling Mul into the previous op where it can")
    SmoothQuantOpTypes: list[str] = option(["Gemm", "Conv", "MatMul", "FusedConv"], "op types smoothed")
    SmoothQuantCalibIter: int = option(100, "calibration samples SmoothQuant reads")
    SmoothQuantScalesPerOp: bool = option(True, "one scale per op (true) or per shared input (false)")

    def validate(self) -> None:
        if not 0.0 <= self.SmoothQuantAlpha <= 1.0:
            raise ValueError(f"SmoothQuantAlpha must be in [0, 1], got {self.SmoothQuantAlpha}")
        if self.SmoothQuantCalibIter < 1:
            raise ValueError(f"SmoothQuantCalibIter must be at least 1, got {self.SmoothQuantCalibIter}")
        if not self.SmoothQuantOpTypes:
            raise ValueError("SmoothQuantOpTypes must name at least one op type")


@dataclass
class TuningOptions:
    """``tuning``: INC's accuracy-aware tuning loop, scored by bitpress's output error."""

    max_trials: int = option(5, "at most this many quantized models are tried (Olive's default)")
    tolerance: float = option(
        0.02, "stop at the first trial whose output error (relative L2 against the float model, worst output, "
        "held-back samples) is at most this"
    )
    held_back: float = option(0.25, "share of the calibration samples kept out of calibration to score trials")

    def validate(self) -> None:
        if not 1 <= self.max_trials <= 100:
            raise ValueError(f"max_trials must be 1 to 100, got {self.max_trials}")
        if not 0.0 < self.tolerance < 1.0:
            raise ValueError(f"tolerance must be between 0 and 1, got {self.tolerance}")
        if not 0.0 < self.held_back < 1.0:
            raise ValueError(f"held_back must be between 0 and 1, got {self.held_back}")


def nested(cls: type, value: dict[str, Any], *, owner: str) -> Any:
    """``value`` (a mapping from a config, or JSON from ``--option``) as ``cls``.

    A bad key or value is a ``ValueError`` starting with ``owner`` (the option's name): the
    host's option check turns it into an OptionError that names the pass as well.
    """
    try:
        return parse_options(cls, value, owner=owner, strict=True)
    except OptionError as exc:
        # parse_options points to `bitpress passes show <owner>`; the owner here is an option, not a pass
        raise ValueError(str(exc).split(" (see `bitpress passes show")[0]) from None


# -- top-level option sets ----------------------------------------------------------------------------
REDUCE_RANGE_HELP = f"Olive's option, kept for its configs: false only ({REFUSED['reduce_range']})"


@dataclass
class Int8Options:
    """What static and dynamic int8 share."""

    weight_type: Int8Type = option("int8", "weights: int8 (symmetric) or uint8")
    per_channel: bool = option(False, "one weight scale per output channel instead of one per tensor")
    reduce_range: bool = option(False, REDUCE_RANGE_HELP)
    op_types_to_quantize: list[str] = option([], "only these op types (default: every op type INC quantizes here)")
    op_types_to_exclude: list[str] = option([], "op types left in float")
    nodes_to_quantize: list[str] = option([], "only these nodes (names)")
    nodes_to_exclude: list[str] = option([], "nodes left in float (names)")
    quant_last_matmul: bool = option(True, "quantize the last MatMul (often the LM head) too")
    optimize_model: bool = option(True, "run ONNX Runtime's basic graph optimizations first, as INC does")

    def validate(self) -> None:
        if self.reduce_range:
            raise ValueError(f"reduce_range=true is refused: {REFUSED['reduce_range']}")
        both = sorted(set(self.op_types_to_quantize) & set(self.op_types_to_exclude))
        if both:
            raise ValueError(f"op types both quantized and excluded: {', '.join(both)}")


@dataclass
class StaticOptions(Int8Options):
    quant_format: Literal["QOperator", "QDQ"] = option(
        "QOperator", "QOperator: QLinearMatMul, QLinearConv, QGemm... ops (Olive's default); QDQ: "
        "QuantizeLinear/DequantizeLinear around float ops"
    )
    calibrate_method: Literal["MinMax", "Percentile", "Entropy"] = option(
        "MinMax", "activation ranges: MinMax or Percentile (Entropy is refused: INC 1.0's equals MinMax)"
    )
    activation_type: Int8Type = option("uint8", "activations: uint8 (INC's default) or int8")
    calibration_sampling_size: int = option(100, "at most this many calibration samples are used")
    extra_options: dict[str, Any] = option(
        {}, "SmoothQuant keys: SmoothQuant, SmoothQuantAlpha, SmoothQuantFolding, SmoothQuantOpTypes, "
        "SmoothQuantCalibIter, SmoothQuantScalesPerOp"
    )

    def validate(self) -> None:
        if self.calibrate_method == "Entropy":
            raise ValueError(f"calibrate_method Entropy is refused: {REFUSED['entropy']}")
        if self.calibration_sampling_size < 1:
            raise ValueError(f"calibration_sampling_size must be at least 1, got {self.calibration_sampling_size}")
        self.smooth_quant()

    def smooth_quant(self) -> SmoothQuantOptions:
        return nested(SmoothQuantOptions, self.extra_options, owner="extra_options")


@dataclass
class DynamicOptions(Int8Options):
    approach: Literal["dynamic"] = option("dynamic", "always dynamic (Olive's IncDynamicQuantization)")
    tuning: dict[str, Any] = option({}, "accuracy-aware tuning: {max_trials, tolerance, held_back}; {} = off")

    def validate(self) -> None:
        if "Conv" in self.op_types_to_quantize or "FusedConv" in self.op_types_to_quantize:
            raise ValueError(f"Conv is refused in dynamic mode: {REFUSED['dynamic_conv']}")
        tuning_options(self)


@dataclass
class WeightOnlyOptions:
    weight_only_config: dict[str, Any] = option(
        {}, "{bits: 4, group_size: 32, scheme: asym|sym, algorithm: RTN|AWQ, accuracy_level, enable_auto_scale, "
        "enable_mse_search}"
    )
    nodes_to_exclude: list[str] = option([], "MatMul nodes left in float (names)")
    calibration_sampling_size: int = option(100, "at most this many calibration samples are used (AWQ)")
    optimize_model: bool = option(True, "run ONNX Runtime's basic graph optimizations first, as INC does")
    tuning: dict[str, Any] = option({}, "accuracy-aware tuning: {max_trials, tolerance, held_back}; {} = off")

    def validate(self) -> None:
        self.woq()
        tuning_options(self)

    def woq(self) -> WeightOnlyConfig:
        return nested(WeightOnlyConfig, self.weight_only_config, owner="weight_only_config")


@dataclass
class StaticPassOptions(StaticOptions):
    """``inc_static`` / IncStaticQuantization: static int8, or weight-only as in Olive's configs."""

    approach: Literal["static", "weight_only"] = option(
        "static", "static int8, or weight_only (int4 MatMulNBits, as Olive's IncStaticQuantization accepts)"
    )
    weight_only_config: dict[str, Any] = option({}, "approach weight_only: as inc_woq's weight_only_config")
    tuning: dict[str, Any] = option({}, "accuracy-aware tuning: {max_trials, tolerance, held_back}; {} = off")

    def validate(self) -> None:
        if self.approach == "weight_only":
            nested(WeightOnlyConfig, self.weight_only_config, owner="weight_only_config")
        elif self.weight_only_config:
            raise ValueError("weight_only_config is for approach weight_only; drop it or set approach")
        tuning_options(self)

    def woq(self) -> WeightOnlyConfig:
        return nested(WeightOnlyConfig, self.weight_only_config, owner="weight_only_config")


@dataclass
class IncPassOptions(StaticOptions):
    """``inc`` / IncQuantization: any approach; ``auto`` tunes static and dynamic together."""

    approach: Approach = option(
        "auto", "static, dynamic, weight_only, or auto: INC's tuning over static and dynamic int8 (Olive's "
        "IncQuantization), scored by output error on held-back samples"
    )
    weight_only_config: dict[str, Any] = option({}, "approach weight_only: as inc_woq's weight_only_config")
    tuning: dict[str, Any] = option(
        {}, "accuracy-aware tuning: {max_trials, tolerance, held_back}; {} = off (approach auto: the defaults)"
    )

    def validate(self) -> None:
        if self.approach == "weight_only":
            nested(WeightOnlyConfig, self.weight_only_config, owner="weight_only_config")
        elif self.weight_only_config:
            raise ValueError("weight_only_config is for approach weight_only; drop it or set approach")
        if self.approach in ("dynamic", "auto") and (
            "Conv" in self.op_types_to_quantize or "FusedConv" in self.op_types_to_quantize
        ):
            raise ValueError(f"Conv is refused in dynamic mode: {REFUSED['dynamic_conv']}")
        tuning_options(self)

    def woq(self) -> WeightOnlyConfig:
        return nested(WeightOnlyConfig, self.weight_only_config, owner="weight_only_config")


def tuning_options(options: Any) -> TuningOptions | None:
    """The ``tuning`` mapping parsed; ``None`` when tuning is off (``{}``, except approach ``auto``)."""
    value = getattr(options, "tuning", {}) or {}
    if not value and getattr(options, "approach", None) != "auto":
        return None
    return nested(TuningOptions, value, owner="tuning")
