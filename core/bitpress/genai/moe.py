"""bitpress's quantized mixture-of-experts weights in a GenAI package's ``com.microsoft.QMoE`` nodes.

The ONNX Runtime GenAI model builder (0.18) quantizes experts itself (symmetric RTN) and cannot
import pre-quantized integer experts, so a ``moe: true`` checkpoint is built in two steps:

1. :func:`stage_moe` writes the model as a float checkpoint in which every expert weight is
   bitpress's dequantization, and :func:`builder_options` asks the builder for a float graph whose
   experts are ``QMoE`` (``moe_quant_type=int4|int8``, ``qmoe_block_size`` = bitpress's group size);
2. :func:`write_experts` then overwrites each ``QMoE`` node's packed weights and scales with
   bitpress's own (and adds zero points for asymmetric experts), after checking every expert
   tensor against the builder's: bitpress's dequantized weights must match the builder's
   dequantized ones within the builder's half quantization step, so a wrong mapping (gate / up
   order, a transposition, another layer's experts) stops the export with the tensor's name.

``QMoE`` layout (ONNX Runtime 1.32, CPU): packed weights ``[E, N, K * bits / 8]``, one row per
output channel, low nibble first (``MatMulNBits``' ``B`` with one row's blocks concatenated);
scales ``[E, N, K / block_size]`` in the activation dtype; optional uint8 zero points
``[E, N, ceil(K / block_size * bits / 8)]`` packed the same way (``2**(bits-1)`` when absent);
``swiglu_fusion=1``: fc1's rows interleaved ``gate0, up0, gate1, up1, ...``. Transformers keeps
``gate_up_proj`` ``[E, 2I, H]`` as ``[gate | up]``; per-expert lists (``gate_proj`` / ``up_proj`` /
``down_proj`` or ``w1`` / ``w3`` / ``w2`` per expert) are stacked the same way. gpt-oss stores its
experts transposed (``gate_up_proj`` ``[E, H, 2I]``, gate / up interleaved on the last axis;
``down_proj`` ``[E, I, H]``); bitpress quantizes each expert's transpose, so its integers are
already QMoE's fc1 ``[E, 2I, H]`` (interleaved) and fc2 ``[E, H, I]``; the staged float checkpoint
holds their dequantization in the stored layout again.

Supported: architectures the builder turns into ``QMoE`` on CPU and whose layout is checked here,
and architectures whose experts mobius 0.1.0 builds as a loop over experts that
:mod:`bitpress.genai.moe_loop` fuses into ``QMoE`` (:data:`SUPPORTED` says which exporter; the
other one is refused with :data:`WRONG_EXPORTER`'s reason and the exporter to pass). The builder's
import of pre-quantized dense layers reads Llama-shaped checkpoints only and bitpress hands mobius
a float checkpoint, so every non-expert layer must be float (quantize with
``modules_to_not_convert`` covering them). Everything else is refused before the build with the
reason (:data:`UNSUPPORTED`).

May import: errors, hf, onnx.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bitpress.errors import ExportError, summarize_names

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

#: architectures whose experts bitpress writes as QMoE, with the exporter that builds them (measured with
#: builder 0.18 and mobius 0.1.0, float32 cpu): the builder writes LFM2-MoE's QMoE nodes itself; mobius
#: writes Mixtral's, Qwen3-MoE's and gpt-oss's experts as a loop over experts, fused into QMoE
#: (:mod:`bitpress.genai.moe_loop`); gpt-oss's transposed experts are quantized as their transpose (:func:`_transposed`)
SUPPORTED = {"Lfm2MoeForCausalLM": ("LFM2-MoE", "builder"), "MixtralForCausalLM": ("Mixtral", "mobius"),
             "Qwen3MoeForCausalLM": ("Qwen3-MoE", "mobius"), "GptOssForCausalLM": ("gpt-oss", "mobius")}
#: why an exporter cannot build an architecture's experts as QMoE (measured); the other exporter may
WRONG_EXPORTER = {
    ("MixtralForCausalLM", "builder"): "the ONNX Runtime GenAI builder 0.18 has no Mixtral builder "
                                       "(NotImplementedError)",
    ("Qwen3MoeForCausalLM", "builder"): "the ONNX Runtime GenAI builder 0.18 has no Qwen3-MoE builder "
                                        "(NotImplementedError)",
    ("Lfm2MoeForCausalLM", "mobius"): "bitpress fuses mobius's loops over experts for Mixtral, Qwen3-MoE and "
                                      "gpt-oss only (LFM2-MoE's sigmoid router with expert biases is not checked)",
    ("GptOssForCausalLM", "builder"): "the ONNX Runtime GenAI builder 0.18 builds gpt-oss QMoE only from the "
                                      "original MXFP4 expert tensors (a float checkpoint gives a float MoE node)",
}
#: MoE architectures neither exporter builds as QMoE on cpu with bitpress's integers, and why (measured)
UNSUPPORTED = {
    "PhimoeForCausalLM": "the ONNX Runtime GenAI builder 0.18 builds Phi-MoE (LongRoPE only) for CUDA only, and "
                         "mobius's sparse-mixer router has no QMoE equivalent on cpu",
    "PhiMoEForCausalLM": "the ONNX Runtime GenAI builder 0.18 builds Phi-MoE (LongRoPE only) for CUDA only, and "
                         "mobius's sparse-mixer router has no QMoE equivalent on cpu",
}
QMOE_BITS = (4, 8)
QMOE_BLOCKS = (32, 64, 128)  # CPU block-wise QMoE (the builder's help, 0.18)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_NODE_LAYER = re.compile(r"/layers\.(\d+)/")
# QMoE inputs: 2 fc1 weights, 3 fc1 scales, 5 fc2 weights, 6 fc2 scales, 11 fc1 zero points, 12 fc2 zero points
_FC = {"fc1": (2, 3, 11), "fc2": (5, 6, 12)}


@dataclass
class ExpertWeights:
    """One QMoE input's worth of bitpress experts: unpacked integers ``[E, N, K]``, scales
    ``[E, N, blocks]``, integer zero points ``[E, N, blocks]`` (None: symmetric)."""

    name: str
    q: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    bits: int
    group_size: int

    def dequantize(self) -> np.ndarray:
        e, n, k = self.q.shape
        nb = self.scales.shape[-1]
        zp = self.zero_points if self.zero_points is not None else np.full(self.scales.shape, 2 ** (self.bits - 1))
        w = (self.q.reshape(e, n, nb, -1).astype(np.float32) - zp[..., None]) * self.scales[..., None]
        return w.reshape(e, n, k)


@dataclass
class MoeLayer:
    """A decoder layer's experts: fc1 (gate and up, rows interleaved) and fc2 (down)."""

    layer: int
    fc1: ExpertWeights
    fc2: ExpertWeights


def is_moe(model: nn.Module) -> bool:
    from bitpress.hf.quantize import config_is_moe, find_experts

    config = getattr(model, "config", None)
    return (config is not None and config_is_moe(config)) or bool(find_experts(model).roots)


def quantized_moe(model: nn.Module) -> bool:
    """A mixture-of-experts model with quantized weights: its GenAI export goes through QMoE."""
    from bitpress.hf.qtensor import QuantTensor

    return is_moe(model) and any(isinstance(p, QuantTensor) for p in model.parameters())


def architecture(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    archs = getattr(config, "architectures", None) or [type(model).__name__]
    return str(archs[0])


def _stack(name: str, tensors: list[Any]) -> ExpertWeights:
    """Per-expert (or one fused) QuantTensors ``[.., N, K]`` -> :class:`ExpertWeights` ``[E, N, K]``."""
    from bitpress.hf.qtensor import QuantTensor

    qs, scales, zps, specs = [], [], [], set()
    for t in tensors:
        if not isinstance(t, QuantTensor):
            raise ExportError(f"{name} is float while other experts are quantized: quantize every expert (moe: "
                              "true without modules_to_not_convert covering experts) or none")
        s = t.spec
        if s.zero_points == "float":
            raise ExportError(f"{name} has float zero points, which QMoE cannot hold: quantize experts with integer "
                              "zero points (rtn_hf, gptq_hf; kquant_hf float_zero_points: false)")
        shape = s.quant_shape if len(s.shape) == 3 else (1, *s.quant_shape)  # rows [.., N, K], even if transposed
        b = t.blocks()
        qs.append(b.q.reshape(*shape[:-1], -1)[..., : s.k])
        scales.append(b.scales.reshape(*shape[:-1], s.n_blocks))
        zps.append(None if b.zero_points is None else b.zero_points.reshape(*shape[:-1], s.n_blocks))
        specs.add((s.bits, s.group_size, s.k))
    if len(specs) > 1:
        raise ExportError(f"the experts of {name} mix bits / group sizes ({sorted(specs)}): QMoE holds one per "
                          "projection; quantize every expert alike")
    (bits, group, k), = specs
    if bits not in QMOE_BITS:
        raise ExportError(f"{name} is {bits}-bit: QMoE on CPU holds 4- or 8-bit experts; quantize experts with "
                          "bits 4 or 8")
    if group not in QMOE_BLOCKS or k % group:
        raise ExportError(f"{name} has group size {group} for K {k}: CPU QMoE needs a block size of "
                          f"{', '.join(map(str, QMOE_BLOCKS))} dividing K; quantize experts with such a group_size")
    if any(z is None for z in zps) and not all(z is None for z in zps):
        raise ExportError(f"the experts of {name} mix symmetric and asymmetric weights: quantize them alike")
    zp = None if zps[0] is None else np.concatenate(zps)
    return ExpertWeights(name, np.concatenate(qs), np.concatenate(scales), zp, bits, group)


def _interleave(gate: ExpertWeights, up: ExpertWeights, name: str) -> ExpertWeights:
    """fc1 for ``swiglu_fusion=1``: rows gate0, up0, gate1, up1, ..."""
    def mix(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
        if a is None or b is None:
            return None
        return np.stack([a, b], axis=2).reshape(a.shape[0], 2 * a.shape[1], *a.shape[2:])

    if (gate.bits, gate.group_size) != (up.bits, up.group_size) or (gate.zero_points is None) != (
            up.zero_points is None):
        raise ExportError(f"{name}: gate and up experts differ in bits, group size or symmetry; QMoE holds them as "
                          "one tensor, quantize them alike")
    return ExpertWeights(name, mix(gate.q, up.q), mix(gate.scales, up.scales),  # type: ignore[arg-type]
                         mix(gate.zero_points, up.zero_points), gate.bits, gate.group_size)


def _split_rows(w: ExpertWeights) -> tuple[ExpertWeights, ExpertWeights]:
    half = w.q.shape[1] // 2

    def part(sl: slice) -> ExpertWeights:
        zp = None if w.zero_points is None else w.zero_points[:, sl]
        return ExpertWeights(w.name, w.q[:, sl], w.scales[:, sl], zp, w.bits, w.group_size)

    return part(slice(0, half)), part(slice(half, None))


_LIST_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _transposed(root: str, mod: Any, params: dict[str, Any]) -> tuple[ExpertWeights, ExpertWeights]:
    """fc1 / fc2 of fused experts stored transposed (gpt-oss's ``gate_up_proj`` ``[E, H, 2I]`` with gate / up
    interleaved on the last axis, ``down_proj`` ``[E, I, H]``): quantized as each expert's transpose
    (``QuantSpec.transposed``), their integers are already QMoE's rows: fc1 ``[E, 2I, H]`` interleaved gate0, up0,
    ..., fc2 ``[E, H, I]``. Only the known layouts (:data:`bitpress.hf.quantize.TRANSPOSED_EXPERTS`) qualify."""
    from bitpress.hf.qtensor import QuantTensor
    from bitpress.hf.quantize import transposed_layout_problem

    out = []
    for attr in ("gate_up_proj", "down_proj"):
        problem = transposed_layout_problem(mod, attr)
        if problem:
            raise ExportError(f"{root}.{attr}: {problem}; no QMoE mapping")
        t = params[attr]
        if isinstance(t, QuantTensor) and not t.spec.transposed:
            raise ExportError(f"{root}.{attr} is stored transposed (E, K, OUT) but its integers run along its last "
                              "axis (quantized by an older bitpress?): requantize it with moe: true")
        out.append(_stack(f"{root}.{attr}", [t]))
    return out[0], out[1]


def expert_layers(model: nn.Module) -> list[MoeLayer]:
    """bitpress's experts of every MoE layer, in QMoE form (fc1 interleaved, fc2 as is)."""
    from torch import nn as tnn

    from bitpress.hf.quantize import find_experts

    mods = dict(model.named_modules())
    out: list[MoeLayer] = []
    for root in find_experts(model).roots:
        m = _LAYER.search(root + ".")
        if m is None:
            raise ExportError(f"the experts {root} are not under a numbered decoder layer (layers.N): their QMoE node "
                              "cannot be found in the package")
        mod = mods[root]
        params = dict(mod.named_parameters(recurse=False))
        if "gate_up_proj" in params and "down_proj" in params and getattr(mod, "is_transposed", False):
            fc1, fc2 = _transposed(root, mod, params)
        elif "gate_up_proj" in params and "down_proj" in params:
            gate, up = _split_rows(_stack(f"{root}.gate_up_proj", [params["gate_up_proj"]]))
            fc1 = _interleave(gate, up, f"{root}.gate_up_proj")
            fc2 = _stack(f"{root}.down_proj", [params["down_proj"]])
        elif isinstance(mod, (tnn.ModuleList, tnn.ModuleDict)):
            experts = list(mod.children())
            names = next((n for n in _LIST_NAMES if all(hasattr(experts[0], a) for a in n)), None)
            if names is None:
                raise ExportError(f"{root}: per-expert modules without gate_proj / up_proj / down_proj (or w1 / w3 / "
                                  "w2) have no QMoE mapping")
            g, u, d = ([getattr(e, a).weight for e in experts] for a in names)
            fc1 = _interleave(_stack(f"{root}.*.{names[0]}", g), _stack(f"{root}.*.{names[1]}", u), f"{root}.*")
            fc2 = _stack(f"{root}.*.{names[2]}", d)
        else:
            raise ExportError(f"{root} ({type(mod).__name__}) has neither fused gate_up_proj / down_proj nor a list "
                              "of per-expert MLPs: no QMoE mapping")
        if fc1.bits != fc2.bits or fc1.group_size != fc2.group_size:
            raise ExportError(
                f"{root}: gate/up experts are {fc1.bits}-bit group {fc1.group_size} and down experts {fc2.bits}-bit "
                f"group {fc2.group_size}, but CPU QMoE needs one width and block size for both (mixed widths are not "
                "implemented on CPU); quantize all experts with the same bits and group_size"
            )
        if (fc1.zero_points is None) != (fc2.zero_points is None):
            raise ExportError(f"{root}: gate/up and down experts differ in symmetry; QMoE takes zero points for both "
                              "or neither: quantize them alike")
        out.append(MoeLayer(int(m.group(1)), fc1, fc2))
    return sorted(out, key=lambda x: x.layer)


def check_moe(model: nn.Module, exporter: str = "builder") -> list[MoeLayer]:
    """Raise :class:`ExportError` unless ``exporter`` builds ``model``'s experts as QMoE (or a loop bitpress
    fuses into QMoE) that bitpress fills with its integers; returns those experts."""
    from bitpress.hf.checkpoint import parameter_groups
    from bitpress.hf.qtensor import QuantTensor
    from bitpress.hf.quantize import find_experts

    arch = architecture(model)
    if arch in UNSUPPORTED:
        raise ExportError(f"{arch} cannot be exported to a GenAI package: {UNSUPPORTED[arch]}")
    if arch not in SUPPORTED:
        raise ExportError(f"mixture-of-experts {arch} is not exported to a GenAI package: bitpress writes QMoE "
                          f"experts for {', '.join(SUPPORTED)} only (the architectures checked with the exporters)")
    name, works = SUPPORTED[arch]
    if exporter != works:
        why = WRONG_EXPORTER.get((arch, exporter), f"bitpress writes {name}'s QMoE experts with {works} only")
        raise ExportError(f"{arch} cannot be exported with exporter {exporter}: {why}; export with exporter: "
                          f"{works} (--exporter {works})")
    experts = find_experts(model)
    dense = [names[0] for names, v in parameter_groups(model)
             if isinstance(v, QuantTensor) and experts.root_of(names[0]) is None]
    if dense:
        who = ("the GenAI builder imports pre-quantized dense layers of Llama-shaped checkpoints only, not "
               f"{name}'s" if exporter == "builder" else
               "bitpress hands mobius a float checkpoint (experts at bitpress's dequantized values) and "
               "fuses its float loop over experts; olive-quantized dense layers beside float experts are not "
               "checked with mobius 0.1.0")
        raise ExportError(
            f"{summarize_names(dense)} are quantized outside the experts: {who}; quantize only the experts "
            "(modules_to_not_convert listing the other layers, e.g. self_attn) to export this model"
        )
    layers = expert_layers(model)
    if not layers:
        raise ExportError(f"{arch} has no quantized experts to export as QMoE")
    kinds = {(x.fc1.bits, x.fc1.group_size) for x in layers}
    if len(kinds) > 1 and exporter == "builder":
        raise ExportError(f"the experts' layers mix {sorted(kinds)} (bits, group size): the builder writes one QMoE "
                          "bits / block size for the model; quantize every expert alike")
    return layers


def builder_options(layers: list[MoeLayer]) -> dict[str, str]:
    """The builder options that make its QMoE nodes the shape of bitpress's experts."""
    bits, group = layers[0].fc1.bits, layers[0].fc1.group_size
    return {"moe_quant_type": f"int{bits}", "qmoe_block_size": str(group)}


def stage_moe(model: nn.Module, dest: Path, *, source: Path) -> Any:
    """A float checkpoint in ``dest`` (experts at bitpress's dequantized values) the builder reads."""
    from bitpress.hf.export import float_view
    from bitpress.hf.olive import write_olive

    with float_view(model) as floats:
        return write_olive(floats, dest, source=source)


# -- the rewrite ------------------------------------------------------------------------------------
def _tensor(folder: Path, t: Any) -> np.ndarray:
    from onnx import numpy_helper

    return numpy_helper.to_array(t, base_dir=str(folder))


def _overwrite(folder: Path, t: Any, array: np.ndarray) -> None:
    """Replace ``t``'s values with ``array`` (same dtype and size): in place in its external file, else inline."""
    import onnx
    from onnx import numpy_helper

    data = np.ascontiguousarray(array).tobytes()
    if t.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        offset, length = int(info.get("offset", 0)), int(info.get("length", len(data)))
        if length != len(data):
            raise ExportError(f"{t.name}: {len(data)} bytes do not fit the {length} the package holds")
        path = folder / info["location"]
        with path.open("r+b") as fh:
            fh.seek(offset)
            fh.write(data)
    else:
        t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(array), t.name))


def _check_against_builder(folder: Path, node: Any, inits: dict[str, Any], fc: str, w: ExpertWeights,
                           bits: int, block: int) -> None:
    """bitpress's dequantized experts must be the builder's within half its quantization step."""
    from bitpress.onnx.layout import unpack_along_last

    wi, si, zi = _FC[fc]
    qw, sc = _tensor(folder, inits[node.input[wi]]), _tensor(folder, inits[node.input[si]]).astype(np.float32)
    e, n, k = w.q.shape
    if qw.shape[:2] != (e, n) or sc.shape != (e, n, k // block):
        raise ExportError(f"{w.name}: bitpress's experts are [{e}, {n}, {k}] but the package's {node.name} {fc} "
                          f"weights are {list(qw.shape)} with scales {list(sc.shape)}: the mapping is wrong")
    q = unpack_along_last(qw, bits, k).astype(np.float32)
    zp = np.full(sc.shape, 2 ** (bits - 1), np.float32)
    if len(node.input) > zi and node.input[zi]:
        zp = unpack_along_last(_tensor(folder, inits[node.input[zi]]), bits, k // block).astype(np.float32)
    built = ((q.reshape(e, n, -1, block) - zp[..., None]) * sc[..., None]).reshape(e, n, k)
    ours = w.dequantize()
    step = np.repeat(np.abs(sc), block, axis=-1)
    bad = np.abs(ours - built) > 0.51 * step + 1e-6
    if bad.any():
        ex, row, col = (int(i[0]) for i in np.nonzero(bad))
        raise ExportError(
            f"{w.name} does not match the builder's {node.name} {fc} weights (expert {ex}, row {row}, column {col}: "
            f"{ours[ex, row, col]:.6g} vs {built[ex, row, col]:.6g}, {int(bad.sum())} values off): the mapping of "
            "bitpress's experts onto QMoE is wrong for this model, so nothing is written"
        )


def write_experts(folder: Path, layers: list[MoeLayer]) -> int:
    """Write bitpress's experts into the QMoE nodes of the package ``folder``; returns the nodes written."""
    import onnx
    from onnx import helper, numpy_helper

    from bitpress.onnx.layout import pack_along_last

    by_layer = {x.layer: x for x in layers}
    written: set[int] = set()
    for path in sorted(p for p in Path(folder).rglob("*.onnx") if p.is_file()):
        proto = onnx.load(str(path), load_external_data=False)
        g = proto.graph
        inits = {t.name: t for t in g.initializer}
        changed = False
        for node in g.node:
            if node.op_type not in ("QMoE", "MoE"):
                continue
            m = _NODE_LAYER.search(node.name)
            layer = by_layer.get(int(m.group(1))) if m else None
            if layer is None:
                raise ExportError(f"{path.name}: {node.name} has no quantized bitpress experts to hold")
            if node.op_type != "QMoE":
                raise ExportError(f"{path.name}: {node.name} is a float MoE node, not QMoE: the builder did not "
                                  "quantize the experts, so bitpress's integers have nowhere to go")
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            bits, block = int(attrs.get("expert_weight_bits", 0)), int(attrs.get("block_size", 0))
            if (bits, block) != (layer.fc1.bits, layer.fc1.group_size) or int(attrs.get("swiglu_fusion", 0)) != 1 \
                    or any(a in attrs for a in ("fc1_expert_weight_bits", "fc2_expert_weight_bits")):
                raise ExportError(f"{node.name}: the builder wrote {bits}-bit QMoE with block size {block} "
                                  f"(swiglu_fusion {attrs.get('swiglu_fusion')}), not bitpress's {layer.fc1.bits}-bit "
                                  f"group {layer.fc1.group_size} with fused SwiGLU")
            for fc, w in (("fc1", layer.fc1), ("fc2", layer.fc2)):
                _check_against_builder(Path(path.parent), node, inits, fc, w, bits, block)
            for fc, w in (("fc1", layer.fc1), ("fc2", layer.fc2)):
                wi, si, zi = _FC[fc]
                _overwrite(path.parent, inits[node.input[wi]], pack_along_last(w.q, bits))
                sc = inits[node.input[si]]
                dtype = onnx.helper.tensor_dtype_to_np_dtype(sc.data_type)
                _overwrite(path.parent, sc, w.scales.astype(dtype))
                if w.zero_points is not None:
                    name = f"{node.input[wi].rsplit('.', 1)[0]}.bitpress_zero_points"
                    zp = numpy_helper.from_array(pack_along_last(w.zero_points, bits), name)
                    g.initializer.append(zp)
                    while len(node.input) <= zi:
                        node.input.append("")
                    node.input[zi] = name
                    changed = True
                elif len(node.input) > zi and node.input[zi]:
                    raise ExportError(f"{node.name}: the builder wrote {fc} zero points for symmetric experts")
            written.add(layer.layer)
            log.info("%s: bitpress's %d-bit experts (block %d%s) written", node.name, bits, block,
                     ", with zero points" if layer.fc1.zero_points is not None else "")
        if changed:
            onnx.save(proto, str(path))  # external data untouched: the tensors still point at their file
    missing = sorted(set(by_layer) - written)
    if missing:
        raise ExportError(f"the package has no QMoE node for the experts of layer(s) {missing}")
    return len(written)
