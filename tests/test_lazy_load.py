"""Single-file models are parsed without their weights (protobuf wire-level walk)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from bitpress.errors import ModelLoadError
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.lazy_load import LAZY_THRESHOLD
from bitpress.onnx.tensors import is_external
from bitpress.synthetic import build_decoder


def test_weights_stay_in_the_file_and_read_back_equal(tmp_path):
    path = build_decoder(tmp_path / "m.onnx", hidden=128, layers=2, vocab=1024, tied=False)
    model = OnnxModel.load(path)
    assert model.proto.ByteSize() < path.stat().st_size / 20  # the handle holds the graph, not the weights
    reference = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    lazy = [t for t in model.graph.initializer if is_external(t)]
    assert lazy and all(len(t.raw_data) == 0 for t in lazy)
    for t in model.graph.initializer:
        np.testing.assert_array_equal(np.asarray(model.array(t)), reference[t.name])
        if reference[t.name].nbytes >= LAZY_THRESHOLD:
            assert is_external(t), t.name
    # every non-weight field survives the rewrite
    full = onnx.load(str(path))
    assert [n.SerializeToString() for n in model.graph.node] == [n.SerializeToString() for n in full.graph.node]
    assert model.proto.opset_import == full.opset_import


@pytest.mark.parametrize("cut", [0.5, 0.9, 0.999])
def test_truncated_single_file_is_refused(tmp_path, cut):
    path = build_decoder(tmp_path / "m.onnx", hidden=64, layers=1, vocab=256)
    data = path.read_bytes()
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(ModelLoadError, match="not a valid ONNX model"):
        OnnxModel.load(bad)
