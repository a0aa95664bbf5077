"""NF4 / FP4 packing matches ORT's quantize_matmul_bnb4 and runs in MatMulBnb4."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi._pybind_state import quantize_matmul_bnb4

from bitpress.onnx.bnb4 import BNB4_QUANT_TYPES, dequantize_bnb4, quantize_bnb4


def _weight(k: int, n: int, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((k, n))
    w[:, 0] = 0.0  # zero blocks
    w[: min(k, 8), 1] = [1, -1, 0.5, -0.5, 0.25, 1e-4, -1e-4, 0][: min(k, 8)]
    return w.astype(dtype)


def _ort_reference(w: np.ndarray, block_size: int, quant_type: str):
    # Same buffers MatMulBnb4Quantizer.bnb4_block_quant hands to the kernel.
    k, n = w.shape
    packed = np.zeros((k * n + 1) // 2, np.uint8)
    absmax = np.zeros(-(-k * n // block_size), w.dtype)
    quantize_matmul_bnb4(
        packed, np.ascontiguousarray(w.T), absmax, block_size, BNB4_QUANT_TYPES[quant_type], n, k
    )
    return packed, absmax


SHAPES = [(64, 8), (100, 7), (33, 5)]  # K a multiple of blocks, not, and an odd N*K


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bytes_match_ort(quant_type, block_size, shape, dtype):
    w = _weight(*shape, dtype=dtype)
    packed, absmax = quantize_bnb4(w, block_size, quant_type)
    ref_packed, ref_absmax = _ort_reference(w, block_size, quant_type)
    assert absmax.dtype == dtype
    np.testing.assert_array_equal(absmax, ref_absmax)
    np.testing.assert_array_equal(packed, ref_packed)


def _run_bnb4(packed, absmax, k, n, block_size, quant_type, a):
    node = helper.make_node(
        "MatMulBnb4",
        ["A", "B", "absmax"],
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        block_size=block_size,
        quant_type=BNB4_QUANT_TYPES[quant_type],
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(a.shape))],
        [helper.make_value_info("Y", onnx.TypeProto())],
        initializer=[
            numpy_helper.from_array(packed, "B"),
            numpy_helper.from_array(absmax, "absmax"),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": a})[0]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_matmul_bnb4_runs(quant_type, block_size, shape):
    k, n = shape
    w = _weight(k, n)
    packed, absmax = quantize_bnb4(w, block_size, quant_type)
    deq = dequantize_bnb4(packed, absmax, k, n, block_size, quant_type)
    assert deq.shape == (k, n)
    # Round trip error is bounded by the codebook spacing.
    per_elem = (np.arange(n * k) // block_size).reshape(n, k).T
    assert np.all(np.abs(deq - w) <= 0.5 * absmax[per_elem] + 1e-6)

    a = np.random.default_rng(1).standard_normal((4, k)).astype(np.float32)
    y = _run_bnb4(
        packed,
        absmax,
        k,
        n,
        block_size,
        quant_type,
        np.concatenate([np.eye(k, dtype=np.float32), a]),
    )
    np.testing.assert_allclose(y[:k], deq, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(y[k:], a @ deq, rtol=1e-4, atol=1e-4)


def test_codebook_and_nibble_order():
    w = np.array([[1.0], [-1.0], [0.0]], np.float32)  # K=3, N=1: one odd-length block
    packed, absmax = quantize_bnb4(w, 16, "nf4")
    assert absmax.tolist() == [1.0]
    # NF4: 1.0 -> 15, -1.0 -> 0, 0.0 -> 7; earlier element in the high nibble, pad = code(0.0)
    assert packed.tolist() == [0xF0, 0x77]
    packed, _ = quantize_bnb4(w, 16, "fp4")
    # FP4: 1.0 -> 0b0011, -1.0 -> 0b1011, 0.0 -> 0
    assert packed.tolist() == [0x3B, 0x00]
    with pytest.raises(ValueError):
        quantize_bnb4(w, 48, "nf4")
    with pytest.raises(ValueError):
        quantize_bnb4(w, 16, "int4")
