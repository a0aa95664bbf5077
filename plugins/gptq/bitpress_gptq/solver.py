"""GPTQ (Frantar et al., 2022) as a :class:`~bitpress.quant.calibrated.CalibratedSolver`, in numpy.

The weight is quantized one input channel (column) at a time; the rounding error of each column,
divided by the matching diagonal entry of ``U`` (the upper Cholesky factor of the damped inverse
Hessian, ``H^-1 = U^T U``), is spread over the columns not yet quantized along ``U``'s row, so
that ``||X W^T - X Q^T||`` stays small on the calibration activations ``X`` (``H = X^T X / n``).

* :meth:`GptqSolver.prepare` (once per input and block layout): dead channels (``H[i, i] == 0``:
  never active, the host's K padding) are isolated with a diagonal of 1 (their weights are set to
  0); act-order (``desc_act``) permutes the channels by decreasing ``H[i, i]`` (stable); the
  diagonal is damped by ``damp_percent`` times the mean diagonal of the live channels, 10x more
  at each retry when the damped Hessian is not positive definite; ``U`` comes from one Cholesky
  factorization of the channel-reversed Hessian (``J H J = V^T V`` gives ``H = R R^T`` with ``R =
  J V^T J`` upper, so ``U = R^-1``) and one triangular inverse, in float32, by LAPACK (scipy's
  ``spotrf`` and ``strtri``) in place: the ``[K, K]`` float32 ``U`` is the only matrix of that
  size it allocates (4 bytes x K^2; measured 10x faster than numpy's float64 at K = 4096, and
  K = 11008 fits beside the host's Hessian).
* :meth:`GptqSolver.solve` (per slab of rows, thread-safe): the paper's Algorithm 1 with lazy
  batches, vectorized over rows and run on the transposed weight (one channel per contiguous
  row): within a lazy batch of ``block_size_solve`` channels (rounded up to whole groups, so a
  group never straddles two batches and the result is exactly the unbatched algorithm's) every
  column's error updates the rest of its sub-batch of :data:`SUB_BATCH` channels (rank-1), a
  matmul carries each sub-batch's errors to the rest of the lazy batch, and one more the lazy
  batch's errors to every later channel. Sub-batches divide the groups, so a group's columns
  have all their updates when the group starts.
* Groups are the output's blocks of ``spec.block_size`` channels in the NATURAL order, with the
  grid of :mod:`bitpress_gptq.grid`. Without act-order each group's parameters are computed when
  the solve reaches it, on its current (updated) weights; with act-order (or ``static_groups``)
  all of them are computed first on the original weights, so the written blocks need no
  ``g_idx``. The integers returned are exactly the ones the solve chose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.linalg import lapack

from bitpress.plugin import BlockSpec, LayerStats, QuantizationError, QuantizedBlocks, Target
from bitpress_gptq.grid import GroupParams, dequantize, group_params, quantize

log = logging.getLogger(__name__)

#: extra attempts, each with 10x the damping, when the damped Hessian is not positive definite
DAMP_RETRIES = 3
#: rank-1 updates stay within sub-batches of this many columns; a matmul carries them further
SUB_BATCH = 32  # 16-32 measured best: 3x faster than rank-1 over the whole lazy batch


@dataclass(frozen=True)
class GptqSettings:
    """GPTQ's options (the ``gptq`` passes fill them from their own)."""

    damp_percent: float = 0.01  # diagonal damping, a fraction of the mean diagonal of H
    shrinkage: float = 0.0  # off-diagonal entries of H scaled by 1 - shrinkage (toward its diagonal)
    block_size_solve: int = 128  # lazy batch width (rounded up to whole groups)
    desc_act: bool = False  # act-order: channels by decreasing H[i, i]
    static_groups: bool = False  # group parameters from the original weights (always with desc_act)
    mse: bool = False  # search the range shrink per group (grid.SHRINK_GRID)

    def validate(self) -> None:
        if not (np.isfinite(self.damp_percent) and self.damp_percent >= 0):
            raise ValueError(f"damp_percent must be a finite number >= 0, got {self.damp_percent}")
        if not (np.isfinite(self.shrinkage) and 0 <= self.shrinkage <= 1):
            raise ValueError(f"shrinkage must be from 0 to 1, got {self.shrinkage}")
        if self.block_size_solve < 1:
            raise ValueError(f"block_size_solve must be a positive integer, got {self.block_size_solve}")

    @property
    def static(self) -> bool:
        return self.static_groups or self.desc_act


def settings_from(options: Any) -> GptqSettings:
    """:class:`GptqSettings` from a pass's options (``damp_percent``, ``shrinkage``, ``block_size_solve``,
    ``desc_act``, ``mse``), checked: the ONNX and Hugging Face passes validate and build them the same way."""
    if not 0 < options.damp_percent < 1:
        raise ValueError(f"damp_percent must be between 0 and 1, got {options.damp_percent}")
    if not 0 <= options.shrinkage < 1:
        raise ValueError(f"shrinkage must be from 0 (the Hessian as measured) to below 1, got {options.shrinkage}")
    if not 16 <= options.block_size_solve <= 4096:
        raise ValueError(f"block_size_solve must be from 16 to 4096, got {options.block_size_solve}")
    return GptqSettings(damp_percent=options.damp_percent, shrinkage=options.shrinkage,
                        block_size_solve=options.block_size_solve,
                        desc_act=options.desc_act, mse=options.mse)


@dataclass(frozen=True)
class GptqPrepared:
    """What :meth:`GptqSolver.prepare` computed for one input (read-only arrays)."""

    hinv: np.ndarray  # float32 [K, K], upper Cholesky factor of the damped H^-1, processing order
    perm: np.ndarray | None  # int64 [K]: processing position -> natural channel; None = natural
    dead: np.ndarray  # bool [K], natural order: channels never active (weights set to 0)
    block_size: int  # the groups' size (spec.block_size)
    lazy: int  # lazy batch width, a multiple of block_size
    damp: float  # the damping added to the diagonal


def _check_spec(spec: BlockSpec) -> None:
    if not 2 <= spec.bits <= 8:
        raise ValueError(f"GPTQ quantizes to 2..8 bits, got {spec.bits}")
    if spec.block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {spec.block_size}")
    if spec.float_zero_points:
        raise ValueError("GPTQ writes integer zero points: unset float_zero_points (or use symmetric quantization)")


def _sub_width(block_size: int) -> int:
    """Width of the rank-1 sub-batches inside a lazy batch: the largest divisor of the group
    size up to :data:`SUB_BATCH`, so every group starts a sub-batch (its columns are then fully updated)."""
    return max(d for d in range(1, min(block_size, SUB_BATCH) + 1) if block_size % d == 0)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


#: elements of the temporaries of the chunked [K, K] helpers below (16 MB of float32)
CHUNK_ELEMENTS = 1 << 22


def _chunk_rows(k: int) -> int:
    """Rows of a ``[K, K]`` matrix handled at once by the chunked helpers."""
    return max(1, CHUNK_ELEMENTS // max(k, 1))


def _all_finite(a: np.ndarray) -> bool:
    """``np.isfinite(a).all()`` for a ``[K, K]`` matrix without a ``[K, K]`` boolean temporary."""
    step = _chunk_rows(a.shape[-1])
    return all(bool(np.isfinite(a[i : i + step]).all()) for i in range(0, a.shape[0], step))


def _gather(h: np.ndarray, order: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = h[order][:, order]`` in float32, by chunks of rows (no second ``[K, K]`` temporary)."""
    step = _chunk_rows(len(order))
    for i in range(0, len(order), step):
        out[i : i + step] = h[order[i : i + step]][:, order]


def _flip_upper(m: np.ndarray) -> None:
    """In place: ``m = triu(m[::-1, ::-1])`` (a row swap at a time: no ``[K, K]`` temporary)."""
    n = m.shape[0]
    for i in range(n // 2):
        top = m[i, ::-1].copy()
        m[i] = m[n - 1 - i, ::-1]
        m[n - 1 - i] = top
    if n % 2:
        m[n // 2] = m[n // 2, ::-1].copy()
    for i in range(1, n):
        m[i, :i] = 0


class GptqSolver:
    """GPTQ with damping, lazy batches, act-order with static groups, optional scale search."""

    needs = frozenset({"hessian"})

    def __init__(self, settings: GptqSettings | None = None) -> None:
        self.settings = settings or GptqSettings()
        self.settings.validate()

    def prepare(self, stats: LayerStats, spec: BlockSpec) -> GptqPrepared:
        _check_spec(spec)
        if stats.hessian is None:
            raise ValueError("GPTQ needs the Hessian of the layer input (stats.hessian is None)")
        h = np.asarray(stats.hessian)  # read only: the host still needs it for the error report
        k = h.shape[0]
        if h.ndim != 2 or h.shape[1] != k:
            raise ValueError(f"the Hessian must be square [K, K], got {h.shape}")
        if k % spec.block_size:
            raise ValueError(f"K ({k}) must be padded to whole blocks of {spec.block_size}")
        if not _all_finite(h):
            raise QuantizationError(
                "the calibration Hessian holds NaN or infinity: the layer's inputs overflowed on the "
                "calibration data (check the data, or keep this layer in float)"
            )
        diag = np.diagonal(h).astype(np.float64)
        dead = diag == 0
        perm = np.argsort(-diag, kind="stable") if self.settings.desc_act else None  # dead channels last
        # the factorized matrix is J P H P^T J (J reverses the channels, P the processing order): its
        # upper Cholesky factor J P H P^T J = V^T V gives P H P^T = R R^T with R = J V^T J upper, and
        # U = R^-1 = J V^-T J: one factorization and one triangular inverse, both in place
        order = (np.arange(k) if perm is None else perm)[::-1]
        gone = np.flatnonzero(dead[order])
        live = diag[~dead]
        mean = float(live.mean()) if live.size else 1.0
        idx = np.arange(k)
        base = self.settings.damp_percent
        m = np.empty((k, k), np.float32)  # the one [K, K] this method allocates (C order; m.T is Fortran's)
        for attempt in range(DAMP_RETRIES + 1):
            frac = base if attempt == 0 else max(base, 0.01) * 10**attempt
            _gather(h, order, m)
            if self.settings.shrinkage:  # (1 - s) H + s diag(H): a convex mix of two PSD matrices stays PSD
                d = m[idx, idx].copy()
                m *= np.float32(1.0 - self.settings.shrinkage)  # in place: no [K, K] temporary
                m[idx, idx] = d
            m[gone, :] = 0  # dead channels isolated: where they sit in the order changes nothing
            m[:, gone] = 0
            m[gone, gone] = 1
            m[idx, idx] += np.float32(frac * mean)
            fac, info = lapack.spotrf(m.T, lower=0, clean=0, overwrite_a=1)  # m.T: Fortran order, in place
            if info == 0:
                break
            if info < 0:
                raise QuantizationError(f"internal error: LAPACK spotrf rejected argument {-info}")
        else:
            raise QuantizationError(
                f"the calibration Hessian is not positive definite even with damping {frac:g} x its "
                f"mean diagonal: raise damp_percent, use more calibration data, or keep this layer "
                f"in float"
            )
        inv, info = lapack.strtri(fac, lower=0, overwrite_c=1)
        del fac
        m = np.ascontiguousarray(inv.T)  # m itself when LAPACK worked in place (it does: Fortran-ordered float32)
        del inv
        if info:
            raise QuantizationError(
                f"the damped calibration Hessian is numerically singular (damping {frac:g} x its mean "
                f"diagonal): raise damp_percent, or use more calibration data"
            )
        _flip_upper(m)
        if not _all_finite(m):
            raise QuantizationError(
                f"the damped calibration Hessian is numerically singular (damping {frac:g} x its mean "
                f"diagonal): raise damp_percent, or use more calibration data"
            )
        if attempt:
            log.warning(
                "the Hessian is not positive definite with damp_percent %g: damped with %g instead "
                "(more calibration data may help)",
                base,
                frac,
            )
        bs = spec.block_size
        lazy = min(k, -(-max(self.settings.block_size_solve, 1) // bs) * bs)
        return GptqPrepared(
            hinv=_readonly(m),
            perm=None if perm is None else _readonly(perm.astype(np.int64)),
            dead=_readonly(dead),
            block_size=bs,
            lazy=lazy,
            damp=frac * mean,
        )

    def solve(self, w: np.ndarray, spec: BlockSpec, prepared: GptqPrepared, target: Target) -> QuantizedBlocks:
        _check_spec(spec)
        k = prepared.hinv.shape[0]
        bs = prepared.block_size
        if spec.block_size != bs:
            raise ValueError(f"prepared for blocks of {bs}, asked for {spec.block_size}")
        if w.ndim != 2 or w.shape[1] != k:
            raise ValueError(f"w must be [rows, {k}] (K padded to whole blocks), got {w.shape}")
        if not np.isfinite(w).all():
            raise QuantizationError(
                f"weight {target.weight!r} holds NaN or infinity: GPTQ cannot quantize it (keep it in float)"
            )
        rows = w.shape[0]
        nb = k // bs
        bits, sym = spec.bits, spec.symmetric
        mse = self.settings.mse
        wt = np.array(w.T, dtype=np.float32, order="C")  # [K, rows]: one channel per row
        wt[prepared.dead] = 0
        static: GroupParams | None = None
        if self.settings.static:
            static = group_params(wt.reshape(nb, bs, rows), bits, sym, mse)  # [nb, rows]
        perm = prepared.perm
        if perm is not None:
            wt = wt[perm]
        group_of = (np.arange(k) if perm is None else perm) // bs  # processing position -> group
        scales = np.empty((nb, rows), np.float32)
        zps = None if sym else np.empty((nb, rows), np.uint8)
        q = np.empty((k, rows), np.uint8)
        u = prepared.hinv
        p: GroupParams | None = None
        sub = _sub_width(bs)
        for i1 in range(0, k, prepared.lazy):
            i2 = min(i1 + prepared.lazy, k)
            w1 = wt[i1:i2]  # a view: updated in place
            u1 = u[i1:i2, i1:i2]
            err1 = np.empty((i2 - i1, rows), np.float32)
            for j1 in range(0, i2 - i1, sub):
                j2 = min(j1 + sub, i2 - i1)
                for i in range(j1, j2):
                    c = i1 + i
                    if static is not None:
                        p = static.take(int(group_of[c]))
                    elif c % bs == 0:  # a group starts: its parameters from its current weights
                        p = group_params(w1[i : i + bs], bits, sym, mse)
                        scales[c // bs] = p.scale
                        if zps is not None:
                            zps[c // bs] = p.zero_point
                    assert p is not None
                    col = w1[i]
                    qc = quantize(col, p, bits)
                    q[c] = qc
                    e = (col - dequantize(qc, p)) / u1[i, i]
                    err1[i] = e
                    if i + 1 < j2:
                        w1[i + 1 : j2] -= u1[i, i + 1 : j2, None] * e[None, :]
                if j2 < i2 - i1:  # the sub-batch's errors to the rest of the lazy batch
                    w1[j2:] -= u1[j1:j2, j2:].T @ err1[j1:j2]
            if i2 < k:  # the lazy batch's errors to every later channel
                wt[i2:] -= u[i1:i2, i2:].T @ err1
        if static is not None:
            scales[:] = static.scale
            if zps is not None:
                zps[:] = static.zero_point
        if perm is not None:
            natural = np.empty_like(q)
            natural[perm] = q
            q = natural
        return QuantizedBlocks(
            q=np.ascontiguousarray(q.T).reshape(rows, nb, bs),
            scales=np.ascontiguousarray(scales.T),
            zero_points=None if zps is None else np.ascontiguousarray(zps.T),
        )
