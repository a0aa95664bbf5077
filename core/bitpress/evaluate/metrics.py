"""Streaming comparison of two models' outputs, and next-token NLL for perplexity.

Sums are kept in float64 across samples so no sample's outputs stay in memory after its step.
"""

from __future__ import annotations

import math

import numpy as np

from bitpress.evaluate.result import ModelMismatchError, OutputMetrics


class OutputAccumulator:
    """Running sums for one output: ``add(reference, quantized)`` per sample, then ``result()``."""

    def __init__(self, name: str, is_logits: bool) -> None:
        self.name = name
        self.is_logits = is_logits
        self.shape: list[int] = []
        self.count = 0
        self.abs_sum = 0.0
        self.abs_max = 0.0
        self.diff_sq = 0.0
        self.ref_sq = 0.0
        self.q_sq = 0.0
        self.dot = 0.0
        self.positions = 0
        self.top1_same = 0
        self.nonfinite = False

    def add(self, reference: np.ndarray, quantized: np.ndarray) -> None:
        if reference.shape != quantized.shape:
            raise ModelMismatchError(
                f"output {self.name} has shape {list(quantized.shape)} in QUANTIZED but {list(reference.shape)} "
                "in the reference for the same input"
            )
        self.shape = list(reference.shape)
        if reference.size == 0:
            return
        r = reference.astype(np.float64, copy=False).reshape(-1)
        q = quantized.astype(np.float64, copy=False).reshape(-1)
        d = q - r
        ad = np.abs(d)
        self.count += r.size
        self.abs_sum += float(ad.sum())
        self.abs_max = max(self.abs_max, float(ad.max()))
        self.diff_sq += float(d @ d)
        self.ref_sq += float(r @ r)
        self.q_sq += float(q @ q)
        self.dot += float(q @ r)
        if self.is_logits and reference.ndim >= 1 and reference.shape[-1] > 1:
            same = reference.argmax(-1) == quantized.argmax(-1)
            self.positions += same.size
            self.top1_same += int(same.sum())

    def result(self) -> OutputMetrics:
        if self.count == 0:
            return OutputMetrics(self.name, self.shape, 0, 0.0, 0.0, 0.0, 1.0, None, self.is_logits)
        rel = math.sqrt(self.diff_sq / self.ref_sq) if self.ref_sq else (0.0 if self.diff_sq == 0 else math.inf)
        if self.ref_sq and self.q_sq:
            cos = self.dot / math.sqrt(self.ref_sq * self.q_sq)
        else:
            cos = 1.0 if self.ref_sq == self.q_sq else 0.0  # both zero: identical
        top1 = self.top1_same / self.positions if self.positions else None
        return OutputMetrics(
            self.name, self.shape, self.count, self.abs_max, self.abs_sum / self.count, rel,
            min(1.0, max(-1.0, cos)) if math.isfinite(cos) else cos, top1, self.is_logits,
        )


def looks_like_logits(name: str, shape: tuple[int, ...], vocab: int | None) -> bool:
    """An output named *logits*, or one whose last dim is the vocabulary (not a KV-cache output)."""
    lname = name.lower()
    if "logits" in lname:
        return True
    if lname.startswith("present"):
        return False
    return vocab is not None and vocab > 1 and len(shape) >= 2 and shape[-1] == vocab


def next_token_nll(logits: np.ndarray, ids: np.ndarray) -> tuple[float, int]:
    """Summed negative log-likelihood of ``ids[:, 1:]`` under ``logits[:, :-1]`` and its count.

    One row at a time in float64: exact log-softmax without holding a float64 copy of the batch.
    """
    if logits.ndim != 3 or logits.shape[:2] != ids.shape:
        raise ModelMismatchError(
            f"perplexity needs logits [batch, seq, vocab] for every position; got {list(logits.shape)} "
            f"for input_ids {list(ids.shape)}"
        )
    total = 0.0
    for row, tgt in zip(logits, ids, strict=True):
        x = row[:-1].astype(np.float64)
        m = x.max(axis=-1, keepdims=True)
        lse = np.log(np.exp(x - m).sum(axis=-1)) + m[:, 0]
        total += float((lse - x[np.arange(len(x)), tgt[1:]]).sum())
    return total, ids.shape[0] * (ids.shape[1] - 1)
