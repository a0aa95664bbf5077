"""QuaRot's ONNX form (plugin bitpress-rotate): the rotation leaves a decoder's outputs unchanged.

The decoders are built here in the layouts of the ONNX Runtime GenAI builder and of mobius:
``GroupQueryAttention`` with rotary embedding, ``SkipSimplifiedLayerNormalization`` between layers,

* Llama-shaped: packed q|k|v MatMul, tied embedding (a Transpose of the LM head's weight feeds the
  Gather) or untied;
* Qwen-shaped: like Llama with a q|k|v bias;
* Gemma-shaped: separate q / k / v MatMuls, the embedding scaled by sqrt(hidden), norm scales computed
  as ``1 + w``, and sandwich norms (``RMSNormalization`` on the attention and MLP outputs before they
  join the residual stream), tied or untied.

Weights are random, norm scales include a few near-zero channels (as real models have), and a width
that is no power of two (48 = 12 x 4) takes a Paley Hadamard matrix.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import bitpress
from bitpress.errors import OptionError, UsageError
from bitpress.models.onnx_model import OnnxModel
from bitpress.passes import PassContext
from bitpress.testing import op_counts

pytest.importorskip("bitpress_rotate")
from bitpress_rotate.matrices import hadamard, hadamard_order_parts, orthogonal
from bitpress_rotate.passes import QuarotPass

VOCAB, LAYERS, HEAD_DIM, CONTEXT = 96, 2, 16, 64


class _G:
    def __init__(self, seed: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def w(self, name: str, shape: tuple[int, ...], scale: float = 0.1) -> str:
        self.inits.append(numpy_helper.from_array((self.rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def gamma(self, name: str, hidden: int, offset: float = 0.0) -> str:
        g = self.rng.uniform(0.2, 2.0, hidden).astype(np.float32)
        g[self.rng.choice(hidden, 2, replace=False)] = 1e-3  # channels a layer ignores
        return self.const(name, g - offset)

    def node(self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        self.n += 1
        outs = [f"{op.lower()}_{self.n}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=f"/{op}_{self.n}", domain=domain, **attrs))
        return outs


def build_decoder(kind: str, tied: bool, hidden: int = 64, seed: int = 0) -> onnx.ModelProto:
    """A random decoder of ``kind`` llama | qwen | gemma (see the module docstring)."""
    g = _G(seed)
    heads, kv = hidden // HEAD_DIM, max(1, hidden // HEAD_DIM // 2)
    inter = 2 * hidden
    gemma = kind == "gemma"
    if tied:
        table = g.w("lm_head.weight", (hidden, VOCAB), 0.5)
        (t,) = g.node("Transpose", [table], perm=[1, 0])
        (x,) = g.node("Gather", [t, "input_ids"])
    else:
        (x,) = g.node("Gather", [g.w("embed.weight", (VOCAB, hidden), 0.5), "input_ids"])
        table = g.w("lm_head.weight", (hidden, VOCAB), 0.5)
    if gemma:
        (x,) = g.node("Mul", [x, g.const("scale", np.array(hidden**0.5, np.float32))])
    inv = 1.0 / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    freqs = np.outer(np.arange(CONTEXT), inv)
    cos, sin = g.const("cos", np.cos(freqs).astype(np.float32)), g.const("sin", np.sin(freqs).astype(np.float32))

    def scale(name: str) -> str:
        if not gemma:
            return g.gamma(name, hidden)
        (s,) = g.node("Add", [g.gamma(name, hidden, offset=1.0), g.const(name + ".one", np.array(1.0, np.float32))])
        return s

    def rms(value: str, name: str) -> str:
        if gemma:
            return g.node("RMSNormalization", [value, scale(name)], epsilon=1e-6)[0]
        return g.node("SimplifiedLayerNormalization", [value, scale(name)], epsilon=1e-6, axis=-1)[0]

    residual, normed = x, rms(x, "l0.input_norm")
    for layer in range(LAYERS):
        p = f"l{layer}"
        if gemma:
            q = g.node("MatMul", [normed, g.w(f"{p}.q", (hidden, heads * HEAD_DIM))])[0]
            k = g.node("MatMul", [normed, g.w(f"{p}.k", (hidden, kv * HEAD_DIM))])[0]
            v = g.node("MatMul", [normed, g.w(f"{p}.v", (hidden, kv * HEAD_DIM))])[0]
            att_in = [q, k, v]
        else:
            (qkv,) = g.node("MatMul", [normed, g.w(f"{p}.qkv", (hidden, (heads + 2 * kv) * HEAD_DIM))])
            if kind == "qwen":
                (qkv,) = g.node("Add", [qkv, g.w(f"{p}.qkv_bias", ((heads + 2 * kv) * HEAD_DIM,), 0.5)])
            att_in = [qkv, "", ""]
        att = g.node("GroupQueryAttention", [*att_in, f"past.{layer}.key", f"past.{layer}.value", "seqlens_k",
                                             "total_sequence_length", cos, sin], 3, domain="com.microsoft",
                     num_heads=heads, kv_num_heads=kv, do_rotary=1, scale=HEAD_DIM**-0.5)[0]
        (o,) = g.node("MatMul", [att, g.w(f"{p}.o", (heads * HEAD_DIM, hidden))])
        if gemma:
            o = rms(o, f"{p}.post_attention_norm")
        normed, _, _, residual = g.node("SkipSimplifiedLayerNormalization",
                                        [residual, o, scale(f"{p}.pre_mlp_norm")], 4, domain="com.microsoft",
                                        epsilon=1e-6)
        (gate,) = g.node("MatMul", [normed, g.w(f"{p}.gate", (hidden, inter))])
        (up,) = g.node("MatMul", [normed, g.w(f"{p}.up", (hidden, inter))])
        (act,) = g.node("Gelu", [gate]) if gemma else g.node("Mul", [gate, g.node("Sigmoid", [gate])[0]])
        (h,) = g.node("Mul", [act, up])
        (down,) = g.node("MatMul", [h, g.w(f"{p}.down", (inter, hidden))])
        if gemma:
            down = rms(down, f"{p}.post_mlp_norm")
        normed, _, _, residual = g.node("SkipSimplifiedLayerNormalization",
                                        [residual, down, scale(f"l{layer + 1}.input_norm")], 4,
                                        domain="com.microsoft", epsilon=1e-6)
    g.node("MatMul", [normed, table])
    g.nodes[-1].output[0] = "logits"
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    for layer in range(LAYERS):
        for what in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past.{layer}.{what}", TensorProto.FLOAT,
                                                        [1, kv, "p", HEAD_DIM]))
    graph = helper.make_graph(g.nodes, f"{kind}-decoder", inputs,
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "s", VOCAB])],
                              g.inits)
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def _feeds(model: onnx.ModelProto, seq: int = 12, seed: int = 1) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, VOCAB, (1, seq))
    feeds = {"input_ids": ids, "seqlens_k": np.array([seq - 1], np.int32),
             "total_sequence_length": np.array(seq, np.int32)}
    for i in model.graph.input:
        if i.name.startswith("past."):
            kv = i.type.tensor_type.shape.dim[1].dim_value
            feeds[i.name] = np.zeros((1, kv, 0, HEAD_DIM), np.float32)
    return feeds


def _logits(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], feeds)[0]


def _rotate(model: onnx.ModelProto, tmp: Path, **options) -> tuple[Path, Path]:
    src = tmp / "float.onnx"
    onnx.save(model, src)
    out = tmp / "rotated.onnx"
    bitpress.quantize(src, out, algorithm="quarot", options=options)
    return src, out


@pytest.mark.parametrize(("kind", "tied", "hidden"), [
    ("llama", True, 64), ("llama", False, 64), ("llama", True, 48), ("qwen", False, 64), ("qwen", True, 48),
    ("gemma", True, 64), ("gemma", False, 64),
])
@pytest.mark.parametrize("mode", ["hadamard", "random"])
def test_rotation_keeps_outputs(tmp_path: Path, kind: str, tied: bool, hidden: int, mode: str) -> None:
    model = build_decoder(kind, tied, hidden)
    src, out = _rotate(model, tmp_path, rotate_mode=mode, seed=3)
    feeds = _feeds(model)
    before, after = _logits(src, feeds), _logits(out, feeds)
    assert np.abs(before).max() > 1.0  # the check is not vacuous
    np.testing.assert_allclose(after, before, rtol=0, atol=2e-4 * np.abs(before).max())
    rotated = onnx.load(out)
    weights = {t.name: numpy_helper.to_array(t) for t in rotated.graph.initializer}
    original = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    # the weights did change (a rotation, not a copy), and a tied table stayed one tensor
    assert not np.allclose(weights["l0.gate"], original["l0.gate"])
    assert not np.allclose(weights["l1.o"], original["l1.o"])
    assert ("embed.weight" in weights) == (not tied)
    online = [n for n in rotated.graph.node if n.name.endswith("quarot_online")]
    sandwich = 2 * LAYERS if kind == "gemma" else 0
    assert len(online) == int(tied) + sandwich
    # no norm keeps a scale: every one reads the shared vector of ones
    for n in rotated.graph.node:
        if n.op_type in ("SimplifiedLayerNormalization", "RMSNormalization", "SkipSimplifiedLayerNormalization"):
            scale = n.input[2 if n.op_type.startswith("Skip") else 1]
            assert np.all(weights[scale] == 1.0), n.name


def test_value_heads_are_rotated(tmp_path: Path) -> None:
    model = build_decoder("llama", True)
    _, out = _rotate(model, tmp_path)
    (tmp_path / "flat").mkdir()
    _, flat = _rotate(model, tmp_path / "flat", rotate_heads=False)
    heads = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    no_heads = {t.name: numpy_helper.to_array(t) for t in onnx.load(flat).graph.initializer}
    hidden = 64
    kv_cols = slice(-(hidden // HEAD_DIM // 2) * HEAD_DIM, None)
    # q and k columns are the same with or without R2; the value columns differ
    np.testing.assert_allclose(heads["l0.qkv"][:, :hidden], no_heads["l0.qkv"][:, :hidden], atol=1e-6)
    assert not np.allclose(heads["l0.qkv"][:, kv_cols], no_heads["l0.qkv"][:, kv_cols])


def test_rotation_then_quantization_keeps_the_online_product_float(tmp_path: Path) -> None:
    model = build_decoder("llama", True)
    src = tmp_path / "float.onnx"
    onnx.save(model, src)
    config = {"input": str(src), "output": str(tmp_path / "q.onnx"),
              "passes": [{"type": "QuaRot", "seed": 1}, {"type": "rtn", "precision": "int4", "block_size": 16}]}
    bitpress.run(config)
    q = onnx.load(tmp_path / "q.onnx")
    counts = op_counts(q)
    float_matmuls = [n for n in q.graph.node if n.op_type == "MatMul"]
    assert [n.name for n in float_matmuls] == [n.name for n in q.graph.node if n.name.endswith("quarot_online")]
    assert counts["MatMulNBits"] == LAYERS * 5 + 1  # qkv, o, gate, up, down per layer, and the tied head
    assert counts["GatherBlockQuantized"] == 1  # the tied table: one quantized tensor for both ends
    # the quantized rotated model still runs and stays close to the float one
    feeds = _feeds(model)
    before, after = _logits(src, feeds), _logits(tmp_path / "q.onnx", feeds)
    assert np.corrcoef(before.ravel(), after.ravel())[0, 1] > 0.9


def test_hadamard_orders() -> None:
    for n in (1, 2, 4, 12, 20, 28, 36, 48, 64, 576, 640, 896, 1536, 2048):
        h = hadamard(n)
        np.testing.assert_array_equal(h @ h.T, n * np.eye(n))
    assert hadamard_order_parts(576) == (36, 16)
    assert hadamard_order_parts(100) is None
    with pytest.raises(ValueError, match="order 100"):
        hadamard(100)
    rng = np.random.default_rng(0)
    for mode in ("hadamard", "random"):
        q = orthogonal(48, mode, rng)
        np.testing.assert_allclose(q @ q.T, np.eye(48), atol=1e-12)
    a = orthogonal(64, "hadamard", np.random.default_rng(5))
    np.testing.assert_array_equal(a, orthogonal(64, "hadamard", np.random.default_rng(5)))


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="rotate_mode"):
        QuarotPass.from_config({"rotate_mode": "learned"})
    # a hidden size without a known Hadamard matrix (688 = 43 x 16): the user is told to use random
    assert hadamard_order_parts(688) is None
    model = build_decoder("llama", False, hidden=688)
    onnx.save(model, tmp_path / "m688.onnx")
    with pytest.raises(UsageError, match=r"order 688 .*rotate_mode=random"):
        QuarotPass.from_config({}).run(OnnxModel.load(tmp_path / "m688.onnx"), PassContext())
    QuarotPass.from_config({"rotate_mode": "random"}).run(OnnxModel.load(tmp_path / "m688.onnx"), PassContext())
    # something on the stream the rotation cannot pass through, named
    model = build_decoder("llama", False)
    first_norm = next(n for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization")
    model.graph.node.append(helper.make_node("Relu", [first_norm.input[0]], ["relu_out"], name="stray_relu"))
    model.graph.output.append(helper.make_tensor_value_info("relu_out", TensorProto.FLOAT, None))
    onnx.save(model, tmp_path / "stray.onnx")
    with pytest.raises(UsageError, match="Relu stray_relu reads the residual stream"):
        QuarotPass.from_config({}).run(OnnxModel.load(tmp_path / "stray.onnx"), PassContext())
    # an encoder-like graph without a token embedding
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm", [x], [y], [w])
    onnx.save(helper.make_model(g), tmp_path / "mm.onnx")
    with pytest.raises(UsageError, match="one token embedding"):
        QuarotPass.from_config({}).run(OnnxModel.load(tmp_path / "mm.onnx"), PassContext())


def test_cli_writes_a_rotated_package(tmp_path: Path) -> None:
    """A GenAI-style folder in, the same folder layout out; the companion files carried over."""
    from bitpress.cli import main

    folder = tmp_path / "pkg"
    folder.mkdir()
    onnx.save(build_decoder("qwen", True), folder / "model.onnx")
    (folder / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "model.onnx"}}}))
    assert main(["quantize", "-m", str(folder), "-o", str(tmp_path / "out"), "--algorithm", "QuaRot"]) == 0
    assert (tmp_path / "out" / "genai_config.json").read_text() == (folder / "genai_config.json").read_text()
    feeds = _feeds(onnx.load(folder / "model.onnx"))
    np.testing.assert_allclose(_logits(tmp_path / "out" / "model.onnx", feeds), _logits(folder / "model.onnx", feeds),
                               atol=1e-3)
