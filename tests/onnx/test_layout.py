"""Run one-node MatMulNBits / GatherBlockQuantized graphs in ORT against numpy references."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from bitpress.onnx.layout import (
    dequantize_gather_block_quantized,
    dequantize_matmul_nbits,
    pack_along_last,
    tied_table_sharing,
    to_gather_block_quantized,
    to_matmul_nbits,
    unpack_along_last,
)
from bitpress.quant.solver import QuantizedBlocks, dequantize

BLOCK_SIZES = [16, 32, 64, 128, 256]
ZP_KINDS = ["none", "uint8", "float"]
SCALE_DTYPES = [np.float32, np.float16]


def _run(nodes, initializers, inputs: dict[str, np.ndarray], outputs: list[str]):
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for k, v in inputs.items()
        ],
        [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
        initializer=[numpy_helper.from_array(a, name) for name, a in initializers.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(outputs, inputs)


def _random_blocks(rng, rows, n_blocks, bs, bits, kind) -> QuantizedBlocks:
    top = 2**bits
    q = rng.integers(0, top, (rows, n_blocks, bs), dtype=np.uint8)
    # Signs vary: symmetric RTN writes negative scales.
    scales = rng.uniform(0.01, 0.1, (rows, n_blocks)) * rng.choice([-1, 1], (rows, n_blocks))
    zp = None
    if kind == "uint8":
        zp = rng.integers(0, top, (rows, n_blocks), dtype=np.uint8)
    elif kind == "float":
        zp = rng.uniform(0, top - 1, (rows, n_blocks)).astype(np.float32)
    return QuantizedBlocks(q, scales.astype(np.float32), zp)


def _as_scale_dtype(blocks: QuantizedBlocks, dt) -> QuantizedBlocks:
    """The blocks the kernel actually sees once scales (and float zero points) are cast."""
    zp = blocks.zero_points
    if zp is not None and zp.dtype != np.uint8:
        zp = zp.astype(dt).astype(np.float32)
    return QuantizedBlocks(blocks.q, blocks.scales.astype(dt).astype(np.float32), zp)


def _reference_kn(blocks: QuantizedBlocks, bits: int, k: int) -> np.ndarray:
    rows = blocks.q.shape[0]
    return dequantize(blocks, bits).reshape(rows, -1)[:, :k].T


def _matmul_node(t, inputs, **extra):
    return helper.make_node(
        "MatMulNBits", inputs, ["Y"], domain="com.microsoft", **t.attributes(), **extra
    )


def _matmul_inits(t) -> tuple[dict[str, np.ndarray], list[str]]:
    inits = {"B": t.b, "scales": t.scales}
    if t.zero_points is not None:
        inits["zp"] = t.zero_points
    return inits, ["A", *inits]


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_roundtrip_low_first(bits):
    v = np.arange(2 * 7).reshape(2, 7) % (2**bits)
    p = pack_along_last(v, bits)
    if bits == 4:
        assert p.shape == (2, 4)
        assert p[0, 0] == (v[0, 0] | v[0, 1] << 4)
    np.testing.assert_array_equal(unpack_along_last(p, bits, 7), v)


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("kind", ZP_KINDS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("bits", [4, 8])
def test_matmul_nbits(bits, block_size, kind, scale_dtype):
    rng = np.random.default_rng(bits * 1000 + block_size)
    n, n_blocks = 7, 3
    k = n_blocks * block_size - block_size // 2 - 1  # padded K, odd
    blocks = _random_blocks(rng, n, n_blocks, block_size, bits, kind)
    if bits == 8 and kind == "float":
        with pytest.raises(ValueError, match="float zero points"):
            to_matmul_nbits(blocks, bits, k, scale_dtype)
        return
    t = to_matmul_nbits(blocks, bits, k, scale_dtype)
    assert t.b.shape == (n, n_blocks, block_size * bits // 8)
    assert t.scales.shape == (n * n_blocks,) and t.scales.dtype == scale_dtype
    if kind == "uint8":
        assert t.zero_points.shape == (n * -(-n_blocks * bits // 8),)
    elif kind == "float":
        assert t.zero_points.shape == (n * n_blocks,) and t.zero_points.dtype == scale_dtype

    ref = _reference_kn(_as_scale_dtype(blocks, scale_dtype), bits, k)
    np.testing.assert_allclose(dequantize_matmul_nbits(t), ref, rtol=1e-6, atol=1e-7)

    inits, names = _matmul_inits(t)
    a = rng.standard_normal((3, k)).astype(scale_dtype)
    eye = np.eye(k, dtype=scale_dtype)
    (y,) = _run([_matmul_node(t, names)], inits, {"A": np.concatenate([eye, a])}, ["Y"])
    assert y.dtype == scale_dtype and y.shape == (k + 3, n)
    if scale_dtype == np.float32:
        # Identity rows read the dequantized weight back exactly.
        np.testing.assert_allclose(y[:k], ref, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(y[k:], a @ ref, rtol=1e-4, atol=1e-4)
    else:
        np.testing.assert_allclose(y[:k], ref, rtol=2e-3, atol=1e-4)
        expect = a.astype(np.float32) @ ref
        np.testing.assert_allclose(y[k:], expect, rtol=1e-2, atol=1e-2 * np.abs(expect).max())


@pytest.mark.parametrize("kind", ["none", "uint8", "float"])
def test_matmul_nbits_2d_scales_accepted(kind):
    rng = np.random.default_rng(5)
    blocks = _random_blocks(rng, 5, 2, 32, 4, kind)
    t = to_matmul_nbits(blocks, 4, 64, flat=False)
    assert t.scales.shape == (5, 2)
    inits, names = _matmul_inits(t)
    (y,) = _run([_matmul_node(t, names)], inits, {"A": np.eye(64, dtype=np.float32)}, ["Y"])
    np.testing.assert_allclose(y, _reference_kn(blocks, 4, 64), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("kind", ["none", "uint8"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("bits", [4, 8])
def test_gather_block_quantized(bits, block_size, kind, scale_dtype):
    rng = np.random.default_rng(bits * 7 + block_size)
    vocab, n_blocks = 9, 3
    hidden = n_blocks * block_size - block_size // 2  # partial last block, even
    blocks = _random_blocks(rng, vocab, n_blocks, block_size, bits, kind)
    t = to_gather_block_quantized(blocks, bits, hidden, scale_dtype)
    assert t.data.shape == (vocab, hidden * bits // 8)
    assert t.scales.shape == (vocab, n_blocks)
    if kind == "uint8":
        assert t.zero_points.shape == (vocab, -(-n_blocks * bits // 8))

    ref = _reference_kn(_as_scale_dtype(blocks, scale_dtype), bits, hidden).T
    np.testing.assert_allclose(dequantize_gather_block_quantized(t), ref, rtol=1e-6, atol=1e-7)

    inits = {"data": t.data, "scales": t.scales}
    if t.zero_points is not None:
        inits["zp"] = t.zero_points
    node = helper.make_node(
        "GatherBlockQuantized",
        ["data", "ids", *list(inits)[1:]],
        ["Y"],
        domain="com.microsoft",
        **t.attributes(),
    )
    ids = np.array([[8, 0, 3], [3, 1, 8]], dtype=np.int64)
    (y,) = _run([node], inits, {"ids": ids}, ["Y"])
    assert y.dtype == scale_dtype and y.shape == (2, 3, hidden)
    tol = 1e-6 if scale_dtype == np.float32 else 2e-3
    np.testing.assert_allclose(y, ref[ids], rtol=tol, atol=tol * 0.1)


def test_ort_cpu_rejects_8bit_float_zero_points():
    # Why to_matmul_nbits refuses them: the CPU kernel fails at session creation.
    b = np.zeros((3, 1, 16), np.uint8)
    inits = {"B": b, "scales": np.ones(3, np.float32), "zp": np.zeros(3, np.float32)}
    node = helper.make_node(
        "MatMulNBits",
        ["A", *inits],
        ["Y"],
        domain="com.microsoft",
        K=16,
        N=3,
        bits=8,
        block_size=16,
    )
    with pytest.raises(Exception, match="floating-point zero points"):
        _run([node], inits, {"A": np.ones((1, 16), np.float32)}, ["Y"])


def test_gather_rejects_float_zero_points_and_odd_hidden():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="uint8 zero points"):
        to_gather_block_quantized(_random_blocks(rng, 2, 1, 16, 4, "float"), 4, 16)
    with pytest.raises(ValueError, match="whole bytes"):
        to_gather_block_quantized(_random_blocks(rng, 2, 1, 16, 4, "none"), 4, 15)


def test_sharing_conditions():
    assert tied_table_sharing(10, 64, 4, 32, "none").shareable
    assert tied_table_sharing(10, 64, 8, 32, "uint8").shareable
    assert not tied_table_sharing(10, 72, 4, 32, "none").shareable
    assert not tied_table_sharing(10, 64, 4, 32, "float").shareable
    s = tied_table_sharing(10, 96, 4, 32, "uint8")
    assert s.reshapes == {
        "B": ((10, 3, 16), (10, 48)),
        "scales": ((30,), (10, 3)),
        "zero_points": ((20,), (10, 2)),
    }
    s2 = tied_table_sharing(10, 96, 4, 32, "uint8", flat=False)
    assert s2.reshapes["scales"] == ((10, 3), (10, 3))


@pytest.mark.parametrize("store_as", ["gather", "matmul"])
@pytest.mark.parametrize("kind", ["none", "uint8"])
@pytest.mark.parametrize("bits", [4, 8])
def test_tied_table_shared_bytes(bits, kind, store_as):
    rng = np.random.default_rng(bits)
    vocab, hidden, bs = 11, 96, 32
    blocks = _random_blocks(rng, vocab, hidden // bs, bs, bits, kind)
    mm = to_matmul_nbits(blocks, bits, hidden)
    gq = to_gather_block_quantized(blocks, bits, hidden)
    share = tied_table_sharing(vocab, hidden, bits, bs, kind)
    assert share.shareable
    pairs = {"B": (mm.b, gq.data), "scales": (mm.scales, gq.scales)}
    if kind == "uint8":
        pairs["zero_points"] = (mm.zero_points, gq.zero_points)
    assert set(pairs) == set(share.reshapes)
    for name, (m_arr, g_arr) in pairs.items():
        assert m_arr.tobytes() == g_arr.tobytes(), name
        assert (m_arr.shape, g_arr.shape) == share.reshapes[name]

    # One stored copy feeds both nodes, the other layout comes through a Reshape.
    stored = {name: arrs[0 if store_as == "matmul" else 1] for name, arrs in pairs.items()}
    nodes, mm_in, g_in = [], {}, {}
    inits: dict[str, np.ndarray] = dict(stored)
    for name, (m_shape, g_shape) in share.reshapes.items():
        other = g_shape if store_as == "matmul" else m_shape
        inits[f"{name}_shape"] = np.array(other, dtype=np.int64)
        nodes.append(helper.make_node("Reshape", [name, f"{name}_shape"], [f"{name}_r"]))
        mm_in[name] = name if store_as == "matmul" else f"{name}_r"
        g_in[name] = f"{name}_r" if store_as == "matmul" else name
    zp = ["zero_points"] if kind == "uint8" else []
    nodes.append(
        helper.make_node(
            "MatMulNBits",
            ["A", *[mm_in[x] for x in ["B", "scales", *zp]]],
            ["Y"],
            domain="com.microsoft",
            **mm.attributes(),
        )
    )
    nodes.append(
        helper.make_node(
            "GatherBlockQuantized",
            [g_in["B"], "ids", *[g_in[x] for x in ["scales", *zp]]],
            ["E"],
            domain="com.microsoft",
            **gq.attributes(),
        )
    )
    ids = np.array([0, 10, 4], dtype=np.int64)
    y, e = _run(nodes, inits, {"A": np.eye(hidden, dtype=np.float32), "ids": ids}, ["Y", "E"])
    table = _reference_kn(blocks, bits, hidden).T
    np.testing.assert_allclose(y, table.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(e, table[ids], rtol=1e-6, atol=1e-6)
