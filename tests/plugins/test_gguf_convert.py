"""gguf_to_genai: tiny llama GGUFs written in the tests convert to packages equal to their float graphs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("bitpress_gguf")
pytest.importorskip("mobius")
pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")

from bitpress.errors import ExportError  # noqa: E402


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: the character standing for each byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 192, 4, 2, 2
VOCAB = 260


def _blocks(x: np.ndarray, t: str, rng: np.random.Generator) -> np.ndarray:
    """``x`` quantized by gguf where it can; the k-quants (gguf has no quantizer for them) as random blocks
    of every bit pattern with finite f16 factors (what they dequantize to is the model)."""
    qt = getattr(gguf.GGMLQuantizationType, t)
    try:
        return gguf.quants.quantize(x, qt)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qt]
        n = x.size // block
        raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
        f16 = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[t]
        for at in f16:
            # d, dmin >= 0 as llama.cpp's quantizers write them (minimums stored negated), small enough that random
            # 6-bit sub-scales give weights of a real model's size (larger ones saturate the tiny model's
            # attention, which then amplifies accuracy_level 4's int8 activations tenfold)
            raw[:, at:at + 2] = np.abs(rng.normal(0, 0.00003, n)).astype(np.float16).view(np.uint8).reshape(n, 2)
        return raw.reshape(x.shape[0], -1)


def write_tiny(path: Path, types: dict[str, str], *, tied: bool = True, arch: str = "llama", seed: int = 0,
               hidden: int = 0, ffn: int = 0) -> Path:
    """A 2-layer llama GGUF with a byte-level BPE vocabulary; weights quantized by gguf's own quantizers
    (``types``: tensor role -> GGUF type; k-quants as random blocks, which need ``hidden`` 256)."""
    global HIDDEN, FFN
    HIDDEN, FFN = hidden or 64, ffn or 192
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    tokens = [*bytes_to_unicode(), "Ġt", "he", "Ġthe", "in"]
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["Ġ t", "h e", "Ġt he", "i n"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def add(name: str, shape: tuple[int, int], t: str) -> None:
        x = rng.normal(0, 0.08, shape).astype(np.float32)
        w.add_tensor(name, _blocks(x, t, rng), raw_dtype=getattr(gguf.GGMLQuantizationType, t))

    add("token_embd.weight", (VOCAB, HIDDEN), types.get("token_embd", "Q8_0"))
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + rng.normal(0, 0.05, HIDDEN)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + rng.normal(0, 0.05, HIDDEN)).astype(np.float32))
        for role, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (kv, HIDDEN)), ("attn_v", (kv, HIDDEN)),
                            ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (FFN, HIDDEN)),
                            ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))):
            add(f"blk.{i}.{role}.weight", shape, types.get(role, "Q4_0"))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    if not tied:
        add("output.weight", (VOCAB, HIDDEN), types.get("output", "Q8_0"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _run(src: Path, out: Path, **options: Any) -> Path:
    import bitpress

    bitpress.run({"input": str(src), "output": str(out), "passes": [{"type": "gguf_to_genai", **options}]})
    return out / src.stem


def _float_graph(src: Path, out: Path) -> Path:
    """mobius build-gguf's float graph of ``src``: the GGUF's dequantized model, the reference."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "mobius", "build-gguf", str(src), "-o", str(out), "--ep", "cpu",
                    "--dtype", "f32"], check=True, capture_output=True, env=env, timeout=600)
    return out / "model.onnx"


def _logits(model: Path, ids: list[int], accuracy_level: int | None = None) -> np.ndarray:
    """The model's logits for ``ids``; ``accuracy_level``: every MatMulNBits run at that level instead of its own
    (the same weights, ONNX Runtime's other kernel)."""
    import onnxruntime as ort

    source: str | bytes = str(model)
    if accuracy_level is not None:
        m = onnx.load(str(model))  # a tiny model: its data fits in one proto
        for n in m.graph.node:
            if n.op_type == "MatMulNBits":
                kept = [a for a in n.attribute if a.name != "accuracy_level"]
                del n.attribute[:]
                n.attribute.extend([*kept, onnx.helper.make_attribute("accuracy_level", accuracy_level)])
        source = m.SerializeToString()
    s = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    x = np.array([ids], np.int64)
    feed: dict[str, np.ndarray] = {"input_ids": x, "attention_mask": np.ones_like(x)}
    for i in s.get_inputs():
        if i.name.startswith("past"):
            feed[i.name] = np.zeros((1, KV_HEADS, 0, HIDDEN // HEADS), np.float32)
    return s.run(["logits"], feed)[0][0]


IDS = [1, 72, 101, 108, 108, 111, 259, 44, 33]
#: largest |logit - float graph's| / max |float logit| at accuracy_level 4 (int8 activations per block, about
#: 0.5 % of each MatMulNBits' largest output), measured on these tests' packages: 0.016 on AVX-512 VNNI kernels
#: and under ``qemu-x86_64 -cpu Haswell`` (AVX2, no AVX-512 / VNNI) alike; the bound leaves 3x. Not a bound
#: for any model: over 25 random tiny models (5 seeds of each test's types) the worst was 0.11, on both, where
#: a random q / k saturates the attention and amplifies the 0.4 % of its MatMulNBits
LEVEL4_BOUND = 0.05


def _weight_of(name: str, graph: onnx.GraphProto, array: Any, fixes: dict[str, Any]) -> tuple[np.ndarray, np.ndarray,
                                                                                               bool]:
    """The effective float32 ``[K, N]`` weight behind the package's tensor ``name`` (a MatMulNBits, its corrected
    sum, or the Concat of split parts), each value's ``|C|`` (0 where uncorrected) and whether any part is
    corrected."""
    from bitpress.onnx.correction import matmul_nbits_weight

    node = next(n for n in graph.node if name in n.output)
    if node.op_type == "Concat":
        parts = [_weight_of(i, graph, array, fixes) for i in node.input]
        return (np.concatenate([p[0] for p in parts], axis=1), np.concatenate([p[1] for p in parts], axis=1),
                any(p[2] for p in parts))
    fix = next((f for f in fixes.values() if f.add == node.name), None)
    mm = node if fix is None else next(n for n in graph.node if n.name == fix.node)
    assert mm.op_type == "MatMulNBits", name
    w = matmul_nbits_weight(mm, array, fix)
    if fix is None:
        return w, np.zeros_like(w), False
    block = next(a.i for a in mm.attribute if a.name == "block_size")
    return w, np.abs(array(fix.c))[np.arange(w.shape[0]) // block], True


def _check_package(pkg: Path, float_model: Path) -> dict[str, int]:
    """What every converted package holds: no float zero points, no slow node at its accuracy_level, every MatMul
    on an initializer part of a block-sum correction, and each weight llama.cpp's values (the float graph's: bit
    for bit for integer zero points; float minimums within 1 ulp of the larger of the value and its block's
    correction, and bit for bit on at least 99.9 % of them). Returns how many weights were checked, by kind."""
    from onnx import numpy_helper

    from bitpress.onnx.correction import find_corrections
    from bitpress.onnx.kernels import graph_paths

    g = onnx.load(str(pkg / "model.onnx")).graph
    inits = {t.name: t for t in g.initializer}
    assert graph_paths(g).slow() == {}
    for n in g.node:
        if n.op_type == "MatMulNBits" and len(n.input) > 3 and n.input[3]:
            assert inits[n.input[3]].data_type == onnx.TensorProto.UINT8, n.name
    fixes = find_corrections(g)
    es = {f.e for f in fixes.values()}
    on_inits = [n for n in g.node if n.op_type == "MatMul" and n.input[1] in inits]
    assert all(n.input[1] in es | {f.c for f in fixes.values()} for n in on_inits), [n.name for n in on_inits]
    sums = [(n.input[0], n.input[1]) for n in on_inits if n.input[1] in es]
    assert len(sums) == len(set(sums))  # an input's block sums computed once

    def array(name: str) -> np.ndarray:
        return numpy_helper.to_array(inits[name])

    ref = onnx.load(str(float_model)).graph
    ref_inits = {t.name: t for t in ref.initializer}
    checked = {"exact": 0, "corrected": 0}
    for n in ref.node:
        if n.op_type != "MatMul" or n.input[1] not in ref_inits:
            continue
        want = numpy_helper.to_array(ref_inits[n.input[1]])
        got, c, corrected = _weight_of(n.output[0], g, array, fixes)
        assert got.shape == want.shape, n.output[0]
        checked["corrected" if corrected else "exact"] += 1
        if not corrected:
            np.testing.assert_array_equal(got, want)
            continue
        tol = np.spacing(np.maximum(np.maximum(np.abs(want), c), np.finfo(np.float32).tiny))
        assert (np.abs(got - want) <= tol).all(), n.output[0]
        assert (got == want).mean() >= 0.999, n.output[0]
    return checked


def _check_logits(pkg: Path, float_model: Path) -> float:
    """At accuracy_level 0 the package computes the float graph's logits (1e-4 relative); as written (4 on cpu)
    within :data:`LEVEL4_BOUND` of the largest logit, the same argmax nearly everywhere. Returns that error."""
    want = _logits(float_model, IDS)
    got = _logits(pkg / "model.onnx", IDS, accuracy_level=0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert (got.argmax(-1) == want.argmax(-1)).all()
    shipped = _logits(pkg / "model.onnx", IDS)
    err = float(np.abs(shipped - want).max() / np.abs(want).max())
    assert err <= LEVEL4_BOUND, err
    return err


def _levels(g: onnx.GraphProto) -> set[int]:
    return {next((a.i for a in n.attribute if a.name == "accuracy_level"), 0) for n in g.node
            if n.op_type == "MatMulNBits"}


# q / k Q4_0 beside a Q8_0 v: the fused q/k/v holds 4-bit integers in 8 bits; Q4_1 / Q4_K-like float minima
MIXED = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
         "ffn_up": "Q5_0", "ffn_down": "Q8_0"}


@pytest.mark.parametrize("tied", [True, False])
def test_a_gguf_becomes_a_package_equal_to_its_dequantized_model(tmp_path: Path, tied: bool) -> None:
    src = write_tiny(tmp_path / "tiny.gguf", MIXED, tied=tied)
    before = src.read_bytes()
    pkg = _run(src, tmp_path / "out", check=True)
    assert src.read_bytes() == before
    names = {p.name for p in pkg.iterdir()}
    assert {"model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json", "tokenizer_config.json",
            "bitpress-manifest.json"} <= names
    cfg = json.loads((pkg / "genai_config.json").read_text())
    assert cfg["model"]["context_length"] == 128 and cfg["model"]["decoder"]["num_key_value_heads"] == 2
    assert "{% for m in messages %}" in (pkg / "chat_template.jinja").read_text() or "chat_template" in \
        json.loads((pkg / "tokenizer_config.json").read_text())
    g = onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in g.node]
    assert ops.count("MatMulNBits") == 2 * 5 + 1  # fused q/k/v, o, gate, up, down per layer + the head
    assert _levels(g) == {4}  # the cpu target's default
    bits = {n.name: {a.name: a.i for a in n.attribute} for n in g.node if n.op_type == "MatMulNBits"}
    qkv = [b for b in bits.values() if b["N"] == HIDDEN + 2 * HIDDEN // HEADS * KV_HEADS]
    assert qkv and qkv[0]["bits"] == 8 and qkv[0]["block_size"] == 32  # promoted, exactly
    floats = [t.name for t in g.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2
              and VOCAB in t.dims and HIDDEN in t.dims]
    assert not floats, floats  # no float table or head left
    tables = [t for t in g.initializer if t.data_type == onnx.TensorProto.UINT8 and t.dims and t.dims[0] == VOCAB
              and int(np.prod(t.dims[1:])) >= HIDDEN // 2]  # integers, not zero points
    assert len(tables) == (1 if tied else 2)  # tied: one table for the Gather and the head
    float_model = _float_graph(src, tmp_path / "float")
    # every projection and the head: the GGUF's blocks (Q4_1 o / gate corrected)
    assert _check_package(pkg, float_model) == {"exact": 2 * 3 + (0 if tied else 1), "corrected": 2 * 2}
    _check_logits(pkg, float_model)
    made = json.loads((pkg / "bitpress-manifest.json").read_text())["made"]
    assert made["checkpoint"] == "gguf" and made["tensors"]["quantized"] == 15 + (0 if tied else 1)
    assert made["tensors"]["corrected"] == 2 * LAYERS and made["accuracy_level"] == 4


def test_an_explicit_accuracy_level_wins(tmp_path: Path) -> None:
    """accuracy_level 0 (ONNX Runtime's float32 kernels: the float graph's logits, as before) is written as asked;
    ep cuda's default is 0 (the GenAI builder's choice there)."""
    from bitpress_gguf.convert import target_of
    from bitpress_gguf.passes import GgufToGenaiOptions

    from bitpress.onnx.kernels import resolve_accuracy_level

    src = write_tiny(tmp_path / "tiny.gguf", {"attn_output": "Q4_1", "ffn_up": "Q4_1"})
    pkg = _run(src, tmp_path / "out", accuracy_level=0, check=False)
    g = onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph
    assert _levels(g) == {0}
    want = _logits(_float_graph(src, tmp_path / "float"), IDS)
    np.testing.assert_allclose(_logits(pkg / "model.onnx", IDS), want, rtol=1e-4,
                               atol=1e-4 * float(np.abs(want).max()))
    assert [resolve_accuracy_level(None, target_of(ep)) for ep in ("cpu", "default", "webgpu", "cuda", "dml")] == \
        [4, 4, 4, 0, 0]
    with pytest.raises(ValueError, match=r"accuracy_level must be 0\.\.4"):
        GgufToGenaiOptions(accuracy_level=7).validate()


def test_k_quants_mixed_like_q4_k_m_convert_exactly(tmp_path: Path) -> None:
    """Q4_K q / k beside a Q6_K v (one MatMulNBits each, concatenated: the 4-bit parts stay 4-bit), Q3_K, Q2_K
    (its 2-bit integers held in 4 bits), Q6_K, Q5_0: llama.cpp's weights, the float graph's logits."""
    types = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q3_K", "ffn_gate": "Q2_K",
             "ffn_up": "Q5_0", "ffn_down": "Q6_K"}
    src = write_tiny(tmp_path / "tiny.gguf", types, hidden=256, ffn=512)
    pkg = _run(src, tmp_path / "out")
    g = onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in g.node]
    assert ops.count("Concat") >= LAYERS
    bits = sorted({(a.i, b.i) for n in g.node if n.op_type == "MatMulNBits" for a in n.attribute
                   for b in n.attribute if a.name == "bits" and b.name == "block_size"})
    assert bits == [(4, 16), (4, 32), (8, 16), (8, 32)]
    float_model = _float_graph(src, tmp_path / "float")
    # q / k / v (split: two parts corrected), gate (Q2_K) corrected; o, up, down exact (the tied head reads the
    # float graph's table through a Transpose: the table's blocks are integers, gathered)
    assert _check_package(pkg, float_model) == {"exact": 3 * LAYERS, "corrected": 2 * LAYERS}
    _check_logits(pkg, float_model)
    stats = json.loads((pkg / "bitpress-manifest.json").read_text())["made"]["tensors"]
    assert stats["split"] == LAYERS and stats["corrected"] == 3 * LAYERS


@pytest.mark.parametrize(("types", "corrected", "shared"), [
    # Q5_K_M-like: Q5_K q / k beside a Q6_K v (stacked: 8 bits, Q6_K's correction 0), Q5_1 o / up, Q6_K down
    ({"attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_1", "ffn_gate": "Q5_K",
      "ffn_up": "Q5_1", "ffn_down": "Q6_K"}, 4, 1),
    # q / k / v all Q5_K; gate Q4_K and up Q5_K share their input's block sums
    ({"attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q5_K", "attn_output": "Q5_K", "ffn_gate": "Q4_K",
      "ffn_up": "Q5_K", "ffn_down": "Q5_1"}, 5, 1),
])
def test_q5_types_convert_exactly_as_one_8_bit_weight(tmp_path: Path, types: dict[str, str], corrected: int,
                                                     shared: int) -> None:
    """Q5_1 / Q5_K (5-bit integers with a float minimum): one 8-bit MatMulNBits with uint8 zero points and the
    block-sum correction, on ONNX Runtime's int8 kernel; llama.cpp's weights, the float graph's logits."""
    src = write_tiny(tmp_path / "tiny.gguf", types, hidden=256, ffn=512)
    pkg = _run(src, tmp_path / "out")
    g = onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in g.node]
    assert "Concat" not in ops and ops.count("MatMulNBits") == 5 * LAYERS + 1
    bits = [a.i for n in g.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"]
    assert bits.count(4) == (LAYERS if "Q4_K" in types.values() else 0)  # the rest, Q5 / Q6_K / the head: 8
    float_model = _float_graph(src, tmp_path / "float")
    checked = _check_package(pkg, float_model)
    assert checked == {"exact": (5 - corrected) * LAYERS, "corrected": corrected * LAYERS}
    sums = [n for n in g.node if n.op_type == "MatMul" and n.name.endswith("_BlockSums")]
    assert len(sums) == (corrected - shared) * LAYERS  # gate / up: one block sum for both
    _check_logits(pkg, float_model)
    stats = json.loads((pkg / "bitpress-manifest.json").read_text())["made"]["tensors"]
    assert stats["quantized"] == 7 * LAYERS + 1 and stats["corrected"] == corrected * LAYERS
    assert "split" not in stats


def test_export_cli_takes_a_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bitpress.cli import main

    src = write_tiny(tmp_path / "tiny.gguf", {})
    assert main(["export", str(src), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tiny" / "genai_config.json").exists()
    assert main(["export", str(src), "-o", str(tmp_path / "o2"), "--dtype", "f16"]) != 0
    assert "only --ep and --option" in capsys.readouterr().err


@pytest.mark.parametrize(("types", "arch", "match"), [
    ({"token_embd": "Q5_1"}, "llama", r"token_embd.weight \(Q5_1: float zero points, which GatherBlockQuantized"),
    ({"token_embd": "Q4_1"}, "llama", r"token_embd.weight \(Q4_1: float zero points, which GatherBlockQuantized"),
    ({}, "qwen2", r"architecture 'qwen2' is not converted: its exporter graph is not verified .*converted: llama, "
                  r"gemma3"),
])
def test_what_has_no_exact_form_is_refused_before_any_build(tmp_path: Path, types: dict[str, str], arch: str,
                                                          match: str) -> None:
    src = write_tiny(tmp_path / "tiny.gguf", types, arch=arch)
    with pytest.raises(ExportError, match=match):
        _run(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_requantize_redoes_the_named_tensors_from_their_dequantized_values(tmp_path: Path) -> None:
    """The Q8_0 table to 4 bits with k-quant (the tied head follows: one table); the rest stays the GGUF's."""
    src = write_tiny(tmp_path / "tiny.gguf", MIXED)
    spec = {"tensors": ["token_embd.weight"], "pass": "kquant", "options": {"bits": 4, "block_size": 32}}
    pkg = _run(src, tmp_path / "out", requantize=spec)
    g = onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph
    gather = next(n for n in g.node if n.op_type == "GatherBlockQuantized")
    assert {a.name: a.i for a in gather.attribute}["bits"] == 4
    head = [n for n in g.node if n.op_type == "MatMulNBits" and {a.name: a.i for a in n.attribute}["N"] == VOCAB]
    assert len(head) == 1 and {a.name: a.i for a in head[0].attribute}["bits"] == 4
    ids = [1, 72, 101, 108, 108, 111, 259, 44, 33]
    want = _logits(_float_graph(src, tmp_path / "float"), ids)
    got = _logits(pkg / "model.onnx", ids)
    assert not np.allclose(got, want, rtol=1e-4, atol=1e-4)  # re-done: no longer the GGUF's values
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99
    made = json.loads((pkg / "bitpress-manifest.json").read_text())["made"]
    assert made["tensors"]["requantized"] == 1
    with pytest.raises(ExportError, match=r"requantize: 'blk\.9\.\*' matches no tensor"):
        _run(src, tmp_path / "o2", requantize={"tensors": ["blk.9.*"], "pass": "kquant"})
