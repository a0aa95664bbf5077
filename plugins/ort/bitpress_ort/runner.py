"""Stage a model, run ONNX Runtime's pre-processing and quantizer on it, take the result back.

ONNX Runtime's quantization API takes paths: the model is saved into a private folder
(:class:`bitpress.toolkit.workspace.Workspace`) **with external data**, so that the graph can
be read without its weights (:mod:`bitpress_ort.calibration`) and ONNX Runtime writes its
output the same way. Static quantization calibrates with :func:`bitpress_ort.calibration.calibrate`
and hands the ranges to ``quantize_static`` as its calibration cache; dynamic quantization is
``quantize_dynamic`` as is. Every call runs inside :func:`bitpress_ort.sandbox.contained`.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from bitpress.plugin import (
    Feed,
    OnnxModel,
    PassContext,
    QuantizationError,
    SaveOptions,
    Workspace,
    count_ops,
    dist_version,
    drop_unused_opsets,
    is_external,
    iter_graphs,
    save_onnx,
    tensor_nbytes,
)
from bitpress_ort.calibration import CalibrationPlan, CalibrationResult, calibrate, save_cache
from bitpress_ort.sandbox import contained

log = logging.getLogger(__name__)

#: op types whose presence shows that a static QDQ / QOperator or a dynamic model was quantized
STATIC_QDQ_OPS = ("DequantizeLinear",)
STATIC_QOPERATOR_OPS = ("QLinearMatMul", "QLinearConv", "QGemm", "QLinearAdd", "QLinearMul", "QAttention",
                        "QLinearConcat", "QLinearSoftmax", "QLinearSigmoid", "QLinearAveragePool",
                        "QLinearGlobalAveragePool", "QLinearLeakyRelu", "QLinearWhere", "MatMulInteger",
                        "QuantizeLinear")
DYNAMIC_OPS = ("DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "DynamicQuantizeLSTM",
               "DynamicQuantizeMatMul", "QAttention")

#: op types ONNX Runtime's basic optimizations fold when all their inputs are constants: a weight
#: read by one of them *and* by another node is duplicated by the folding (tied embeddings)
_FOLDABLE = frozenset({"Transpose", "Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten"})
#: ...and the folding that pays: a BatchNormalization after a Conv becomes part of the Conv
_FUSED_BY_PREPROCESS = frozenset({"BatchNormalization"})
#: tensors up to this size are read for the symbolic shape inference (bigger ones are weights)
SYMBOLIC_INLINE_BYTES = 1 << 20


@dataclass
class Staged:
    """The model ONNX Runtime reads (the staged input, or its pre-processed copy)."""

    ws: Workspace
    path: Path
    preprocessed: bool
    preprocess_reason: str
    seconds: dict[str, float] = field(default_factory=dict)

    def drop_inputs(self) -> None:
        """Remove the staged and pre-processed copies (disk: a large model's) once the result is loaded."""
        self.ws.drop_input()
        shutil.rmtree(self.ws.tmp / "preprocessed", ignore_errors=True)


def stage(model: OnnxModel, context: PassContext) -> Workspace:
    """A workspace with ``model`` saved at its input, weights as external data."""
    ws = Workspace.open(model, context, prefix="ort", save_input=False)
    try:
        save_onnx(model, ws.input, SaveOptions(external_data=True, check=False))
        ws.external = True
    except BaseException:
        ws.discard()
        raise
    return ws


def preprocess_decision(proto: onnx.ModelProto, value: str | bool) -> tuple[bool, str]:
    """``quant_preprocess`` resolved for this model: ``(run it, why)``.

    ``auto`` runs ONNX Runtime's pre-processing except where its constant folding would store
    a weight twice (a weight read by a foldable op and by another node: a tied embedding and LM
    head). Measured on the test models (static QDQ / QOperator, dynamic): the conv net's
    BatchNormalizations fold into its Convs (a fully int8 graph, output 4% smaller); the
    encoder's output is 2-4% smaller at the same error; the tied decoder's output grows 9-13%
    (the folded [hidden, vocab] head is stored beside the table).
    """
    if isinstance(value, bool):
        return value, "set explicitly"
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for g in iter_graphs(proto.graph):
        for node in g.node:
            for name in node.input:
                consumers.setdefault(name, []).append(node)
    for t in proto.graph.initializer:
        users = consumers.get(t.name, [])
        folded = [n for n in users if n.op_type in _FOLDABLE and all(i == t.name for i in n.input[:1])]
        if folded and len(users) > 1:
            return False, (f"auto: off, ONNX Runtime's constant folding would store {t.name} twice (read by "
                           f"{folded[0].op_type} {folded[0].name!r} and {len(users) - 1} other node(s))")
    fused = sorted({n.op_type for g in iter_graphs(proto.graph) for n in g.node} & _FUSED_BY_PREPROCESS)
    why = f"folds {', '.join(fused)} into the ops before it" if fused else "shape inference and graph optimization"
    return True, f"auto: on ({why})"


def run_preprocess(ws: Workspace, source: Path) -> Path:
    """ONNX Runtime's quantization pre-processing of ``source``, its weights left on disk; inside the sandbox.

    The steps of ``quant_pre_process`` (onnxruntime 1.32), in its order: symbolic shape
    inference, ONNX Runtime's basic graph optimizations, ONNX shape inference, the
    ``onnx.quant.pre_process`` mark. ``quant_pre_process`` itself loads the model's weights into
    Python twice (its copy and the symbolic inference's) beside the optimizing session's; here
    the symbolic inference reads the graph without weights, the session writes the optimized
    weights straight to an external data file and the shape inference goes file to file.
    Models of opset 10 or older (``quant_pre_process`` converts them first) use it as it is.
    """
    import onnxruntime as ort
    from onnxruntime.quantization.quant_utils import add_pre_process_metadata

    out_dir = ws.tmp / "preprocessed"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "model.onnx"
    graph = onnx.load(str(source), load_external_data=False)
    opset = next((o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset <= 10:
        return _quant_pre_process(source, out)
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    # the symbolic inference reads the values of constant inputs (shapes, biases): small tensors
    # are read into the graph, weights stay on disk
    for tensor in graph.graph.initializer:
        if is_external(tensor) and tensor_nbytes(tensor) <= SYMBOLIC_INLINE_BYTES:
            onnx.external_data_helper.load_external_data_for_tensor(tensor, str(source.parent))
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    try:
        inferred = SymbolicShapeInference.infer_shapes(graph, 2**31 - 1, True, False, 0)
    except Exception as exc:  # a bare Exception when shapes are left unknown; a weight it wanted to read
        if "should be stored in" in str(exc):
            log.info("symbolic shape inference reads a weight of more than %d bytes: ONNX Runtime's "
                     "quant_pre_process takes over", SYMBOLIC_INLINE_BYTES)
            return _quant_pre_process(source, out)
        raise QuantizationError(f"ONNX Runtime's symbolic shape inference failed: {_first_line(exc)}") from exc
    if inferred is None:
        raise QuantizationError("ONNX Runtime's symbolic shape inference gave no model (opset below 7?)")
    symbolic = source.with_name("symbolic.onnx")  # beside the weights its references name
    onnx.save(inferred, str(symbolic))
    del graph, inferred
    optimized = out_dir / "optimized.onnx"
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(optimized)
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "model.onnx.data")
    opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    try:
        ort.InferenceSession(str(symbolic), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # quant_pre_process goes on without the optimization: let it
        log.warning("ONNX Runtime's graph optimization failed (%s): ONNX Runtime's quant_pre_process takes over",
                    _first_line(exc))
        symbolic.unlink(missing_ok=True)
        return _quant_pre_process(source, out)
    try:
        onnx.shape_inference.infer_shapes_path(str(optimized), str(out))
    except Exception as exc:  # onnx raises InferenceError and others
        raise QuantizationError(f"ONNX shape inference failed: {_first_line(exc)}") from exc
    final = onnx.load(str(out), load_external_data=False)
    add_pre_process_metadata(final)
    onnx.save(final, str(out))
    symbolic.unlink(missing_ok=True)
    optimized.unlink(missing_ok=True)
    return out


def _quant_pre_process(source: Path, out: Path) -> Path:
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        quant_pre_process(str(source), str(out), auto_merge=True, save_as_external_data=True,
                          all_tensors_to_one_file=True, external_data_location="model.onnx.data")
    except Exception as exc:  # ONNX Runtime raises what its steps raise
        raise QuantizationError(f"ONNX Runtime's quantization pre-processing failed: {_first_line(exc)}") from exc
    if not out.exists():
        raise QuantizationError("ONNX Runtime's quantization pre-processing wrote no model")
    return out


def prepare(model: OnnxModel, context: PassContext, preprocess: str | bool) -> Staged:
    """Stage ``model`` and pre-process it when ``preprocess`` says so (resolved per model)."""
    run, reason = preprocess_decision(model.proto, preprocess)
    log.info("quant_preprocess: %s", reason if run or reason != "set explicitly" else "off (set explicitly)")
    t0 = time.perf_counter()
    ws = stage(model, context)
    staged = Staged(ws, ws.input, False, reason, {"stage": time.perf_counter() - t0})
    if run:
        t0 = time.perf_counter()
        try:
            with contained(ws.folder):
                staged.path = run_preprocess(ws, ws.input)
            staged.preprocessed = True
        except QuantizationError as exc:
            if preprocess is True:
                ws.discard()
                raise QuantizationError(f"{exc}; rerun with quant_preprocess=false") from exc
            # auto, as Olive does: quantize the model as it is
            log.warning("quant_preprocess=auto: %s; quantizing without pre-processing", exc)
            staged.preprocess_reason = f"{reason}, failed: {exc}"
        except BaseException:
            ws.discard()
            raise
        staged.seconds["preprocess"] = time.perf_counter() - t0
    return staged


@dataclass(frozen=True)
class StaticConfig:
    """Everything ``quantize_static`` is given, in ONNX Runtime's terms (enum names as strings)."""

    quant_format: str
    activation_type: str
    weight_type: str
    per_channel: bool
    reduce_range: bool
    op_types: tuple[str, ...]
    nodes_to_quantize: tuple[str, ...]
    nodes_to_exclude: tuple[str, ...]
    extra_options: dict[str, Any]
    plan: CalibrationPlan

    @property
    def mode(self) -> str:
        pc = ", per channel" if self.per_channel else ""
        return f"static int8 ({self.quant_format}, {self.plan.method}{pc})"


@dataclass(frozen=True)
class DynamicConfig:
    weight_type: str
    per_channel: bool
    reduce_range: bool
    op_types: tuple[str, ...]
    nodes_to_quantize: tuple[str, ...]
    nodes_to_exclude: tuple[str, ...]
    extra_options: dict[str, Any]

    @property
    def mode(self) -> str:
        return f"dynamic int8{', per channel' if self.per_channel else ''}"


def calibrate_staged(staged: Staged, feeds: list[Feed], plan: CalibrationPlan, context: PassContext,
                     name: str = "calibration") -> tuple[CalibrationResult, Path]:
    """Calibrate the staged model; the ranges as a cache file for ``quantize_static``."""
    t0 = time.perf_counter()
    with contained(staged.ws.folder), context.step(len(feeds), f"{plan.method} calibration") as advance:
        result = calibrate(staged.path, feeds, plan, progress=advance)
        cache = save_cache(result.ranges, staged.ws.tmp / f"{name}-{plan.method}.json")
    staged.seconds["calibration"] = staged.seconds.get("calibration", 0.0) + time.perf_counter() - t0
    log.info("%s calibration: %d tensor(s), %d sample(s) in %d chunk(s)", plan.method, result.tensors,
             result.samples, result.chunks)
    return result, cache


def mask_nodes(staged: Staged, huge: list[str]) -> list[str]:
    """The nodes of the staged graph that read or write one of the ``huge`` tensors (attention masks)."""
    if not huge:
        return []
    wanted = set(huge)
    graph = onnx.load(str(staged.path), load_external_data=False).graph
    return [n.name for n in graph.node if n.name and (wanted & set(n.input) or wanted & set(n.output))]


def with_float_masks(cfg: StaticConfig, staged: Staged, calib: CalibrationResult) -> tuple[StaticConfig, list[str]]:
    """``cfg`` with the nodes around attention masks left in float (``float_masks``), and those nodes."""
    nodes = [n for n in mask_nodes(staged, calib.huge) if n not in cfg.nodes_to_exclude]
    if nodes:
        log.info("float_masks: %d tensor(s) with ranges past 1e30 (attention masks); %d node(s) stay float: %s",
                 len(calib.huge), len(nodes), ", ".join(nodes[:4]) + (" ..." if len(nodes) > 4 else ""))
    return dataclasses.replace(cfg, nodes_to_exclude=(*cfg.nodes_to_exclude, *nodes)), nodes


def quantize_static_from_cache(staged: Staged, cfg: StaticConfig, cache: Path, dest: Path) -> float:
    """``quantize_static`` of the staged model with the calibration cache; returns the seconds."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    dest.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with contained(staged.ws.folder):
        try:
            quantize_static(
                str(staged.path), str(dest), None,
                quant_format=QuantFormat[cfg.quant_format],
                op_types_to_quantize=list(cfg.op_types),
                per_channel=cfg.per_channel,
                reduce_range=cfg.reduce_range,
                activation_type=QuantType[cfg.activation_type],
                weight_type=QuantType[cfg.weight_type],
                nodes_to_quantize=list(cfg.nodes_to_quantize),
                nodes_to_exclude=list(cfg.nodes_to_exclude),
                use_external_data_format=True,
                calibrate_method=CalibrationMethod[cfg.plan.method],
                extra_options=dict(cfg.extra_options),
                calibration_cache_path=str(cache),
            )
        except Exception as exc:  # ONNX Runtime raises what its steps raise
            raise QuantizationError(f"ONNX Runtime {cfg.mode} failed: {_first_line(exc)}") from exc
    if not dest.exists():
        raise QuantizationError(f"ONNX Runtime {cfg.mode} wrote no model")
    return time.perf_counter() - t0


def quantize_dynamic_staged(staged: Staged, cfg: DynamicConfig, dest: Path) -> float:
    """``quantize_dynamic`` of the staged model; returns the seconds."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    dest.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with contained(staged.ws.folder):
        try:
            quantize_dynamic(
                str(staged.path), str(dest),
                op_types_to_quantize=list(cfg.op_types),
                per_channel=cfg.per_channel,
                reduce_range=cfg.reduce_range,
                weight_type=QuantType[cfg.weight_type],
                nodes_to_quantize=list(cfg.nodes_to_quantize),
                nodes_to_exclude=list(cfg.nodes_to_exclude),
                use_external_data_format=True,
                extra_options=dict(cfg.extra_options),
            )
        except Exception as exc:  # ONNX Runtime raises what its steps raise
            raise QuantizationError(f"ONNX Runtime {cfg.mode} failed: {_first_line(exc)}") from exc
    if not dest.exists():
        raise QuantizationError(f"ONNX Runtime {cfg.mode} wrote no model")
    return time.perf_counter() - t0


def check_loads(path: Path, mode: str) -> None:
    """Fail unless ONNX Runtime loads ``path`` with its default session options (all graph optimizations).

    The host's own check loads outputs with optimizations off; ONNX Runtime's QDQ propagation (an
    extended optimization) rejects some of its quantizer's outputs at load: measured with QInt8
    activations when Reshape / Transpose stay unquantized (``op_types_to_quantize=MatMul``, any
    decoder): "output_dtype INT8 does not match y_zero_point type UINT8".
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ONNX Runtime raises its own pybind exception types
        message = _first_line(exc).split("] ")[-1]
        raise QuantizationError(
            f"ONNX Runtime {mode} wrote a model that ONNX Runtime's own graph optimizations reject at load "
            f"({message}); it loads with optimizations at the basic level. Seen with QInt8 activations when "
            "Reshape / Transpose stay unquantized (op_types_to_quantize=MatMul): use activation_type=QUInt8, "
            "or quantize those op types too") from None


def take_result(staged: Staged, model: OnnxModel, path: Path, mode: str, quantized_ops: tuple[str, ...]
                ) -> tuple[OnnxModel, dict[str, int]]:
    """ONNX Runtime's output as the new handle, and the quantized op counts (none: an error)."""
    check_loads(path, mode)
    result = staged.ws.load(path, model)
    counts = count_ops(result.proto)
    found = {op: counts[op] for op in quantized_ops if counts[op]}
    if not found:
        raise QuantizationError(
            f"ONNX Runtime {mode} quantized nothing (no {', '.join(quantized_ops)} in its output): the model has no "
            "op it quantizes in this mode, or the options exclude them all")
    drop_unused_opsets(result.proto)
    return result, found


def static_ops(quant_format: str) -> tuple[str, ...]:
    return STATIC_QDQ_OPS if quant_format == "QDQ" else STATIC_QOPERATOR_OPS


def ort_version() -> str:
    return dist_version("onnxruntime")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


Progress = Callable[[int], Any]

__all__ = [
    "DynamicConfig",
    "Staged",
    "StaticConfig",
    "calibrate_staged",
    "check_loads",
    "mask_nodes",
    "ort_version",
    "prepare",
    "preprocess_decision",
    "quantize_dynamic_staged",
    "quantize_static_from_cache",
    "stage",
    "static_ops",
    "take_result",
    "with_float_masks",
]
