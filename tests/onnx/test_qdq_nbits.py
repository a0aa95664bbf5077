"""The QDQ -> MatMulNBits converter (bitpress.onnx.qdq_nbits) and the host pass ``qdq_to_nbits``.

Every model is built here with onnx.helper: ``DequantizeLinear`` (opset 21, blockwise along K as
NVIDIA ModelOpt writes it, or per channel / per tensor) feeding ``MatMul``. Each conversion is
checked three ways: the op types and attributes written; the weight that MatMulNBits' B / scales
/ zero points encode equals the DQ's dequantized weight bit for bit (same integers, scales and
zero points); and ONNX Runtime's output of the converted model against the QDQ model run with
graph optimizations off (so ORT really runs DequantizeLinear + MatMul, not its own fusion).

Measured on this machine (ORT 1.32 CPU), largest ``max|y - y_ref| / max|y_ref|`` over the cases:
float32 6.5e-7 (bound 1e-6), float16 4.5e-4 (bound 1e-3: one fp16 ulp is up to 9.8e-4 relative,
and the two graphs round fp16 products and sums in different places).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import bitpress
from bitpress.errors import UsageError
from bitpress.onnx.layout import MatMulNBitsTensors, dequantize_matmul_nbits, unpack_along_last
from bitpress.onnx.qdq_nbits import QdqConversion, convert_qdq_to_nbits

F32_BOUND = 1e-6
F16_BOUND = 1e-3

#: name -> (numpy type, low, high (exclusive), bits)
INT_TYPES = {
    "int4": (ml_dtypes.int4, -8, 8, 4),
    "uint4": (ml_dtypes.uint4, 0, 16, 4),
    "int8": (np.int8, -128, 128, 8),
    "uint8": (np.uint8, 0, 256, 8),
}


def make_qdq(
    k: int, n: int, *, wtype: str = "int4", block: int = 32, zero_points: bool = True,
    dtype: type = np.float32, per: str = "block", stored_nk: bool = False, readers: int = 1,
    mul: bool = False, seed: int = 0, zp_values: str = "random",
) -> tuple[onnx.ModelProto, np.ndarray]:
    """A DequantizeLinear -> MatMul model and the float32 weight ``[K, N]`` its DQ encodes exactly.

    per: "block" (block_size along K), "channel" (one scale per output channel), "tensor".
    stored_nk: the integers are stored [N, K] (blocks along axis 1) and read through a Transpose.
    readers: MatMuls sharing the weight (inputs X, X1, ...). mul: AWQ's pre-quant-scale Mul on X.
    zp_values: "random", or "zero" (a symmetric weight written with explicit zero points, as ModelOpt does).
    """
    rng = np.random.default_rng(seed)
    np_int, lo, hi, _ = INT_TYPES[wtype]
    shape = (n, k) if stored_nk else (k, n)
    q = rng.integers(lo, hi, shape)
    k_axis = 1 if stored_nk else 0
    if per == "block":
        nb = -(-k // block)
        s_shape = (n, nb) if stored_nk else (nb, n)
    elif per == "channel":
        s_shape = (n,)
    else:
        s_shape = ()
    # signs vary, as symmetric quantizers write them
    s = (rng.uniform(0.01, 0.1, s_shape) * rng.choice([-1, 1], s_shape)).astype(dtype)
    z = rng.integers(lo, hi, s_shape) if zp_values == "random" else np.zeros(s_shape, np.int64)
    # the reference: expand scale / zero point to the weight's shape and dequantize in float32 (exact)
    if per == "block":
        s_full = np.repeat(s, block, axis=k_axis).take(range(k), axis=k_axis)
        z_full = np.repeat(z, block, axis=k_axis).take(range(k), axis=k_axis)
    else:
        s_full = np.broadcast_to(s, shape) if stored_nk is False or per == "tensor" else s[:, None]
        z_full = np.broadcast_to(z, shape) if stored_nk is False or per == "tensor" else z[:, None]
    w = (q.astype(np.float32) - (z_full.astype(np.float32) if zero_points else 0)) * s_full.astype(np.float32)
    w_kn = np.ascontiguousarray(w.T if stored_nk else w)

    inits = [numpy_helper.from_array(q.astype(np_int), "W"), numpy_helper.from_array(s, "S")]
    dq_in = ["W", "S"]
    if zero_points:
        inits.append(numpy_helper.from_array(z.astype(np_int), "Z"))
        dq_in.append("Z")
    attrs: dict[str, int] = {}
    if per == "block":
        attrs = {"axis": k_axis, "block_size": block}
    elif per == "channel":
        attrs = {"axis": 0 if stored_nk else 1}
    nodes = [helper.make_node("DequantizeLinear", dq_in, ["W_dq"], name="dq", **attrs)]
    b = "W_dq"
    if stored_nk:
        nodes.append(helper.make_node("Transpose", ["W_dq"], ["W_t"], name="transpose", perm=[1, 0]))
        b = "W_t"
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs, outputs = [], []
    for i in range(readers):
        x = f"X{i}" if i else "X"
        inputs.append(helper.make_tensor_value_info(x, elem, [2, 3, k]))
        if mul:
            inits.append(numpy_helper.from_array(rng.uniform(0.5, 2, k).astype(dtype), f"awq_scale{i}"))
            nodes.append(helper.make_node("Mul", [x, f"awq_scale{i}"], [f"{x}_s"], name=f"awq_mul{i}"))
            x = f"{x}_s"
        nodes.append(helper.make_node("MatMul", [x, b], [f"Y{i}"], name=f"mm{i}"))
        outputs.append(helper.make_tensor_value_info(f"Y{i}", elem, [2, 3, n]))
    graph = helper.make_graph(nodes, "qdq", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model, w_kn


def feeds(model: onnx.ModelProto, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        dt = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        out[i.name] = rng.standard_normal(shape).astype(dt)
    return out


def run(model: onnx.ModelProto, inputs: dict[str, np.ndarray], *, optimize: bool = True) -> list[np.ndarray]:
    so = ort.SessionOptions()
    if not optimize:  # ORT would fuse DQ -> MatMul itself: the reference runs the QDQ graph as written
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)


def convert(model: onnx.ModelProto, **kwargs) -> tuple[onnx.ModelProto, QdqConversion]:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out, convert_qdq_to_nbits(out, **kwargs)


def nbits_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "MatMulNBits"]


def attrs(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def encoded_weight(model: onnx.ModelProto, node: onnx.NodeProto) -> np.ndarray:
    """The float32 [K, N] weight that a MatMulNBits node's B / scales / zero points encode."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    a = attrs(node)
    zp = inits[node.input[3]] if len(node.input) > 3 and node.input[3] else None
    t = MatMulNBitsTensors(inits[node.input[1]], inits[node.input[2]], zp, a["K"], a["N"], a["bits"], a["block_size"])
    return dequantize_matmul_nbits(t)


def padding(model: onnx.ModelProto, node: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray]:
    """The integers padding K to whole blocks in B, and the zero points of their (last) blocks."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    a = attrs(node)
    n, bits, bs, k = a["N"], a["bits"], a["block_size"], a["K"]
    q = unpack_along_last(inits[node.input[1]], bits, bs).reshape(n, -1)
    n_blocks = q.shape[1] // bs
    if len(node.input) > 3:
        zp = unpack_along_last(inits[node.input[3]].reshape(n, -1), bits, n_blocks)[:, -1:]
    else:
        zp = np.full((n, 1), 2 ** (bits - 1), np.uint8)
    return q[:, k:], np.broadcast_to(zp, q[:, k:].shape)


def relative_error(y: np.ndarray, ref: np.ndarray) -> float:
    ref64 = ref.astype(np.float64)
    return float(np.abs(y.astype(np.float64) - ref64).max() / np.abs(ref64).max())


def check_equivalent(model: onnx.ModelProto, converted: onnx.ModelProto, w: np.ndarray, bound: float) -> None:
    for node in nbits_nodes(converted):
        np.testing.assert_array_equal(encoded_weight(converted, node), w)
    x = feeds(model)
    for y, ref in zip(run(converted, x), run(model, x, optimize=False), strict=True):
        assert y.dtype == ref.dtype
        assert relative_error(y, ref) < bound


# -- bits, types, block sizes, zero points, odd K -------------------------------------------------------
@pytest.mark.parametrize("wtype", list(INT_TYPES))
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("zero_points", [True, False])
def test_blockwise_exact(wtype: str, block: int, zero_points: bool) -> None:
    """K = 200 is a multiple of no block size: the last block is partial and padded."""
    model, w = make_qdq(200, 24, wtype=wtype, block=block, zero_points=zero_points)
    converted, res = convert(model)
    assert res.converted == ["mm0"] and res.skipped == {} and res.weights == 1
    assert [n.op_type for n in converted.graph.node] == ["MatMulNBits"]
    node = nbits_nodes(converted)[0]
    bits = INT_TYPES[wtype][3]
    assert attrs(node) == {"K": 200, "N": 24, "bits": bits, "block_size": block}
    assert node.domain == "com.microsoft"
    assert any(o.domain == "com.microsoft" for o in converted.opset_import)
    # no zero points stored where MatMulNBits' default (2**(bits-1)) is the DQ's: a signed weight
    # without zero points; an unsigned one without them has zero points 0, which must be written
    assert (len(node.input) > 3) == (zero_points or wtype.startswith("u"))
    assert {t.name for t in converted.graph.initializer} == set(node.input[1:])
    pad, zp = padding(converted, node)
    assert pad.shape[1] == -200 % block
    np.testing.assert_array_equal(pad, zp)  # the padding dequantizes to 0, whatever a kernel does with it
    check_equivalent(model, converted, w, F32_BOUND)


@pytest.mark.parametrize("wtype", ["int4", "int8"])
@pytest.mark.parametrize("k", [256, 1000])
def test_aligned_and_long_k(wtype: str, k: int) -> None:
    model, w = make_qdq(k, 40, wtype=wtype, block=128, seed=3)
    converted, res = convert(model)
    assert res.converted == ["mm0"]
    assert attrs(nbits_nodes(converted)[0])["K"] == k
    check_equivalent(model, converted, w, F32_BOUND)


@pytest.mark.parametrize("wtype", ["int4", "uint4", "int8"])
@pytest.mark.parametrize("zero_points", [True, False])
def test_float16_scales(wtype: str, zero_points: bool) -> None:
    """fp16 scales: MatMulNBits computes in fp16 (its T is the scales' type), as the MatMul did."""
    model, w = make_qdq(200, 32, wtype=wtype, block=32, zero_points=zero_points, dtype=np.float16)
    converted, res = convert(model)
    assert res.converted == ["mm0"]
    node = nbits_nodes(converted)[0]
    scales = next(t for t in converted.graph.initializer if t.name == node.input[2])
    assert scales.data_type == TensorProto.FLOAT16
    check_equivalent(model, converted, w, F16_BOUND)


# -- other quantization layouts ------------------------------------------------------------------------
@pytest.mark.parametrize(("per", "k", "block"), [("channel", 200, 256), ("channel", 600, 256), ("tensor", 100, 128)])
@pytest.mark.parametrize("wtype", ["int8", "uint8", "int4"])
def test_per_channel_and_per_tensor(per: str, k: int, block: int, wtype: str) -> None:
    """One scale per output channel (or per tensor) becomes blocks of min(256, next power of two >= K)."""
    model, w = make_qdq(k, 16, wtype=wtype, per=per)
    converted, res = convert(model)
    assert res.converted == ["mm0"]
    assert attrs(nbits_nodes(converted)[0])["block_size"] == block
    check_equivalent(model, converted, w, F32_BOUND)


@pytest.mark.parametrize(("dq_block", "block"), [(48, 16), (96, 32), (512, 256)])
def test_blocks_written_as_smaller_power_of_two_blocks(dq_block: int, block: int) -> None:
    """A DQ block that is not a power of two from 16 to 256 is split; its scale is repeated, nothing requantized."""
    model, w = make_qdq(1000, 16, block=dq_block)
    converted, res = convert(model)
    assert res.converted == ["mm0"]
    assert attrs(nbits_nodes(converted)[0])["block_size"] == block
    check_equivalent(model, converted, w, F32_BOUND)


def test_transposed_weight() -> None:
    """Integers stored [N, K] with blocks along axis 1, read through Transpose: MatMulNBits' own orientation."""
    model, w = make_qdq(200, 24, wtype="uint4", block=32, stored_nk=True)
    converted, res = convert(model)
    assert res.converted == ["mm0"]
    assert [n.op_type for n in converted.graph.node] == ["MatMulNBits"]
    check_equivalent(model, converted, w, F32_BOUND)


# -- graph shapes ----------------------------------------------------------------------------------------
def test_tied_weight_converted_once() -> None:
    model, w = make_qdq(256, 32, readers=2)
    converted, res = convert(model)
    assert res.converted == ["mm0", "mm1"] and res.weights == 1
    a, b = nbits_nodes(converted)
    assert a.input[1:] == b.input[1:], "both MatMuls read the same B / scales / zero points"
    assert len(converted.graph.initializer) == 3
    check_equivalent(model, converted, w, F32_BOUND)


def test_awq_mul_kept() -> None:
    model, w = make_qdq(128, 16, mul=True)
    mul_scale = next(t for t in model.graph.initializer if t.name == "awq_scale0")
    converted, res = convert(model)
    assert res.converted == ["mm0"]
    assert [n.op_type for n in converted.graph.node] == ["Mul", "MatMulNBits"]
    assert nbits_nodes(converted)[0].input[0] == "X_s"
    kept = next(t for t in converted.graph.initializer if t.name == "awq_scale0")
    assert kept == mul_scale
    check_equivalent(model, converted, w, F32_BOUND)


def test_accuracy_level_written() -> None:
    model, _ = make_qdq(128, 16)
    converted, _ = convert(model, accuracy_level=4)
    assert attrs(nbits_nodes(converted)[0])["accuracy_level"] == 4
    run(converted, feeds(model))  # ORT takes it (int8 compute: its error is not this test's business)
    with pytest.raises(UsageError, match="accuracy_level"):
        convert(model, accuracy_level=7)


def test_nodes_selects_matmuls() -> None:
    model, _ = make_qdq(128, 16, readers=2)
    converted, res = convert(model, nodes=["mm0", "nope"])
    assert res.converted == []
    assert "mm1, not selected" in res.skipped["mm0"] and "one tensor" in res.skipped["mm0"]
    assert res.skipped["nope"] == "no MatMul of that name reads a DequantizeLinear weight"
    assert converted == model, "nothing changed"
    converted, res = convert(model, nodes=["mm0", "mm1"])
    assert res.converted == ["mm0", "mm1"]


def test_file_smaller_for_modelopt_style_symmetric() -> None:
    """A symmetric int4 weight written with explicit zero points of 0 (ModelOpt's form): MatMulNBits
    needs none (its default is the shifted 0), so the file loses the zero-point tensor; the
    integers and scales take the same bytes in both forms when K is a multiple of the block."""
    model, w = make_qdq(512, 256, block=128, zp_values="zero")
    converted, res = convert(model)
    node = nbits_nodes(converted)[0]
    assert len(node.input) == 3, "no zero points"
    before, after = model.ByteSize(), converted.ByteSize()
    zp_bytes = 4 * 256 // 2  # [K/128, N] int4
    assert after < before - zp_bytes + 64  # the MatMulNBits node's attributes take a few dozen bytes more
    assert res.removed_bytes - res.stored_bytes == zp_bytes
    check_equivalent(model, converted, w, F32_BOUND)


# -- what is left as it is, and why ---------------------------------------------------------------------
def _extra_reader(model: onnx.ModelProto, node: onnx.NodeProto) -> onnx.ModelProto:
    model.graph.node.append(node)
    model.graph.output.append(helper.make_value_info(node.output[0], onnx.TypeProto()))
    return model


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda m: _extra_reader(m, helper.make_node("Gather", ["W_dq", "I"], ["G"], name="gather")),
         "also read by Gather gather"),
        (lambda m: m.graph.output.append(helper.make_value_info("W_dq", onnx.TypeProto())),
         "also read by a graph output"),
        (lambda m: _extra_reader(m, helper.make_node("Reshape", ["W_dq", "shape"], ["R"], name="reshape")),
         "Reshape reshape changes the weight's shape"),
        (lambda m: m.graph.input.append(helper.make_tensor_value_info("S", TensorProto.FLOAT, [7, 16])),
         "its scale 'S' is also a graph input"),
    ],
)
def test_skipped_with_reason(edit, reason: str) -> None:
    model, _ = make_qdq(200, 16)
    model.graph.initializer.extend([numpy_helper.from_array(np.array([0], np.int64), "I"),
                                    numpy_helper.from_array(np.array([16, 200], np.int64), "shape")])
    edit(model)
    converted, res = convert(model)
    assert res.converted == []
    assert reason in res.skipped["mm0"], res.skipped
    assert converted == model


def test_noop_reshape_converted() -> None:
    model, w = make_qdq(200, 16)
    mm = next(n for n in model.graph.node if n.op_type == "MatMul")
    mm.input[1] = "W_r"
    model.graph.initializer.append(numpy_helper.from_array(np.array([-1, 16], np.int64), "shape"))
    model.graph.node.insert(1, helper.make_node("Reshape", ["W_dq", "shape"], ["W_r"], name="reshape"))
    converted, res = convert(model)
    assert res.converted == ["mm0"]
    assert [n.op_type for n in converted.graph.node] == ["MatMulNBits"]
    assert {t.name for t in converted.graph.initializer} == {"W_Q4", "W_scales", "W_zero_points"}
    check_equivalent(model, converted, w, F32_BOUND)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"block": 24}, "block_size 24 has no power-of-two divisor of at least 16"),
        ({"dtype": "bf16"}, "BFLOAT16 scales"),
        ({"axis": 1}, "blocks run along N"),
        ({"matmul_a": True}, "reads it as its input A"),
    ],
)
def test_unconvertible_dq(change: dict, reason: str) -> None:
    model, _ = make_qdq(192, 192, block=change.get("block", 32))
    dq = model.graph.node[0]
    if change.get("dtype") == "bf16":
        s = next(t for t in model.graph.initializer if t.name == "S")
        s.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(s).astype(ml_dtypes.bfloat16), "S"))
    if "axis" in change:  # 192 x 192 so that blocks of 32 along N have the same scale shape
        next(a for a in dq.attribute if a.name == "axis").i = change["axis"]
    if change.get("matmul_a"):
        mm = model.graph.node[1]
        mm.input[0], mm.input[1] = "W_dq", "X"
    converted, res = convert(model)
    assert res.converted == []
    assert reason in res.skipped["mm0"], res.skipped
    assert converted == model


# -- external data ------------------------------------------------------------------------------------------
def test_external_data(tmp_path: Path) -> None:
    model, w = make_qdq(512, 64, wtype="int8", block=64)
    path = tmp_path / "qdq.onnx"
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # onnx.save moves the tensors of the proto it is given to external data
    onnx.save(copy, path, save_as_external_data=True, location="qdq.data", size_threshold=0)
    loaded = onnx.load(path, load_external_data=False)
    with pytest.raises(UsageError, match="base_dir"):
        convert_qdq_to_nbits(loaded)
    res = convert_qdq_to_nbits(loaded, base_dir=tmp_path)
    assert res.converted == ["mm0"]
    assert all(t.data_location != TensorProto.EXTERNAL for t in loaded.graph.initializer)
    check_equivalent(model, loaded, w, F32_BOUND)
    # the pass on the file: the host's model handle reads the external data itself
    result = bitpress.quantize(path, tmp_path / "out", algorithm="qdq_to_nbits", options={"accuracy_level": 0})
    check_equivalent(model, onnx.load(next(p for p in result.files if p.suffix == ".onnx")), w, F32_BOUND)


# -- the host pass: API and CLI ----------------------------------------------------------------------------
def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, path)
    return path


def test_pass_api_end_to_end(tmp_path: Path) -> None:
    model, w = make_qdq(256, 32, readers=2, mul=True)
    src = _save(model, tmp_path / "qdq.onnx")
    result = bitpress.quantize(src, tmp_path / "out", algorithm="qdq_to_nbits", options={"accuracy_level": 0})
    out = onnx.load(next(p for p in result.files if p.suffix == ".onnx"))
    assert sorted(n.op_type for n in out.graph.node) == ["MatMulNBits", "MatMulNBits", "Mul", "Mul"]
    (name, _, report), = result.reports
    assert name == "qdq_to_nbits" and report.converted == ["mm0", "mm1"]
    check_equivalent(model, out, w, F32_BOUND)


def test_pass_excludes_and_refuses(tmp_path: Path) -> None:
    model, _ = make_qdq(128, 16)
    src = _save(model, tmp_path / "qdq.onnx")
    with pytest.raises(UsageError, match="excluded by nodes_to_exclude"):
        bitpress.quantize(src, tmp_path / "out", algorithm="qdq_to_nbits", options={"nodes_to_exclude": ["mm*"]})
    floaty = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")], "f",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")]), opset_imports=[helper.make_opsetid("", 21)])
    with pytest.raises(UsageError, match=r"no DequantizeLinear feeds a MatMul weight.*such as rtn"):
        bitpress.quantize(_save(floaty, tmp_path / "float.onnx"), tmp_path / "out2", algorithm="qdq_to_nbits")


def test_cli_end_to_end(tmp_path: Path, run_cli) -> None:
    model, w = make_qdq(200, 24, wtype="uint8", block=64, zero_points=False)
    src = _save(model, tmp_path / "qdq.onnx")
    code, out, err = run_cli("quantize", "-m", src, "-o", tmp_path / "out", "--algorithm", "qdq_to_nbits",
                             "--option", "accuracy_level=1")
    assert code == 0, err
    assert "qdq_to_nbits on qdq.onnx: converted 1 MatMul nodes (1 weights) to MatMulNBits" in out
    converted = onnx.load(next((tmp_path / "out").glob("*.onnx")))
    assert attrs(nbits_nodes(converted)[0])["accuracy_level"] == 1
    check_equivalent(model, converted, w, F32_BOUND)
    code, out, _ = run_cli("passes", "list")
    row = next(line for line in out.splitlines() if line.startswith("qdq_to_nbits"))
    assert row.split()[:2] == ["qdq_to_nbits", "bitpress"]
    code, _, err = run_cli("quantize", "-m", tmp_path / "out" / "qdq.onnx", "-o", tmp_path / "again",
                           "--algorithm", "qdq_to_nbits")
    assert code == 2 and "no DequantizeLinear feeds a MatMul weight" in err
    code, _, err = run_cli("quantize", "-m", src, "-o", tmp_path / "p", "--algorithm", "qdq_to_nbits",
                           "--precision", "int4")
    assert code == 2 and "it takes no precision (leave --precision out)" in err


@pytest.mark.parametrize("wtype", ["int4", "uint4", "int8", "uint8"])
def test_accuracy_level_4_is_what_ort_makes_of_the_qdq_file(wtype: str) -> None:
    """On CPU, ONNX Runtime fuses DQ -> MatMul into MatMulNBits itself at session load, with
    accuracy_level 4 (int8 activations; its session option ``session.qdq_matmulnbits_accuracy_level``
    defaults to 4). Converted with accuracy_level=4, the file gives those outputs bit for bit
    (measured: identical); the default 0 gives the exact DQ + MatMul result instead."""
    model, _ = make_qdq(256, 64, wtype=wtype, block=32, seed=5)
    converted, _ = convert(model, accuracy_level=4)
    x = feeds(model)
    np.testing.assert_array_equal(run(converted, x)[0], run(model, x)[0])
