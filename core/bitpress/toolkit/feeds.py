"""The host's calibration data (``--data``) as what toolkits consume: lists of feeds and readers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from bitpress.calibration.data import DataConfig, iter_feeds
from bitpress.errors import UsageError
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.inputs import input_specs

Feed = dict[str, np.ndarray]


class FeedReader:
    """ONNX Runtime's ``CalibrationDataReader`` interface over a list of feeds.

    Toolkits call ``get_next()`` until it returns ``None``; some ``rewind()`` (or iterate, or
    take ``len``) to run the data twice.
    """

    def __init__(self, feeds: list[Feed]) -> None:
        self.feeds = feeds
        self._it: Iterator[Feed] = iter(feeds)

    def get_next(self) -> Feed | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self.feeds)

    def __len__(self) -> int:
        return len(self.feeds)

    def __iter__(self) -> Iterator[Feed]:
        return iter(self.feeds)


def calibration_feeds(model: OnnxModel, data: Any, *, who: str = "static quantization") -> list[Feed]:
    """The host's calibration data (``context.data``) for ``model`` as a list of feeds.

    ``who`` names the pass in the error raised when no data was given.
    """
    if data is None:
        raise UsageError(
            f"{who} needs calibration data: give --data (random, a .npz file or folder, or a .txt "
            "file with a tokenizer) or 'data:' in the config"
        )
    config = DataConfig.from_value(data)
    feeds = list(iter_feeds(model.proto, config, model.source.parent, root=getattr(model, "package_root", None),
                            handle=model))
    if not feeds:
        raise UsageError(f"calibration data {config.source!r} gave no samples")
    return feeds


def placeholder_feeds(model: OnnxModel) -> list[Feed]:
    """One all-zero feed, for toolkits that demand a non-empty reader in a mode that never runs it."""
    feed = {}
    for spec in input_specs(model.proto):
        shape = tuple(d if isinstance(d, int) and d > 0 else (1 if i == 0 else 8) for i, d in enumerate(spec.shape))
        feed[spec.name] = np.zeros(shape, dtype=spec.dtype)
    return [feed]


def split_feeds(feeds: list[Feed], held_back: float) -> tuple[list[Feed], list[Feed]]:
    """``(calibration, held back)``: the last ``held_back`` fraction (at least one) kept for scoring."""
    if not 0 < held_back < 1:
        raise UsageError(f"held-back fraction must be between 0 and 1, got {held_back}")
    if len(feeds) < 2:
        raise UsageError(f"scoring on held-back data needs at least 2 calibration samples, got {len(feeds)}")
    n_held = max(1, round(len(feeds) * held_back))
    return feeds[:-n_held], feeds[-n_held:]
