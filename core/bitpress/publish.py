"""Moved: ``bitpress publish`` (the export matrix) is :mod:`bitpress.genai.publish` (the ``genai`` package owns
everything about GenAI packages).

This path keeps working for one release and warns when imported.
"""

from __future__ import annotations

import warnings

from bitpress.genai.publish import (
    _RUNNABLE,
    INDEX,
    Cell,
    PublishResult,
    _check_genai,
    check_eval,
    evaluate_cells,
    load_publish_config,
    plan_cells,
    publish,
)

warnings.warn("bitpress.publish moved to bitpress.genai.publish; import publish from there",
              DeprecationWarning, stacklevel=2)

__all__ = [
    "INDEX",
    "_RUNNABLE",
    "Cell",
    "PublishResult",
    "_check_genai",
    "check_eval",
    "evaluate_cells",
    "load_publish_config",
    "plan_cells",
    "publish",
]
