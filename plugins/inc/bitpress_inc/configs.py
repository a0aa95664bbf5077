"""The pass options as INC 1.0 configuration objects, and the spaces its tuning loop searches.

Call these only after :func:`bitpress_inc.sandbox.import_inc` (inside the containment): they
import ``onnx_neural_compressor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx

from bitpress.plugin import UsageError, iter_graphs, resolve_accuracy_level
from bitpress_inc.options import REFUSED, Int8Options, SmoothQuantOptions, StaticOptions, WeightOnlyConfig

CPU = "CPUExecutionProvider"
#: Conv with a bias breaks INC 1.0's dynamic quantizer (see options.REFUSED["dynamic_conv"])
DYNAMIC_REFUSED = frozenset({"Conv", "FusedConv"})


def _inc() -> tuple[Any, Any, Any]:
    from onnx_neural_compressor import constants
    from onnx_neural_compressor.quantization import config, quant_utils

    return constants, config, quant_utils


def model_op_types(proto: onnx.ModelProto) -> set[str]:
    return {n.op_type for g in iter_graphs(proto.graph) for n in g.node}


def op_types(mode: str, options: Int8Options, present: set[str], strict: bool = True) -> list[str]:
    """INC's op types for ``mode`` (``qoperator``, ``qdq``, ``dynamic``) after the include/exclude options.

    ``strict``: an ``op_types_to_quantize`` entry INC does not quantize in ``mode`` is an error;
    otherwise it is left out (``approach: auto`` applies one list to static and dynamic).
    """
    constants, _, _ = _inc()
    supported = {
        "qoperator": constants.STATIC_QOPERATOR_CPU_OP_LIST,
        "qdq": constants.STATIC_QDQ_CPU_OP_LIST,
        "dynamic": [t for t in constants.DYNAMIC_CPU_OP_LIST if t not in DYNAMIC_REFUSED],
    }[mode]
    if options.op_types_to_quantize:
        unknown = sorted(set(options.op_types_to_quantize) - set(supported))
        if unknown and strict:
            raise UsageError(f"op_types_to_quantize: INC does not quantize {', '.join(unknown)} in {mode} mode "
                             f"(it does: {', '.join(sorted(supported))})")
        chosen = [t for t in options.op_types_to_quantize if t in set(supported)]
    else:
        chosen = list(supported)
    missing = sorted(set(options.op_types_to_exclude) - present)
    if missing:
        raise UsageError(f"op_types_to_exclude: the model has no {', '.join(missing)} nodes")
    chosen = [t for t in chosen if t not in set(options.op_types_to_exclude)]
    if not any(t in present for t in chosen):
        why = f" ({REFUSED['dynamic_conv']})" if mode == "dynamic" and present & DYNAMIC_REFUSED else ""
        raise UsageError(f"nothing to quantize in {mode} mode: the model has no {', '.join(sorted(chosen)) or 'op'} "
                         f"node left by the options{why}")
    return chosen


def check_nodes(proto: onnx.ModelProto, names: list[str], option: str) -> None:
    known = {n.name for g in iter_graphs(proto.graph) for n in g.node}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(f"{option}: the model has no node named {', '.join(unknown[:5])}")


def _qtype(name: str) -> Any:
    _, _, quant_utils = _inc()
    return quant_utils.QuantType.QInt8 if name == "int8" else quant_utils.QuantType.QUInt8


@dataclass
class StaticSettings:
    """The fixed part of a static config (what tuning does not vary) and the SmoothQuant settings."""

    quant_format: Any
    op_types: list[str]
    kwargs: dict[str, Any]
    smooth: SmoothQuantOptions | None


def static_settings(options: StaticOptions, proto: onnx.ModelProto, quant_format: str | None = None,
                    samples: int = 1, strict: bool = True) -> StaticSettings:
    _, _, quant_utils = _inc()
    fmt = quant_format or options.quant_format
    check_nodes(proto, options.nodes_to_quantize, "nodes_to_quantize")
    check_nodes(proto, options.nodes_to_exclude, "nodes_to_exclude")
    chosen = op_types("qdq" if fmt == "QDQ" else "qoperator", options, model_op_types(proto), strict)
    method = {"MinMax": quant_utils.CalibrationMethod.MinMax,
              "Percentile": quant_utils.CalibrationMethod.Percentile}[options.calibrate_method]
    sq = options.smooth_quant()
    kwargs = {
        "calibrate_method": method,
        "activation_type": _qtype(options.activation_type),
        "weight_type": _qtype(options.weight_type),
        "nodes_to_quantize": list(options.nodes_to_quantize) or None,
        "nodes_to_exclude": list(options.nodes_to_exclude) or None,
        "reduce_range": False,
        "calibration_sampling_size": samples,
        "execution_provider": CPU,
    }
    qf = quant_utils.QuantFormat.QDQ if fmt == "QDQ" else quant_utils.QuantFormat.QOperator
    return StaticSettings(qf, chosen, kwargs, sq if sq.SmoothQuant else None)


def static_config(s: StaticSettings, *, per_channel: Any, quant_last_matmul: Any,
                  op_types_to_quantize: list[str] | None = None, alpha: Any = None) -> Any:
    """A StaticQuantConfig, or SmoothQuantConfig when SmoothQuant is on (its alpha reaches INC only so)."""
    _, config, _ = _inc()
    common = {**s.kwargs, "quant_format": s.quant_format, "per_channel": per_channel,
              "quant_last_matmul": quant_last_matmul, "op_types_to_quantize": op_types_to_quantize or s.op_types,
              "nodes_to_exclude": list(s.kwargs["nodes_to_exclude"] or [])}
    if s.smooth is None:
        return config.StaticQuantConfig(**common)
    sq = s.smooth
    return config.SmoothQuantConfig(
        alpha=sq.SmoothQuantAlpha if alpha is None else alpha, folding=sq.SmoothQuantFolding,
        op_types=list(sq.SmoothQuantOpTypes), calib_iter=sq.SmoothQuantCalibIter,
        scales_per_op=sq.SmoothQuantScalesPerOp, **common,
    )


def dynamic_config(options: Int8Options, proto: onnx.ModelProto, *, per_channel: Any = None,
                   quant_last_matmul: Any = None, op_types_to_quantize: list[str] | None = None,
                   strict: bool = True) -> Any:
    _, config, _ = _inc()
    check_nodes(proto, options.nodes_to_quantize, "nodes_to_quantize")
    check_nodes(proto, options.nodes_to_exclude, "nodes_to_exclude")
    return config.DynamicQuantConfig(
        weight_type=_qtype(options.weight_type),
        op_types_to_quantize=op_types_to_quantize or op_types("dynamic", options, model_op_types(proto), strict),
        nodes_to_quantize=list(options.nodes_to_quantize) or None,
        nodes_to_exclude=list(options.nodes_to_exclude) or None,
        per_channel=options.per_channel if per_channel is None else per_channel,
        reduce_range=False,
        quant_last_matmul=options.quant_last_matmul if quant_last_matmul is None else quant_last_matmul,
        execution_provider=CPU,
    )


def woq_config(w: WeightOnlyConfig, nodes_to_exclude: list[str], *, algorithm: str | None = None,
               group_size: int | None = None, sym: bool | None = None) -> Any:
    """An RTNConfig / AWQConfig for MatMul weights (``nodes_to_exclude`` stay float), as INC's own quantizer."""
    _, config, _ = _inc()
    algorithm = algorithm or w.algorithm
    cls = {"RTN": config.RTNConfig, "AWQ": config.AWQConfig}[algorithm]
    kwargs: dict[str, Any] = {
        "weight_bits": w.bits, "weight_group_size": group_size or w.group_size,
        "weight_sym": (w.scheme == "sym") if sym is None else sym,
        "accuracy_level": resolve_accuracy_level(w.accuracy_level, "cpu"),
        "providers": [CPU],
    }
    if algorithm == "AWQ":
        kwargs.update(enable_auto_scale=w.enable_auto_scale, enable_mse_search=w.enable_mse_search)
    cfg = cls(**kwargs)
    if nodes_to_exclude:
        cfg += cls(weight_dtype="fp32", white_list=list(nodes_to_exclude))
    return cfg


# -- tuning spaces --------------------------------------------------------------------------------
def static_space(s: StaticSettings, options: StaticOptions) -> list[Any]:
    """The user's config first, then INC's own static space around it.

    INC's space (``StaticQuantConfig.get_config_set_for_tuning``): four op-type sets (all; without
    Add and Mul; also without the Gathers; also without Attention) x ``per_channel`` (true, false) x
    ``quant_last_matmul`` (true, false). With SmoothQuant on, the same trials with SmoothQuant and
    the user's alpha, then INC's alpha grid (0.3 .. 0.65).
    """
    first = static_config(s, per_channel=options.per_channel, quant_last_matmul=options.quant_last_matmul)
    base = set(s.op_types)
    sets = [base, base - {"Add", "Mul"}, base - {"Add", "Mul", "Gather", "GatherElements", "GatherND"},
            base - {"Add", "Mul", "Gather", "GatherElements", "GatherND", "Attention"}]
    ordered = [[t for t in s.op_types if t in chosen] for chosen in sets]
    space = [first] + [static_config(s, per_channel=[True, False], quant_last_matmul=[True, False],
                                     op_types_to_quantize=ops) for ops in ordered if ops]
    if s.smooth is not None:
        space.append(static_config(s, per_channel=options.per_channel, quant_last_matmul=options.quant_last_matmul,
                                   alpha=[round(0.3 + 0.05 * i, 2) for i in range(8)]))
    return space


def dynamic_space(options: Int8Options, proto: onnx.ModelProto, strict: bool = True) -> list[Any]:
    """The user's config first, then INC's dynamic space (``DynamicQuantConfig.get_config_set_for_tuning``):
    op-type sets (all; without Gather and EmbedLayerNormalization; also without Attention; without MatMul)
    x ``per_channel`` x ``quant_last_matmul``."""
    first = dynamic_config(options, proto, strict=strict)
    base = op_types("dynamic", options, model_op_types(proto), strict)
    drop = [set(), {"EmbedLayerNormalization", "Gather", "LSTM"},
            {"EmbedLayerNormalization", "Gather", "LSTM", "Attention"},
            {"EmbedLayerNormalization", "Gather", "LSTM", "MatMul"}]
    present = model_op_types(proto)
    space = [first]
    for d in drop:
        ops = [t for t in base if t not in d]
        if any(t in present for t in ops):
            space.append(dynamic_config(options, proto, per_channel=[True, False], quant_last_matmul=[True, False],
                                        op_types_to_quantize=ops))
    return space


def woq_space(w: WeightOnlyConfig, nodes_to_exclude: list[str], has_data: bool) -> list[Any]:
    """The user's config first, then INC's weight-only space without its GPTQ entries (see REFUSED):
    RTN and AWQ, asymmetric, groups of 32, then groups of 128."""
    space = [woq_config(w, nodes_to_exclude)]
    algorithms = ("RTN", "AWQ") if has_data else ("RTN",)
    for group in (32, 128):
        for algorithm in algorithms:
            space.append(woq_config(w, nodes_to_exclude, algorithm=algorithm, group_size=group, sym=False))
    return space


# -- describing a config (trial reports) ------------------------------------------------------------
def op_set_key(cfg: Any) -> str:
    """``static/QOperator``, ``static/QDQ`` or ``dynamic``: configs whose op-type lists compare."""
    constants, _, _ = _inc()
    if cfg.name == constants.DYNAMIC_QUANT:
        return "dynamic"
    return "static/" + ("QDQ" if getattr(cfg.quant_format, "name", "") == "QDQ" else "QOperator")


def describe(cfg: Any, base_ops: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """The settings of one (expanded) INC config, JSON-ready, for the trial table.

    ``base_ops``: the full op-type list of each kind (:func:`op_set_key`); a trial's op types are
    then told as ``all`` or ``without X, Y``.
    """
    constants, _, _ = _inc()
    name = getattr(cfg, "name", type(cfg).__name__)
    if name in (constants.STATIC_QUANT, constants.SMOOTH_QUANT, constants.DYNAMIC_QUANT):
        out: dict[str, Any] = {"approach": "dynamic" if name == constants.DYNAMIC_QUANT else "static"}
        if name != constants.DYNAMIC_QUANT:
            out["quant_format"] = "QDQ" if getattr(cfg.quant_format, "name", "") == "QDQ" else "QOperator"
        if name == constants.SMOOTH_QUANT:
            out["smooth_quant_alpha"] = round(float(cfg.alpha), 4)
        out["per_channel"] = bool(cfg.per_channel)
        out["quant_last_matmul"] = bool(cfg.quant_last_matmul)
        ops = list(cfg.op_types_to_quantize)
        base = (base_ops or {}).get(op_set_key(cfg))
        if base is not None:
            dropped = sorted(set(base) - set(ops))
            out["op_types"] = "all" if not dropped else "without " + ", ".join(dropped)
        else:
            out["op_types"] = ", ".join(sorted(ops))
        return out
    if name in (constants.RTN, constants.AWQ):
        configs = getattr(cfg, "config_list", [cfg])
        main = configs[0]
        return {"approach": "weight_only", "algorithm": name.upper(), "group_size": int(main.weight_group_size),
                "scheme": "sym" if main.weight_sym else "asym"}
    return {"config": name}


def summary_text(desc: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in desc.items())
