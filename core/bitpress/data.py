"""Calibration data, one option for every pass that needs data.

Sources:

* ``random``: inputs drawn from the model's signature (ids within the vocabulary read off
  the embedding table, masks of ones, floats from a normal). For smoke tests only: a warning
  says so.
* ``.npz`` files (one file, or a folder of them): each file holds arrays named like the
  model's inputs; a leading axis larger than the model's batch is split into samples.
* a text file (``.txt``) with a tokenizer (``tokenizer.json`` in the model's folder, or
  ``tokenizer``): windows of ``seq_len`` tokens give ``input_ids`` (and ``attention_mask``,
  ``position_ids`` when the model takes them). Needs the ``tokenizers`` package.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bitpress.errors import ConfigError, UsageError

log = logging.getLogger(__name__)

_NP = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.BOOL: np.bool_,
    onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.INT8: np.int8,
}


@dataclass
class DataConfig:
    """Where calibration inputs come from; ``source`` is ``random``, a .npz file/folder or a .txt."""

    source: str = "random"
    samples: int = 8
    seq_len: int = 128
    batch: int = 1
    tokenizer: str | None = None
    seed: int = 0

    @classmethod
    def from_value(cls, value: Any) -> DataConfig:
        if isinstance(value, DataConfig):
            return value
        if isinstance(value, str):
            return cls(source=value)
        if isinstance(value, dict):
            try:
                return cls(**value)
            except TypeError as exc:
                raise ConfigError(
                    f"data: {exc}; valid keys: source, samples, seq_len, batch, tokenizer, seed"
                ) from None
        raise ConfigError(f"data must be a source string or a mapping, got {value!r}")


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: type
    shape: tuple[int | str | None, ...]


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dtype = _NP.get(tt.elem_type, np.float32)
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        specs.append(InputSpec(vi.name, dtype, shape))
    return specs


def _vocab_size(model: onnx.ModelProto) -> int:
    """Rows of the first Gather table read by the ids (the embedding), else 100."""
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type in ("Gather", "GatherBlockQuantized") and node.input[0] in inits:
            return int(inits[node.input[0]].dims[0])
    return 100


def iter_feeds(
    model: onnx.ModelProto, config: DataConfig, model_dir: Path | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """Yield ``config.samples`` feeds for ONNX Runtime."""
    src = config.source
    specs = input_specs(model)
    if src == "random":
        log.warning("calibrating on random inputs: fine for smoke tests, not for real quality")
        yield from _random(specs, config, _vocab_size(model))
        return
    path = Path(src)
    if not path.exists():
        raise UsageError(f"calibration data {src!r} not found (use 'random', a .npz file/folder or a .txt file)")
    if path.is_dir() or path.suffix == ".npz":
        yield from _npz(path, specs, config)
        return
    if path.suffix in (".txt", ".cor", ".md", ".text"):
        yield from _text(path, specs, config, model_dir)
        return
    raise UsageError(f"calibration data {src!r}: expected 'random', a .npz file or folder, or a .txt file")


def _concrete(shape: tuple, batch: int, seq: int) -> tuple[int, ...]:
    out = []
    for i, d in enumerate(shape):
        if isinstance(d, int) and d > 0:
            out.append(d)
        else:
            out.append(batch if i == 0 else seq)
    return tuple(out)


def _random(specs: list[InputSpec], config: DataConfig, vocab: int) -> Iterator[dict[str, np.ndarray]]:
    rng = np.random.default_rng(config.seed)
    for _ in range(config.samples):
        feed = {}
        for s in specs:
            shape = _concrete(s.shape, config.batch, config.seq_len)
            lname = s.name.lower()
            if np.issubdtype(s.dtype, np.integer):
                if "mask" in lname:
                    feed[s.name] = np.ones(shape, s.dtype)
                elif "position" in lname:
                    feed[s.name] = np.broadcast_to(np.arange(shape[-1], dtype=s.dtype), shape).copy()
                else:
                    feed[s.name] = rng.integers(0, vocab, size=shape).astype(s.dtype)
            elif s.dtype == np.bool_:
                feed[s.name] = np.ones(shape, np.bool_)
            else:
                feed[s.name] = rng.standard_normal(shape).astype(s.dtype)
        yield feed


def _npz(path: Path, specs: list[InputSpec], config: DataConfig) -> Iterator[dict[str, np.ndarray]]:
    files = sorted(path.glob("*.npz")) if path.is_dir() else [path]
    if not files:
        raise UsageError(f"no .npz files in {path}")
    names = {s.name for s in specs}
    produced = 0
    for f in files:
        with np.load(f, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        missing = names - set(arrays)
        if missing:
            raise UsageError(f"{f.name} lacks inputs {sorted(missing)}; it has {sorted(arrays)}")
        n = len(next(iter(arrays.values())))
        step = max(1, config.batch)
        for i in range(0, n, step):
            yield {k: arrays[k][i : i + step] for k in names}
            produced += 1
            if produced >= config.samples:
                return


def _text(
    path: Path, specs: list[InputSpec], config: DataConfig, model_dir: Path | None
) -> Iterator[dict[str, np.ndarray]]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("text calibration data needs the 'tokenizers' package: pip install tokenizers") from None
    tok_path = Path(config.tokenizer) if config.tokenizer else (model_dir or path.parent)
    if tok_path.is_dir():
        tok_path = tok_path / "tokenizer.json"
    if not tok_path.is_file():
        raise UsageError(f"no tokenizer.json at {tok_path}; pass data.tokenizer (a tokenizer.json or its folder)")
    tokenizer = Tokenizer.from_file(str(tok_path))
    ids = np.array(tokenizer.encode(path.read_text(errors="replace")).ids, dtype=np.int64)
    if ids.size < config.seq_len:
        raise UsageError(f"{path.name} holds {ids.size} tokens, fewer than seq_len={config.seq_len}")
    by_name = {s.name: s for s in specs}
    windows = ids[: ids.size // config.seq_len * config.seq_len].reshape(-1, config.seq_len)
    for i in range(0, min(len(windows), config.samples * config.batch), config.batch):
        w = windows[i : i + config.batch]
        feed: dict[str, np.ndarray] = {}
        for name, s in by_name.items():
            lname = name.lower()
            if "input_ids" in lname or lname == "ids":
                feed[name] = w.astype(s.dtype)
            elif "mask" in lname:
                feed[name] = np.ones(w.shape, s.dtype)
            elif "position" in lname:
                feed[name] = np.broadcast_to(np.arange(w.shape[1], dtype=s.dtype), w.shape).copy()
            else:
                raise UsageError(f"text calibration cannot fill input {name!r}; give .npz files instead")
        yield feed
