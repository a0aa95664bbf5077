"""Calibrated weight-only quantization of ONNX graphs: the host's half of GPTQ, AWQ and the like.

A plugin gives a :class:`~bitpress.quant.calibrated.CalibratedSolver` (and optionally an
:class:`~bitpress.quant.calibrated.InputScaler`) by subclassing :class:`CalibratedPass`; the
host does the rest: the plan (the same as every weight-only pass: selection, overrides, tied
tables), the calibration data (``--data``), the statistics of every weight's input computed
stage by stage in ONNX Runtime (:mod:`~bitpress.onnx.calibrated.stages`), the frontier values
between stages kept within ``memory_mb`` (:mod:`~bitpress.onnx.calibrated.frontier`), the
solve in slabs of rows (:mod:`~bitpress.onnx.calibrated.solve`), the dequantized weights later
stages compute with kept in files (:mod:`~bitpress.onnx.calibrated.substitutes`), the exact input scaling
(:mod:`~bitpress.onnx.calibrated.scaling`), and the ``MatMulNBits`` / ``GatherBlockQuantized``
nodes written from the solver's integers as they are. See docs/writing-a-plugin.md.

May import: calibration, errors, memory, models, options, passes, plugins, quant (and the rest of
onnx).
"""

from __future__ import annotations

from bitpress.onnx.calibrated.passes import CalibratedOptions, CalibratedPass
from bitpress.onnx.calibrated.scaling import InputScaling, apply_scalings
from bitpress.onnx.calibrated.stages import Stage, StagePlan, order_activations, plan_stages
from bitpress.onnx.calibrated.stats import StatsAccumulator

__all__ = [
    "CalibratedOptions",
    "CalibratedPass",
    "InputScaling",
    "Stage",
    "StagePlan",
    "StatsAccumulator",
    "apply_scalings",
    "order_activations",
    "plan_stages",
]
