"""Workflows: a config read and checked, a run planned, a run carried out.

What it owns, one module each:

* :mod:`~bitpress.workflow.config`: building a workflow from a config: :func:`load_config` (JSON /
  YAML, bounded in size, depth and values), :func:`build_workflow` (every key and option checked,
  every pass built, before any work) and the :class:`Workflow` / :class:`PassStep` it makes; which
  pass a name or an algorithm means for the input's kind (:func:`input_kind`);
* :mod:`~bitpress.workflow.plan`: planning one (``--plan``): what each pass would do to every weight,
  nothing written;
* :mod:`~bitpress.workflow.runner`: running one: the passes in order, the output assembled in a
  temporary folder, checked and moved into place atomically (:func:`run_workflow`, :func:`run`,
  :class:`RunResult`), and the ``bitpress`` metadata a run records (:func:`record_pass`).

This package re-exports the names of ``config`` and ``runner`` that other code uses; ``plan`` is
imported by its path (the command line's ``--plan``), so importing the package does not import it.
Code below the workflow that a run uses (passes, plugins, models, onnx, output, envs) never imports it;
the code that runs whole workflows (:mod:`bitpress.api`, :mod:`bitpress.sweep`,
:mod:`bitpress.genai.publish`) and :mod:`bitpress.evaluate` (reading the metadata a run recorded) do.

May import: calibration (config: data), crashwatch, envs (pinned passes, isolated runs), errors, executors,
hf (the order of calibrated passes), interrupts, models, onnx, options, output, passes, plugins, selection.
"""

from bitpress.workflow.config import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_VALUES,
    MAX_JOBS,
    PassStep,
    Workflow,
    build_workflow,
    check_jobs,
    input_kind,
    load_config,
    select_pass,
)
from bitpress.workflow.runner import MAX_OUTPUT_PART, METADATA_KEY, RunResult, record_pass, run, run_workflow

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_VALUES",
    "MAX_JOBS",
    "MAX_OUTPUT_PART",
    "METADATA_KEY",
    "PassStep",
    "RunResult",
    "Workflow",
    "build_workflow",
    "check_jobs",
    "input_kind",
    "load_config",
    "record_pass",
    "run",
    "run_workflow",
    "select_pass",
]
