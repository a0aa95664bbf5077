"""Moved: the GenAI export by mobius is :mod:`bitpress.genai.mobius` (the ``genai`` package owns everything about
GenAI packages).

This path keeps working for one release and warns when imported.
"""

from __future__ import annotations

import warnings

from bitpress.genai.mobius import (
    CPU_RUNNABLE,
    MOBIUS_EPS,
    finish_mobius,
    mobius_argv,
    mobius_missing,
    set_accuracy_level,
)

warnings.warn("bitpress.hf.mobius_export moved to bitpress.genai.mobius; import mobius_argv from there",
              DeprecationWarning, stacklevel=2)

__all__ = ["CPU_RUNNABLE", "MOBIUS_EPS", "finish_mobius", "mobius_argv", "mobius_missing", "set_accuracy_level"]
