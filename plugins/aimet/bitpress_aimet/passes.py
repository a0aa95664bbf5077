"""The ``aimet`` pass: Qualcomm AIMET QuantSim to a QDQ model, with LPBQ, SeqMSE and AdaRound.

Importing this module imports neither ``aimet_onnx`` nor ``torch``: the host lists the pass
(as unavailable, with the install command) wherever the plugin is installed. AIMET is imported
inside ``run()``, under :func:`bitpress_aimet.sandbox.contained`.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from bitpress.plugin import OnnxModel, Pass, PassContext, UsageError, calibration_feeds
from bitpress_aimet.options import AimetOptions

#: shown when AIMET is missing: its environment keeps torchvision out (it breaks CPU torch)
INSTALL_HINT = (
    "bitpress env create aimet (an isolated environment: aimet-onnx needs torch, and its dependency "
    "onnx2torch pulls a torchvision that breaks CPU torch, which the environment removes)"
)
REQUIRES = ("aimet_onnx", "torch", "onnxruntime")

log = logging.getLogger(__name__)


class AimetPass(Pass):
    """Qualcomm AIMET: QuantSim calibration to QuantizeLinear/DequantizeLinear, for Snapdragon NPUs."""

    name = "aimet"
    aliases: ClassVar[tuple[str, ...]] = ("AimetQuantization",)
    algorithms = ("aimet",)
    precisions = ("int4", "int8", "int16")
    needs_data = True
    summary = "Qualcomm AIMET QuantSim to QDQ (int4/int8/int16 weights; LPBQ, SeqMSE, AdaRound) for QNN / NPUs"
    requires: ClassVar[tuple[str, ...]] = REQUIRES
    install_hint: ClassVar[str | None] = INSTALL_HINT
    Options: ClassVar[type] = AimetOptions

    def run(self, model: Any, context: PassContext) -> Any:
        from bitpress_aimet.runner import quantize

        if not isinstance(model, OnnxModel):
            raise UsageError(f"{self.name} takes ONNX models, got {model.describe()}")
        o: AimetOptions = self.options
        techniques = o.checked_techniques()
        feeds = calibration_feeds(model, context.data, who="AIMET quantization")
        return quantize(model, context, o, techniques, feeds, self.name)


PASSES = (AimetPass,)
