"""The contract of calibrated weight-only algorithms (GPTQ, AWQ, and third parties' own).

A calibrated algorithm sees, besides the weight, statistics of the activations that multiply
it on the calibration data. The host collects them (:mod:`bitpress.onnx.calibrated` for ONNX
graphs, :mod:`bitpress.hf.calibrated` for PyTorch models), sequentially when asked: the inputs
of a layer come from the model whose earlier layers are already quantized. Then:

* a :class:`CalibratedSolver` quantizes one weight given its input's :class:`LayerStats`, and
  returns integers, scales and zero points in the host's block layout (the one of
  :class:`~bitpress.quant.solver.QuantizedBlocks`); the host writes them as they are (no
  re-quantization);
* an optional :class:`InputScaler` (AWQ) first picks one positive scale per input channel for
  all the weights that read one input; the host multiplies those weights' columns by it and
  divides the input by it exactly (folded into the producer or as a ``Mul``), then solves the
  scaled weights with the scaled statistics.

Orientation: a weight is handed over as float32 ``[rows, K]``, one row per output channel, K the
reduction axis, padded with zeros to whole blocks; the statistics have the same (padded) K, the
padding channels all zero.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from bitpress.quant.solver import BlockSpec, QuantizedBlocks

log = logging.getLogger(__name__)

#: calibration tokens a calibrated solve wants per channel of an input (fewer than 1: rank-deficient)
TOKENS_PER_CHANNEL = 2

#: the statistics a solver may ask for (``needs``)
STATS_KINDS = frozenset({"hessian", "mean_abs", "mean_sq", "sample"})


@dataclass
class LayerStats:
    """Statistics of one weight input ``x`` (``K`` channels) over ``rows`` calibration tokens.

    hessian: float32 ``[K, K]``, ``sum(x x^T) / rows`` (GPTQ's ``H`` is twice this; the factor
        cancels in the algorithm).
    mean_abs: float32 ``[K]``, ``mean(|x|)`` per channel (AWQ's activation magnitude).
    mean_sq: float32 ``[K]``, ``mean(x**2)`` per channel (the imatrix; the diagonal of ``hessian``).
    sample: float32 ``[R, K]``, rows of ``x`` taken evenly over the calibration tokens.
    Each is ``None`` unless a solver asked for it.
    """

    rows: int
    hessian: np.ndarray | None = None
    mean_abs: np.ndarray | None = None
    mean_sq: np.ndarray | None = None
    sample: np.ndarray | None = None

    @property
    def channels(self) -> int:
        for a in (self.mean_sq, self.mean_abs, self.hessian, self.sample):
            if a is not None:
                return int(a.shape[-1])
        raise ValueError("the statistics hold nothing")

    @property
    def rank_deficient(self) -> bool:
        """A Hessian from fewer tokens than channels (it cannot have full rank)."""
        return self.hessian is not None and self.rows < self.hessian.shape[-1]

    def scaled(self, s: np.ndarray) -> LayerStats:
        """The statistics of ``x / s`` (``s`` float32 ``[K]``, positive): what the scaled weights see."""
        inv = (1.0 / s.astype(np.float64)).astype(np.float32)
        return replace(
            self,
            hessian=None if self.hessian is None else self.hessian * inv[:, None] * inv[None, :],
            mean_abs=None if self.mean_abs is None else self.mean_abs * inv,
            mean_sq=None if self.mean_sq is None else self.mean_sq * inv * inv,
            sample=None if self.sample is None else self.sample * inv,
        )

    def padded(self, k: int) -> LayerStats:
        """The statistics with zero channels appended up to ``k`` (the weight's K padded to whole blocks)."""
        n = k - self.channels
        if n <= 0:
            return self
        return LayerStats(
            self.rows,
            None if self.hessian is None else np.pad(self.hessian, ((0, n), (0, n))),
            None if self.mean_abs is None else np.pad(self.mean_abs, (0, n)),
            None if self.mean_sq is None else np.pad(self.mean_sq, (0, n)),
            None if self.sample is None else np.pad(self.sample, ((0, 0), (0, n))),
        )


def warn_rank_deficient(pass_name: str, thin: list[tuple[str, int, int]]) -> None:
    """One warning naming the layer inputs whose calibration Hessian saw fewer tokens than it has channels.

    Such a Hessian is rank-deficient: a solver that inverts it (GPTQ) fits the calibration text in the
    directions it never saw, and the result can be worse than plain rounding on other text."""
    tokens = min(rows for _, rows, _ in thin)
    widest = max(k for _, _, k in thin)
    names = ", ".join(a for a, _, _ in thin[:4]) + (f" and {len(thin) - 4} more" if len(thin) > 4 else "")
    log.warning("%s: %d layer input(s) saw %d calibration tokens for up to %d channels (%s): their statistics are "
                "rank-deficient and the solve may fit the calibration text; give at least %d tokens "
                "(data: samples x seq_len)", pass_name, len(thin), tokens, widest, names, TOKENS_PER_CHANNEL * widest)


def output_error(stats: LayerStats, delta: np.ndarray) -> float:
    """``mean over tokens of ||x delta^T||^2`` for ``delta`` float ``[rows, K]`` (a weight difference).

    Exact from the Hessian when there is one (``sum((delta @ H) * delta)``), else estimated on
    the sample rows.
    """
    d = np.asarray(delta, dtype=np.float32)
    if stats.hessian is not None:
        return float(np.einsum("rk,rk->", d @ stats.hessian, d, dtype=np.float64))
    if stats.sample is not None and len(stats.sample):
        y = stats.sample @ d.T
        return float(np.einsum("ij,ij->", y, y, dtype=np.float64)) / len(stats.sample)
    raise ValueError("output_error needs the hessian or sample rows")


@dataclass(frozen=True)
class Target:
    """Which weight a solver is working on (for per-layer choices such as AWQ skipping q/k clipping)."""

    weight: str
    nodes: tuple[str, ...]


class CalibratedSolver(Protocol):
    """Quantize one weight knowing the statistics of its input.

    ``needs``: the :data:`STATS_KINDS` the host must collect for it.
    :meth:`prepare` runs once per input and block layout (e.g. GPTQ's inverse Hessian, shared by
    q/k/v); :meth:`solve` once per slab of rows, possibly on several threads at once with the
    same prepared value, which it must not modify. ``w`` is float32 ``[rows, K]`` (K padded to
    whole blocks of ``spec.block_size``), rows independent; the answer's ``q`` is
    ``[rows, K / block_size, block_size]``. ``w`` must not be modified.
    """

    needs: frozenset[str]

    def prepare(self, stats: LayerStats, spec: BlockSpec) -> Any: ...

    def solve(self, w: np.ndarray, spec: BlockSpec, prepared: Any, target: Target) -> QuantizedBlocks: ...


class InputScaler(Protocol):
    """Pick per-input-channel scales for every weight reading one input (AWQ's search).

    ``weights``: float32 ``[rows_i, K]`` each (unpadded K), the same input ``x`` for all;
    ``specs``: each weight's block layout; ``targets``: which weights they are. Returns
    float32 ``[K]``, every value positive and finite (the weights become ``w * s``, the input
    ``x / s``), or ``None`` to leave this input unscaled.
    """

    needs: frozenset[str]

    def scales(
        self, weights: list[np.ndarray], stats: LayerStats, specs: list[BlockSpec], targets: list[Target]
    ) -> np.ndarray | None: ...
