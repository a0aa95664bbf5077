"""Weight-only block quantization of ONNX graphs, shared by every native algorithm.

The host does the graph work once: it finds the weights of ``MatMul``, ``Gemm`` and ``Gather``
nodes, groups the nodes that read the same table (tied embedding / LM head, weights shared by
several MatMuls), reads each weight in bounded chunks, asks the plugin's block solver for
integers, scales and zero points, and writes ``com.microsoft`` ``MatMulNBits`` /
``GatherBlockQuantized`` nodes with the layouts of :mod:`bitpress.onnx.layout`.

A plugin only supplies a :class:`~bitpress.quant.solver.BlockSolver` (see
:class:`WeightOnlyPass`).

Orientation: ``MatMulNBits`` quantizes ``B [K, N]`` in blocks along K for each of the N output
columns, i.e. the rows of ``B^T``. A table read by ``Gather`` is quantized along its last axis,
i.e. its own rows. A table ``T [vocab, hidden]`` that feeds ``Gather`` and, through
``Transpose``, the LM-head ``MatMul`` therefore has one orientation for both: it is quantized
once and the two nodes share the bytes.
"""

from __future__ import annotations

import logging
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx import helper

from bitpress.errors import QuantizationError
from bitpress.memory import trim_heap
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx import layout
from bitpress.onnx.graph import MS_DOMAIN, consumers, producers, used_names
from bitpress.onnx.tensors import np_dtype
from bitpress.options import option
from bitpress.passes import Pass, PassContext
from bitpress.quant.solver import (
    BlockSolver,
    BlockSpec,
    PackedBlocks,
    PackingKernel,
    QuantizedBlocks,
    check_block_size,
    dequantize,
)
from bitpress.selection import NameMatcher

log = logging.getLogger(__name__)

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
#: float32 elements per chunk handed to a solver (bounds memory per tensor in flight)
CHUNK_ELEMENTS = 1 << 20  # 4 MB of float32: small enough for the allocator to reuse (no page-fault storms)


# -- options -----------------------------------------------------------------------------------
@dataclass
class WeightOnlyOptions:
    """Options every weight-only pass shares; the names follow Olive's passes."""

    bits: int = option(4, "bits per weight: 4 or 8 (set by --precision int4/int8)")
    block_size: int = option(32, "weights per block along K: a power of two from 16 to 256")
    is_symmetric: bool = option(False, "symmetric quantization (no zero points stored)")
    accuracy_level: int = option(
        0, "MatMulNBits accuracy_level: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 compute"
    )
    op_types: list[str] = option(["MatMul", "Gemm", "Gather"], "op types whose weights are quantized")
    nodes_to_include: list[str] = option(
        [], "only these nodes (names, globs or re:REGEX; node or weight names); empty: all"
    )
    nodes_to_exclude: list[str] = option([], "nodes left in float (names, globs or re:REGEX)")
    overrides: dict[str, dict[str, Any]] = option(
        {}, 'per-node settings, first match wins: {"re:.*down_proj.*": {"bits": 8}}'
    )
    gather_min_rows: int = option(
        64, "Gather tables with fewer rows stay float (token-type tables: no size gain, error on every token)"
    )

    def validate(self) -> None:
        check_bits_block(self.bits, self.block_size, "")
        if self.accuracy_level not in range(5):
            raise ValueError("accuracy_level must be 0..4")
        bad = sorted(set(self.op_types) - {"MatMul", "Gemm", "Gather"})
        if bad:
            raise ValueError(f"op_types {bad} are not supported; use MatMul, Gemm, Gather")
        for pattern, settings in self.overrides.items():
            if not isinstance(settings, dict) or set(settings) - {"bits", "block_size", "is_symmetric"}:
                raise ValueError(
                    f"overrides[{pattern!r}] must map to bits / block_size / is_symmetric, got {settings!r}"
                )
            check_bits_block(
                int(settings.get("bits", self.bits)),
                int(settings.get("block_size", self.block_size)),
                f"overrides[{pattern!r}]: ",
            )


def check_bits_block(bits: int, block_size: int, where: str) -> None:
    if bits not in (4, 8):
        raise ValueError(f"{where}bits must be 4 or 8, got {bits}")
    check_block_size(block_size, f"{where}block_size")


# -- what to quantize ------------------------------------------------------------------------------
@dataclass
class Use:
    """One node reading a weight, and how (which orientation it needs)."""

    node: onnx.NodeProto
    # "matmul" (B [K,N]), "matmul_t" (B = Transpose(T [N,K])), "gemm", "gemm_t" (transB=1),
    # "gather" (table T), "gather_t" (table = Transpose(W [K,N]): the ORT GenAI builder's tie)
    kind: str
    transpose: onnx.NodeProto | None = None

    @property
    def rows_are_table_rows(self) -> bool:
        # True: quantization blocks run along the stored tensor's last axis (its rows are the N rows)
        return self.kind in ("matmul_t", "gemm_t", "gather")

    @property
    def is_gather(self) -> bool:
        return self.kind in ("gather", "gather_t")


@dataclass
class Group:
    """One weight initializer and every node that will read its quantized form."""

    weight: str
    uses: list[Use] = field(default_factory=list)
    bits: int = 4
    block_size: int = 32
    symmetric: bool = False


@dataclass
class Plan:
    groups: list[Group]
    skipped: dict[str, str]  # weight or node -> reason
    notes: dict[str, str] = field(default_factory=dict)  # weight -> a setting the planner adjusted


def plan(model: OnnxModel, opts: WeightOnlyOptions) -> Plan:
    """Decide which weights to quantize and how, before reading any of them."""
    graph = model.graph
    inits = model.initializers()
    cons = consumers(graph)
    prods = producers(graph)
    include = NameMatcher(opts.nodes_to_include, what="nodes_to_include")
    exclude = NameMatcher(opts.nodes_to_exclude, what="nodes_to_exclude")
    overrides = NameMatcher(list(opts.overrides), what="overrides key")
    subgraph_reads = _subgraph_reads(graph)
    graph_outputs = {o.name for o in graph.output}
    skipped: dict[str, str] = {}
    notes: dict[str, str] = {}
    uses: dict[str, list[Use]] = defaultdict(list)

    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in opts.op_types:
            continue
        use, weight, why = _classify(node, inits, prods, cons)
        if use is None:
            if why:
                skipped[node.name or node.output[0]] = why
            continue
        uses[weight].append(use)

    groups = []
    for weight, wuses in uses.items():
        tensor = inits[weight]
        # every reader of the weight (directly or via the Transpose) must be a planned use
        readers = {id(n) for n in cons.get(weight, [])}
        planned = {id(u.node) for u in wuses} | {id(u.transpose) for u in wuses if u.transpose is not None}
        for u in wuses:
            if u.transpose is not None:
                t_out = u.transpose.output[0]
                readers |= {id(n) for n in cons.get(t_out, [])}
                if t_out in graph_outputs or t_out in subgraph_reads:
                    readers.add(-1)
        if readers - planned or weight in graph_outputs or weight in subgraph_reads:
            skipped[weight] = "also read by nodes that are not quantized; kept in float"
            continue
        names = [n for u in wuses for n in (u.node.name, weight)]
        if include and not any(include.matches(u.node.name, weight) for u in wuses):
            continue
        excluded = [u.node.name for u in wuses if exclude.matches(u.node.name, weight)]
        if include:
            excluded += [u.node.name for u in wuses if not include.matches(u.node.name, weight)]
        if excluded:
            if len(wuses) > 1:
                skipped[weight] = (
                    f"shared by {len(wuses)} nodes and {', '.join(sorted(set(excluded)))} excluded: "
                    "all of them stay float so the weight stays one tensor"
                )
            continue
        orientations = {u.rows_are_table_rows for u in wuses}
        if len(orientations) > 1:
            skipped[weight] = "read in two orientations (e.g. MatMul and Gather without Transpose); kept in float"
            continue
        settings = []
        for u in wuses:
            key = overrides.first(u.node.name, weight)
            settings.append(dict(opts.overrides[key]) if key is not None else {})
        bits = {int(s.get("bits", opts.bits)) for s in settings}
        blocks = {int(s.get("block_size", opts.block_size)) for s in settings}
        sym = {bool(s.get("is_symmetric", opts.is_symmetric)) for s in settings}
        if len(bits) > 1 or len(blocks) > 1 or len(sym) > 1:
            skipped[weight] = (
                "tied/shared weight with conflicting overrides for its nodes "
                f"({', '.join(sorted(set(names)))}); kept in float"
            )
            continue
        group = Group(weight, wuses, bits.pop(), blocks.pop(), sym.pop())
        a, b = (int(d) for d in tensor.dims)
        n_rows, k = (a, b) if wuses[0].rows_are_table_rows else (b, a)
        gathers = [u for u in wuses if u.is_gather]
        if gathers and n_rows < opts.gather_min_rows:
            skipped[weight] = (
                f"Gather table with {n_rows} rows (< gather_min_rows={opts.gather_min_rows}): tiny tables such as "
                "token-type embeddings save nothing and their error reaches every token; kept in float"
            )
            continue
        if gathers and len(gathers) < len(wuses) and k % group.block_size:
            # a tied table is shared only when blocks tile its rows exactly: use the largest block that does
            fit = next((bs for bs in (256, 128, 64, 32, 16) if bs < group.block_size and k % bs == 0), None)
            if fit is not None:
                notes[weight] = f"tied table of width {k}: block_size {group.block_size} -> {fit} so both ends share it"
                group.block_size = fit
        reason = _layout_problem(group, tensor)
        if reason:
            skipped[weight] = reason
            continue
        groups.append(group)
    return Plan(groups, skipped, notes)


def _subgraph_reads(graph: onnx.GraphProto) -> set[str]:
    reads: set[str] = set()
    for node in graph.node:
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for g in subs:
                reads |= used_names(g)
    return reads


def _classify(
    node: onnx.NodeProto,
    inits: dict[str, onnx.TensorProto],
    prods: dict[str, onnx.NodeProto],
    cons: dict[str, list[onnx.NodeProto]],
) -> tuple[Use | None, str, str | None]:
    """How ``node`` reads a constant weight, or why it cannot be quantized."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Gather":
        name = node.input[0]
        t = inits.get(name)
        kind, tr = "gather", None
        if t is None and name in prods and prods[name].op_type == "Transpose":
            tr = prods[name]
            perm = [int(p) for p in attrs_of(tr).get("perm", [1, 0])]
            src = inits.get(tr.input[0])
            if src is not None and len(src.dims) == 2 and perm == [1, 0]:
                t, name, kind = src, tr.input[0], "gather_t"
        if t is None:
            return None, "", None  # a Gather on activations
        if len(t.dims) != 2 or t.data_type not in FLOAT_TYPES:
            return None, "", "Gather table is not a 2-D float initializer"
        if attrs.get("axis", 0) != 0:
            return None, "", "Gather axis is not 0 (GatherBlockQuantized needs gather_axis 0)"
        return Use(node, kind, tr if kind == "gather_t" else None), name, None
    if len(node.input) < 2:
        return None, "", None
    b = node.input[1]
    transpose = None
    t = inits.get(b)
    if t is None and node.op_type == "MatMul" and b in prods and prods[b].op_type == "Transpose":
        tr = prods[b]
        perm = [int(p) for p in attrs_of(tr).get("perm", [1, 0])]
        src = inits.get(tr.input[0])
        if src is not None and len(src.dims) == 2 and perm == [1, 0]:
            t, transpose, b = src, tr, tr.input[0]
    if t is None:
        return None, "", None  # activations x activations (attention scores): nothing to do
    if len(t.dims) != 2:
        return None, "", f"weight {b} is {len(t.dims)}-D; only 2-D weights are quantized"
    if t.data_type not in FLOAT_TYPES:
        return None, "", f"weight {b} is not float"
    if node.op_type == "MatMul":
        return Use(node, "matmul_t" if transpose is not None else "matmul", transpose), b, None
    # Gemm: Y = alpha * A' B' + beta * C
    if attrs.get("transA", 0):
        return None, "", "Gemm with transA=1 is skipped (MatMulNBits has no transposed A)"
    if float(attrs.get("alpha", 1.0)) != 1.0:
        return None, "", "Gemm with alpha != 1 is skipped (no exact rewrite)"
    if len(node.input) > 2 and node.input[2] and float(attrs.get("beta", 1.0)) != 1.0:
        return None, "", "Gemm with beta != 1 is skipped (no exact rewrite)"
    return Use(node, "gemm_t" if attrs.get("transB", 0) else "gemm"), b, None


def attrs_of(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _layout_problem(group: Group, tensor: onnx.TensorProto) -> str | None:
    a, b = (int(d) for d in tensor.dims)
    rows, cols = (a, b) if group.uses[0].rows_are_table_rows else (b, a)
    has_gather = any(u.is_gather for u in group.uses)
    has_matmul = any(not u.is_gather for u in group.uses)
    if has_gather:
        hidden = cols
        if hidden * group.bits % 8:
            return f"Gather table width {hidden} does not fill whole bytes at {group.bits} bits; kept in float"
        if tensor.data_type == onnx.TensorProto.BFLOAT16:
            return "bfloat16 tables are not supported by GatherBlockQuantized on CPU; kept in float"
    if has_gather and has_matmul:
        share = layout.tied_table_sharing(
            rows, cols, group.bits, group.block_size, "none" if group.symmetric else "uint8", flat=False
        )
        if not share.shareable:
            return (
                f"tied table read by Gather and MatMul cannot share one quantized layout ({share.reason}); "
                "both stay float so the tie is kept"
            )
    return None


# -- reading, solving, writing -----------------------------------------------------------------------
@dataclass
class Result:
    """What a solver produced for one group, ready to be written."""

    group: Group
    blocks: QuantizedBlocks  # q is left empty: ``packed`` holds the integers
    packed: np.ndarray  # uint8 [rows, n_blocks, block_size * bits / 8] (pack_along_last)
    k: int  # true reduction length (before padding)
    dtype: np.dtype  # the weight's float type (scales use it)
    error: float  # relative Frobenius error of the dequantized weight


@dataclass
class Chunk:
    """A slab of one weight, K padded with zeros to whole blocks.

    ``data`` is float32 as stored: ``[rows, K]`` for row-oriented weights (tables, ``[N, K]``
    sources), ``[K, N]`` bands for MatMul weights (``k_major``). :attr:`w` gives the solver's
    orientation ``[rows, blocks, block_size]``; :meth:`kn` a packing kernel's ``[K, rows]``.
    """

    rows: slice
    blocks: slice
    data: np.ndarray
    k_major: bool
    block_size: int
    k_valid: int  # real (unpadded) K elements in this chunk

    @property
    def w(self) -> np.ndarray:
        d = transposed(self.data) if self.k_major else self.data
        return d.reshape(d.shape[0], -1, self.block_size)

    def kn(self) -> np.ndarray:
        return self.data if self.k_major else transposed(self.data)

    def sample_rows(self, step: int) -> np.ndarray:
        """Every ``step``-th row in the solver's orientation, ``[rows / step, K]``."""
        return np.ascontiguousarray(self.data[:, ::step].T if self.k_major else self.data[::step])


#: rows per strip of :func:`transposed`
_TRANSPOSE_STRIP = 64


def transposed(a: np.ndarray) -> np.ndarray:
    """``a.T`` of a 2-D array, C-contiguous, copied in strips of rows.

    numpy's plain transposing copy walks the source with a stride of one row; with power-of-two
    row lengths (every hidden size) those addresses share cache sets and the copy runs 5-7x
    slower than in strips of a few dozen rows.
    """
    out = np.empty(a.shape[::-1], a.dtype)
    for r in range(0, a.shape[0], _TRANSPOSE_STRIP):
        out[:, r : r + _TRANSPOSE_STRIP] = a[r : r + _TRANSPOSE_STRIP].T
    return out


class _ReadBuffers:
    """Per-weight scratch for chunk reads: reused, so reading costs no page faults per chunk."""

    def __init__(self, dtype: np.dtype, elements: int) -> None:
        self.raw = np.empty(elements, dtype)
        self.f32 = self.raw if dtype == np.float32 else np.empty(elements, np.float32)

    def read(self, reader: Any, r0: int, r1: int, row_shape: tuple[int, ...]) -> np.ndarray:
        n = (r1 - r0) * int(np.prod(row_shape, dtype=np.int64))
        raw = reader(r0, r1, out=self.raw[:n].reshape(r1 - r0, *row_shape))
        if raw.dtype == np.float32 and raw.flags.c_contiguous:
            return raw  # read into the buffer, or a view of weights already in memory
        out = self.f32[:n].reshape(r1 - r0, *row_shape)
        np.copyto(out, raw, casting="unsafe")
        return out


def iter_chunks(model: OnnxModel, group: Group) -> Iterator[Chunk]:
    """Read a weight in slabs of at most ``CHUNK_ELEMENTS`` elements.

    Row-oriented weights (tables, ``[N, K]`` Gemm/Transpose sources) are read as row ranges;
    ``[K, N]`` MatMul weights as bands of whole blocks along K (contiguous rows of the stored
    tensor). Reads are explicit (no memory map left behind) into buffers reused from chunk to
    chunk, so resident memory stays at a few slabs per worker however large the model. A
    chunk's arrays are valid until the next chunk is asked for.
    """
    tensor = model.initializers()[group.weight]
    a, b = (int(d) for d in tensor.dims)
    bs = group.block_size
    reader = model.resolver.row_reader(tensor)
    if group.uses[0].rows_are_table_rows:
        rows, k = a, b
        n_blocks = -(-k // bs)
        step = max(1, CHUNK_ELEMENTS // max(k, 1))
        bufs = _ReadBuffers(np_dtype(tensor), min(rows, step) * k)
        pad = np.zeros((min(rows, step), n_blocks * bs), np.float32) if n_blocks * bs != k else None
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            w = bufs.read(reader, r0, r1, (k,))
            if pad is not None:
                pad[: r1 - r0, :k] = w
                w = pad[: r1 - r0]
            yield Chunk(slice(r0, r1), slice(0, n_blocks), w, False, bs, k)
    else:
        k, rows = a, b
        n_blocks = -(-k // bs)
        blocks_per_step = max(1, CHUNK_ELEMENTS // max(rows * bs, 1))
        bufs = _ReadBuffers(np_dtype(tensor), min(n_blocks, blocks_per_step) * bs * rows)
        for b0 in range(0, n_blocks, blocks_per_step):
            b1 = min(n_blocks, b0 + blocks_per_step)
            k0, k1 = b0 * bs, min(k, b1 * bs)
            band = bufs.read(reader, k0, k1, (rows,))  # [k1 - k0, N]
            if k1 - k0 != (b1 - b0) * bs:  # the last band: pad K with zeros to whole blocks
                padded = np.zeros(((b1 - b0) * bs, rows), np.float32)
                padded[: k1 - k0] = band
                band = padded
            yield Chunk(slice(0, rows), slice(b0, b1), band, True, bs, k1 - k0)


#: When a packing kernel solved a weight of many rows, its error is measured on every
#: ``ERROR_SAMPLE_STEP``-th row only, keeping at least ``ERROR_SAMPLE_MIN_ROWS`` rows: unpacking
#: every integer again costs a fifth of a whole RTN run. Weights under twice that many rows are
#: measured exactly. (A sample of >= 1024 rows puts the estimate within about 1% of the exact one.)
ERROR_SAMPLE_STEP = 8
ERROR_SAMPLE_MIN_ROWS = 1024


@dataclass
class _ErrorSum:
    num: float = 0.0
    den: float = 0.0

    def add(self, deq: np.ndarray, w: np.ndarray, k_valid: int) -> None:
        """Accumulate ``|deq - w|^2`` and ``|w|^2``; ``deq`` (``[rows, blocks, block]``, overwritten)
        and ``w`` (``[rows, K_padded]``) are the same rows."""
        deq = deq.reshape(w.shape)
        deq -= w
        if k_valid != w.shape[1]:  # the zero padding of the last block is not part of the weight
            deq, w = deq[:, :k_valid], w[:, :k_valid]
        d, x = deq.ravel(), w.ravel()
        self.num += float(np.dot(d, d))
        self.den += float(np.dot(x, x))

    @property
    def relative(self) -> float:
        return (self.num / self.den) ** 0.5 if self.den else 0.0


def solve_group(
    model: OnnxModel, group: Group, solver: BlockSolver, float_zero_points: bool,
    importance: np.ndarray | None = None, kernel: PackingKernel | None = None,
) -> Result:
    tensor = model.initializers()[group.weight]
    dtype = np_dtype(tensor)
    a, b = (int(d) for d in tensor.dims)
    by_rows = group.uses[0].rows_are_table_rows
    rows, k = (a, b) if by_rows else (b, a)
    bs = group.block_size
    n_blocks = -(-k // bs)
    # float offsets exist only for 4-bit MatMulNBits: not for Gather, nor for 8 bits on CPU
    use_float_zp = (
        float_zero_points and not group.symmetric and group.bits == 4
        and not any(u.is_gather for u in group.uses)
    )
    spec = BlockSpec(group.bits, bs, group.symmetric, use_float_zp)
    # packed chunk by chunk: the result holds bits/8 bytes per weight, not one
    packed = np.empty((rows, n_blocks, bs * group.bits // 8), np.uint8)
    scales = np.empty((rows, n_blocks), np.float32)
    zps = None if group.symmetric else np.empty((rows, n_blocks), np.float32 if use_float_zp else np.uint8)
    err = _ErrorSum()
    if importance is not None and importance.shape[0] != k:
        importance = None
    imp = None if importance is None else np.pad(importance.astype(np.float32), (0, n_blocks * bs - k))
    if imp is not None:
        kernel = None  # a packing kernel knows no activation statistics
    step = max(1, min(ERROR_SAMPLE_STEP, rows // ERROR_SAMPLE_MIN_ROWS))
    for c in iter_chunks(model, group):
        fast = _run_kernel(kernel, c, spec, group.weight) if kernel is not None else None
        if fast is not None:
            packed[c.rows, c.blocks] = fast.packed
            scales[c.rows, c.blocks] = fast.scales
            if zps is not None:
                zps[c.rows, c.blocks] = fast.zero_points
            # the error on every step-th row (all rows of a small weight)
            sample = QuantizedBlocks(
                layout.unpack_along_last(fast.packed[::step], spec.bits, bs), fast.scales[::step],
                None if fast.zero_points is None else fast.zero_points[::step],
            )
            err.add(dequantize(sample, spec.bits), c.sample_rows(step), c.k_valid)
            del fast, sample
            continue
        w3 = c.w
        imp_c = None if imp is None else imp[c.blocks.start * bs : c.blocks.stop * bs]
        try:
            out = solver(w3, spec, imp_c)
        except ValueError as exc:  # solvers refuse what they cannot quantize (NaN weights, ...)
            raise QuantizationError(f"weight {group.weight}: {exc}") from None
        _check_solver_output(out, w3.shape, spec, group.weight)
        # NaN / inf weights make every solver's scales non-finite: one check on the small array
        if not np.isfinite(out.scales).all():
            raise QuantizationError(f"weight {group.weight} holds NaN or infinite values; cannot quantize it")
        packed[c.rows, c.blocks] = layout.pack_along_last(out.q, group.bits)
        scales[c.rows, c.blocks] = out.scales
        if zps is not None:
            if out.zero_points is None:
                raise QuantizationError(f"solver returned no zero points for asymmetric {group.weight}")
            zps[c.rows, c.blocks] = out.zero_points
        nrows = w3.shape[0]
        err.add(dequantize(out, spec.bits), w3.reshape(nrows, -1), c.k_valid)
        del out, w3
    blocks = QuantizedBlocks(np.empty((rows, n_blocks, 0), np.uint8), scales, zps)
    return Result(group, blocks, packed, k, dtype, err.relative)


def _run_kernel(kernel: PackingKernel, c: Chunk, spec: BlockSpec, name: str) -> PackedBlocks | None:
    # A sum is finite only when every element is (NaN and inf propagate): one cheap pass. The
    # kernels' min/max would not reliably turn NaN into a non-finite scale.
    with np.errstate(over="ignore", invalid="ignore"):  # a huge finite sum falls back to the exact test
        total = np.add.reduce(c.data, axis=None)
    if not np.isfinite(total) and not np.isfinite(c.data).all():
        raise QuantizationError(f"weight {name} holds NaN or infinite values; cannot quantize it")
    out = kernel(c.kn(), spec)
    if out is None:
        return None
    n_rows = c.rows.stop - c.rows.start
    shape = (n_rows, c.blocks.stop - c.blocks.start)
    if out.packed.dtype != np.uint8 or out.packed.shape != (*shape, spec.block_size * spec.bits // 8) or (
        out.scales.shape != shape or (out.zero_points is None) != spec.symmetric
    ):
        raise QuantizationError(f"the packing kernel returned unexpected shapes for {name}")
    return out


def _check_solver_output(out: QuantizedBlocks, shape: tuple[int, ...], spec: BlockSpec, name: str) -> None:
    if out.q.shape != shape or out.scales.shape != shape[:2]:
        raise QuantizationError(
            f"the block solver returned shapes q{out.q.shape} scales{out.scales.shape} for {name}, "
            f"expected q{shape} scales{shape[:2]}"
        )
    if out.q.dtype != np.uint8 or (out.q.size and int(out.q.max()) >= 2**spec.bits):
        raise QuantizationError(f"the block solver returned integers outside [0, 2**{spec.bits}) for {name}")


class Writer:
    """Applies solved groups to the graph (single-threaded: protobuf edits are not thread-safe)."""

    def __init__(self, model: OnnxModel, accuracy_level: int) -> None:
        self.model = model
        self.accuracy_level = accuracy_level
        self.graph = model.graph
        self.replace: dict[int, list[onnx.NodeProto]] = {}  # id(old node) -> new nodes
        self.drop: set[int] = set()
        self.new_inits: list[onnx.TensorProto] = []
        self.stored_bytes = 0  # integers, scales and zero points written

    def write(self, res: Result) -> None:
        g = res.group
        weight = g.weight
        scale_dtype = np.float16 if res.dtype == np.float16 else np.float32
        if res.dtype not in (np.dtype(np.float16), np.dtype(np.float32)):
            scale_dtype = np.float32
        has_gather = any(u.is_gather for u in g.uses)
        matmul_uses = [u for u in g.uses if not u.is_gather]
        tag = f"Q{g.bits}"
        if matmul_uses:
            mt = layout.to_matmul_nbits(res.blocks, g.bits, res.k, scale_dtype, flat=not has_gather,
                                        packed_q=res.packed)
            b_name = f"{weight}_{tag}"
            s_name = f"{weight}_scales"
            z_name = f"{weight}_zero_points" if mt.zero_points is not None else ""
            self._add(b_name, mt.b)
            self._add(s_name, mt.scales)
            if z_name:
                self._add(z_name, mt.zero_points)
            for u in matmul_uses:
                self._matmul(u, mt, b_name, s_name, z_name)
        if has_gather:
            hidden = res.k
            gt_attrs = {"bits": g.bits, "block_size": g.block_size, "gather_axis": 0, "quantize_axis": 1}
            if matmul_uses:
                # tied: one B tensor; the Gather reads it through a Reshape (same bytes)
                rows = res.packed.shape[0]
                shape_name = f"{weight}_gather_shape"
                data_name = f"{weight}_{tag}_gather"
                self._add(shape_name, np.array([rows, hidden * g.bits // 8], np.int64))
                reshape = helper.make_node(
                    "Reshape", [b_name, shape_name], [data_name], name=f"{weight}_{tag}_Reshape"
                )
                gs_name, gz_name = s_name, z_name
                pre = [reshape]
            else:
                gt = layout.to_gather_block_quantized(res.blocks, g.bits, hidden, scale_dtype, packed_q=res.packed)
                data_name = f"{weight}_{tag}"
                gs_name = f"{weight}_scales"
                gz_name = f"{weight}_zero_points" if gt.zero_points is not None else ""
                self._add(data_name, gt.data)
                self._add(gs_name, gt.scales)
                if gz_name:
                    self._add(gz_name, gt.zero_points)
                pre = []
            for i, u in enumerate(u for u in g.uses if u.is_gather):
                inputs = [data_name, u.node.input[1], gs_name] + ([gz_name] if gz_name else [])
                node = helper.make_node(
                    "GatherBlockQuantized", inputs, list(u.node.output),
                    name=f"{u.node.name or weight}_{tag}", domain=MS_DOMAIN, **gt_attrs,
                )
                self.replace[id(u.node)] = ([*pre] if i == 0 else []) + [node]
                if u.transpose is not None:
                    self.drop.add(id(u.transpose))

    def _add(self, name: str, array: np.ndarray) -> None:
        if array.dtype != np.int64:  # not the Reshape target shape
            self.stored_bytes += array.nbytes
        self.new_inits.append(self.model.make_tensor(name, array))

    def _matmul(self, u: Use, mt: layout.MatMulNBitsTensors, b: str, s: str, z: str) -> None:
        node = u.node
        out = node.output[0]
        inputs = [node.input[0], b, s] + ([z] if z else [])
        new_nodes = []
        gemm_bias = node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]
        mm_out = f"{out}_MatMulNBits" if gemm_bias else out
        new_nodes.append(helper.make_node(
            "MatMulNBits", inputs, [mm_out], name=f"{node.name or out}_Q{mt.bits}", domain=MS_DOMAIN,
            **mt.attributes(self.accuracy_level),
        ))
        if gemm_bias:
            new_nodes.append(helper.make_node("Add", [mm_out, node.input[2]], [out], name=f"{node.name}_bias"))
        self.replace[id(node)] = new_nodes
        if u.transpose is not None:
            self.drop.add(id(u.transpose))

    def finish(self) -> None:
        """Swap nodes in place (keeping topological order) and drop orphaned initializers."""
        nodes = []
        for node in self.graph.node:
            if id(node) in self.drop:
                continue
            nodes.extend(self.replace.get(id(node), [node]))
        new = [onnx.NodeProto() for _ in nodes]
        for dst, src in zip(new, nodes, strict=True):
            dst.CopyFrom(src)
        del self.graph.node[:]
        self.graph.node.extend(new)
        self.graph.initializer.extend(self.new_inits)
        self.model.remove_unused_initializers()
        self.model.modified = True


# -- the pass -------------------------------------------------------------------------------------------
@dataclass
class Report:
    quantized: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)  # weight -> relative error
    weights: int = 0  # float weights quantized
    stored_bytes: int = 0  # bytes of integers, scales and zero points written for them

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.stored_bytes / self.weights if self.weights else 0.0

    def summary(self) -> str:
        text = f"quantized {self.quantized} weights ({self.bits_per_weight:.2f} bits per weight)"
        if self.errors:
            worst = max(self.errors.items(), key=lambda kv: kv[1])
            mean = sum(self.errors.values()) / len(self.errors)
            text += f", relative weight error mean {mean:.4f}, worst {worst[1]:.4f} ({worst[0]})"
        if self.skipped:
            text += f"; {len(self.skipped)} left in float (see -v)"
        return text


def quantize_weights(
    model: OnnxModel, opts: WeightOnlyOptions, solver: BlockSolver, context: PassContext, *,
    float_zero_points: bool = False, importance: dict[str, np.ndarray] | None = None,
    kernel: PackingKernel | None = None,
) -> Report:
    """Quantize every planned weight of ``model`` in place; tensors are solved in parallel.

    ``kernel``: the solver's optional packing fast path (see :class:`PackingKernel`).
    """
    p = plan(model, opts)
    report = Report(skipped=dict(p.skipped))
    for what, why in p.skipped.items():
        log.info("not quantized: %s: %s", what, why)
    for what, why in p.notes.items():
        log.info("%s: %s", what, why)
    if not p.groups:
        log.warning("no weights to quantize in %s", model.source.name)
        return report
    writer = Writer(model, opts.accuracy_level)
    jobs = max(1, int(context.jobs))

    def work(group: Group) -> Result:
        imp = None
        if importance is not None:
            imp = importance.get(group.weight)
        return solve_group(model, group, solver, float_zero_points, imp, kernel)

    # bounded in-flight work: at most ``jobs + 1`` tensors solved but not yet written
    with context.step(len(p.groups), "quantizing") as advance, ThreadPoolExecutor(jobs) as pool:
        pending: set[Future[Result]] = set()
        todo = iter(sorted(p.groups, key=lambda g: -_numel(model, g)))
        done_all = False
        while pending or not done_all:
            while not done_all and len(pending) < jobs + 1:
                group = next(todo, None)
                if group is None:
                    done_all = True
                    break
                pending.add(pool.submit(work, group))
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                res = fut.result()
                writer.write(res)  # protobuf edits stay on this thread
                report.quantized += 1
                report.weights += res.packed.shape[0] * res.k
                report.errors[res.group.weight] = res.error
                advance(1)
                del res
            del finished, fut  # the futures hold the results: drop them before trimming
            trim_heap()
    writer.finish()
    report.stored_bytes = writer.stored_bytes
    return report


def _numel(model: OnnxModel, group: Group) -> int:
    t = model.initializers()[group.weight]
    return int(np.prod(t.dims))


class WeightOnlyPass(Pass):
    """Base of the native weight-only passes: subclasses provide :meth:`solver`.

    ``float_zero_points``: whether the algorithm's optimum is a float offset (HQQ, k-quant).
    Subclasses may extend :class:`WeightOnlyOptions` with their own fields.
    """

    model_kinds: ClassVar[tuple[str, ...]] = ("onnx",)
    precisions: ClassVar[tuple[str, ...]] = ("int4", "int8")
    Options: ClassVar[type] = WeightOnlyOptions
    #: the solver weights its error by activation statistics when calibration data is given
    uses_importance: ClassVar[bool] = False

    def solver(self) -> BlockSolver:
        raise NotImplementedError

    def packing_kernel(self) -> PackingKernel | None:
        """An optional fused quantize-and-pack kernel giving exactly the solver's answer, faster."""
        return None

    def _importance(self, model: OnnxModel, context: PassContext) -> dict[str, np.ndarray]:
        from bitpress.data import DataConfig, iter_feeds
        from bitpress.onnx.activations import channel_importance

        readers = {
            g.weight: [u.node.input[0] for u in g.uses if not u.is_gather] for g in plan(model, self.options).groups
        }
        readers = {w: acts for w, acts in readers.items() if acts}
        feeds = iter_feeds(model.proto, DataConfig.from_value(context.data), model.source.parent)
        if context.workdir is not None:
            return channel_importance(model, readers, feeds, context.workdir)
        with tempfile.TemporaryDirectory(prefix="bitpress-calibration-") as tmp:
            return channel_importance(model, readers, feeds, Path(tmp))

    def float_zero_points(self) -> bool:
        return bool(getattr(self.options, "float_zero_points", False))

    def run(self, model: Any, context: PassContext) -> Any:
        if not isinstance(model, OnnxModel):
            raise QuantizationError(f"{self.name} quantizes ONNX models, got {model.kind}")
        importance = None
        if self.uses_importance and context.data is not None:
            importance = self._importance(model, context)
        report = quantize_weights(
            model, self.options, self.solver(), context, float_zero_points=self.float_zero_points(),
            importance=importance, kernel=self.packing_kernel(),
        )
        context.extras.setdefault("reports", []).append((self.name, model.source, report))
        log.info("%s: %s", self.name, report.summary())
        return model


__all__ = [
    "Group",
    "Plan",
    "Report",
    "WeightOnlyOptions",
    "WeightOnlyPass",
    "plan",
    "quantize_weights",
]
