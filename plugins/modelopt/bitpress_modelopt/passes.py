"""The ModelOpt passes: int4 weight-only (AWQ / RTN) and static int8.

Importing this module imports neither ``modelopt`` nor ``torch``: the host lists these passes
(as unavailable, with the install command) wherever the plugin is installed. ModelOpt is
imported inside ``run()``, under :func:`bitpress_modelopt.sandbox.contained`.

Option names follow Olive's ``NVModelOptQuantization`` (``algorithm``, ``calibration_method``,
``enable_mixed_quant``, ``layers_8bit``) and ModelOpt's own ``quantize()`` arguments.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from bitpress.plugin import (
    NameMatcher,
    OnnxModel,
    Pass,
    PassContext,
    UsageError,
    calibration_feeds,
    check_block_size,
    option,
    placeholder_feeds,
    resolve_accuracy_level,
)
from bitpress_modelopt.runner import ModelOptCall, exact_patterns, name_nodes, run_modelopt

#: shown when ModelOpt is missing; an environment of its own because its [onnx] extra replaces onnxruntime
INSTALL_HINT = (
    "bitpress env create modelopt (an isolated environment, recommended: nvidia-modelopt[onnx] would replace "
    'onnxruntime with onnxruntime-gpu) or pip install "bitpress[modelopt]"'
)
REQUIRES = ("modelopt", "torch", "onnx_graphsurgeon", "onnxruntime")
#: the LM head as ModelOpt's int4 default excludes it (``nodes_to_exclude=[r"/lm_head"]``, re.match)
LM_HEAD = "/lm_head*"
#: ModelOpt's layers_8bit syntax: comma-separated dot / slash separated names
_LAYERS_8BIT = re.compile(r"\s*[/A-Za-z0-9_.\-]+(\s*,\s*[/A-Za-z0-9_.\-]+)*\s*")

Int4Method = Literal["awq_lite", "awq_clip", "rtn_dq"]
_METHOD_ALGORITHM = {"awq_lite": "awq", "awq_clip": "awq", "rtn_dq": "rtn"}
_DEFAULT_METHOD = {"awq": "awq_lite", "rtn": "rtn_dq"}

log = logging.getLogger(__name__)


class _ModelOptPass(Pass):
    requires: ClassVar[tuple[str, ...]] = REQUIRES
    install_hint: ClassVar[str | None] = INSTALL_HINT

    def _onnx(self, model: Any) -> OnnxModel:
        if not isinstance(model, OnnxModel):
            raise UsageError(f"{self.name} takes ONNX models, got {model.describe()}")
        return model

    def _excluded(self, model: OnnxModel, patterns: list[str] | None) -> list[str]:
        """Names of the nodes ``patterns`` (``None``: the LM head) select; unknown patterns are errors."""
        name_nodes(model.proto)
        names = [n.name for n in model.graph.node]
        if patterns is None:
            matcher = NameMatcher([LM_HEAD], what="nodes_to_exclude")
        else:
            matcher = NameMatcher(patterns, what="nodes_to_exclude")
            unmatched = matcher.unmatched(names)
            if unmatched:
                raise UsageError(
                    f"{self.name}: nodes_to_exclude {', '.join(map(repr, unmatched))} matches no node of "
                    f"{model.source.name} (exact names, globs like '/model/layers.0/*' or re:REGEX)"
                )
        return [n for n in names if matcher.matches(n)]


def _quantizable(model: OnnxModel, excluded: list[str]) -> list[str]:
    """MatMul / Gemm nodes ModelOpt's int4 path quantizes: a constant weight (input B), not excluded."""
    inits = {t.name for t in model.graph.initializer}
    skip = set(excluded)
    return [n.name for n in model.graph.node
            if n.op_type in ("MatMul", "Gemm") and n.name not in skip and len(n.input) > 1
            and n.input[1] in inits and n.input[0] not in inits]


# -- int4 weight-only ------------------------------------------------------------------------------------
@dataclass
class ModelOptInt4Options:
    algorithm: Literal["awq", "rtn"] | None = option(
        None, "awq: activation-aware (needs calibration data); rtn: round to nearest (no data). "
        "Unset: from calibration_method, else awq"
    )
    calibration_method: Int4Method | None = option(
        None, "awq_lite: per-channel activation scales searched on the data; awq_clip: per-block weight clipping "
        "searched on the data; rtn_dq: round to nearest. Unset: awq_lite for awq, rtn_dq for rtn"
    )
    block_size: int = option(128, "weights per block along K: a power of two from 16 to 256")
    nodes_to_exclude: list[str] | None = option(
        None, "nodes left in float (exact names, globs or re:REGEX). Unset: the LM head (nodes named /lm_head*, "
        "as ModelOpt's own default, unless layers_8bit names it); [] quantizes the LM head too"
    )
    enable_mixed_quant: bool = option(
        False, "ModelOpt's default mixed precision: per-channel int8 for the qkv/v_proj and down_proj MatMuls of "
        "the first and last eighth of the layers and of every third layer between, int4 elsewhere"
    )
    layers_8bit: str = option(
        "", "comma-separated layer patterns quantized to per-channel int8 instead of int4, as ModelOpt matches "
        "them: dot-separated parts of node names ('model.layers.0,lm_head' matches /model/layers.0/...); "
        "enables mixed precision"
    )
    use_zero_point: bool = option(False, "awq_lite only: asymmetric uint4 with zero points (default: symmetric int4)")
    awqlite_fuse_nodes: bool = option(
        True, "awq_lite: one scale per group of MatMuls reading the same activation, folded into the preceding "
        "Mul / norm weight where possible (ModelOpt's default); false: a Mul before each MatMul, each its own scale"
    )
    output_format: Literal["matmulnbits", "qdq"] = option(
        "matmulnbits", "matmulnbits: com.microsoft MatMulNBits, the same integers and scales as ModelOpt wrote "
        "(smaller, loads faster); qdq: ModelOpt's DequantizeLinear(int4, blocked) -> MatMul at opset 21"
    )
    accuracy_level: int | None = option(
        None, "MatMulNBits accuracy_level (output_format matmulnbits): 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8; "
        "null: 4, what runs fastest on CPU (bitpress.onnx.kernels)"
    )

    def method(self) -> Int4Method:
        """The calibration method that runs (``algorithm`` and ``calibration_method`` reconciled)."""
        if self.calibration_method is not None:
            return self.calibration_method
        return _DEFAULT_METHOD[self.algorithm or "awq"]  # type: ignore[return-value]

    def validate(self) -> None:
        if (self.algorithm is not None and self.calibration_method is not None
                and _METHOD_ALGORITHM[self.calibration_method] != self.algorithm):
            raise ValueError(
                f"calibration_method {self.calibration_method} is not an {self.algorithm} method "
                f"(awq: awq_lite, awq_clip; rtn: rtn_dq)"
            )
        check_block_size(self.block_size)
        if self.use_zero_point and self.method() != "awq_lite":
            raise ValueError(
                f"use_zero_point: ModelOpt's {self.method()} is symmetric only (awq_lite takes zero points)"
            )
        if self.accuracy_level is not None and self.accuracy_level not in range(5):
            raise ValueError(f"accuracy_level must be 0 to 4, got {self.accuracy_level}")
        if self.accuracy_level and self.output_format == "qdq":
            raise ValueError("accuracy_level is a MatMulNBits attribute: it needs output_format matmulnbits")
        if self.layers_8bit and not _LAYERS_8BIT.fullmatch(self.layers_8bit):
            raise ValueError(
                f"layers_8bit {self.layers_8bit!r}: give comma-separated names of letters, digits, '.', '/', '_' "
                "and '-' (like 'model.layers.0,lm_head')"
            )
        if self.nodes_to_exclude is not None:
            NameMatcher(self.nodes_to_exclude, what="nodes_to_exclude")


class ModelOptInt4Pass(_ModelOptPass):
    """NVIDIA ModelOpt int4 weight-only quantization (AWQ or RTN), MatMulNBits or QDQ output."""

    name = "modelopt_int4"
    aliases = ("NVModelOptQuantization",)
    algorithms = ("modelopt_int4", "modelopt_awq")
    precisions = ("int4",)
    #: the default algorithm (awq) calibrates; an rtn instance says False (see __init__)
    needs_data = True
    #: Olive's examples give no data (Olive would download a dataset): awq then calibrates on the model's own text
    own_text_default = True
    summary = "NVIDIA ModelOpt int4 weight-only (AWQ lite / clip or RTN; int8 layers; MatMulNBits or QDQ)"
    Options: ClassVar[type] = ModelOptInt4Options

    def __init__(self, options: Any | None = None) -> None:
        super().__init__(options)
        self.needs_data = self.options.method() != "rtn_dq"

    def run(self, model: Any, context: PassContext) -> Any:
        model = self._onnx(model)
        o: ModelOptInt4Options = self.options
        method = o.method()
        if method == "rtn_dq":
            if context.data is not None:
                log.info("%s: rtn_dq uses no calibration data: --data is ignored", self.name)
            feeds = placeholder_feeds(model)  # ModelOpt's reader must exist; RTN never runs it
        else:
            feeds = calibration_feeds(model, context.data, who=f"{self.name} ({method})")
        excluded = self._excluded(model, o.nodes_to_exclude)
        quantizable = _quantizable(model, excluded)
        details: dict[str, Any] = {"calibration_method": method, "output_format": o.output_format,
                                   "nodes_excluded": len(excluded)}

        def check(moq: Any) -> None:
            if o.layers_8bit and o.nodes_to_exclude is None:
                # a layer the user names for 8 bits is quantized although ModelOpt's default leaves it out
                named = _default_excluded_named(o.layers_8bit, excluded)
                if named:
                    log.info("%s: layers_8bit names %s, which ModelOpt's default nodes_to_exclude leaves in float: "
                             "quantized at 8 bits", self.name, ", ".join(named))
                    excluded[:] = [n for n in excluded if n not in named]
                    quantizable[:] = _quantizable(model, excluded)
                    call.kwargs["nodes_to_exclude"] = exact_patterns(excluded)
                    details["nodes_excluded"] = len(excluded)
            if not quantizable:
                raise UsageError(
                    f"{self.name}: {model.source.name} has no MatMul / Gemm with a constant weight left to quantize"
                    + (f" ({len(excluded)} nodes excluded)" if excluded else "")
                )
            if o.layers_8bit:
                details["layers_8bit"] = _layers_8bit(self.name, o.layers_8bit, quantizable)

        mode = f"int4 {method} (block {o.block_size}" + (", zero points" if o.use_zero_point else "") + ")"
        if o.layers_8bit or o.enable_mixed_quant:
            mode += " with int8 layers"
        call = ModelOptCall(
            mode=mode,
            kwargs={
                "quantize_mode": "int4", "calibration_method": method, "block_size": o.block_size,
                "nodes_to_exclude": exact_patterns(excluded), "use_zero_point": o.use_zero_point,
                "enable_mixed_quant": o.enable_mixed_quant, "layers_8bit": o.layers_8bit or None,
                "awqlite_fuse_nodes": o.awqlite_fuse_nodes,
                # ModelOpt copies every initializer two nodes read (a tied embedding / LM head table
                # becomes two tensors, one quantized): keep shared weights one tensor
                "enable_shared_constants_duplication": False,
            },
            quantized_ops=("DequantizeLinear",), feeds=feeds, details=details,
        )
        return run_modelopt(model, context, pass_name=self.name, call=call, check=check,
                            to_nbits=resolve_accuracy_level(o.accuracy_level, "cpu") if o.output_format == "matmulnbits"
                            else None)


def _default_excluded_named(patterns: str, excluded: list[str]) -> list[str]:
    """The nodes of the default exclusion (the LM head) that ``layers_8bit`` names."""
    from modelopt.onnx.quantization.graph_utils import should_quantize_to_8bit

    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    return [n for n in excluded if should_quantize_to_8bit(n, wanted)]


def _layers_8bit(pass_name: str, patterns: str, quantizable: list[str]) -> list[str]:
    """The nodes ModelOpt will quantize to int8 for ``patterns``; a pattern that matches none is an error."""
    from modelopt.onnx.quantization.graph_utils import should_quantize_to_8bit

    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    unmatched = [p for p in wanted if not any(should_quantize_to_8bit(n, [p]) for n in quantizable)]
    if unmatched:
        raise UsageError(
            f"{pass_name}: layers_8bit {', '.join(map(repr, unmatched))} matches no quantized MatMul / Gemm "
            "(ModelOpt compares dot-separated parts of node names: 'model.layers.0' matches /model/layers.0/..., "
            "not /model/layers.10/...)"
        )
    return [n for n in quantizable if should_quantize_to_8bit(n, wanted)]


# -- static int8 -----------------------------------------------------------------------------------------
@dataclass
class ModelOptInt8Options:
    calibration_method: Literal["entropy", "max"] = option(
        "entropy", "activation ranges: entropy (KL-divergence thresholds, ModelOpt's default) or max (the "
        "largest magnitude seen); symmetric int8 activations, per-channel symmetric int8 weights"
    )
    nodes_to_exclude: list[str] = option([], "nodes left in float (exact names, globs or re:REGEX)")
    op_types_to_exclude: list[str] = option([], "op types left in float")
    high_precision_dtype: Literal["fp32", "fp16"] = option(
        "fp32", "the float type of what stays float: fp32 keeps the model's (ModelOpt's own default, fp16, "
        "targets GPUs); the graph inputs and outputs keep their type"
    )
    dq_only: bool = option(
        True, "store int8 weights, read by DequantizeLinear; false: float weights with QuantizeLinear -> "
        "DequantizeLinear (ModelOpt's default: the file stays as large as the float model)"
    )

    def validate(self) -> None:
        NameMatcher(self.nodes_to_exclude, what="nodes_to_exclude")


class ModelOptInt8Pass(_ModelOptPass):
    """NVIDIA ModelOpt static int8: QDQ with calibrated activation ranges."""

    name = "modelopt_int8"
    algorithms = ("modelopt_int8", "modelopt_static")
    precisions = ("int8",)
    needs_data = True
    summary = "NVIDIA ModelOpt static int8 QDQ (entropy or max calibration, per-channel weights)"
    Options: ClassVar[type] = ModelOptInt8Options

    def run(self, model: Any, context: PassContext) -> Any:
        model = self._onnx(model)
        o: ModelOptInt8Options = self.options
        feeds = calibration_feeds(model, context.data, who=f"{self.name} static quantization")
        excluded = self._excluded(model, o.nodes_to_exclude)
        present = {n.op_type for n in model.graph.node}
        unknown = sorted(set(o.op_types_to_exclude) - present)
        if unknown:
            raise UsageError(f"{self.name}: op_types_to_exclude: {model.source.name} has no {', '.join(unknown)} nodes")
        call = ModelOptCall(
            mode=f"static int8 ({o.calibration_method})",
            kwargs={
                "quantize_mode": "int8", "calibration_method": o.calibration_method,
                "nodes_to_exclude": exact_patterns(excluded), "op_types_to_exclude": list(o.op_types_to_exclude),
                "high_precision_dtype": o.high_precision_dtype, "dq_only": o.dq_only,
                "enable_shared_constants_duplication": False,
                # a TensorRT heuristic: MatMuls with M or N of 1 in the calibration shapes (one token,
                # batch 1) or K / N under 16 left in float, as they do not use Tensor Cores
                "enable_gemv_detection_for_trt": False,
            },
            quantized_ops=("QuantizeLinear",), feeds=feeds,
            details={"calibration_method": o.calibration_method, "nodes_excluded": len(excluded)},
        )
        return run_modelopt(model, context, pass_name=self.name, call=call)


PASSES = (ModelOptInt4Pass, ModelOptInt8Pass)
