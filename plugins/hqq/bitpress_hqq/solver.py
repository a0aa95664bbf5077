"""Half-Quadratic Quantization (HQQ, Badri & Shaji 2023) as a bitpress block solver.

HQQ needs no calibration data. Per block it minimises ``||W - dequant(quant(W))||_p^p`` with
``p < 1`` (robust to the few large errors) by half-quadratic splitting: an auxiliary error
``W_e`` is updated by generalised soft-thresholding, then the zero point (and optionally the
scale) in closed form, with the penalty ``beta`` growing by ``kappa`` every iteration.

Conventions match :mod:`bitpress.quant.solver`: ``w ~= (q - z) * s``, ``q`` in ``[0, 2**bits)``.
Internally the loop works in quantised units with the inverse scale ``a = 1/s``:
``u = w*a + z``, ``q = clip(rint(u))``, error ``x = (u - q) / a``.

The CPU path is float32 numpy, vectorised over blocks and run in chunks of at most
``chunk_elems`` weights (on a few threads), so memory stays bounded whatever the matrix size.
The same code runs on torch tensors when a CUDA device is available (torch is imported lazily
and never required).
"""

from __future__ import annotations

import functools
import glob
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from bitpress.plugin import BlockSpec, QuantizedBlocks

__all__ = ["bits_per_weight", "hqq_solver"]

_F32 = np.float32
# Floor for a block's scale: keeps 1/s finite (< float32 max) for all-zero or subnormal blocks.
_MIN_SCALE = 1e-36
# Relative floor on importance so that no block's weights sum to zero.
_MIN_IMPORTANCE = 1e-6
# Torch chunks are larger: a GPU wants big kernels and has the memory for them.
_TORCH_CHUNK_ELEMS = 1 << 24

Array = Any  # np.ndarray, or torch.Tensor on the torch path


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
    mode: str  # "float": free float z; "int": z rounded into [0, qmax]; "sym": z fixed mid-range
    iters: int
    lp_norm: float
    beta: float
    kappa: float
    early_stop: bool
    optimize_scale: bool
    refit_iters: int

    @property
    def qmax(self) -> float:
        return float(2**self.bits - 1)


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
    chunk_elems: int = 1 << 17,
    workers: int | None = None,
    device: str = "auto",
) -> QuantizedBlocks:
    """Quantise ``w`` (``[rows, n_blocks, block_size]``) per block with HQQ.

    ``iters``, ``lp_norm``, ``beta``, ``kappa`` and ``early_stop`` are the HQQ package
    defaults. Early stopping is per block: a block keeps its best parameters (by mean
    ``|W - W_r|``, the package's criterion) and freezes at its first non-improving step.
    ``optimize_scale`` also updates the scale in closed form inside the HQQ loop.

    ``refit_iters`` alternating least-squares steps (re-round q, then the L2-optimal scale
    and zero point for that q) follow the HQQ loop. With integer zero points they run after
    rounding z (floor or ceil, whichever fits better), re-fitting the scale so the rounding
    does not throw the gain away. Each step can only lower the (importance-weighted) squared
    error. ``refit_iters=0`` is plain HQQ (z then simply rounded when integer).

    ``spec.symmetric`` uses a symmetric variant: the zero point is fixed at ``2**(bits-1)``
    and the HQQ loop updates the scale instead of the zero point, in closed form.

    ``importance`` (``[n_blocks * block_size]``, >= 0) weights every mean and fit by input
    channel. ``workers`` threads process chunks in parallel (numpy releases the GIL); the
    result does not depend on ``workers`` or ``chunk_elems``.

    ``device``: ``"auto"`` uses torch on CUDA when both are available, else numpy;
    ``"numpy"`` forces numpy; any other string is a torch device (``"cuda:1"``, ``"cpu"``).
    """
    w = np.asarray(w)
    if w.ndim != 3:
        raise ValueError(f"hqq_solver expects w as [rows, n_blocks, block_size], got {w.shape}")
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
    xp = _select_backend(device)

    n = rows * n_blocks
    w2 = w.reshape(n, block)  # a view when w is C-contiguous
    q = np.empty((n, block), dtype=np.uint8)
    scales = np.empty(n, dtype=_F32)
    zeros = np.empty(n, dtype=_F32)

    if xp is _NUMPY:
        per_chunk = max(1, chunk_elems // block)
    else:
        per_chunk = max(1, max(chunk_elems, _TORCH_CHUNK_ELEMS) // block)
        workers = 1  # one device queue; threads would only contend for it
    starts = range(0, n, per_chunk)

    def run(j0: int) -> None:
        j1 = min(j0 + per_chunk, n)
        wc = xp.asarray(w2[j0:j1])  # float32; never written to (w must stay untouched)
        hc = None if h is None else xp.asarray(h[np.arange(j0, j1) % n_blocks])
        # Blocks of tiny weights can overflow a ** (2 - p) to inf, which is handled (no cap)
        with np.errstate(over="ignore"):
            qc, sc, zc = _solve_chunk(xp, wc, hc, cfg)
        q[j0:j1], scales[j0:j1], zeros[j0:j1] = xp.to_numpy(qc), xp.to_numpy(sc), xp.to_numpy(zc)

    if workers is None:
        workers = min(os.cpu_count() or 1, 8)
    if workers > 1 and len(starts) > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(starts))) as pool:
            list(pool.map(run, starts))  # list() re-raises a worker's exception
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


# ---------------------------------------------------------------------------------------------
# Backends: the few operations where numpy and torch spell things differently. Operators,
# indexing, abs() and ** are shared, so the algorithm below is written once.


class _NumpyOps:
    asarray = staticmethod(lambda x: np.asarray(x, dtype=_F32))
    to_numpy = staticmethod(np.asarray)
    rint = staticmethod(np.rint)
    rint_ = staticmethod(lambda x: np.rint(x, out=x))
    copysign = staticmethod(np.copysign)
    minimum = staticmethod(np.minimum)
    maximum = staticmethod(np.maximum)
    floor = staticmethod(np.floor)
    where = staticmethod(np.where)
    isfinite = staticmethod(np.isfinite)
    row_min = staticmethod(lambda x: x.min(axis=1))
    row_max = staticmethod(lambda x: x.max(axis=1))
    # einsum's row reductions are several times faster than .sum(axis=1) on short rows
    row_sum = staticmethod(lambda x: np.einsum("ij->i", x))
    row_dot = staticmethod(lambda x, y: np.einsum("ij,ij->i", x, y))
    clip_ = staticmethod(lambda x, lo, hi: np.clip(x, lo, hi, out=x))
    clamp_min = staticmethod(lambda x, lo: np.maximum(x, _F32(lo)))
    copy = staticmethod(np.copy)
    arange = staticmethod(np.arange)
    full = staticmethod(lambda n, v: np.full(n, v, dtype=_F32))
    trues = staticmethod(lambda n: np.ones(n, dtype=bool))
    to_u8 = staticmethod(lambda x: x.astype(np.uint8))


class _TorchOps:
    def __init__(self, torch: Any, device: str) -> None:
        t = torch
        dev = t.device(device)
        # torch.tensor copies, so read-only numpy input is fine (as_tensor would warn)
        self.asarray = lambda x: t.tensor(np.asarray(x, dtype=_F32), device=dev)
        self.to_numpy = lambda x: x.cpu().numpy()
        self.rint = t.round  # round half to even, like np.rint
        self.rint_ = lambda x: x.round_()
        self.copysign = t.copysign
        self.minimum = t.minimum
        self.maximum = t.maximum
        self.floor = t.floor
        self.where = t.where
        self.isfinite = t.isfinite
        self.row_min = lambda x: x.amin(dim=1)
        self.row_max = lambda x: x.amax(dim=1)
        self.row_sum = lambda x: x.sum(dim=1)
        self.row_dot = lambda x, y: (x * y).sum(dim=1)
        self.clip_ = lambda x, lo, hi: x.clamp_(lo, hi)
        self.clamp_min = lambda x, lo: x.clamp_min(lo)
        self.copy = lambda x: x.clone()
        self.arange = lambda n: t.arange(n, device=dev)
        self.full = lambda n, v: t.full((n,), float(v), dtype=t.float32, device=dev)
        self.trues = lambda n: t.ones(n, dtype=t.bool, device=dev)
        self.to_u8 = lambda x: x.to(t.uint8)


_NUMPY = _NumpyOps()


@functools.cache  # one import attempt and CUDA probe per device string
def _select_backend(device: str) -> Any:
    if device == "numpy":
        return _NUMPY
    if device == "auto":
        # importing torch costs seconds: only try when an NVIDIA device node exists
        if not glob.glob("/dev/nvidia[0-9]*"):
            return _NUMPY
        try:
            import torch  # optional; only for the GPU path
        except ImportError:
            return _NUMPY
        return _TorchOps(torch, "cuda") if torch.cuda.is_available() else _NUMPY
    try:
        import torch
    except ImportError as exc:
        raise ValueError(f"device={device!r} needs torch, which is not installed") from exc
    return _TorchOps(torch, device)


# ---------------------------------------------------------------------------------------------
# The algorithm, on one chunk of blocks ``w [n, B]``.


def _mean(xp: Any, x: Array, h: Array | None, hsum: Array | None) -> Array:
    """Per-block (importance-weighted) mean over the last axis."""
    return xp.row_sum(x) / x.shape[1] if h is None else xp.row_dot(x, h) / hsum


def _dot_mean(xp: Any, x: Array, y: Array, h: Array | None, hsum: Array | None) -> Array:
    """Per-block (importance-weighted) mean of ``x * y``."""
    return xp.row_dot(x, y) / x.shape[1] if h is None else xp.row_dot(x * y, h) / hsum


def _quantize(xp: Any, wa: Array, z: Array, qmax: float) -> tuple[Array, Array]:
    """``q = clip(rint(wa + z), 0, qmax)`` and the error ``wa + z - q`` in quantised units."""
    u = wa + z[:, None]
    q = xp.clip_(xp.rint(u), 0.0, qmax)
    u -= q
    return q, u


def _levels(xp: Any, w: Array, s: Array, z: Array, qmax: float) -> Array:
    """``q = clip(rint(w / s + z), 0, qmax)``."""
    u = w * (1 / s)[:, None]
    u += z[:, None]
    return xp.clip_(xp.rint_(u), 0.0, qmax)


def _sq_error(xp: Any, w: Array, h: Array | None, s: Array, z: Array, qmax: float) -> Array:
    """Per-block (weighted) sum of squared reconstruction errors."""
    _, xa = _quantize(xp, w * (1 / s)[:, None], z, qmax)
    x = xa * s[:, None]
    return xp.row_dot(x, x if h is None else x * h)


def _solve_chunk(xp: Any, w: Array, h: Array | None, cfg: _Config) -> tuple[Array, Array, Array]:
    """HQQ on ``n`` blocks; returns uint8 q, float32 scales and float32 zero points."""
    qmax = cfg.qmax
    hsum = None if h is None else h.sum(1)
    wmin = xp.row_min(w)
    wmax = xp.row_max(w)
    if not bool(xp.isfinite(wmin).all() & xp.isfinite(wmax).all()):
        raise ValueError("hqq_solver: weights contain NaN or infinity")

    flip = None
    if cfg.mode == "sym":
        # The grid (q - z) * s has one more level below zero than above. Like ONNX Runtime's
        # quantizer, give it to the side of the block's largest magnitude: negate blocks whose
        # peak is positive, solve with s > 0, and hand back a negative scale for them.
        flip = wmax > -wmin
        w = xp.where(flip[:, None], -w, w)
        wmin, wmax = xp.where(flip, -wmax, wmin), xp.where(flip, -wmin, wmax)
        z = xp.full(w.shape[0], 2 ** (cfg.bits - 1))
        # Smallest scale whose grid [-z*s, (qmax - z)*s] still covers [wmin, wmax].
        s = xp.clamp_min(xp.maximum(wmax / (qmax - z), -wmin / z), _MIN_SCALE)
    else:
        # Min/max init; a constant block gets any scale and is reproduced exactly through z.
        span = wmax - wmin
        s = xp.clamp_min(xp.where(span > 0, span, abs(wmin)) / qmax, _MIN_SCALE)
        z = -wmin / s

    if cfg.iters > 0:
        s, z = _hqq_loop(xp, w, h, hsum, s, z, cfg)

    steps = cfg.refit_iters
    if cfg.mode == "int":
        if steps > 0:
            s, z = _pick_integer_zero(xp, w, h, hsum, s, z, qmax)
            steps -= 1
        else:
            z = xp.clip_(xp.rint(z), 0.0, qmax)
    for _ in range(steps):
        if cfg.mode == "float":
            s, z = _refit_scale_zero(xp, w, h, hsum, s, z, qmax)
        else:
            s = _refit_scale(xp, w, h, hsum, s, z, qmax)

    q = xp.to_u8(_levels(xp, w, s, z, qmax))
    return q, s if flip is None else xp.where(flip, -s, s), z


def _hqq_loop(
    xp: Any,
    w: Array,
    h: Array | None,
    hsum: Array | None,
    s: Array,
    z: Array,
    cfg: _Config,
) -> tuple[Array, Array]:
    """The proximal iterations; returns each block's best ``(s, z)`` by mean ``|W - W_r|``."""
    qmax = cfg.qmax
    p = cfg.lp_norm
    update_scale = cfg.optimize_scale or cfg.mode == "sym"
    n = w.shape[0]
    best_err = xp.full(n, np.inf)
    best_s = xp.copy(s)
    best_z = xp.copy(z)

    # Working set: blocks still improving. Frozen ones are dropped lazily (once they are a
    # quarter of the set): gathering on every step would cost more than carrying them along.
    idx = xp.arange(n)
    live = xp.trues(n)
    wk, hk, hsk = w, h, hsum
    a = 1 / s
    wa = wk * a[:, None]
    beta = cfg.beta
    for it in range(cfg.iters + 1):
        q, xa = _quantize(xp, wa, z, qmax)
        ax = abs(xa)
        err = _mean(xp, ax, hk, hsk) / a
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
            if n_live <= 0.75 * live.shape[0]:
                idx, a, z, q, xa, ax = idx[live], a[live], z[live], q[live], xa[live], ax[live]
                wk, wa = wk[live], wa[live]
                if hk is not None:
                    hk, hsk = hk[live], hsk[live]
                live = xp.trues(n_live)

        # g = x - shrink_p(x) = sign(x) * min(|x|, |x|^(p-1) / beta): the part of the error
        # the zero point absorbs. Large errors are capped, so outliers barely pull on it.
        # In quantised units (x = xa / a) the cap is c * |xa|^(p-1) with c = a^(2-p) / beta.
        c = a ** (2 - p) / beta
        if p == 1.0:
            g = xp.copysign(xp.minimum(ax, c[:, None]), xa)
        elif bool((ax > (c ** (1 / (2 - p)))[:, None]).any()):
            # Only errors above c^(1/(2-p)) get capped (below it the cap exceeds |x|), so the
            # power is skipped when there are none: the usual case for LLM-sized weights.
            # Computing it densely beats gathering the few capped entries. The clamp avoids
            # 0 ** (p-1) = inf, which would be harmless but warns.
            cap = xp.clamp_min(ax, _MIN_SCALE) ** (p - 1) * c[:, None]
            g = xp.copysign(xp.minimum(ax, cap), xa)
        else:
            g = xa

        if update_scale:
            a, z = _scale_step(xp, q, g, a, z, hk, hsk, cfg.mode == "sym")
            wa = wk * a[:, None]
        else:
            # z <- mean(q - (w - e) * a) = z - mean(g)
            z = z - _mean(xp, g, hk, hsk)
        beta *= cfg.kappa
    return best_s, best_z


def _scale_step(
    xp: Any,
    q: Array,
    g: Array,
    a: Array,
    z: Array,
    h: Array | None,
    hsum: Array | None,
    fixed_zero: bool,
) -> tuple[Array, Array]:
    """Closed-form fit of the target ``t = w - e = (q - z + g) / a`` by ``(q - z') * s'``."""
    if fixed_zero:
        # s' = sum(t d) / sum(d^2) with d = q - z, i.e. (1 + sum(g d) / sum(d^2)) / a
        d = q - z[:, None]
        num = _dot_mean(xp, g, d, h, hsum)
        den = _dot_mean(xp, d, d, h, hsum)
        ok = den > 0
        s_new = (1 + xp.where(ok, num / xp.where(ok, den, 1.0), 0.0)) / a
        return _safe_inverse(xp, s_new, a), z
    # Least squares t ~= s' q + m: slope (1 + cov(q, g) / var(q)) / a; z' = -m / s'.
    qm = _mean(xp, q, h, hsum)
    qc = q - qm[:, None]
    var = _dot_mean(xp, qc, qc, h, hsum)
    cov = _dot_mean(xp, qc, g, h, hsum)
    gm = _mean(xp, g, h, hsum)
    ok = var > 0
    s_new = (1 + xp.where(ok, cov / xp.where(ok, var, 1.0), 0.0)) / a
    a_new = _safe_inverse(xp, s_new, a)
    t_mean = (qm - z + gm) / a
    return a_new, xp.where(ok, qm - t_mean * a_new, z - gm)


def _safe_inverse(xp: Any, s_new: Array, a_old: Array) -> Array:
    """``1 / s_new``, keeping the old inverse scale where the fit is degenerate."""
    good = xp.isfinite(s_new) & (s_new >= _MIN_SCALE)
    return xp.where(good, 1 / xp.where(good, s_new, 1.0), a_old)


def _refit_scale_zero(
    xp: Any,
    w: Array,
    h: Array | None,
    hsum: Array | None,
    s: Array,
    z: Array,
    qmax: float,
) -> tuple[Array, Array]:
    """One L2 step: re-round q, then least-squares ``w ~= s*q + m`` per block."""
    q = _levels(xp, w, s, z, qmax)
    qm = _mean(xp, q, h, hsum)
    qc = q - qm[:, None]
    var = _dot_mean(xp, qc, qc, h, hsum)
    cov = _dot_mean(xp, qc, w, h, hsum)
    ok = (var > 0) & (cov > 0)
    s_new = xp.clamp_min(xp.where(ok, cov / xp.where(ok, var, 1.0), s), _MIN_SCALE)
    # m = mean(w) - s*mean(q) and z = -m/s
    return s_new, xp.where(ok, qm - _mean(xp, w, h, hsum) / s_new, z)


def _refit_scale(
    xp: Any,
    w: Array,
    h: Array | None,
    hsum: Array | None,
    s: Array,
    z: Array,
    qmax: float,
) -> Array:
    """One L2 step with z fixed: re-round q, then ``s = sum(w d) / sum(d^2)``, ``d = q - z``."""
    d = _levels(xp, w, s, z, qmax)
    d -= z[:, None]
    num = _dot_mean(xp, w, d, h, hsum)
    den = _dot_mean(xp, d, d, h, hsum)
    ok = (den > 0) & (num > 0)
    return xp.clamp_min(xp.where(ok, num / xp.where(ok, den, 1.0), s), _MIN_SCALE)


def _pick_integer_zero(
    xp: Any,
    w: Array,
    h: Array | None,
    hsum: Array | None,
    s: Array,
    z: Array,
    qmax: float,
) -> tuple[Array, Array]:
    """Integer zero point: floor or ceil of HQQ's float optimum, each with its scale re-fitted
    once; per block keep the one with the lower squared error (nearest is not always best)."""
    lo = xp.clip_(xp.floor(z), 0.0, qmax)
    hi = xp.clip_(lo + 1, 0.0, qmax)
    s_lo = _refit_scale(xp, w, h, hsum, s, lo, qmax)
    s_hi = _refit_scale(xp, w, h, hsum, s, hi, qmax)
    take_lo = _sq_error(xp, w, h, s_lo, lo, qmax) <= _sq_error(xp, w, h, s_hi, hi, qmax)
    return xp.where(take_lo, s_lo, s_hi), xp.where(take_lo, lo, hi)
