"""bitpress-inc: Intel Neural Compressor (``onnx-neural-compressor``) as bitpress passes.

Static int8 (QOperator / QDQ, MinMax / Percentile, SmoothQuant), dynamic int8, int4
weight-only MatMulNBits (RTN, AWQ) and INC's accuracy-aware tuning loop, scored by bitpress's
output error. The plugin itself needs only the host; the toolkit comes with the ``toolkit``
extra or, better, an environment of its own: ``bitpress env create inc``.
"""

from __future__ import annotations

from bitpress.plugin import hookimpl
from bitpress_inc.passes import PASSES, IncDynamicPass, IncPass, IncStaticPass, IncWeightOnlyPass

__all__ = ["IncDynamicPass", "IncPass", "IncStaticPass", "IncWeightOnlyPass"]


@hookimpl
def bitpress_register_passes(register):
    for cls in PASSES:
        register(cls)
