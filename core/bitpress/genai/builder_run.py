"""Run the ONNX Runtime GenAI builder on a configuration transformers 5 writes and builder 0.18 misreads.

``python -m bitpress.genai.builder_run ARGS`` is ``python -m onnxruntime_genai.models.builder ARGS``
with the configuration the builder loads (through ``transformers.AutoConfig``) adapted first:

* Gemma-3 (``Gemma3ForCausalLM``, and the text model of ``Gemma3ForConditionalGeneration``):
  transformers 5 keeps the rope parameters per attention type
  (``rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}``), where the builder
  reads ``rope_parameters["rope_type"]``, ``rope_theta`` and ``rope_local_base_freq`` (it fails
  with ``KeyError: 'rope_type'``). The full-attention parameters become ``rope_parameters`` and
  ``rope_theta``, the sliding layers' theta ``rope_local_base_freq``: the attributes transformers
  4 gave the builder. Measured: the package then equals transformers' forward to float rounding,
  past the sliding window too (:mod:`bitpress.genai.check` checks it on every build).

Nothing else changes: the builder reads the same folder, with the same arguments.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

#: architectures whose per-attention-type rope parameters are adapted (their builder class reads the flat form)
PER_LAYER_TYPE_ROPE = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


def per_layer_type_rope(config: Any) -> dict[str, Any] | None:
    """``config``'s rope parameters per attention type, when it has them (else None)."""
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        return rope
    return None


def adapt(config: Any) -> Any:
    """Give a Gemma-3 ``config`` (or its ``text_config``) the flat rope attributes the builder reads."""
    if not set(getattr(config, "architectures", None) or ()) & set(PER_LAYER_TYPE_ROPE):
        return config
    for cfg in (config, getattr(config, "text_config", None)):
        rope = per_layer_type_rope(cfg) if cfg is not None else None
        if rope is None or "full_attention" not in rope:
            continue
        full, local = rope["full_attention"], rope.get("sliding_attention") or rope["full_attention"]
        # plain attributes, set past the config's validation (which wants one form or the other)
        object.__setattr__(cfg, "rope_parameters", dict(full))
        object.__setattr__(cfg, "rope_theta", full["rope_theta"])
        object.__setattr__(cfg, "rope_local_base_freq", local["rope_theta"])
    return config


def main(argv: list[str]) -> None:
    import transformers

    load = transformers.AutoConfig.from_pretrained.__func__

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        return adapt(load(cls, *args, **kwargs))

    transformers.AutoConfig.from_pretrained = classmethod(from_pretrained)
    sys.argv = ["onnxruntime_genai.models.builder", *argv]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
