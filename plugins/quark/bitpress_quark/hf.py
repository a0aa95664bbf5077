"""Olive's ``QuarkQuantization`` on Hugging Face checkpoints: AMD Quark's PyTorch path (``quark.torch``).

``quark_hf`` runs Quark's ``LLMTemplate`` / ``ModelQuantizer`` on the checkpoint in memory (CPU),
then takes Quark's integers, scales and zero points out of its quantized linears and stores them as
bitpress's quantized tensors: the result is a bitpress checkpoint (``quantization_config`` of bitpress,
weights as MatMulNBits-ready blocks) that ``bitpress export`` turns into a GenAI package holding
Quark's integers exactly. Each weight is checked: bitpress's blocks dequantize to exactly the weight
Quark's own forward uses (``get_quant_weight``), or the pass stops.

Schemes: ``uint4_wo_{32,64,128}`` (asymmetric, integer zero points) and ``int4_wo_{32,64,128}``
(symmetric). Algorithms: awq, gptq, gptaq, qronos, autosmoothquant, rotation (untied models), or
none (round to nearest). What is refused, one line each before any work, and why: see
:data:`REFUSED_SCHEMES`, :data:`REFUSED_ALGORITHMS` and :data:`REFUSED_EXPORTS`.

Importing this module imports neither torch nor quark.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bitpress.plugin import (
    HfModel,
    Pass,
    PassContext,
    QuantizationError,
    ToolReport,
    UsageError,
    dist_version,
    option,
)
from bitpress_quark.sandbox import contained, import_quark_torch

log = logging.getLogger(__name__)

#: Quark's weight-only schemes bitpress stores exactly: (bits, group size, symmetric)
SCHEMES: dict[str, tuple[int, int, bool]] = {
    **{f"uint4_wo_{g}": (4, g, False) for g in (32, 64, 128)},
    **{f"int4_wo_{g}": (4, g, True) for g in (32, 64, 128)},
}
#: Olive's older names of the same schemes (its default is ``w_uint4_per_group_asym``)
SCHEME_ALIASES = {"w_uint4_per_group_asym": "uint4_wo_128", "w_int4_per_group_sym": "int4_wo_128"}
_ACTIVATIONS = ("quantizes activations too; bitpress's Hugging Face checkpoints and GenAI packages hold weight-only "
                "formats: export the float model and use the ONNX quark pass (static int8) on it")
REFUSED_SCHEMES = {
    "int8": "is W8A8 (weights and activations, static) and " + _ACTIVATIONS,
    "int4_wa_64": _ACTIVATIONS,
    "int4_wo_per_channel": "has one scale per row, which MatMulNBits holds only as a power-of-two block: use "
                           "int4_wo_128",
    "uint4_wo_per_channel": "has one scale per row, which MatMulNBits holds only as a power-of-two block: use "
                            "uint4_wo_128",
}
#: Quark's float / micro-scaling schemes: no ONNX Runtime CPU kernel for them
_NO_CPU_KERNEL = ("fp8", "ptpc_fp8", "mxfp4", "mxfp4_weight_only", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_mxfp6_e2m3",
                  "mxfp4_fp8", "amdfp4", "amdfp4_g32", "int4_fp8", "mx6", "mx9", "bfp16", "nvfp4",
                  "fp4_block16_scale_e4m3", "amdfp4_global16", "amdfp4_global32")
ALGORITHMS = ("awq", "gptq", "gptaq", "qronos", "autosmoothquant", "rotation")
REFUSED_ALGORITHMS = {
    "smoothquant": "moves activation outliers into the weights, which weight-only int4 then rounds: measured worse "
                   "than no algorithm (tests/plugins/test_quark.py); use awq or autosmoothquant",
    "autoround": "not run by bitpress's tests on a CPU; use awq or gptq",
    "twobitscalar": "a 2-bit method, not a scheme here; use awq or gptq",
}
REFUSED_EXPORTS = {
    "onnx": "Quark's ONNX export of per-group int4 fails (its weight folding cannot broadcast group scales): "
            "`bitpress export` writes the GenAI package with Quark's integers as MatMulNBits",
    "gguf": "Quark's GGUF export takes uint4_wo_32 with a sentencepiece tokenizer.model only: export the checkpoint "
            "with `bitpress export` instead",
}
CALIBRATED = {"awq", "gptq", "gptaq", "qronos", "autosmoothquant"}
INSTALL_HINT = (
    "bitpress env create quark (an isolated environment, recommended: Quark pins onnx<=1.22.0) "
    'or pip install "bitpress[quark]"'
)


@dataclass
class QuarkHfOptions:
    quant_scheme: str = option(
        "uint4_wo_128", "uint4_wo_32/64/128 (asymmetric, zero points) or int4_wo_32/64/128 (symmetric); Olive's "
        "w_uint4_per_group_asym is uint4_wo_128"
    )
    quant_algo: str | list[str] | None = option(
        "awq", f"{', '.join(ALGORITHMS)}, a list of them (['rotation', 'gptq']), or null: round to nearest"
    )
    dataset: str | None = option(
        None, "Olive's calibration dataset name: not downloaded (the run's data, or the model's own text, is used)"
    )
    num_calib_data: int | None = option(None, "at most this many calibration windows of the run's data")
    exclude_layers: list[str] | None = option(
        None, "layers left in float (Quark's patterns); unset: Quark's template default (lm_head)"
    )
    model_export: list[str] = option(["hf_format"], "hf_format: a checkpoint bitpress export turns into a package")
    quant_config: dict[str, Any] | None = option(None, "Quark's JSON algorithm config: not read (refused if given)")

    def scheme(self) -> str:
        return SCHEME_ALIASES.get(self.quant_scheme, self.quant_scheme)

    def algorithms(self) -> list[str]:
        algo = self.quant_algo
        return [] if algo in (None, "", "none", "rtn") else [algo] if isinstance(algo, str) else list(algo)

    def validate(self) -> None:
        scheme = self.scheme()
        if scheme not in SCHEMES:
            if scheme in REFUSED_SCHEMES:
                raise ValueError(f"quant_scheme {scheme} {REFUSED_SCHEMES[scheme]}")
            if scheme in _NO_CPU_KERNEL:
                raise ValueError(f"quant_scheme {scheme}: ONNX Runtime has no CPU kernel for it; use one of "
                                 f"{', '.join(SCHEMES)}")
            raise ValueError(f"quant_scheme {scheme!r}: choose one of {', '.join(SCHEMES)}")
        for algo in self.algorithms():
            if algo in REFUSED_ALGORITHMS:
                raise ValueError(f"quant_algo {algo} {REFUSED_ALGORITHMS[algo]}")
            if algo not in ALGORITHMS:
                raise ValueError(f"quant_algo {algo!r}: choose from {', '.join(ALGORITHMS)} (or null)")
        for fmt in self.model_export:
            if fmt in REFUSED_EXPORTS:
                raise ValueError(f"model_export {fmt}: {REFUSED_EXPORTS[fmt]}")
            if fmt != "hf_format":
                raise ValueError(f"model_export {fmt!r}: hf_format is the one written")
        if self.quant_config:
            raise ValueError("quant_config (Quark's JSON algorithm config) is not read: give quant_algo")
        if self.num_calib_data is not None and self.num_calib_data < 1:
            raise ValueError(f"num_calib_data must be at least 1, got {self.num_calib_data}")


class QuarkHfPass(Pass):
    """AMD Quark's PyTorch quantizer on a Hugging Face checkpoint: int4 weight-only, Quark's integers kept."""

    name = "quark_hf"
    algorithms = ("quark",)
    precisions = ("int4",)
    model_kinds = ("hf",)
    needs_data = True  # awq / gptq / ...; without an algorithm no data is read (see __init__)
    own_text_default = True
    summary = "AMD Quark (quark.torch) int4 weight-only on Hugging Face checkpoints (AWQ, GPTQ, rotation, ...)"
    Options: ClassVar[type] = QuarkHfOptions
    requires: ClassVar[tuple[str, ...]] = ("quark", "torch", "transformers", "safetensors")
    install_hint: ClassVar[str | None] = INSTALL_HINT

    def __init__(self, options: Any | None = None) -> None:
        super().__init__(options)
        self.needs_data = bool(CALIBRATED & set(self.options.algorithms()))

    def run(self, model: Any, context: PassContext) -> Any:
        from bitpress.plugin import check_float_model

        if not isinstance(model, HfModel):
            raise UsageError(f"{self.name} takes Hugging Face checkpoints, got {model.describe()}")
        o: QuarkHfOptions = self.options
        if o.dataset:
            log.warning("%s: Olive's dataset %s is not downloaded: the run's calibration data is used", self.name,
                        o.dataset)
        check_float_model(model, self.name)
        torch_model = model.torch_model()
        scheme, algorithms = o.scheme(), o.algorithms()
        bits, group, symmetric = SCHEMES[scheme]
        import_quark_torch()
        _check_model(self.name, torch_model, o, algorithms)
        loader = _calibration(model, torch_model, context, o) if self.needs_data else None
        t0 = time.perf_counter()
        if context.workdir is not None:
            Path(context.workdir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="quark-hf-", dir=context.workdir) as tmp, \
                contained(Path(tmp)), _float32(torch_model) as dtype:
            quantized = _quantize(torch_model, scheme, algorithms, o.exclude_layers, loader)
            stored = _store(torch_model, quantized, bits, group, symmetric, dtype)
        seconds = time.perf_counter() - t0
        mode = f"{scheme}" + (f" {'+'.join(algorithms)}" if algorithms else " (round to nearest)")
        details = {"scheme": scheme, "algorithms": algorithms, "weights": stored}
        report = ToolReport("Quark", dist_version("amd-quark"), mode, seconds, {"linear int4": len(stored)}, details)
        context.extras.setdefault("reports", []).append((self.name, model.source, report))
        log.info("%s", report.summary())
        model.history.append({"pass": self.name, "options": {"quant_scheme": scheme, "quant_algo": algorithms,
                                                             "exclude_layers": o.exclude_layers}})
        return model


def _check_model(pass_name: str, torch_model: Any, o: QuarkHfOptions, algorithms: list[str]) -> None:
    """What Quark would do wrong or refuse, said before any work."""
    from quark.torch import LLMTemplate

    model_type = getattr(torch_model.config, "model_type", None)
    if model_type not in LLMTemplate.list_available():
        raise UsageError(f"{pass_name}: Quark 0.13 has no template for model type {model_type!r} (it knows "
                         f"{', '.join(sorted(LLMTemplate.list_available())[:12])}, ...): use rtn_hf / gptq_hf / awq_hf")
    from torch import nn

    group = SCHEMES[o.scheme()][1]
    excluded = ["lm_head"] if o.exclude_layers is None else o.exclude_layers
    widths = {name: m.in_features for name, m in torch_model.named_modules()
              if isinstance(m, nn.Linear) and not any(p in name for p in excluded)}
    odd = {name: k for name, k in widths.items() if k % group}
    if odd:
        name, k = next(iter(odd.items()))
        fits = [g for g in (128, 64, 32) if all(w % g == 0 for w in widths.values())]
        hint = f"choose {o.scheme().rsplit('_', 1)[0]}_{fits[0]}" if fits else "no group size of Quark's fits them all"
        raise UsageError(f"{pass_name}: quant_scheme {o.scheme()} splits inputs in groups of {group}, but {name} has "
                         f"{k} inputs ({len(odd)} such layers): {hint}")
    tied = _tied(torch_model)
    if tied and "rotation" in algorithms:
        raise UsageError(f"{pass_name}: Quark's rotation rotates the embedding and the LM head apart, which unties a "
                         "tied table (two tables in the output); use bitpress's quarot_hf (one table) before this pass")
    if tied and o.exclude_layers is not None and not any("lm_head" in p for p in o.exclude_layers):
        raise UsageError(f"{pass_name}: the LM head shares the embedding table; Quark would quantize the head's use "
                         "of it alone and untie them: keep lm_head in exclude_layers (quantize the table with rtn_hf "
                         "after this pass)")


def _tied(torch_model: Any) -> bool:
    head = torch_model.get_output_embeddings()
    embed = torch_model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def _calibration(model: HfModel, torch_model: Any, context: PassContext, o: QuarkHfOptions) -> Any:
    """The run's data as Quark takes it: a DataLoader of input_ids rows."""
    import torch
    from torch.utils.data import DataLoader

    from bitpress.plugin import calibration_batches

    batches = calibration_batches(context.data, model.source, torch_model.config.vocab_size, torch_model)
    ids = torch.cat([b.input_ids for b in batches])
    if o.num_calib_data is not None:
        ids = ids[:o.num_calib_data]
    log.info("calibrating Quark on %d windows of %d tokens", ids.shape[0], ids.shape[1])
    return DataLoader(ids, batch_size=1)


class _float32:
    """Quark computes in float32 on a CPU: a bf16 / fp16 model runs as float32, and every float parameter and
    buffer that is still there afterwards gets its own dtype back (Quark's integers are stored apart)."""

    def __init__(self, torch_model: Any) -> None:
        self.model = torch_model
        self.dtype = next(p for p in torch_model.parameters()).dtype
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> Any:
        import torch

        if self.dtype != torch.float32:
            self.saved = {name: t.dtype for name, t in (*self.model.named_parameters(), *self.model.named_buffers())}
            self.model.to(torch.float32)
        return self.dtype

    def __exit__(self, *exc: Any) -> None:
        from bitpress.plugin import QuantTensor

        for full, dtype in self.saved.items():
            owner, _, name = full.rpartition(".")
            try:
                module = self.model.get_submodule(owner) if owner else self.model
            except AttributeError:  # a module Quark replaced
                continue
            if name in module._parameters and module._parameters[name] is not None:
                param = module._parameters[name]
                if not isinstance(param.data, QuantTensor) and param.dtype != dtype:
                    param.data = param.data.to(dtype)
            elif name in module._buffers and module._buffers[name] is not None:
                module._buffers[name] = module._buffers[name].to(dtype)


def _quantize(torch_model: Any, scheme: str, algorithms: list[str], exclude: list[str] | None, loader: Any) -> dict:
    """Run Quark in place; ``{module name: Quark's quantized linear}``."""
    from quark.torch import LLMTemplate, ModelQuantizer
    from quark.torch.quantization.nn.modules.quantize_linear import QuantLinear

    template = LLMTemplate.get(torch_model.config.model_type)
    kwargs: dict[str, Any] = {"scheme": scheme, "algorithm": (algorithms[0] if len(algorithms) == 1 else algorithms)
                              if algorithms else None}
    if exclude is not None:
        kwargs["exclude_layers"] = list(exclude)
    config = template.get_config(**kwargs)
    try:
        ModelQuantizer(config).quantize_model(torch_model, loader)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QuantizationError(f"Quark {scheme} {'+'.join(algorithms) or 'rtn'} failed: {first}") from exc
    found = {name: m for name, m in torch_model.named_modules() if isinstance(m, QuantLinear)}
    if not found:
        raise QuantizationError(f"Quark {scheme} quantized no linear layer (exclude_layers leaves none?)")
    return found


def _store(torch_model: Any, quantized: dict[str, Any], bits: int, group: int, symmetric: bool,
           dtype: Any) -> list[str]:
    """Replace each Quark linear by a plain ``nn.Linear`` whose weight holds Quark's integers as bitpress blocks;
    each checked to dequantize to exactly the weight Quark's forward uses."""
    import numpy as np
    import torch
    from torch import nn

    from bitpress.plugin import QuantizedBlocks, QuantSpec, QuantTensor

    names = []
    for name, m in quantized.items():
        quantizer = m._weight_quantizer
        w = m.weight.detach().float()
        out_f, k = w.shape
        if k % group:
            raise QuantizationError(f"{name}: {k} inputs are not a multiple of Quark's group {group}")
        scale = quantizer.scale.detach().float().reshape(out_f, k // group)
        zero = quantizer.zero_point.detach().to(torch.int32).reshape(out_f, k // group)
        lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2 ** bits - 1)
        # Quark's fake quantization: clamp(round_half_even(w * (1 / s)) + z, lo, hi)
        inv = (1.0 / scale).repeat_interleave(group, dim=1)
        q = torch.clamp(torch.round(w * inv) + zero.repeat_interleave(group, dim=1), lo, hi)
        ours = (q - zero.repeat_interleave(group, dim=1)) * scale.repeat_interleave(group, dim=1)
        theirs = m.get_quant_weight(m.weight).detach().float()
        if not torch.equal(ours, theirs):
            bad = int((ours != theirs).sum())
            raise QuantizationError(f"{name}: {bad} of {ours.numel()} weights differ from Quark's own quantized "
                                    "weight; nothing written")
        if symmetric and int(zero.abs().max()) != 0:
            raise QuantizationError(f"{name}: Quark's symmetric scheme wrote non-zero zero points")
        offset = 2 ** (bits - 1) if symmetric else 0  # bitpress's symmetric codes: q + 8, implied zero point 8
        codes = (q + offset).to(torch.uint8).numpy().reshape(out_f, k // group, group)
        blocks = QuantizedBlocks(q=codes, scales=scale.numpy().astype(np.float32),
                                 zero_points=None if symmetric else zero.to(torch.uint8).numpy())
        spec = QuantSpec(bits, group, symmetric, (out_f, k), dtype, "none" if symmetric else "uint8")
        linear = nn.Linear(k, out_f, bias=m.bias is not None, device="meta")
        linear.weight = nn.Parameter(QuantTensor.from_blocks(blocks, spec), requires_grad=False)
        if m.bias is not None:
            linear.bias = nn.Parameter(m.bias.detach().to(dtype), requires_grad=False)
        parent_name, _, attr = name.rpartition(".")
        setattr(torch_model.get_submodule(parent_name) if parent_name else torch_model, attr, linear)
        names.append(name)
    return names
