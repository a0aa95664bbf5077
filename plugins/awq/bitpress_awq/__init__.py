"""bitpress-awq: activation-aware weight quantization (AWQ) on bitpress's calibrated machinery.

:mod:`bitpress_awq.search` holds the numeric part: :class:`AwqScaler` (the per-input-channel
scale search, an :class:`~bitpress.quant.calibrated.InputScaler`) and :class:`AwqClipSolver`
(the per-block clip search, a :class:`~bitpress.quant.calibrated.CalibratedSolver`), both
rounding with any block solver (rtn by default).
"""

from __future__ import annotations

from bitpress.plugin import hookimpl
from bitpress_awq.search import AwqClipSolver, AwqScaler

__all__ = ["AwqClipSolver", "AwqScaler"]


@hookimpl
def bitpress_register_passes(register):
    from bitpress_awq.passes import AwqPass

    register(AwqPass)
    # Hugging Face (PyTorch) passes: their modules import torch only when they run
    from bitpress_awq.hf_passes import AwqHfPass

    register(AwqHfPass)
