"""The ONNX pass ``gptq``: GPTQ on the host's calibrated weight-only machinery.

Olive's ``Gptq`` / ``GptqQuantizer`` are PyTorch passes: their aliases belong to ``gptq_hf``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from bitpress.plugin import (
    BlockSolver,
    BlockSpec,
    CalibratedOptions,
    CalibratedPass,
    CalibratedSolver,
    Group,
    QuantizedBlocks,
    option,
)
from bitpress_gptq import grid
from bitpress_gptq.solver import GptqSolver, settings_from


@dataclass
class GptqOptions(CalibratedOptions):
    block_size: int = option(128, "weights per quantization group along K (MatMulNBits block_size): 16-256")
    is_symmetric: bool = option(False, "symmetric (no zero points stored); default: integer zero points")
    damp_percent: float = option(0.1, "dampening added to the Hessian's diagonal, as a share of its mean")
    shrinkage: float = option(
        0.6, "the Hessian's off-diagonal entries scaled by 1 - shrinkage (covariance shrinkage toward its diagonal): "
        "less trust in cross-channel correlations that a small or unlike calibration set gets wrong"
    )
    block_size_solve: int = option(128, "columns updated lazily at once (GPTQ's block size; a multiple of block_size)")
    desc_act: bool = option(
        True, "act-order: solve the input channels by decreasing activation energy (static groups, so MatMulNBits "
        "needs no g_idx and inference costs nothing more)"
    )
    mse: bool = option(False, "search each group's range (shrink 1.00..0.80) for the smallest error, not min/max")

    def validate(self) -> None:
        super().validate()
        settings_from(self)
        for pattern, settings in self.overrides.items():
            if settings.get("bits", self.bits) not in (4, 8):
                raise ValueError(f"overrides[{pattern}]: gptq writes 4 or 8 bits on ONNX")


class GptqPass(CalibratedPass):
    """GPTQ (Frantar et al.): each weight's columns rounded in turn, the error pushed onto the columns
    not yet rounded through the inverse Hessian of its input; layers solved in order, each on
    inputs from the model with the earlier layers already quantized."""

    name = "gptq"
    algorithms = ("gptq",)
    precisions = ("int4", "int8")
    summary = "GPTQ: calibrated int4/int8, sequential over layers, to MatMulNBits (integers written as solved)"
    Options: ClassVar[type] = GptqOptions

    def calibrated_solver(self, group: Group) -> CalibratedSolver:
        if self._gptq is None:  # one solver: q/k/v (gate/up) share one prepared inverse Hessian
            self._gptq = GptqSolver(settings_from(self.options))
        return self._gptq

    _gptq: GptqSolver | None = None

    def solver(self) -> BlockSolver:
        """Tables no activation reaches (an untied embedding): rounded on GPTQ's grid."""
        return grid_solver(self.options.mse)

    def float_zero_points(self) -> bool:
        return False


def grid_solver(mse: bool) -> BlockSolver:
    """A block solver rounding to nearest on GPTQ's grid (:mod:`bitpress_gptq.grid`)."""

    def solve(w: np.ndarray, spec: BlockSpec, importance: np.ndarray | None = None) -> QuantizedBlocks:
        g = np.ascontiguousarray(np.moveaxis(w, 0, -1))  # [n_blocks, block, rows]
        p = grid.group_params(g, spec.bits, spec.symmetric, mse)  # arrays [n_blocks, rows]
        q = grid.quantize(g, grid.GroupParams(p.scale[:, None], None if p.zero_point is None else p.zero_point[:, None],
                                              p.offset[:, None], p.recip[:, None]), spec.bits)
        zps = None if p.zero_point is None else np.ascontiguousarray(p.zero_point.T)
        return QuantizedBlocks(np.moveaxis(q, -1, 0).astype(np.uint8), np.ascontiguousarray(p.scale.T), zps)

    return solve
