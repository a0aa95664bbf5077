"""GPTQ on PyTorch (Hugging Face) models: ``gptq_hf``, Olive's ``Gptq`` and ``GptqQuantizer``.

The numpy solver of the ONNX ``gptq`` pass (:class:`~bitpress_gptq.solver.GptqSolver`) on the
host's layer-wise machinery (:mod:`bitpress.hf.calibrated`): each decoder block's linears are
solved with the Hessian of their inputs, sequentially (block k's inputs come from the model
whose earlier blocks are already quantized). Embedding tables (no input statistics) are rounded
on GPTQ's grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from bitpress.plugin import BlockSolver, CalibratedHfOptions, CalibratedHfPass, option

if TYPE_CHECKING:
    from bitpress.plugin import Method


@dataclass
class GptqHfOptions(CalibratedHfOptions):
    sym: bool = option(False, "symmetric (no zero points); default: an integer zero point per block")
    damp_percent: float = option(0.1, "dampening added to the Hessian's diagonal, as a share of its mean")
    shrinkage: float = option(
        0.6, "the Hessian's off-diagonal entries scaled by 1 - shrinkage (covariance shrinkage toward its diagonal): "
        "less trust in cross-channel correlations that a small or unlike calibration set gets wrong"
    )
    block_size_solve: int = option(128, "columns updated lazily at once (GPTQ's block size; whole groups)")
    desc_act: bool = option(
        True, "act-order: solve the input channels by decreasing activation energy (static groups: the checkpoint "
        "and MatMulNBits need no g_idx)"
    )
    mse: bool = option(False, "search each group's range (shrink 1.00..0.80) for the smallest error, not min/max")

    def validate(self) -> None:
        super().validate()
        from bitpress_gptq.solver import settings_from

        settings_from(self)


class GptqHfPass(CalibratedHfPass):
    """GPTQ (Frantar et al.) on a Hugging Face model's linears, block by block, on CPU."""

    name = "gptq_hf"
    algorithms = ("gptq",)
    summary = "GPTQ on a Hugging Face model's linears, sequential over decoder blocks, stored quantized in place"
    Options: ClassVar[type] = GptqHfOptions
    aliases: ClassVar[tuple[str, ...]] = ("Gptq", "GptqQuantizer")

    def solver(self) -> BlockSolver:
        from bitpress_gptq.passes import grid_solver

        return grid_solver(self.options.mse)

    def method(self) -> Method:
        from bitpress.plugin import Method
        from bitpress_gptq.solver import GptqSolver, settings_from

        return Method(GptqSolver(settings_from(self.options)), self.solver())
