"""The ``hqq`` pass: Half-Quadratic Quantization of ONNX weights, float zero points by default."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from bitpress.plugin import BlockSolver, WeightOnlyOptions, WeightOnlyPass, option
from bitpress_hqq.solver import hqq_solver


@dataclass
class HqqOptions(WeightOnlyOptions):
    block_size: int = option(64, "weights per block along K: a power of two from 16 to 256")
    is_symmetric: bool = option(False, "symmetric variant (fixed zero point, the loop updates scales)")
    float_zero_points: bool = option(
        True, "keep HQQ's optimum as a float zero point (4-bit MatMulNBits); false: rounded uint8"
    )
    iters: int = option(20, "half-quadratic iterations per block")
    lp_norm: float = option(0.7, "p of the lp-norm (p < 1) the solver minimizes")
    beta: float = option(10.0, "initial penalty of the half-quadratic split")
    kappa: float = option(1.01, "growth of beta per iteration")
    optimize_scale: bool = option(False, "also update scales inside the HQQ loop")
    refit_iters: int = option(4, "least-squares refits of scale and zero point after the loop")
    device: str = option("auto", "auto (CUDA through torch when present), numpy, or a torch device")


class HqqPass(WeightOnlyPass):
    """HQQ: a proximal solver for the zero points (and optionally scales) under an lp-norm, p < 1."""

    name = "hqq"
    algorithms = ("hqq",)
    precisions = ("int4", "int8")
    summary = "half-quadratic quantization, calibration-free, float zero points, to MatMulNBits"
    Options: ClassVar[type] = HqqOptions
    aliases: ClassVar[tuple[str, ...]] = ("OnnxHqqQuantization",)
    uses_importance = True  # weights the fit by activation statistics when --data is given

    def solver(self) -> BlockSolver:
        o = self.options
        # tensors already run in parallel in the host: one thread per tensor here
        return functools.partial(
            hqq_solver, iters=o.iters, lp_norm=o.lp_norm, beta=o.beta, kappa=o.kappa,
            optimize_scale=o.optimize_scale, refit_iters=o.refit_iters, workers=1, device=o.device,
        )
