"""Olive-format checkpoints: bitpress's integers in the layout ONNX Runtime GenAI's builder imports as is.

The model builder (``onnxruntime_genai.models.builder``, 0.18) reads pre-quantized checkpoints
whose ``quantization_config.quant_method`` is ``olive`` (its ``models/loaders/olive.py``): per
quantized ``nn.Linear`` ``<module>.qweight`` uint8 ``[N, K * bits / 8]`` (the lower K index in
the lower bits), ``<module>.scales`` ``[N, K / group_size]`` and ``<module>.qzeros`` uint8
``[N, ceil(groups * bits / 8)]`` (packed the same way, each row on its own), and reshapes them
into ``MatMulNBits``'s ``B`` / scales / zero points without changing a value. bitpress's own
layout is ``MatMulNBits``'s (:mod:`bitpress.hf.qtensor`), so the conversion is a reshape and a
packing of the zero points: the builder's graph holds exactly the checkpoint's integers,
scales and zero points (tested in ``tests/hf/test_genai_export.py``).

What the format (or the builder reading it) cannot carry is refused here, before any build:

* float zero points (kquant / hqq style): olive's zero points are integers;
* a decoder ``nn.Linear`` left in float (the builder's loader takes every ``*.weight`` of a
  quantized layer for a ``qweight`` and fails): quantize every projection, or none;
* ``K`` not a multiple of the group size (no padding in the format);
* 2- or 3-bit weights (no ``MatMulNBits`` kernel), fused expert tensors, a quantized
  embedding table not tied to the LM head (the builder imports quantized linears only).

Symmetric weights get explicit zero points of ``2**(bits - 1)``: the value ``MatMulNBits``
implies without them, written so the builder's fused q/k/v path (which concatenates zero
points) works. Layers whose q/k/v differ in bits or group size need ``fuse_qkv=false`` (the
builder's fusion then writes a broken graph): :attr:`OliveCheckpoint.builder_options` says so.

mobius (``mobius build --config``, 0.1.0) reads the same tensors with other conventions, so
``exporter="mobius"`` writes them its way: ``quantization_config`` carries ``sym`` (mobius
assumes symmetric when it is absent and silently drops the zero points: measured), ``lm_head``,
``embeds`` and ``tie_word_embeddings``; a quantized embedding table, tied or not, is stored as
``model.embed_tokens.*`` (mobius gathers it with ``GatherBlockQuantized`` and, tied, its LM head
reads the same initializers); symmetric checkpoints carry no zero points. mobius has one
``bits`` / ``group_size`` for the whole model: mixed ones are refused.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bitpress.errors import ExportError, summarize_names

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

QUANT_METHOD = "olive"
OLIVE_BITS = (4, 8)
EXPORTERS = ("builder", "mobius")
_TABLE = "model.embed_tokens.weight"
_HEAD = "lm_head.weight"


@dataclass
class OliveCheckpoint:
    """A folder the builder reads, and the builder options it needs to read it faithfully."""

    folder: Path
    quantized: bool
    builder_options: dict[str, str] = field(default_factory=dict)
    modules: int = 0  # quantized linears written


def pack_zero_points(zp: np.ndarray, bits: int) -> np.ndarray:
    """uint8 ``[rows, ceil(groups * bits / 8)]`` from integer zero points ``[rows, groups]``
    (4 bits: two per byte, the lower group in the lower nibble; each row padded on its own)."""
    z = np.asarray(zp, dtype=np.uint8)
    if bits == 8:
        return np.ascontiguousarray(z)
    if z.shape[1] % 2:
        z = np.concatenate([z, np.zeros((z.shape[0], 1), np.uint8)], axis=1)
    return np.ascontiguousarray((z[:, 0::2] & 0xF) | ((z[:, 1::2] & 0xF) << 4))


def _module_of(name: str) -> str:
    return name.removesuffix(".weight")


def _decoder_linears(model: nn.Module) -> dict[str, str]:
    """``weight name -> kind`` for every ``nn.Linear`` weight of the model except the LM head."""
    from torch import nn

    out = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and mod_name and f"{mod_name}.weight" != _HEAD:
            out[f"{mod_name}.weight"] = mod_name.rsplit(".", 1)[-1]
    return out


def check_olive(model: nn.Module, exporter: str = "builder") -> None:
    """Raise :class:`ExportError` when ``model`` cannot be written as an olive checkpoint ``exporter``
    reads faithfully."""
    from bitpress.hf.checkpoint import parameter_groups
    from bitpress.hf.qtensor import QuantTensor

    linears = _decoder_linears(model)
    problems: list[str] = []
    float_linears, float_zp, bad_bits, fused, bad_k, tables = [], [], [], [], [], []
    specs: set[tuple[int, int]] = set()
    any_quantized = False
    for names, value in parameter_groups(model):
        if not isinstance(value, QuantTensor):
            float_linears += [n for n in names if n in linears]
            continue
        any_quantized = True
        spec = value.spec
        if len(spec.shape) != 2:
            fused.append(names[0])
        elif spec.zero_points == "float":
            float_zp.append(names[0])
        elif spec.bits not in OLIVE_BITS:
            bad_bits.append(f"{names[0]} ({spec.bits}-bit)")
        elif spec.k % spec.group_size:
            bad_k.append(f"{names[0]} (K {spec.k}, group {spec.group_size})")
        else:
            specs.add((spec.bits, spec.group_size))
        if _TABLE in names and _HEAD not in names and exporter == "builder":
            tables.append(names[0])
    if not any_quantized:
        return
    if exporter == "mobius" and len(specs) > 1:
        problems.append(
            f"the weights mix {', '.join(f'{b}-bit group {g}' for b, g in sorted(specs))}: mobius reads one bits / "
            "group_size for the whole model (quantize with one, or use the builder: --exporter builder)"
        )
    if float_linears:
        problems.append(
            f"{summarize_names(float_linears)} are float in a quantized checkpoint: {_who(exporter)} imports a "
            "quantized checkpoint only when every decoder linear is quantized (quantize them all, e.g. without "
            "nodes_to_exclude / overrides that keep projections float, or export the float model)"
        )
    if float_zp:
        problems.append(
            f"{summarize_names(float_zp)} have float zero points (kquant / hqq), which the olive format cannot "
            "hold: quantize with integer zero points for a GenAI package (kquant_hf float_zero_points: false; "
            "rtn_hf, gptq_hf, awq_hf), or use bitpress's own export (hf_to_onnx keeps float zero points)"
        )
    if bad_bits:
        problems.append(f"{summarize_names(bad_bits)}: the builder imports 4- and 8-bit weights only")
    if bad_k:
        problems.append(
            f"{summarize_names(bad_k)}: the olive format has no padding, K must be a multiple of the group size "
            "(quantize with a group_size that divides it, e.g. 32 or 64: the *_hf passes' option)"
        )
    if fused:
        problems.append(f"{summarize_names(fused)}: fused expert tensors have no olive form")
    if tables:
        problems.append(
            f"{summarize_names(tables)}: a quantized embedding table not tied to the LM head has no olive form "
            "(the builder quantizes embeddings itself, from float): keep embeddings float (embeds: false), or "
            "export with --exporter mobius"
        )
    if problems:
        raise ExportError(f"cannot write this checkpoint for {_who(exporter)}: " + "; ".join(problems))


def _who(exporter: str) -> str:
    return "the GenAI builder" if exporter == "builder" else exporter


def write_olive(model: nn.Module, dest: Path, *, source: Path, exporter: str = "builder") -> OliveCheckpoint:
    """Write ``model`` (bitpress-quantized, or float) as a Hugging Face folder ``exporter`` imports.

    A float model is written as a plain float checkpoint; a quantized one in the olive format
    (``exporter``'s conventions: see the module's docstring), after :func:`check_olive`.
    Companion files (tokenizer, generation config) come from ``source``, each checked to stay
    inside it.
    """
    import torch
    from safetensors.torch import save_file

    from bitpress.hf.checkpoint import SAFETENSORS, companion_files, copy_companion, parameter_groups
    from bitpress.hf.online import is_online
    from bitpress.hf.qtensor import QuantTensor

    if exporter not in EXPORTERS:
        raise ExportError(f"unknown exporter {exporter!r}; known: {', '.join(EXPORTERS)}")
    check_olive(model, exporter)
    mobius = exporter == "mobius"
    groups = list(parameter_groups(model))
    quantized = [v for _, v in groups if isinstance(v, QuantTensor)]
    all_sym = all(v.qzeros is None for v in quantized)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    specs: dict[str, tuple[int, int]] = {}  # module -> (bits, group size)
    tied = tied_quantized = table_quantized = False
    for names, value in groups:
        if _TABLE in names and _HEAD in names:
            tied = True
        if not isinstance(value, QuantTensor):
            if not is_online(names[0]):  # an online product is inserted into the built graph, not staged
                tensors[names[0]] = value.detach().contiguous()
            continue
        spec = value.spec
        # the builder's GatherBlockQuantized reads a tied table from the LM head's tensors; mobius's
        # tied head reads the embedding's
        name = _TABLE if mobius and _TABLE in names else _HEAD if _HEAD in names else names[0]
        tied_quantized = tied_quantized or (_HEAD in names and _TABLE in names)
        table_quantized = table_quantized or _TABLE in names
        module = _module_of(name)
        rows, nb = spec.rows, spec.n_blocks
        tensors[f"{module}.qweight"] = value.qweight.reshape(rows, -1).contiguous()
        tensors[f"{module}.scales"] = value.scales.reshape(rows, nb).contiguous()
        if value.qzeros is not None:
            zp = value.qzeros.reshape(rows, nb).cpu().numpy()
        else:
            zp = np.full((rows, nb), 2 ** (spec.bits - 1), np.uint8)
        if not (mobius and all_sym):  # mobius: a symmetric model has no zero points
            tensors[f"{module}.qzeros"] = torch.from_numpy(pack_zero_points(zp, spec.bits))
        specs[module] = (spec.bits, spec.group_size)
    save_file(tensors, str(dest / SAFETENSORS), metadata={"format": "pt"})
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
    config.pop("quantization_config", None)
    options: dict[str, str] = {}
    if specs:
        (bits, group), _ = Counter(specs.values()).most_common(1)[0]
        qc: dict[str, Any] = {"quant_method": QUANT_METHOD, "bits": bits, "group_size": group}
        if mobius:
            qc |= {"sym": all_sym, "lm_head": _module_of(_HEAD) in specs or tied_quantized,
                   "embeds": table_quantized, "tie_word_embeddings": tied}
        else:
            qc["overrides"] = {m: {"bits": b, "group_size": g} for m, (b, g) in sorted(specs.items())
                               if (b, g) != (bits, group)}
            if _mixed_qkv(specs):
                options["fuse_qkv"] = "false"
            if _module_of(_HEAD) not in specs:  # a float head stays float (the builder would round it itself)
                options["nodes_to_exclude"] = "/lm_head/MatMul" + (",/model/embed_tokens/Gather" if tied else "")
        config["quantization_config"] = qc
    config["tie_word_embeddings"] = bool(tied)
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    for f in companion_files(Path(source)):
        if not (dest / f.name).exists():
            copy_companion(Path(source), f, dest / f.name)
    if tied and not tied_quantized and specs:
        log.info("the tied embedding / LM head table is float: the package keeps it float and shared")
    return OliveCheckpoint(dest, bool(specs), options, len(specs))


def _mixed_qkv(specs: dict[str, tuple[int, int]]) -> bool:
    """Whether some attention block's q/k/v projections differ in bits or group size."""
    layers: dict[str, set[tuple[int, int]]] = {}
    for module, spec in specs.items():
        parent, _, leaf = module.rpartition(".")
        if leaf in ("q_proj", "k_proj", "v_proj"):
            layers.setdefault(parent, set()).add(spec)
    return any(len(s) > 1 for s in layers.values())


def describe(config: dict[str, Any]) -> str:
    """One line on an olive ``quantization_config``."""
    qc = config.get("quantization_config") or {}
    return f"olive {qc.get('bits')}-bit, group {qc.get('group_size')}, {len(qc.get('overrides') or {})} overrides"
