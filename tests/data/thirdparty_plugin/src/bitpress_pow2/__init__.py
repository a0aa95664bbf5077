"""bitpress-pow2: weight-only quantization whose scales are powers of two.

Dequantization then needs only shifts; the host's weight-only machinery does all the ONNX work
(finding weights, tied embeddings, packing, MatMulNBits / GatherBlockQuantized nodes), so the
plugin is a block solver, a pass class and one hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from bitpress.plugin import BlockSolver, BlockSpec, QuantizedBlocks, WeightOnlyOptions, WeightOnlyPass, hookimpl, option

__version__ = "0.3.1"


def _pow2_at_least(x: np.ndarray) -> np.ndarray:
    # smallest power of two >= x; an all-zero block gets scale 1 (its codes are all the zero point)
    x = np.where(x > 0, x, np.float32(1)).astype(np.float32)
    return np.exp2(np.ceil(np.log2(x))).astype(np.float32)


def pow2_solver(w: np.ndarray, spec: BlockSpec, importance: np.ndarray | None = None) -> QuantizedBlocks:
    """``w`` float32 ``[rows, n_blocks, block_size]`` -> codes, power-of-two scales, zero points."""
    qmax = 2**spec.bits - 1
    if spec.symmetric:  # implied zero point 2**(bits-1); codes use [1, qmax] so +-peak fit
        half = 2 ** (spec.bits - 1)
        scales = _pow2_at_least(np.abs(w).max(axis=-1) / (half - 1))
        q = np.clip(np.round(w / scales[..., None]) + half, 0, qmax)
        return QuantizedBlocks(q.astype(np.uint8), scales, None)
    lo = np.minimum(w.min(axis=-1), 0)
    hi = np.maximum(w.max(axis=-1), 0)
    scales = _pow2_at_least((hi - lo) / qmax)
    zp = np.clip(np.round(-lo / scales), 0, qmax)
    q = np.clip(np.round(w / scales[..., None]) + zp[..., None], 0, qmax)
    return QuantizedBlocks(q.astype(np.uint8), scales, zp.astype(np.uint8))


@dataclass
class Pow2Options(WeightOnlyOptions):
    # the shared options (bits, block_size, nodes_to_exclude, ...) come from WeightOnlyOptions
    is_symmetric: bool = option(True, "symmetric blocks (no zero points stored)")


class Pow2Pass(WeightOnlyPass):
    """Round to nearest on a power-of-two grid, block-wise."""

    name = "pow2"
    algorithms = ("pow2",)
    precisions = ("int4",)
    summary = "4-bit block quantization with power-of-two scales (shift-only dequantization)"
    Options: ClassVar[type] = Pow2Options

    def solver(self) -> BlockSolver:
        return pow2_solver


@hookimpl
def bitpress_register_passes(register: Callable[[type], None]) -> None:
    register(Pow2Pass)
