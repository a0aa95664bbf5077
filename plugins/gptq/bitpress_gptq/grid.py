"""GPTQ's quantization grid: per-row parameters of one group of weights, and rounding onto it.

Arrays are laid out ``[..., group, rows]`` (the solver works on the transposed weight, one
input channel per row of the array), so a group's parameters reduce over axis ``-2``.

Grids (``w ~= (q - zero_point) * scale``, ``q`` integer in ``[0, 2**bits)``):

* asymmetric: the group's range is widened to include 0, ``scale = (max - min) / (2**bits - 1)``,
  integer ``zp = roundf(-min / scale)`` clipped to ``[0, 2**bits - 1]`` (0 is exactly
  representable);
* symmetric (no zero points stored, the implied one is ``m = 2**(bits-1)``): ONNX Runtime's
  grid, the one of the ``rtn`` plugin: ``peak`` = the group's value of largest magnitude (the
  minimum on a tie), ``scale = -peak / m``, so ``peak`` lands exactly on ``q = 0`` and all
  ``2**bits`` levels are used (the scale is negative when ``peak > 0``);
* ``q = clip(roundf(w * (1 / scale) + zp), 0, 2**bits - 1)``, ``roundf`` sending halves up; an
  all-zero group has scale 0 and a reciprocal of 0, so it quantizes to ``q = zp`` (exactly 0).

The optional scale search (``mse``) shrinks the range by each factor of :data:`SHRINK_GRID`
(1.00, 0.99, ..., 0.80: the asymmetric ``min`` and ``max``, or the symmetric ``peak``) and keeps,
per row of the group, the factor with the smallest ``sum |w - dequant(quant(w))| ** 2.4`` (the
first one on a tie, so 1.0 unless a shrink is strictly better).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: range shrink factors tried by the scale search, largest first (1.0 = plain min/max)
SHRINK_GRID: tuple[float, ...] = tuple(round(1.0 - i / 100, 2) for i in range(21))
#: exponent of the per-row error norm the scale search minimizes
ERROR_NORM = 2.4


@dataclass
class GroupParams:
    """One group's parameters per row: float32 arrays of the group's shape less axis ``-2``."""

    scale: np.ndarray
    zero_point: np.ndarray | None  # uint8; None when symmetric
    offset: np.ndarray  # the zero point as float32 (``2**(bits-1)`` when symmetric)
    recip: np.ndarray  # 1 / scale, 0 where the scale is 0

    def take(self, index: int | np.ndarray) -> GroupParams:
        """The parameters of group ``index`` of a stack of groups (leading axis)."""
        zp = None if self.zero_point is None else self.zero_point[index]
        return GroupParams(self.scale[index], zp, self.offset[index], self.recip[index])


def _params_from_range(lo: np.ndarray, hi: np.ndarray, bits: int, symmetric: bool) -> GroupParams:
    qmax = np.float32(2**bits - 1)
    mid = np.float32(2 ** (bits - 1))
    zp: np.ndarray | None
    if symmetric:
        peak = np.where(np.abs(hi) > np.abs(lo), hi, lo)
        scale = (-peak / mid).astype(np.float32)
        zp = None
        offset = np.full(scale.shape, mid, np.float32)
    else:
        lo = np.minimum(lo, np.float32(0))
        hi = np.maximum(hi, np.float32(0))
        scale = ((hi - lo) / qmax).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            zp_f = np.where(scale != 0, -lo / scale, np.float32(0))
        zp = roundf(np.clip(zp_f, 0, qmax)).astype(np.uint8)
        offset = zp.astype(np.float32)
    with np.errstate(divide="ignore"):
        recip = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    return GroupParams(scale, zp, offset, recip)


def roundf(x: np.ndarray) -> np.ndarray:
    """Round halves up (C ``roundf`` for ``x >= 0``; negative values are clipped to 0 anyway)."""
    f = np.floor(x)
    return f + (x - f >= 0.5)


def quantize(w: np.ndarray, p: GroupParams, bits: int) -> np.ndarray:
    """``clip(roundf(w / scale + zp), 0, 2**bits - 1)`` as float32 (the integers, unconverted).

    ``p``'s arrays broadcast against ``w`` (a column ``[rows]`` or a group ``[..., group, rows]``
    with ``p`` of ``[..., 1, rows]``).
    """
    x = w * p.recip
    x += p.offset
    x = roundf(x)
    return np.clip(x, 0, np.float32(2**bits - 1), out=x)


def dequantize(q: np.ndarray, p: GroupParams) -> np.ndarray:
    """``(q - zp) * scale`` as float32."""
    return (q - p.offset) * p.scale


def _expand(p: GroupParams) -> GroupParams:
    """Parameters of ``[..., rows]`` made to broadcast against groups ``[..., group, rows]``."""
    zp = None if p.zero_point is None else p.zero_point[..., None, :]
    return GroupParams(p.scale[..., None, :], zp, p.offset[..., None, :], p.recip[..., None, :])


def group_params(w: np.ndarray, bits: int, symmetric: bool, mse: bool = False) -> GroupParams:
    """Parameters of float32 groups ``w [..., group, rows]``: arrays ``[..., rows]``."""
    lo = w.min(axis=-2)
    hi = w.max(axis=-2)
    best = _params_from_range(lo, hi, bits, symmetric)
    if not mse:
        return best
    best_err = _error(w, best, bits)
    for shrink in SHRINK_GRID[1:]:
        f = np.float32(shrink)
        cand = _params_from_range(lo * f, hi * f, bits, symmetric)
        err = _error(w, cand, bits)
        better = err < best_err
        if not better.any():
            continue
        best_err = np.where(better, err, best_err)
        best = GroupParams(
            np.where(better, cand.scale, best.scale),
            None if best.zero_point is None else np.where(better, cand.zero_point, best.zero_point),
            np.where(better, cand.offset, best.offset),
            np.where(better, cand.recip, best.recip),
        )
    return best


def _error(w: np.ndarray, p: GroupParams, bits: int) -> np.ndarray:
    """``sum |w - dequant(quant(w))| ** 2.4`` over each group (axis ``-2``)."""
    e = _expand(p)
    d = np.abs(w - dequantize(quantize(w, e, bits), e))
    np.power(d, np.float32(ERROR_NORM), out=d)
    return d.sum(axis=-2, dtype=np.float32)
