"""What each extra brings (issue 32): the passes that read --data text get its tokenizer; `hub` the Hub client."""

from __future__ import annotations

import tomllib
from pathlib import Path

EXTRAS = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
    "optional-dependencies"]


def _names(extra: str) -> set[str]:
    return {req.split("@")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
            for req in EXTRAS[extra]}


def test_passes_that_read_text_data_bring_tokenizers() -> None:
    # gptq / awq calibrate on --data text.txt; kquant's imatrix and every bpw budget measure on it
    for extra in ("gptq", "awq", "kquant", "hqq", "native", "all", "eval", "genai"):
        assert "tokenizers" in _names(extra), extra


def test_hub_extra_brings_the_hub_client() -> None:
    assert _names("hub") == {"huggingface_hub"}
