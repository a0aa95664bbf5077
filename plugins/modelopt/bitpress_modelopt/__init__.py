"""bitpress-modelopt: NVIDIA ModelOpt (``modelopt.onnx.quantization``) as bitpress passes.

``modelopt_int4``: int4 weight-only AWQ (awq_lite, awq_clip) or RTN (rtn_dq), with ``layers_8bit``
/ ``enable_mixed_quant`` for per-channel int8 layers; written as ``com.microsoft`` MatMulNBits
(default) or kept in ModelOpt's ``DequantizeLinear -> MatMul`` form. ``modelopt_int8``: static
int8 QDQ (entropy / max calibration). The plugin itself needs only the host; the toolkit comes
with the ``toolkit`` extra or, better, an environment of its own: ``bitpress env create modelopt``.
"""

from __future__ import annotations

from bitpress.plugin import hookimpl
from bitpress_modelopt.passes import PASSES, ModelOptInt4Pass, ModelOptInt8Pass

__all__ = ["ModelOptInt4Pass", "ModelOptInt8Pass"]


@hookimpl
def bitpress_register_passes(register):
    for cls in PASSES:
        register(cls)
