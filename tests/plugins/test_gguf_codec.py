"""GGUF blocks in ONNX Runtime's form: (q - zero) * scale equals llama.cpp's dequantization (gguf.quants)."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("bitpress_gguf")

from bitpress_gguf.codec import TYPES, Blocks, decode, integer_form, pack  # noqa: E402


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


def _written_bits(name: str) -> int:
    return TYPES[name].bits if TYPES[name].bits in (4, 8) else 4  # Q2_K's 2-bit integers held in 4 bits


def _integer_form_values(blocks: Blocks, bits: int) -> np.ndarray:
    """``s * (q - zi) + C`` per value, in float32 as ONNX Runtime adds them (the first term exact)."""
    assert blocks.minimum is not None
    zi, c = integer_form(blocks.scale, blocks.zero, blocks.minimum, bits)
    n, e = blocks.ints.shape
    q = blocks.ints.reshape(n, e // blocks.info.block, -1).astype(np.float32)
    main = (q - zi[..., None].astype(np.float32)) * blocks.scale[..., None]
    return (main + c[..., None]).reshape(n, e)


@pytest.mark.parametrize("name", sorted(n for n, t in TYPES.items() if t.float_zero))
def test_the_integer_form_of_a_float_minimum_is_llama_cpp_values(name: str) -> None:
    """uint8 ``zi = round(M / s)`` and ``C = s * zi - M`` rounded once from the GGUF's own ``M``: llama.cpp's
    float32 values bit for bit on random blocks (every bit pattern; 8 x 4096 blocks measured: all), within 1 ulp
    of the terms where ``C`` is not a float32; a zero-scale block keeps ``C = 0``."""
    worst, equal, total = 0.0, 0, 0
    for seed in range(4):
        rng = np.random.default_rng(200 + seed)
        raw = _random_blocks(name, 2048, rng)
        want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).reshape(raw.shape[0], -1)
        blocks = decode(name, raw)
        got = _integer_form_values(blocks, _written_bits(name))
        worst = max(worst, _ulps(got, want, _terms(blocks)))
        equal += int((got == want).sum())
        total += got.size
        zi, c = integer_form(blocks.scale, blocks.zero, blocks.minimum, _written_bits(name))  # type: ignore[arg-type]
        dead = (blocks.zero == 1) & (blocks.ints.reshape(*blocks.scale.shape, -1) == 0).all(axis=-1)
        assert dead.any() and (c[dead] == 0).all() and (zi[dead] == 1).all()
        assert int(zi.max()) <= 2 ** _written_bits(name) - 1
    assert worst <= 1.0
    assert equal / total >= 0.9999, equal / total


def _matmulnbits_weights(blocks: Blocks, rows: int, k: int, *, accuracy_level: int = 0) -> np.ndarray:
    """The weight [rows, K] ONNX Runtime computes from ``blocks`` written as the conversion writes them, read back
    through an identity input (float32 math: accuracy_level 0): a MatMulNBits with uint8 zero points, plus for a
    float minimum the block-sum correction ``MatMul(MatMul(X, E), C)`` (bitpress.onnx.correction)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from bitpress.onnx import correction

    info = blocks.info
    bits = _written_bits(info.name)
    nb = k // info.block
    ints = blocks.ints.reshape(rows, k)
    scale = blocks.scale.reshape(rows, nb)
    zero = blocks.zero.reshape(rows, nb)
    c = None
    if blocks.minimum is not None:
        zero, c = integer_form(scale, zero, blocks.minimum.reshape(rows, nb), bits)
    inits = [numpy_helper.from_array(pack(ints, bits).reshape(rows, nb, -1), "B"),
             numpy_helper.from_array(scale, "S"),
             numpy_helper.from_array(zero if bits == 8 else pack(zero, bits), "Z")]
    nodes = [helper.make_node("MatMulNBits", ["X", "B", "S", "Z"], ["Y" if c is None else "Y0"],
                              domain="com.microsoft", K=k, N=rows, bits=bits, block_size=info.block,
                              accuracy_level=accuracy_level)]
    if c is not None:
        inits += [numpy_helper.from_array(correction.block_sum_matrix(k, info.block), "E"),
                  numpy_helper.from_array(np.ascontiguousarray(c.T), "C")]
        nodes += correction.correction_nodes("X", "Y0", "Y", "E", "C", None, "fix")
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [k, k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [k, rows])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"X": np.eye(k, dtype=np.float32)})[0].T


@pytest.mark.parametrize("name", sorted(TYPES))
def test_onnx_runtime_computes_the_gguf_values(name: str) -> None:
    """The blocks as the conversion writes them: ONNX Runtime's weight equals llama.cpp's (integer zero points bit
    for bit; float minimums, uint8 zero points + correction, within 1 ulp of the terms; Q5_1 / Q5_K one 8-bit
    MatMulNBits)."""
    rng = np.random.default_rng(10 + sorted(TYPES).index(name))
    rows, k = 8, 512
    info = TYPES[name]
    raw = _random_blocks(name, rows * k // info.elements, rng)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).reshape(rows, k)
    blocks = decode(name, raw)
    got = _matmulnbits_weights(blocks, rows, k)
    if info.float_zero:
        assert _ulps(got, want, _terms(blocks).reshape(rows, k)) <= 1.0
    else:
        np.testing.assert_array_equal(got, want)
