"""Half-Quadratic Quantization (HQQ, Badri & Shaji 2023) as a bitpress block solver.

HQQ needs no calibration data. Per block it minimises ``||W - dequant(quant(W))||_p^p`` with
``p < 1`` (robust to the few large errors) by half-quadratic splitting: an auxiliary error
``W_e`` is updated by generalised soft-thresholding, then the zero point (and optionally the
scale) in closed form, with the penalty ``beta`` growing by ``kappa`` every iteration.

Conventions match :mod:`bitpress.quant.solver`: ``w ~= (q - z) * s``, ``q`` in ``[0, 2**bits)``.
Internally the loop works in quantised units with the inverse scale ``a = 1/s``:
``u = w*a + z``, ``q = clip(rint(u))``, error ``x = (u - q) / a``.

Everything is float32 numpy, vectorised over blocks and processed in chunks of at most
``chunk_elems`` weights, so memory stays bounded whatever the matrix size.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from bitpress.quant.solver import BlockSpec, QuantizedBlocks

__all__ = ["bits_per_weight", "hqq_solver"]

_F32 = np.float32
# Floor for a block's scale: keeps 1/s finite for all-zero or subnormal blocks.
_MIN_SCALE = _F32(1e-30)
# Relative floor on importance so that no block's weights sum to zero.
_MIN_IMPORTANCE = 1e-6


def bits_per_weight(spec: BlockSpec, scale_bytes: int = 2) -> float:
    """Storage cost per weight: ``bits`` for q plus the per-block scale and zero point.

    Integer zero points are packed at ``bits`` bits each (as MatMulNBits stores them); float
    zero points take the scale's type; symmetric blocks store none.
    """
    if spec.symmetric:
        zp_bits = 0
    elif spec.float_zero_points:
        zp_bits = 8 * scale_bytes
    else:
        zp_bits = spec.bits
    return spec.bits + (8 * scale_bytes + zp_bits) / spec.block_size


@dataclass(frozen=True)
class _Config:
    bits: int
    mode: str  # "float": free float z; "int": z rounded to [0, qmax]; "sym": z fixed mid-range
    iters: int
    lp_norm: float
    beta: float
    kappa: float
    early_stop: bool
    optimize_scale: bool
    refit_iters: int

    @property
    def qmax(self) -> np.float32:
        return _F32(2**self.bits - 1)


def hqq_solver(
    w: np.ndarray,
    spec: BlockSpec,
    importance: np.ndarray | None = None,
    *,
    iters: int = 20,
    lp_norm: float = 0.7,
    beta: float = 10.0,
    kappa: float = 1.01,
    early_stop: bool = True,
    optimize_scale: bool = False,
    refit_iters: int = 4,
    chunk_elems: int = 1 << 18,
    workers: int | None = None,
) -> QuantizedBlocks:
    """Quantise ``w`` (``[rows, n_blocks, block_size]``) per block with HQQ.

    ``iters``, ``lp_norm``, ``beta``, ``kappa`` and ``early_stop`` are the HQQ package
    defaults. Early stopping is per block: a block keeps its best parameters (by mean
    ``|W - W_r|``, the package's criterion) and freezes at its first non-improving step.
    ``optimize_scale`` also updates the scale in closed form inside the HQQ loop.

    ``refit_iters`` alternating least-squares steps (re-round q, then the L2-optimal scale
    and zero point for that q) follow the HQQ loop; with integer zero points they run after
    rounding z, re-fitting the scale so the rounding does not throw the gain away. Each step
    can only lower the (importance-weighted) squared error. 0 gives plain HQQ.

    ``spec.symmetric`` uses a symmetric variant: the zero point is fixed at ``2**(bits-1)``
    and the HQQ loop updates the scale instead (the closed-form scale step).

    ``importance`` (``[n_blocks * block_size]``, >= 0) weights every mean and fit by input
    channel. ``workers`` threads process chunks in parallel (numpy releases the GIL); the
    result does not depend on ``workers`` or ``chunk_elems``.
    """
    w = np.asarray(w)
    if w.ndim != 3:
        raise ValueError(
            f"hqq_solver expects w of shape [rows, n_blocks, block_size], got {w.shape}"
        )
    rows, n_blocks, block = w.shape
    if block != spec.block_size:
        raise ValueError(f"w's last axis is {block}, spec.block_size is {spec.block_size}")
    if not 2 <= spec.bits <= 8:
        raise ValueError(f"hqq_solver supports 2..8 bits, got {spec.bits}")
    if not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"hqq_solver expects floating-point weights, got {w.dtype}")
    if not 0.0 < lp_norm <= 1.0:
        raise ValueError(f"lp_norm must be in (0, 1], got {lp_norm}")
    if beta <= 0.0 or kappa < 1.0 or iters < 0 or refit_iters < 0:
        raise ValueError("need beta > 0, kappa >= 1, iters >= 0 and refit_iters >= 0")

    mode = "sym" if spec.symmetric else ("float" if spec.float_zero_points else "int")
    cfg = _Config(
        spec.bits, mode, iters, lp_norm, beta, kappa, early_stop, optimize_scale, refit_iters
    )
    h = _block_importance(importance, n_blocks, block)

    n = rows * n_blocks
    w2 = w.reshape(n, block)  # a view when w is C-contiguous
    q = np.empty((n, block), dtype=np.uint8)
    scales = np.empty(n, dtype=_F32)
    zeros = np.empty(n, dtype=_F32)

    per_chunk = max(1, chunk_elems // block)
    starts = range(0, n, per_chunk)

    def run(j0: int) -> None:
        j1 = min(j0 + per_chunk, n)
        wc = np.asarray(w2[j0:j1], dtype=_F32)  # no copy for float32 input; never written
        hc = None if h is None else h[np.arange(j0, j1) % n_blocks]
        q[j0:j1], scales[j0:j1], zeros[j0:j1] = _solve_chunk(wc, hc, cfg)

    if workers is None:
        workers = min(os.cpu_count() or 1, 8)
    if workers > 1 and len(starts) > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(starts))) as pool:
            list(pool.map(run, starts))  # list() re-raises worker exceptions
    else:
        for j0 in starts:
            run(j0)

    q = q.reshape(rows, n_blocks, block)
    scales = scales.reshape(rows, n_blocks)
    if mode == "sym":
        zp = None
    elif mode == "int":
        zp = zeros.reshape(rows, n_blocks).astype(np.uint8)
    else:
        zp = zeros.reshape(rows, n_blocks)
    return QuantizedBlocks(q=q, scales=scales, zero_points=zp)


def _block_importance(
    importance: np.ndarray | None, n_blocks: int, block: int
) -> np.ndarray | None:
    """``[n_blocks, block]`` float32 weights scaled to max 1, or None for uniform."""
    if importance is None:
        return None
    h = np.asarray(importance, dtype=_F32).reshape(-1)
    if h.size != n_blocks * block:
        raise ValueError(f"importance has {h.size} values, expected {n_blocks * block}")
    if not np.isfinite(h).all() or (h < 0).any():
        raise ValueError("importance must be finite and non-negative")
    top = h.max()
    if top <= 0:
        return None
    # The floor keeps every weight slightly in play and every block's weight sum positive.
    return (h / top + _F32(_MIN_IMPORTANCE)).reshape(n_blocks, block)


def _mean(x: np.ndarray, h: np.ndarray | None, hsum: np.ndarray | None) -> np.ndarray:
    """Per-block (weighted) mean over the last axis."""
    if h is None:
        return x.mean(axis=1)
    return np.einsum("ij,ij->i", x, h) / hsum


def _quantize(wa: np.ndarray, z: np.ndarray, qmax: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """``q = clip(rint(wa + z), 0, qmax)`` and the error ``u - q`` in quantised units."""
    u = wa + z[:, None]
    q = np.rint(u)
    np.clip(q, 0, qmax, out=q)
    u -= q
    return q, u


def _solve_chunk(
    w: np.ndarray, h: np.ndarray | None, cfg: _Config
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """HQQ on ``n`` blocks ``w [n, B]``; returns uint8 q, scales and (float) zero points."""
    qmax = cfg.qmax
    hsum = None if h is None else h.sum(axis=1)
    wmin = w.min(axis=1)
    wmax = w.max(axis=1)
    if not (np.isfinite(wmin).all() and np.isfinite(wmax).all()):
        raise ValueError("hqq_solver: weights contain NaN or infinity")

    if cfg.mode == "sym":
        z = np.full(w.shape[0], 2 ** (cfg.bits - 1), dtype=_F32)
        # Smallest scale whose grid [-z*s, (qmax - z)*s] still covers [wmin, wmax].
        s = np.maximum(wmax / (qmax - z), -wmin / z)
    else:
        # Min/max init; a constant block gets any scale and reproduces exactly via z.
        span = wmax - wmin
        s = np.where(span > 0, span, np.abs(wmin)) / qmax
    s = np.maximum(s, _MIN_SCALE).astype(_F32)
    if cfg.mode != "sym":
        z = (-wmin / s).astype(_F32)

    if cfg.iters > 0:
        s, z = _hqq_loop(w, h, hsum, s, z, cfg)

    if cfg.mode == "int":
        z = np.clip(np.rint(z), 0, qmax)
    if cfg.mode == "float":
        for _ in range(cfg.refit_iters):
            s, z = _refit_scale_zero(w, h, hsum, s, z, qmax)
    else:
        for _ in range(cfg.refit_iters):
            s = _refit_scale(w, h, hsum, s, z, qmax)

    q, _ = _quantize(w / s[:, None], z, qmax)
    return q.astype(np.uint8), s, z


def _hqq_loop(
    w: np.ndarray,
    h: np.ndarray | None,
    hsum: np.ndarray | None,
    s: np.ndarray,
    z: np.ndarray,
    cfg: _Config,
) -> tuple[np.ndarray, np.ndarray]:
    """The proximal iterations; returns each block's best ``(s, z)`` by mean ``|W - W_r|``."""
    qmax = cfg.qmax
    p = cfg.lp_norm
    update_scale = cfg.optimize_scale or cfg.mode == "sym"
    n = w.shape[0]
    best_err = np.full(n, np.inf, dtype=_F32)
    best_s = s.copy()
    best_z = z.copy()

    # Working set: blocks still improving. Frozen ones are dropped lazily (when they are a
    # quarter of the set) because gathering every step costs more than carrying them.
    idx = np.arange(n)
    live = np.ones(n, dtype=bool)
    wk, hk, hsk = w, h, hsum
    a = (1 / s).astype(_F32)
    wa = wk * a[:, None]
    beta = cfg.beta
    for it in range(cfg.iters + 1):
        q, xa = _quantize(wa, z, qmax)
        ax = np.abs(xa)
        err = _mean(ax, hk, hsk) / a
        better = live & (err < best_err[idx])
        sel = idx[better]
        best_err[sel] = err[better]
        best_s[sel] = 1 / a[better]
        best_z[sel] = z[better]
        if it == cfg.iters:
            break
        if cfg.early_stop:
            live = better
            n_live = int(live.sum())
            if n_live == 0:
                break
            if n_live <= 0.75 * live.size:
                idx, a, z, q, xa, ax = idx[live], a[live], z[live], q[live], xa[live], ax[live]
                wk = wk[live]
                wa = wa[live]
                if hk is not None:
                    hk, hsk = hk[live], hsk[live]
                live = np.ones(n_live, dtype=bool)

        # g = x - shrink_p(x) = sign(x) * min(|x|, |x|^(p-1) / beta): the part of the error
        # the zero point should absorb; big errors are capped, so outliers barely pull it.
        # In quantised units (x = xa / a) the cap is c * |xa|^(p-1) with c = a^(2-p) / beta.
        c = a ** _F32(2 - p) / _F32(beta)
        if p == 1.0:
            cap = np.broadcast_to(c[:, None], ax.shape)
        else:
            # Only errors above c^(1/(2-p)) are capped: skip the power when there are none.
            thr = c ** _F32(1 / (2 - p))
            if (ax > thr[:, None]).any():
                cap = np.power(ax, _F32(p - 1))
                cap *= c[:, None]
            else:
                cap = None
        g = xa if cap is None else np.copysign(np.minimum(ax, cap), xa)

        if not update_scale:
            # z <- mean(q - (w - e) * a) = z - mean(g)
            z = z - _mean(g, hk, hsk)
        else:
            a, z = _scale_step(q, g, a, z, hk, hsk, cfg.mode == "sym")
            wa = wk * a[:, None]
        beta *= cfg.kappa
    return best_s, best_z


def _scale_step(
    q: np.ndarray,
    g: np.ndarray,
    a: np.ndarray,
    z: np.ndarray,
    h: np.ndarray | None,
    hsum: np.ndarray | None,
    fixed_zero: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Closed-form scale (and zero) fit of the target ``t = w - e = (q - z + g) / a`` on q."""
    if fixed_zero:
        d = q - z[:, None]
        num = _mean(g * d, h, hsum)
        den = _mean(d * d, h, hsum)
        ok = den > 0
        ratio = np.where(ok, num / np.where(ok, den, 1), 0)
        # s_new = sum(t d) / sum(d^2) = (1 + sum(g d) / sum(d^2)) / a
        s_new = (1 + ratio) / a
        return _inverse_scale(s_new, a), z
    qm = _mean(q, h, hsum)
    qc = q - qm[:, None]
    var = _mean(qc * qc, h, hsum)
    cov = _mean(qc * g, h, hsum)
    ok = var > 0
    # Regressing t on q: slope (1 + cov(q, g)/var(q)) / a, intercept mean(t) - slope*mean(q).
    s_new = (1 + np.where(ok, cov / np.where(ok, var, 1), 0)) / a
    t_mean = (qm - z + _mean(g, h, hsum)) / a
    a_new = _inverse_scale(s_new, a)
    z_new = qm - t_mean * a_new
    return a_new, np.where(ok, z_new, z - _mean(g, h, hsum)).astype(_F32)


def _inverse_scale(s_new: np.ndarray, a_old: np.ndarray) -> np.ndarray:
    """``1 / s_new``, keeping the old inverse scale where the fit is degenerate."""
    good = np.isfinite(s_new) & (s_new >= _MIN_SCALE)
    return np.where(good, 1 / np.where(good, s_new, 1), a_old).astype(_F32)


def _refit_scale_zero(
    w: np.ndarray,
    h: np.ndarray | None,
    hsum: np.ndarray | None,
    s: np.ndarray,
    z: np.ndarray,
    qmax: np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    """One L2 step: re-round q, then least-squares ``w ~= s*q + m`` per block."""
    q, _ = _quantize(w / s[:, None], z, qmax)
    qm = _mean(q, h, hsum)
    wm = _mean(w, h, hsum)
    qc = q - qm[:, None]
    var = _mean(qc * qc, h, hsum)
    cov = _mean(qc * w, h, hsum)
    ok = (var > 0) & (cov > 0)
    s_new = np.where(ok, cov / np.where(ok, var, 1), s)
    s_new = np.maximum(s_new, _MIN_SCALE).astype(_F32)
    # m = wm - s*qm and z = -m/s
    z_new = np.where(ok, qm - wm / s_new, z).astype(_F32)
    return s_new, z_new


def _refit_scale(
    w: np.ndarray,
    h: np.ndarray | None,
    hsum: np.ndarray | None,
    s: np.ndarray,
    z: np.ndarray,
    qmax: np.float32,
) -> np.ndarray:
    """One L2 step with z fixed: re-round q, then ``s = sum(w d) / sum(d^2)``, ``d = q - z``."""
    q, _ = _quantize(w / s[:, None], z, qmax)
    d = q - z[:, None]
    num = _mean(w * d, h, hsum)
    den = _mean(d * d, h, hsum)
    ok = (den > 0) & (num > 0)
    s_new = np.where(ok, num / np.where(ok, den, 1), s)
    return np.maximum(s_new, _MIN_SCALE).astype(_F32)
