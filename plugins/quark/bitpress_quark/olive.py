"""Olive's ``QuarkQuantization`` on ONNX models: its configuration shapes read and checked here.

Olive passes ``global_config`` / ``specific_layer_config`` / ``layer_type_config`` / ``exclude`` /
``algo_config`` / ``extra_options`` to Quark's ``QConfig``. This module checks those shapes
without importing Quark (so a config is refused before any work, in the host too) and turns them
into Quark's objects inside the plugin's environment (:func:`layer_config`, :func:`algorithms`).

What is refused, and why (each one line, before any work):

- data types Quark writes as its own custom operators (BFP16, MX*, BFloat16, Float16, Int32,
  UInt32): ONNX Runtime loads those models only with Quark's custom-op library, and bitpress
  outputs load in plain ONNX Runtime;
- algorithms this pass does not run (``gptq``, ``adaround``, ``adaquant``, ``quarot``,
  ``auto_mixprecision``), each naming what to use instead;
- ``extra_options`` that write files, pick devices or rewrite graphs for AMD NPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from bitpress.plugin import OnnxModel, PassContext, UsageError, iter_graphs, option
from bitpress_quark.passes import _QuarkPass
from bitpress_quark.runner import calibration_feeds, reject_fallback, run_quark

#: Olive's / Quark's data type names that ONNX Runtime runs without Quark's custom operators:
#: int8 / uint8 as standard Q/DQ, int16 / uint16 as com.microsoft Q/DQ
DATA_TYPES = ("Int8", "UInt8", "Int16", "UInt16")
#: refused, with the reason
CUSTOM_OP_TYPES = ("Int32", "UInt32", "Float16", "BFloat16", "BFP16", "BFP", "MX", "MX4", "MX6", "MX9", "MXFP4E2M1",
                   "MXFP6E3M2", "MXFP6E2M3", "MXFP8E5M2", "MXFP8E4M3", "MXInt8")
CALIBRATION_METHODS = ("MinMax", "MinMSE", "Percentile", "Entropy", "LayerwisePercentile", "Distribution")
SCALE_TYPES = ("Float32", "PowerOf2", "Int16")
GRANULARITIES = ("Tensor", "Channel")
#: a layer config's tensors; Olive's ``activation`` is Quark's ``input_tensors`` (Quark 0.13 renamed it)
TENSORS = ("input_tensors", "weight", "bias", "output_tensors")
TENSOR_KEYS = ("data_type", "symmetric", "scale_type", "calibration_method", "quant_granularity")
#: Olive's algorithm names -> the options of each that are passed on
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "cle": ("cle_balance_method", "cle_steps", "cle_weight_threshold", "cle_scale_append_bias",
            "cle_scale_use_threshold", "cle_total_layer_diff_threshold"),
    "smooth_quant": ("alpha",),
    "bias_correction": (),
}
REFUSED_ALGORITHMS = {
    "gptq": "Quark's ONNX GPTQ solves int4 MatMulNBits weights: use bitpress's gptq pass (or quark_int4)",
    "adaround": "Quark's fast fine-tuning trains every layer with torch for hours on a CPU; not run by this pass",
    "adaquant": "Quark's fast fine-tuning trains every layer with torch for hours on a CPU; not run by this pass",
    "quarot": "use bitpress's quarot pass (an offline rotation that keeps a tied table one table) before this one",
    "auto_mixprecision": "Quark's automatic mixed precision is not wrapped: give specific_layer_config, or use "
                         "bitpress's bpw budget for weight-only formats",
}
#: extra_options passed on to Quark as they are (calibration and Q/DQ placement); others are refused
EXTRA_OPTIONS = ("Percentile", "CalibMovingAverage", "CalibMovingAverageConstant", "CalibTensorRangeSymmetric",
                 "LWPMetric", "PercentileCandidates", "LWPUseHistogram", "QuantizeBias", "Int32Bias", "Int16Bias",
                 "MatMulConstBOnly", "AddQDQPairToWeight", "DedicatedQDQPair", "OpTypesToExcludeOutputQuantization",
                 "NodesToExcludeOutputQuantization", "OptimizeModel", "CopySharedInit", "UseUnsignedReLU",
                 "ForceQuantizeNoInputCheck", "OpTypesToQuantize", "NodesToQuantize", "ExtraOpTypesToQuantize",
                 "QuantizeFP16", "UseFP32Scale", "ActivationScaled", "WeightScaled")
#: Quark's QConfig default: Int8 activations and weights (Quark's Int8 spec: symmetric, Percentile)
DEFAULT_GLOBAL = {"activation": {"data_type": "Int8"}, "weight": {"data_type": "Int8"}}
_ENUM_PREFIX = {"calibration_method": "CalibMethod.", "scale_type": "ScaleType.",
                "quant_granularity": "QuantGranularity."}
_CHOICES = {"data_type": DATA_TYPES, "calibration_method": CALIBRATION_METHODS, "scale_type": SCALE_TYPES,
            "quant_granularity": GRANULARITIES}


def _name(value: Any) -> str:
    return repr(value) if not isinstance(value, str) or len(value) > 60 else value


def tensor_config(value: Any, where: str) -> dict[str, Any]:
    """One tensor's settings, names normalized (``CalibMethod.MinMax`` and ``MinMax`` alike)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping of {', '.join(TENSOR_KEYS)}, got {_name(value)}")
    unknown = sorted(set(value) - set(TENSOR_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(_name, unknown))}; valid: {', '.join(TENSOR_KEYS)}")
    if "data_type" not in value:
        raise ValueError(f"{where}: data_type is required ({', '.join(DATA_TYPES)})")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key == "symmetric":
            if not isinstance(item, bool):
                raise ValueError(f"{where}.symmetric: expected true or false, got {_name(item)}")
            out[key] = item
            continue
        if not isinstance(item, str):
            raise ValueError(f"{where}.{key}: expected a name, got {_name(item)}")
        name = item.removeprefix(_ENUM_PREFIX.get(key, ""))
        if key == "data_type" and name in CUSTOM_OP_TYPES:
            raise ValueError(
                f"{where}.data_type {name}: Quark writes it as its own custom operators, which ONNX Runtime loads only "
                f"with Quark's custom-op library; bitpress outputs load in plain ONNX Runtime ({', '.join(DATA_TYPES)})"
            )
        if key == "quant_granularity" and name == "Group":
            raise ValueError(f"{where}.quant_granularity Group is for Quark's MX / BFP types: use Tensor or Channel "
                             "(int4 blocks: quark_int4 or bitpress's rtn / gptq)")
        if name not in _CHOICES[key]:
            raise ValueError(f"{where}.{key} {_name(item)}: choose one of {', '.join(_CHOICES[key])}")
        out[key] = name
    return out


def layer_config(value: Any, where: str, *, whole: bool = False) -> dict[str, dict[str, Any]]:
    """A layer's settings: ``{input_tensors, weight, bias, output_tensors}`` (Olive's ``activation`` renamed).

    ``whole``: the global config, which needs the activations' and the weights' settings."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping of activation, weight, bias, output_tensors, got {_name(value)}")
    keys = set(value)
    if {"activation", "input_tensors"} <= keys:
        raise ValueError(f"{where}: give activation (Olive's name) or input_tensors (Quark's), not both")
    unknown = sorted(keys - set(TENSORS) - {"activation"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(_name, unknown))}; valid: activation, "
                         f"{', '.join(TENSORS)}")
    out = {("input_tensors" if k == "activation" else k): tensor_config(v, f"{where}.{k}") for k, v in value.items()}
    if whole and not {"input_tensors", "weight"} <= set(out):
        raise ValueError(f"{where}: give both activation and weight (their data_type at least)")
    return out


def layer_list(value: Any, where: str, *, allow_none: bool) -> list[tuple[dict[str, Any] | None, list[str]]]:
    """Olive's ``[[layer config, [names]], ...]`` (``null`` for the config: leave those in float)."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of [config, [names]] pairs, got {_name(value)}")
    out = []
    for i, pair in enumerate(value):
        at = f"{where}[{i}]"
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], list)
                and all(isinstance(n, str) and n for n in pair[1])):
            raise ValueError(f"{at}: expected [config, [names]], got {_name(pair)}")
        if pair[0] is None and not allow_none:
            raise ValueError(f"{at}: a null config (left in float) belongs in exclude")
        out.append((None if pair[0] is None else layer_config(pair[0], f"{at}[0]"), list(pair[1])))
    return out


def exclusions(value: Any, where: str = "exclude") -> tuple[list[str], list[tuple[list[str], list[str]]]]:
    """``exclude``: node names, and subgraphs as ``[[start nodes], [end nodes]]``."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of node names or [[start nodes], [end nodes]], got {_name(value)}")
    names, subgraphs = [], []
    for i, item in enumerate(value):
        if isinstance(item, str) and item:
            names.append(item)
        elif (isinstance(item, list) and len(item) == 2
              and all(isinstance(p, list) and p and all(isinstance(n, str) and n for n in p) for p in item)):
            subgraphs.append((list(item[0]), list(item[1])))
        else:
            raise ValueError(f"{where}[{i}]: expected a node name or [[start nodes], [end nodes]], got {_name(item)}")
    return names, subgraphs


def algorithm_list(value: Any, where: str = "algo_config") -> list[dict[str, Any]]:
    """``algo_config``: ``[{name: cle | smooth_quant | bias_correction, ...its options}]``."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of {{name: ..., options}}, got {_name(value)}")
    out = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"{at}: expected a mapping with a name, got {_name(item)}")
        name = item["name"]
        if name in REFUSED_ALGORITHMS:
            raise ValueError(f"{at}: {name}: {REFUSED_ALGORITHMS[name]}")
        if name not in ALGORITHMS:
            raise ValueError(f"{at}: unknown algorithm {_name(name)}; this pass runs {', '.join(ALGORITHMS)}")
        unknown = sorted(set(item) - {"name", *ALGORITHMS[name]})
        if unknown:
            valid = ", ".join(ALGORITHMS[name]) or "none"
            raise ValueError(f"{at}: {name} has no option(s) {', '.join(map(_name, unknown))} (its options: {valid})")
        out.append(dict(item))
    return out


def extra_options(value: Any, where: str = "extra_options") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping, got {_name(value)}")
    refused = sorted(k for k in value if k not in EXTRA_OPTIONS)
    if refused:
        raise ValueError(
            f"{where}: {', '.join(map(_name, refused))} not passed to Quark (options that write files, pick devices "
            f"or rewrite graphs for AMD NPUs are not); passed on: {', '.join(EXTRA_OPTIONS)}"
        )
    return dict(value)


# -- inside the plugin's environment: Quark's objects ----------------------------------------------------
def quark_tensor(settings: dict[str, Any]) -> Any:
    """Quark's spec of the data type with the settings given (the rest: Quark's defaults for that type)."""
    from quark.onnx.quantization.config import spec

    cls = getattr(spec, f"{settings['data_type']}Spec")
    kwargs: dict[str, Any] = {}
    for key, item in settings.items():
        if key == "data_type":
            continue
        enum = {"calibration_method": spec.CalibMethod, "scale_type": spec.ScaleType,
                "quant_granularity": spec.QuantGranularity}.get(key)
        kwargs[key] = getattr(enum, item) if enum is not None else item
    return cls(**kwargs)


def quark_layer(settings: dict[str, dict[str, Any]]) -> Any:
    from quark.onnx.quantization.config.spec import QLayerConfig

    return QLayerConfig(**{k: quark_tensor(v) for k, v in settings.items()})


def quark_algorithms(items: list[dict[str, Any]]) -> list[Any]:
    from quark.onnx.quantization.config import algorithm

    classes = {"cle": algorithm.CLEConfig, "smooth_quant": algorithm.SmoothQuantConfig,
               "bias_correction": algorithm.BiasCorrectionConfig}
    out = []
    for item in items:
        config = classes[item["name"]]()
        for key, value in item.items():
            if key != "name":
                setattr(config, key, value)
        out.append(config)
    return out


# -- the pass ------------------------------------------------------------------------------------------
@dataclass
class QuarkQuantizationOptions:
    quant_mode: Literal["static", "dynamic"] = option(
        "static", "static: activation ranges calibrated on --data; dynamic: int8 weights, activations quantized at "
        "run time (no data)"
    )
    quant_format: Literal["QDQ", "QOperator"] = option(
        "QDQ", "QDQ: QuantizeLinear / DequantizeLinear around float ops; QOperator: QLinearMatMul, QGemm, ... "
        "(static, 8-bit, no per-layer configs)"
    )
    global_config: dict[str, Any] | None = option(
        None, "every layer's settings: {activation: {data_type, symmetric, calibration_method, "
        "scale_type, quant_granularity}, weight: {...}, bias: {...}, output_tensors: {...}}; data types Int8, UInt8, "
        "Int16, UInt16; unset keys take Quark's defaults for the data type. Unset: Int8 activations and weights "
        "(Quark's QConfig default; dynamic: UInt8 activations at run time)"
    )
    specific_layer_config: list[Any] = option(
        [], "[[layer config, [node names]], ...]: other settings for those nodes (Int16 activations for a "
        "sensitive layer, say)"
    )
    layer_type_config: list[Any] = option(
        [], "[[layer config or null, [op types]], ...]: other settings for those op types; null leaves them in float"
    )
    exclude: list[Any] = option([], "nodes left in float: names, or subgraphs as [[start nodes], [end nodes]]")
    algo_config: list[Any] = option(
        [], "[{name: cle | smooth_quant | bias_correction, ...its options}]: Quark's algorithms run before "
        "quantizing (cle: cross-layer equalization; smooth_quant: alpha; bias_correction)"
    )
    extra_options: dict[str, Any] = option(
        {}, f"Quark options passed on as they are: {', '.join(EXTRA_OPTIONS)}"
    )
    reduce_range: Literal["auto"] | bool = option(
        "auto", "8-bit weights only: 7-bit weights, which avoid the int16 saturation of ONNX Runtime's int8 kernels "
        "on x86 CPUs without VNNI; auto: for this CPU"
    )

    def parsed(self) -> dict[str, Any]:
        """The configuration checked and normalized (ValueError naming the setting that is wrong)."""
        names, subgraphs = exclusions(self.exclude)
        out = {
            "global": layer_config(DEFAULT_GLOBAL if self.global_config is None else self.global_config,
                                   "global_config", whole=True),
            "specific": layer_list(self.specific_layer_config, "specific_layer_config", allow_none=False),
            "layer_type": layer_list(self.layer_type_config, "layer_type_config", allow_none=True),
            "exclude": names, "subgraphs": subgraphs,
            "algorithms": algorithm_list(self.algo_config),
            "extra": extra_options(self.extra_options),
        }
        per_layer = out["specific"] or [c for c, _ in out["layer_type"] if c is not None]
        eight_bit = {"Int8", "UInt8"}
        if self.quant_mode == "dynamic":
            weight = out["global"]["weight"]["data_type"]
            if weight not in eight_bit:
                raise ValueError(f"quant_mode dynamic: weights are Int8 or UInt8, got {weight}")
            activation = out["global"]["input_tensors"]["data_type"]
            if activation != "UInt8" and self.global_config is not None:
                raise ValueError(f"quant_mode dynamic: ONNX Runtime quantizes activations to UInt8 at run time, "
                                 f"got {activation}")
            if per_layer or out["algorithms"] or subgraphs:
                raise ValueError("quant_mode dynamic takes global_config, exclude (node names) and layer_type_config "
                                 "nulls only: per-layer configs, subgraphs and algo_config are static quantization's")
        elif self.quant_format == "QOperator":
            types = {t["data_type"] for t in out["global"].values()}
            if not types <= eight_bit:
                raise ValueError("quant_format QOperator: 8-bit types only (QLinear ops), got "
                                 f"{', '.join(sorted(types))}")
            if per_layer:
                raise ValueError("quant_format QOperator: per-layer configs need QDQ (Quark maps them onto Q/DQ pairs)")
        return out

    def validate(self) -> None:
        self.parsed()


class QuarkQuantizationPass(_QuarkPass):
    """Olive's QuarkQuantization on ONNX models: its global / per-layer / per-op-type configs onto Quark."""

    name = "quark"
    aliases = ("QuarkQuantization",)
    algorithms = ("quark",)
    precisions = ("int8", "int16")
    needs_data = True  # static; a dynamic instance says False (see __init__)
    summary = "AMD Quark with Olive's QuarkQuantization config (global_config, specific_layer_config, ...)"
    Options: ClassVar[type] = QuarkQuantizationOptions

    def __init__(self, options: Any | None = None) -> None:
        super().__init__(options)
        self.needs_data = self.options.quant_mode == "static"

    def run(self, model: Any, context: PassContext) -> Any:
        model = self._onnx(model)
        o: QuarkQuantizationOptions = self.options
        cfg = o.parsed()
        _check_names(model, cfg)
        dynamic = o.quant_mode == "dynamic"
        weight8 = cfg["global"]["weight"]["data_type"] in ("Int8", "UInt8")
        reduce_range = self._reduce_range(o.reduce_range) if weight8 else None
        excluded_types = sorted({t for c, types in cfg["layer_type"] if c is None for t in types})

        def make_config(quark_onnx: Any, tmp: Path, external: bool, src: Path) -> Any:
            from onnxruntime.quantization.quant_utils import QuantFormat
            from quark.onnx.quantization.config.config import Config, QConfig
            from quark.onnx.quantization.config.legacy import QuantizationConfig
            from quark.onnx.quantization.config.maps import _check_q_config, _map_q_config
            from quark.onnx.quantization.quant_utils import recursive_update

            rr = bool(reduce_range and reduce_range.value)
            if dynamic:
                from quark.onnx.quantizers.registry import IntegerOpsRegistry

                return Config(global_quant_config=QuantizationConfig(
                    use_dynamic_quant=True, weight_type=quark_tensor(cfg["global"]["weight"]).data_type.map_onnx_format,
                    per_channel=cfg["global"]["weight"].get("quant_granularity") == "Channel", reduce_range=rr,
                    op_types_to_quantize=sorted(set(IntegerOpsRegistry) - set(excluded_types)),
                    nodes_to_exclude=list(cfg["exclude"]), use_external_data_format=external, ignore_warnings=False,
                    extra_options={**cfg["extra"], "TmpDir": str(tmp)},
                ))
            # Quark's own mapping of its QConfig onto the quantizer's settings (per-layer configs become tensor
            # overrides), then the legacy config, which also takes reduce_range and QOperator
            algorithms = quark_algorithms(cfg["algorithms"])
            q = QConfig(
                global_config=quark_layer(cfg["global"]),
                specific_layer_config={quark_layer(c): names for c, names in cfg["specific"]},
                layer_type_config={None if c is None else quark_layer(c): types for c, types in cfg["layer_type"]},
                exclude=[*cfg["exclude"], *cfg["subgraphs"]], use_external_data_format=external,
                extra_options=dict(cfg["extra"]),
            )
            _check_q_config(q)
            m = _map_q_config(q, str(src))
            extra = m["extra_options"]
            for algorithm in algorithms:
                recursive_update(extra, algorithm._get_config(extra))
            extra["TmpDir"] = str(tmp)
            names = {type(a).__name__ for a in algorithms}
            return Config(global_quant_config=QuantizationConfig(
                calibrate_method=m["calibrate_method"],
                quant_format=QuantFormat.QOperator if o.quant_format == "QOperator" else m["quant_format"],
                activation_type=m["activation_type"].map_onnx_format, weight_type=m["weight_type"].map_onnx_format,
                input_nodes=extra["InputNodes"], output_nodes=extra["OutputNodes"],
                op_types_to_quantize=extra["OpTypesToQuantize"], nodes_to_quantize=extra["NodesToQuantize"],
                extra_op_types_to_quantize=extra["ExtraOpTypesToQuantize"], nodes_to_exclude=m["nodes_to_exclude"],
                subgraphs_to_exclude=m["subgraphs_to_exclude"],
                specific_tensor_precision=extra["SpecificTensorPrecision"],
                execution_providers=["CPUExecutionProvider"], per_channel=m["per_channel"], reduce_range=rr,
                optimize_model=extra["OptimizeModel"], use_external_data_format=external,
                include_cle="CLEConfig" in names, include_sq="SmoothQuantConfig" in names, include_rotation=False,
                include_auto_mp=False, include_fast_ft=False, print_summary=False, ignore_warnings=False,
                extra_options=extra,
            ))

        activation = cfg["global"]["input_tensors"]
        method = activation.get("calibration_method", "Percentile")
        if dynamic:
            mode, feeds = "dynamic (QuarkQuantization)", None
            ops: tuple[str, ...] = ("DynamicQuantizeLinear", "MatMulInteger", "ConvInteger")
        else:
            mode = (f"static {activation['data_type']} / {cfg['global']['weight']['data_type']} ({o.quant_format}, "
                    f"{method}" + (", " + ", ".join(a["name"] for a in cfg["algorithms"]) if cfg["algorithms"] else "")
                    + ")")
            feeds = calibration_feeds(model, context.data)
            ops = ("QLinearMatMul", "QGemm", "QLinearConv", "MatMulInteger", "QuantizeLinear") \
                if o.quant_format == "QOperator" else ("DequantizeLinear",)
        result = run_quark(model, context, pass_name=self.name, mode=mode, make_config=make_config, feeds=feeds,
                           quantized_ops=ops, check_messages=None if dynamic else reject_fallback(method.lower()))
        if reduce_range is not None:
            self._report(context, model, reduce_range)
        return result


def _check_names(model: OnnxModel, cfg: dict[str, Any]) -> None:
    """Every node name and op type a config names is in the model (a typo quantizes what it meant to spare)."""
    nodes = {n.name for g in iter_graphs(model.proto.graph) for n in g.node}
    types = {n.op_type for g in iter_graphs(model.proto.graph) for n in g.node}
    named = [("specific_layer_config", n) for _, names in cfg["specific"] for n in names]
    named += [("exclude", n) for n in cfg["exclude"]]
    named += [("exclude", n) for start, end in cfg["subgraphs"] for n in (*start, *end)]
    missing = [(where, n) for where, n in named if n not in nodes]
    if missing:
        where, name = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UsageError(f"{where}: no node named {name!r} in {model.source.name}{more}")
    unknown = sorted({t for _, ts in cfg["layer_type"] for t in ts} - types)
    if unknown:
        raise UsageError(f"layer_type_config: {model.source.name} has no {', '.join(unknown)} nodes")
