"""Tiny random checkpoints of the architectures the exporters claim, built offline from transformers configs.

For the architecture matrix (``make -C bench architectures``, ``docs/architectures.md``) and the tests:
float32, hidden 64, two layers (one of each attention type where the model mixes them), a
256-token WordLevel tokenizer and a generation config, weights drawn large enough (normal, 0.1)
that a wrong rope theta, scale or window shows in the logits. ``build_tiny(model_type, folder)``
writes one; :data:`TINY` lists the types and what each one's config sets beyond the common sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: sizes every tiny model shares (names as most configs spell them)
COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
_WINDOWED = {"head_dim": 16, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]}
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 16 for i in range(8)],
             "long_factor": [1.0 + i / 4 for i in range(8)], "original_max_position_embeddings": 64}

#: name -> (transformers model_type, config settings beyond COMMON)
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama (tied)": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "granite": ("granite", {"embedding_multiplier": 2.0, "logits_scaling": 4.0, "residual_multiplier": 0.5,
                            "attention_multiplier": 0.2}),
    # head_dim 32: a rotary half of 8 (ONNX Runtime's GroupQueryAttention wants a multiple of 8)
    "phi": ("phi", {"partial_rotary_factor": 0.5, "num_attention_heads": 2, "num_key_value_heads": 2}),
    "phi3 (4k)": ("phi3", {"original_max_position_embeddings": 128}),
    "phi3 (LongRoPE)": ("phi3", {"rope_parameters": _LONGROPE, "original_max_position_embeddings": 64}),
    "gemma": ("gemma", {"head_dim": 16}),
    "gemma2": ("gemma2", _WINDOWED),
    "gemma3_text": ("gemma3_text", _WINDOWED),
    "olmo": ("olmo", {}),
    "olmo2": ("olmo2", {}),
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0], "no_rope_layer_interval": 2}),
    "gpt2": ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "n_inner": 128,
                      "num_key_value_heads": 4}),  # GPT-2 has no grouped heads (an exporter may read the key)
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "head_dim": 16, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, **_WINDOWED,
                            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 64}}),
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"], "block_ff_dim": 128, "conv_L_cache": 3}),
}


def tiny_config(name: str) -> Any:
    """The transformers config of the tiny model ``name`` (a key of :data:`TINY`)."""
    from transformers import AutoConfig

    model_type, extra = TINY[name]
    settings = {**COMMON, **extra}
    return AutoConfig.for_model(model_type, **{k: v for k, v in settings.items()})


def build_tiny(name: str, folder: Path, *, seed: int = 0) -> Path:
    """Write the tiny model ``name`` (a key of :data:`TINY`) with its tokenizer to ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    with torch.no_grad():  # large enough that a wrong rope theta, scale or window shows in the logits
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    return save_with_tokenizer(model, Path(folder))


def save_with_tokenizer(model: Any, folder: Path) -> Path:
    """``save_pretrained`` plus a 256-token WordLevel tokenizer and a greedy generation config."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    model.save_pretrained(folder)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, 256)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(folder)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=False).save_pretrained(folder)
    return folder
