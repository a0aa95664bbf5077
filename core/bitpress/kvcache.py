"""Moved: KV-cache feeds are :mod:`bitpress.genai.kvcache`; a model's companion files and ``genai_config.json``
:mod:`bitpress.genai.package` (``read_genai_config`` is now ``find_genai_config`` there); text as token windows
:mod:`bitpress.calibration.text`.

This path keeps working for one release and warns when imported.
"""

from __future__ import annotations

import warnings

from bitpress.calibration.text import (
    TOKENIZER,
    TOKENIZER_CONFIG,
    TextTokens,
    bos_tokens,
    find_tokenizer,
    load_tokenizer,
    token_windows,
    tokenize,
)
from bitpress.genai.kvcache import (
    CachePlan,
    KVCacheError,
    PastFill,
    cache_plan,
    decoder_section,
    ids_input,
    is_past,
    kv_hints,
    window_feeds,
)
from bitpress.genai.package import GENAI_CONFIG, companion, search_folders
from bitpress.genai.package import find_genai_config as read_genai_config

warnings.warn("bitpress.kvcache moved to bitpress.genai.kvcache (the KV cache, feeds), bitpress.genai.package "
              "(companion files; read_genai_config is find_genai_config there) and bitpress.calibration.text "
              "(tokenizer, BOS, token windows); import them from there",
              DeprecationWarning, stacklevel=2)

__all__ = [
    "GENAI_CONFIG",
    "TOKENIZER",
    "TOKENIZER_CONFIG",
    "CachePlan",
    "KVCacheError",
    "PastFill",
    "TextTokens",
    "bos_tokens",
    "cache_plan",
    "companion",
    "decoder_section",
    "find_tokenizer",
    "ids_input",
    "is_past",
    "kv_hints",
    "load_tokenizer",
    "read_genai_config",
    "search_folders",
    "token_windows",
    "tokenize",
    "window_feeds",
]
