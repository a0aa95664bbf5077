"""The RTN passes: ``rtn`` (MatMulNBits / GatherBlockQuantized) and ``bnb4`` (MatMulBnb4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from bitpress.plugin import (
    BlockSolver,
    Estimate,
    KernelOf,
    OnnxModel,
    PackingKernel,
    PassContext,
    Plan,
    QuantizationError,
    WeightOnlyOptions,
    WeightOnlyPass,
    check_block_size,
    option,
)
from bitpress_rtn.solver import rtn_packing_kernel, rtn_solver


@dataclass
class RtnOptions(WeightOnlyOptions):
    block_size: int = option(128, "weights per block along K: a power of two from 16 to 256")
    is_symmetric: bool = option(True, "symmetric quantization (no zero points), as ONNX Runtime's default")
    float_zero_points: bool = option(
        False, "asymmetric only: store the unrounded zero point as a float (4-bit MatMulNBits)"
    )


class RtnPass(WeightOnlyPass):
    """Round to nearest, block-wise; matches ONNX Runtime's MatMulNBitsQuantizer bit for bit."""

    name = "rtn"
    algorithms = ("rtn",)
    precisions = ("int4", "int8")
    summary = "round-to-nearest block quantization to MatMulNBits / GatherBlockQuantized"
    Options: ClassVar[type] = RtnOptions
    aliases: ClassVar[tuple[str, ...]] = ("OnnxBlockWiseRtnQuantization",)

    def solver(self) -> BlockSolver:
        return rtn_solver

    def packing_kernel(self) -> PackingKernel | None:
        return rtn_packing_kernel


@dataclass
class Bnb4Options:
    precision: str = option("nf4", "codebook: nf4 (NormalFloat) or fp4")
    block_size: int = option(64, "weights per absmax block: a power of two from 16 to 256")
    nodes_to_include: list[str] = option([], "only these MatMul nodes (names, globs, re:REGEX)")
    nodes_to_exclude: list[str] = option([], "MatMul nodes left in float")

    def validate(self) -> None:
        if self.precision not in ("nf4", "fp4"):
            raise ValueError("precision must be nf4 or fp4")
        check_block_size(self.block_size)


class Bnb4Pass(WeightOnlyPass):
    """NF4 / FP4 codebook quantization of MatMul weights to ONNX Runtime's MatMulBnb4."""

    name = "bnb4"
    algorithms = ("nf4", "fp4", "bnb4")
    precisions = ("nf4", "fp4")
    summary = "4-bit NormalFloat / FP4 codebooks to com.microsoft MatMulBnb4 (float32 models)"
    Options: ClassVar[type] = Bnb4Options
    aliases: ClassVar[tuple[str, ...]] = ("OnnxBnb4Quantization",)
    distributes: ClassVar[bool] = False  # its own writer, on this machine's threads
    experts: ClassVar[str | None] = None  # MatMul weights only: no codebook form of QMoE

    def weight_plan(self, model: Any, data: Any = None) -> Plan:
        from bitpress_rtn.bnb4_writer import bnb4_plan

        return bnb4_plan(model, self.options)

    def estimate(self) -> Estimate:
        from bitpress_rtn.bnb4_writer import bnb4_estimate

        return bnb4_estimate(self.options)

    def kernel(self) -> KernelOf:
        """MatMulBnb4 has no fast form on CPU: ONNX Runtime dequantizes the whole weight on every call."""
        from bitpress.plugin import bnb4_path

        return lambda group: bnb4_path("cpu")

    def run(self, model: Any, context: PassContext) -> Any:
        from bitpress_rtn.bnb4_writer import quantize_bnb4_model

        if not isinstance(model, OnnxModel):
            raise QuantizationError(f"bnb4 quantizes ONNX models, got {model.kind}")
        report = quantize_bnb4_model(model, self.options, context, self.weight_plan(model))
        context.extras.setdefault("reports", []).append((self.name, model.source, report))
        return model
