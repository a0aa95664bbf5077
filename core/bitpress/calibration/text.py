"""Text as calibration data: a tokenizer found beside the model, BOS, windows of ``seq_len`` tokens.

One module for every place that runs a language model on a text: calibration data
(:mod:`bitpress.calibration.data`, and the Hugging Face path's :mod:`bitpress.hf.layer_inputs`) and
``bitpress eval``'s perplexity (:mod:`bitpress.evaluate.feeds`), so both see the same windows. A
window's feeds (ids, mask, positions, an empty KV cache) are
:func:`bitpress.genai.kvcache.window_feeds`'s.

**Tokenizer.** ``tokenizer.json`` as given, else the nearest one from the model's folder up to the
package's (never above it; a link leaving the folder is refused). Needs the ``tokenizers``
package.

**BOS.** When the tokenizer asks for it (``add_bos_token`` in ``tokenizer_config.json`` beside
``tokenizer.json``, else the special tokens its post-processor puts before a text), every
window starts with it: ``[BOS] + seq_len - 1`` tokens of text. The text itself is encoded
without special tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bitpress import paths
from bitpress.errors import ModelLoadError, UsageError
from bitpress.genai.package import companion

log = logging.getLogger(__name__)

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


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
            "text needs the 'tokenizers' package: pip install tokenizers (bitpress's gptq, awq, kquant, hqq and eval "
            "extras bring it)"
        ) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception subclass for unreadable files
        raise UsageError(f"{path} is not a tokenizer.json the tokenizers package reads: {exc}") from None


def find_tokenizer(tokenizer: str | Path | None, folders: list[tuple[Path, Path | None]], hint: str) -> Path:
    """``tokenizer`` as given (a tokenizer.json or its folder), else the nearest tokenizer.json of a model.

    ``folders``: ``(model_dir, root)`` pairs searched in order, each from the model's folder up to
    its root (:func:`bitpress.genai.package.search_folders`); a tokenizer.json linking outside is refused.
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
    folder = tokenizer_path.parent
    cfg = _tokenizer_config(folder)
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


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` beside the tokenizer, or ``{}`` (absent or unreadable: logged)."""
    try:
        found = paths.optional(folder, TOKENIZER_CONFIG, "tokenizer config")
        if found is not None:
            loaded = json.loads(paths.read_text(folder, found, "tokenizer config"))
            return loaded if isinstance(loaded, dict) else {}
    except (json.JSONDecodeError, ModelLoadError) as exc:
        log.warning("ignoring %s: %s", folder / TOKENIZER_CONFIG, exc)
    return {}


#: document separators tried, in order, when a tokenizer config names neither a BOS nor an EOS token
_SEPARATORS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


def start_tokens(tok: Any, tokenizer_path: Path) -> tuple[int, ...]:
    """What text the model writes itself starts from: the windows' BOS (:func:`bos_tokens`), else the
    token that separates documents (the config's ``bos_token``, then ``eos_token``, then a usual name)."""
    bos = bos_tokens(tok, tokenizer_path)
    if bos:
        return bos
    cfg = _tokenizer_config(tokenizer_path.parent)
    names: list[Any] = [cfg.get("bos_token"), cfg.get("eos_token"), *_SEPARATORS]
    for name in names:
        if isinstance(name, dict):
            name = name.get("content")
        tid = tok.token_to_id(name) if isinstance(name, str) and name else None
        if tid is not None:
            return (int(tid),)
    raise UsageError(f"the tokenizer in {tokenizer_path.parent} names no BOS or end-of-text token for the model "
                     "to start its own calibration text from; give a text (data: source) instead")


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


__all__ = [
    "TOKENIZER",
    "TOKENIZER_CONFIG",
    "TextTokens",
    "bos_tokens",
    "find_tokenizer",
    "load_tokenizer",
    "start_tokens",
    "token_windows",
    "tokenize",
]
