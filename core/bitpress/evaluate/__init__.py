"""``bitpress eval``: what quantization cost, measured against the float model.

Runs QUANTIZED and its float reference through ONNX Runtime (CPU) on the same inputs and
reports, per output, max / mean absolute error, relative L2, cosine similarity and (logits)
top-1 agreement; the perplexity of both models on a text; and the SQNR of every quantized
weight against its float original (table, JSON, self-contained HTML report).

``bitpress.evaluate(quantized, reference, ...)`` is :func:`bitpress.evaluate.runner.evaluate`: this package
is callable so that the package name and the function name can be the same.

May import: calibration, errors, genai, hub (Hub ids as the models and tokenizer), models, onnx, speed,
workflow.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from bitpress.evaluate.result import (
    EvalError,
    EvalResult,
    ModelMismatchError,
    OutputMetrics,
    PerplexityResult,
    TensorError,
)


class _CallableModule(types.ModuleType):
    # `import bitpress.evaluate` binds this package as the attribute `bitpress.evaluate`, so a
    # function of that name in bitpress/__init__ would be replaced by it (or would hide the
    # package from `bitpress.evaluate.report`); a callable package serves both uses.
    def __call__(self, *args: Any, **kwargs: Any) -> EvalResult:
        from bitpress.evaluate.runner import evaluate

        return evaluate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = [
    "EvalError",
    "EvalResult",
    "ModelMismatchError",
    "OutputMetrics",
    "PerplexityResult",
    "TensorError",
]
