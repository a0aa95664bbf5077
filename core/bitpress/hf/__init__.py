"""Hugging Face (PyTorch) models: quantize weights in place, save, reload, export to ONNX.

Importing this package does not import torch; the submodules that need it do
(:mod:`~bitpress.hf.qtensor`, :mod:`~bitpress.hf.quantize`, :mod:`~bitpress.hf.checkpoint`, and
:mod:`~bitpress.hf.export` inside its functions). See docs/huggingface.md.

May import: calibration, errors, executors, genai, interrupts, models, onnx, options, passes, paths,
quant, selection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def hf_to_onnx(model: Any, output: str | Path, **kwargs: Any) -> list[Path]:
    """Export a Hugging Face folder or :class:`~bitpress.hf.model.HfModel` to an ONNX folder.

    See :func:`bitpress.hf.export.hf_to_onnx`.
    """
    from bitpress.hf.export import hf_to_onnx as _export

    return _export(model, output, **kwargs)


__all__ = ["hf_to_onnx"]
