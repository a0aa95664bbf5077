"""GGUF blocks in ONNX Runtime's form: (q - zero) * scale equals llama.cpp's dequantization (gguf.quants)."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("bitpress_gguf")

from bitpress_gguf.codec import TYPES, decode, pack, two_terms  # noqa: E402


def _ulps(a: np.ndarray, b: np.ndarray, magnitude: np.ndarray) -> float:
    """Largest ``|a - b|`` in float32 ulps of ``magnitude`` (the size of the terms each value is computed
    from: ``s * q - m`` near zero cancels, so the value's own ulp would say nothing)."""
    spacing = np.spacing(np.maximum(np.abs(magnitude), np.finfo(np.float32).tiny).astype(np.float32))
    return float((np.abs(a.astype(np.float64) - b.astype(np.float64)) / spacing).max()) if a.size else 0.0


def _terms(blocks: object) -> np.ndarray:
    """Per value, the largest of |q * s| and |zero * s|: what llama.cpp's s * q - m is computed from."""
    b = blocks  # Blocks
    n, e = b.ints.shape  # type: ignore[attr-defined]
    sub = b.info.block  # type: ignore[attr-defined]
    q = b.ints.reshape(n, e // sub, sub).astype(np.float32)  # type: ignore[attr-defined]
    s = b.scale[..., None]  # type: ignore[attr-defined]
    z = b.zero.astype(np.float32)[..., None]  # type: ignore[attr-defined]
    return np.maximum(np.abs(q * s), np.abs(z * s)).reshape(n, e)


def _random_blocks(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Every bit pattern of the integer and scale fields; the f16 factors finite, some zero."""
    info = TYPES[name]
    raw = rng.integers(0, 256, (n, info.nbytes), dtype=np.uint8)
    f16_at = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[name]
    for i, at in enumerate(f16_at):
        v = rng.normal(0, 0.02, n).astype(np.float16)
        if i == 0:
            v[:: 7] = 0  # zero scales (with a minimum: the degenerate blocks)
        raw[:, at:at + 2] = v.view(np.uint8).reshape(n, 2)
    return raw


@pytest.mark.parametrize("name", sorted(TYPES))
def test_every_type_decodes_to_llama_cpp_values(name: str) -> None:
    rng = np.random.default_rng(sorted(TYPES).index(name))
    raw = _random_blocks(name, 512, rng)
    qtype = getattr(gguf.GGMLQuantizationType, name)
    want = gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], -1)
    blocks = decode(name, raw)
    info = TYPES[name]
    assert blocks.ints.shape == (512, info.elements) and blocks.ints.dtype == np.uint8
    assert int(blocks.ints.max()) < 2 ** info.bits
    assert blocks.scale.shape == (512, info.elements // info.block)
    got = blocks.values()
    if info.float_zero:
        assert blocks.zero.dtype == np.float32
        # one rounding more than llama.cpp's s * q - m: within 2 ulps of the terms it subtracts
        assert _ulps(got, want, _terms(blocks)) <= 2.0
    else:
        assert blocks.zero.dtype == np.uint8
        np.testing.assert_array_equal(got, want)  # the same float32 products, bit for bit


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q2_K", "Q5_K"])
def test_a_zero_scale_with_a_minimum_is_written_exactly(name: str) -> None:
    rng = np.random.default_rng(1)
    raw = _random_blocks(name, 256, rng)
    blocks = decode(name, raw)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).reshape(256, -1)
    assert blocks.degenerate > 0
    sub = TYPES[name].block
    const = np.ptp(want.reshape(256, -1, sub), axis=2) == 0
    dead = (blocks.ints.reshape(256, -1, sub) == 0).all(axis=2) & (blocks.zero == 1)
    np.testing.assert_array_equal(blocks.values().reshape(256, -1, sub)[dead], want.reshape(256, -1, sub)[dead])
    assert (const | ~dead).all()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_blocks_gguf_quantizes_itself_round_trip(name: str) -> None:
    """gguf's own quantizers (the types it has them for) on a float weight: the same values back."""
    rng = np.random.default_rng(2)
    w = rng.normal(0, 0.05, (8, 256)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, name)
    raw = gguf.quants.quantize(w, qtype).reshape(-1, TYPES[name].nbytes)
    want = gguf.quants.dequantize(raw, qtype).reshape(8, 256)
    blocks = decode(name, raw)
    got = blocks.values().reshape(8, 256)
    assert _ulps(got, want, _terms(blocks).reshape(8, 256)) <= (2.0 if TYPES[name].float_zero else 0.0)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_puts_the_lower_k_in_the_lower_bits(bits: int) -> None:
    ints = (np.arange(16).reshape(1, 16) % (1 << bits)).astype(np.uint8)
    packed = pack(ints, bits)
    assert packed.shape == (1, 16 * bits // 8)
    per = 8 // bits
    back = np.stack([(packed >> (i * bits)) & ((1 << bits) - 1) for i in range(per)], axis=-1).reshape(1, 16)
    np.testing.assert_array_equal(back, ints)


def _matmulnbits_weights(blocks: object, rows: int, k: int, *, split: bool = False) -> np.ndarray:
    """The weight [rows, K] ONNX Runtime's MatMulNBits computes from ``blocks``, read back through an identity
    input (float32 math: accuracy_level 0). ``split``: as the conversion writes Q5_1 / Q5_K, two 4-bit
    MatMulNBits (the low bits, the fifth bit: :func:`two_terms`) whose outputs are added."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    b = blocks  # Blocks of a [rows, K] tensor
    info = b.info  # type: ignore[attr-defined]
    nb = k // info.block
    ints = b.ints.reshape(rows, k)  # type: ignore[attr-defined]
    scale = b.scale.reshape(rows, nb)  # type: ignore[attr-defined]
    zero = b.zero.reshape(rows, nb)  # type: ignore[attr-defined]
    terms = [(ints, scale, zero, info.bits)]
    if split:
        low, high, high_scale, high_zero = two_terms(ints, scale, zero)
        terms = [(low, scale, zero, 4), (high, high_scale, high_zero, 4)]
    inits, nodes = [], []
    for i, (q, s, z, bits) in enumerate(terms):
        inits += [numpy_helper.from_array(pack(q, bits).reshape(rows, nb, -1), f"B{i}"),
                  numpy_helper.from_array(s, f"S{i}"),
                  numpy_helper.from_array(z if z.dtype == np.float32 or bits == 8 else pack(z, bits), f"Z{i}")]
        nodes.append(helper.make_node("MatMulNBits", ["X", f"B{i}", f"S{i}", f"Z{i}"], [f"Y{i}"],
                                      domain="com.microsoft", K=k, N=rows, bits=bits, block_size=info.block,
                                      accuracy_level=0))
    nodes.append(helper.make_node("Sum", [f"Y{i}" for i in range(len(terms))], ["Y"]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [k, k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [k, rows])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"X": np.eye(k, dtype=np.float32)})[0].T


@pytest.mark.parametrize("name", sorted(TYPES))
def test_onnx_runtime_computes_the_gguf_values(name: str) -> None:
    """The blocks as MatMulNBits initializers: ONNX Runtime's weight equals llama.cpp's (integer zero points bit
    for bit, float ones within float32 rounding of the terms; Q5_1 / Q5_K as two MatMulNBits added)."""
    rng = np.random.default_rng(10 + sorted(TYPES).index(name))
    rows, k = 8, 512
    info = TYPES[name]
    raw = _random_blocks(name, rows * k // info.elements, rng)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).reshape(rows, k)
    blocks = decode(name, raw)
    got = _matmulnbits_weights(blocks, rows, k, split=info.two_terms)
    if info.float_zero:
        assert _ulps(got, want, _terms(blocks).reshape(rows, k)) <= 4.0
    else:
        np.testing.assert_array_equal(got, want)


def test_onnx_runtime_refuses_float_zero_points_at_8_bits() -> None:
    """Why Q5_1 / Q5_K take two MatMulNBits: one 8-bit with float zero points fails until ONNX Runtime accepts
    it (then: write one)."""
    rng = np.random.default_rng(3)
    raw = _random_blocks("Q5_K", 8 * 512 // 256, rng)
    with pytest.raises(Exception, match="8-bit weights with floating-point zero points"):
        _matmulnbits_weights(decode("Q5_K", raw), 8, 512)
    assert TYPES["Q5_K"].two_terms and TYPES["Q5_1"].two_terms
    assert not any(t.two_terms for n, t in TYPES.items() if n not in ("Q5_1", "Q5_K"))


@pytest.mark.parametrize("name", ["Q5_1", "Q5_K"])
def test_two_terms_sum_to_the_blocks(name: str) -> None:
    """The low bits' and the fifth bit's terms add up to the blocks' values; a zero-scale block (integers 0)
    has no high term, and the high scales are 16 s exactly."""
    rng = np.random.default_rng(4)
    blocks = decode(name, _random_blocks(name, 256, rng))
    sub = TYPES[name].block
    n, e = blocks.ints.shape
    low, high, high_scale, high_zero = two_terms(blocks.ints, blocks.scale, blocks.zero)
    assert low.max() <= 15 and set(np.unique(high)) <= {0, 1} and high.any() and high_zero.dtype == np.uint8
    np.testing.assert_array_equal(high_scale / 16, blocks.scale)
    lo = (low.reshape(n, -1, sub).astype(np.float32) - blocks.zero[..., None]) * blocks.scale[..., None]
    hi = high.reshape(n, -1, sub).astype(np.float32) * high_scale[..., None]
    np.testing.assert_allclose((lo + hi).reshape(n, e), blocks.values(), rtol=0,
                               atol=4 * float(np.spacing(np.abs(_terms(blocks)).max())))
    dead = (blocks.zero == 1) & (blocks.ints.reshape(n, -1, sub) == 0).all(axis=2)
    assert blocks.degenerate and (high.reshape(n, -1, sub)[dead] == 0).all()
