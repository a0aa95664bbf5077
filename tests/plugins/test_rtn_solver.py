"""The RTN solver reproduces ONNX Runtime's MatMulNBitsQuantizer (DefaultWeightOnlyQuantConfig)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

from bitpress.onnx.layout import MatMulNBitsTensors, dequantize_matmul_nbits, pack_along_last, unpack_along_last
from bitpress.quant.solver import BlockSpec, dequantize
from bitpress_rtn.solver import rtn_packing_kernel, rtn_solver


def _weight(k: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(k * n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:, 1] = np.abs(w[:, 1])  # all-positive column: range widened to 0, max wins the sign
    w[:, 2] = -np.abs(w[:, 2])
    w[:, 3] = 0.0  # all-zero blocks: zero scale
    w[:, 4] = (np.arange(k) % 16 - 7.5) * 0.1  # lands near .5 ties
    w[:5, 5] = 40.0  # outliers
    return w


def _ort_quantize(w: np.ndarray, bits: int, block_size: int, symmetric: bool):
    """Run ORT's MatMulNBitsQuantizer on a one-MatMul model, return its MatMulNBits tensors."""
    # The quantizer module needs onnx_ir, which onnxruntime does not declare as a dependency.
    pytest.importorskip("onnx_ir")
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    k, n = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "W"], ["Y"])],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])],
        initializer=[numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric, bits=bits)
    quant = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, algo_config=config)
    quant.process()
    out = quant.model.model
    (node,) = out.graph.node
    assert node.op_type == "MatMulNBits"
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    b, scales, *zp = (inits[name] for name in node.input[1:])
    return MatMulNBitsTensors(b, scales, zp[0] if zp else None, k, n, bits, block_size)


def _ort_kernel(w: np.ndarray, bits: int, block_size: int, symmetric: bool):
    """Call the C++ kernels the quantizer wraps directly, with the buffers it would pass."""
    k, n = w.shape
    n_blocks = -(-k // block_size)
    src = np.zeros((n_blocks * block_size, n), np.float32)
    src[:k] = w
    b = np.zeros((n, n_blocks, block_size * bits // 8), np.uint8)
    scales = np.zeros((n, n_blocks), np.float32)
    zp = np.zeros((n, -(-n_blocks * bits // 8)), np.uint8)
    kernel = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    kernel(b, src, scales, zp, block_size, n, k, symmetric)
    return MatMulNBitsTensors(b, scales, None if symmetric else zp, k, n, bits, block_size)


def _solve(w: np.ndarray, spec: BlockSpec):
    k, n = w.shape
    n_blocks = -(-k // spec.block_size)
    padded = np.zeros((n, n_blocks * spec.block_size), np.float32)
    padded[:, :k] = w.T
    return rtn_solver(padded.reshape(n, n_blocks, spec.block_size), spec)


@pytest.mark.parametrize("source", [_ort_quantize, _ort_kernel], ids=["quantizer", "kernel"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_matches_ort(bits, block_size, symmetric, source):
    k, n = 2 * block_size + 40, 13  # K not a multiple of the block
    w = _weight(k, n)
    ort_t = source(w, bits, block_size, symmetric)
    mine = _solve(w, BlockSpec(bits=bits, block_size=block_size, symmetric=symmetric))
    n_blocks = mine.q.shape[1]

    np.testing.assert_array_equal(mine.scales, ort_t.scales.reshape(n, n_blocks))
    if symmetric:
        assert ort_t.zero_points is None and mine.zero_points is None
    else:
        ort_zp = unpack_along_last(ort_t.zero_points.reshape(n, -1), bits, n_blocks)
        np.testing.assert_array_equal(mine.zero_points, ort_zp)
    ort_q = unpack_along_last(ort_t.b, bits, block_size).reshape(n, -1)[:, :k]
    np.testing.assert_array_equal(mine.q.reshape(n, -1)[:, :k], ort_q)

    mine_w = dequantize(mine, bits).reshape(n, -1)[:, :k].T
    np.testing.assert_allclose(mine_w, dequantize_matmul_nbits(ort_t), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_maps_largest_magnitude_to_zero_code(bits):
    w = np.array([[[0.5, -2.0, 1.0, 0.0] * 4], [[3.0, -1.0, 0.25, 0.0] * 4]], np.float32)
    out = rtn_solver(w, BlockSpec(bits=bits, block_size=16, symmetric=True))
    half = 2 ** (bits - 1)
    np.testing.assert_allclose(out.scales[:, 0], [2.0 / half, -3.0 / half])
    assert out.q[0, 0, 1] == 0 and out.q[1, 0, 0] == 0  # the peak value gets code 0


def test_float_zero_points():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 4, 32)).astype(np.float32) + 0.7
    w[0, 0] = 0.0
    spec = BlockSpec(bits=4, block_size=32, symmetric=False, float_zero_points=True)
    out = rtn_solver(w, spec)
    assert out.zero_points.dtype == np.float32
    lo = np.minimum(w.min(-1), 0)
    safe = np.where(out.scales > 0, out.scales, 1)
    np.testing.assert_allclose(out.zero_points, np.where(out.scales > 0, -lo / safe, 0))
    assert out.zero_points[0, 0] == 0 and out.scales[0, 0] == 0
    err = np.abs(dequantize(out, 4) - w)
    assert np.all(err <= out.scales[..., None] / 2 + 1e-6)
    # The block minimum is represented exactly (up to rounding) instead of via a rounded zp.
    q_min = np.take_along_axis(out.q, w.argmin(-1)[..., None], -1)[..., 0]
    assert np.all(q_min[lo < 0] == 0)
    integer = rtn_solver(w, BlockSpec(bits=4, block_size=32, symmetric=False))
    assert err.mean() <= np.abs(dequantize(integer, 4) - w).mean()


def test_does_not_modify_input_and_validates():
    w = np.random.default_rng(0).standard_normal((2, 3, 16)).astype(np.float32)
    before = w.copy()
    rtn_solver(w, BlockSpec(bits=4, block_size=16, symmetric=False), np.ones(48, np.float32))
    np.testing.assert_array_equal(w, before)
    with pytest.raises(ValueError):
        rtn_solver(w, BlockSpec(bits=4, block_size=32, symmetric=False))


# -- the packing kernel: the same answer in the stored [K, N] layout ---------------------------------
def _kernel_vs_solver(w_kn: np.ndarray, spec: BlockSpec) -> None:
    k, n = w_kn.shape
    fast = rtn_packing_kernel(w_kn, spec)
    ref = rtn_solver(np.ascontiguousarray(w_kn.T).reshape(n, k // spec.block_size, spec.block_size), spec)
    np.testing.assert_array_equal(fast.packed, pack_along_last(ref.q, spec.bits))
    np.testing.assert_array_equal(fast.scales, ref.scales)
    if ref.zero_points is None:
        assert fast.zero_points is None
    else:
        assert fast.zero_points.dtype == ref.zero_points.dtype
        np.testing.assert_array_equal(fast.zero_points, ref.zero_points)


@pytest.mark.parametrize(("symmetric", "float_zp"), [(True, False), (False, False), (False, True)],
                         ids=["sym", "asym", "asym-float-zp"])
@pytest.mark.parametrize("block_size", [16, 32, 128, 256])
@pytest.mark.parametrize("bits", [4, 8])
def test_packing_kernel_equals_block_solver(bits, block_size, symmetric, float_zp):
    w = _weight(3 * block_size, 37)  # ties, all-zero, one-signed and outlier columns
    w[:, 6] = np.arange(3 * block_size) % 7 / np.float32(2) - 1.5  # exact halves after scaling
    w[:, 7] *= np.float32(1e-30)  # subnormal-sized scales
    _kernel_vs_solver(w, BlockSpec(bits, block_size, symmetric, float_zp))


@pytest.mark.parametrize("symmetric", [True, False])
def test_packing_kernel_equals_ort_kernel(symmetric):
    w = _weight(256, 96)
    fast = rtn_packing_kernel(w, BlockSpec(4, 32, symmetric))
    ort_t = _ort_kernel(w, 4, 32, symmetric)
    np.testing.assert_array_equal(fast.packed, ort_t.b)
    np.testing.assert_array_equal(fast.scales, ort_t.scales.reshape(96, -1))


def test_packing_kernel_declines_and_validates():
    w = np.ones((64, 8), np.float32)
    assert rtn_packing_kernel(w, BlockSpec(2, 32, True)) is None  # no ONNX layout for 2 bits
    with pytest.raises(ValueError, match="whole blocks"):
        rtn_packing_kernel(w[:40], BlockSpec(4, 32, True))
    before = w.copy()
    rtn_packing_kernel(w, BlockSpec(4, 32, False))
    np.testing.assert_array_equal(w, before)
