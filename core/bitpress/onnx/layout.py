"""Byte layouts of ONNX Runtime's block-quantized contrib ops (``com.microsoft`` domain).

Pure array functions: a solver's :class:`~bitpress.quant.solver.QuantizedBlocks` in, the exact
initializer arrays of ``MatMulNBits`` / ``GatherBlockQuantized`` out, and the inverse (used by
tests). No graph surgery happens here.

Layout facts (ORT 1.32 CPU kernels, checked by running them in ``tests/onnx/test_layout.py``):

``MatMulNBits`` (attributes K, N, bits, block_size, accuracy_level), weight rows = N:
    * ``B``: uint8 ``[N, n_blocks, blob_size]``, ``n_blocks = ceil(K / block_size)``,
      ``blob_size = block_size * bits / 8``. Elements run along K; 4-bit values are packed two
      per byte, the lower K index in the low nibble. K is padded to ``n_blocks * block_size``.
    * ``scales``: scale dtype (float32 or float16, the same as input A), ``[N * n_blocks]`` as the
      op spec says; ORT also accepts ``[N, n_blocks]`` (the spec keeps 1-D "for backward
      compatibility", ORT's own quantizer writes 2-D).
    * ``zero_points`` (optional; absent means ``2**(bits-1)``): either uint8 packed per row,
      ``[N * ceil(n_blocks * bits / 8)]`` (4 bits: two per byte, low nibble first, each row padded
      to whole bytes), or float offsets of the scales' dtype ``[N * n_blocks]`` (the 2-D forms
      ``[N, ...]`` are accepted too). The CPU kernel takes float zero points with 4 bits only: it
      refuses 8-bit weights with float zero points at session creation.

``GatherBlockQuantized`` with uint8 data (attributes bits 2/4/8, block_size, gather_axis must be 0,
quantize_axis must be the last axis), table ``[vocab, hidden]`` quantized along hidden:
    * ``data``: uint8 ``[vocab, hidden * bits / 8]``, packed like ``B`` (low nibble first), so
      4-bit needs an even hidden. The output's last dim is ``data.shape[-1] * 8 / bits``.
    * ``scales``: ``[vocab, ceil(hidden / block_size)]``; its dtype is the output dtype.
    * ``zero_points`` (optional; absent means ``2**(bits-1)``): uint8 only, packed per row like
      MatMulNBits', ``[vocab, ceil(n_blocks * bits / 8)]``. Float zero points are rejected (the
      input has the data's type).

Tied LM head / embedding table ``[vocab, hidden]``: MatMulNBits with ``N = vocab, K = hidden`` and
GatherBlockQuantized over the same table hold the same bytes exactly when

    1. ``hidden % block_size == 0`` (otherwise each B row carries padding bytes the gather data
       must not have),
    2. the zero points are absent (symmetric) or uint8 (float offsets exist only for MatMulNBits),
    3. both nodes use the same scale dtype (the gather's output dtype is the scales' dtype, the
       matmul's A dtype must equal it too).

Then one copy of each tensor serves both nodes, with a Reshape between the layouts:
``B [vocab, n_blocks, blob] <-> data [vocab, hidden*bits/8]``, and for 1-D scales / zero points
``[vocab * n] <-> [vocab, n]`` (no reshape when MatMulNBits is given the 2-D forms).
See :func:`tied_table_sharing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from bitpress.quant.solver import QuantizedBlocks

ZeroPointKind = Literal["none", "uint8", "float"]

_WRITER_BITS = (4, 8)


def _check_bits(bits: int) -> None:
    if bits not in _WRITER_BITS:
        raise ValueError(f"bits must be one of {_WRITER_BITS}, got {bits}")


def _check_block_size(block_size: int) -> None:
    # Both kernels enforce this at session creation; fail earlier with a clearer message.
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of 2 and >= 16, got {block_size}")


def pack_along_last(values: np.ndarray, bits: int, fill: int = 0) -> np.ndarray:
    """Pack ``bits``-wide unsigned values along the last axis into bytes, lowest index in the
    lowest bits. The last axis is padded with ``fill`` to whole bytes."""
    _check_bits(bits)
    v = np.asarray(values, dtype=np.uint8)
    if bits == 8:
        return np.ascontiguousarray(v)
    if v.shape[-1] % 2:
        pad = [(0, 0)] * (v.ndim - 1) + [(0, 1)]
        v = np.pad(v, pad, constant_values=fill)
    return ((v[..., 0::2] & 0x0F) | (v[..., 1::2] << 4)).astype(np.uint8)


def unpack_along_last(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_along_last`: the first ``count`` values of the last axis."""
    _check_bits(bits)
    p = np.asarray(packed, dtype=np.uint8)
    if bits == 8:
        return p[..., :count].copy()
    out = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)
    return out[..., :count]


def _scales_as(blocks: QuantizedBlocks, scale_dtype: np.dtype | type) -> np.ndarray:
    dt = np.dtype(scale_dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise ValueError(f"scale dtype must be float32 or float16, got {dt}")
    return np.asarray(blocks.scales).astype(dt)


def zero_point_kind(blocks: QuantizedBlocks) -> ZeroPointKind:
    if blocks.zero_points is None:
        return "none"
    return "uint8" if blocks.zero_points.dtype == np.uint8 else "float"


# ----------------------------------------------------------------------------- MatMulNBits


@dataclass(frozen=True)
class MatMulNBitsTensors:
    """Initializers and attributes of one ``com.microsoft.MatMulNBits`` node."""

    b: np.ndarray  # uint8 [N, n_blocks, blob_size]
    scales: np.ndarray  # [N * n_blocks] (or [N, n_blocks])
    zero_points: np.ndarray | None  # uint8 [N * zp_bytes] / float [N * n_blocks], or 2-D
    k: int
    n: int
    bits: int
    block_size: int

    @property
    def n_blocks(self) -> int:
        return self.b.shape[1]

    def attributes(self, accuracy_level: int | None = None) -> dict[str, int]:
        attrs = {"K": self.k, "N": self.n, "bits": self.bits, "block_size": self.block_size}
        # Leave it out when 0: optional, and some EPs reject it.
        if accuracy_level:
            attrs["accuracy_level"] = accuracy_level
        return attrs


def to_matmul_nbits(
    blocks: QuantizedBlocks,
    bits: int,
    k: int,
    scale_dtype: np.dtype | type = np.float32,
    flat: bool = True,
    packed_q: np.ndarray | None = None,
) -> MatMulNBitsTensors:
    """MatMulNBits tensors for ``blocks`` (rows = N, blocks along K padded by the caller).

    ``k`` is the true K (the node's attribute); ``flat`` writes scales / zero points 1-D as the
    op spec says, else ``[N, ...]`` (also accepted by ORT). ``packed_q``: ``blocks.q`` already
    packed with :func:`pack_along_last` (``[N, n_blocks, blob]``; ``blocks.q`` is then ignored),
    so a caller can pack chunk by chunk and never hold one byte per weight.
    """
    _check_bits(bits)
    n, n_blocks = blocks.scales.shape
    block_size = packed_q.shape[-1] * 8 // bits if packed_q is not None else blocks.q.shape[-1]
    _check_block_size(block_size)
    if not (n_blocks - 1) * block_size < k <= n_blocks * block_size:
        raise ValueError(f"K={k} does not need {n_blocks} blocks of {block_size}")
    b = packed_q if packed_q is not None else pack_along_last(blocks.q, bits)
    scales = _scales_as(blocks, scale_dtype)
    kind = zero_point_kind(blocks)
    zp: np.ndarray | None = None
    if kind == "uint8":
        # The unused high nibble of an odd row is the kernel's default, harmless either way.
        zp = pack_along_last(blocks.zero_points, bits, fill=2 ** (bits - 1))
    elif kind == "float":
        if bits == 8:
            raise ValueError("ORT's MatMulNBits (CPU) rejects 8-bit weights with float zero points")
        zp = np.asarray(blocks.zero_points).astype(scales.dtype)
    if flat:
        scales = scales.reshape(-1)
        zp = None if zp is None else zp.reshape(-1)
    return MatMulNBitsTensors(b, scales, zp, k, n, bits, block_size)


def dequantize_matmul_nbits(t: MatMulNBitsTensors) -> np.ndarray:
    """float32 ``[K, N]`` weight that ``t`` encodes (what ``A @ W`` uses)."""
    n, n_blocks, bs = t.n, t.n_blocks, t.block_size
    q = unpack_along_last(t.b, t.bits, bs).astype(np.float32)  # [N, n_blocks, bs]
    scales = t.scales.astype(np.float32).reshape(n, n_blocks)
    if t.zero_points is None:
        zp = np.full((n, n_blocks), 2 ** (t.bits - 1), np.float32)
    elif t.zero_points.dtype == np.uint8:
        zp = unpack_along_last(t.zero_points.reshape(n, -1), t.bits, n_blocks).astype(np.float32)
    else:
        zp = t.zero_points.astype(np.float32).reshape(n, n_blocks)
    w = (q - zp[..., None]) * scales[..., None]
    return np.ascontiguousarray(w.reshape(n, n_blocks * bs)[:, : t.k].T)


# ---------------------------------------------------------------------- GatherBlockQuantized


@dataclass(frozen=True)
class GatherBlockQuantizedTensors:
    """Initializers and attributes of one ``com.microsoft.GatherBlockQuantized`` node."""

    data: np.ndarray  # uint8 [vocab, hidden * bits / 8]
    scales: np.ndarray  # [vocab, n_blocks]
    zero_points: np.ndarray | None  # uint8 [vocab, ceil(n_blocks * bits / 8)]
    hidden: int
    bits: int
    block_size: int

    def attributes(self) -> dict[str, int]:
        return {
            "bits": self.bits,
            "block_size": self.block_size,
            "gather_axis": 0,
            "quantize_axis": 1,
        }


def to_gather_block_quantized(
    blocks: QuantizedBlocks,
    bits: int,
    hidden: int,
    scale_dtype: np.dtype | type = np.float32,
    packed_q: np.ndarray | None = None,
) -> GatherBlockQuantizedTensors:
    """GatherBlockQuantized tensors for a ``[vocab, hidden]`` table quantized along hidden.

    ``blocks`` covers hidden padded to whole blocks; the padding is dropped from ``data``.
    ``packed_q``: as in :func:`to_matmul_nbits`.
    """
    _check_bits(bits)
    vocab, n_blocks = blocks.scales.shape
    block_size = packed_q.shape[-1] * 8 // bits if packed_q is not None else blocks.q.shape[-1]
    _check_block_size(block_size)
    if not (n_blocks - 1) * block_size < hidden <= n_blocks * block_size:
        raise ValueError(f"hidden={hidden} does not need {n_blocks} blocks of {block_size}")
    if hidden * bits % 8:
        # The kernel infers hidden as data.shape[-1] * 8 / bits.
        raise ValueError(f"hidden={hidden} does not fill whole bytes at {bits} bits")
    kind = zero_point_kind(blocks)
    if kind == "float":
        raise ValueError("GatherBlockQuantized takes uint8 zero points only, not float offsets")
    if packed_q is not None:
        # blocks are whole bytes, so the packed row's first hidden*bits/8 bytes are the table row
        data = np.ascontiguousarray(packed_q.reshape(vocab, -1)[:, : hidden * bits // 8])
    else:
        data = pack_along_last(blocks.q.reshape(vocab, -1)[:, :hidden], bits)
    scales = _scales_as(blocks, scale_dtype)
    zp = None
    if kind == "uint8":
        zp = pack_along_last(blocks.zero_points, bits, fill=2 ** (bits - 1))
    return GatherBlockQuantizedTensors(data, scales, zp, hidden, bits, block_size)


def dequantize_gather_block_quantized(t: GatherBlockQuantizedTensors) -> np.ndarray:
    """float32 ``[vocab, hidden]`` table that ``t`` encodes."""
    vocab, n_blocks = t.scales.shape
    q = unpack_along_last(t.data, t.bits, t.hidden).astype(np.float32)
    if t.zero_points is None:
        zp = np.full((vocab, n_blocks), 2 ** (t.bits - 1), np.float32)
    else:
        zp = unpack_along_last(t.zero_points, t.bits, n_blocks).astype(np.float32)
    per_elem = np.arange(t.hidden) // t.block_size
    return (q - zp[:, per_elem]) * t.scales.astype(np.float32)[:, per_elem]


# -------------------------------------------------------------------------------- tied tables


@dataclass(frozen=True)
class TiedSharing:
    """Whether a tied ``[vocab, hidden]`` table can be stored once for both nodes.

    ``reshapes`` maps each shared input to ``(matmul_nbits_shape, gather_shape)``; equal shapes
    need no Reshape. Empty when not shareable.
    """

    shareable: bool
    reason: str
    reshapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]


def tied_table_sharing(
    vocab: int,
    hidden: int,
    bits: int,
    block_size: int,
    zero_points: ZeroPointKind,
    flat: bool = True,
) -> TiedSharing:
    """Can MatMulNBits (N=vocab, K=hidden) and GatherBlockQuantized share one table's bytes?

    ``flat`` is the MatMulNBits scales / zero points form (see :func:`to_matmul_nbits`). Both
    nodes must also use one scale dtype; that is the caller's choice, not checked here.
    """
    if bits not in _WRITER_BITS:
        return TiedSharing(False, f"bits={bits} is not written by bitpress", {})
    if block_size < 16 or block_size & (block_size - 1):
        return TiedSharing(False, f"block_size={block_size} is invalid for both ops", {})
    if hidden % block_size:
        return TiedSharing(
            False, "hidden is not a multiple of block_size: B rows carry padding", {}
        )
    if zero_points == "float":
        return TiedSharing(False, "GatherBlockQuantized has no float zero points", {})
    n_blocks = hidden // block_size
    row_bytes = hidden * bits // 8
    reshapes = {
        "B": ((vocab, n_blocks, block_size * bits // 8), (vocab, row_bytes)),
        "scales": ((vocab * n_blocks,) if flat else (vocab, n_blocks), (vocab, n_blocks)),
    }
    if zero_points == "uint8":
        zp_bytes = -(-n_blocks * bits // 8)
        reshapes["zero_points"] = (
            (vocab * zp_bytes,) if flat else (vocab, zp_bytes),
            (vocab, zp_bytes),
        )
    return TiedSharing(True, "same bytes", reshapes)
