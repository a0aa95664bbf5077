"""A bits-per-weight budget (``bpw``): each weight gets the bits and block size that cost the model least.

For every planned weight, each candidate layout (4 or 8 bits; blocks of 128, 64 or 32 along K; the
user's symmetry) is priced exactly as the writer will store it (integers, scales, zero points: the
plan's :class:`~bitpress.onnx.weightonly.report.Estimate`), and its rounding error ``e`` measured on
the weight itself (``||W - Q(W)|| / ||W||``). What that error costs the model is measured too
(:mod:`bitpress.onnx.weightonly.sensitivity`): each weight alone is rounded to its cheapest layout
and the output's KL divergence from the float model's, ``s``, taken on a few samples of the
calibration data (random token ids without data). A layout's expected loss is then
``s * (e / e_cheapest)**2``: the loss grows with the square of the weight's error, and weights add.

Starting from the cheapest layout of every weight, the allocation repeatedly takes the upgrade
that removes the most expected loss per byte until the next one would pass the budget: the greedy
solution of the knapsack, over each weight's lower convex hull of (bytes, loss). llama.cpp's
``Q4_K_M`` and the GenAI builder's ``k_quant_mixed`` give the head, attention values and FFN-down
more bits by name; here the measurements decide, and a tied table (one weight read by the embedding
and the head) is measured through both reads.

Layouts whose kernel dequantizes the weight on every call (slow on the target) and those a tied
table cannot share are never candidates, so a budget adds no slow path. The budget counts the
weights the plan quantizes (a tied table once), as ``bitpress eval`` and the run report measure
bits per weight; weights the user's ``overrides`` set keep their layout and count in the budget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from bitpress.errors import OptionError

if TYPE_CHECKING:
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.weightonly.planning import Group, Plan
    from bitpress.onnx.weightonly.report import Estimate, KernelOf

log = logging.getLogger(__name__)

#: weight -> (bits, block size) in, weight -> measured sensitivity out
Measure = Callable[[dict[str, tuple[int, int]]], dict[str, float]]

#: (bits, block size) a budget chooses from
LAYOUTS: tuple[tuple[int, int], ...] = ((4, 128), (4, 64), (4, 32), (8, 128), (8, 64), (8, 32))
#: columns of a weight rounded at a time (bounds the float copies)
COLUMNS = 4096


@dataclass
class Choice:
    bits: int
    block_size: int
    bytes: int
    error: float  # relative rounding error of the weight
    loss: float = 0.0  # expected loss of the model's output (see the module's text)


@dataclass
class Allocation:
    """What :func:`allocate` chose: weight -> the chosen layout, and the budget's figures."""

    chosen: dict[str, Choice]
    base: dict[str, Choice]  # the cheapest layout of each weight
    budget: float
    bits_per_weight: float  # what the chosen layouts store
    weights: int

    def overrides(self) -> dict[str, dict[str, int]]:
        return {w: {"bits": c.bits, "block_size": c.block_size} for w, c in self.chosen.items()}

    def note(self, weight: str) -> str:
        c, b = self.chosen[weight], self.base[weight]
        if c is b:
            return f"bpw {self.budget:g}: its cheapest layout (expected loss {c.loss:.3g})"
        return (f"bpw {self.budget:g}: expected loss {c.loss:.3g}, {b.loss:.3g} at its cheapest "
                f"({b.bits} bits, block {b.block_size})")


def fake_quantize(matrix: np.ndarray, bits: int, block_size: int, symmetric: bool) -> np.ndarray:
    """``matrix`` ([K, N], blocks of ``block_size`` along K) rounded to nearest and back, as float32."""
    k, n = matrix.shape
    pad = (-k) % block_size
    out = np.empty((k, n), dtype=np.float32)
    qmax = (1 << bits) - 1
    for c in range(0, n, COLUMNS):
        part = np.asarray(matrix[:, c:c + COLUMNS], dtype=np.float32)
        if pad:
            part = np.concatenate([part, np.zeros((pad, part.shape[1]), dtype=np.float32)])
        blocks = part.reshape(-1, block_size, part.shape[1])
        if symmetric:
            half = 1 << (bits - 1)
            scale = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(half - 0.5)
            scale[scale == 0] = 1.0
            q = np.clip(np.round(blocks / scale), -half, half - 1) * scale
        else:
            lo = np.minimum(blocks.min(axis=1, keepdims=True), 0.0)
            hi = np.maximum(blocks.max(axis=1, keepdims=True), 0.0)
            scale = (hi - lo) / np.float32(qmax)
            scale[scale == 0] = 1.0
            zero = np.clip(np.round(-lo / scale), 0, qmax)
            q = (np.clip(np.round(blocks / scale) + zero, 0, qmax) - zero) * scale
        out[:, c:c + COLUMNS] = q.reshape(-1, part.shape[1])[:k]
    return out


def rounding_error(w: np.ndarray, bits: int, block_size: int, symmetric: bool) -> float:
    """Relative error ``||W - Q(W)|| / ||W||`` of round-to-nearest, blocks along K (``w`` is [K, N])."""
    err = ref = 0.0
    for c in range(0, w.shape[1], COLUMNS):
        part = np.asarray(w[:, c:c + COLUMNS], dtype=np.float64)
        diff = fake_quantize(part, bits, block_size, symmetric) - part
        err += float(np.einsum("ij,ij->", diff, diff))
        ref += float(np.einsum("ij,ij->", part, part))
    return float(np.sqrt(err / ref)) if ref > 0 else 0.0


def weight_matrix(model: OnnxModel, group: Group, array: np.ndarray | None = None) -> np.ndarray:
    """The weight as [K, N] (blocks along K), whichever way it is stored (``array``: its data, when read)."""
    array = model.array(group.weight) if array is None else array
    return array.T if group.uses[0].rows_are_table_rows else array


def allocate(model: OnnxModel, p: Plan, budget: float, estimate: Estimate, kernel: KernelOf | None,
             measure: Measure | None = None, fixed: set[str] | None = None) -> Allocation:
    """Choose a layout per planned weight so that the bits per weight stay within ``budget``.

    ``measure``: ``{weight: (bits, block)} -> {weight: sensitivity}`` (:func:`bitpress.onnx.weightonly.
    sensitivity.measure` on samples); without it each weight's loss is its squared relative error (a tied
    table's twice). ``fixed``: weights whose layout the user set (``overrides``): kept, counted in the budget.
    Sets each group's ``bits`` / ``block_size`` in ``p`` and notes why.
    """
    from bitpress.onnx.weightonly.planning import _layout_problem

    fixed = fixed or set()
    inits = model.initializers()
    options: dict[str, list[Choice]] = {}
    weights = 0
    for g in p.groups:
        tensor = inits[g.weight]
        weights += int(np.prod([int(d) for d in tensor.dims]))
        matrix = None
        found = []
        tied = len({u.is_gather for u in g.uses}) > 1
        for bits, bs in LAYOUTS if g.weight not in fixed else ():
            trial = replace(g, bits=bits, block_size=bs)
            if _layout_problem(trial, tensor) or (kernel is not None and kernel(trial).slow):
                continue
            if matrix is None:
                matrix = weight_matrix(model, g)
            err = rounding_error(matrix, bits, bs, g.symmetric)
            found.append(Choice(bits, bs, estimate(trial, tensor)[0], err, err * err * (2.0 if tied else 1.0)))
        if not found:  # fixed by the user, or no layout of the list fits: keep what the plan had
            found.append(Choice(g.bits, g.block_size, estimate(g, tensor)[0], 0.0, 0.0))
        options[g.weight] = _frontier(found)
    base = {w: c[0] for w, c in options.items()}
    total = sum(c.bytes for c in base.values())
    floor = 8 * total / weights if weights else 0.0
    if weights and floor > budget + 1e-9:
        raise OptionError(f"bpw {budget:g} is below what the smallest layouts store for these weights "
                          f"({floor:.2f} bits per weight); give at least {floor:.2f}")
    if measure is not None:
        open_ = {w: (c.bits, c.block_size) for w, c in base.items() if len(options[w]) > 1}
        measured = measure(open_) if open_ else {}
        for w, sens in measured.items():
            ref = base[w].error
            for c in options[w]:
                c.loss = sens * (c.error / ref) ** 2 if ref > 0 else 0.0
            options[w] = _frontier(options[w])
    limit = budget * weights / 8
    chosen = dict(base)
    position = {w: 0 for w in options}
    while True:
        best, best_gain = None, 0.0
        for w, frontier in options.items():
            i = position[w]
            if i + 1 >= len(frontier):
                continue
            cur, nxt = frontier[i], frontier[i + 1]
            extra = nxt.bytes - cur.bytes
            if total + extra > limit:
                continue
            gain = (cur.loss - nxt.loss) / max(extra, 1)
            if gain > best_gain:
                best, best_gain = w, gain
        if best is None:
            break
        i = position[best]
        total += options[best][i + 1].bytes - options[best][i].bytes
        position[best] = i + 1
        chosen[best] = options[best][i + 1]
    bpw = 8 * total / weights if weights else 0.0
    alloc = Allocation(chosen, base, budget, bpw, weights)
    for g in p.groups:
        if g.weight not in fixed:
            c = chosen[g.weight]
            g.bits, g.block_size = c.bits, c.block_size
            p.notes[g.weight] = alloc.note(g.weight)
    log.info("%s: bpw %g: %d weights at %.3f bits per weight (%d at 8 bits; loss %s)", model.source.name, budget,
             len(chosen), bpw, sum(c.bits == 8 for c in chosen.values()),
             "measured" if measure is not None else "from the weights' errors alone")
    return alloc


def _frontier(choices: list[Choice]) -> list[Choice]:
    """The layouts worth paying for, cheapest first: each costs more and loses less than the one before,
    on the lower convex hull (so greedy upgrades take the best loss removed per byte first)."""
    ordered = sorted(choices, key=lambda c: (c.bytes, c.loss))
    pareto: list[Choice] = []
    for c in ordered:
        if not pareto or c.loss < pareto[-1].loss:
            pareto.append(c)
    hull: list[Choice] = []
    for c in pareto:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when the a -> c slope removes loss per byte at least as fast as a -> b
            ab = (a.loss - b.loss) / max(b.bytes - a.bytes, 1)
            ac = (a.loss - c.loss) / max(c.bytes - a.bytes, 1)
            if ac >= ab:
                hull.pop()
            else:
                break
        hull.append(c)
    return hull
