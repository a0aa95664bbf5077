"""bitpress-rotate: QuaRot, an orthogonal rotation of a decoder that leaves its function unchanged
and spreads its weights' outliers, so that a quantizer run after it (``gptq``, ``rtn``, ...) loses less.

:mod:`bitpress_rotate.matrices` builds the rotations (randomized Hadamard matrices of the widths
models use, or random orthogonal ones), :mod:`bitpress_rotate.stream` finds the residual stream of
an ONNX decoder and the weights around it, :mod:`bitpress_rotate.rotate` applies the rotation;
:mod:`bitpress_rotate.hf` is the same rotation on a Hugging Face (PyTorch) decoder (``quarot_hf``).
"""

from __future__ import annotations

from bitpress.plugin import hookimpl


@hookimpl
def bitpress_register_passes(register):
    from bitpress_rotate.hf import QuarotHfPass
    from bitpress_rotate.passes import QuarotPass
    from bitpress_rotate.spinquant import SpinQuantHfPass

    register(QuarotPass)
    register(QuarotHfPass)
    register(SpinQuantHfPass)
