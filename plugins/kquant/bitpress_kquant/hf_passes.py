"""k-quant for PyTorch (Hugging Face) models: ``kquant_hf``, Olive's ``KQuant``.

The same llama.cpp search as the ONNX ``kquant`` pass (no importance weights: calibration-free).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from bitpress.plugin import BlockSolver, HfQuantOptions, HfQuantPass, option
from bitpress_kquant.solver import kquant_solver


@dataclass
class KQuantHfOptions(HfQuantOptions):
    group_size: int = option(32, "weights per block along the input dimension: a power of two from 16 to 256")
    sym: bool = option(False, "symmetric search (no min); default: scale and min per block")
    float_zero_points: bool = option(
        True, "keep the block minimum as a float zero point (4-bit linears only; tables get uint8)"
    )
    nstep: int = option(20, "candidate scales tried per block (llama.cpp make_qkx2_quants)")
    rmin: float = option(-1.0, "first candidate offset of the scale sweep")
    rdelta: float = option(0.1, "step between candidate offsets")

    def validate(self) -> None:
        super().validate()
        if self.nstep < 0:
            raise ValueError(f"nstep must be >= 0, got {self.nstep}")


class KQuantHfPass(HfQuantPass):
    """llama.cpp's k-quant search per block, on a Hugging Face model's weights."""

    name = "kquant_hf"
    algorithms = ("kquant",)
    summary = "llama.cpp k-quant search on a Hugging Face model's weights, stored quantized in place (2/4/8 bits)"
    Options: ClassVar[type] = KQuantHfOptions
    aliases: ClassVar[tuple[str, ...]] = ("KQuant",)

    def solver(self) -> BlockSolver:
        o = self.options
        return functools.partial(kquant_solver, nstep=o.nstep, rmin=o.rmin, rdelta=o.rdelta)
