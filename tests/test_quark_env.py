"""AMD Quark for real, in its own environment, next to a pass that runs here.

Quark pins onnx<=1.22.0, which the host's environment does not have: `make envs` builds
`.bitpress-envs/quark` (`bitpress env create quark`) and `make test` points BITPRESS_TEST_ENVS
at it. Without it these tests skip, saying how to build it.
"""

from __future__ import annotations

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
    not ENVS or not (Path(ENVS) / "quark" / "env.json").is_file(),
    reason="no Quark environment: run `make envs` (bitpress env create quark) and set BITPRESS_TEST_ENVS",
)


@pytest.fixture
def registry(monkeypatch) -> Registry:
    monkeypatch.setenv("BITPRESS_ENVS", str(ENVS))
    return Registry()


def test_quark_passes_run_in_their_environment(registry):
    for name in ("quark_static", "quark_dynamic", "quark_int4"):
        cls = registry.passes[name]
        assert cls.unavailable_reason() is None, name
        assert cls.env == "quark"  # a proxy: the toolkit is not importable here


def test_two_pass_workflow_here_and_in_the_quark_environment(registry, tmp_path):
    src = build_decoder(tmp_path / "m.onnx", hidden=64, layers=2, vocab=256, tied=False)
    config = {
        "input": str(src),
        "output": str(tmp_path / "out"),
        "passes": [
            # here: int4 RTN for the MLP projections
            {"type": "rtn", "precision": "int4", "block_size": 32, "nodes_to_include": ["re:.*/mlp/.*"]},
            # in Quark's environment: dynamic int8 for the remaining float MatMuls
            {"type": "quark_dynamic", "env": "quark"},
        ],
    }
    result = bitpress.run(config, registry=registry)
    out = tmp_path / "out" / "m.onnx"
    assert out in result.files
    onnx.checker.check_model(str(out))
    ops = [n.op_type for n in onnx.load(str(out)).graph.node]
    assert ops.count("MatMulNBits") == 6  # gate/up/down of two layers, from the pass run here
    assert "MatMulInteger" in ops and "DynamicQuantizeLinear" in ops  # from Quark
    feeds = random_inputs(src)
    a = ort.InferenceSession(str(src)).run(None, feeds)[0]
    b = ort.InferenceSession(str(out)).run(None, feeds)[0]
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.2
    assert not list(tmp_path.glob("quantized_info.csv")) and not Path("quantized_info.csv").exists()


def test_quark_static_int8_with_calibration_data(registry, tmp_path):
    src = build_decoder(tmp_path / "m.onnx", hidden=64, layers=1, vocab=256, tied=False)
    out = tmp_path / "q.onnx"
    bitpress.quantize(src, out, algorithm="quark_static", precision="int8", data={"source": "random", "samples": 4,
                      "seq_len": 16}, registry=registry)
    ops = [n.op_type for n in onnx.load(str(out)).graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    feeds = random_inputs(src)
    a = ort.InferenceSession(str(src)).run(None, feeds)[0]
    b = ort.InferenceSession(str(out)).run(None, feeds)[0]
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.1
