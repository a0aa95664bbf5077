"""bitpress-gptq: GPTQ (second-order, calibration-driven) weight-only quantization, in numpy.

:class:`~bitpress_gptq.solver.GptqSolver` implements the host's
:class:`~bitpress.quant.calibrated.CalibratedSolver` contract; the passes run it on the
statistics the host collects.
"""

from __future__ import annotations

from bitpress.plugin import hookimpl
from bitpress_gptq.solver import GptqPrepared, GptqSettings, GptqSolver

__all__ = ["GptqPrepared", "GptqSettings", "GptqSolver"]


@hookimpl
def bitpress_register_passes(register):
    from bitpress_gptq.passes import GptqPass

    register(GptqPass)
    # Hugging Face (PyTorch) passes: their modules import torch only when they run
    from bitpress_gptq.hf_passes import GptqHfPass

    register(GptqHfPass)
