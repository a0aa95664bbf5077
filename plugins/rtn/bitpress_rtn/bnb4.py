"""Moved: the MatMulBnb4 layout (NF4 / FP4 codebooks, encoding, decoding) is the host's :mod:`bitpress.onnx.bnb4`,
which ``bitpress eval`` reads too (plugins: :mod:`bitpress.plugin` offers its names). This path keeps working for
one release and warns when imported."""

from __future__ import annotations

import warnings

from bitpress.plugin import (
    BNB4_BLOCK_SIZES,
    BNB4_QUANT_TYPES,
    FP4_CODEBOOK,
    NF4_CODEBOOK,
    dequantize_bnb4,
    quantize_bnb4,
)

warnings.warn("bitpress_rtn.bnb4 moved to bitpress.onnx.bnb4; plugins import its names from bitpress.plugin",
              DeprecationWarning, stacklevel=2)

__all__ = ["BNB4_BLOCK_SIZES", "BNB4_QUANT_TYPES", "FP4_CODEBOOK", "NF4_CODEBOOK", "dequantize_bnb4", "quantize_bnb4"]
