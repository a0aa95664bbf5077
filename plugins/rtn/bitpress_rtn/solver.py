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

:func:`rtn_solver` is the block solver (the definition); :func:`rtn_packing_kernel` gives the
same bytes from the weight's stored ``[K, N]`` layout and is what the ``rtn`` pass runs.
"""

from __future__ import annotations

import numpy as np

from bitpress.plugin import BlockSpec, PackedBlocks, QuantizedBlocks


def _roundf(x: np.ndarray) -> np.ndarray:
    # C roundf for x >= 0 (halves up); negatives are clipped to 0 by every caller anyway.
    # np.round would send halves to even and disagree with ORT on exact ties.
    f = np.floor(x)
    return f + (x - f >= 0.5)


def _check_spec(spec: BlockSpec) -> None:
    if not 2 <= spec.bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {spec.bits}")


def _block_params(
    lo: np.ndarray, hi: np.ndarray, spec: BlockSpec
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """Scales, stored zero points, the offset added before rounding and ``1 / scale`` (0 for an
    all-zero block), from each block's minimum ``lo`` and maximum ``hi`` (float32, any shape)."""
    qmax = np.float32(2**spec.bits - 1)
    mid = np.float32(2 ** (spec.bits - 1))
    zp: np.ndarray | None
    if spec.symmetric:
        peak = np.where(np.abs(hi) > np.abs(lo), hi, lo)
        scales = -peak / mid
        zp = None
        offset = np.full(scales.shape, mid, np.float32)
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
    return scales.astype(np.float32), zp, offset, recip


def _round_clip(x: np.ndarray, qmax: np.float32) -> np.ndarray:
    """``clip(roundf(x), 0, qmax)`` as uint8; ``x`` is overwritten."""
    f = np.floor(x)
    x -= f
    with np.errstate(invalid="ignore"):  # NaN weights: the caller rejects their non-finite scales
        f += x >= 0.5
        np.clip(f, 0, qmax, out=f)
    return f.astype(np.uint8)


def rtn_solver(
    w: np.ndarray, spec: BlockSpec, importance: np.ndarray | None = None
) -> QuantizedBlocks:
    """Quantize float32 ``w [rows, n_blocks, block_size]`` per block; ``importance`` is unused."""
    del importance  # RTN has no use for activation statistics
    _check_spec(spec)
    if w.ndim != 3 or w.shape[-1] != spec.block_size:
        raise ValueError(f"w must be [rows, n_blocks, {spec.block_size}], got {w.shape}")
    w = np.asarray(w, dtype=np.float32)
    scales, zp, offset, recip = _block_params(w.min(axis=-1), w.max(axis=-1), spec)
    x = w * recip[..., None]
    x += offset[..., None]
    q = _round_clip(x, np.float32(2**spec.bits - 1))
    return QuantizedBlocks(q=q, scales=scales, zero_points=zp)


def rtn_packing_kernel(w_kn: np.ndarray, spec: BlockSpec) -> PackedBlocks | None:
    """RTN of a weight in its stored ``[K, N]`` form, packed: the same answer as :func:`rtn_solver`.

    Working in the stored layout, blocks are ``[n_blocks, block_size, N]``: the per-block
    minimum / maximum reduce over whole rows of N values and every other step runs along
    contiguous rows, so no float transpose is needed (only the packed bytes, an eighth of the
    floats at 4 bits, are transposed). 1.7-2.9x less CPU than transposing for the block solver,
    and 0.5-0.7x the CPU time of ONNX Runtime's C++ kernel (``make -C bench kernels``).
    """
    _check_spec(spec)
    if spec.bits not in (4, 8):
        return None  # the ONNX layouts hold 4 or 8 bits
    k, n = w_kn.shape
    bs = spec.block_size
    if k % bs:
        raise ValueError(f"w_kn must hold whole blocks along K ({bs}), got K={k}")
    w = np.asarray(w_kn, dtype=np.float32).reshape(k // bs, bs, n)
    scales, zp, offset, recip = _block_params(w.min(axis=1), w.max(axis=1), spec)  # [n_blocks, N]
    x = np.multiply(w, recip[:, None, :])
    x += offset[:, None, :]
    q = _round_clip(x, np.float32(2**spec.bits - 1))  # [n_blocks, block_size, N]
    del x
    if spec.bits == 4:
        q = q[:, 0::2, :] | (q[:, 1::2, :] << 4)  # lowest index in the low nibble
    return PackedBlocks(
        packed=np.ascontiguousarray(q.transpose(2, 0, 1)),
        scales=np.ascontiguousarray(scales.T),
        zero_points=None if zp is None else np.ascontiguousarray(zp.T),
    )
