"""GGUF quantized blocks as ONNX Runtime's block-quantized form: integers, block scales, zero points.

ONNX Runtime's ``MatMulNBits`` (and ``GatherBlockQuantized``) compute a weight as
``(q - zero_point) * scale`` per block along K. Every llama.cpp type in use has that form once
its super-blocks are expanded into their sub-blocks:

======  =====  =====  ===========  ==========================================================
type    bits   block  zero point   llama.cpp's value (f16 d, dmin, m read as float32)
======  =====  =====  ===========  ==========================================================
Q4_0    4      32     8 (uint8)    ``d * (q - 8)``
Q4_1    4      32     float        ``d * q + m``
Q5_0    8      32     16 (uint8)   ``d * (q - 16)``, q 5-bit
Q5_1    8      32     float        ``d * q + m``, q 5-bit
Q8_0    8      32     128 (uint8)  ``d * q``, q int8 (stored as q + 128)
Q2_K    2      16     float        ``d * sc * q - dmin * m``, 4-bit sc / m per 16
Q3_K    4      16     4 (uint8)    ``d * sc * q``, q in -4..3 (stored as q + 4), 6-bit signed sc
Q4_K    4      32     float        ``d * sc * q - dmin * m``, 6-bit sc / m per 32
Q5_K    8      32     float        as Q4_K, q 5-bit
Q6_K    8      16     32 (uint8)   ``d * sc * (q - 32)``, q 6-bit, int8 sc per 16
======  =====  =====  ===========  ==========================================================

Integer zero points give llama.cpp's values bit for bit (the same float32 products). A float
minimum ``M`` (``w = s * q - M``) is the float zero point ``z = M / s`` of :meth:`Blocks.values`,
which rounds once more than llama.cpp (a few float32 ulps; the tests measure the worst). What the
conversion writes instead (:func:`integer_form`, ONNX Runtime's fast kernels, see
:mod:`bitpress.onnx.correction`) is ``s * (q - zi) + C`` with uint8 ``zi = round(z)`` and
``C = s * zi - M`` rounded once from the GGUF's own ``s`` and ``M``: llama.cpp's value bit for bit
wherever ``C`` is a float32 (measured: every random block the tests draw), else within 1 ulp.
``GatherBlockQuantized`` takes integer zero points only, so an embedding table of a float-minimum
type (Q4_1, Q2_K, Q4_K, Q5_x) cannot be gathered from its blocks. A block whose scale is zero but
whose minimum is not (every value ``-M``) has no ``M / s``: it is written exactly as ``(0 - 1) * M``
(scale ``M``, zero point 1, integers 0) and counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256


@dataclass(frozen=True)
class TypeInfo:
    name: str
    elements: int  # per GGUF block
    nbytes: int  # per GGUF block
    bits: int  # of the ONNX integers
    block: int  # ONNX block size (the sub-block)
    float_zero: bool  # zero points are float (a minimum), else a fixed integer

    @property
    def gatherable(self) -> bool:
        """Whether GatherBlockQuantized can read the type as an embedding table (integer zero points)."""
        return not self.float_zero and self.bits in (4, 8)


TYPES: dict[str, TypeInfo] = {t.name: t for t in (
    TypeInfo("Q4_0", 32, 18, 4, 32, False),
    TypeInfo("Q4_1", 32, 20, 4, 32, True),
    TypeInfo("Q5_0", 32, 22, 8, 32, False),
    TypeInfo("Q5_1", 32, 24, 8, 32, True),
    TypeInfo("Q8_0", 32, 34, 8, 32, False),
    TypeInfo("Q2_K", QK_K, 84, 2, 16, True),
    TypeInfo("Q3_K", QK_K, 110, 4, 16, False),
    TypeInfo("Q4_K", QK_K, 144, 4, 32, True),
    TypeInfo("Q5_K", QK_K, 176, 8, 32, True),
    TypeInfo("Q6_K", QK_K, 210, 8, 16, False),
)}
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass
class Blocks:
    """``w = (ints - zero) * scale`` per sub-block: ints ``[n, elements]`` uint8, scale / zero
    ``[n, elements / block]`` (zero float32 or uint8); for a float-minimum type also ``minimum``, the ``M`` of
    llama.cpp's ``w = scale * ints - M`` as llama.cpp computes it (float32, ``[n, elements / block]``)."""

    info: TypeInfo
    ints: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    degenerate: int = 0  # sub-blocks with a zero scale and a non-zero minimum, written exactly
    minimum: np.ndarray | None = None

    def values(self) -> np.ndarray:
        """The weights ``[n, elements]`` float32, as ONNX Runtime computes them."""
        n, e = self.ints.shape
        sub = self.info.block
        q = self.ints.reshape(n, e // sub, sub).astype(np.float32)
        z = self.zero.astype(np.float32)[..., None]
        return ((q - z) * self.scale[..., None]).reshape(n, e)


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """float32 ``[n, 1]`` from the f16 at byte ``at`` of each block."""
    return np.ascontiguousarray(raw[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Low nibbles then high nibbles of each run of ``group`` bytes: ``[n, 2 * bytes]``."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1)


def _bits_of(mask: np.ndarray, count: int, width: int = 1) -> np.ndarray:
    """Fields of ``width`` bits from each byte of ``mask`` ``[n, m]``: ``[n, count, m]``, lowest field first."""
    shifts = (np.arange(count, dtype=np.uint8) * width).reshape(1, count, 1)
    return (mask[:, None, :] >> shifts) & np.uint8((1 << width) - 1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 six-bit scales and mins packed in 12 bytes."""
    n = packed.shape[0]
    p = packed.reshape(n, 3, 4)
    lo_s, lo_m, hi = p[:, 0], p[:, 1], p[:, 2]
    sc = np.concatenate([lo_s & 0x3F, (hi & 0x0F) | ((lo_s >> 2) & 0x30)], axis=1)
    mn = np.concatenate([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _with_minimum(info: TypeInfo, ints: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> Blocks:
    """``w = scale * q - minimum`` as ``(q - minimum / scale) * scale``; a zero scale written exactly."""
    dead = (scale == 0) & (minimum != 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(scale != 0, minimum / np.where(scale != 0, scale, 1), 0).astype(np.float32)
    if dead.any():
        sub = info.block
        n, e = ints.shape
        q = ints.reshape(n, e // sub, sub)
        q[dead] = 0
        scale = np.where(dead, minimum, scale)
        zero = np.where(dead, np.float32(1), zero)
        ints = q.reshape(n, e)
    # a dead block keeps its minimum: scale * 0 - M is still its value
    return Blocks(info, ints, scale.astype(np.float32), zero.astype(np.float32), int(dead.sum()),
                  np.asarray(minimum, np.float32))


def decode(type_name: str, raw: np.ndarray) -> Blocks:
    """The blocks ``raw`` (uint8 ``[n, nbytes]``) of GGUF type ``type_name`` in ONNX Runtime's form."""
    info = TYPES[type_name]
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, info.nbytes)
    n = raw.shape[0]
    fixed = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128, "Q3_K": 4, "Q6_K": 32}
    if type_name in ("Q4_0", "Q4_1"):
        at = 2 if type_name == "Q4_0" else 4
        ints = _nibbles(raw[:, at:], 16)
        scale = _f16(raw, 0)
        if type_name == "Q4_1":  # d * q + m: the minimum is -m
            return _with_minimum(info, ints, scale, -_f16(raw, 2))
    elif type_name in ("Q5_0", "Q5_1"):
        at = 2 if type_name == "Q5_0" else 4
        high = _bits_of(raw[:, at:at + 4], 8).transpose(0, 2, 1).reshape(n, 32)  # bit j of the 32-bit word
        ints = _nibbles(raw[:, at + 4:], 16) | (high << 4)
        scale = _f16(raw, 0)
        if type_name == "Q5_1":
            return _with_minimum(info, ints, scale, -_f16(raw, 2))
    elif type_name == "Q8_0":
        ints = (raw[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        scale = _f16(raw, 0)
    elif type_name == "Q2_K":
        sc, qs = raw[:, :16], raw[:, 16:80]
        d, dmin = _f16(raw, 80), _f16(raw, 82)
        ints = _bits_of(qs.reshape(n * 2, 32), 4, 2).reshape(n, QK_K)  # half, shift, byte
        scale = d * (sc & 0x0F).astype(np.float32)
        return _with_minimum(info, ints, scale, dmin * (sc >> 4).astype(np.float32))
    elif type_name == "Q3_K":
        hmask, qs, packed = raw[:, :32], raw[:, 32:96], raw[:, 96:108]
        d = _f16(raw, 108)
        low = (packed[:, :8, None] >> np.array([0, 4], np.uint8)).transpose(0, 2, 1).reshape(n, 16) & 0x0F
        high = _bits_of(packed[:, 8:12], 4, 2).reshape(n, 16)
        sc = ((low | (high << 4)).astype(np.int16) - 32).astype(np.float32)
        q2 = _bits_of(qs.reshape(n * 2, 32), 4, 2).reshape(n, QK_K)
        hbit = _bits_of(hmask, 8).reshape(n, QK_K)  # bit j of every byte: elements 32 j ..
        ints = (q2 + 4 * hbit).astype(np.uint8)  # q = q2 - 4 (1 - hbit): stored as q + 4
        scale = d * sc
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(raw, 0), _f16(raw, 2)
        sc, mn = _k_scales(raw[:, 4:16])
        if type_name == "Q4_K":
            ints = _nibbles(raw[:, 16:], 32)
        else:
            qh, qs = raw[:, 16:48], raw[:, 48:]
            ints = _nibbles(qs, 32) | (_bits_of(qh, 8).reshape(n, QK_K) << 4)
        return _with_minimum(info, ints, d * sc, dmin * mn)
    elif type_name == "Q6_K":
        ql, qh, sc = raw[:, :128], raw[:, 128:192], raw[:, 192:208].view(np.int8)
        d = _f16(raw, 208)
        low = _nibbles(ql, 64)  # [n, 256]: per 128-half, low nibbles of 64 bytes then high
        high = _bits_of(qh.reshape(n * 2, 32), 4, 2).reshape(n, QK_K)
        ints = low | (high << 4)
        scale = d * sc.astype(np.float32)
    else:  # pragma: no cover - TYPES lists what decode handles
        raise KeyError(type_name)
    zero = np.full(scale.shape, fixed[type_name], np.uint8)
    return Blocks(info, ints.astype(np.uint8), scale.astype(np.float32), zero)


def integer_form(scale: np.ndarray, zero: np.ndarray, minimum: np.ndarray, bits: int) -> tuple[np.ndarray,
                                                                                         np.ndarray]:
    """Float-minimum blocks ``s * q - M`` (``z = M / s``) as uint8 zero points ``zi`` and the per-block constant
    ``C`` (``[n, blocks]``) of :mod:`bitpress.onnx.correction`: ``s * q - M = s * (q - zi) + C``, the host's
    :func:`~bitpress.onnx.correction.split_zero_points` with the GGUF's own ``M`` as the exact offset.

    ``C = s * zi - M`` is rounded once (float64, then float32), not ``s * (zi - z)`` (two more roundings: 1-2
    ulps): when ``C`` is a float32, ``s * (q - zi)`` (exact: small integers times ``s``) plus ``C`` rounds once
    to llama.cpp's ``fl(s * q - M)``, bit for bit. ``zi = round(z)`` at 4 bits too, not the implied 8: ``s * (q -
    8)`` and ``C = 8 s - M`` cancel where ``s * q - M`` is small, which costs millions of float32 ulps of
    llama.cpp's terms (measured on random Q4_1 / Q4_K / Q2_K blocks)."""
    from bitpress.plugin import split_zero_points

    zi, c = split_zero_points(scale, zero, bits, np.float32, offsets=minimum)
    return zi, np.ascontiguousarray(c.T)


def pack(ints: np.ndarray, bits: int) -> np.ndarray:
    """uint8 ``[rows, K * bits / 8]`` from integers ``[rows, K]``: the lower K in the lower bits."""
    per = 8 // bits
    q = ints.reshape(ints.shape[0], -1, per).astype(np.uint8)
    out = np.zeros(q.shape[:2], np.uint8)
    for i in range(per):
        out |= q[:, :, i] << np.uint8(i * bits)
    return out
