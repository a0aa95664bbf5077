"""Feeding a causal language model (a GenAI package's decoder): its KV-cache inputs, and token windows.

One module for every place that runs a decoder on text or on given inputs: calibration data
(:mod:`bitpress.calibration.data`, text for ``kquant`` / ``hqq`` statistics and static int8
passes), ``bitpress eval`` (:mod:`bitpress.evaluate.feeds`, perplexity and output comparison) and
``bitpress bench`` (:mod:`bitpress.speed.feeds`). The text itself (tokenizer, BOS, windows) is
:mod:`bitpress.calibration.text`'s; :func:`window_feeds` turns its windows into feeds.

**KV cache.** Exports with a cache (ONNX Runtime GenAI builder, Optimum, mobius) take
``past_key_values.{i}.key`` / ``.value`` (or similar floating ``past*`` inputs). A window runs
in one call from an empty cache. Per past input, :func:`cache_plan` decides what "empty" is:

* a dynamic past axis (named like ``past_sequence_length``): length 0;
* a sliding-window cache of the GenAI builder (``GroupQueryAttention`` with
  ``sliding_window_cache=1``, a past axis named like ``past_sliding_length``, or a layer listed in
  ``genai_config.json`` ``model.decoder.sliding_window.layers``): zeros of the window's capacity
  (``local_window_size`` / ``sliding_window.window_size`` + ``cache_slack``), which ONNX Runtime
  requires (``KV cache capacity (0) must be at least local_window_size``);
* a static past axis (a number): zeros of that capacity.

How ``attention_mask`` covers a zero past depends on what reads the cache. ``GroupQueryAttention``
takes the sequence lengths from the mask (``seqlens_k``, ``total_sequence_length``) and the past
buffer only as capacity: the mask covers the window's tokens. Anything else (``Concat`` of past
and new keys, ``Attention``) attends over past + window: the mask gets zeros over the past
(which must then have one capacity for all inputs). ``position_ids`` is ``0 .. S-1``.

Head counts and sizes given as dim names come from ``genai_config.json``
(``num_key_value_heads``, ``head_size``; :func:`kv_hints`), found in the model's folder or the
package's root, never above it (:func:`bitpress.genai.package.find_genai_config`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from bitpress.errors import BitpressError, UsageError
from bitpress.onnx.inputs import InputSpec, input_specs

_PAST_AXIS_WORDS = ("past", "seq", "len", "total")
# head size as exports name it: head_size, head_dim, kv_cache_dim (GenAI builder), ...
_HEAD_SIZE = re.compile(r"head_?(size|dim)|per_head|(^|_)dim$")
_LAYER = re.compile(r"(\d+)")


class KVCacheError(BitpressError):
    """The model's cache inputs cannot be filled (unknown sizes, a window that does not fit)."""


# -- genai_config.json ----------------------------------------------------------------------------------
def decoder_section(genai: dict[str, Any] | None) -> dict[str, Any]:
    model = (genai or {}).get("model")
    dec = model.get("decoder") if isinstance(model, dict) else None
    return dec if isinstance(dec, dict) else {}


def kv_hints(genai: dict[str, Any] | None) -> dict[str, Any]:
    """What ``genai_config.json`` tells about the cache: ``heads`` / ``head_size`` (for dims given as
    names), ``sliding_window`` (the capacity of a sliding-window cache: ``window_size`` +
    ``cache_slack``) and ``sliding_layers`` (the layers that have one), each only when it says."""
    dec = decoder_section(genai)
    hints: dict[str, Any] = {}
    heads = dec.get("num_key_value_heads") or dec.get("num_attention_heads")
    if isinstance(heads, int):
        hints["heads"] = heads
    size = dec.get("head_size")
    if not isinstance(size, int) and isinstance(dec.get("hidden_size"), int) and dec.get("num_attention_heads"):
        size = dec["hidden_size"] // dec["num_attention_heads"]
    if isinstance(size, int):
        hints["head_size"] = size
    sw = dec.get("sliding_window")
    if isinstance(sw, dict):
        window = sw.get("window_size")
        slack = sw.get("cache_slack") if isinstance(sw.get("cache_slack"), int) else 0
        if isinstance(window, int) and window > 0:
            hints["sliding_window"] = window + max(slack, 0)
        layers = sw.get("layers")
        if isinstance(layers, list):
            hints["sliding_layers"] = tuple(int(i) for i in layers if isinstance(i, int))
    return hints


# -- signature ------------------------------------------------------------------------------------------
def is_past(spec: InputSpec) -> bool:
    """A KV-cache input: past_key_values.0.key, past_key_values.0, past_0, past_key.0 ..."""
    return spec.name.lower().startswith("past") and np.issubdtype(spec.dtype, np.floating)


def ids_input(specs: list[InputSpec]) -> str | None:
    for s in specs:
        if s.name == "input_ids":
            return s.name
    for s in specs:
        lname = s.name.lower()
        if ("input_ids" in lname or lname == "ids") and np.issubdtype(s.dtype, np.integer):
            return s.name
    return None


@dataclass(frozen=True)
class PastFill:
    """How one past input is fed: zeros of ``shape`` (``None`` where the batch goes)."""

    name: str
    dtype: type
    shape: tuple[int | None, ...]
    axis: int
    #: read by GroupQueryAttention: the buffer is capacity, the mask counts only real tokens
    gqa: bool
    #: why the past is not empty (``sliding window``, ``static cache``), or "" for length 0
    reason: str = ""

    @property
    def capacity(self) -> int:
        return int(self.shape[self.axis] or 0)


@dataclass
class CachePlan:
    """What a window of ``S`` tokens needs besides its ids, mask and positions."""

    past: list[PastFill] = field(default_factory=list)
    #: zeros put before the window in ``attention_mask`` (the capacity of a non-GQA static past)
    mask_past: int = 0
    mask_name: str | None = None

    def note(self) -> str | None:
        if not self.past:
            return None
        sized = [p for p in self.past if p.capacity]
        if not sized:
            return f"KV-cache model: {len(self.past)} past input(s) fed empty (length 0); each window runs in one call"
        reasons = sorted({f"{p.reason} {p.capacity}" for p in sized})
        return (
            f"KV-cache model: each window runs in one call from an empty cache: {len(self.past) - len(sized)} "
            f"past input(s) of length 0, {len(sized)} as zeros of a fixed capacity ({', '.join(reasons)}) that "
            "hold no tokens"
        )

    def fill(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``feed`` plus the cache inputs it lacks; a mask made for the window gets the past's zeros."""
        if not self.past:
            return feed
        batch = next((a.shape[0] for a in feed.values() if a.ndim), 1)
        out = dict(feed)
        added = False
        for p in self.past:
            if p.name in out:
                continue
            shape = tuple(batch if d is None else d for d in p.shape)
            out[p.name] = np.zeros(shape, p.dtype)
            added = True
        if added and self.mask_past and self.mask_name in out:
            mask = out[self.mask_name]
            zeros = np.zeros((*mask.shape[:-1], self.mask_past), mask.dtype)
            out[self.mask_name] = np.concatenate([zeros, mask], axis=-1)
        return out

    def check_window(self, seq_len: int) -> None:
        """A static (non-sliding) cache read by GroupQueryAttention must hold the whole window."""
        for p in self.past:
            if p.gqa and p.reason == "static cache" and p.capacity < seq_len:
                raise KVCacheError(
                    f"the cache input {p.name} holds {p.capacity} positions, fewer than a window of {seq_len} "
                    f"tokens; use a sequence length of at most {p.capacity}"
                )


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            if name:
                out.setdefault(name, []).append(node)
    return out


def _attr(node: onnx.NodeProto, name: str) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return None


def _readers(name: str, consumers: dict[str, list[onnx.NodeProto]]) -> list[onnx.NodeProto]:
    """Nodes that read ``name``, looking through Cast / Identity (fp16 caches cast on the way in)."""
    out, todo, seen = [], [name], set()
    while todo:
        cur = todo.pop()
        for node in consumers.get(cur, []):
            if node.op_type in ("Cast", "Identity") and id(node) not in seen:
                seen.add(id(node))
                todo.extend(node.output)
            else:
                out.append(node)
    return out


def cache_plan(model: onnx.ModelProto, hints: dict[str, Any] | None = None, *,
               specs: list[InputSpec] | None = None) -> CachePlan:
    """How to feed every past input of ``model`` (see the module's docstring); ``hints``: :func:`kv_hints`."""
    specs = specs if specs is not None else input_specs(model)
    past = [s for s in specs if is_past(s)]
    plan = CachePlan(mask_name=next((s.name for s in specs if "mask" in s.name.lower() and not is_past(s)), None))
    if not past:
        return plan
    hints = hints or {}
    window = hints.get("sliding_window")
    sliding_layers = set(hints["sliding_layers"]) if "sliding_layers" in hints else None
    consumers = _consumers(model.graph)
    for spec in past:
        readers = _readers(spec.name, consumers)
        gqa_nodes = [n for n in readers if n.op_type == "GroupQueryAttention"]
        gqa = bool(gqa_nodes)
        local = max((int(_attr(n, "local_window_size") or -1) for n in gqa_nodes), default=-1)
        sliding = any(int(_attr(n, "sliding_window_cache") or 0) == 1 for n in gqa_nodes)
        shape, axis = _past_shape(spec, hints)
        dim = spec.shape[axis]
        if isinstance(dim, int) and dim > 0:
            reason, capacity = "static cache", dim
        else:
            layer = _LAYER.search(spec.name)
            named = isinstance(dim, str) and "sliding" in dim.lower()
            listed = sliding_layers is not None and layer is not None and int(layer.group(1)) in sliding_layers
            reason, capacity = "", 0
            if sliding or named or listed:
                capacity = max(window or 0, local if local > 0 else 0)
                if capacity <= 0:
                    raise KVCacheError(
                        f"the cache input {spec.name} is a sliding-window cache of unknown size; put a "
                        "genai_config.json with model.decoder.sliding_window.window_size beside the model"
                    )
                reason = "sliding window"
        shape[axis] = capacity
        plan.past.append(PastFill(spec.name, spec.dtype, tuple(shape), axis, gqa, reason))
    plain = {p.capacity for p in plan.past if not p.gqa}
    if len(plain) > 1:
        raise KVCacheError(
            "the cache inputs have different static lengths (" + ", ".join(str(c) for c in sorted(plain)) + ") "
            "and no GroupQueryAttention reads them: one attention_mask cannot cover them"
        )
    plan.mask_past = max(plain, default=0)
    if plan.mask_past and plan.mask_name is None:
        raise KVCacheError(
            f"the model has a static cache of {plan.mask_past} positions but no attention_mask input to mask it "
            "out; export it with a dynamic past length"
        )
    return plan


def _past_shape(spec: InputSpec, hints: dict[str, Any]) -> tuple[list[int | None], int]:
    """The shape of an empty cache for ``spec`` (``None`` where the batch goes) and its past axis."""
    batch = -1
    shape: list[int | None] = []
    past_axis = None
    for i, d in enumerate(spec.shape):
        name = d.lower() if isinstance(d, str) else ""
        if isinstance(d, int) and d > 0:
            shape.append(d)
        elif "batch" in name:
            shape.append(batch)
        elif past_axis is None and any(w in name for w in _PAST_AXIS_WORDS):
            shape.append(0)
            past_axis = i
        elif _HEAD_SIZE.search(name):
            shape.append(hints.get("head_size"))
        elif "head" in name:
            shape.append(hints.get("heads"))
        elif i == 0:
            shape.append(batch)  # exports put the batch first even when the dim has no name
        else:
            shape.append(None)
    if past_axis is None and len(shape) >= 3 and (shape[-2] is None or isinstance(spec.shape[-2], int)):
        # [batch, heads, past, head_size]: an unnamed dynamic dim, or a number (a static cache)
        past_axis = len(shape) - 2
        if shape[past_axis] is None:
            shape[past_axis] = 0
    if past_axis is None:
        raise KVCacheError(f"cannot tell the past-sequence axis of the cache input {spec.name} {list(spec.shape)}")
    unknown = [i for i, s in enumerate(shape) if s is None]
    if unknown:
        dims = ", ".join(f"{i} ({spec.shape[i] or 'unnamed'})" for i in unknown)
        raise KVCacheError(
            f"cannot tell the size of dim {dims} of the cache input {spec.name}; put a genai_config.json with "
            "num_key_value_heads and head_size beside the model"
        )
    return [None if s == batch else s for s in shape], past_axis


# -- feeds of token windows ---------------------------------------------------------------------------
def window_feeds(
    specs: list[InputSpec], plan: CachePlan, windows: np.ndarray, batch: int, what: str
) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """``(ids, feed)`` per batch of windows: ids, masks of ones, positions ``0..S-1``, the cache."""
    ids_name = ids_input([s for s in specs if not is_past(s)])
    if ids_name is None:
        names = ", ".join(s.name for s in specs if not is_past(s))
        raise UsageError(f"{what} needs a model taking input_ids; this one takes {names}")
    plan.check_window(int(windows.shape[1]))
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        feed: dict[str, np.ndarray] = {}
        for s in specs:
            lname = s.name.lower()
            if is_past(s):
                continue
            if s.name == ids_name:
                feed[s.name] = w.astype(s.dtype)
            elif "mask" in lname:
                feed[s.name] = np.ones(w.shape, s.dtype)  # the past is empty or masked out by plan.fill
            elif "position" in lname:
                feed[s.name] = np.broadcast_to(np.arange(w.shape[1], dtype=s.dtype), w.shape).copy()
            else:
                raise UsageError(f"{what} cannot fill the input {s.name!r} from text; give .npz files instead")
        yield w, plan.fill(feed)


__all__ = [
    "CachePlan",
    "KVCacheError",
    "PastFill",
    "cache_plan",
    "decoder_section",
    "ids_input",
    "is_past",
    "kv_hints",
    "window_feeds",
]
