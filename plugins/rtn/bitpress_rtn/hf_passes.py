"""RTN for PyTorch (Hugging Face) models: ``rtn_hf``, Olive's ``Rtn``.

The same block solver as the ONNX ``rtn`` pass; the host's :class:`bitpress.hf.passes.HfQuantPass`
finds the weights, applies the selection rules and stores the result on the parameters.
"""

from __future__ import annotations

from typing import ClassVar

from bitpress.plugin import BlockSolver, HfQuantOptions, HfQuantPass
from bitpress_rtn.solver import rtn_solver


class RtnHfPass(HfQuantPass):
    """Round to nearest, block-wise, on a Hugging Face model's weights (before any ONNX export)."""

    name = "rtn_hf"
    algorithms = ("rtn",)
    summary = "round-to-nearest on a Hugging Face model's weights, stored quantized in place (2/4/8 bits)"
    Options: ClassVar[type] = HfQuantOptions
    aliases: ClassVar[tuple[str, ...]] = ("Rtn",)

    def solver(self) -> BlockSolver:
        return rtn_solver
