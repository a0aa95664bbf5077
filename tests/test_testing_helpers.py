"""bitpress.testing, the helpers the plugins' tests share: each on a small model whose answer is known."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bitpress import testing


def _save(path: Path, nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], outputs: list[str],
          domains: tuple[str, ...] = ()) -> Path:
    """A graph of input ``x`` [batch, seq, 4] (float) and float outputs ``outputs``."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    opsets = [helper.make_opsetid("", 21), *(helper.make_opsetid(d, 1) for d in domains)]
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=10), str(path))
    return path


def _linear(path: Path, w_scale: float, z_scale: float, log: bool = False) -> Path:
    """``y = x @ (w * w_scale)``, ``z = x * z_scale`` (or ``log(-|x|)``, NaN, with ``log``)."""
    w = (np.arange(16, dtype=np.float32).reshape(4, 4) - 7.5) / 8
    inits = [numpy_helper.from_array(w * w_scale, "w"), numpy_helper.from_array(np.float32(z_scale), "s")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    if log:
        nodes += [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["n"]),
                  helper.make_node("Log", ["n"], ["z"])]
    else:
        nodes.append(helper.make_node("Mul", ["x", "s"], ["z"]))
    return _save(path, nodes, inits, ["y", "z"])


def _quantized(path: Path) -> Path:
    """QDQ weights (int8 [40, 40] per tensor, uint8 [4] per channel) and a quantized activation, a
    MatMulNBits node (not run) and a Conv whose weight is dequantized too."""
    w8 = np.arange(1600, dtype=np.int64).reshape(40, 40) % 200 - 100
    w8[3, 5] = -128
    inits = [
        numpy_helper.from_array(w8.astype(np.int8), "w8"), numpy_helper.from_array(np.float32(0.5), "w8_scale"),
        numpy_helper.from_array(np.int8(0), "w8_zp"),
        numpy_helper.from_array(np.full(4, 7, np.uint8), "wu8"),
        numpy_helper.from_array(np.full(4, 0.25, np.float32), "wu8_scale"),
        numpy_helper.from_array(np.full(4, 3, np.uint8), "wu8_zp"),
        numpy_helper.from_array(np.array([0.125], np.float32), "x_scale"),
        numpy_helper.from_array(np.uint8(128), "x_zp"),
        numpy_helper.from_array(np.zeros((4, 1, 8), np.uint8), "q4"),
        numpy_helper.from_array(np.ones(4, np.float32), "q4_scales"),
        numpy_helper.from_array(np.zeros(2, np.int8), "small_int8"),  # under 1000 values: not a weight
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["w8", "w8_scale", "w8_zp"], ["w8_f"], name="dq_w8"),
        helper.make_node("MatMul", ["h", "w8_f"], ["y1"], name="mm"),
        helper.make_node("DequantizeLinear", ["wu8", "wu8_scale", "wu8_zp"], ["wu8_f"], name="dq_wu8", axis=0),
        helper.make_node("Conv", ["img", "wu8_f"], ["y2"], name="conv"),
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"], name="q_x"),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["x_dq"], name="dq_x"),
        helper.make_node("MatMulNBits", ["x_dq", "q4", "q4_scales"], ["y3"], name="nbits", domain="com.microsoft",
                         K=8, N=4, bits=4, block_size=32),
    ]
    return _save(path, nodes, inits, ["y1", "y2", "y3"], domains=("com.microsoft",))


def test_graph_helpers(tmp_path: Path) -> None:
    path = _quantized(tmp_path / "q.onnx")
    proto = onnx.load(str(path))
    assert testing.load_proto(proto) is proto and testing.load_proto(path) == proto
    assert testing.op_counts(path) == {"DequantizeLinear": 3, "MatMul": 1, "Conv": 1, "QuantizeLinear": 1,
                                       "MatMulNBits": 1}
    assert testing.op_counts(proto) == testing.op_counts(str(path))
    inits = testing.initializers(path)
    assert inits["w8"].dtype == np.int8 and inits["w8"].shape == (40, 40) and len(inits) == 11
    assert testing.initializer_protos(path)["wu8"].data_type == TensorProto.UINT8
    (nbits,) = testing.matmul_nbits_nodes(path)
    assert nbits.name == "nbits"
    assert testing.attrs(nbits) == {"K": 8, "N": 4, "bits": 4, "block_size": 32}
    assert testing.attrs(nbits).get("accuracy_level") is None
    assert list(testing.int8_weights(path)) == ["w8"]  # the others have under 1000 values
    assert list(testing.int8_weights(path, min_size=4)) == ["w8", "wu8", "wu8_zp", "q4"]
    assert testing.max_abs_int8_weight(path) == 128


def test_scales_and_zero_points(tmp_path: Path) -> None:
    path = _quantized(tmp_path / "q.onnx")
    assert testing.activation_scales(path) == {"x": 0.125}
    assert testing.zero_point_types(path) == ({np.dtype(np.int8), np.dtype(np.uint8)}, {np.dtype(np.uint8)})
    (mm,) = testing.weight_scales(path)
    assert mm.shape == () and float(mm) == 0.5
    both = testing.weight_scales(path, ("MatMul", "Conv"))
    assert [s.size for s in both] == [1, 4]
    # a per-channel activation scale is not what activation_scales reads
    proto = onnx.load(str(path))
    for t in proto.graph.initializer:
        if t.name == "x_scale":
            t.CopyFrom(numpy_helper.from_array(np.array([0.125, 0.5], np.float32), "x_scale"))
    with pytest.raises(ValueError, match="not per tensor"):
        testing.activation_scales(proto)


def test_max_abs_int8_weight_needs_int8_weights(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="no int8 weights"):
        testing.max_abs_int8_weight(_linear(tmp_path / "f.onnx", 1.0, 2.0))


def test_assert_plain_onnx(tmp_path: Path) -> None:
    testing.assert_plain_onnx(_quantized(tmp_path / "q.onnx"))  # com.microsoft, declared
    custom = onnx.load(str(tmp_path / "q.onnx"))
    custom.graph.node[0].domain = "com.amd.quark"
    custom.opset_import.append(helper.make_opsetid("com.amd.quark", 1))
    with pytest.raises(AssertionError, match=r"com\.amd\.quark"):
        testing.assert_plain_onnx(custom)
    undeclared = onnx.load(str(tmp_path / "q.onnx"))
    del undeclared.opset_import[1:]
    with pytest.raises(AssertionError, match="not declared"):
        testing.assert_plain_onnx(undeclared)
    unused = onnx.load(str(tmp_path / "q.onnx"))
    unused.opset_import.append(helper.make_opsetid("ai.onnx.ml", 3))
    with pytest.raises(AssertionError, match="unused opset imports"):
        testing.assert_plain_onnx(unused)


def test_relative_error() -> None:
    ref = np.array([[3.0, 0.0], [0.0, 4.0]])
    assert testing.relative_error(ref, ref) == 0.0
    assert testing.relative_error(ref, ref * 1.5) == pytest.approx(0.5)
    assert testing.relative_error(ref, np.zeros_like(ref)) == pytest.approx(1.0)


def test_output_error(tmp_path: Path) -> None:
    src = _linear(tmp_path / "src.onnx", 1.0, 2.0)
    out = _linear(tmp_path / "out.onnx", 1.1, 3.0)  # y off by 10 %, z by 50 %
    assert testing.output_error(src, src) == 0.0
    assert testing.output_error(src, out) == pytest.approx(0.1, rel=1e-5)  # the first output only
    assert testing.output_error(src, out, every_output=True) == pytest.approx(0.5, rel=1e-5)
    assert testing.output_error(src, out, exact_qdq=True, seeds=(5,)) == pytest.approx(0.1, rel=1e-5)
    feeds = testing.random_feeds(src, 123)
    assert feeds["x"].shape == (2, 16, 4)
    np.testing.assert_array_equal(testing.random_feeds(src, 123)["x"], feeds["x"])
    _, z = testing.ort_outputs(src, feeds)
    np.testing.assert_allclose(z, 2 * feeds["x"], rtol=1e-6)
    nan = _linear(tmp_path / "nan.onnx", 1.0, 2.0, log=True)
    assert testing.output_error(src, nan) == 0.0  # z is not compared ...
    with pytest.raises(AssertionError, match="non-finite"):
        testing.output_error(src, nan, finite=True)  # ... but every output must be finite
    one = _save(tmp_path / "one.onnx", [helper.make_node("Identity", ["x"], ["y"])], [], ["y"])
    with pytest.raises(AssertionError):
        testing.output_error(src, one, every_output=True)  # an output missing


def test_session_is_quiet_and_on_cpu(tmp_path: Path) -> None:
    sess = testing.session(_linear(tmp_path / "m.onnx", 1.0, 2.0), exact_qdq=True)
    assert sess.get_providers() == ["CPUExecutionProvider"]
    assert [o.name for o in sess.get_outputs()] == ["y", "z"]


def test_run_python() -> None:
    proc = testing.run_python("import sys; print(sys.argv[1:]); print('to stderr', file=sys.stderr)", "a", "b",
                              timeout=60)
    assert proc.stdout.strip() == "['a', 'b']" and "to stderr" in proc.stderr
    assert testing.run_python("import os; print(os.environ['X_T'])", timeout=60,
                              env={**os.environ, "X_T": "here"}).stdout.strip() == "here"
    with pytest.raises(AssertionError, match="boom"):
        testing.run_python("raise SystemExit('boom')", timeout=60)
    with pytest.raises(subprocess.TimeoutExpired):
        testing.run_python("import time; time.sleep(10)", timeout=0.5)


def test_restored_logger() -> None:
    logger = logging.getLogger("bitpress.testing.check")
    logger.setLevel(logging.WARNING)
    before = list(logger.handlers)
    with testing.restored_logger("bitpress.testing.check") as got:
        assert got is logger
        got.addHandler(logging.NullHandler())
        got.setLevel(logging.DEBUG)
        got.propagate = False
    assert logger.handlers == before and logger.level == logging.WARNING and logger.propagate is True
    with pytest.raises(RuntimeError), testing.restored_logger("bitpress.testing.check"):
        logger.propagate = False
        raise RuntimeError
    assert logger.propagate is True


def test_process_state_sees_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    before = testing.process_state()
    assert testing.process_state() == before
    monkeypatch.setenv("BITPRESS_TESTING_CHECK", "1")
    monkeypatch.setattr(sys, "path", [*sys.path, "/nowhere"])
    after = testing.process_state()
    assert [k for k in before if before[k] != after[k]] == ["environ", "sys_path"]


def test_unavailable_registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    registry = testing.unavailable_registry("rtn", monkeypatch, tmp_path)
    assert os.environ["BITPRESS_ENVS"] == str(tmp_path / "no-envs")
    assert "rtn" in registry.passes
    with pytest.raises(pytest.fail.Exception, match="bitpress-nosuch is not installed"):
        testing.unavailable_registry("nosuch", monkeypatch, tmp_path)


def test_assert_plugin_loaded() -> None:
    listing = "plugin  version  status\nquark   0.1.0    ok\nbroken  0.1.0    error: boom\n"
    testing.assert_plugin_loaded(listing, "quark")
    for name in ("broken", "quar", "aimet"):
        with pytest.raises(AssertionError):
            testing.assert_plugin_loaded(listing, name)


def test_import_is_light() -> None:
    """No toolkit, torch, pytest or ONNX Runtime at import: importable in every plugin environment."""
    code = ("import sys, bitpress.testing; "
            "print([m for m in ('torch', 'pytest', 'onnxruntime', 'quark', 'aimet_onnx', 'modelopt', "
            "'onnx_neural_compressor') if m in sys.modules])")
    assert testing.run_python(code, timeout=120).stdout.strip() == "[]"
