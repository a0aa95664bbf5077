"""The INC passes: static int8 (with SmoothQuant), dynamic int8, int4 weight-only, and IncQuantization.

Importing this module imports no part of ``onnx_neural_compressor``: the host lists these
passes (as unavailable, with the install command) wherever the plugin is installed. INC is
imported inside ``run()``, under :func:`bitpress_inc.sandbox.contained`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from bitpress.plugin import OptionError, Pass, PassContext
from bitpress_inc import runner
from bitpress_inc.options import (
    DynamicOptions,
    IncPassOptions,
    StaticPassOptions,
    WeightOnlyOptions,
    tuning_options,
)

#: shown when INC is missing; an environment of its own because onnx-neural-compressor declares numpy<2
INSTALL_HINT = (
    "bitpress env create inc (an isolated environment, recommended: onnx-neural-compressor 1.0 declares "
    'numpy<2) or pip install "bitpress[inc]"'
)
REQUIRES = ("onnx_neural_compressor", "onnxruntime", "scipy", "prettytable")


class _IncPass(Pass):
    requires: ClassVar[tuple[str, ...]] = REQUIRES
    install_hint: ClassVar[str | None] = INSTALL_HINT
    aliases: ClassVar[tuple[str, ...]] = ()
    #: the approach when the options have none (``approach`` is an option of inc_static and inc)
    approach: ClassVar[str] = "static"

    def job(self) -> runner.Job:
        return runner.Job(self.name, getattr(self.options, "approach", self.approach), self.options,
                          tuning_options(self.options))

    def run(self, model: Any, context: PassContext) -> Any:
        return runner.run(model, context, self.job())


class IncStaticPass(_IncPass):
    """Intel Neural Compressor static int8 (QOperator or QDQ, optional SmoothQuant); Olive's IncStaticQuantization."""

    name = "inc_static"
    algorithms = ("inc_static",)
    precisions = ("int8", "int4")
    needs_data = True
    summary = "Intel Neural Compressor static int8 (QOperator/QDQ, MinMax/Percentile, SmoothQuant, tuning)"
    Options: ClassVar[type] = StaticPassOptions
    aliases: ClassVar[tuple[str, ...]] = ("IncStaticQuantization",)

    @classmethod
    def precision_options(cls, precision: str) -> dict[str, Any]:
        super().precision_options(precision)  # refuses a precision the pass does not list
        return {"approach": "weight_only" if precision == "int4" else "static"}


class IncDynamicPass(_IncPass):
    """Intel Neural Compressor dynamic int8 (no calibration data); Olive's IncDynamicQuantization."""

    name = "inc_dynamic"
    algorithms = ("inc_dynamic",)
    precisions = ("int8",)
    needs_data = False
    summary = "Intel Neural Compressor dynamic int8 (MatMulInteger + DynamicQuantizeLinear, no data)"
    Options: ClassVar[type] = DynamicOptions
    aliases: ClassVar[tuple[str, ...]] = ("IncDynamicQuantization",)
    approach: ClassVar[str] = "dynamic"


class IncWeightOnlyPass(_IncPass):
    """Intel Neural Compressor int4 weight-only quantization of MatMul weights to MatMulNBits (RTN, AWQ)."""

    name = "inc_woq"
    algorithms = ("inc_woq",)
    precisions = ("int4",)
    needs_data = False  # RTN needs none; AWQ and tuning ask for it when they run
    summary = "Intel Neural Compressor int4 weight-only MatMulNBits (RTN, AWQ; GPTQ refused)"
    Options: ClassVar[type] = WeightOnlyOptions
    approach: ClassVar[str] = "weight_only"

    @classmethod
    def precision_options(cls, precision: str) -> dict[str, Any]:
        super().precision_options(precision)
        return {}


class IncPass(_IncPass):
    """Olive's IncQuantization: any approach; ``auto`` lets INC's tuning choose static or dynamic int8."""

    name = "inc"
    algorithms = ("inc",)
    precisions = ("int8", "int4")
    needs_data = True
    summary = "Intel Neural Compressor, approach auto (tuned static/dynamic int8), static, dynamic or weight_only"
    Options: ClassVar[type] = IncPassOptions
    aliases: ClassVar[tuple[str, ...]] = ("IncQuantization",)

    @classmethod
    def precision_options(cls, precision: str) -> dict[str, Any]:
        super().precision_options(precision)
        return {"approach": "weight_only"} if precision == "int4" else {}

    @classmethod
    def from_config(cls, values: dict[str, Any] | None, precision: str | None = None, *,
                    strict: bool = False) -> Pass:
        built = super().from_config(values, precision, strict=strict)
        if precision == "int8" and built.options.approach == "weight_only":
            raise OptionError(f"{cls.name}: approach weight_only is int4; it contradicts --precision int8")
        return built


PASSES = (IncStaticPass, IncDynamicPass, IncWeightOnlyPass, IncPass)
