"""Which .onnx file to evaluate, what it takes as input, and the feeds for both models.

Models with a KV cache (ONNX Runtime GenAI builder, Optimum, mobius exports) take
``past_key_values.{i}.key`` / ``.value`` (or similar ``past*`` inputs). The evaluation runs the
whole window in one call from an empty cache, or from zeros of a fixed capacity where the model
needs one (a sliding-window or static cache, masked out). The cache logic, the token windows and
BOS are :mod:`bitpress.genai.kvcache`'s and :mod:`bitpress.calibration.text`'s, shared with calibration data
(:mod:`bitpress.calibration.data`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bitpress.calibration import data as calibration_data
from bitpress.calibration import text as calibration_text
from bitpress.calibration.data import DataConfig, iter_feeds
from bitpress.calibration.text import TextTokens
from bitpress.errors import UsageError
from bitpress.evaluate.result import EvalError, ModelMismatchError
from bitpress.genai import kvcache
from bitpress.genai.kvcache import KVCacheError, is_past
from bitpress.genai.package import ModelFile, resolve_model  # noqa: F401 (their home now: bench resolves too)
from bitpress.onnx.inputs import input_specs

log = logging.getLogger(__name__)


# -- which file -------------------------------------------------------------------------------------
# -- signature --------------------------------------------------------------------------------------
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


# -- feeds ------------------------------------------------------------------------------------------
class _DropRandomWarning(logging.Filter):
    """bitpress.calibration.data warns about *calibrating* on random data; the evaluation notes it itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("calibrating on random inputs")


def signature_stub(model: onnx.ModelProto, drop: set[str]) -> onnx.ModelProto:
    """A weightless copy of ``model``'s signature without the ``drop`` inputs, for bitpress.calibration.data.

    bitpress.calibration.data fills every graph input and reads the vocabulary off the embedding table's
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


def cache_plan(model: onnx.ModelProto, hints: dict[str, Any]) -> kvcache.CachePlan:
    try:
        return kvcache.cache_plan(model, hints)
    except KVCacheError as exc:
        raise EvalError(str(exc)) from None


def cache_note(model: onnx.ModelProto, hints: dict[str, Any]) -> str | None:
    """What the report says about the cache (empty, or zeros of a fixed capacity)."""
    return cache_plan(model, hints).note()


def data_feeds(
    model: onnx.ModelProto, config: DataConfig, model_dir: Path, hints: dict[str, Any]
) -> list[dict[str, np.ndarray]]:
    """``config.count`` feeds from bitpress.calibration.data (random, .npz, text), with the cache filled."""
    plan = cache_plan(model, hints)
    # bitpress.calibration.data fills what the stub takes; the cache is filled here, as this evaluation sees it
    # (both models' genai_config.json), not as model_dir's alone would
    stub = signature_stub(model, {p.name for p in plan.past})
    logger = logging.getLogger(calibration_data.__name__)
    quiet = _DropRandomWarning()
    logger.addFilter(quiet)
    try:
        feeds = [plan.fill(f) for f in iter_feeds(stub, config, model_dir)]
    finally:
        logger.removeFilter(quiet)
    if not feeds:
        raise UsageError(f"the data {config.source!r} gave no samples")
    return feeds


# -- text -------------------------------------------------------------------------------------------
def find_tokenizer(tokenizer: str | Path | None, folders: list[Path]) -> Path:
    """``tokenizer`` (a tokenizer.json or its folder), else tokenizer.json in the models' folders."""
    return calibration_text.find_tokenizer(tokenizer, [(f, f) for f in dict.fromkeys(folders)], "--tokenizer")


def tokenize(text: Path, tokenizer: Path) -> TextTokens:
    """The text's tokens (no special tokens) and the BOS each window starts with, if any."""
    return calibration_text.tokenize(text, tokenizer)


def token_windows(tokens: TextTokens, seq_len: int, max_windows: int | None) -> np.ndarray:
    """Non-overlapping ``[n, seq_len]`` windows (BOS first when the tokenizer asks); a text shorter
    than one window is one window."""
    return calibration_text.token_windows(tokens, seq_len, max_windows, shorter="one")


def ids_input(model: onnx.ModelProto) -> str:
    specs = [s for s in input_specs(model) if not is_past(s)]
    name = kvcache.ids_input(specs)
    if name is None:
        raise UsageError(
            f"perplexity needs a causal LM taking input_ids; this model takes {', '.join(s.name for s in specs)}"
        )
    return name


def text_feeds(
    model: onnx.ModelProto, windows: np.ndarray, batch: int, hints: dict[str, Any]
) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """``(ids, feed)`` per batch of windows: ids, masks of ones, positions 0..S-1, the cache."""
    ids_input(model)
    plan = cache_plan(model, hints)
    try:
        yield from kvcache.window_feeds(input_specs(model), plan, windows, batch, "perplexity")
    except KVCacheError as exc:
        raise EvalError(str(exc)) from None
