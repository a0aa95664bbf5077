"""Moved: the MatMulBnb4 layout (NF4 / FP4 codebooks, encoding, decoding) is the host's :mod:`bitpress.onnx.bnb4`,
which ``bitpress eval`` reads too. This path keeps working for one release and warns when imported."""

from __future__ import annotations

import warnings

from bitpress.onnx.bnb4 import (
    BNB4_BLOCK_SIZES,
    BNB4_QUANT_TYPES,
    FP4_CODEBOOK,
    NF4_CODEBOOK,
    dequantize_bnb4,
    quantize_bnb4,
)

warnings.warn("bitpress_rtn.bnb4 moved to bitpress.onnx.bnb4; import from there", DeprecationWarning, stacklevel=2)

__all__ = ["BNB4_BLOCK_SIZES", "BNB4_QUANT_TYPES", "FP4_CODEBOOK", "NF4_CODEBOOK", "dequantize_bnb4", "quantize_bnb4"]
