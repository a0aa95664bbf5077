"""The per-block solver contract shared by every weight-only algorithm.

A native algorithm plugin (rtn, hqq, kquant, or a third party's) supplies one function:
float blocks in, integers + scales + zero points out. The host does everything else
(finding weights, transposing, padding K, packing, writing ONNX ops, tied weights).

Convention (the one ONNX Runtime's ``MatMulNBits`` uses): ``w ~= (q - zero_point) * scale``
with ``q`` an unsigned integer in ``[0, 2**bits)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class BlockSpec:
    """What the solver is asked to produce for one tensor."""

    bits: int  # 2..8; the ONNX writers accept 4 and 8
    block_size: int  # elements per block along the reduction axis (K)
    symmetric: bool  # True: no zero points stored, the implied one is 2**(bits-1)
    float_zero_points: bool = False  # allow a float offset (zero_points of the scale's type)


@dataclass
class QuantizedBlocks:
    """A solver's answer for ``rows x n_blocks`` blocks.

    q: uint8 ``[rows, n_blocks, block_size]``, every value in ``[0, 2**bits)``.
    scales: float32 ``[rows, n_blocks]``.
    zero_points: ``None`` when symmetric (implied ``2**(bits-1)``); uint8 ``[rows, n_blocks]``
        for integer zero points; float32 ``[rows, n_blocks]`` for float offsets.
    """

    q: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None

    def implied_zero_points(self, bits: int) -> np.ndarray:
        if self.zero_points is None:
            return np.full(self.scales.shape, 2 ** (bits - 1), dtype=np.float32)
        return self.zero_points.astype(np.float32)


class BlockSolver(Protocol):
    """Quantize ``w`` (float32 ``[rows, n_blocks, block_size]``) per block.

    ``importance`` is optional, float32 ``[block_size * n_blocks]`` per input channel (K),
    e.g. mean squared activations from calibration data; solvers may ignore it.
    Solvers must not modify ``w``.
    """

    def __call__(
        self, w: np.ndarray, spec: BlockSpec, importance: np.ndarray | None = None
    ) -> QuantizedBlocks: ...


@dataclass
class PackedBlocks:
    """A packing kernel's answer for ``rows x n_blocks`` blocks: integers already packed.

    packed: uint8 ``[rows, n_blocks, block_size * bits / 8]``, values packed along the last axis,
        lowest index in the lowest bits (MatMulNBits' B layout).
    scales: float32 ``[rows, n_blocks]``.
    zero_points: ``None`` when symmetric, else uint8 ``[rows, n_blocks]`` (one value per byte),
        or float32 when ``spec.float_zero_points`` is set.
    """

    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None


class PackingKernel(Protocol):
    """Optional fast path of a solver: quantize and pack a weight in its stored ``[K, N]`` form.

    ``w_kn`` is float32 ``[n_blocks * block_size, N]``, C-contiguous, K already padded with zeros
    to whole blocks; blocks run along K for each of the N output channels (the answer's rows).
    It must produce exactly what the block solver would (same integers, scales, zero points),
    only faster; it returns ``None`` to decline (the host then calls the block solver).
    A pass offers one through :meth:`bitpress.onnx.weightonly.WeightOnlyPass.packing_kernel`;
    it is not used when activation statistics (``importance``) are given.
    """

    def __call__(self, w_kn: np.ndarray, spec: BlockSpec) -> PackedBlocks | None: ...


def check_block_size(block_size: int, name: str = "block_size") -> None:
    """The block sizes every bitpress writer and kernel takes: powers of two from 16 to 256."""
    if block_size < 16 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"{name} must be a power of two from 16 to 256, got {block_size}")


def dequantize(blocks: QuantizedBlocks, bits: int) -> np.ndarray:
    """float32 ``[rows, n_blocks, block_size]`` reconstruction of ``blocks``."""
    out = blocks.q.astype(np.float32)  # the one full-size temporary: the rest is in place
    out -= blocks.implied_zero_points(bits)[..., None]
    out *= blocks.scales.astype(np.float32)[..., None]
    return out
