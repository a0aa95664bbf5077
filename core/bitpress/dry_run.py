"""Moved: ``--plan`` is :mod:`bitpress.workflow.plan` (the ``workflow`` package owns configs, plans and runs).

This path keeps working for one release and warns when imported.
"""

from __future__ import annotations

import warnings

from bitpress.workflow.plan import (
    PlanResult,
    StepPlan,
    plan_lines,
    plan_quantize,
    plan_run,
    plan_workflow,
    weight_table_lines,
)

warnings.warn("bitpress.dry_run moved to bitpress.workflow.plan; import plan_workflow and the rest from there",
              DeprecationWarning, stacklevel=2)

__all__ = ["PlanResult", "StepPlan", "plan_lines", "plan_quantize", "plan_run", "plan_workflow", "weight_table_lines"]
