"""bitpress-rtn: round-to-nearest weight-only quantization (int4/int8) and NF4/FP4.

The plugin supplies block solvers; the host's weight-only machinery does the graph work.
"""

from __future__ import annotations

from bitpress.plugin import hookimpl
from bitpress_rtn.passes import Bnb4Pass, RtnPass

__all__ = ["Bnb4Pass", "RtnPass"]


@hookimpl
def bitpress_register_passes(register):
    register(RtnPass)
    register(Bnb4Pass)
    # Hugging Face (PyTorch) passes: their modules import torch only when they run
    from bitpress_rtn.hf_passes import RtnHfPass

    register(RtnHfPass)
