"""Which exporter builds which architecture right, and the choice ``--exporter auto`` makes.

The architectures each exporter claims come from the exporters themselves: the GenAI builder's
``create_model`` dispatch on ``config.architectures[0]`` (read from its source, the only place
builder 0.18 lists them) and mobius's model registry (``model_type``). What each one builds
*wrong* is measured: ``make -C bench architectures`` runs tiny checkpoints of every type through
both exporters, float and quantized, each build checked against transformers
(:mod:`bitpress.genai.check`), and writes ``docs/architectures.md``; :data:`FAULTS` holds what that
run found, with the reason a user is told.

``auto`` takes the builder when it claims the architecture and has no fault for it, else mobius
on the same terms; when neither can, the export is refused before any work, with one line saying
why for each and what would work. Naming an exporter with a known fault is refused the same way.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bitpress.errors import ExportError

EXPORTERS = ("auto", "builder", "mobius")
BUILDER_EPS = ("cpu", "cuda", "dml", "webgpu", "NvTensorRtRtx")  # the builder's -e choices (0.18)

#: measured faults (docs/architectures.md): model_type -> exporter -> checkpoint ("float", "quantized",
#: "any") -> why that exporter is refused for it (what works instead is added by :func:`refusal`)
#: the model types whose mobius 0.1.0 model takes quantized linears (measured; every other type's fails after
#: loading with "Weight shape mismatch": Gemma, Gemma-3, Granite, OLMo, OLMo2, Phi, SmolLM3, ...). Mixture-of-experts
#: types are staged float with bitpress's experts written into QMoE nodes afterwards (bitpress.genai.moe_loop).
MOBIUS_QUANTIZED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gpt_oss")


FAULTS: dict[str, dict[str, dict[str, str]]] = {
    "gemma2": {"mobius": {"any": "mobius 0.1.0 fails on Gemma-2 (its config has no query_pre_attn_scalar)"}},
    "gpt_oss": {"builder": {"any": "the GenAI builder 0.18 builds gpt-oss only from its original MXFP4 checkpoint "
                                   "(AssertionError on a float one)"}},
    "lfm2": {"builder": {"any": "the GenAI builder 0.18 builds LFM2 wrong from transformers 5's checkpoint (logits off "
                                "by 3.8 on a tiny model; quantized ones fail with int() of 'weight')"}},
    "olmo": {
        "builder": {"any": "the GenAI builder 0.18 builds OLMo wrong (logits off by 0.95 on a tiny model, decode "
                           "steps)"},
    },
    "phi": {
        "builder": {"any": "the GenAI builder 0.18's Phi-2 differs from transformers by 2e-3 where mobius's by 1e-6 "
                           "(tiny model), and it cannot read a quantized Phi-2 checkpoint (int() of 'bias')"},
    },
    "smollm3": {"builder": {"any": "the GenAI builder 0.18 fails on SmolLM3's layers without rope (KeyError "
                                   "'position_ids')"}},
    "phi3": {
        "builder": {"any": "the GenAI builder 0.18 builds Phi-3 wrong from transformers 5's config (float logits off "
                           "by 3.4 on a tiny model; LongRoPE fails with KeyError 'type'; quantized checkpoints get "
                           "zero points of the wrong shape)"},
    },
}


@dataclass(frozen=True)
class Choice:
    exporter: str
    reason: str


@functools.cache
def builder_architectures() -> frozenset[str]:
    """The ``architectures`` the GenAI builder's ``create_model`` dispatches on (empty without the builder)."""
    spec = importlib.util.find_spec("onnxruntime_genai")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    source = Path(next(iter(spec.submodule_search_locations))) / "models" / "builder.py"
    try:
        text = source.read_text(encoding="utf-8")
    except OSError:
        return frozenset()
    return frozenset(re.findall(r'config\.architectures\[0\]\s*==\s*"([A-Za-z0-9_]+)"', text))


@functools.cache
def mobius_model_types() -> frozenset[str]:
    """The ``model_type`` values mobius's registry builds (empty without mobius)."""
    if importlib.util.find_spec("mobius") is None:
        return frozenset()
    try:
        from mobius._registry import registry
    except Exception:  # a mobius that cannot be imported builds nothing
        return frozenset()
    return frozenset(registry.architectures())


def _claims(exporter: str, config: dict[str, Any]) -> bool:
    if exporter == "builder":
        archs = config.get("architectures") or []
        return bool(archs) and archs[0] in builder_architectures()
    return config.get("model_type") in mobius_model_types()


#: float dtypes whose packages an exporter builds for the CPU but ONNX Runtime cannot run (measured)
BROKEN_CPU_DTYPES = {"builder": ("f16", "bf16")}


def refusal(exporter: str, config: dict[str, Any], quantized: bool, dtype: str = "auto", ep: str = "cpu") -> str | None:
    """Why ``exporter`` cannot build this model right (None when it can, as far as is known)."""
    from bitpress.genai.mobius import CPU_RUNNABLE

    model_type = config.get("model_type")
    if ep in CPU_RUNNABLE and dtype in BROKEN_CPU_DTYPES.get(exporter, ()):
        return (f"the GenAI builder 0.18's {dtype} packages for {ep} fail in ONNX Runtime after a prefill "
                "(\"Shape mismatch attempting to re-use buffer\" at the first decode step)")
    if not _claims(exporter, config):
        if exporter == "builder":
            arch = (config.get("architectures") or ["(none given)"])[0]
            return f"the GenAI builder 0.18 does not build {arch}"
        return f"mobius 0.1.0 does not build model_type {model_type!r}"
    if exporter == "mobius" and quantized and model_type not in MOBIUS_QUANTIZED:
        return (f"mobius 0.1.0's model for {model_type!r} takes no quantized linears (it fails with 'Weight shape "
                f"mismatch'; measured: it takes them for {', '.join(MOBIUS_QUANTIZED[:5])})")
    if exporter == "mobius":
        from bitpress.genai.mobius import config_fault

        why = config_fault(config)
        if why:
            return why
    faults = FAULTS.get(str(model_type), {}).get(exporter, {})
    return faults.get("quantized" if quantized else "float") or faults.get("any")


def choose(requested: str, config: dict[str, Any], *, quantized: bool, ep: str, dtype: str = "auto") -> Choice:
    """The exporter that builds this model: ``requested`` if it can, or for ``auto`` the first that can;
    raises :class:`ExportError` (one line: why each cannot, what would) before any work."""
    from bitpress.genai.mobius import MOBIUS_EPS

    model_type = config.get("model_type")
    what = f"model_type {model_type!r}" + (" (quantized)" if quantized else "")
    if requested != "auto":
        why = refusal(requested, config, quantized, dtype, ep)
        if why is None:
            return Choice(requested, f"{requested} (named)")
        other = "mobius" if requested == "builder" else "builder"
        alt = (f"use --exporter {other} (or auto)" if refusal(other, config, quantized, dtype, ep) is None
               else "no exporter builds it right here (docs/architectures.md); --runtime onnx is bitpress's own graph")
        raise ExportError(f"{why}: {what} is refused before the build; {alt}")
    reasons = []
    for exporter, eps in (("builder", BUILDER_EPS), ("mobius", MOBIUS_EPS)):
        if ep not in eps:
            reasons.append(f"{exporter}: no execution provider {ep!r}")
            continue
        why = refusal(exporter, config, quantized, dtype, ep)
        if why is None:
            return Choice(exporter, f"{exporter}: it builds {what} and is checked against transformers "
                                    "(docs/architectures.md)" + (f"; not the builder: {reasons[0]}" if reasons else ""))
        reasons.append(why)
    raise ExportError(f"no exporter builds {what} right here: {'; '.join(reasons)}; export with --runtime onnx "
                      "(bitpress's own graph, no KV cache) or see docs/architectures.md")


def is_quantized(model: Any) -> bool:
    """Whether the Hugging Face model ``model`` (an :class:`~bitpress.hf.model.HfModel`) holds quantized weights."""
    from bitpress.hf.checkpoint import QUANT_METHOD, read_config

    if not model.loaded:
        qc = read_config(model.source).get("quantization_config")
        return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD
    from bitpress.hf.qtensor import QuantTensor

    return any(isinstance(p, QuantTensor) for p in model.torch_model().parameters())
