"""What the fuzzer found, each kept as a plain test: one error line, the input unchanged, nothing written.

* an attribute whose type was lost (or is unknown, or names another field than the one set) reached
  the weight-only planner as ``None`` / a scalar: ``TypeError`` (an internal error);
* a standard node with too few outputs (or inputs) was indexed by the writer: ``IndexError``;
* ONNX Runtime printed its own log line of a failed session on stderr beside bitpress's error line;
* huge finite weights (bit flips in float data) overflowed the float32 error sums: numpy printed a
  ``RuntimeWarning`` on stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from onnx import helper

from bitpress import synthetic

MODEL = {"hidden": 32, "layers": 1, "heads": 2, "vocab": 64}


def _node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def _untyped(model: onnx.ModelProto) -> None:
    _node(model, "/model/layers.0/self_attn/Transpose_3").attribute[0].ClearField("type")


def _int_holding_ints(model: onnx.ModelProto) -> None:
    _node(model, "/model/layers.0/self_attn/Transpose_3").attribute[0].type = onnx.AttributeProto.INT


def _no_output(model: onnx.ModelProto) -> None:
    del _node(model, "/model/layers.0/mlp/up_proj/MatMul").output[:]


def _one_input(model: onnx.ModelProto) -> None:
    del _node(model, "/model/layers.0/mlp/up_proj/MatMul").input[1:]


def _in_a_subgraph(model: onnx.ModelProto) -> None:
    body = helper.make_graph([helper.make_node("Transpose", ["x"], ["y"], name="inner")], "body", [],
                             [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    body.node[0].attribute.add().name = "perm"  # no type
    cond = helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])
    model.graph.node.append(helper.make_node("If", ["c"], ["z"], name="if", then_branch=body, else_branch=body))
    model.graph.input.append(cond)


@pytest.mark.parametrize(("edit", "message"), [
    (_untyped, "node '/model/layers.0/self_attn/Transpose_3' (Transpose): attribute 'perm' has no known type (0)"),
    (_int_holding_ints, "attribute 'perm' is of type INT but holds ints"),
    (_no_output, "node '/model/layers.0/mlp/up_proj/MatMul' (MatMul) has 2 inputs and 0 outputs; MatMul (opset"),
    (_one_input, "(MatMul) has 1 inputs and 1 outputs; MatMul (opset 21) takes 2 inputs and 1 outputs"),
    (_in_a_subgraph, "node 'inner' (Transpose): attribute 'perm' has no known type"),
])
@pytest.mark.parametrize("external", [False, True])
def test_malformed_nodes_give_one_error_line(
    tmp_path: Path, run_cli: Callable[..., tuple[int, str, str]], sha256_tree: Callable[[Path], dict[str, str]],
    edit: Callable[[onnx.ModelProto], None], message: str, external: bool,
) -> None:
    path = synthetic.build_decoder(tmp_path / "in" / "model.onnx", external_data=external, **MODEL)
    model = onnx.load(path, load_external_data=False)
    edit(model)
    path.write_bytes(model.SerializeToString())
    before = sha256_tree(tmp_path)
    code, out, err = run_cli("quantize", "-m", path, "-o", tmp_path / "out" / "model.onnx", "--algorithm", "rtn")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("bitpress: error: ") and "is not a valid ONNX model" in lines[0], err
    assert message in lines[0]
    assert out == "" and not (tmp_path / "out").exists() and sha256_tree(tmp_path) == before


def test_onnx_runtime_does_not_print_a_second_error_line(tmp_path: Path) -> None:
    """An output ONNX Runtime refuses (a Transpose perm out of range): one line, from bitpress only."""
    path = synthetic.build_decoder(tmp_path / "in" / "model.onnx", **MODEL)
    model = onnx.load(path)
    perm = _node(model, "/model/layers.0/self_attn/Transpose_3").attribute[0]
    perm.ints[:] = [2, 0]  # caught when the kernel is built, not by shape inference
    path.write_bytes(model.SerializeToString())
    proc = subprocess.run(
        [sys.executable, "-m", "bitpress", "quantize", "-m", str(path), "-o", str(tmp_path / "out" / "model.onnx"),
         "--algorithm", "rtn"], capture_output=True, text=True, timeout=300, env={**os.environ, "NO_COLOR": "1"},
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("bitpress: error: ") and "ONNX Runtime" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [1e20, 3e38])
def test_huge_finite_weights_print_no_numpy_warning(
    tmp_path: Path, run_cli: Callable[..., tuple[int, str, str]], value: float,
) -> None:
    """Bit flips in weights give huge finite floats: the error sums overflowed float32 and numpy
    printed a RuntimeWarning on stderr beside the result (now summed in float64, no warning)."""
    import warnings

    import numpy as np
    from onnx import numpy_helper

    path = synthetic.build_decoder(tmp_path / "in" / "model.onnx", **MODEL)
    model = onnx.load(path)
    for i, t in enumerate(model.graph.initializer):
        if t.name == "model.layers.0.mlp.up_proj.weight":
            w = numpy_helper.to_array(t).copy()
            w[0, :4] = value
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(w, t.name))
    path.write_bytes(model.SerializeToString())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        code, _, err = run_cli("quantize", "-m", path, "-o", tmp_path / "out" / "model.onnx", "--algorithm", "rtn",
                               "--json")
    assert code == 0, err
    assert "Warning" not in err and np.isfinite(value)
