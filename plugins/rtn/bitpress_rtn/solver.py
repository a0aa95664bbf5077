"""Round-to-nearest block quantization, bit-compatible with ONNX Runtime's own quantizer.

Mirrors ``MatMulNBitsQuantizer`` + ``DefaultWeightOnlyQuantConfig`` (MLAS ``BlockwiseQuantizer``
behind ``quantize_matmul_4bits`` / ``quantize_matmul_8bits``), all in float32:

* symmetric: ``m`` = the block's value of largest magnitude (the minimum on a tie),
  ``scale = -m / 2**(bits-1)``, so ``m`` lands on ``q = 0`` (-8 for int4) and the scale is
  negative when ``m > 0``; zero point ``2**(bits-1)``.
* asymmetric: the range is widened to include 0, ``scale = (max - min) / (2**bits - 1)``,
  ``zp = round(-min / scale)``.
* ``q = clip(round(w * (1 / scale) + zp), 0, 2**bits - 1)``, with C ``roundf`` (halves away from
  zero) and a reciprocal of 0 for an all-zero block.

``spec.float_zero_points`` (asymmetric only) keeps ``zp = -min / scale`` unrounded.
"""

from __future__ import annotations

import numpy as np

from bitpress.quant.solver import BlockSpec, QuantizedBlocks


def _roundf(x: np.ndarray) -> np.ndarray:
    # C roundf for x >= 0 (halves up); negatives are clipped to 0 by every caller anyway.
    # np.round would send halves to even and disagree with ORT on exact ties.
    f = np.floor(x)
    return f + (x - f >= 0.5)


def rtn_solver(
    w: np.ndarray, spec: BlockSpec, importance: np.ndarray | None = None
) -> QuantizedBlocks:
    """Quantize float32 ``w [rows, n_blocks, block_size]`` per block; ``importance`` is unused."""
    del importance  # RTN has no use for activation statistics
    if not 2 <= spec.bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {spec.bits}")
    if w.ndim != 3 or w.shape[-1] != spec.block_size:
        raise ValueError(f"w must be [rows, n_blocks, {spec.block_size}], got {w.shape}")
    w = np.asarray(w, dtype=np.float32)
    qmax = np.float32(2**spec.bits - 1)
    mid = np.float32(2 ** (spec.bits - 1))
    lo = w.min(axis=-1)
    hi = w.max(axis=-1)

    if spec.symmetric:
        peak = np.where(np.abs(hi) > np.abs(lo), hi, lo)
        scales = -peak / mid
        zp = None
        offset = mid
    else:
        lo = np.minimum(lo, np.float32(0))
        hi = np.maximum(hi, np.float32(0))
        scales = (hi - lo) / qmax
        with np.errstate(divide="ignore", invalid="ignore"):
            zp_f = np.where(scales != 0, -lo / scales, lo)
        zp_f = np.clip(zp_f, 0, qmax)
        if spec.float_zero_points:
            zp = zp_f.astype(np.float32)
            offset = zp
        else:
            zp = _roundf(zp_f).astype(np.uint8)
            offset = zp.astype(np.float32)

    with np.errstate(divide="ignore"):
        recip = np.where(scales != 0, np.float32(1) / scales, np.float32(0)).astype(np.float32)
    x = w * recip[..., None] + np.asarray(offset, dtype=np.float32)[..., None]
    with np.errstate(invalid="ignore"):  # NaN weights: the caller rejects their non-finite scales
        q = np.clip(_roundf(x), 0, qmax).astype(np.uint8)
    return QuantizedBlocks(q=q, scales=scales.astype(np.float32), zero_points=zp)
