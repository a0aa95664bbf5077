"""Solving one planned weight: the plugin's block solver (or packing kernel) chunk by chunk, and its error."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bitpress.errors import QuantizationError
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx import layout
from bitpress.onnx.weightonly.planning import Group, zero_point_kind
from bitpress.onnx.weightonly.reading import Chunk, TensorSource, iter_source_chunks
from bitpress.quant.solver import (
    BlockSolver,
    BlockSpec,
    PackedBlocks,
    PackingKernel,
    QuantizedBlocks,
    dequantize,
)


@dataclass
class Result:
    """What a solver produced for one group, ready to be written."""

    group: Group
    blocks: QuantizedBlocks  # q is left empty: ``packed`` holds the integers
    packed: np.ndarray  # uint8 [rows, n_blocks, block_size * bits / 8] (pack_along_last)
    k: int  # true reduction length (before padding)
    dtype: np.dtype  # the weight's float type (scales use it)
    error: float  # relative Frobenius error of the dequantized weight
    #: float zero points only: ``scales * zero_points`` exactly, when the writer of the blocks knows it better than
    #: that product in float32 (a GGUF's minimum): the block-sum correction is rounded once from it
    offsets: np.ndarray | None = None


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
        # huge but finite weights (|w| ~ 1e20 and up) overflow float32 squares: no RuntimeWarning on
        # stderr (found by the fuzzer, tests/fuzz); those sums are redone in float64
        with np.errstate(over="ignore", invalid="ignore"):
            deq = deq.reshape(w.shape)
            deq -= w
            if k_valid != w.shape[1]:  # the zero padding of the last block is not part of the weight
                deq, w = deq[:, :k_valid], w[:, :k_valid]
            d, x = deq.ravel(), w.ravel()
            num, den = float(np.dot(d, d)), float(np.dot(x, x))
            if not np.isfinite(num + den):
                d64, x64 = d.astype(np.float64), x.astype(np.float64)
                num, den = float(np.dot(d64, d64)), float(np.dot(x64, x64))
        self.num += num
        self.den += den

    @property
    def relative(self) -> float:
        return (self.num / self.den) ** 0.5 if self.den else 0.0


@dataclass(frozen=True)
class SolveTask:
    """Everything solving one weight needs, and nothing of the graph: picklable, so a worker
    process (a Ray task) can solve it and read the weight itself from where it lies."""

    source: TensorSource
    by_rows: bool  # blocks run along the stored tensor's last axis (tables, [N, K] sources)
    spec: BlockSpec
    importance: np.ndarray | None = None  # per input channel, K long
    chunk_elements: int | None = None  # None: the CHUNK_ELEMENTS of the process solving it


@dataclass
class Solved:
    """A solve task's answer: packed integers, scales, zero points and the relative error."""

    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    k: int
    dtype: np.dtype
    error: float


def task_of(model: OnnxModel, group: Group, float_zero_points: bool, importance: np.ndarray | None = None,
            chunk_elements: int | None = None) -> SolveTask:
    """The solve task of a planned weight of ``model``."""
    # float offsets exist only for 4-bit MatMulNBits: not for Gather, nor for 8 bits on CPU
    use_float_zp = zero_point_kind(group, float_zero_points) == "float"
    spec = BlockSpec(group.bits, group.block_size, group.symmetric, use_float_zp)
    return SolveTask(TensorSource.of(model, group.weight), group.uses[0].rows_are_table_rows, spec, importance,
                     chunk_elements)


def solve_group(
    model: OnnxModel, group: Group, solver: BlockSolver, float_zero_points: bool,
    importance: np.ndarray | None = None, kernel: PackingKernel | None = None,
) -> Result:
    return result_of(group, solve_task(task_of(model, group, float_zero_points, importance), solver, kernel))


def result_of(group: Group, solved: Solved) -> Result:
    """A solved task as the :class:`Result` the writer takes for ``group``."""
    blocks = QuantizedBlocks(np.empty((*solved.scales.shape, 0), np.uint8), solved.scales, solved.zero_points)
    return Result(group, blocks, solved.packed, solved.k, solved.dtype, solved.error)


def solve_task(task: SolveTask, solver: BlockSolver, kernel: PackingKernel | None = None) -> Solved:
    """Solve one weight chunk by chunk (module-level: the function a worker process runs)."""
    src, spec = task.source, task.spec
    name = src.name
    dtype = np.dtype(src.dtype)
    a, b = src.shape
    rows, k = (a, b) if task.by_rows else (b, a)
    bs = spec.block_size
    n_blocks = -(-k // bs)
    # packed chunk by chunk: the result holds bits/8 bytes per weight, not one
    packed = np.empty((rows, n_blocks, bs * spec.bits // 8), np.uint8)
    scales = np.empty((rows, n_blocks), np.float32)
    zps = None if spec.symmetric else np.empty((rows, n_blocks), np.float32 if spec.float_zero_points else np.uint8)
    err = _ErrorSum()
    importance = task.importance
    if importance is not None and importance.shape[0] != k:
        importance = None
    imp = None if importance is None else np.pad(importance.astype(np.float32), (0, n_blocks * bs - k))
    if imp is not None:
        kernel = None  # a packing kernel knows no activation statistics
    step = max(1, min(ERROR_SAMPLE_STEP, rows // ERROR_SAMPLE_MIN_ROWS))
    for c in iter_source_chunks(src, task.by_rows, bs, task.chunk_elements):
        fast = _run_kernel(kernel, c, spec, name) if kernel is not None else None
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
            raise QuantizationError(f"weight {name}: {exc}") from None
        check_solver_output(out, w3.shape, spec, name)
        # NaN / inf weights make every solver's scales non-finite: one check on the small array
        if not np.isfinite(out.scales).all():
            raise QuantizationError(f"weight {name} holds NaN or infinite values; cannot quantize it")
        packed[c.rows, c.blocks] = layout.pack_along_last(out.q, spec.bits)
        scales[c.rows, c.blocks] = out.scales
        if zps is not None:
            if out.zero_points is None:
                raise QuantizationError(f"solver returned no zero points for asymmetric {name}")
            zps[c.rows, c.blocks] = out.zero_points
        nrows = w3.shape[0]
        err.add(dequantize(out, spec.bits), w3.reshape(nrows, -1), c.k_valid)
        del out, w3
    return Solved(packed, scales, zps, k, dtype, err.relative)


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


def check_solver_output(out: QuantizedBlocks, shape: tuple[int, ...], spec: BlockSpec, name: str) -> None:
    if out.q.shape != shape or out.scales.shape != shape[:2]:
        raise QuantizationError(
            f"the block solver returned shapes q{out.q.shape} scales{out.scales.shape} for {name}, "
            f"expected q{shape} scales{shape[:2]}"
        )
    if out.q.dtype != np.uint8 or (out.q.size and int(out.q.max()) >= 2**spec.bits):
        raise QuantizationError(f"the block solver returned integers outside [0, 2**{spec.bits}) for {name}")
