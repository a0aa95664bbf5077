"""bitpress-aimet: Qualcomm AIMET (``aimet-onnx``) as a bitpress pass.

QuantSim static quantization to a QDQ model (int4 / int8 / int16 weights; uint8 / uint16
activations), with LPBQ, SeqMSE and AdaRound, as Olive's ``AimetQuantization``. The plugin
itself needs only the host; the toolkit comes with an environment of its own:
``bitpress env create aimet``.
"""

from __future__ import annotations

from bitpress.plugin import hookimpl
from bitpress_aimet.passes import PASSES, AimetPass

__all__ = ["AimetPass"]


@hookimpl
def bitpress_register_passes(register):
    for cls in PASSES:
        register(cls)
