"""Which .onnx file to evaluate, what it takes as input, and the feeds for both models.

Models with a KV cache (ONNX Runtime GenAI builder, Optimum, mobius exports) take
``past_key_values.{i}.key`` / ``.value`` (or similar ``past*`` inputs). The evaluation runs the
whole window in one call from an empty cache: every past input gets a length of 0 along its
past-sequence axis, and the attention mask (over past + current) is then as long as the window.
Sizes of the other axes come from the input's dims (numbers, or names such as ``batch_size``)
and, for symbolic head counts / sizes, from ``genai_config.json``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bitpress.data import DataConfig, InputSpec, input_specs, iter_feeds
from bitpress.errors import ModelLoadError, UsageError
from bitpress.evaluate.result import EvalError, ModelMismatchError

log = logging.getLogger(__name__)

GENAI_CONFIG = "genai_config.json"
_PAST_AXIS_WORDS = ("past", "seq", "len", "total")
# head size as exports name it: head_size, head_dim, kv_cache_dim (GenAI builder), ...
_HEAD_SIZE = re.compile(r"head_?(size|dim)|per_head|(^|_)dim$")


# -- which file -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFile:
    """The .onnx file to run and the folder its companions (tokenizer, genai_config) live in."""

    path: Path
    root: Path
    genai: dict[str, Any] | None

    def kv_hints(self) -> dict[str, int]:
        """Head count / head size from genai_config.json, keyed by the dim names exports use."""
        dec = ((self.genai or {}).get("model") or {}).get("decoder") or {}
        hints: dict[str, int] = {}
        heads = dec.get("num_key_value_heads") or dec.get("num_attention_heads")
        if isinstance(heads, int):
            hints["heads"] = heads
        size = dec.get("head_size")
        if not isinstance(size, int) and isinstance(dec.get("hidden_size"), int) and dec.get("num_attention_heads"):
            size = dec["hidden_size"] // dec["num_attention_heads"]
        if isinstance(size, int):
            hints["head_size"] = size
        return hints


def resolve_model(path: str | Path, what: str) -> ModelFile:
    """An .onnx file as given, or the decoder of a folder (genai_config.json, else its only .onnx)."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{what} model not found: {path}")
    if path.is_file():
        return ModelFile(path, path.parent, _genai_config(path.parent))
    genai = _genai_config(path)
    filename = (((genai or {}).get("model") or {}).get("decoder") or {}).get("filename")
    if filename:
        file = path / filename
        if not file.is_file():
            raise ModelLoadError(f"{path / GENAI_CONFIG} names the decoder {filename!r}, which is not in {path}")
        return ModelFile(file, path, genai)
    found = sorted(p for p in path.rglob("*.onnx") if p.is_file())
    if not found:
        raise ModelLoadError(f"{path} is a folder without any .onnx model")
    if len(found) > 1:
        names = ", ".join(p.relative_to(path).as_posix() for p in found)
        raise UsageError(f"{path} holds several models ({names}); pass the .onnx file to evaluate")
    return ModelFile(found[0], path, genai)


def _genai_config(folder: Path) -> dict[str, Any] | None:
    cfg = folder / GENAI_CONFIG
    if not cfg.is_file():
        return None
    try:
        data = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{cfg} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else None


# -- signature --------------------------------------------------------------------------------------
def is_past(spec: InputSpec) -> bool:
    """A KV-cache input: past_key_values.0.key, past_key_values.0, past_0, past_key.0 ..."""
    return spec.name.lower().startswith("past") and np.issubdtype(spec.dtype, np.floating)


def output_names(model: onnx.ModelProto) -> list[str]:
    return [o.name for o in model.graph.output]


def check_same_signature(q: onnx.ModelProto, r: onnx.ModelProto) -> None:
    """Both models must take the same inputs (names and types) and give the same outputs."""
    qi = {s.name: np.dtype(s.dtype) for s in input_specs(q)}
    ri = {s.name: np.dtype(s.dtype) for s in input_specs(r)}
    if set(qi) != set(ri):
        raise ModelMismatchError(
            "the models take different inputs: " + _diff(set(qi), set(ri)) + "; evaluate a model against its own "
            "float export"
        )
    bad = [f"{n} ({qi[n]} vs {ri[n]})" for n in sorted(qi) if qi[n] != ri[n]]
    if bad:
        raise ModelMismatchError(f"inputs differ in type between the models: {', '.join(bad)}")
    qo, ro = output_names(q), output_names(r)
    if set(qo) != set(ro):
        raise ModelMismatchError("the models give different outputs: " + _diff(set(qo), set(ro)))


def _diff(q: set[str], r: set[str]) -> str:
    parts = []
    if q - r:
        parts.append(f"only QUANTIZED has {', '.join(sorted(q - r))}")
    if r - q:
        parts.append(f"only the reference has {', '.join(sorted(r - q))}")
    return "; ".join(parts)


def vocab_size(model: onnx.ModelProto) -> int | None:
    """Rows of the table gathered by the first embedding lookup (float or block-quantized)."""
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type in ("Gather", "GatherBlockQuantized") and node.input and node.input[0] in inits:
            dims = inits[node.input[0]].dims
            if len(dims) >= 2:
                return int(dims[0])
    return None


# -- KV cache ---------------------------------------------------------------------------------------
def past_shape(spec: InputSpec, batch: int, hints: dict[str, int]) -> tuple[int, ...]:
    """The shape of an empty cache for ``spec``: 0 along the past axis, the rest from its dims."""
    shape: list[int | None] = []
    past_axis = None
    for i, d in enumerate(spec.shape):
        if isinstance(d, int) and d > 0:
            shape.append(d)
            continue
        name = (d or "").lower() if isinstance(d, str) else ""
        if "batch" in name:
            shape.append(batch)
        elif any(w in name for w in _PAST_AXIS_WORDS):
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
    if past_axis is None and len(shape) >= 3 and shape[-2] is None:
        # an unnamed dynamic dim where [batch, heads, past, head_size] keeps the past length
        shape[-2] = 0
        past_axis = len(shape) - 2
    if past_axis is None:
        raise EvalError(
            f"input {spec.name} {list(spec.shape)} has no dynamic past-sequence axis (a static KV cache); "
            "export the model with a dynamic past length to evaluate it"
        )
    unknown = [i for i, s in enumerate(shape) if s is None]
    if unknown:
        dims = ", ".join(f"{i} ({spec.shape[i] or 'unnamed'})" for i in unknown)
        raise EvalError(
            f"cannot tell the size of dim {dims} of the cache input {spec.name}; put a genai_config.json with "
            "num_key_value_heads and head_size beside the model"
        )
    return tuple(int(s) for s in shape)  # type: ignore[arg-type]


def add_empty_past(feed: dict[str, np.ndarray], past: list[InputSpec], hints: dict[str, int]) -> dict[str, np.ndarray]:
    """``feed`` plus a zero-length cache for every past input."""
    if not past:
        return feed
    batch = next((a.shape[0] for a in feed.values() if a.ndim), 1)
    out = dict(feed)
    for spec in past:
        out[spec.name] = np.zeros(past_shape(spec, batch, hints), spec.dtype)
    return out


# -- feeds ------------------------------------------------------------------------------------------
def signature_stub(model: onnx.ModelProto, drop: set[str]) -> onnx.ModelProto:
    """A weightless copy of ``model``'s signature without the ``drop`` inputs, for bitpress.data.

    bitpress.data fills every graph input and reads the vocabulary off the embedding table's
    dims; the cache inputs are ours to fill, and copying the weights would cost memory.
    """
    stub = onnx.ModelProto()
    stub.ir_version = model.ir_version
    stub.opset_import.extend(model.opset_import)
    inits = {t.name: t for t in model.graph.initializer}
    stub.graph.input.extend(vi for vi in model.graph.input if vi.name not in drop and vi.name not in inits)
    for node in model.graph.node:
        if node.op_type in ("Gather", "GatherBlockQuantized") and node.input and node.input[0] in inits:
            stub.graph.node.add().CopyFrom(node)
            t = inits[node.input[0]]
            stub.graph.initializer.add(name=t.name, dims=list(t.dims), data_type=t.data_type)
            break
    return stub


class _DropRandomWarning(logging.Filter):
    """bitpress.data warns about *calibrating* on random data; the evaluation notes it itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("calibrating on random inputs")


def data_feeds(
    model: onnx.ModelProto, config: DataConfig, model_dir: Path, hints: dict[str, int]
) -> list[dict[str, np.ndarray]]:
    """``config.samples`` feeds from bitpress.data (random, .npz, text), with empty caches added."""
    past = [s for s in input_specs(model) if is_past(s)]
    stub = signature_stub(model, {s.name for s in past})
    logger = logging.getLogger("bitpress.data")
    quiet = _DropRandomWarning()
    logger.addFilter(quiet)
    try:
        feeds = list(iter_feeds(stub, config, model_dir))
    finally:
        logger.removeFilter(quiet)
    if not feeds:
        raise UsageError(f"the data {config.source!r} gave no samples")
    return [add_empty_past(f, past, hints) for f in feeds]


# -- text -------------------------------------------------------------------------------------------
def find_tokenizer(tokenizer: str | Path | None, folders: list[Path]) -> Path:
    """``tokenizer`` (a tokenizer.json or its folder), else tokenizer.json in the models' folders."""
    if tokenizer:
        path = Path(tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise UsageError(f"no tokenizer at {path}; --tokenizer takes a tokenizer.json or its folder")
        return path
    for folder in folders:
        if (folder / "tokenizer.json").is_file():
            return folder / "tokenizer.json"
    where = " or ".join(str(f) for f in dict.fromkeys(folders))
    raise UsageError(f"no tokenizer.json in {where}; pass --tokenizer (a tokenizer.json or its folder)")


def tokenize(text: Path, tokenizer: Path) -> np.ndarray:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(
            "perplexity needs the 'tokenizers' package: pip install tokenizers (or bitpress[eval])"
        ) from None
    if not text.is_file():
        raise UsageError(f"text file not found: {text}")
    try:
        tok = Tokenizer.from_file(str(tokenizer))
    except Exception as exc:  # tokenizers raises its own Exception subclass for unreadable files
        raise UsageError(f"{tokenizer} is not a tokenizer.json the tokenizers package reads: {exc}") from None
    return np.asarray(tok.encode(text.read_text(errors="replace")).ids, dtype=np.int64)


def token_windows(ids: np.ndarray, seq_len: int, max_windows: int | None) -> np.ndarray:
    """Non-overlapping ``[n, seq_len]`` windows; a text shorter than one window is one window."""
    if ids.size < 2:
        raise UsageError(f"the text holds {ids.size} token(s); perplexity needs at least 2")
    if ids.size < seq_len:
        log.warning("the text holds %d tokens, fewer than --seq-len %d: one window of %d", ids.size, seq_len, ids.size)
        seq_len = int(ids.size)
    n = ids.size // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    return ids[: n * seq_len].reshape(n, seq_len)


def ids_input(model: onnx.ModelProto) -> str:
    specs = [s for s in input_specs(model) if not is_past(s)]
    for s in specs:
        if s.name == "input_ids" or ("input_ids" in s.name.lower() and np.issubdtype(s.dtype, np.integer)):
            return s.name
    raise UsageError(
        f"perplexity needs a causal LM taking input_ids; this model takes {', '.join(s.name for s in specs)}"
    )


def text_feeds(
    model: onnx.ModelProto, windows: np.ndarray, batch: int, hints: dict[str, int]
) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """``(ids, feed)`` per batch of windows: ids, masks of ones, positions 0..S-1, empty caches."""
    specs = input_specs(model)
    past = [s for s in specs if is_past(s)]
    ids_name = ids_input(model)
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        feed: dict[str, np.ndarray] = {}
        for s in specs:
            lname = s.name.lower()
            if s in past:
                continue
            if s.name == ids_name:
                feed[s.name] = w.astype(s.dtype)
            elif "mask" in lname:
                # over past + current; the past is empty
                feed[s.name] = np.ones(w.shape, s.dtype)
            elif "position" in lname:
                feed[s.name] = np.broadcast_to(np.arange(w.shape[1], dtype=s.dtype), w.shape).copy()
            else:
                raise UsageError(f"perplexity cannot fill the input {s.name!r} from text")
        yield w, add_empty_past(feed, past, hints)
