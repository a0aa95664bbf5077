"""Moved: calibration data is :mod:`bitpress.calibration.data` (the ``calibration`` package owns it).

This path keeps working for one release and warns when imported.
"""

from __future__ import annotations

import warnings

from bitpress.calibration.data import DataConfig, InputSpec, _npz, input_specs, iter_feeds, vocab_size
from bitpress.calibration.text import find_tokenizer, token_windows, tokenize
from bitpress.genai.kvcache import CachePlan, cache_plan, is_past, kv_hints, window_feeds
from bitpress.genai.package import find_genai_config as read_genai_config

warnings.warn("bitpress.data moved to bitpress.calibration.data; import DataConfig and iter_feeds from there",
              DeprecationWarning, stacklevel=2)

# the names bitpress.data offered: its own, and what it imported (the KV cache, text, a model's inputs)
__all__ = ["CachePlan", "DataConfig", "InputSpec", "_npz", "cache_plan", "find_tokenizer", "input_specs", "is_past",
           "iter_feeds", "kv_hints", "read_genai_config", "token_windows", "tokenize", "vocab_size", "window_feeds"]
