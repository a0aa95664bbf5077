"""Accumulating :class:`~bitpress.quant.calibrated.LayerStats` from activations, one sample at a time.

The Hessian is summed in float32 in place (its upper triangle, by column bands), then mirrored
and scaled in place by :meth:`StatsAccumulator.result`: one ``[K, K]`` float32 per input, 0.48 GB
at K = 11008 (a Llama-2-7B ``down_proj``), where a float64 sum and its float32 copy took 1.45 GB.
"""

from __future__ import annotations

import numpy as np

from bitpress.errors import QuantizationError
from bitpress.quant.calibrated import STATS_KINDS, LayerStats

#: rows of ``x`` kept for solvers asking for ``sample`` (spread evenly over the calibration samples)
SAMPLE_ROWS = 4096


class StatsAccumulator:
    """The statistics of one activation ``[..., K]``; :meth:`add` each sample's value, then :meth:`result`."""

    def __init__(self, needs: frozenset[str], samples: int, sample_rows: int = SAMPLE_ROWS) -> None:
        unknown = set(needs) - STATS_KINDS
        if unknown:
            raise QuantizationError(f"unknown calibration statistics {sorted(unknown)}; known: {sorted(STATS_KINDS)}")
        self.needs = needs
        self.rows = 0
        self.k: int | None = None
        self._h: np.ndarray | None = None
        self._abs: np.ndarray | None = None
        self._sq: np.ndarray | None = None
        self._sample: list[np.ndarray] = []
        self._per_sample = max(1, -(-sample_rows // max(samples, 1)))

    def add(self, value: np.ndarray) -> None:
        x = np.asarray(value)
        if x.ndim == 0 or x.shape[-1] == 0:
            return
        k = int(x.shape[-1])
        if self.k is None:
            self.k = k
        elif k != self.k:
            raise QuantizationError(f"an activation changed width between samples ({self.k} -> {k})")
        x = x.reshape(-1, k)
        if not len(x):
            return
        x = x.astype(np.float32, copy=False)
        if not np.isfinite(x).all():
            raise QuantizationError("the calibration data gives NaN or infinite activations; check the inputs")
        self.rows += len(x)
        if "hessian" in self.needs:
            if self._h is None:
                self._h = np.zeros((k, k), np.float32)
            add_gram_upper(self._h, x)
        if "mean_abs" in self.needs:
            a = np.abs(x).sum(axis=0, dtype=np.float64)
            self._abs = a if self._abs is None else self._abs + a
        if "mean_sq" in self.needs and "hessian" not in self.needs:
            q = np.einsum("ij,ij->j", x, x, dtype=np.float64)
            self._sq = q if self._sq is None else self._sq + q
        if "sample" in self.needs:
            take = np.linspace(0, len(x) - 1, min(len(x), self._per_sample)).astype(np.int64)
            self._sample.append(x[take].copy())

    def result(self) -> LayerStats:
        if not self.rows:
            raise QuantizationError("the calibration data reached this layer with no tokens")
        n = float(self.rows)
        h, self._h = self._h, None  # handed over: no second [K, K]
        if h is not None:
            mirror_upper(h)
            h *= np.float32(1.0 / n)
        sq = None
        if "mean_sq" in self.needs:
            sq = np.diagonal(h).copy() if h is not None else (self._sq / n).astype(np.float32)  # type: ignore[operator]
        return LayerStats(
            self.rows,
            hessian=h,
            mean_abs=None if self._abs is None else (self._abs / n).astype(np.float32),
            mean_sq=sq,
            sample=np.concatenate(self._sample) if self._sample else None,
        )

    @property
    def nbytes(self) -> int:
        k = self.k or 0
        return (4 * k * k if "hessian" in self.needs else 0) + 16 * k + sum(s.nbytes for s in self._sample)


#: float32 elements of the temporaries of :func:`add_gram_upper` and :func:`mirror_upper` (16 MB)
GRAM_CHUNK_ELEMENTS = 1 << 22


def add_gram_upper(h: np.ndarray, x: np.ndarray) -> None:
    """``h += x^T x`` on and above the diagonal only, in place, by column bands (float32 BLAS: half
    the products of the full ``x^T x`` and no ``[K, K]`` temporary; :func:`mirror_upper` completes it)."""
    k = h.shape[0]
    band = max(1, GRAM_CHUNK_ELEMENTS // max(k, 1))
    for j0 in range(0, k, band):
        j1 = min(k, j0 + band)
        h[:j1, j0:j1] += x[:, :j1].T @ x[:, j0:j1]


def mirror_upper(h: np.ndarray) -> None:
    """Copy the upper triangle of the square ``h`` onto its lower one, in place, by bands of rows."""
    k = h.shape[0]
    band = max(1, GRAM_CHUNK_ELEMENTS // max(k, 1))
    for i0 in range(0, k, band):
        i1 = min(k, i0 + band)
        # rows i0:i1 left of the diagonal band, then the band's own lower triangle
        h[i0:i1, :i0] = h[:i0, i0:i1].T
        blk = h[i0:i1, i0:i1]
        low = np.tril_indices(i1 - i0, -1)
        blk[low] = blk.T[low]


def combine(parts: list[LayerStats]) -> LayerStats:
    """The statistics of several inputs of one weight (a weight read by two MatMuls), token-weighted."""
    if len(parts) == 1:
        return parts[0]
    total = sum(p.rows for p in parts)

    def mix(attr: str) -> np.ndarray | None:
        vals = [getattr(p, attr) for p in parts]
        if any(v is None for v in vals):
            return None
        return sum(v * (p.rows / total) for v, p in zip(vals, parts, strict=True)).astype(np.float32)

    samples = [p.sample for p in parts if p.sample is not None]
    return LayerStats(total, mix("hessian"), mix("mean_abs"), mix("mean_sq"),
                      np.concatenate(samples) if samples else None)
