"""The ``aimet`` pass's options, as Olive's ``AimetQuantization`` names them, checked before any work.

``techniques`` is an ordered list of mappings, each with a ``name`` (``lpbq``, ``seqmse``,
``adaround``) and that technique's options. Every name, option and value is checked here, when
the pass is built (``bitpress quantize`` / a workflow config), so a typo fails at once with the
valid names listed, never after minutes of AdaRound.

Nothing here imports AIMET.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import Any, Literal

from bitpress.plugin import coerce, option, short

#: the linear op types AIMET optimizes (AdaRound: ``AdaroundSupportedModules``; LPBQ: any weight op)
LINEAR_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclass
class LpbqOptions:
    """``{name: lpbq}``: low-power blockwise quantization of the weights (``set_lpbq_for_params``)."""

    block_size: int = option(64, "input channels per block; layers whose input channels it does not divide "
                                 "keep per-channel weights")
    op_types: list[str] = option(["Gemm", "MatMul", "Conv"], "op types whose weights get LPBQ")
    nodes_to_exclude: list[str] = option([], "node names whose weights keep per-channel quantization")
    bitwidth: int = option(4, "bits of the weights (Olive's LPBQ option)")
    decompressed_bw: int = option(8, "bits of the per-block scales times the weights' (Olive's LPBQ option); "
                                     "AIMET 2.42's set_lpbq_for_params fixes it at 2 x bitwidth")

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be a positive number of input channels, got {self.block_size}")
        if not self.op_types:
            raise ValueError("op_types must name at least one op type (Gemm, MatMul, Conv)")
        if not 2 <= self.bitwidth <= 8:
            raise ValueError(f"bitwidth must be 2 to 8, got {self.bitwidth}")
        if self.decompressed_bw != 2 * self.bitwidth:
            raise ValueError(
                f"decompressed_bw={self.decompressed_bw} with bitwidth={self.bitwidth}: AIMET 2.42's "
                f"set_lpbq_for_params always uses {2 * self.bitwidth} (2 x bitwidth); drop decompressed_bw"
            )


@dataclass
class SeqMseOptions:
    """``{name: seqmse}``: per-layer search of the weight scales that minimise the layer's output MSE."""

    num_candidates: int = option(20, "scales tried per weight (fewer: faster, coarser)")

    def validate(self) -> None:
        if self.num_candidates < 1:
            raise ValueError(f"num_candidates must be at least 1, got {self.num_candidates}")


@dataclass
class AdaRoundOptions:
    """``{name: adaround}``: learned rounding of each layer's weights (``apply_adaround``)."""

    num_iterations: int = option(10000, "optimisation steps per layer (AIMET recommends 10000 for 8 bits, "
                                         "15000 below)")
    nodes_to_exclude: list[str] = option([], "node names AdaRound leaves with nearest rounding")

    def validate(self) -> None:
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be at least 1, got {self.num_iterations}")


#: technique name -> its options; the order is the only one in which each technique takes effect
TECHNIQUES: dict[str, type] = {"lpbq": LpbqOptions, "seqmse": SeqMseOptions, "adaround": AdaRoundOptions}

#: why the order is fixed (measured with aimet-onnx 2.42, see docs/aimet.md)
ORDER_REASON = (
    "a technique after AdaRound or SeqMSE finds the weight encodings frozen: LPBQ after either, and SeqMSE "
    "after AdaRound, silently change nothing (measured with aimet-onnx 2.42)"
)


@dataclass(frozen=True)
class Technique:
    """One checked entry of ``techniques``."""

    name: str
    options: Any

    def describe(self) -> str:
        values = ", ".join(f"{f.name}={getattr(self.options, f.name)}" for f in fields(self.options))
        return f"{self.name}({values})"


def parse_technique(index: int, entry: Any) -> Technique:
    """``techniques[index]`` as a :class:`Technique`; ``ValueError`` naming what is wrong."""
    where = f"techniques[{index}]"
    valid_names = ", ".join(TECHNIQUES)
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping like {{name: lpbq, block_size: 64}}, got {short(entry)}")
    if "name" not in entry:
        raise ValueError(f"{where} has no name; valid names: {valid_names}")
    name = entry["name"]
    if not isinstance(name, str) or name.lower() not in TECHNIQUES:
        raise ValueError(f"{where}: unknown technique {short(name)}; valid names: {valid_names}")
    name = name.lower()
    cls = TECHNIQUES[name]
    given = {k: v for k, v in entry.items() if k != "name"}
    known = {f.name for f in fields(cls)}
    if "data_config" in given:
        raise ValueError(
            f"{where} ({name}): data_config is not supported: every technique uses the run's calibration "
            "data (--data or 'data:' in the config)"
        )
    unknown = sorted(str(k) for k in given if k not in known)
    if unknown:
        raise ValueError(f"{where} ({name}): unknown option(s) {', '.join(unknown)}; valid options for {name}: "
                         f"{', '.join(sorted(known))}")
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in given.items():
        try:
            values[key] = coerce(value, hints[key], strict=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where} ({name}): {key}={short(value)} is not valid: {exc}") from None
    options = cls(**values)
    try:
        options.validate()
    except ValueError as exc:
        raise ValueError(f"{where} ({name}): {exc}") from None
    return Technique(name, options)


def parse_techniques(entries: list[Any]) -> list[Technique]:
    """Every entry checked, then their order: lpbq, seqmse, adaround, each at most once."""
    techniques = [parse_technique(i, e) for i, e in enumerate(entries)]
    names = [t.name for t in techniques]
    for name in set(names):
        if names.count(name) > 1:
            raise ValueError(f"techniques: {name} is listed {names.count(name)} times; list each technique once")
    rank = list(TECHNIQUES)
    if names != sorted(names, key=rank.index):
        raise ValueError(
            f"techniques: {', '.join(names)} must be listed in the order {', '.join(n for n in rank if n in names)}: "
            f"{ORDER_REASON}"
        )
    return techniques


Precision = Literal["int4", "int8", "int16"]
ActivationType = Literal["uint8", "uint16", "fp16"]


@dataclass
class AimetOptions:
    """Olive's ``AimetQuantization`` options (an Olive config ports by changing ``type``)."""

    precision: Precision = option("int8", "weights: int4, int8 or int16 (per channel, symmetric)")
    activation_type: ActivationType = option(
        "uint8", "activations: uint8 or uint16 (asymmetric QuantizeLinear/DequantizeLinear), or fp16 (AIMET "
        "simulates fp16 activations; the QDQ output quantizes the weights only)"
    )
    quant_scheme: Literal["min_max", "tf_enhanced"] = option(
        "min_max", "activation ranges: min_max (observed range) or tf_enhanced (AIMET's SQNR-based range search)"
    )
    config_file: str | None = option(
        None, "AIMET quantsim config: a JSON file (absolute path) or an alias: default, htp_v66 ... htp_v85, "
        "enpu_v6, enpu_v7 (None: default, per-channel weights)"
    )
    op_types_to_exclude: list[str] = option([], "op types left in float (tensors only they produce and consume)")
    nodes_to_exclude: list[str] = option(
        [], "node names left in float: their weights, and tensors only excluded nodes produce and consume"
    )
    techniques: list[dict[str, Any]] = option(
        [], "applied in order before the encodings are computed: {name: lpbq, block_size: 64, op_types, "
        "nodes_to_exclude}, {name: seqmse, num_candidates: 20}, {name: adaround, num_iterations: 10000, "
        "nodes_to_exclude}; listed in the order lpbq, seqmse, adaround; [] = plain static quantization"
    )
    export_encodings: bool = option(
        False, "also write AIMET's encodings JSON (<output name>.encodings) beside the output model, for QNN tools"
    )

    def validate(self) -> None:
        techniques = parse_techniques(self.techniques)
        if self.quant_scheme != "min_max" and any(t.name == "seqmse" for t in techniques):
            raise ValueError("seqmse needs quant_scheme=min_max (AIMET's sequential MSE asserts the TF scheme)")

    def checked_techniques(self) -> list[Technique]:
        return parse_techniques(self.techniques)


__all__ = [
    "LINEAR_OPS", "ORDER_REASON", "TECHNIQUES", "AdaRoundOptions", "AimetOptions", "LpbqOptions", "SeqMseOptions",
    "Technique", "parse_technique", "parse_techniques",
]
