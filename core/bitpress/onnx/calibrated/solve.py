"""Solving one planned weight with a calibrated solver, in slabs of whole rows, and what it costs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from bitpress.errors import QuantizationError
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx import layout
from bitpress.onnx.calibrated.substitutes import SubstituteStore
from bitpress.onnx.tensors import np_dtype
from bitpress.onnx.weightonly.planning import Group, zero_point_kind
from bitpress.onnx.weightonly.solving import Result, check_solver_output
from bitpress.onnx.weightonly.writing import scale_dtype_of
from bitpress.quant.calibrated import CalibratedSolver, LayerStats, Target, output_error
from bitpress.quant.solver import BlockSpec, QuantizedBlocks, dequantize

#: float32 elements of one slab of rows handed to a calibrated solver (whole rows: all of K)
ROW_CHUNK_ELEMENTS = 1 << 22


@dataclass
class Solved:
    """A solved weight: what the writer stores, and its error on the calibration data."""

    result: Result
    output_error: float | None  # ||x (W - Q)|| / ||x W|| over the calibration tokens


def weight_shape(model: OnnxModel, group: Group) -> tuple[int, int]:
    """``(rows, K)`` of a planned weight in the solver's orientation."""
    a, b = (int(d) for d in model.initializers()[group.weight].dims)
    return (a, b) if group.uses[0].rows_are_table_rows else (b, a)


def read_rows(model: OnnxModel, group: Group, r0: int, r1: int) -> np.ndarray:
    """float32 ``[r1 - r0, K]``: rows ``r0:r1`` of a weight in the solver's orientation."""
    tensor = model.initializers()[group.weight]
    reader = model.resolver.row_reader(tensor)
    if group.uses[0].rows_are_table_rows:
        return np.asarray(reader(r0, r1), dtype=np.float32)
    k = int(tensor.dims[0])
    out = np.empty((r1 - r0, k), np.float32)
    band = max(1, ROW_CHUNK_ELEMENTS // max(int(tensor.dims[1]), 1))
    for k0 in range(0, k, band):
        k1 = min(k, k0 + band)
        out[:, k0:k1] = np.asarray(reader(k0, k1)[:, r0:r1], dtype=np.float32).T
    return out


def computed_weight(blocks: QuantizedBlocks, bits: int, dtype: np.dtype) -> np.ndarray:
    """float32 ``[rows, n_blocks, block_size]``: what the written model computes with for a weight of
    ``dtype``: the scales (and float zero points) rounded to the type the writer stores them in."""
    stored = scale_dtype_of(dtype)
    zps = blocks.zero_points
    if zps is not None and zps.dtype != np.uint8:
        zps = zps.astype(stored).astype(np.float32)
    return dequantize(QuantizedBlocks(blocks.q, blocks.scales.astype(stored).astype(np.float32), zps), bits)


def spec_of(group: Group, float_zero_points: bool) -> BlockSpec:
    return BlockSpec(group.bits, group.block_size, group.symmetric,
                     zero_point_kind(group, float_zero_points) == "float")


def solve_calibrated(
    model: OnnxModel, group: Group, solver: CalibratedSolver, prepared: object, stats: LayerStats | None,
    spec: BlockSpec, *, scales: np.ndarray | None = None, substitutes: SubstituteStore | None = None,
) -> Solved:
    """Quantize ``group`` with ``solver`` (prepared for its input, whose statistics are ``stats``).

    ``scales``: the input's AWQ scales (the weight's columns are multiplied by them first and
    ``stats`` are those of ``x / s``; the error is measured on the weight the model computes
    with, ``Q / s``, for the unscaled input). ``substitutes``: where the dequantized weight goes,
    slab by slab, for the later stages of a sequential run."""
    tensor = model.initializers()[group.weight]
    dtype = np_dtype(tensor)
    rows, k = weight_shape(model, group)
    bs = spec.block_size
    n_blocks = -(-k // bs)
    kp = n_blocks * bs
    packed = np.empty((rows, n_blocks, bs * spec.bits // 8), np.uint8)
    out_scales = np.empty((rows, n_blocks), np.float32)
    zps = None if spec.symmetric else np.empty((rows, n_blocks), np.float32 if spec.float_zero_points else np.uint8)
    with contextlib.ExitStack() as stack:
        sub = None
        if substitutes is not None:  # closed (and on failure left to the store to delete) on the way out
            sub = stack.enter_context(substitutes.writer(group.weight, tuple(int(d) for d in tensor.dims), dtype,
                                                         transposed=not group.uses[0].rows_are_table_rows))
        target = Target(group.weight, tuple(u.node.name for u in group.uses))
        err_num = err_den = out_num = out_den = 0.0
        step = max(1, ROW_CHUNK_ELEMENTS // max(kp, 1))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            w = read_rows(model, group, r0, r1)
            if not np.isfinite(w).all():
                raise QuantizationError(f"weight {group.weight} holds NaN or infinite values; cannot quantize it")
            ws = w if scales is None else w * scales[None, :]
            wp = np.zeros((r1 - r0, kp), np.float32)
            wp[:, :k] = ws
            try:
                q = solver.solve(wp, spec, prepared, target)
            except ValueError as exc:
                raise QuantizationError(f"weight {group.weight}: {exc}") from None
            check_solver_output(q, (r1 - r0, n_blocks, bs), spec, group.weight)
            if not np.isfinite(q.scales).all():
                raise QuantizationError(f"weight {group.weight}: the solver returned non-finite scales")
            if zps is not None and q.zero_points is None:
                raise QuantizationError(f"solver returned no zero points for asymmetric {group.weight}")
            packed[r0:r1] = layout.pack_along_last(q.q, spec.bits)
            out_scales[r0:r1] = q.scales
            if zps is not None:
                zps[r0:r1] = q.zero_points
            deq = computed_weight(q, spec.bits, dtype).reshape(r1 - r0, kp)[:, :k]
            if scales is not None:
                deq /= scales[None, :]
            d = w - deq
            err_num += float(np.einsum("ij,ij->", d, d, dtype=np.float64))
            err_den += float(np.einsum("ij,ij->", w, w, dtype=np.float64))
            if stats is not None and (stats.hessian is not None or stats.sample is not None):
                # x (W - Q/s)^T = (x / s) ((W - Q/s) * s)^T: the scaled statistics, the difference scaled back
                out_num += output_error(stats, d if scales is None else d * scales[None, :])
                out_den += output_error(stats, ws)
            if sub is not None:
                sub.write(r0, deq)
            del w, ws, wp, q, deq, d
    blocks = QuantizedBlocks(np.empty((rows, n_blocks, 0), np.uint8), out_scales, zps)
    res = Result(group, blocks, packed, k, dtype, (err_num / err_den) ** 0.5 if err_den else 0.0)
    out_err = (out_num / out_den) ** 0.5 if out_den else None
    return Solved(res, out_err)
