"""The k-quant block solver: llama.cpp's ``make_qkx2_quants`` search, vectorized with numpy.

For each block the solver sweeps ``nstep + 1`` candidate inverse scales around the min/max fit,
rounds the block at each, solves the weighted least-squares problem for the best ``(scale, min)``
in closed form and keeps the candidate with the lowest weighted squared error. The per-element
weights follow llama.cpp's Q4_K: ``|x| + rms(block)`` without an importance vector, and
``importance * sqrt(2 * mean(x^2) + x^2)`` with one (llama.cpp's ``quantize_row_q4_K_impl``
takes ``sigma2`` over a 256-element super-block; here the block is the only grouping there is).
A candidate's error comes from the same sums in closed form (at a least-squares optimum
``error = sum(w x^2) - scale * sum(w x l) - min * sum(w x)``), so each candidate costs one
rounding pass and three weighted sums. After the sweep the block is re-rounded to the chosen
grid and the pair re-fitted once; both steps can only lower the weighted error. All three
flavours below use the same weights (llama.cpp's Q6_K would use ``x^2`` for its symmetric
search).

Three output flavours, chosen by the :class:`BlockSpec`:

* ``float_zero_points``: llama.cpp's representation. ``zero_point = -min / scale`` as float32,
  so the fitted ``min`` survives exactly. llama.cpp clamps ``min <= 0``; this solver also
  keeps the top level ``>= 0`` (``max`` clamped likewise, and the fit constrained), so the
  zero point stays in ``[0, 2**bits - 1]``: an all-negative block would otherwise get an
  unbounded one (past fp16's range for a narrow block far from 0). Only such blocks differ.
* integer zero points: the same sweep, but each candidate rounds its zero point to an integer
  in ``[0, 2**bits)`` and fits the scale alone for it (a 1-D least-squares problem).
* ``symmetric``: llama.cpp's ``make_qx_quants`` idea. The element of largest magnitude is
  mapped to the lowest level ``-2**(bits-1)``, which uses both ends of the asymmetric integer
  range; the sweep picks the scale, which therefore may be negative.

Every step is vectorized over all blocks of a chunk of rows and loops only over candidates.
Chunks are laid out ``[block_size, n_blocks]`` so the per-block reductions run over the slow
axis (contiguous SIMD adds), and are bounded (``_CHUNK_ELEMS``) so a 4096x11008 matrix costs a
few MiB of scratch per worker thread. numpy releases the GIL in its loops, so chunks run on a
small thread pool.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bitpress.plugin import BlockSpec, QuantizedBlocks

__all__ = ["bits_per_weight", "kquant_solver"]

# ~128K elements (512 KiB per float32 array) keeps a chunk's working set in a core's L2.
_CHUNK_ELEMS = 1 << 17
# A candidate whose 2x2 system is this close to singular (all levels nearly equal, the
# determinant lost in float32 round-off) is skipped rather than trusted.
_REL_DET_EPS = 1e-5
# Rounds of re-rounding + re-fitting after the sweep (each one a full pass over the block).
_POLISH_ITERS = 1
# Bit widths from which the search runs in float64 (see kquant_solver).
_F64_FROM_BITS = 7


def bits_per_weight(spec: BlockSpec, scale_bytes: int = 2) -> float:
    """Storage cost per weight: the codes, one scale per block and its zero point, if any.

    Float zero points are stored like the scales (``scale_bytes`` each); integer zero points
    are packed at ``bits`` bits, as ``MatMulNBits`` stores them.
    """
    per_block = 8.0 * scale_bytes
    if not spec.symmetric:
        per_block += 8.0 * scale_bytes if spec.float_zero_points else spec.bits
    return spec.bits + per_block / spec.block_size


def kquant_solver(
    w: np.ndarray,
    spec: BlockSpec,
    importance: np.ndarray | None = None,
    *,
    nstep: int = 20,
    rmin: float = -1.0,
    rdelta: float = 0.1,
) -> QuantizedBlocks:
    """Quantize ``w`` (``[rows, n_blocks, block_size]``) block by block with the k-quant search.

    The defaults (``nstep=20, rmin=-1, rdelta=0.1``) are llama.cpp's for Q4_K without an
    imatrix (``make_qkx2_quants``; Q5_K uses ``15, -0.5, 0.1``, the imatrix path's
    ``make_qkx3_quants`` uses ``36, -0.9, 0.05``). Candidate ``c`` rounds with the inverse
    scale ``(nmax + rmin + rdelta * c) / (max - min)`` (symmetric: ``-(2**(bits-1) + rmin +
    rdelta * c) / m``, ``m`` the block's value of largest magnitude, as in llama.cpp's
    ``make_qx_quants``, whose own sweep is ``is = -9..9`` in steps of 0.1). ``nstep < 1``
    skips the sweep.
    ``importance`` is per input channel, ``[n_blocks * block_size]``. ``w`` is not modified.
    """
    if w.ndim != 3:
        raise ValueError(f"w must be [rows, n_blocks, block_size], got shape {w.shape}")
    if not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"w must be a float array, got {w.dtype}")
    rows, n_blocks, block_size = w.shape
    if not 2 <= spec.bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {spec.bits}")
    if spec.block_size != block_size:
        raise ValueError(f"spec.block_size={spec.block_size} but w has blocks of {block_size}")
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")
    if nstep < 0:
        raise ValueError(f"nstep must be >= 0, got {nstep}")
    imp = _check_importance(importance, n_blocks, block_size)

    q = np.empty((rows, n_blocks, block_size), dtype=np.uint8)
    scales = np.empty((rows, n_blocks), dtype=np.float32)
    zps = np.empty((rows, n_blocks), dtype=np.float32 if spec.float_zero_points else np.uint8)
    zero_points = None if spec.symmetric else zps
    if rows == 0 or n_blocks == 0:
        return QuantizedBlocks(q=q, scales=scales, zero_points=zero_points)

    # Candidate multipliers of the normalized block; all blocks share them.
    nmax = 2 ** (spec.bits - 1) if spec.symmetric else 2**spec.bits - 1
    mults = [nmax + rmin + rdelta * c for c in range(nstep + 1)] if nstep >= 1 else []
    mults = [a for a in mults if a > 0]

    # float32 sums leave ~1e-6 relative noise in the closed-form errors: nothing next to a
    # 4-bit error, but at 8 bits as large as the differences between candidates.
    work = np.float32 if spec.bits < _F64_FROM_BITS else np.float64
    rows_per_chunk = max(1, _CHUNK_ELEMS // (n_blocks * block_size))
    # Importance laid out like a chunk: column r * n_blocks + b holds block b's channels.
    imp_tiled = None if imp is None else np.tile(imp.T, (1, rows_per_chunk)).astype(work)

    def run(r0: int) -> None:
        r1 = min(rows, r0 + rows_per_chunk)
        # The transposed copy is the only thing written; ``w`` stays untouched.
        x = np.ascontiguousarray(w[r0:r1].reshape(-1, block_size).T, dtype=work)
        if not np.isfinite(x).all():
            raise ValueError(f"w has non-finite values in rows {r0}..{r1 - 1}")
        wt = _weights(x, None if imp_tiled is None else imp_tiled[:, : x.shape[1]])
        if spec.symmetric:
            codes, s = _solve_symmetric(x, wt, nmax, mults)
        elif spec.float_zero_points:
            codes, s, zp = _solve_float_min(x, wt, nmax, mults)
            zps[r0:r1] = zp.reshape(r1 - r0, n_blocks)
        else:
            codes, s, zp = _solve_int_zero(x, wt, nmax, mults)
            zps[r0:r1] = zp.reshape(r1 - r0, n_blocks)
        scales[r0:r1] = s.reshape(r1 - r0, n_blocks)
        # Narrow to uint8 while contiguous, then transpose the 1-byte codes.
        q[r0:r1] = codes.astype(np.uint8).T.reshape(r1 - r0, n_blocks, block_size)

    starts = range(0, rows, rows_per_chunk)
    workers = min(len(starts), os.cpu_count() or 1)
    if workers <= 1:
        for r0 in starts:
            run(r0)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for fut in [pool.submit(run, r0) for r0 in starts]:
                fut.result()
    return QuantizedBlocks(q=q, scales=scales, zero_points=zero_points)


def _check_importance(
    importance: np.ndarray | None, n_blocks: int, block_size: int
) -> np.ndarray | None:
    if importance is None:
        return None
    imp = np.asarray(importance, dtype=np.float64)
    if imp.shape != (n_blocks * block_size,):
        raise ValueError(
            f"importance must be [{n_blocks * block_size}] (one per input channel), "
            f"got shape {imp.shape}"
        )
    if not np.isfinite(imp).all() or (imp < 0).any():
        raise ValueError("importance must be finite and non-negative")
    return imp.reshape(n_blocks, block_size)


def _weights(x: np.ndarray, imp: np.ndarray | None) -> np.ndarray:
    """Per-element error weights for blocks laid out ``[block_size, n]``."""
    x2 = np.square(x)
    if imp is None:
        # llama.cpp Q4_K: large weights matter more, the block's rms keeps small ones in play.
        return np.abs(x) + np.sqrt(x2.mean(axis=0))
    x2 += 2.0 * x2.mean(axis=0)  # sigma2: an importance-scaled floor for small weights
    np.sqrt(x2, out=x2)
    x2 *= imp
    return x2


def _inv(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``1 / a`` where ``a != 0``, else 0 (a zero scale maps every element to level 0)."""
    nz = a != 0
    return np.where(nz, 1.0 / np.where(nz, a, 1.0), 0.0).astype(dtype)


def _levels(
    y: np.ndarray,
    mult: float,
    lo: float | np.ndarray | None,
    hi: float | np.ndarray | None,
    out: np.ndarray,
) -> np.ndarray:
    """``clip(rint(y * mult), lo, hi)`` into ``out``; ``None`` skips a clip the data can't hit."""
    np.multiply(y, mult, out=out)
    np.rint(out, out=out)
    if lo is not None:
        np.maximum(out, lo, out=out)
    if hi is not None:
        np.minimum(out, hi, out=out)
    return out


def _wsum(*arrays: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Per-block (column) sum of the elementwise product of ``[block_size, n]`` arrays."""
    return np.einsum(",".join(["sn"] * len(arrays)) + "->n", *arrays, out=out)


def _pick(score: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block, the usable candidate (row) with the highest score, and whether there was one."""
    score = np.where(ok, score, -np.inf)
    # argmax along a contiguous axis: far faster than down the strided candidate axis.
    best = np.ascontiguousarray(score.T).argmax(axis=1)
    return best, ok.any(axis=0)


def _fit_scale_min(
    sw: np.ndarray,
    swx: np.ndarray,
    sl: np.ndarray,
    sl2: np.ndarray,
    sxl: np.ndarray,
    nmax: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Weighted least squares for ``x ~ scale * l + min``, per block, keeping 0 on the grid.

    Takes ``sum(w)``, ``sum(w*x)`` and, per candidate, ``sum(w*l)``, ``sum(w*l*l)``,
    ``sum(w*x*l)``. ``-scale * nmax <= min <= 0`` keeps the zero point ``-min / scale`` in
    ``[0, nmax]``. Returns ``scale, min``, the gain (``sum(w*x*x)`` less the weighted error)
    and whether the fit is usable (non-singular, positive scale).
    """
    swl2 = sw * sl2
    det = swl2 - sl * sl
    ok = det > _REL_DET_EPS * swl2
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_det = np.where(ok, 1.0 / det, 0.0)
        scale = (sw * sxl - swx * sl) * inv_det
        mn = (sl2 * swx - sl * sxl) * inv_det
        # A free optimum with 0 off the grid is replaced by the best with 0 on its end
        # level: min = 0 (llama.cpp's clamp), or the top level at 0, min = -scale * nmax.
        # Both are rare, so only those entries are recomputed.
        low = mn > 0
        if low.any():
            scale[low] = sxl[low] / sl2[low]
            mn[low] = 0.0
        high = mn + scale * nmax < 0
        if high.any():
            den = (sl2 - 2.0 * nmax * sl + nmax * nmax * sw)[high]  # sum(w (l - nmax)^2)
            scale[high] = (sxl - nmax * swx)[high] / den
            mn[high] = -nmax * scale[high]
    # At a least-squares optimum the residual is orthogonal to the fit, so
    # error = sum(w x^2) - scale * sum(w x l) - min * sum(w x), constrained or not.
    gain = scale * sxl + mn * swx
    ok &= (scale > 0) & np.isfinite(gain)
    return scale, mn, gain, ok


def _solve_float_min(
    x: np.ndarray, w: np.ndarray, nmax: int, mults: list[float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants over every column of ``x`` (``[block_size, n]``): codes, scale, zp."""
    dt, n = x.dtype, x.shape[1]
    cols = np.arange(n)
    # llama.cpp clamps min <= 0 so 0 is representable; max >= 0 as well keeps an all-negative
    # block's zero point -min/scale near [0, nmax] rather than unbounded (fp16 storage).
    xmin = np.minimum(x.min(axis=0), 0.0)
    rng = np.maximum(x.max(axis=0), 0.0) - xmin
    # An all-zero block has rng == 0: scale 0, every code and the zero point 0.
    y = (x - xmin) * _inv(rng, dt)  # every block normalized to [0, 1]
    wx = w * x
    sw = w.sum(axis=0)
    swx = wx.sum(axis=0)
    lv = np.empty_like(x)

    def sums(lv: np.ndarray, out: np.ndarray) -> np.ndarray:
        _wsum(w, lv, out=out[0])
        _wsum(w, lv, lv, out=out[1])
        _wsum(wx, lv, out=out[2])
        return out

    # The plain min/max grid: llama.cpp's starting point, kept where no candidate fits.
    best_s = rng / nmax
    best_m = xmin.copy()
    if mults:
        # Only the O(block_size) work runs per candidate; the 2x2 algebra runs once on all.
        acc = np.empty((len(mults), 3, n), dtype=dt)
        for c, mult in enumerate(mults):
            # y * mult >= 0 and y <= 1 (to float round-off): only multipliers near or past
            # nmax + 0.5 can round above nmax.
            sums(_levels(y, mult, None, nmax if mult > nmax + 0.45 else None, lv), acc[c])
        scale, mn, gain, ok = _fit_scale_min(sw, swx, *acc.transpose(1, 0, 2), nmax)
        k, found = _pick(gain, ok)
        best_s = np.where(found, scale[k, cols], best_s)
        best_m = np.where(found, mn[k, cols], best_m)

    # Polish: round every element to its nearest level on the chosen grid, then re-fit the
    # pair for those codes. Neither step can raise the weighted error.
    def round_to() -> np.ndarray:
        return _levels((x - best_m.astype(dt)) * _inv(best_s, dt), 1.0, 0.0, nmax, lv)

    one = np.empty((3, n), dtype=dt)
    for _ in range(_POLISH_ITERS):
        scale, mn, _, ok = _fit_scale_min(sw, swx, *sums(round_to(), one), nmax)
        best_s[ok] = scale[ok]
        best_m[ok] = mn[ok]
    round_to()
    # The fit already keeps it in [0, nmax]; the clip only absorbs float round-off.
    zp = np.clip(-best_m * _inv(best_s, dt), 0.0, nmax)
    return lv, best_s, zp


def _fit_scale(den: np.ndarray, num: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x ~ s * d``: ``s = sum(w x d) / sum(w d d)``; the error is ``sum(w x x) - s * num``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        s = num / np.where(den > 0, den, 1.0)
    return s, s * num, (den > 0) & (s != 0) & np.isfinite(s)


def _solve_int_zero(
    x: np.ndarray, w: np.ndarray, nmax: int, mults: list[float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sweep with each candidate's zero point rounded to an integer; the scale is fitted.

    Works with ``d = code - zero_point`` so the sums need no cancelling correction terms.
    """
    dt, n = x.dtype, x.shape[1]
    cols = np.arange(n)
    # An integer zero point must land in [0, nmax], so the range covers 0 from both sides.
    xmin = np.minimum(x.min(axis=0), 0.0)
    rng = np.maximum(x.max(axis=0), 0.0) - xmin
    flat = ~(rng > 0)
    y = x * _inv(rng, dt)  # a candidate's codes are rint(y * mult) + its zero point
    wx = w * x
    d = np.empty_like(x)

    def sums(d: np.ndarray, out: np.ndarray) -> np.ndarray:
        _wsum(w, d, d, out=out[0])
        _wsum(wx, d, out=out[1])
        return out

    def levels(y: np.ndarray, mult: float, zp: np.ndarray) -> np.ndarray:
        return _levels(y, mult, (-zp).astype(dt), (nmax - zp).astype(dt), d)

    frac = -xmin * _inv(rng, dt)  # where 0 sits in the block's range
    best_s = rng / nmax
    best_z = np.clip(np.rint(frac * nmax), 0, nmax)
    if mults:
        zps = np.clip(np.rint(frac * np.asarray(mults)[:, None]), 0, nmax)
        acc = np.empty((len(mults), 2, n), dtype=dt)
        for c, mult in enumerate(mults):
            sums(levels(y, mult, zps[c]), acc[c])
        s, gain, ok = _fit_scale(*acc.transpose(1, 0, 2))
        ok &= s > 0
        k, found = _pick(gain, ok)
        best_s = np.where(found, s[k, cols], best_s)
        best_z = np.where(found, zps[k, cols], best_z)

    # Polish with the zero point fixed: re-round, re-fit the scale.
    def round_to() -> np.ndarray:
        return levels(x * _inv(best_s, dt), 1.0, best_z)

    one = np.empty((2, n), dtype=dt)
    for _ in range(_POLISH_ITERS):
        s, _, ok = _fit_scale(*sums(round_to(), one))
        ok &= (s > 0) & ~flat
        best_s[ok] = s[ok]
    codes = round_to()
    codes += best_z.astype(dt)

    # A flat block is all zero here (its range includes 0).
    best_s[flat] = 0.0
    best_z[flat] = 0.0
    codes[:, flat] = 0.0
    return codes, best_s, best_z


def _solve_symmetric(
    x: np.ndarray, w: np.ndarray, half: int, mults: list[float]
) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants-style: levels ``[-half, half)`` around the implied zero point ``half``."""
    dt, n = x.dtype, x.shape[1]
    cols = np.arange(n)
    vmax = x[np.abs(x).argmax(axis=0), cols]  # the signed value of largest magnitude
    flat = vmax == 0
    # The extreme element sits at +1, so -mult sends it to the extra level at -half.
    y = x * _inv(vmax, dt)
    wx = w * x
    lv = np.empty_like(x)

    def sums(lv: np.ndarray, out: np.ndarray) -> np.ndarray:
        _wsum(w, lv, lv, out=out[0])
        _wsum(wx, lv, out=out[1])
        return out

    best_s = -vmax / half
    if mults:
        acc = np.empty((len(mults), 2, n), dtype=dt)
        for c, mult in enumerate(mults):
            sums(_levels(y, -mult, -half, half - 1, lv), acc[c])
        s, gain, ok = _fit_scale(*acc.transpose(1, 0, 2))
        k, found = _pick(gain, ok)
        best_s = np.where(found, s[k, cols], best_s)

    def round_to() -> np.ndarray:
        return _levels(x * _inv(best_s, dt), 1.0, -half, half - 1, lv)

    one = np.empty((2, n), dtype=dt)
    for _ in range(_POLISH_ITERS):
        s, _, ok = _fit_scale(*sums(round_to(), one))
        ok &= ~flat
        best_s[ok] = s[ok]
    codes = round_to()
    best_s[flat] = 0.0
    codes[:, flat] = 0.0
    codes += half
    return codes, best_s
