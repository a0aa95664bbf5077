"""Intel Neural Compressor for real, in its own environment, driven from the host.

onnx-neural-compressor 1.0 declares numpy<2, which the host's environment does not have: `make envs`
builds `.bitpress-envs/inc` (`bitpress env create inc`) and `make test` points BITPRESS_TEST_ENVS
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
    not ENVS or not (Path(ENVS) / "inc" / "env.json").is_file(),
    reason="no Intel Neural Compressor environment: run `make envs` (bitpress env create inc) and set "
           "BITPRESS_TEST_ENVS",
)
DATA = {"source": "random", "samples": 8, "seq_len": 16}


@pytest.fixture
def registry(monkeypatch) -> Registry:
    monkeypatch.setenv("BITPRESS_ENVS", str(ENVS))
    return Registry()


def _error(src: Path, out: Path) -> float:
    feeds = random_inputs(src, batch=2, seq=16, seed=5)
    a = ort.InferenceSession(str(src)).run(None, feeds)[0]
    b = ort.InferenceSession(str(out)).run(None, feeds)[0]
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def test_inc_passes_run_in_their_environment(registry) -> None:
    for name in ("inc", "inc_static", "inc_dynamic", "inc_woq"):
        cls = registry.passes[name]
        assert cls.unavailable_reason() is None, name
        assert cls.env == "inc"  # a proxy: the toolkit is not importable here
    assert registry.find_pass("IncStaticQuantization").name == "inc_static"


def test_workflow_here_and_in_the_inc_environment(registry, tmp_path: Path) -> None:
    src = build_decoder(tmp_path / "m.onnx", hidden=64, layers=2, vocab=256, tied=False)
    config = {
        "input": str(src),
        "output": str(tmp_path / "out"),
        "passes": [
            # here: int4 RTN for the MLP projections
            {"type": "rtn", "precision": "int4", "block_size": 32, "nodes_to_include": ["re:.*/mlp/.*"]},
            # in INC's environment, by Olive's name: dynamic int8 for the remaining float MatMuls
            {"type": "IncDynamicQuantization"},
        ],
    }
    result = bitpress.run(config, registry=registry)
    out = tmp_path / "out" / "m.onnx"
    assert out in result.files
    onnx.checker.check_model(str(out))
    ops = [n.op_type for n in onnx.load(str(out)).graph.node]
    assert ops.count("MatMulNBits") == 6 and "MatMulInteger" in ops and "DynamicQuantizeLinear" in ops
    assert _error(src, out) < 0.2


def test_tuning_report_crosses_the_environment(registry, tmp_path: Path) -> None:
    """The trial table comes back from the worker: in the summary and in --json's reports."""
    src = build_decoder(tmp_path / "m.onnx", hidden=64, layers=1, vocab=256, tied=False)
    out = tmp_path / "q.onnx"
    result = bitpress.quantize(src, out, algorithm="inc", data=DATA, registry=registry,
                               options={"tuning": {"max_trials": 2, "tolerance": 1e-4}})
    (name, _src, report) = result.reports[0]
    assert name == "inc"
    summary = report.summary()
    assert "Intel Neural Compressor 1.0" in summary and "tuning: 2 trial(s), none within tolerance" in summary
    data = json.loads(json.dumps(result.to_json()))["reports"][0]
    assert [t["approach"] for t in data["tuning"]["trials"]] == ["static", "dynamic"]
    assert data["tuning"]["chosen"] == int(np.argmin([t["error"] for t in data["tuning"]["trials"]]))
    assert _error(src, out) < 0.1
