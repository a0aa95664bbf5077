"""com.microsoft.MoE -> QMoE (issue 31): experts quantized per expert and block, in the CPU kernel's layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import bitpress
from bitpress.onnx import layout
from bitpress.plugins import get_registry

E, H, INTER, K_TOP = 4, 64, 32, 2


def _moe_model(
    path: Path,
    *,
    fusion: int = 1,
    act: str = "swiglu",
    bias: bool = False,
    alpha: float = 1.0,
    beta: float = 0.0,
    limit: float | None = None,
    dtype: type = np.float32,
    seed: int = 0,
    hidden: int = H,
    inter: int = INTER,
    experts: int = E,
) -> dict[str, np.ndarray]:
    """x [T, hidden] -> router MatMul -> MoE -> y; returns the float weights by role."""
    rng = np.random.default_rng(seed)
    swiglu = act == "swiglu"
    n1 = 2 * inter if swiglu and fusion else inter
    w = {
        "fc1": rng.standard_normal((experts, n1, hidden)) / hidden**0.5,
        "fc2": rng.standard_normal((experts, hidden, inter)) / inter**0.5,
        "router": rng.standard_normal((hidden, experts)),
    }
    if swiglu and fusion == 0:
        w["fc3"] = rng.standard_normal((experts, inter, hidden)) / hidden**0.5
    if bias:
        w["fc1_b"] = rng.standard_normal((experts, n1)) * 0.1
        w["fc2_b"] = rng.standard_normal((experts, hidden)) * 0.1
        if "fc3" in w:
            w["fc3_b"] = rng.standard_normal((experts, inter)) * 0.1
    w = {k: v.astype(dtype) for k, v in w.items()}
    inputs = ["x", "probs", "fc1", "fc1_b" if bias else "", "fc2", "fc2_b" if bias else ""]
    if "fc3" in w:
        inputs += ["fc3", "fc3_b" if bias else ""]
    while not inputs[-1]:
        inputs.pop()
    attrs = {"k": K_TOP, "activation_type": act, "normalize_routing_weights": 1}
    if swiglu:
        attrs.update(swiglu_fusion=fusion, activation_alpha=alpha, activation_beta=beta)
        if limit is not None:
            attrs["swiglu_limit"] = limit
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node("MatMul", ["x", "router"], ["probs"], name="router"),
        helper.make_node("MoE", inputs, ["y"], name="/layers.0/moe", domain="com.microsoft", **attrs),
    ]
    g = helper.make_graph(
        nodes,
        "moe",
        [helper.make_tensor_value_info("x", t, [None, hidden])],
        [helper.make_tensor_value_info("y", t, [None, hidden])],
        [numpy_helper.from_array(v, k) for k, v in w.items()],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(m, path)
    return w


def _reference(
    x: np.ndarray,
    w: dict[str, np.ndarray],
    *,
    fusion: int = 1,
    act: str = "swiglu",
    alpha: float = 1.0,
    beta: float = 0.0,
    limit: float | None = None,
) -> np.ndarray:
    """ONNX Runtime's MoE in numpy (float64): softmax routing, top-k, renormalized, experts summed."""
    x = x.astype(np.float64)
    logits = x @ w["router"].astype(np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(len(x)):
        top = np.argsort(-p[t], kind="stable")[:K_TOP]
        wts = p[t, top] / p[t, top].sum()
        for e, wt in zip(top, wts, strict=True):
            h = w["fc1"][e].astype(np.float64) @ x[t] + (w["fc1_b"][e] if "fc1_b" in w else 0)
            if act == "swiglu":
                if fusion == 1:
                    g, lin = h[0::2], h[1::2]
                elif fusion == 2:
                    g, lin = np.split(h, 2)
                else:
                    g, lin = h, w["fc3"][e].astype(np.float64) @ x[t] + (w["fc3_b"][e] if "fc3_b" in w else 0)
                if limit is not None:
                    g, lin = np.minimum(g, limit), np.clip(lin, -limit, limit)
                a = g / (1 + np.exp(-alpha * g)) * (lin + beta)
            elif act == "relu":
                a = np.maximum(h, 0)
            else:
                a = h / (1 + np.exp(-h))
            out[t] += wt * (w["fc2"][e].astype(np.float64) @ a + (w["fc2_b"][e] if "fc2_b" in w else 0))
    return out


def _qmoe(model: onnx.ModelProto) -> onnx.NodeProto:
    nodes = [n for n in model.graph.node if n.op_type == "QMoE"]
    assert len(nodes) == 1 and not [n for n in model.graph.node if n.op_type == "MoE"]
    return nodes[0]


def _expert_weights(path: Path, node: onnx.NodeProto) -> dict[str, np.ndarray]:
    """The QMoE node's experts dequantized, [E, N, K] float32, keyed fc1 / fc2 (bitpress's own reading)."""
    from bitpress.onnx.weightonly.qmoe import Expert3D, dequantized

    m = onnx.load(path)
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    bits, bs = attrs["expert_weight_bits"], attrs["block_size"]
    out = {}
    for role, (wi, si, zi) in {"fc1": (2, 3, 11), "fc2": (5, 6, 12)}.items():
        zp_name = node.input[zi] if len(node.input) > zi else ""
        scales = inits[node.input[si]]
        zps = None
        if zp_name:
            zps = layout.unpack_along_last(inits[zp_name], bits, scales.shape[-1])
        out[role] = dequantized(Expert3D(inits[node.input[wi]], scales, zps), bits, bs)
    return out


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def _solver(name: str, bits: int, block: int, sym: bool):
    cls = get_registry().get_pass(name)
    inst = cls.from_config({"bits": bits, "block_size": block, "is_symmetric": sym}, strict=True)
    return inst.solver()


def _as_float(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float32) for k, v in w.items()}


@pytest.mark.parametrize("bits, sym", [(4, False), (4, True), (8, False)])
def test_rtn_experts_are_qmoe_and_decode_to_the_solvers_integers(tmp_path: Path, bits: int, sym: bool) -> None:
    src = tmp_path / "moe.onnx"
    w = _moe_model(src)
    out = tmp_path / "q.onnx"
    bitpress.run(
        {
            "input": str(src),
            "output": str(out),
            "passes": [
                {
                    "type": "rtn",
                    "bits": bits,
                    "block_size": 16,
                    "is_symmetric": sym,
                    "accuracy_level": 0,
                    "nodes_to_exclude": ["router"],
                }
            ],
        }
    )
    node = _qmoe(onnx.load(out))
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["expert_weight_bits"] == bits and attrs["block_size"] == 16 and attrs["swiglu_fusion"] == 1
    assert attrs["k"] == K_TOP and attrs["normalize_routing_weights"] == 1
    got = _expert_weights(out, node)
    solve = _solver("rtn", bits, 16, sym)
    from bitpress.quant.solver import BlockSpec, dequantize

    for role in ("fc1", "fc2"):
        e, n, k = w[role].shape
        blocks = solve(w[role].reshape(e * n, k // 16, 16), BlockSpec(bits, 16, sym))
        np.testing.assert_array_equal(got[role], dequantize(blocks, bits).reshape(e, n, k))
    # ONNX Runtime computes with exactly those weights (accuracy_level 0: float32 activations for 4 bits)
    x = np.random.default_rng(1).standard_normal((9, H)).astype(np.float32)
    ref = _reference(x, {**w, **got})
    y = _run(out, x)
    tol = 1e-5 if bits == 4 else 2e-2  # 8-bit experts compute with int8 activations at every level on CPU
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < tol
    # and the quantized model is close to the float one
    assert np.linalg.norm(y - _reference(x, w)) / np.linalg.norm(_reference(x, w)) < (0.15 if bits == 4 else 0.02)


@pytest.mark.parametrize("fusion", [0, 2])
def test_concatenated_or_separate_gate_up_is_interleaved_exactly(tmp_path: Path, fusion: int) -> None:
    """The CPU kernel takes only interleaved gate / up rows: fc3 or a [gate | up] fc1 is reordered, biases too."""
    src = tmp_path / "moe.onnx"
    w = _moe_model(src, fusion=fusion, bias=True)
    out = tmp_path / "q.onnx"
    bitpress.run(
        {
            "input": str(src),
            "output": str(out),
            "passes": [
                {
                    "type": "rtn",
                    "block_size": 16,
                    "is_symmetric": False,
                    "accuracy_level": 0,
                    "nodes_to_exclude": ["router"],
                }
            ],
        }
    )
    node = _qmoe(onnx.load(out))
    got = _expert_weights(out, node)
    assert got["fc1"].shape == (E, 2 * INTER, H) and (len(node.input) < 9 or not node.input[8])  # no fc3
    # the same rows, reordered: solving is per row, so each interleaved row is the source row's solve
    deq_src = {}
    solve = _solver("rtn", 4, 16, False)
    from bitpress.quant.solver import BlockSpec, dequantize

    for role in ("fc1", "fc3"):
        if role in w:
            e, n, k = w[role].shape
            deq_src[role] = dequantize(solve(w[role].reshape(e * n, k // 16, 16), BlockSpec(4, 16, False)), 4).reshape(
                e, n, k
            )
    if fusion == 2:
        gate, up = deq_src["fc1"][:, :INTER], deq_src["fc1"][:, INTER:]
    else:
        gate, up = deq_src["fc1"], deq_src["fc3"]
    np.testing.assert_array_equal(got["fc1"][:, 0::2], gate)
    np.testing.assert_array_equal(got["fc1"][:, 1::2], up)
    x = np.random.default_rng(2).standard_normal((7, H)).astype(np.float32)
    ref = _reference(
        x,
        {**w, "fc1": deq_src["fc1"], "fc2": got["fc2"], **({"fc3": deq_src["fc3"]} if fusion == 0 else {})},
        fusion=fusion,
    )
    y = _run(out, x)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


def test_gpt_oss_activation_parameters_and_biases_are_carried(tmp_path: Path) -> None:
    src = tmp_path / "moe.onnx"
    w = _moe_model(src, bias=True, alpha=1.702, beta=1.0, limit=0.5)
    out = tmp_path / "q.onnx"
    bitpress.run(
        {
            "input": str(src),
            "output": str(out),
            "passes": [{"type": "rtn", "accuracy_level": 0, "nodes_to_exclude": ["router"]}],
        }
    )
    node = _qmoe(onnx.load(out))
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["activation_alpha"] == pytest.approx(1.702) and attrs["swiglu_limit"] == pytest.approx(0.5)
    got = _expert_weights(out, node)
    x = np.random.default_rng(3).standard_normal((8, H)).astype(np.float32)
    ref = _reference(x, {**w, **got}, alpha=1.702, beta=1.0, limit=0.5)
    assert np.linalg.norm(_run(out, x) - ref) / np.linalg.norm(ref) < 1e-5
    # the limit clamps: without it the reference differs (the attribute matters)
    assert np.linalg.norm(_reference(x, {**w, **got}, alpha=1.702, beta=1.0) - ref) > 1e-3 * np.linalg.norm(ref)


@pytest.mark.parametrize("name", ["kquant", "hqq"])
def test_float_offset_solvers_write_integer_zero_points_for_experts(tmp_path: Path, name: str) -> None:
    src = tmp_path / "moe.onnx"
    w = _moe_model(src, act="silu")
    out = tmp_path / "q.onnx"
    bitpress.run(
        {
            "input": str(src),
            "output": str(out),
            "passes": [{"type": name, "block_size": 32, "accuracy_level": 0, "nodes_to_exclude": ["router"]}],
        }
    )
    node = _qmoe(onnx.load(out))
    m = onnx.load(out)
    dtypes = {t.name: t.data_type for t in m.graph.initializer}
    assert dtypes[node.input[11]] == TensorProto.UINT8
    got = _expert_weights(out, node)
    x = np.random.default_rng(4).standard_normal((8, H)).astype(np.float32)
    ref = _reference(x, {**w, **got}, act="silu")
    assert np.linalg.norm(_run(out, x) - ref) / np.linalg.norm(ref) < 1e-5
    for role in ("fc1", "fc2"):
        assert np.linalg.norm(got[role] - w[role]) / np.linalg.norm(w[role]) < 0.12


def test_plan_shows_experts_and_block_is_fitted(tmp_path: Path) -> None:
    src = tmp_path / "moe.onnx"
    _moe_model(src, hidden=64, inter=48)  # 48: block 32 does not divide it, 16 does
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.weightonly import WeightOnlyOptions
    from bitpress.onnx.weightonly import plan as make_plan
    from bitpress.onnx.weightonly.report import nbits_estimate, nbits_kernel, planned_report
    from bitpress.workflow.plan import plan_lines, plan_run

    text = "\n".join(
        plan_lines(
            plan_run(
                {"input": str(src), "output": str(tmp_path / "o.onnx"), "passes": [{"type": "rtn", "block_size": 32}]}
            )
        )
    )
    assert "MoE 4 experts -> QMoE" in text and "block_size 32 -> 16" in text
    model = OnnxModel.load(src)
    opts = WeightOnlyOptions(block_size=32)
    p = make_plan(model, opts)
    report = planned_report(model, p, nbits_estimate(False), nbits_kernel(opts, False))
    rows = {r.weight: r for r in report.rows}
    assert rows["fc1"].experts == E and rows["fc1"].writes == "QMoE" and rows["fc1"].block_size == 16
    assert "block_size 32 -> 16" in rows["fc1"].note and rows["fc2"].quantized
    assert rows["fc1"].kernel == "packed, int8 compute"  # the cpu target's accuracy_level 4
    assert not rows["router"].quantized and "router of a MoE node" in rows["router"].reason  # kept float
    p = make_plan(model, WeightOnlyOptions(quantize_router=True))
    assert "router" in {g.weight for g in p.groups}
    # excluded by name: the experts stay float, said in the rows
    p = make_plan(model, WeightOnlyOptions(nodes_to_exclude=["/layers.0/moe"]))
    report = planned_report(model, p, nbits_estimate(False), nbits_kernel(opts, False))
    rows = {r.weight: r for r in report.rows}
    assert not rows["fc1"].quantized and "nodes_to_exclude" in rows["fc1"].reason


def test_mixed_widths_are_kept_float_with_the_reason(tmp_path: Path) -> None:
    src = tmp_path / "moe.onnx"
    _moe_model(src)
    out = tmp_path / "q.onnx"
    res = bitpress.run(
        {"input": str(src), "output": str(out), "passes": [{"type": "rtn", "overrides": {"fc2": {"bits": 8}}}]}
    )
    m = onnx.load(out)
    assert [n.op_type for n in m.graph.node].count("MoE") == 1
    del res


def _decoder_with_moe(path: Path, *, experts: int = E, seed: int = 0, router_bias: np.ndarray | None = None) -> None:
    """input_ids -> embedding -> router -> MoE (+ residual) -> LM head: a model calibration data can feed."""
    rng = np.random.default_rng(seed)
    vocab = 128
    w = {
        "embed": rng.standard_normal((vocab, H)).astype(np.float32),
        "router": rng.standard_normal((H, experts)).astype(np.float32),
        "fc1": (rng.standard_normal((experts, 2 * INTER, H)) / H**0.5).astype(np.float32),
        "fc2": (rng.standard_normal((experts, H, INTER)) / INTER**0.5).astype(np.float32),
        "head": (rng.standard_normal((H, vocab)) / H**0.5).astype(np.float32),
        "shape2d": np.array([-1, H], np.int64),
        "shape3d": np.array([1, -1, H], np.int64),
    }
    if router_bias is not None:
        w["router_bias"] = router_bias.astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["embed", "input_ids"], ["h"], name="embed"),
        helper.make_node("Reshape", ["h", "shape2d"], ["x"], name="flat"),
        helper.make_node("MatMul", ["x", "router"], ["logits0" if router_bias is not None else "probs"], name="router"),
    ]
    if router_bias is not None:
        nodes.append(helper.make_node("Add", ["logits0", "router_bias"], ["probs"], name="router_bias_add"))
    nodes += [
        helper.make_node(
            "MoE",
            ["x", "probs", "fc1", "", "fc2"],
            ["m"],
            name="/layers.0/moe",
            domain="com.microsoft",
            k=K_TOP,
            activation_type="swiglu",
            swiglu_fusion=1,
            normalize_routing_weights=1,
            activation_alpha=1.0,
            activation_beta=0.0,
        ),
        helper.make_node("Add", ["x", "m"], ["r"], name="residual"),
        helper.make_node("Reshape", ["r", "shape3d"], ["r3"], name="unflat"),
        helper.make_node("MatMul", ["r3", "head"], ["logits"], name="lm_head"),
    ]
    g = helper.make_graph(
        nodes,
        "dec",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, None, vocab])],
        [numpy_helper.from_array(v, k) for k, v in w.items()],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(m, path)


def _routed_rows(path: Path, data: dict) -> tuple[np.ndarray, np.ndarray]:
    """x and router logits of the float model on the calibration data (what the pass saw)."""
    from bitpress.calibration.data import DataConfig, iter_feeds
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.calibrated.experts import capture
    from bitpress.onnx.weightonly import WeightOnlyOptions
    from bitpress.onnx.weightonly import plan as make_plan

    model = OnnxModel.load(path)
    g = make_plan(model, WeightOnlyOptions()).experts.groups[0]
    feeds = list(iter_feeds(model.proto, DataConfig.from_value(data), path.parent))
    return capture(model, g, feeds)


def test_gptq_experts_beat_rtn_on_the_routed_tokens(tmp_path: Path) -> None:
    from bitpress.onnx.calibrated.experts import routed

    src = tmp_path / "dec.onnx"
    _decoder_with_moe(src)
    data = {"source": "random", "samples": 8, "seq_len": 64, "seed": 3}
    common = {"bits": 4, "block_size": 16, "is_symmetric": False, "accuracy_level": 0, "nodes_to_exclude": ["router"]}
    outs = {}
    for name in ("gptq", "rtn"):
        outs[name] = tmp_path / f"{name}.onnx"
        res = bitpress.run(
            {"input": str(src), "output": str(outs[name]), "data": data, "passes": [{"type": name, **common}]}
        )
        assert not [n for n in res.notes if "too few calibration tokens" in n]
    x, logits = _routed_rows(src, data)
    mask = routed(logits, K_TOP)
    w1 = numpy_helper.to_array(next(t for t in onnx.load(src).graph.initializer if t.name == "fc1"))
    deq = {k: _expert_weights(v, _qmoe(onnx.load(v)))["fc1"] for k, v in outs.items()}
    better = 0
    for e in range(E):
        rows = x[mask[:, e]]
        assert len(rows) >= H  # every expert got enough tokens: none fell back
        err = {k: np.linalg.norm(rows @ (d[e] - w1[e]).T) for k, d in deq.items()}
        better += err["gptq"] < err["rtn"]
    assert better == E  # GPTQ's layer error on its own tokens is below RTN's for every expert


def test_a_starved_expert_falls_back_and_is_reported(tmp_path: Path) -> None:
    src = tmp_path / "dec.onnx"
    bias = np.zeros(E, np.float32)
    bias[3] = -1e4  # the router never picks expert 3
    _decoder_with_moe(src, router_bias=bias)
    data = {"source": "random", "samples": 4, "seq_len": 64, "seed": 3}
    out = tmp_path / "gptq.onnx"
    res = bitpress.run(
        {
            "input": str(src),
            "output": str(out),
            "data": data,
            "passes": [{"type": "gptq", "block_size": 16, "accuracy_level": 0, "nodes_to_exclude": ["router"]}],
        }
    )
    notes = [n for n in res.notes if "too few calibration tokens" in n]
    assert len(notes) == 1 and "/layers.0/moe expert 3: 0 calibration tokens (< 64)" in notes[0]
    # the starved expert holds exactly GPTQ's calibration-free rounding (its grid solver) of the float weights
    from bitpress.quant.solver import BlockSpec, dequantize

    w1 = numpy_helper.to_array(next(t for t in onnx.load(src).graph.initializer if t.name == "fc1"))
    got = _expert_weights(out, _qmoe(onnx.load(out)))["fc1"]
    gptq = get_registry().get_pass("gptq").from_config({"block_size": 16}, strict=True)
    n, k = w1[3].shape
    want = dequantize(gptq.solver()(w1[3].reshape(n, k // 16, 16), BlockSpec(4, 16, False)), 4).reshape(n, k)
    np.testing.assert_array_equal(got[3], want)
    # and ONNX Runtime runs the model
    s = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert np.isfinite(s.run(None, {"input_ids": np.arange(10, dtype=np.int64)[None]})[0]).all()


def test_awq_clip_search_does_not_lose_to_rtn_on_the_routed_tokens(tmp_path: Path) -> None:
    from bitpress.onnx.calibrated.experts import routed

    src = tmp_path / "dec.onnx"
    _decoder_with_moe(src)
    data = {"source": "random", "samples": 8, "seq_len": 64, "seed": 5}
    common = {"bits": 4, "block_size": 16, "is_symmetric": False, "accuracy_level": 0, "nodes_to_exclude": ["router"]}
    outs = {}
    for name, extra in (("awq", {"quantizer": "rtn"}), ("rtn", {})):
        outs[name] = tmp_path / f"{name}.onnx"
        bitpress.run(
            {"input": str(src), "output": str(outs[name]), "data": data, "passes": [{"type": name, **common, **extra}]}
        )
    x, logits = _routed_rows(src, data)
    mask = routed(logits, K_TOP)
    w1 = numpy_helper.to_array(next(t for t in onnx.load(src).graph.initializer if t.name == "fc1"))
    deq = {k: _expert_weights(v, _qmoe(onnx.load(v)))["fc1"] for k, v in outs.items()}
    err = {k: sum(np.linalg.norm(x[mask[:, e]] @ (d[e] - w1[e]).T) ** 2 for e in range(E)) for k, d in deq.items()}
    assert err["awq"] <= err["rtn"] * 1.0001
    assert not np.array_equal(deq["awq"], deq["rtn"])  # the clip search changed some blocks


def test_float16_experts_get_float16_scales(tmp_path: Path) -> None:
    src = tmp_path / "moe.onnx"
    w = _moe_model(src, dtype=np.float16)
    out = tmp_path / "q.onnx"
    bitpress.run(
        {
            "input": str(src),
            "output": str(out),
            "passes": [
                {
                    "type": "rtn",
                    "block_size": 16,
                    "is_symmetric": False,
                    "accuracy_level": 0,
                    "nodes_to_exclude": ["router"],
                }
            ],
        }
    )
    node = _qmoe(onnx.load(out))
    scales = {t.name: t.data_type for t in onnx.load(out).graph.initializer}
    assert scales[node.input[3]] == scales[node.input[6]] == TensorProto.FLOAT16
    got = _expert_weights(out, node)
    x = np.random.default_rng(1).standard_normal((9, H)).astype(np.float16)
    ref = _reference(x.astype(np.float32), {**_as_float(w), **got})
    assert np.linalg.norm(_run(out, x) - ref) / np.linalg.norm(ref) < 2e-3  # float16 activations' rounding


def test_experts_from_the_float_model_when_not_sequential(tmp_path: Path) -> None:
    src, out = tmp_path / "dec.onnx", tmp_path / "gptq.onnx"
    _decoder_with_moe(src)
    bitpress.run(
        {
            "input": str(src),
            "output": str(out),
            "data": {"source": "random", "samples": 4, "seq_len": 64},
            "passes": [{"type": "gptq", "block_size": 16, "sequential": False, "expert_min_tokens": 16}],
        }
    )
    assert _qmoe(onnx.load(out)).op_type == "QMoE"


def test_inspect_and_passes_list_show_experts(tmp_path: Path) -> None:
    import subprocess
    import sys

    src, out = tmp_path / "moe.onnx", tmp_path / "q.onnx"
    _moe_model(src)
    bitpress.run({"input": str(src), "output": str(out), "passes": [{"type": "rtn", "bits": 8, "block_size": 16}]})

    def cli(*args: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "bitpress", *args], check=True, capture_output=True, text=True
        ).stdout

    text = cli("inspect", str(out), "--no-check")
    assert "experts: /layers.0/moe_Q8: QMoE, 4 experts (top 2, swiglu, hidden 64): 8-bit, block 16" in text
    assert "packed, int8 compute" in text
    assert "MoE, 4 experts (top 2, swiglu, hidden 64): float32, not quantized" in cli("inspect", str(src))
    rows = {line.split()[0]: line for line in cli("passes", "list").splitlines()[1:] if line.strip()}
    assert "QMoE" in rows["rtn"] and "QMoE, per expert" in rows["gptq"] and "loops -> MoE" in rows["fuse_experts"]


def test_a_graph_with_qmoe_keeps_its_experts_and_routers_when_dense_weights_are_quantized(tmp_path: Path) -> None:
    """A package whose experts are already QMoE (the GenAI export) quantized again: only the dense MatMuls change."""
    src, q1, q2 = tmp_path / "dec.onnx", tmp_path / "q1.onnx", tmp_path / "q2.onnx"
    _decoder_with_moe(src)
    bitpress.run(
        {"input": str(src), "output": str(q1), "passes": [{"type": "rtn", "nodes_to_exclude": ["lm_head", "embed"]}]}
    )
    first = {t.name: numpy_helper.to_array(t) for t in onnx.load(q1).graph.initializer}
    bitpress.run({"input": str(q1), "output": str(q2), "passes": [{"type": "rtn"}]})
    m = onnx.load(q2)
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("QMoE") == 1 and "MatMulNBits" in ops and "GatherBlockQuantized" in ops
    after = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    assert np.array_equal(after["router"], first["router"])  # the router stays float
    node = _qmoe(m)
    for i in (2, 3, 5, 6):  # the experts' integers and scales as they were
        assert np.array_equal(after[node.input[i]], first[node.input[i]])
