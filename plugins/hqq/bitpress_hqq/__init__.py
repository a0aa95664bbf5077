"""bitpress-hqq: Half-Quadratic Quantization for ONNX weights (numpy; a GPU only if present)."""

from __future__ import annotations

from bitpress.plugin import hookimpl
from bitpress_hqq.passes import HqqPass

__all__ = ["HqqPass"]


@hookimpl
def bitpress_register_passes(register):
    register(HqqPass)
