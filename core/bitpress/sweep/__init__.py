"""``bitpress sweep CONFIG``: every model x pass x grid point, run in parallel, evaluated, compared.

A sweep config lists models, passes (each with fixed options and a grid of values to try) and
how to evaluate; each combination is one job with a stable id and its own output
(``OUT/runs/<id>/``); each finished job appends its row to ``OUT/results.jsonl`` (a rerun skips
the jobs done) and rewrites ``OUT/report.html``, the size / error Pareto front of every model.
With ``publish:``, every cell of ``bitpress publish``'s GenAI export matrix is a job too, for each
Hugging Face model. See docs/sweep.md.

``bitpress.sweep(config, ...)`` is :func:`bitpress.sweep.runner.sweep`: this package is callable so that
the package name and the function name can be the same (as ``bitpress.evaluate``).

May import: errors, evaluate, executors, genai, hub (Hub ids as models), interrupts, models, options,
output, plugins, workflow.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    # `import bitpress.sweep` binds this package as the attribute `bitpress.sweep`, so a function
    # of that name in bitpress/__init__ would be replaced by it (or would hide the package); a
    # callable package serves both uses.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from bitpress.sweep.runner import sweep

        return sweep(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule


def __getattr__(name: str) -> Any:
    # the package stays light (it is imported with bitpress); its parts load when used
    if name in ("SweepResult", "sweep"):
        from bitpress.sweep import runner

        return getattr(runner, name)
    if name in ("SweepConfig", "Job", "EvalSpec", "parse_sweep", "load_sweep_config", "job_id"):
        from bitpress.sweep import config

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EvalSpec", "Job", "SweepConfig", "SweepResult", "job_id", "load_sweep_config", "parse_sweep", "sweep"]
