"""bitpress-kquant: llama.cpp's k-quant search for ONNX weights, and the Q4_K_M recipe."""

from __future__ import annotations

from bitpress.plugin import hookimpl
from bitpress_kquant.passes import KQuantPass, Q4KMPass

__all__ = ["KQuantPass", "Q4KMPass"]


@hookimpl
def bitpress_register_passes(register):
    register(KQuantPass)
    register(Q4KMPass)
    # Hugging Face (PyTorch) passes: their modules import torch only when they run
    from bitpress_kquant.hf_passes import KQuantHfPass

    register(KQuantHfPass)
