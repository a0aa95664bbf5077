"""Feeds for causal language models: KV-cache inputs, token windows, BOS.

One module for the two places that run a language model on text: calibration data
(:mod:`bitpress.data`, text for ``kquant`` / ``hqq`` statistics and static int8 passes) and
``bitpress eval`` (:mod:`bitpress.evaluate.feeds`, perplexity and output comparison).

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
(``num_key_value_heads``, ``head_size``), found in the model's folder or the package's root,
never above it.

**BOS.** When the tokenizer asks for it (``add_bos_token`` in ``tokenizer_config.json`` beside
``tokenizer.json``, else the special tokens its post-processor puts before a text), every
window starts with it: ``[BOS] + seq_len - 1`` tokens of text. The text itself is encoded
without special tokens.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bitpress.errors import BitpressError, ModelLoadError, UsageError
from bitpress.onnx.inputs import InputSpec, input_specs

log = logging.getLogger(__name__)

GENAI_CONFIG = "genai_config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
_PAST_AXIS_WORDS = ("past", "seq", "len", "total")
# head size as exports name it: head_size, head_dim, kv_cache_dim (GenAI builder), ...
_HEAD_SIZE = re.compile(r"head_?(size|dim)|per_head|(^|_)dim$")
_LAYER = re.compile(r"(\d+)")


class KVCacheError(BitpressError):
    """The model's cache inputs cannot be filled (unknown sizes, a window that does not fit)."""


# -- companion files ----------------------------------------------------------------------------------
def search_folders(model_dir: Path, root: Path | None) -> list[Path]:
    """``model_dir`` and its parents up to ``root`` (the package's folder), nearest first.

    Without ``root`` (or with a ``root`` that does not hold ``model_dir``) only ``model_dir``:
    nothing above the model's own folder is ever read.
    """
    model_dir = Path(model_dir)
    if root is None:
        return [model_dir]
    root = Path(root)
    try:
        rel = model_dir.resolve().relative_to(root.resolve())
    except (ValueError, OSError):
        return [model_dir]
    out = [model_dir]
    for depth in range(len(rel.parts)):
        out.append(model_dir.parents[depth])
    return out


def companion(name: str, model_dir: Path, root: Path | None, what: str) -> Path | None:
    """The nearest ``name`` from ``model_dir`` up to ``root``, checked to stay inside ``root``.

    A file that is a link leaving the folder is refused (:class:`~bitpress.errors.UnsafePathError`).
    """
    from bitpress import paths

    folders = search_folders(model_dir, root)
    top = folders[-1]
    for folder in folders:
        found = paths.optional(top, str((folder / name).relative_to(top)), what)
        if found is not None:
            return found
    return None


def read_genai_config(model_dir: Path, root: Path | None = None) -> dict[str, Any] | None:
    """``genai_config.json`` of the model's folder, else of the package's root (never above)."""
    from bitpress import paths

    folders = search_folders(model_dir, root)
    cfg = companion(GENAI_CONFIG, model_dir, root, GENAI_CONFIG)
    if cfg is None:
        return None
    try:
        data = json.loads(paths.read_text(folders[-1], cfg, GENAI_CONFIG))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg} is not valid JSON: {exc}") from None
    from bitpress.models.package import check_genai_config

    check_genai_config(data, cfg.parent, require_decoder=False)  # its shape, and file names inside the folder
    return data


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


# -- text -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TextTokens:
    """A text encoded without special tokens, and the tokens each window starts with."""

    ids: np.ndarray
    bos: tuple[int, ...]
    tokenizer: Path


def load_tokenizer(path: Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(
            "text needs the 'tokenizers' package: pip install tokenizers (or bitpress[eval])"
        ) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception subclass for unreadable files
        raise UsageError(f"{path} is not a tokenizer.json the tokenizers package reads: {exc}") from None


def find_tokenizer(tokenizer: str | Path | None, folders: list[tuple[Path, Path | None]], hint: str) -> Path:
    """``tokenizer`` as given (a tokenizer.json or its folder), else the nearest tokenizer.json of a model.

    ``folders``: ``(model_dir, root)`` pairs searched in order, each from the model's folder up to
    its root (:func:`search_folders`); a tokenizer.json linking outside is refused.
    """
    if tokenizer:
        path = Path(tokenizer)
        if path.is_dir():
            path = path / TOKENIZER
        if not path.is_file():
            raise UsageError(f"no tokenizer at {path}; {hint} takes a tokenizer.json or its folder")
        return path
    for model_dir, root in folders:
        found = companion(TOKENIZER, model_dir, root, "tokenizer")
        if found is not None:
            return found
    where = " or ".join(dict.fromkeys(str(m) for m, _ in folders))
    raise UsageError(f"no tokenizer.json in {where}; pass {hint} (a tokenizer.json or its folder)")


def bos_tokens(tok: Any, tokenizer_path: Path) -> tuple[int, ...]:
    """What each window starts with: the BOS the tokenizer config asks for, else the post-processor's prefix.

    ``tokenizer_config.json`` beside the tokenizer (``add_bos_token``, ``bos_token``) decides when it
    says; otherwise the special tokens ``tokenizers`` puts before a text (a ``TemplateProcessing``
    such as ``<bos> $A``).
    """
    from bitpress import paths

    folder = tokenizer_path.parent
    cfg: dict[str, Any] = {}
    try:
        found = paths.optional(folder, TOKENIZER_CONFIG, "tokenizer config")
        if found is not None:
            loaded = json.loads(paths.read_text(folder, found, "tokenizer config"))
            cfg = loaded if isinstance(loaded, dict) else {}
    except (json.JSONDecodeError, ModelLoadError) as exc:
        log.warning("ignoring %s: %s", folder / TOKENIZER_CONFIG, exc)
    prefix = _template_prefix(tok)
    if "add_bos_token" in cfg:
        if not cfg["add_bos_token"]:
            return ()
        bos = cfg.get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
        tid = tok.token_to_id(bos) if isinstance(bos, str) else None
        if tid is not None:
            return (int(tid),)
        if prefix:
            return prefix
        log.warning("%s asks for a BOS token but names none the tokenizer knows; windows start without one",
                    folder / TOKENIZER_CONFIG)
        return ()
    return prefix


def _template_prefix(tok: Any) -> tuple[int, ...]:
    probe = "Hello world"
    plain = list(tok.encode(probe, add_special_tokens=False).ids)
    full = list(tok.encode(probe, add_special_tokens=True).ids)
    if not plain:
        return tuple(full)
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return tuple(full[:i])
    return ()


def tokenize(text: Path, tokenizer: Path) -> TextTokens:
    """``text`` encoded without special tokens, with the BOS :func:`bos_tokens` asks for."""
    tok = load_tokenizer(tokenizer)
    if not text.is_file():
        raise UsageError(f"text file not found: {text}")
    # the whole text is one stream cut into windows here: a tokenizer.json that truncates (encoders'
    # max_length 128) or pads would keep one window of it
    tok.no_truncation()
    tok.no_padding()
    ids = np.asarray(tok.encode(text.read_text(errors="replace"), add_special_tokens=False).ids, dtype=np.int64)
    bos = bos_tokens(tok, tokenizer)
    if bos:
        log.info("each window starts with token(s) %s, as the tokenizer in %s asks", list(bos), tokenizer.parent)
    return TextTokens(ids, bos, tokenizer)


def token_windows(tokens: TextTokens, seq_len: int, max_windows: int | None = None, *,
                  shorter: str = "one") -> np.ndarray:
    """Non-overlapping ``[n, seq_len]`` windows, each ``bos + seq_len - len(bos)`` text tokens.

    A text shorter than one window is one shorter window (``shorter="one"``) or an error
    (``shorter="error"``).
    """
    bos = np.asarray(tokens.bos, dtype=np.int64)
    body = seq_len - bos.size
    if body < 1:
        raise UsageError(f"a window of {seq_len} token(s) leaves no room for text after {bos.size} BOS token(s)")
    ids = tokens.ids
    if ids.size < body:
        if shorter == "error" or ids.size + bos.size < 2:
            raise UsageError(
                f"the text holds {ids.size} token(s), fewer than a window of {seq_len}"
                + (f" ({bos.size} of them BOS)" if bos.size else "")
            )
        log.warning("the text holds %d tokens, fewer than a window of %d: one window of %d", ids.size, seq_len,
                    ids.size + bos.size)
        body = int(ids.size)
    n = ids.size // body
    if max_windows is not None:
        n = min(n, max_windows)
    windows = ids[: n * body].reshape(n, body)
    if bos.size:
        windows = np.concatenate([np.broadcast_to(bos, (n, bos.size)), windows], axis=1)
    return windows


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
    "TextTokens",
    "bos_tokens",
    "cache_plan",
    "companion",
    "find_tokenizer",
    "ids_input",
    "is_past",
    "kv_hints",
    "read_genai_config",
    "search_folders",
    "token_windows",
    "tokenize",
    "window_feeds",
]
