"""Hand an :class:`~bitpress.models.onnx_model.OnnxModel` to ModelOpt and take its result back.

``modelopt.onnx.quantization.quantize`` takes a model path and writes the quantized model to an
output path: the model is saved into a :class:`~bitpress.toolkit.workspace.Workspace`, ModelOpt
runs under :func:`bitpress_modelopt.sandbox.contained`, and its output becomes the new handle
(then, for ``output_format: matmulnbits``, rewritten by the host's QDQ -> MatMulNBits converter).
Nothing from ``modelopt`` is imported at module level.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import onnx

from bitpress.plugin import (
    Feed,
    FeedReader,
    OnnxModel,
    PassContext,
    QdqConversion,
    QuantizationError,
    ToolReport,
    UsageError,
    Workspace,
    convert_qdq_to_nbits,
    count_ops,
    dist_version,
    drop_unused_opsets,
    record_report,
)
from bitpress_modelopt.sandbox import contained, import_modelopt

log = logging.getLogger(__name__)

#: names per alternation in one ModelOpt pattern (ModelOpt runs re.match of each pattern on each node)
_NAMES_PER_PATTERN = 200


class ModelOptReader(FeedReader):
    """The host's feeds as ModelOpt's calibration reader: ONNX Runtime's interface plus ``get_first``.

    ModelOpt runs one inference on ``get_first()`` (to learn tensor shapes) before calibrating, a
    method of its own readers that ONNX Runtime's ``CalibrationDataReader`` lacks.
    """

    def get_first(self) -> Feed:
        return self.feeds[0]


def exact_patterns(names: Iterable[str]) -> list[str]:
    """ModelOpt node patterns (``re.match``) that match exactly ``names``, a few hundred per pattern."""
    names = sorted(set(names))
    return ["^(?:" + "|".join(re.escape(n) for n in names[i:i + _NAMES_PER_PATTERN]) + ")$"
            for i in range(0, len(names), _NAMES_PER_PATTERN)]


def name_nodes(proto: onnx.ModelProto) -> int:
    """Give unnamed nodes of the main graph a unique name (ModelOpt selects nodes by name)."""
    taken = {n.name for n in proto.graph.node if n.name}
    named = 0
    for i, node in enumerate(proto.graph.node):
        if not node.name:
            name, k = f"/{node.op_type}_{i}", 0
            while name in taken:
                k += 1
                name = f"/{node.op_type}_{i}_{k}"
            node.name = name
            taken.add(name)
            named += 1
    return named


@dataclass
class ModelOptCall:
    """One ``quantize()`` call: the mode, the keyword arguments, what must be in the output."""

    mode: str  # what the report says, e.g. "int4 awq_lite (block 128)"
    kwargs: dict[str, Any]
    #: op types the output must hold at least one of (ModelOpt writes the input back when it quantizes nothing)
    quantized_ops: tuple[str, ...]
    feeds: list[Feed] | None = None
    details: dict[str, Any] = field(default_factory=dict)


def run_modelopt(
    model: OnnxModel,
    context: PassContext,
    *,
    pass_name: str,
    call: ModelOptCall,
    check: Callable[[Any], None] | None = None,
    to_nbits: int | None = None,
) -> OnnxModel:
    """Run ``modelopt.onnx.quantization.quantize`` on ``model``; the output is the new handle.

    ``check(moq)`` runs after ModelOpt is imported and before anything is written (option checks
    that need ModelOpt's own functions). ``to_nbits``: convert ModelOpt's ``DequantizeLinear ->
    MatMul`` weights to ``MatMulNBits`` with this ``accuracy_level`` (``None``: keep the QDQ form).
    """
    t0 = time.perf_counter()
    moq = import_modelopt()
    if check is not None:
        check(moq)
    ws = Workspace.open(model, context, prefix="modelopt")
    try:
        kwargs = dict(call.kwargs)
        kwargs.update(
            output_path=str(ws.output), use_external_data_format=ws.external, calibration_eps=["cpu"],
            log_level="INFO",
        )
        if call.feeds is not None:
            kwargs["calibration_data_reader"] = ModelOptReader(call.feeds)
        with contained(ws.folder) as messages:
            try:
                moq.quantize(str(ws.input), **kwargs)
            except onnx.checker.ValidationError as exc:
                first = str(exc).strip().splitlines()[0]
                raise UsageError(
                    f"ModelOpt {call.mode}: ModelOpt first runs the ONNX checker on its input, which rejects "
                    f"{model.source.name}: {first}. ONNX Runtime-only ops in the ONNX domain (the ORT GenAI "
                    "builder's SimplifiedLayerNormalization) are the usual cause: export with torch.onnx or "
                    "mobius, or use a native pass (rtn, hqq, kquant)"
                ) from exc
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise QuantizationError(f"ModelOpt {call.mode} failed: {type(exc).__name__}: {first}") from exc
        if not ws.output.exists():
            errors = messages.errors()
            raise QuantizationError(f"ModelOpt {call.mode} failed: {errors[-1] if errors else 'it wrote no model'}")
        ws.drop_input()
        result = ws.load(ws.output, model)
        counts = count_ops(result.proto)
        if not any(counts[op] for op in call.quantized_ops):
            raise QuantizationError(
                f"ModelOpt {call.mode} quantized nothing (no {', '.join(call.quantized_ops)} in its output): the "
                "model has no MatMul / Gemm with a constant weight, or nodes_to_exclude leaves none"
            )
        details = dict(call.details)
        if to_nbits is not None:
            conversion = convert_qdq_to_nbits(result, accuracy_level=to_nbits)
            details.update(_conversion_details(conversion))
            counts = count_ops(result.proto)
        drop_unused_opsets(result.proto)
        found = {op: counts[op] for op in ("MatMulNBits", "DequantizeLinear", "QuantizeLinear") if counts[op]}
        seconds = time.perf_counter() - t0
        record_report(context, pass_name, model,
                      ToolReport("ModelOpt", dist_version("nvidia-modelopt"), call.mode, seconds, found, details))
    except BaseException:
        ws.discard()
        raise
    ws.finish(result)
    model.close()
    return result


def _conversion_details(conversion: QdqConversion) -> dict[str, Any]:
    """What the MatMulNBits rewrite did, for the report; what it left as QDQ is logged with the reason."""
    for name, why in conversion.skipped.items():
        log.info("left as DequantizeLinear -> MatMul: %s (%s)", name, why)
    return {"matmulnbits": len(conversion.converted), "left_qdq": dict(conversion.skipped)}


__all__ = ["ModelOptCall", "ModelOptReader", "exact_patterns", "name_nodes", "run_modelopt"]
