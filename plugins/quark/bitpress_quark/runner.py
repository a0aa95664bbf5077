"""Hand an :class:`~bitpress.models.onnx_model.OnnxModel` to Quark and take its result back.

Quark's API takes model paths, so the model is saved to a scratch folder, Quark writes its
result beside it, and the result is loaded as the new model handle. The host then saves that
handle like any other (checker, ONNX Runtime session), so every Quark output is validated.
Nothing from ``quark`` is imported at module level.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bitpress.plugin import (
    FeedReader,
    OnnxModel,
    PassContext,
    QuantizationError,
    ToolReport,
    Workspace,
    count_ops,
    dist_version,
    drop_unused_opsets,
    placeholder_feeds,
    record_report,
)
from bitpress.plugin import calibration_feeds as host_calibration_feeds
from bitpress_quark.sandbox import QuarkMessages, contained, import_quark

__all__ = ["FeedReader", "calibration_feeds", "placeholder_feeds", "reject_fallback", "run_quark"]

log = logging.getLogger(__name__)

#: what Quark logs when a histogram calibration failed and it silently retried with another method
_FALLBACK = "Will automatically set the 'calibrate_method'"


def calibration_feeds(model: OnnxModel, data: Any) -> list[dict[str, np.ndarray]]:
    """The host's calibration data (``context.data``) as a list of feeds."""
    return host_calibration_feeds(model, data, who="Quark static quantization")


def run_quark(
    model: OnnxModel,
    context: PassContext,
    *,
    pass_name: str,
    mode: str,
    make_config: Callable[[Any, Path, bool, Path], Any],
    feeds: list[dict[str, np.ndarray]] | None,
    quantized_ops: tuple[str, ...],
    post: Callable[[onnx.ModelProto], None] | None = None,
    check_messages: Callable[[QuarkMessages], None] | None = None,
) -> OnnxModel:
    """Run ``ModelQuantizer(make_config(quark_onnx, tmp_dir, external, src)).quantize_model`` on ``model``
    (``src``: the model as Quark reads it, for configs that look at its nodes).

    ``quantized_ops``: op types of which the output must hold at least one (Quark returns the
    float model, with a warning only, when it finds nothing to quantize). ``post`` edits the
    result's graph before it becomes the new handle.
    """
    ws = Workspace.open(model, context, prefix="quark")
    try:
        src, dest = ws.input, ws.output
        t0 = time.perf_counter()
        quark_onnx = import_quark()
        with contained(ws.folder) as messages:
            config = make_config(quark_onnx, ws.tmp, ws.external, src)
            reader = FeedReader(feeds) if feeds is not None else None
            try:
                quark_onnx.ModelQuantizer(config).quantize_model(str(src), str(dest), reader)
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise QuantizationError(f"Quark {mode} failed: {first}") from exc
        seconds = time.perf_counter() - t0
        if not dest.exists():
            # Quark logs some failures and returns None instead of raising
            errors = messages.errors()
            reason = errors[-1] if errors else "it wrote no output model"
            raise QuantizationError(f"Quark {mode} failed: {reason}")
        if check_messages is not None:
            check_messages(messages)
        ws.drop_input()
        result = ws.load(dest, model)
        counts = count_ops(result.proto)
        found = {op: counts[op] for op in quantized_ops if counts[op]}
        if not found:
            raise QuantizationError(
                f"Quark {mode} quantized nothing (no {', '.join(quantized_ops)} in its output): the model has "
                "no op Quark quantizes in this mode, or the options exclude them all"
            )
        if post is not None:
            post(result.proto)
        drop_unused_opsets(result.proto)
        record_report(context, pass_name, model, ToolReport("Quark", dist_version("amd-quark"), mode, seconds, found))
    except BaseException:
        ws.discard()
        raise
    ws.finish(result)
    model.close()
    return result


def reject_fallback(method: str) -> Callable[[QuarkMessages], None]:
    """Fail when Quark replaced the requested calibration method after an error."""

    def check(messages: QuarkMessages) -> None:
        if messages.matching(_FALLBACK):
            errors = messages.errors()
            why = f" after: {errors[0]}" if errors else ""
            raise QuantizationError(
                f"Quark's {method} calibration failed and Quark fell back to another method{why}; "
                "choose another calibration_method"
            )

    return check
