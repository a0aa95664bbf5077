"""One AIMET quantization: QuantSim, the techniques in order, encodings, the QDQ model back.

The model is handed to ``aimet_onnx.QuantizationSimModel`` as a ``ModelProto`` (tied weights
split first, see :mod:`bitpress_aimet.tied`); LPBQ, SeqMSE and AdaRound configure or optimise
the weight quantizers; ``compute_encodings`` calibrates the rest on the run's data;
``to_onnx_qdq(prequantize_constants=True)`` gives the QDQ model (int weights followed by
``DequantizeLinear``), which becomes the new handle through :class:`bitpress.toolkit.workspace.Workspace`.
Nothing from ``aimet_onnx`` is imported at module level.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bitpress.plugin import (
    SINGLE_FILE_LIMIT,
    OnnxModel,
    PassContext,
    QuantizationError,
    ToolReport,
    UsageError,
    Workspace,
    count_ops,
    dist_version,
    drop_unused_opsets,
    iter_tensors,
    record_report,
    tensor_nbytes,
)
from bitpress_aimet import tied
from bitpress_aimet.options import LINEAR_OPS, AdaRoundOptions, AimetOptions, LpbqOptions, SeqMseOptions, Technique
from bitpress_aimet.sandbox import contained, import_aimet, torch_threads

log = logging.getLogger(__name__)

#: option value -> the ``aimet_onnx.qtype`` alias (AIMET's activations are asymmetric: uint on export)
ACTIVATION_QTYPES = {"uint8": "int8", "uint16": "int16", "fp16": "float16"}
#: ops that mark a model quantized already (AIMET would quantize it again, or refuse)
QUANTIZED_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulNBits", "QLinearMatMul",
                 "MatMulInteger", "QLinearConv", "ConvInteger")
#: the file name AIMET's encodings get beside the output (``<output name>.encodings``)
ENCODINGS_SUFFIX = ".encodings"


@dataclass
class Plan:
    """What one run does, worked out (and checked against the model) before AIMET starts."""

    lpbq: LpbqOptions | None = None
    seqmse: SeqMseOptions | None = None
    adaround: AdaRoundOptions | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, techniques: list[Technique]) -> Plan:
        plan = cls()
        for t in techniques:
            setattr(plan, t.name, t.options)
        return plan


def _node_names(model: onnx.ModelProto) -> set[str]:
    return {n.name for n in model.graph.node if n.name}


def check_model(model: onnx.ModelProto, o: AimetOptions, plan: Plan) -> None:
    """Everything that needs the model checked before any work; UsageError naming what is wrong."""
    ops = {n.op_type for n in model.graph.node}
    found = sorted(ops & set(QUANTIZED_OPS))
    if found:
        raise UsageError(f"aimet: the model is quantized already ({', '.join(found)}); give it the float model")
    unknown = sorted(set(o.op_types_to_exclude) - ops)
    if unknown:
        raise UsageError(f"aimet: op_types_to_exclude: the model has no {', '.join(unknown)} nodes")
    names = _node_names(model)
    for where, wanted in (("nodes_to_exclude", o.nodes_to_exclude),
                          ("lpbq nodes_to_exclude", plan.lpbq.nodes_to_exclude if plan.lpbq else []),
                          ("adaround nodes_to_exclude", plan.adaround.nodes_to_exclude if plan.adaround else [])):
        missing = sorted(set(wanted) - names)
        if missing:
            import difflib

            hints = [f"{m} (did you mean {c[0]}?)" if (c := difflib.get_close_matches(m, sorted(names), 1)) else m
                     for m in missing[:5]]
            raise UsageError(f"aimet: {where}: the model has no node named {', '.join(hints)}")
    if plan.lpbq and not set(plan.lpbq.op_types) & ops:
        raise UsageError(f"aimet: lpbq op_types {', '.join(plan.lpbq.op_types)}: the model has none of them")
    if o.config_file is not None:
        from aimet_onnx.common.quantsim_config.quantsim_config import _config_file_aliases

        if o.config_file not in _config_file_aliases and not Path(o.config_file).is_file():
            raise UsageError(
                f"aimet: config_file {o.config_file!r} is neither an AIMET alias ({', '.join(_config_file_aliases)}) "
                "nor an existing file (give an absolute path: a plugin environment runs in another folder)"
            )


class OpNames:
    """AIMET's ops (ConnectedGraph) against the model's node names and op types.

    QuantSim fuses supergroups (``MatMul`` + ``Add`` becomes one ``Gemm`` op named after their
    common prefix, held as a function); users name the model's nodes and op types. Each AIMET op
    has members (its nodes in the model) and a primary member: the linear node when it has one.
    """

    def __init__(self, sim: Any) -> None:
        model = sim.model.model
        bodies = {(f.domain, f.name): [(n.name, n.op_type) for n in f.node] for f in model.functions}
        self.members: dict[str, list[tuple[str, str]]] = {}
        for node in model.graph.node:
            body = bodies.get((node.domain, node.op_type)) if node.domain.startswith("aimet.supergroup") else None
            self.members[node.name] = body or [(node.name, node.op_type)]
        self.ops = {op.name: op for op in sim.connected_graph.ordered_ops}
        self.of_node = {name: op for op, members in self.members.items() for name, _ in members}

    def primary(self, op: str) -> tuple[str, str]:
        members = self.members.get(op) or [(op, self.ops[op].type if op in self.ops else "?")]
        return next((m for m in members if m[1] in LINEAR_OPS), members[0])

    def type_of(self, op: str) -> str:
        return self.primary(op)[1]

    def ops_of(self, node_names: Any) -> set[str]:
        return {self.of_node.get(n, n) for n in node_names}

    def shown(self, ops: Any, limit: int = 6) -> str:
        names = sorted(self.primary(op)[0] for op in ops)
        return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _weight(sim: Any, op: Any) -> Any:
    return sim.get_op_quantizers(op)[2].get("weight")


def _exclude(sim: Any, excluded: Any) -> int:
    """Disable the quantizers of tensors that only excluded ops produce and consume (Olive's rule).

    A weight (no producer) is excluded with its op; an activation when its producer (if any)
    and every consumer are excluded. Returns how many quantizers were disabled.
    """
    count = 0
    for product in sim.connected_graph.get_all_products().values():
        if product.producer is not None and not excluded(product.producer):
            continue
        if not product.consumers or any(not excluded(c) for c in product.consumers):
            continue
        quantizer = sim.qc_quantize_op_dict.get(product.name)
        if quantizer is not None and quantizer.enabled and not quantizer.is_encoding_frozen():
            quantizer.enabled = False
            count += 1
    return count


def _lpbq_nodes(sim: Any) -> set[str]:
    """Ops whose weight quantizer ended up blockwise (LPBQ): ``set_lpbq_for_params`` skips some silently."""
    out = set()
    for op in sim.connected_graph.ordered_ops:
        weight = _weight(sim, op)
        if weight is not None and getattr(weight.quant_info, "blockSize", 0) > 0:
            out.add(op.name)
    return out


def _apply_lpbq(sim: Any, names: OpNames, lp: LpbqOptions, plan: Plan) -> set[str]:
    """LPBQ on the weights of the model's ``lp.op_types`` nodes; returns the AIMET ops that got it."""
    from aimet_onnx.quantsim import set_lpbq_for_params

    skip = names.ops_of(lp.nodes_to_exclude)
    weighted = [op for op in sim.connected_graph.ordered_ops if _weight(sim, op) is not None]
    wanted = {op.name for op in weighted if names.type_of(op.name) in lp.op_types and op.name not in skip}
    if not wanted:
        raise UsageError(f"aimet: lpbq: no weight of a {', '.join(lp.op_types)} node is left to quantize")
    # AIMET matches its own op types (a fused MatMul + Add is a Gemm): name the rest as excluded
    types = {op.type for op in weighted if op.name in wanted}
    others = {op.name for op in weighted if op.type in types and op.name not in wanted}
    set_lpbq_for_params(sim, lp.bitwidth, lp.block_size, op_types=types, nodes_to_exclude=others)
    done = _lpbq_nodes(sim) & wanted
    if not done:
        raise UsageError(
            f"aimet: lpbq with block_size={lp.block_size} applies to no weight: it must divide the input "
            f"channels of the {', '.join(lp.op_types)} weights"
        )
    if wanted - done:
        plan.notes.append(f"lpbq left {len(wanted - done)} weight(s) per-channel (block_size {lp.block_size} does "
                          f"not divide their input channels): {names.shown(wanted - done)}")
    return done


def _transposed_weights(model: onnx.ModelProto) -> set[str]:
    """Linear nodes whose weight reaches them through a Transpose: AIMET's AdaRound multiplies the
    untransposed tensor (measured: "mat1 and mat2 shapes cannot be multiplied" on a tied LM head)."""
    produced = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name for t in model.graph.initializer}
    out = set()
    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1:
            src = produced.get(node.input[1])
            if src is not None and src.op_type == "Transpose" and src.input[0] in inits:
                out.add(node.name)
    return out


def _adaround_targets(sim: Any, names: OpNames, model: onnx.ModelProto, plan: Plan, lpbq_ops: set[str]) -> list[str]:
    assert plan.adaround is not None
    candidates = [op.name for op in sim.connected_graph.ordered_ops
                  if op.type in LINEAR_OPS and _weight(sim, op) is not None]
    excluded = names.ops_of(plan.adaround.nodes_to_exclude)
    overlap = (set(candidates) - excluded) & lpbq_ops
    if overlap:
        raise UsageError(
            "aimet: adaround cannot optimise LPBQ (blockwise) weights: AIMET 2.42's apply_adaround fails on them "
            f"(AssertionError in broadcast_to_tensor). These nodes get both: {names.shown(overlap)}; add them to "
            "adaround's nodes_to_exclude or to lpbq's nodes_to_exclude / op_types"
        )
    skipped = (set(candidates) & names.ops_of(_transposed_weights(model))) - excluded
    if skipped:
        plan.notes.append(f"adaround skipped {names.shown(skipped)}: weights read through a Transpose (tied LM head)")
    targets = [n for n in candidates if n not in excluded and n not in skipped]
    if not targets:
        raise UsageError("aimet: adaround: every linear weight is excluded; nothing to optimise")
    return targets


@dataclass
class AimetRun:
    """What AIMET produced: the QDQ proto, the encodings JSON (when asked), timings, notes."""

    proto: onnx.ModelProto
    encodings: dict[str, Any] | None
    seconds: dict[str, float]
    lpbq_nodes: list[str]
    adaround_nodes: list[str]
    notes: list[str]


def run_aimet(proto: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], o: AimetOptions, plan: Plan,
              folder: Path, jobs: int) -> AimetRun:
    """QuantSim with the options, the techniques of ``plan``, encodings; inside :func:`contained`."""
    import_aimet(folder)
    seconds: dict[str, float] = {}
    with contained(folder), torch_threads(jobs):
        from aimet_onnx.quantsim import QuantizationSimModel

        t0 = time.perf_counter()
        try:
            sim = QuantizationSimModel(
                proto, param_type=o.precision, activation_type=ACTIVATION_QTYPES[o.activation_type],
                quant_scheme=o.quant_scheme, config_file=o.config_file, providers=["CPUExecutionProvider"],
                path=str(folder / "tmp" / "quantsim"), session_options_kwargs={"intra_op_num_threads": jobs},
            )
        except (RuntimeError, ValueError, AssertionError) as exc:
            raise QuantizationError(f"AIMET cannot build a QuantizationSimModel of this model: {_first(exc)}") from exc
        seconds["quantsim"] = time.perf_counter() - t0
        names = OpNames(sim)
        if o.op_types_to_exclude:
            types = set(o.op_types_to_exclude)
            _exclude(sim, lambda op: names.type_of(op.name) in types)
        if o.nodes_to_exclude:
            excluded_ops = names.ops_of(o.nodes_to_exclude)
            _exclude(sim, lambda op: op.name in excluded_ops)
        lpbq_ops = _apply_lpbq(sim, names, plan.lpbq, plan) if plan.lpbq is not None else set()
        adaround_ops = _adaround_targets(sim, names, proto, plan, lpbq_ops) if plan.adaround is not None else []
        try:
            if plan.seqmse is not None:
                from aimet_onnx import apply_seq_mse

                t0 = time.perf_counter()
                apply_seq_mse(sim, feeds, num_candidates=plan.seqmse.num_candidates)
                seconds["seqmse"] = time.perf_counter() - t0
            if plan.adaround is not None:
                from aimet_onnx import apply_adaround

                t0 = time.perf_counter()
                apply_adaround(sim, feeds, plan.adaround.num_iterations, nodes_to_include=adaround_ops)
                seconds["adaround"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            sim.compute_encodings(feeds)
            seconds["encodings"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            qdq = sim.to_onnx_qdq(prequantize_constants=True)
            encodings = None
            if o.export_encodings:
                out = folder / "tmp" / "export"
                out.mkdir(parents=True, exist_ok=True)
                sim.export(str(out), "model", export_model=False)
                encodings = json.loads((out / f"model{ENCODINGS_SUFFIX}").read_text())
            seconds["export"] = time.perf_counter() - t0
        except Exception as exc:
            raise QuantizationError(f"AIMET failed: {_first(exc)}") from exc
    return AimetRun(qdq, encodings, seconds, sorted(lpbq_ops), adaround_ops, plan.notes)


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def mode_of(o: AimetOptions, techniques: list[Technique]) -> str:
    names = "+".join(t.name for t in techniques) or "static"
    return f"{names} (weights {o.precision}, activations {o.activation_type}, {o.quant_scheme})"


def quantize(model: OnnxModel, context: PassContext, o: AimetOptions, techniques: list[Technique],
             feeds: list[dict[str, np.ndarray]], pass_name: str) -> OnnxModel:
    """The whole pass: workspace, tied weights, AIMET, the QDQ model loaded back as the new handle."""
    plan = Plan.of(techniques)
    ws = Workspace.open(model, context, prefix="aimet")
    try:
        proto = onnx.load(str(ws.input))  # tensors in memory: AIMET takes a ModelProto
        ws.drop_input()
        tied.name_nodes(proto.graph)
        import_aimet(ws.folder)  # before check_model reads AIMET's config aliases: the import contained
        check_model(proto, o, plan)
        groups = tied.untie(proto)
        t0 = time.perf_counter()
        run = run_aimet(proto, feeds, o, plan, ws.folder, max(1, context.jobs))
        seconds = time.perf_counter() - t0
        del proto
        notes = [*run.notes, *tied.retie(run.proto, groups)]
        drop_unused_opsets(run.proto)
        large = sum(tensor_nbytes(t) for t in iter_tensors(run.proto)) >= SINGLE_FILE_LIMIT
        onnx.save_model(run.proto, str(ws.output), save_as_external_data=large,
                        location=f"{ws.output.name}.data" if large else None)
        result = ws.load(ws.output, model)
        counts = count_ops(result.proto)
        found = {op: counts[op] for op in ("DequantizeLinear", "QuantizeLinear") if counts[op]}
        if "DequantizeLinear" not in found:
            raise QuantizationError("AIMET quantized nothing (no DequantizeLinear in its output): the options "
                                    "exclude every weight and activation")
        if run.encodings is not None:
            tied.retie_encodings(run.encodings, groups)
            path = ws.output.with_suffix(ENCODINGS_SUFFIX)
            path.write_text(json.dumps(run.encodings, indent=1))
            result.sidecars = {ENCODINGS_SUFFIX: path}  # type: ignore[attr-defined]
        for note in notes:
            log.info("aimet: %s", note)
        details = {"techniques": [t.describe() for t in techniques], "seconds_by_step": {
            k: round(v, 3) for k, v in run.seconds.items()}, "lpbq_nodes": len(run.lpbq_nodes),
            "adaround_nodes": len(run.adaround_nodes), "notes": notes}
        record_report(context, pass_name, model, ToolReport(
            "AIMET", dist_version("aimet-onnx"), mode_of(o, techniques), seconds, found, details))
    except BaseException:
        ws.discard()
        raise
    if run.encodings is not None and not ws.host_owned:
        # the encodings file is read when the host saves the handle: keep the folder as long as the handle
        weakref.finalize(result, shutil.rmtree, ws.folder, True)
    else:
        ws.finish(result)
    model.close()
    return result


__all__ = ["ACTIVATION_QTYPES", "ENCODINGS_SUFFIX", "AimetRun", "Plan", "check_model", "quantize", "run_aimet"]
