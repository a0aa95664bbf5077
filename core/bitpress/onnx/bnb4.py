"""NF4 / FP4 (bitsandbytes-style) weights in ONNX Runtime's ``com.microsoft.MatMulBnb4`` layout: encoding and decoding.

The rtn plugin's ``bnb4`` pass writes it; ``bitpress eval`` reads it back (:mod:`bitpress.evaluate.weights`).

Layout the kernel reads (attributes K, N, block_size 16..256, quant_type 0=FP4 1=NF4):

* the weight ``[K, N]`` is transposed to ``[N, K]`` and flattened; blocks of ``block_size`` run
  over that flat array (a block may span two rows when K is not a multiple of it);
* ``absmax``: ``[ceil(N*K / block_size)]``, the block's largest magnitude (float32 on CPU);
* ``B``: uint8 ``[ceil(N*K / 2)]``, two 4-bit codes per byte, the EARLIER element in the HIGH
  nibble (the opposite of MatMulNBits); an odd tail is padded with the code of 0.0;
* value = ``codebook[code] * absmax``. Codes are chosen for ``w * (1 / absmax)`` by ORT's fixed
  float32 decision thresholds (midpoints, a value on a threshold goes to the lower code).
"""

from __future__ import annotations

import numpy as np

BNB4_QUANT_TYPES = {"fp4": 0, "nf4": 1}
BNB4_BLOCK_SIZES = (16, 32, 64, 128, 256)

# NF4 code -> value, ascending, and the thresholds between neighbours.
NF4_CODEBOOK = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=np.float32,
)  # fmt: skip
_NF4_THRESHOLDS = np.array(
    [
        -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
        -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
        0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
        0.5016634166240692, 0.6427869200706482, 0.8614784181118011,
    ],
    dtype=np.float32,
)  # fmt: skip

# FP4 (e2m1 with bias 3, scaled by 1/12): bit 3 is the sign, codes 0-7 are not in value order.
FP4_CODEBOOK = np.array(
    [0.0, 0.005208333333, 0.66666667, 1.0, 0.33333333, 0.5, 0.16666667, 0.25], dtype=np.float32
)
FP4_CODEBOOK = np.concatenate([FP4_CODEBOOK, -FP4_CODEBOOK])
# Magnitude thresholds, and the code of each magnitude interval in ascending order.
_FP4_THRESHOLDS = np.array(
    [0.00260417, 0.0859375, 0.20833333, 0.29166667, 0.4166667, 0.583333, 0.8333333],
    dtype=np.float32,
)
_FP4_CODES_BY_MAGNITUDE = np.array([0, 1, 6, 7, 4, 5, 2, 3], dtype=np.uint8)


def _quant_type_id(quant_type: str) -> int:
    try:
        return BNB4_QUANT_TYPES[quant_type.lower()]
    except KeyError:
        raise ValueError(f"quant_type must be 'fp4' or 'nf4', got {quant_type!r}") from None


def _codes(x: np.ndarray, qt: int) -> np.ndarray:
    # searchsorted 'left' counts thresholds strictly below x: ties take the lower code like ORT.
    if qt == BNB4_QUANT_TYPES["nf4"]:
        return np.searchsorted(_NF4_THRESHOLDS, x, side="left").astype(np.uint8)
    mag = _FP4_CODES_BY_MAGNITUDE[np.searchsorted(_FP4_THRESHOLDS, np.abs(x), side="left")]
    return mag | np.where(x < 0, np.uint8(8), np.uint8(0))


def quantize_bnb4(
    weight_kn: np.ndarray, block_size: int, quant_type: str
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a MatMul weight ``[K, N]`` (float32/float16) to ``(packed_b, absmax)``.

    ``absmax`` has the weight's dtype (use float32 for ORT's CPU kernel).
    """
    qt = _quant_type_id(quant_type)
    if block_size not in BNB4_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BNB4_BLOCK_SIZES}, got {block_size}")
    w = np.asarray(weight_kn)
    if w.ndim != 2 or w.dtype not in (np.float32, np.float16):
        raise ValueError(f"weight must be a 2-D float32/float16 array, got {w.dtype} {w.shape}")
    flat = w.T.astype(np.float32).reshape(-1)
    numel = flat.size
    n_blocks = -(-numel // block_size)
    # Zero padding neither changes absmax nor the tail byte (ORT quantizes 0.0 there too).
    blocks = np.zeros(n_blocks * block_size, np.float32)
    blocks[:numel] = flat
    blocks = blocks.reshape(n_blocks, block_size)
    absmax = np.abs(blocks).max(axis=1)
    with np.errstate(divide="ignore"):
        recip = np.where(absmax != 0, np.float32(1) / absmax, np.float32(0)).astype(np.float32)
    codes = _codes(blocks * recip[:, None], qt).reshape(-1)
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed[: (numel + 1) // 2].astype(np.uint8), absmax.astype(w.dtype)


def dequantize_bnb4(
    packed_b: np.ndarray, absmax: np.ndarray, k: int, n: int, block_size: int, quant_type: str
) -> np.ndarray:
    """float32 ``[K, N]`` weight encoded by :func:`quantize_bnb4`'s output."""
    qt = _quant_type_id(quant_type)
    book = NF4_CODEBOOK if qt == BNB4_QUANT_TYPES["nf4"] else FP4_CODEBOOK
    p = np.asarray(packed_b, dtype=np.uint8)
    codes = np.stack([p >> 4, p & 0x0F], axis=-1).reshape(-1)[: n * k]
    per_elem = np.arange(n * k) // block_size
    values = book[codes] * np.asarray(absmax, dtype=np.float32)[per_elem]
    return np.ascontiguousarray(values.reshape(n, k).T)
