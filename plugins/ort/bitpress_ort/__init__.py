"""bitpress-ort: ONNX Runtime's own int8 quantization (``onnxruntime.quantization``) as bitpress passes.

``ort_static`` (Olive's ``OnnxStaticQuantization``), ``ort_dynamic`` (``OnnxDynamicQuantization``)
and ``ort_tune`` (``OnnxQuantization``: a small search over static and dynamic settings, scored
by the output error on held-back calibration samples). The plugin needs only ONNX Runtime,
one of the host's own dependencies: it runs in the host's environment.
"""

from __future__ import annotations

from bitpress.plugin import hookimpl
from bitpress_ort.passes import PASSES, OrtDynamicPass, OrtStaticPass
from bitpress_ort.tuning import OrtTunePass

__all__ = ["OrtDynamicPass", "OrtStaticPass", "OrtTunePass"]


@hookimpl
def bitpress_register_passes(register):
    for cls in (*PASSES, OrtTunePass):
        register(cls)
