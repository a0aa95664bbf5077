"""AWQ's two searches (activation-aware weight quantization, Lin et al. 2023), in numpy.

Both round with any block solver (:class:`~bitpress.quant.solver.BlockSolver`: rtn, kquant,
hqq or a third party's), so AWQ composes with every rounding bitpress has.

* :class:`AwqScaler` (an :class:`~bitpress.quant.calibrated.InputScaler`): one positive scale
  per input channel, shared by every weight that reads the input (q/k/v, gate/up). The
  candidates are ``s = x_mean**a / w_mean**(1 - a)`` (``duo_scaling``, the newer form) or
  ``s = x_mean**a``, normalised by ``sqrt(max(s) * min(s))``, for ``a`` on a grid in ``[0, 1)``;
  ``x_mean`` is the mean ``|x|`` per channel, ``w_mean`` the mean over all rows of all the
  weights of ``|w|`` divided by its block's largest ``|w|``. Each candidate is scored by what it
  would cost after rounding: every weight's columns are multiplied by ``s``, rounded by the block
  solver, divided by ``s`` again, and the output error ``mean ||x (w - w_eff)^T||^2`` is summed
  over the weights. The Hessian gives that error exactly (``rows * K**2`` per weight and
  candidate); when the input is wider than the sample rows the host collected (``K > R``), the
  error is estimated on those rows instead (``rows * K * R``, cheaper by ``K / R``).
* :class:`AwqClipSolver` (a :class:`~bitpress.quant.calibrated.CalibratedSolver`): per block of
  each row, a clip ratio ``1 - i / n_grid`` (``i = 0 .. max_shrink * n_grid``) of the block's
  largest ``|w|``; the block is clamped, rounded, and scored by its own output error
  ``d^T H_bb d`` (``H_bb`` the block's diagonal block of the Hessian, i.e. over all calibration
  tokens). The answer is the block solver's answer for the best ratio of each block, which
  assumes (true of rtn, kquant and hqq) that the solver rounds every block on its own. Weights
  whose names match ``clip_skip`` (query / key projections by default: attention scores are not
  linear in them, and AWQ does not clip them) are rounded without clipping.

All the arithmetic is float32 (errors summed in float64), vectorized over rows and blocks; the
clip search runs in chunks of rows so temporaries stay a few MiB whatever the matrix size, the
scale search scores at most ``max_rows`` rows of the weights (evenly spaced, 4096 by default).

Cost, CPU seconds on one thread of this machine (``OPENBLAS_NUM_THREADS=1``, int4 block 32,
4096 calibration tokens, 512 sample rows; SmolLM2-135M's shapes, search = 21 candidates):

    input (weights)                    | rtn: scale  clip | kquant: scale  clip
    q/k/v [576|192|192, 576], Hessian  |      0.28   0.10 |         0.84   0.40
    gate/up 2x [1536, 576], Hessian    |      0.89   0.36 |         2.69   1.40
    down [576, 1536], Hessian          |      0.69   0.17 |         1.55   0.64
    down [576, 1536], 512 sample rows  |      0.41   0.16 |         1.29   0.72

Rounding costs about as much as the exact error at these sizes; the Hessian's ``K**2`` grows
faster, hence the sample rows for wide inputs (they changed the chosen exponent by at most one
grid step and the layer's error by under 0.5% on outlier layers of K 576 and 1536).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bitpress.plugin import (
    BlockSolver,
    BlockSpec,
    LayerStats,
    NameMatcher,
    QuantizationError,
    QuantizedBlocks,
    Target,
    UsageError,
    dequantize,
    output_error,
)
from bitpress_rtn.solver import rtn_solver

__all__ = [
    "DEFAULT_CLIP_SKIP",
    "AwqClipSolver",
    "AwqScaler",
    "ClipPrepared",
    "ScaleSearch",
    "awq_scales",
    "block_errors",
    "fake_quantize",
    "weight_magnitude",
]

log = logging.getLogger(__name__)

#: Relative floor of the activation and weight magnitudes (of their largest value): keeps
#: ``x**a`` and ``w**-(1-a)`` positive and finite for dead channels and zero columns, and the
#: spread of one input's scales within ``1 / floor``.
_REL_FLOOR = 1e-4
#: Elements of a weight handled at once by the clip search (bounds its temporaries).
_CHUNK_ELEMS = 1 << 20

#: Regular expressions (searched, case-insensitive, in the weight's and its nodes' names) of the
#: weights :class:`AwqClipSolver` rounds without clipping: query / key projections, alone or
#: fused with the values (HF ``q_proj``, BERT ``query``, GenAI ``/attn/q_proj``, T5
#: ``SelfAttention.q``, fused ``qkv_proj``, ``Wqkv``, ``c_attn``, ``query_key_value``).
DEFAULT_CLIP_SKIP: tuple[str, ...] = (
    r"re:(?i).*(^|[/._])[qk]_?proj($|[/._]).*",
    r"re:(?i).*(^|[/._])(query|key)($|[/._]).*",
    r"re:(?i).*(^|[/._])attn[/._][qk]($|[/._]).*",
    r"re:(?i).*attention[/._][qk]($|[/._]).*",
    r"re:(?i).*(^|[/._])(w?qkv|qkv_?proj|c_attn|query_key_value)($|[/._]).*",
)


def _pad_columns(w: np.ndarray, block_size: int) -> np.ndarray:
    n = -w.shape[1] % block_size
    return np.pad(w, ((0, 0), (0, n))) if n else w


def fake_quantize(
    solver: BlockSolver, w: np.ndarray, spec: BlockSpec, importance: np.ndarray | None = None
) -> np.ndarray:
    """float32 ``[rows, K]``: ``w`` (``[rows, K]``, any K) rounded by ``solver`` and dequantized.

    K is padded with zeros to whole blocks for the solver and the padding dropped again;
    ``importance`` (``[K]``) is padded likewise.
    """
    rows, k = w.shape
    wp = _pad_columns(np.asarray(w, dtype=np.float32), spec.block_size)
    imp = None if importance is None else np.pad(importance.astype(np.float32), (0, wp.shape[1] - k))
    blocks = solver(wp.reshape(rows, -1, spec.block_size), spec, imp)
    return dequantize(blocks, spec.bits).reshape(rows, -1)[:, :k]


def _floored(a: np.ndarray) -> np.ndarray:
    """``a`` (>= 0) with every value at least ``_REL_FLOOR`` of its largest (1 for all zeros)."""
    top = float(a.max(initial=0.0))
    return np.maximum(a, top * _REL_FLOOR if top > 0 else 1.0)


def weight_magnitude(weights: Sequence[np.ndarray], specs: Sequence[BlockSpec]) -> np.ndarray:
    """float64 ``[K]``: per input channel, the mean over every row of every weight of ``|w|``
    divided by the largest ``|w|`` of its block (AWQ's ``w_mean`` for duo scaling)."""
    k = weights[0].shape[1]
    total = np.zeros(k, dtype=np.float64)
    rows = 0
    for w, spec in zip(weights, specs, strict=True):
        a = np.abs(_pad_columns(np.asarray(w, dtype=np.float32), spec.block_size))
        blocks = a.reshape(a.shape[0], -1, spec.block_size)
        peak = blocks.max(axis=-1, keepdims=True)
        blocks /= np.where(peak > 0, peak, np.float32(1))
        total += a[:, :k].sum(axis=0, dtype=np.float64)
        rows += w.shape[0]
    return total / max(rows, 1)


def awq_scales(x_mean: np.ndarray, w_mean: np.ndarray | None, a: float) -> np.ndarray:
    """float32 ``[K]``: ``x_mean**a / w_mean**(1 - a)`` (``x_mean**a`` without ``w_mean``), divided
    by ``sqrt(max * min)`` of itself so the scales centre on 1 (in the geometric sense).
    ``x_mean`` and ``w_mean`` must be positive (see ``_floored``)."""
    s = np.asarray(x_mean, dtype=np.float64) ** a
    if w_mean is not None:
        s = s / np.asarray(w_mean, dtype=np.float64) ** (1.0 - a)
    return (s / math.sqrt(float(s.max()) * float(s.min()))).astype(np.float32)


@dataclass
class ScaleSearch:
    """What :meth:`AwqScaler.search` found: the scales, their exponent (``None`` for the identity
    candidate) and every candidate's summed output error (by exponent; ``None`` keys the identity)."""

    scales: np.ndarray
    ratio: float | None
    losses: dict[float | None, float]


class AwqScaler:
    """AWQ's per-input-channel scale search (:class:`~bitpress.quant.calibrated.InputScaler`).

    ``solver`` rounds the scaled weights (``rtn_solver`` by default), ``n_grid`` exponents
    ``a = i / n_grid`` are tried, ``duo_scaling`` divides by the weight magnitude as well.
    ``try_identity`` also scores ``s = 1`` (unscaled; with ``duo_scaling`` no exponent gives it),
    so the scales never cost more output error than no scaling. ``use_sample`` asks the host for
    sample rows too, used for the error when the input is wider than them (see the module
    docstring); without, the error is always the exact one from the Hessian. ``importance``
    hands the solver the scaled weights' mean squared activations (the Hessian's diagonal).
    ``max_rows`` bounds the rows the candidates are scored on: when the weights have more in
    all, evenly spaced rows of each (in proportion to its rows) stand for it, their error scaled
    up to the weight's rows; rows are rounded and scored independently, so this only estimates
    the sum (the row subset is fixed, the same for every candidate). ``None``: all rows.
    """

    def __init__(
        self,
        solver: BlockSolver = rtn_solver,
        *,
        n_grid: int = 20,
        duo_scaling: bool = True,
        try_identity: bool = True,
        use_sample: bool = True,
        importance: bool = False,
        max_rows: int | None = 4096,
    ) -> None:
        if n_grid < 1:
            raise UsageError(f"AWQ's n_grid must be at least 1, got {n_grid}")
        if max_rows is not None and max_rows < 1:
            raise UsageError(f"AWQ's max_rows must be at least 1 (or None for all rows), got {max_rows}")
        self.max_rows = max_rows
        self.solver = solver
        self.n_grid = n_grid
        self.duo_scaling = duo_scaling
        self.try_identity = try_identity
        self.importance = importance
        self.needs = frozenset({"mean_abs", "hessian"} | ({"sample"} if use_sample else set()))

    def scales(
        self, weights: list[np.ndarray], stats: LayerStats, specs: list[BlockSpec], targets: list[Target]
    ) -> np.ndarray | None:
        """float32 ``[K]`` scales for these weights' common input, or ``None`` for a dead input."""
        found = self.search(weights, stats, specs, targets)
        return None if found is None else found.scales

    def search(
        self, weights: list[np.ndarray], stats: LayerStats, specs: list[BlockSpec], targets: list[Target]
    ) -> ScaleSearch | None:
        """The full search (:meth:`scales` keeps only its scales); ``None`` when every input
        channel is zero on the calibration data (no scale changes anything)."""
        k = _check_scaler_inputs(weights, stats, specs, targets)
        x_mean = np.asarray(stats.mean_abs, dtype=np.float64)
        if not np.any(x_mean > 0):
            log.debug("AWQ: input of %s is zero on the calibration data, left unscaled", targets[0].weight)
            return None
        x_mean = _floored(x_mean)
        w_mean = _floored(weight_magnitude(weights, specs)) if self.duo_scaling else None
        err_stats = _error_stats(stats, k)
        diag = _diagonal(stats) if self.importance else None

        candidates: list[tuple[float | None, np.ndarray]] = []
        if self.try_identity:
            candidates.append((None, np.ones(k, dtype=np.float32)))
        for i in range(self.n_grid):
            a = i / self.n_grid
            s = awq_scales(x_mean, w_mean, a)
            if np.all(np.isfinite(s)) and np.all(s > 0):  # the floors keep them so
                candidates.append((a, s))

        scored = _row_subsets(weights, self.max_rows)
        losses: dict[float | None, float] = {}
        best: tuple[float, float | None, np.ndarray] | None = None
        for a, s in candidates:
            loss = sum(
                factor * self._loss(w, s, spec, err_stats, diag)
                for (w, factor), spec in zip(scored, specs, strict=True)
            )
            losses[a] = loss
            if math.isfinite(loss) and (best is None or loss < best[0]):
                best = (loss, a, s)
        if best is None:
            raise QuantizationError(
                f"AWQ could not score any scale candidate for {targets[0].weight} (non-finite weights or "
                "statistics?): check the model's weights and the calibration data"
            )
        loss, a, s = best
        log.debug("AWQ scales for %s: a=%s, loss %.4g (unscaled %s)", targets[0].weight, a, loss, losses.get(None))
        return ScaleSearch(scales=s, ratio=a, losses=losses)

    def _loss(
        self, w: np.ndarray, s: np.ndarray, spec: BlockSpec, err_stats: LayerStats, diag: np.ndarray | None
    ) -> float:
        w = np.asarray(w, dtype=np.float32)
        importance = None if diag is None else diag / (s * s)
        effective = fake_quantize(self.solver, w * s, spec, importance)
        effective /= s
        return output_error(err_stats, w - effective)


def _row_subsets(weights: list[np.ndarray], max_rows: int | None) -> list[tuple[np.ndarray, float]]:
    """Each weight's rows the scale candidates are scored on, and the factor scaling their error
    up to all its rows: all of them (factor 1) within ``max_rows`` in all, else evenly spaced ones."""
    total = sum(w.shape[0] for w in weights)
    if max_rows is None or total <= max_rows:
        return [(np.asarray(w, dtype=np.float32), 1.0) for w in weights]
    out = []
    for w in weights:
        n = w.shape[0]
        m = max(1, min(n, round(n * max_rows / total)))
        rows = np.unique(np.linspace(0, n - 1, m).round().astype(np.intp))
        out.append((np.asarray(w[rows], dtype=np.float32), n / len(rows)))
    return out


def _check_scaler_inputs(
    weights: list[np.ndarray], stats: LayerStats, specs: list[BlockSpec], targets: list[Target]
) -> int:
    if not weights or not len(weights) == len(specs) == len(targets):
        raise QuantizationError(
            f"AWQ needs one spec and one target per weight, got {len(weights)} weights, {len(specs)} specs "
            f"and {len(targets)} targets"
        )
    ks = {int(w.shape[1]) for w in weights}
    if len(ks) != 1 or any(w.ndim != 2 for w in weights):
        raise QuantizationError(
            f"AWQ scales weights [rows, K] that read one input, got shapes {[w.shape for w in weights]} "
            f"for {targets[0].weight}"
        )
    k = ks.pop()
    if stats.mean_abs is None or (stats.hessian is None and stats.sample is None):
        raise QuantizationError(
            f"AWQ needs the input's mean_abs and its hessian or sample rows for {targets[0].weight}: "
            "the host collects what AwqScaler.needs lists"
        )
    if stats.channels != k:
        raise QuantizationError(
            f"the statistics of {targets[0].weight}'s input have {stats.channels} channels, its weights {k}"
        )
    return k


def _error_stats(stats: LayerStats, k: int) -> LayerStats:
    """What :func:`output_error` should use: sample rows when there are fewer of them than
    channels (cheaper, estimated), else the Hessian (exact)."""
    sample = stats.sample
    if sample is not None and len(sample) and (stats.hessian is None or k > len(sample)):
        return LayerStats(stats.rows, sample=np.asarray(sample, dtype=np.float32))
    if stats.hessian is None:
        raise QuantizationError("AWQ's output error needs the input's hessian or sample rows; both are empty")
    return LayerStats(stats.rows, hessian=np.asarray(stats.hessian, dtype=np.float32))


def _diagonal(stats: LayerStats) -> np.ndarray:
    """float32 ``[K]`` mean squared activation per channel (the imatrix)."""
    if stats.mean_sq is not None:
        return np.asarray(stats.mean_sq, dtype=np.float32)
    if stats.hessian is not None:
        return np.ascontiguousarray(np.diagonal(stats.hessian), dtype=np.float32)
    assert stats.sample is not None
    return np.mean(np.square(stats.sample, dtype=np.float32), axis=0)


@dataclass(frozen=True)
class ClipPrepared:
    """:meth:`AwqClipSolver.prepare`'s value: the Hessian's diagonal blocks (float32
    ``[n_blocks, block_size, block_size]``) and the solver's importance (``[K]``) if asked."""

    h_blocks: np.ndarray
    importance: np.ndarray | None


class AwqClipSolver:
    """AWQ's per-block clip search (:class:`~bitpress.quant.calibrated.CalibratedSolver`).

    ``solver`` rounds (``rtn_solver`` by default); ratios ``1 - i / n_grid`` for ``i`` from 0 to
    ``max_shrink * n_grid`` are tried; ``clip_skip`` are patterns (names, globs, ``re:REGEX``) of the weights
    rounded without clipping (:data:`DEFAULT_CLIP_SKIP`); ``importance`` hands the solver the
    input's mean squared activations (the Hessian's diagonal).
    """

    needs = frozenset({"hessian"})

    def __init__(
        self,
        solver: BlockSolver = rtn_solver,
        *,
        n_grid: int = 20,
        max_shrink: float = 0.5,
        clip_skip: Sequence[str] = DEFAULT_CLIP_SKIP,
        importance: bool = False,
    ) -> None:
        if n_grid < 1 or not 0.0 <= max_shrink < 1.0:
            raise UsageError(f"AWQ's clip search needs n_grid >= 1 and 0 <= max_shrink < 1, got {n_grid}, {max_shrink}")
        # names, globs or re:REGEX as every bitpress selection (RE2: linear time, no backtracking)
        self._skip = NameMatcher(list(clip_skip), what="clip_skip")
        self.solver = solver
        self.ratios = [1.0 - i / n_grid for i in range(round(max_shrink * n_grid) + 1)]
        self.importance = importance

    def skips(self, target: Target) -> bool:
        """Whether ``target`` is rounded without clipping (a ``clip_skip`` pattern matches a name)."""
        names = (target.weight, *target.nodes)
        return self._skip.matches(*names)

    def prepare(self, stats: LayerStats, spec: BlockSpec) -> ClipPrepared:
        if stats.hessian is None:
            raise QuantizationError(
                "AWQ's clip search needs the input's hessian: the host collects what AwqClipSolver.needs lists"
            )
        bs = spec.block_size
        h = np.asarray(stats.padded(-(-stats.channels // bs) * bs).hessian, dtype=np.float32)
        nb = h.shape[0] // bs
        idx = np.arange(nb)
        h_blocks = np.ascontiguousarray(h.reshape(nb, bs, nb, bs)[idx, :, idx, :])
        importance = np.ascontiguousarray(np.diagonal(h)) if self.importance else None
        return ClipPrepared(h_blocks=h_blocks, importance=importance)

    def solve(self, w: np.ndarray, spec: BlockSpec, prepared: ClipPrepared, target: Target) -> QuantizedBlocks:
        rows, kp = w.shape
        nb, bs = prepared.h_blocks.shape[:2]
        if bs != spec.block_size or kp != nb * bs:
            raise QuantizationError(
                f"{target.weight}: weight [{rows}, {kp}] and block size {spec.block_size} do not match the "
                f"prepared statistics ({nb} blocks of {bs}); prepare() with the same spec, pad K to whole blocks"
            )
        w3 = np.asarray(w, dtype=np.float32).reshape(rows, nb, bs)
        if self.skips(target) or rows == 0:
            return self.solver(w3, spec, prepared.importance)
        step = max(1, _CHUNK_ELEMS // max(kp, 1))
        parts = [self._solve_rows(w3[r : r + step], spec, prepared) for r in range(0, rows, step)]
        zps = [p.zero_points for p in parts]
        return QuantizedBlocks(
            q=np.concatenate([p.q for p in parts]),
            scales=np.concatenate([p.scales for p in parts]),
            zero_points=None if zps[0] is None else np.concatenate(zps),
        )

    def _solve_rows(self, w3: np.ndarray, spec: BlockSpec, prepared: ClipPrepared) -> QuantizedBlocks:
        """The clip search on a chunk of rows ``[rows, n_blocks, block_size]``."""
        peak = np.abs(w3).max(axis=-1, keepdims=True)
        best = _own(self.solver(w3, spec, prepared.importance))  # ratio 1: clamping changes nothing
        best_err = block_errors(prepared.h_blocks, w3 - dequantize(best, spec.bits))
        for ratio in self.ratios[1:]:
            limit = peak * np.float32(ratio)
            found = self.solver(np.clip(w3, -limit, limit), spec, prepared.importance)
            err = block_errors(prepared.h_blocks, w3 - dequantize(found, spec.bits))
            better = err < best_err
            if not better.any():
                continue
            best.q[better] = found.q[better]
            best.scales[better] = found.scales[better]
            if best.zero_points is not None and found.zero_points is not None:
                best.zero_points[better] = found.zero_points[better]
            best_err = np.where(better, err, best_err)
        return best


def _own(blocks: QuantizedBlocks) -> QuantizedBlocks:
    """``blocks`` with arrays this module may write into."""
    zp = blocks.zero_points
    return QuantizedBlocks(
        q=np.array(blocks.q, dtype=np.uint8),
        scales=np.array(blocks.scales, dtype=np.float32),
        zero_points=None if zp is None else np.array(zp),
    )


def block_errors(h_blocks: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """float64 ``[rows, n_blocks]``: ``d^T H_bb d`` for each block ``d`` of ``delta``
    (``[rows, n_blocks, block_size]``), ``H_bb`` = ``h_blocks[b]``: each block's own output error."""
    dt = np.ascontiguousarray(delta.transpose(1, 0, 2), dtype=np.float32)  # [n_blocks, rows, bs]
    t = np.matmul(dt, h_blocks)  # batched over blocks
    return np.einsum("nrb,nrb->rn", t, dt, dtype=np.float64)
