"""The ONNX pass ``awq``: activation-aware scaling and clipping on the host's calibrated machinery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from bitpress.plugin import (
    BlockSolver,
    CalibratedOptions,
    CalibratedPass,
    CalibratedSolver,
    Group,
    InputScaler,
    option,
    rounding_solver,
)
from bitpress_awq.search import DEFAULT_CLIP_SKIP, AwqClipSolver, AwqScaler


@dataclass
class AwqOptions(CalibratedOptions):
    block_size: int = option(128, "weights per quantization group along K (MatMulNBits block_size): 16-256")
    is_symmetric: bool = option(False, "symmetric (no zero points stored); default: zero points, as AutoAWQ")
    quantizer: str = option("rtn", "the block solver that rounds the scaled weights: rtn, kquant, hqq (a pass name)")
    n_grid: int = option(20, "exponents tried by the scale search (a = 0, 1/n, ... < 1)")
    duo_scaling: bool = option(True, "scales from activation and weight magnitudes (AutoAWQ's newer form)")
    clip: bool = option(True, "search a clip ratio per block against its output error")
    max_shrink: float = option(0.5, "the clip search's smallest ratio is 1 - max_shrink")
    clip_skip: list[str] = option(
        list(DEFAULT_CLIP_SKIP), "weights rounded without clipping (names, globs or re:REGEX): query / key projections"
    )

    def validate(self) -> None:
        super().validate()
        if self.n_grid < 1 or self.n_grid > 100:
            raise ValueError(f"n_grid must be from 1 to 100, got {self.n_grid}")
        if not 0 <= self.max_shrink < 1:
            raise ValueError(f"max_shrink must be in [0, 1), got {self.max_shrink}")


class AwqPass(CalibratedPass):
    """AWQ (Lin et al.): per-input-channel scales chosen against the output error of every MatMul
    reading the input, folded exactly into the producer (or a Mul), a clip ratio per block, then
    the rounding of any block solver (``quantizer``)."""

    name = "awq"
    algorithms = ("awq",)
    precisions = ("int4", "int8")
    summary = "AWQ: activation-aware scales and clipping, rounded by rtn / kquant / hqq, to MatMulNBits"
    Options: ClassVar[type] = AwqOptions

    def _rounding(self) -> tuple[BlockSolver, bool]:
        o = self.options
        return rounding_solver(o.quantizer, o.bits, o.block_size, o.is_symmetric)

    def solver(self) -> BlockSolver:
        return self._rounding()[0]

    def float_zero_points(self) -> bool:
        return self._rounding()[1]

    def input_scaler(self) -> InputScaler | None:
        o = self.options
        return AwqScaler(self.solver(), n_grid=o.n_grid, duo_scaling=o.duo_scaling)

    def calibrated_solver(self, group: Group) -> CalibratedSolver:
        if self._clip is None:  # one solver: weights sharing an input share its prepared Hessian blocks
            o = self.options
            self._clip = AwqClipSolver(
                self.solver(), n_grid=o.n_grid, max_shrink=o.max_shrink if o.clip else 0.0, clip_skip=o.clip_skip
            )
        return self._clip

    _clip: AwqClipSolver | None = None
