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

The stages live in modules of their own: :mod:`~bitpress.onnx.weightonly.planning` (options and
the plan), :mod:`~bitpress.onnx.weightonly.reading` (chunked reads), :mod:`~bitpress.onnx.weightonly.solving`
(solvers, kernels, error), :mod:`~bitpress.onnx.weightonly.writing` (the new nodes) and
:mod:`~bitpress.onnx.weightonly.passes` (:class:`WeightOnlyPass`, :func:`quantize_weights`,
:class:`Report`). Everything public is importable from this package.

May import: calibration, errors, executors, interrupts, memory, models, options, passes, quant,
selection (and the rest of onnx).
"""

from __future__ import annotations

#: float32 elements per chunk handed to a solver (bounds memory per tensor in flight); read at each call
CHUNK_ELEMENTS = 1 << 20  # 4 MB of float32: small enough for the allocator to reuse (no page-fault storms)

from bitpress.onnx.weightonly.passes import WeightOnlyPass, quantize_weights  # noqa: E402
from bitpress.onnx.weightonly.planning import (  # noqa: E402
    FLOAT_TYPES,
    Group,
    Plan,
    Use,
    WeightOnlyOptions,
    attrs_of,
    check_bits_block,
    plan,
)
from bitpress.onnx.weightonly.reading import Chunk, iter_chunks, transposed  # noqa: E402
from bitpress.onnx.weightonly.report import Report, WeightRow, planned_report  # noqa: E402
from bitpress.onnx.weightonly.solving import (  # noqa: E402
    ERROR_SAMPLE_MIN_ROWS,
    ERROR_SAMPLE_STEP,
    Result,
    solve_group,
)
from bitpress.onnx.weightonly.writing import Writer  # noqa: E402

__all__ = [
    "CHUNK_ELEMENTS",
    "ERROR_SAMPLE_MIN_ROWS",
    "ERROR_SAMPLE_STEP",
    "FLOAT_TYPES",
    "Chunk",
    "Group",
    "Plan",
    "Report",
    "Result",
    "Use",
    "WeightOnlyOptions",
    "WeightOnlyPass",
    "WeightRow",
    "Writer",
    "attrs_of",
    "check_bits_block",
    "iter_chunks",
    "plan",
    "planned_report",
    "quantize_weights",
    "solve_group",
    "transposed",
]
