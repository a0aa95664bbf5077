"""NVIDIA ModelOpt for real, in its own environment, driven from the host's.

ModelOpt's ``[onnx]`` extra would replace the host's onnxruntime with onnxruntime-gpu: `make envs`
builds `.bitpress-envs/modelopt` (`bitpress env create modelopt`) and `make test` points
BITPRESS_TEST_ENVS at it. Without it these tests skip, saying how to build it.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import onnx
import pytest
from onnx import helper

import bitpress
from bitpress.plugins import Registry
from bitpress.synthetic import build_decoder

ENVS = os.environ.get("BITPRESS_TEST_ENVS")
pytestmark = pytest.mark.skipif(
    not ENVS or not (Path(ENVS) / "modelopt" / "env.json").is_file(),
    reason="no ModelOpt environment: run `make envs` (bitpress env create modelopt) and set BITPRESS_TEST_ENVS",
)


@pytest.fixture
def registry(monkeypatch) -> Registry:
    monkeypatch.setenv("BITPRESS_ENVS", str(ENVS))
    return Registry()


def _bits(path: Path) -> collections.Counter[int]:
    return collections.Counter(
        next(helper.get_attribute_value(a) for a in n.attribute if a.name == "bits")
        for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits")


def test_modelopt_passes_run_in_their_environment(registry):
    for name in ("modelopt_int4", "modelopt_int8"):
        cls = registry.passes[name]
        assert cls.unavailable_reason() is None, name
        assert cls.env == "modelopt"  # a proxy: the toolkit is not importable here


def test_olive_style_awq_with_8bit_layers_in_the_environment(registry, tmp_path):
    src = build_decoder(tmp_path / "m.onnx", hidden=128, layers=2, vocab=256, tied=False)
    config = {
        "input": str(src),
        "output": str(tmp_path / "out"),
        "data": {"source": "random", "samples": 4, "seq_len": 16},
        "passes": [
            # Olive's pass name and options (seed: "Mixed Precision Quantization")
            {"type": "NVModelOptQuantization", "algorithm": "awq", "calibration_method": "awq_lite",
             "layers_8bit": "model.layers.0"},
        ],
    }
    result = bitpress.run(config, registry=registry)
    out = tmp_path / "out" / "m.onnx"
    assert out in result.files
    onnx.checker.check_model(str(out))
    assert _bits(out) == {8: 7, 4: 7}  # layer 0 in int8, layer 1 in int4, the LM head float


def test_rtn_runs_without_data_in_the_environment(registry, tmp_path, caplog):
    """The proxy asks the plugin installed here whether this instance reads data (rtn: no), so the workflow neither
    asks for --data nor prepares the model's own text for it."""
    import logging

    src = build_decoder(tmp_path / "m.onnx", hidden=128, layers=1, vocab=256, tied=False)
    config = {"input": str(src), "output": str(tmp_path / "out"),
              "passes": [{"type": "modelopt_int4", "algorithm": "rtn", "block_size": 64}]}
    with caplog.at_level(logging.WARNING, logger="bitpress"):
        bitpress.run(config, registry=registry)
    assert _bits(tmp_path / "out" / "m.onnx") == {4: 7}
    assert "calibrates on text the model writes itself" not in caplog.text
