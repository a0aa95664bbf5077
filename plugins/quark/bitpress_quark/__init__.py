"""bitpress-quark: AMD Quark (``quark.onnx``) as bitpress passes.

Static int8 (QDQ / QOperator), dynamic int8 and int4 weight-only MatMulNBits (DEFAULT, HQQ), and
Olive's QuarkQuantization configs (``quark``: global / per-layer / per-op-type settings, CLE, SmoothQuant);
on Hugging Face checkpoints Quark's PyTorch quantizer (``quark_hf``: int4 weight-only, AWQ, GPTQ, ...).
The plugin itself needs only the host; the toolkit (``amd-quark``, torch) comes with the
``toolkit`` extra or, better, an environment of its own: ``bitpress env create quark``.
"""

from __future__ import annotations

from bitpress.plugin import hookimpl
from bitpress_quark.hf import QuarkHfPass
from bitpress_quark.olive import QuarkQuantizationPass
from bitpress_quark.passes import PASSES, QuarkDynamicPass, QuarkInt4Pass, QuarkStaticPass

__all__ = ["QuarkDynamicPass", "QuarkHfPass", "QuarkInt4Pass", "QuarkQuantizationPass", "QuarkStaticPass"]


@hookimpl
def bitpress_register_passes(register):
    for cls in (*PASSES, QuarkQuantizationPass, QuarkHfPass):
        register(cls)
