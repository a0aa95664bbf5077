"""Float zero points on ONNX Runtime's fast kernels: ``MatMulNBits`` with integer zero points plus an
exact per-block correction computed from the input's block sums.

A block quantized with a float zero point ``z`` (HQQ, k-quant, llama.cpp's Q4_1 / Q4_K minimums)
means ``w = s * (q - z)``. ONNX Runtime's CPU ``MatMulNBits`` takes float zero points, but then
skips prepacking and dequantizes the whole weight to float32 on every call (``matmul_nbits.cc``:
prepacking needs absent or uint8 zero points): one 2048 x 2048 weight costs 5 ms per token
instead of 0.05 ms. The same weight is written here as

    w = s * (q - zi)  +  C,     zi = round(z) (uint8),  C = s * zi - s * z

the first term a ``MatMulNBits`` with uint8 zero points (prepacked, int8 compute at
``accuracy_level`` 4), the second a constant per block and output column. For an input ``x``,
``sum_k x_k * C[k // block, n]`` is ``sum_b S_b(x) * C[b, n]`` with ``S_b(x)`` the sum of ``x``
over block ``b``, so::

    y = MatMulNBits(x)  +  MatMul(MatMul(x, E), C)

with ``E [K, n_blocks]`` the block indicator (``E[k, k // block] = 1``, shared by every weight of
that ``K`` and block size; the last block's padding rows simply do not exist) and ``C [n_blocks,
N]``. Both small MatMuls cost ``1 / block_size`` of a float MatMul of the weight, and the block sums
are computed once per input for every weight that reads it (q / k / v, gate / up).

``zi = round(z)`` keeps the first term as close to the weight as any integer zero point can: ONNX
Runtime's int8 activations (level 4) then cost what they cost any integer-zero-point weight, and
``s * (q - zi)`` (small integers times ``s``: exact) plus ``C`` adds without cancellation. The
implied zero point (``2**(bits-1)``, no zero-point input) would save half a byte per 4-bit block
but not that: integers of a narrow range (llama.cpp's Q2_K in a 4-bit container, its 5-bit blocks
in an 8-bit one) sit far from it, and the int8 activations' error grew 6x (measured on Q2_K
blocks). ``C`` is rounded once, from ``s * z`` in float64, or from the exact offset a caller knows
(``offsets``: a GGUF's own minimum ``M`` of ``w = s * q - M``, which makes the sum llama.cpp's
value bit for bit wherever ``C`` is a float32). The stored bytes are those of the float zero
points (``C``) plus the uint8 ones.

:func:`insert_corrections` adds the nodes (the host's weight-only writer and plugins that write
their own ``MatMulNBits`` use it); :func:`find_corrections` recognises the pattern in a graph (for
``bitpress eval``'s per-tensor error and for :mod:`bitpress.onnx.kernels`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper


def block_sum_matrix(k: int, block_size: int, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """``E [K, n_blocks]``: ``x @ E`` sums ``x`` over each block of ``block_size`` along K."""
    n_blocks = -(-k // block_size)
    e = np.zeros((k, n_blocks), np.dtype(dtype))
    e[np.arange(k), np.arange(k) // block_size] = 1
    return e


def split_zero_points(scales: np.ndarray, zero_points: np.ndarray, bits: int,
                      dtype: np.dtype | type = np.float32,
                      offsets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Float zero points ``z`` of ``[N, n_blocks]`` blocks as ``(zi, C)``: uint8 ``zi = round(z)`` (clipped to the
    integers' range) and ``C [n_blocks, N] = s * zi - s * z`` in ``dtype``, rounded once. ``offsets``: ``s * z``
    exactly, when the caller has it (a GGUF's minimum); else computed in float64 from ``scales`` and ``z``."""
    s = np.asarray(scales, np.float64)
    z = np.asarray(zero_points, np.float32)
    zi = np.clip(np.rint(z), 0, 2**bits - 1)
    off = s * z.astype(np.float64) if offsets is None else np.asarray(offsets, np.float64)
    c = s * zi - off
    return zi.astype(np.uint8), np.ascontiguousarray(c.T).astype(np.dtype(dtype))


def block_sum_name(k: int, block_size: int, dtype: np.dtype | type) -> str:
    """The initializer name of the shared ``E`` for one ``K``, block size and dtype."""
    return f"bitpress_block_sums_K{k}_B{block_size}_{np.dtype(dtype).name}"


def correction_nodes(x: str, main_out: str, out: str, e_name: str, c_name: str, sums: str | None,
                     prefix: str) -> list[onnx.NodeProto]:
    """``out = main_out + MatMul(MatMul(x, E), C)``; ``sums``: the block sums ``MatMul(x, E)`` already
    computed for another weight reading ``x`` (None: computed here, as ``{prefix}_block_sums``)."""
    nodes = []
    if sums is None:
        sums = f"{prefix}_block_sums"
        nodes.append(helper.make_node("MatMul", [x, e_name], [sums], name=f"{prefix}_BlockSums"))
    nodes.append(helper.make_node("MatMul", [sums, c_name], [f"{prefix}_correction"], name=f"{prefix}_Correction"))
    nodes.append(helper.make_node("Add", [main_out, f"{prefix}_correction"], [out], name=f"{prefix}_AddCorrection"))
    return nodes


@dataclass(frozen=True)
class Fix:
    """The correction of one ``MatMulNBits`` (by the output it writes): its ``C`` initializer, and the ``K``,
    block size and dtype of the shared block-sum matrix ``E``."""

    c_name: str
    k: int
    block_size: int
    dtype: np.dtype


def insert_corrections(nodes: list[onnx.NodeProto], fixes: dict[str, Fix],
                       add_initializer: Callable[[str, np.ndarray], None]) -> list[onnx.NodeProto]:
    """``nodes`` (graph order) with each fixed ``MatMulNBits``'s correction after it: the node now writes
    ``<out>_nbits`` and the correction's ``Add`` writes ``<out>``, so its readers are unchanged. The block sums
    of an input are computed once, by its first corrected reader in graph order, for every weight of the same
    ``K`` and block size reading it; each ``E`` is added once through ``add_initializer`` (``C`` is the caller's).
    Raises ``ValueError`` when no ``MatMulNBits`` writes an output ``fixes`` names."""
    out: list[onnx.NodeProto] = []
    sums: dict[tuple[str, str], str] = {}
    added: set[str] = set()
    done: set[str] = set()
    for node in nodes:
        out.append(node)
        fix = fixes.get(node.output[0]) if node.op_type == "MatMulNBits" and node.output else None
        if fix is None:
            continue
        e = block_sum_name(fix.k, fix.block_size, fix.dtype)
        if e not in added:
            added.add(e)
            add_initializer(e, block_sum_matrix(fix.k, fix.block_size, fix.dtype))
        x, y = node.input[0], node.output[0]
        node.output[0] = f"{y}_nbits"
        out += correction_nodes(x, node.output[0], y, e, fix.c_name, sums.get((x, e)), node.name or y)
        sums.setdefault((x, e), f"{node.name or y}_block_sums")
        done.add(y)
    missing = sorted(set(fixes) - done)
    if missing:
        raise ValueError(f"no MatMulNBits writes {', '.join(missing[:3])}: no place for its correction")
    return out


@dataclass(frozen=True)
class Correction:
    """One ``MatMulNBits`` node's block-sum correction, as found in a graph."""

    node: str  # the MatMulNBits node's name
    e: str  # E's initializer
    c: str  # C's initializer
    add: str  # the Add node's name (its output is what the MatMulNBits' readers read)


def find_corrections(graph: onnx.GraphProto) -> dict[str, Correction]:
    """Every ``MatMulNBits`` whose output gets ``MatMul(MatMul(x, E), C)`` added, ``x`` its own input
    and ``E`` / ``C`` initializers: MatMulNBits node name -> :class:`Correction`."""
    inits = {t.name for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    found: dict[str, Correction] = {}
    for node in graph.node:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            continue
        users = readers.get(node.output[0], [])
        if len(users) != 1 or users[0].op_type != "Add":
            continue
        add = users[0]
        other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
        corr = producer.get(other)
        if corr is None or corr.op_type != "MatMul" or corr.input[1] not in inits:
            continue
        sums = producer.get(corr.input[0])
        if sums is None or sums.op_type != "MatMul" or sums.input[0] != node.input[0] or sums.input[1] not in inits:
            continue
        found[node.name] = Correction(node.name, sums.input[1], corr.input[1], add.name)
    return found


def corrected_weight(w_kn: np.ndarray, c: np.ndarray, block_size: int) -> np.ndarray:
    """The weight ``[K, N]`` a MatMulNBits of dequantized weight ``w_kn`` plus correction ``C`` computes."""
    k = w_kn.shape[0]
    blocks = np.arange(k) // block_size
    return w_kn + np.asarray(c, np.float32)[blocks]


def matmul_nbits_weight(node: onnx.NodeProto, array: Callable[[str], np.ndarray],
                        fix: Correction | None = None) -> np.ndarray:
    """The float32 ``[K, N]`` weight a ``MatMulNBits`` node multiplies by, its correction (``fix``, from
    :func:`find_corrections`) included. ``array``: initializer name -> its values. No ``g_idx``."""
    from bitpress.onnx import layout

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, bits, bs = int(attrs["K"]), int(attrs["N"]), int(attrs.get("bits", 4)), int(attrs["block_size"])
    n_blocks = -(-k // bs)
    zp = array(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    t = layout.MatMulNBitsTensors(np.asarray(array(node.input[1])).reshape(n, n_blocks, bs * bits // 8),
                                  np.asarray(array(node.input[2])), zp, k, n, bits, bs)
    w = layout.dequantize_matmul_nbits(t)
    return w if fix is None else corrected_weight(w, array(fix.c), bs)
