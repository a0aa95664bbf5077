"""Synthetic inputs for timing a plain ONNX model: one token (batch 1) and a prompt-sized batch.

Every dynamic dimension but the first (the batch, 1) is the sequence: 1 for ``single``,
``prompt_tokens`` for ``prompt``. Integer inputs get token ids in the vocabulary (the first
``Gather`` table's rows), ones for masks and counted positions; float inputs standard normal
values. A KV-cache decoder (``past_key_values.*`` inputs, :mod:`bitpress.genai.kvcache`) decodes its
single token after a cache of ``prompt_tokens`` positions (zeros), the way generation runs;
its prompt runs from an empty cache.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from bitpress.genai.kvcache import cache_plan, is_past, kv_hints
from bitpress.genai.package import find_genai_config
from bitpress.onnx.inputs import InputSpec, input_specs, vocab_size


def _shape(spec: InputSpec, seq: int) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) and d > 0 else (1 if i == 0 else seq) for i, d in enumerate(spec.shape))


def _fill(spec: InputSpec, shape: tuple[int, ...], vocab: int, rng: np.random.Generator, start: int) -> np.ndarray:
    name = spec.name.lower()
    if np.issubdtype(spec.dtype, np.integer):
        if "mask" in name:
            return np.ones(shape, spec.dtype)
        if "position" in name:
            return np.broadcast_to(np.arange(start, start + shape[-1], dtype=spec.dtype), shape).copy()
        return rng.integers(0, vocab, size=shape).astype(spec.dtype)
    if spec.dtype == np.bool_:
        return np.ones(shape, np.bool_)
    return rng.standard_normal(shape).astype(spec.dtype)


def speed_feeds(model: onnx.ModelProto, model_dir: Path | None, prompt_tokens: int,
                seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """``{"single": feed, "prompt": feed}`` for ``model`` (a graph; no weight data is read)."""
    rng = np.random.default_rng(seed)
    specs = input_specs(model)
    vocab = vocab_size(model)
    plain = [s for s in specs if not is_past(s)]
    past = [s for s in specs if is_past(s)]
    plan = cache_plan(model, kv_hints(find_genai_config(model_dir) if model_dir else None), specs=specs) \
        if past else None
    # a cache of fixed capacity (sliding window, static GQA buffer) is fed as evaluation feeds it
    dynamic = plan is not None and all(not p.capacity for p in plan.past)
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, seq in (("single", 1), ("prompt", prompt_tokens)):
        # the single token of a KV-cache decoder follows a cache of prompt_tokens positions
        cached = prompt_tokens if key == "single" and dynamic else 0
        feed = {}
        for s in plain:
            shape = _shape(s, seq)
            if "mask" in s.name.lower() and cached and len(shape) == 2:
                shape = (shape[0], shape[1] + cached)
            feed[s.name] = _fill(s, shape, vocab, rng, cached)
        if plan is not None and cached:
            for p in plan.past:
                shape = [1 if d is None else d for d in p.shape]
                shape[p.axis] = cached
                feed[p.name] = np.zeros(tuple(shape), p.dtype)
        elif plan is not None:
            feed = plan.fill(feed)
        out[key] = feed
    return out
