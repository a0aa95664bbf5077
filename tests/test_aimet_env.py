"""Qualcomm AIMET for real, in its own environment, next to a pass that runs here.

aimet-onnx needs torch and keeps torchvision out (it breaks CPU torch): `make envs` builds
`.bitpress-envs/aimet` (`bitpress env create aimet`) and `make test` points BITPRESS_TEST_ENVS
at it. Without it these tests skip, saying how to build it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import bitpress
from bitpress.plugins import Registry
from bitpress.synthetic import build_decoder, random_inputs

ENVS = os.environ.get("BITPRESS_TEST_ENVS")
pytestmark = pytest.mark.skipif(
    not ENVS or not (Path(ENVS) / "aimet" / "env.json").is_file(),
    reason="no AIMET environment: run `make envs` (bitpress env create aimet) and set BITPRESS_TEST_ENVS",
)
DATA = {"source": "random", "samples": 4, "seq_len": 16}


@pytest.fixture
def registry(monkeypatch) -> Registry:
    monkeypatch.setenv("BITPRESS_ENVS", str(ENVS))
    return Registry()


def test_aimet_runs_in_its_environment(registry) -> None:
    cls = registry.passes["aimet"]
    assert cls.unavailable_reason() is None
    assert cls.env == "aimet"  # a proxy: the toolkit is not importable here
    assert "AimetQuantization" in cls.aliases


def test_workflow_aimet_there_then_rtn_here(registry, tmp_path) -> None:
    """AIMET's QDQ for the attention (in its environment), then int4 RTN for the MLP (here)."""
    src = build_decoder(tmp_path / "m.onnx", hidden=64, layers=2, vocab=256, tied=False)
    model = onnx.load(str(src))
    mlp = [n.name for n in model.graph.node if "/mlp/" in n.name and n.op_type == "MatMul"]
    config = {
        "input": str(src),
        "output": str(tmp_path / "out.onnx"),
        "data": DATA,
        "passes": [
            # Olive's pass name (AIMET is not importable here: the registry's aimet is its environment's);
            # the MLP weights stay float for the next pass
            {"type": "AimetQuantization", "precision": "int8", "nodes_to_exclude": mlp},
            {"type": "rtn", "precision": "int4", "block_size": 32, "nodes_to_include": ["re:.*/mlp/.*"]},
        ],
    }
    result = bitpress.run(config, registry=registry)
    out = tmp_path / "out.onnx"
    assert out in result.files
    ops = [n.op_type for n in onnx.load(str(out)).graph.node]
    assert ops.count("MatMulNBits") == len(mlp) == 6  # from RTN, here
    assert ops.count("QuantizeLinear") > 0 and ops.count("DequantizeLinear") > 0  # from AIMET, there
    assert [r[0] for r in result.reports][:1] == ["aimet"] and "AIMET 2.42" in result.reports[0][2].summary()
    assert "RemoteReport" in type(result.reports[0][2]).__name__  # it ran in the environment's worker
    feeds = random_inputs(src)
    a = ort.InferenceSession(str(src)).run(None, feeds)[0]
    b = ort.InferenceSession(str(out)).run(None, feeds)[0]
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.12


def test_encodings_come_back_from_the_environment(registry, tmp_path) -> None:
    src = build_decoder(tmp_path / "m.onnx", hidden=64, layers=1, vocab=256)
    out = tmp_path / "q.onnx"
    result = bitpress.quantize(src, out, algorithm="aimet", data=DATA, registry=registry,
                               options={"precision": "int4", "export_encodings": True})
    assert (tmp_path / "q.encodings") in result.files
    encodings = json.loads((tmp_path / "q.encodings").read_text())
    assert any(e["name"].endswith("q_proj.weight") for e in encodings["param_encodings"])


def test_bad_technique_fails_before_work(registry, tmp_path) -> None:
    src = build_decoder(tmp_path / "m.onnx", hidden=64, layers=1, vocab=256)
    with pytest.raises(bitpress.errors.OptionError, match="unknown technique 'gptq'; valid names: lpbq, seqmse"):
        bitpress.quantize(src, tmp_path / "q.onnx", algorithm="aimet", data=DATA, registry=registry,
                          options={"techniques": [{"name": "gptq"}]})
    assert not (tmp_path / "q.onnx").exists()
