"""Loops over experts (mobius's dense mixture of experts) fused into MoE, then QMoE (issue 31)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import bitpress
from bitpress.errors import UsageError

E, H, INTER, K_TOP = 4, 64, 32, 2


def _loop_model(path: Path, *, normalize: bool = True, seed: int = 0) -> None:
    """x [1, T, H] -> mobius's loop: router Softmax -> TopK (-> Div by the sum), every expert on every token,
    weighted by ReduceSum(w * Cast(Equal(index, i))) and summed by a chain of Adds."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((H, E)).astype(np.float32), "router.weight"),
             numpy_helper.from_array(np.array([K_TOP], np.int64), "k"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    nodes = [helper.make_node("MatMul", ["x", "router.weight"], ["logits"], name="/model/layers.0/mlp/router/MatMul"),
             helper.make_node("Softmax", ["logits"], ["probs"], name="/model/layers.0/mlp/Softmax", axis=-1),
             helper.make_node("TopK", ["probs", "k"], ["top", "index"], name="/model/layers.0/mlp/TopK", axis=-1)]
    w = "top"
    if normalize:
        nodes += [helper.make_node("ReduceSum", ["top", "axes"], ["total"], name="/model/layers.0/mlp/ReduceSum",
                                   keepdims=1),
                  helper.make_node("Div", ["top", "total"], ["w"], name="/model/layers.0/mlp/Div")]
        w = "w"
    acc = None
    for i in range(E):
        s = f"/model/layers.0/mlp/experts.{i}"
        for nm, shape, fan in (("gate", (H, INTER), H), ("up", (H, INTER), H), ("down", (INTER, H), INTER)):
            inits.append(numpy_helper.from_array((rng.standard_normal(shape) / fan**0.5).astype(np.float32),
                                                 f"experts.{i}.{nm}.weight"))
        inits.append(numpy_helper.from_array(np.array(i, np.int64), f"expert_index_{i}"))
        nodes += [
            helper.make_node("MatMul", ["x", f"experts.{i}.gate.weight"], [f"{s}/g"], name=f"{s}/gate/MatMul"),
            helper.make_node("MatMul", ["x", f"experts.{i}.up.weight"], [f"{s}/u"], name=f"{s}/up/MatMul"),
            helper.make_node("Sigmoid", [f"{s}/g"], [f"{s}/sg"], name=f"{s}/Sigmoid"),
            helper.make_node("Mul", [f"{s}/g", f"{s}/sg"], [f"{s}/a"], name=f"{s}/Mul_act"),
            helper.make_node("Mul", [f"{s}/a", f"{s}/u"], [f"{s}/h"], name=f"{s}/Mul_up"),
            helper.make_node("MatMul", [f"{s}/h", f"experts.{i}.down.weight"], [f"{s}/y"], name=f"{s}/down/MatMul"),
            helper.make_node("Equal", ["index", f"expert_index_{i}"], [f"{s}/eq"], name=f"{s}/Equal"),
            helper.make_node("Cast", [f"{s}/eq"], [f"{s}/mask"], name=f"{s}/Cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", [w, f"{s}/mask"], [f"{s}/wm"], name=f"{s}/Mul_mask"),
            helper.make_node("ReduceSum", [f"{s}/wm", "axes"], [f"{s}/r"], name=f"{s}/ReduceSum", keepdims=1),
            helper.make_node("Mul", [f"{s}/y", f"{s}/r"], [f"{s}/c"], name=f"{s}/Mul_weight"),
        ]
        if acc is None:
            acc = f"{s}/c"
        else:
            out = "y" if i == E - 1 else f"/model/layers.0/mlp/sum{i}"
            nodes.append(helper.make_node("Add", [acc, f"{s}/c"], [out], name=f"/model/layers.0/mlp/Add_{i}"))
            acc = out
    g = helper.make_graph(nodes, "loop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, H])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, H])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_a_loop_becomes_one_moe_node_with_the_same_outputs(tmp_path: Path) -> None:
    src, out = tmp_path / "loop.onnx", tmp_path / "fused.onnx"
    _loop_model(src)
    res = bitpress.run({"input": str(src), "output": str(out), "passes": [{"type": "fuse_experts"}]})
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert ops.count("MoE") == 1 and "TopK" not in ops and "Equal" not in ops and ops.count("MatMul") == 1
    assert any("1 loop(s) over experts fused" in n for n in res.notes)
    x = np.random.default_rng(1).standard_normal((1, 11, H)).astype(np.float32)
    want = _run(src, x)
    assert np.abs(_run(out, x) - want).max() <= 1e-5 * np.abs(want).max()


def test_fused_then_quantized_is_qmoe_with_the_integers_matmulnbits_would_hold(tmp_path: Path) -> None:
    src, out, per_expert = tmp_path / "loop.onnx", tmp_path / "q.onnx", tmp_path / "per_expert.onnx"
    _loop_model(src)
    rtn = {"type": "rtn", "block_size": 32, "is_symmetric": False, "accuracy_level": 0}
    bitpress.run({"input": str(src), "output": str(out), "passes": [{"type": "fuse_experts"}, rtn]})
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert ops.count("QMoE") == 1 and "MatMulNBits" not in ops  # the router stays float
    # the loop quantized as it is: each expert MatMul as MatMulNBits, the same blocks (rows of fc1 = columns of B)
    bitpress.run({"input": str(src), "output": str(per_expert),
                  "passes": [{**rtn, "nodes_to_exclude": ["/model/layers.0/mlp/router/MatMul"]}]})
    assert [n.op_type for n in onnx.load(per_expert).graph.node].count("MatMulNBits") == 3 * E
    x = np.random.default_rng(2).standard_normal((1, 9, H)).astype(np.float32)
    got, loop_q, want = _run(out, x), _run(per_expert, x), _run(src, x)
    assert np.linalg.norm(got - loop_q) / np.linalg.norm(loop_q) < 1e-5  # float32 compute: summation order only
    assert 0 < np.linalg.norm(got - want) / np.linalg.norm(want) < 0.2


def test_the_plan_of_a_loop_graph_points_at_fuse_experts(tmp_path: Path) -> None:
    from bitpress.workflow.plan import plan_lines, plan_run

    src = tmp_path / "loop.onnx"
    _loop_model(src)
    text = "\n".join(plan_lines(plan_run({"input": str(src), "output": str(tmp_path / "o.onnx"),
                                          "passes": [{"type": "rtn"}]})))
    assert "fuse_experts" in text and "1 loop(s) over experts" in text


def test_an_unnormalized_routing_is_left_as_it_is_with_the_reason(tmp_path: Path) -> None:
    src = tmp_path / "loop.onnx"
    _loop_model(src, normalize=False)
    with pytest.raises(UsageError, match=r"not renormalized.*router_weights"):
        bitpress.run({"input": str(src), "output": str(tmp_path / "o.onnx"), "passes": [{"type": "fuse_experts"}]})
    assert not (tmp_path / "o.onnx").exists()
