"""Tiny random-weight Hugging Face models (built from transformers configs, offline) for tests/hf.

Folder fixtures are session-wide and read-only: copy before changing anything. ``llama(...)``
builds a fresh in-memory model for tests that quantize in place.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError:  # the HF path is optional: without torch these tests are not collected
    collect_ignore_glob = ["test_*.py"]
else:
    # the real-model fixtures (SmolLM2 as a cached HF folder, the Lee corpus) live beside the other
    # real-model tests; load that conftest under its own name and reuse its fixtures here
    _spec = importlib.util.spec_from_file_location(
        "bitpress_tests_realmodels_conftest", Path(__file__).resolve().parents[1] / "realmodels" / "conftest.py"
    )
    assert _spec is not None and _spec.loader is not None
    _realmodels = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_realmodels)
    realmodels_cache = _realmodels.realmodels_cache
    smollm2_gguf = _realmodels.smollm2_gguf
    smollm2_hf = _realmodels.smollm2_hf
    lee_background = _realmodels.lee_background

#: small enough to build in milliseconds; hidden 64 so group sizes 16..64 tile the rows exactly
LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def build_llama(tied: bool, seed: int = 0, **overrides: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**LLAMA, **overrides}, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


def build_mixtral(seed: int = 0) -> Any:
    """A tiny Mixtral: fused experts (E, OUT, K), is_transposed False; eager experts for CPU."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=128, tie_word_embeddings=False)
    model = MixtralForCausalLM(cfg).eval()
    model.set_experts_implementation("eager")
    return model


def save_folder(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder)
    # a tokenizer-like companion file: the export and the checkpoint must carry it over unchanged
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return folder


@pytest.fixture
def llama() -> Callable[..., Any]:
    """``llama(tied=True, seed=0, **config)``: a fresh tiny LlamaForCausalLM in eval mode."""
    return build_llama


@pytest.fixture
def save_hf() -> Callable[[Any, Path], Path]:
    """``save_hf(model, folder)``: save_pretrained plus a tokenizer-like companion file."""
    return save_folder


@pytest.fixture
def mixtral() -> Callable[..., Any]:
    return build_mixtral


@pytest.fixture(scope="session")
def llama_tied_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 HF folder of a tiny Llama whose input embedding and LM head are one table."""
    return save_folder(build_llama(True), tmp_path_factory.mktemp("hf") / "llama_tied")


@pytest.fixture(scope="session")
def llama_untied_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_folder(build_llama(False, seed=1), tmp_path_factory.mktemp("hf") / "llama_untied")


def run_hf(passes: list[dict[str, Any]], src: Path, out: Path) -> Any:
    """Run a workflow on ``src`` and return the RunResult (output in ``out/<src.name>``)."""
    import bitpress

    return bitpress.run({"input": str(src), "output": str(out), "passes": passes})


@pytest.fixture
def hf_run() -> Callable[..., Any]:
    return run_hf
