"""Olive's QuarkQuantization on a Hugging Face checkpoint: Quark's PyTorch path in its own environment, the
checkpoint crossing as a folder, then ``bitpress export`` to a GenAI package here with Quark's integers kept.

Needs the Quark environment (`make envs`; BITPRESS_TEST_ENVS points at it, as tests/test_quark_env.py). The
checks inside the environment (bitpress's blocks against Quark's own quantized weights, the refusals' evidence)
are in tests/plugins/test_quark.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_genai_export import _assert_same_integers, _logits_og, _logits_torch, _run, tiny

import bitpress
from bitpress.plugins import Registry

__all__ = ["tiny"]  # a fixture used here

ENVS = os.environ.get("BITPRESS_TEST_ENVS")
pytestmark = pytest.mark.skipif(
    not ENVS or not (Path(ENVS) / "quark" / "env.json").is_file(),
    reason="no Quark environment: run `make envs` (bitpress env create quark) and set BITPRESS_TEST_ENVS",
)
pytest.importorskip("onnxruntime_genai")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    monkeypatch.setenv("BITPRESS_ENVS", str(ENVS))
    return Registry()


def test_olive_quark_quantization_on_a_checkpoint_exports_with_quarks_integers(
        tiny: dict[str, Path], tmp_path: Path, registry: Registry) -> None:
    """The seed's Hugging Face example (uint4 group 64 here: the test model is 64 wide), AWQ on the run's data in
    Quark's environment; the checkpoint comes back as bitpress's, and the GenAI package holds exactly its integers,
    scales and zero points and computes the quantized PyTorch model's logits."""
    out = tmp_path / "ckpt"
    bitpress.run({
        "input": str(tiny["untied"]), "output": str(out), "data": {"source": "random", "samples": 16, "seq_len": 64},
        "passes": [{"type": "QuarkQuantization", "quant_scheme": "uint4_wo_64", "quant_algo": "awq",
                    "dataset": "pileval_for_awq_benchmark", "model_export": ["hf_format"]}],
    }, registry=registry)
    ckpt = out / tiny["untied"].name
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert [h["pass"] for h in qc["passes"]] == ["quark_hf"]
    linears = {k: v for k, v in qc["modules"].items() if k.startswith("model.layers.")}
    assert len(linears) == 14 and all(v["bits"] == 4 and v["group_size"] == 64 and not v["symmetric"]
                                      for v in linears.values())
    assert "lm_head.weight" not in qc["modules"]  # Quark's template leaves the head in float
    package = _run([{"type": "hf_to_genai", "exporter": "builder", "accuracy_level": 1}], ckpt, tmp_path / "pkg")
    assert _assert_same_integers(ckpt, package) == 2 * 5  # q/k/v fused by the builder: 5 MatMulNBits a layer
    prompt = [5, 17, 42, 9]
    np.testing.assert_allclose(_logits_og(package, prompt), _logits_torch(ckpt, prompt), atol=2e-4, rtol=1e-4)


def test_quark_hf_refusals_reach_the_user_in_one_line(tiny: dict[str, Path], tmp_path: Path,
                                                      registry: Registry) -> None:
    """A tied table with Quark's rotation (which would untie it) is refused in the environment before any work;
    nothing is written."""
    with pytest.raises(bitpress.BitpressError if hasattr(bitpress, "BitpressError") else Exception,
                       match="unties a tied table"):
        bitpress.run({"input": str(tiny["tied"]), "output": str(tmp_path / "o"),
                      "passes": [{"type": "quark_hf", "quant_algo": "rotation", "quant_scheme": "int4_wo_64"}]},
                     registry=registry)
    assert not (tmp_path / "o").exists()
