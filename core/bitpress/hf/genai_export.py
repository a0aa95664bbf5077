"""Moved: the GenAI export by the model builder is :mod:`bitpress.genai.export` (the ``genai`` package owns
everything about GenAI packages).

This path keeps working for one release and warns when imported.
"""

from __future__ import annotations

import warnings

from bitpress.genai import GENAI_INSTALL_HINT
from bitpress.genai.export import (
    BUILD_TIMEOUT_S,
    EPS,
    EXPORTERS,
    FLOAT_PRECISION,
    GenaiPackage,
    build_genai,
    builder_missing,
    builder_reason,
    check_package,
    fix_tied_gather_scales,
    generate_step,
    greedy,
    stage_files,
)

warnings.warn("bitpress.hf.genai_export moved to bitpress.genai.export; import build_genai and GenaiPackage from there",
              DeprecationWarning, stacklevel=2)

__all__ = ["BUILD_TIMEOUT_S", "EPS", "EXPORTERS", "FLOAT_PRECISION", "GENAI_INSTALL_HINT", "GenaiPackage",
           "build_genai", "builder_missing", "builder_reason", "check_package", "fix_tied_gather_scales",
           "generate_step", "greedy", "stage_files"]
