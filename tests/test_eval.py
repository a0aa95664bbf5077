"""``bitpress eval`` / ``bitpress.evaluate``: output errors, perplexity, per-tensor SQNR, reports.

Every model is built here (bitpress.synthetic, or a small KV-cache decoder written with
onnx.helper) and quantized with the RTN plugin through ``bitpress.quantize``.
"""

from __future__ import annotations

import json
import math
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import bitpress
from bitpress.api import evaluate, quantize
from bitpress.errors import BitpressError, UsageError
from bitpress.evaluate import EvalError, EvalResult, ModelMismatchError
from bitpress.evaluate.metrics import OutputAccumulator, next_token_nll
from bitpress.evaluate.report import text_lines
from bitpress.evaluate.result import OutputMetrics
from bitpress.evaluate.weights import sqnr_db
from bitpress.plugins import Registry
from bitpress.synthetic import build_decoder, build_encoder, build_genai_folder

TINY = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256}
FAST = {"samples": 2, "seq_len": 16}


def rtn_registry() -> Registry:
    import bitpress_rtn

    reg = Registry(entry_points=False)
    reg.register(bitpress_rtn, name="rtn")
    return reg


def rtn(src: Path, dest: Path, precision: str, **options: Any) -> tuple[Path, dict[str, float]]:
    """Quantize with RTN; return the output and the quantizer's own relative error per weight."""
    result = quantize(src, dest, algorithm="rtn", precision=precision, options={"block_size": 32, **options},
                      registry=rtn_registry(), overwrite=True)
    errors: dict[str, float] = {}
    for _, _, report in result.reports:
        errors.update(report.errors)
    return result.output if result.output.suffix == ".onnx" else result.output / src.name, errors


@pytest.fixture(scope="module")
def dec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tied-head decoder in float, int4 and int8 (block 32: the tied table is quantized too)."""
    root = tmp_path_factory.mktemp("eval_dec")
    src = build_decoder(root / "float" / "model.onnx", **TINY)
    q4, err4 = rtn(src, root / "int4" / "model.onnx", "int4")
    q8, err8 = rtn(src, root / "int8" / "model.onnx", "int8")
    return {"root": root, "float": src, "int4": q4, "int8": q8, "err4": err4, "err8": err8}


def word_tokenizer(path: Path, words: int) -> Path:
    """A word-level tokenizer.json: ``<unk>`` = 0, ``w1`` .. ``w{words-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def word_text(path: Path, n: int, words: int, prefix: str = "w") -> Path:
    rng = np.random.default_rng(3)
    # a repeating phrase with noise: not uniform, so perplexities differ from the vocabulary size
    ids = [(i % 7) + 1 if rng.random() < 0.7 else int(rng.integers(1, words)) for i in range(n)]
    path.write_text(" ".join(f"{prefix}{i}" for i in ids) + "\n")
    return path


# -- metrics ----------------------------------------------------------------------------------------
def test_accumulator_matches_direct_formulas() -> None:
    rng = np.random.default_rng(0)
    ref = [rng.standard_normal((2, 5, 11)).astype(np.float32) for _ in range(3)]
    qnt = [r + 0.05 * rng.standard_normal(r.shape).astype(np.float32) for r in ref]
    acc = OutputAccumulator("logits", True)
    for r, q in zip(ref, qnt, strict=True):
        acc.add(r, q)
    m = acc.result()
    r, q = np.concatenate(ref).astype(np.float64).ravel(), np.concatenate(qnt).astype(np.float64).ravel()
    assert m.elements == r.size
    assert m.max_abs_error == pytest.approx(np.abs(q - r).max())
    assert m.mean_abs_error == pytest.approx(np.abs(q - r).mean())
    assert m.relative_l2 == pytest.approx(np.linalg.norm(q - r) / np.linalg.norm(r))
    assert m.cosine == pytest.approx(q @ r / np.linalg.norm(q) / np.linalg.norm(r))
    same = np.concatenate(ref).argmax(-1) == np.concatenate(qnt).argmax(-1)
    assert m.top1_agreement == pytest.approx(same.mean())
    assert 0 < m.top1_agreement < 1 or m.top1_agreement == 1  # computed, in range


def test_nll_of_uniform_logits_is_log_vocab() -> None:
    ids = np.array([[1, 5, 2, 7], [0, 3, 3, 9]])
    total, count = next_token_nll(np.zeros((2, 4, 10), np.float32), ids)
    assert count == 6
    assert total / count == pytest.approx(math.log(10))
    # a confident right prediction costs ~0
    logits = np.full((1, 3, 4), -30.0, np.float32)
    logits[0, 0, 2] = logits[0, 1, 3] = 30.0
    total, count = next_token_nll(logits, np.array([[0, 2, 3]]))
    assert count == 2 and total < 1e-6


def test_sqnr_definition() -> None:
    w = np.array([3.0, 4.0])
    assert sqnr_db(w, w)[0] == math.inf
    db, rel, mx = sqnr_db(w, w + np.array([0.5, 0.0]))
    assert db == pytest.approx(10 * math.log10(25 / 0.25))
    assert rel == pytest.approx(0.1) and mx == pytest.approx(0.5)


def test_text_report_folds_cache_outputs(tmp_path: Path) -> None:
    outs = [OutputMetrics("logits", [1, 4, 10], 40, 0.5, 0.1, 0.05, 0.99, 0.75, True)]
    outs += [OutputMetrics(f"present.{i}.key", [1, 2, 4, 8], 64, 0.1 * (i + 1), 0.01, 0.02 * (i + 1), 1 - 0.01 * i)
             for i in range(4)]
    res = EvalResult(tmp_path / "q.onnx", tmp_path / "r.onnx", "random", 1, 1, 4, 1, outs, weights_compared=False)
    lines = text_lines(res)
    assert not any(line.startswith("present.0") for line in lines)
    (row,) = [line for line in lines if line.startswith("present.*")]
    assert "(4, worst)" in row and "0.08" in row and "0.970000" in row  # largest rel L2, lowest cosine
    assert any("75.00%" in line for line in lines) and any("--no-weights" in line for line in lines)
    page = res.to_json()
    assert page["weights_compared"] is False and len(page["outputs"]) == 5


# -- outputs and weights ------------------------------------------------------------------------------
def test_identical_models_have_zero_error(dec: dict[str, Any]) -> None:
    res = evaluate(dec["float"], dec["float"], **FAST)
    (out,) = res.outputs
    assert out.name == "logits" and out.is_logits
    assert out.max_abs_error == 0 and out.mean_abs_error == 0 and out.relative_l2 == 0
    assert out.cosine == pytest.approx(1.0, abs=1e-12)
    assert out.top1_agreement == 1.0
    assert out.shape == [1, 16, 256] and out.elements == 2 * 16 * 256
    assert res.tensors == []
    assert res.samples == 2 and any("random" in n for n in res.notes)


def test_int8_is_closer_than_int4(dec: dict[str, Any]) -> None:
    r4 = evaluate(dec["int4"], dec["float"], **FAST)
    r8 = evaluate(dec["int8"], dec["float"], **FAST)
    l4, l8 = r4.logits(), r8.logits()
    assert l4 is not None and l8 is not None
    assert 0 < l8.relative_l2 < l4.relative_l2 < 0.5
    assert l4.cosine < l8.cosine <= 1.0 and l4.cosine > 0.9
    assert l8.max_abs_error < l4.max_abs_error
    assert l4.top1_agreement is not None and l8.top1_agreement is not None
    assert l8.top1_agreement >= l4.top1_agreement > 0.5

    # every quantized weight is matched and its SQNR agrees with the quantizer's own error
    for res, errors in ((r4, dec["err4"]), (r8, dec["err8"])):
        assert {t.weight for t in res.tensors} == set(errors)
        for t in res.tensors:
            assert t.note == "" and t.sqnr_db is not None
            assert t.relative_error == pytest.approx(errors[t.weight], rel=1e-3)
            assert t.sqnr_db == pytest.approx(-20 * math.log10(errors[t.weight]), abs=0.01)
    s4 = {t.weight: t.sqnr_db for t in r4.tensors}
    s8 = {t.weight: t.sqnr_db for t in r8.tensors}
    for w in s4:
        assert s8[w] > s4[w] + 15  # ~6 dB per bit
    assert 12 < min(s4.values()) < 30 and min(s8.values()) > 35

    # the tied table is stored once: one row, read by the embedding gather and the LM head
    (tied,) = [t for t in r4.tensors if t.weight == "model.embed_tokens.weight"]
    assert tied.op_type == "GatherBlockQuantized" and len(tied.nodes) == 2
    assert tied.nodes[1].startswith("/lm_head/")
    # node order: the embedding first, the last layer's down_proj before the head
    order = [t.weight for t in r4.tensors]
    assert order[0] == "model.embed_tokens.weight" and order[-1] == "model.layers.1.mlp.down_proj.weight"


def test_gemm_and_untied_head_orientation(tmp_path: Path) -> None:
    """Square [out, in] Gemm(transB=1) weights and an untied head compare in the graph's orientation."""
    enc = build_encoder(tmp_path / "enc" / "model.onnx", hidden=64, layers=1)
    q, errors = rtn(enc, tmp_path / "enc8" / "model.onnx", "int8")
    res = evaluate(q, enc, **FAST)
    assert res.logits() is None and res.outputs[0].name == "last_hidden_state"
    assert res.outputs[0].top1_agreement is None
    gemm = [t for t in res.tensors if "dense" in t.weight and t.shape[0] == t.shape[1]]
    assert gemm, "expected square dense weights"
    for t in res.tensors:
        assert t.relative_error == pytest.approx(errors[t.weight], rel=1e-3), t.weight

    untied = build_decoder(tmp_path / "untied" / "model.onnx", **{**TINY, "tied": False, "layers": 1})
    q, errors = rtn(untied, tmp_path / "untied4" / "model.onnx", "int4", nodes_to_exclude=["/lm_head/MatMul"])
    res = evaluate(q, untied, **FAST)
    assert "lm_head.weight" not in {t.weight for t in res.tensors}
    for t in res.tensors:
        assert t.relative_error == pytest.approx(errors[t.weight], rel=1e-3), t.weight


def test_nf4_tensors_are_compared(dec: dict[str, Any], tmp_path: Path) -> None:
    res = quantize(dec["float"], tmp_path / "nf4" / "model.onnx", algorithm="nf4", precision="nf4",
                   registry=rtn_registry())
    r = evaluate(res.output, dec["float"], **FAST)
    assert r.tensors and all(t.op_type == "MatMulBnb4" and t.sqnr_db is not None for t in r.tensors)
    assert all(15 < t.sqnr_db < 30 for t in r.tensors)  # type: ignore[operator]


def test_npz_data_and_progress(dec: dict[str, Any], tmp_path: Path) -> None:
    ids = np.random.default_rng(1).integers(0, 256, size=(3, 12)).astype(np.int64)
    np.savez(tmp_path / "in.npz", input_ids=ids)
    calls: list[tuple[str, int]] = []

    class Bar:
        def __init__(self, total: int, desc: str) -> None:
            self.desc, self.n = desc, 0
            calls.append((desc, total))

        def update(self, n: int = 1) -> None:
            self.n += n

        def close(self) -> None:
            assert self.n == dict(calls)[self.desc]  # every unit of work was reported

    res = evaluate(dec["int4"], dec["float"], data=str(tmp_path / "in.npz"),
                   progress=lambda it, total, desc: Bar(total, desc))
    assert res.samples == 3 and res.outputs[0].shape == [1, 12, 256]
    assert res.data.endswith("in.npz") and not any("random" in n for n in res.notes)
    # one unit per quantized node: 15 tensors, the tied one read by two nodes
    assert ("comparing outputs", 3) in calls and ("weight error", 16) in calls


def test_bitpress_evaluate_is_callable(dec: dict[str, Any]) -> None:
    res = bitpress.evaluate(dec["int8"], dec["float"], samples=1, seq_len=8, weights=False)
    assert isinstance(res, EvalResult) and res.tensors == []
    from bitpress.evaluate import report

    assert bitpress.evaluate.report is report  # the package is still a package
    assert json.loads(json.dumps(res.to_json()))["outputs"][0]["name"] == "logits"


# -- KV cache -----------------------------------------------------------------------------------------
def build_kv_decoder(path: Path, *, vocab: int = 64, heads: int = 2, head_dim: int = 16, symbolic: bool = False,
                     static_past: int | None = None, seed: int = 0) -> Path:
    """One attention layer with a KV cache, as GenAI builder / Optimum exports take it.

    Inputs ``input_ids``, ``attention_mask`` (over past + current), ``position_ids``,
    ``past_key_values.0.key/value`` ``[batch, heads, past, head_dim]``; outputs ``logits`` and
    ``present.0.key/value`` (past concatenated with the window's keys / values).
    """
    rng = np.random.default_rng(seed)
    hidden = heads * head_dim

    def w(name: str, *shape: int) -> TensorProto:
        return numpy_helper.from_array((0.3 * rng.standard_normal(shape)).astype(np.float32), name)

    def c(name: str, value: Any, dtype: Any = np.int64) -> TensorProto:
        return numpy_helper.from_array(np.asarray(value, dtype), name)

    inits = [w("embed.weight", vocab, hidden), w("pos.weight", 256, hidden), w("q.weight", hidden, hidden),
             w("k.weight", hidden, hidden), w("v.weight", hidden, hidden), w("o.weight", hidden, hidden),
             w("head.weight", hidden, vocab), c("heads_shape", [0, 0, heads, head_dim]),
             c("hidden_shape", [0, 0, hidden]), c("scale", 1 / math.sqrt(head_dim), np.float32),
             c("one", 1.0, np.float32), c("neg", -1e4, np.float32), c("axes12", [1, 2])]
    n = helper.make_node
    nodes = [
        n("Gather", ["embed.weight", "input_ids"], ["tok"], name="/embed/Gather"),
        n("Gather", ["pos.weight", "position_ids"], ["pos"], name="/pos/Gather"),
        n("Add", ["tok", "pos"], ["x"], name="/Add"),
    ]
    for p in ("q", "k", "v"):
        nodes += [
            n("MatMul", ["x", f"{p}.weight"], [f"{p}_flat"], name=f"/attn/{p}_proj/MatMul"),
            n("Reshape", [f"{p}_flat", "heads_shape"], [f"{p}_4d"], name=f"/attn/{p}/Reshape"),
            n("Transpose", [f"{p}_4d"], [f"{p}_h"], name=f"/attn/{p}/Transpose", perm=[0, 2, 1, 3]),
        ]
    nodes += [
        n("Concat", ["past_key_values.0.key", "k_h"], ["present.0.key"], name="/attn/k/Concat", axis=2),
        n("Concat", ["past_key_values.0.value", "v_h"], ["present.0.value"], name="/attn/v/Concat", axis=2),
        n("Transpose", ["present.0.key"], ["kt"], name="/attn/kt", perm=[0, 1, 3, 2]),
        n("MatMul", ["q_h", "kt"], ["scores0"], name="/attn/scores"),
        n("Mul", ["scores0", "scale"], ["scores1"], name="/attn/scale"),
        n("Cast", ["attention_mask"], ["m"], name="/mask/Cast", to=TensorProto.FLOAT),
        n("Sub", ["one", "m"], ["m1"], name="/mask/Sub"),
        n("Mul", ["m1", "neg"], ["m2"], name="/mask/Mul"),
        n("Unsqueeze", ["m2", "axes12"], ["m3"], name="/mask/Unsqueeze"),
        n("Add", ["scores1", "m3"], ["scores"], name="/attn/mask"),
        n("Softmax", ["scores"], ["probs"], name="/attn/Softmax", axis=-1),
        n("MatMul", ["probs", "present.0.value"], ["ctx_h"], name="/attn/ctx"),
        n("Transpose", ["ctx_h"], ["ctx_t"], name="/attn/ctx/Transpose", perm=[0, 2, 1, 3]),
        n("Reshape", ["ctx_t", "hidden_shape"], ["ctx"], name="/attn/ctx/Reshape"),
        n("MatMul", ["ctx", "o.weight"], ["o"], name="/attn/o_proj/MatMul"),
        n("Add", ["x", "o"], ["h"], name="/Add_1"),
        n("MatMul", ["h", "head.weight"], ["logits"], name="/lm_head/MatMul"),
    ]
    kvh: int | str = "num_key_value_heads" if symbolic else heads
    hd: int | str = "head_size" if symbolic else head_dim
    past: int | str = static_past if static_past is not None else "past_sequence_length"
    total = "total_sequence_length"
    vi = helper.make_tensor_value_info
    inputs = [
        vi("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        vi("attention_mask", TensorProto.INT64, ["batch_size", total]),
        vi("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        vi("past_key_values.0.key", TensorProto.FLOAT, ["batch_size", kvh, past, hd]),
        vi("past_key_values.0.value", TensorProto.FLOAT, ["batch_size", kvh, past, hd]),
    ]
    outputs = [
        vi("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab]),
        vi("present.0.key", TensorProto.FLOAT, ["batch_size", kvh, total, hd]),
        vi("present.0.value", TensorProto.FLOAT, ["batch_size", kvh, total, hd]),
    ]
    graph = helper.make_graph(nodes, "kv_decoder", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def test_kv_cache_model(tmp_path: Path) -> None:
    src = build_kv_decoder(tmp_path / "kv" / "model.onnx")
    q, errors = rtn(src, tmp_path / "kv4" / "model.onnx", "int4", block_size=16)
    res = evaluate(q, src, samples=2, seq_len=12)
    by_name = {o.name: o for o in res.outputs}
    assert set(by_name) == {"logits", "present.0.key", "present.0.value"}
    assert by_name["logits"].is_logits and by_name["logits"].top1_agreement is not None
    assert not by_name["present.0.key"].is_logits
    # the cache was empty: present holds exactly the window
    assert by_name["present.0.key"].shape == [1, 2, 12, 16]
    assert 0 < by_name["logits"].relative_l2 < 0.5 and by_name["logits"].cosine > 0.9
    assert any("KV-cache" in n for n in res.notes)
    assert {t.weight for t in res.tensors} == set(errors)
    assert all(t.sqnr_db is not None and t.sqnr_db > 10 for t in res.tensors)

    same = evaluate(src, src, samples=1, seq_len=12, batch=2)
    assert all(o.max_abs_error == 0 and o.cosine == pytest.approx(1.0) for o in same.outputs)
    assert {o.name: o.shape for o in same.outputs}["present.0.value"] == [2, 2, 12, 16]


def test_kv_cache_folder_with_symbolic_heads(tmp_path: Path) -> None:
    """Head count / size as dim names: read from the folder's genai_config.json."""
    folders = {}
    for name, seed in (("float", 0), ("other", 1)):
        folder = tmp_path / name
        build_kv_decoder(folder / "decoder.onnx", symbolic=True, seed=seed)
        folders[name] = folder
    (folders["float"] / "extra.onnx").write_bytes((folders["float"] / "decoder.onnx").read_bytes())
    with pytest.raises(UsageError, match="several models"):
        evaluate(folders["other"], folders["float"], samples=1, seq_len=8)
    with pytest.raises(EvalError, match=r"genai_config\.json"):
        evaluate(folders["other"], folders["other"] / "decoder.onnx", samples=1, seq_len=8)
    cfg = {"model": {"decoder": {"filename": "decoder.onnx", "num_key_value_heads": 2, "head_size": 16}}}
    for folder in folders.values():
        (folder / "genai_config.json").write_text(json.dumps(cfg))
    res = evaluate(folders["other"], folders["float"], samples=1, seq_len=8)
    assert res.quantized.name == "decoder.onnx"
    assert {o.name: o.shape for o in res.outputs}["present.0.key"] == [1, 2, 8, 16]
    assert res.logits() is not None and res.logits().relative_l2 > 0.1  # type: ignore[union-attr]


def test_static_cache_is_fed_masked_zeros(tmp_path: Path) -> None:
    """A static cache (a number as past length): zeros of that capacity, masked out by attention_mask."""
    dyn = build_kv_decoder(tmp_path / "dyn.onnx")
    static = build_kv_decoder(tmp_path / "static.onnx", static_past=4)
    tok = word_tokenizer(tmp_path / "tok" / "tokenizer.json", 64)
    text = word_text(tmp_path / "t.txt", 40, 64)
    a = evaluate(dyn, dyn, text=text, tokenizer=tok, seq_len=8)
    b = evaluate(static, static, text=text, tokenizer=tok, seq_len=8)
    assert a.perplexity is not None and b.perplexity is not None
    assert b.perplexity.reference == pytest.approx(a.perplexity.reference, rel=1e-5)
    assert {o.name: o.shape for o in b.outputs}["present.0.key"] == [1, 2, 4 + 8, 16]
    assert any("static cache 4" in n for n in b.notes), b.notes


# -- perplexity ---------------------------------------------------------------------------------------
def test_perplexity_identical_and_quantized(dec: dict[str, Any], tmp_path: Path) -> None:
    tok = word_tokenizer(tmp_path / "tok" / "tokenizer.json", 200)
    text = word_text(tmp_path / "text.txt", 330, 200)
    same = evaluate(dec["float"], dec["float"], text=text, tokenizer=tok, seq_len=32, batch=2)
    p = same.perplexity
    assert p is not None
    assert p.windows == 10 and p.seq_len == 32 and p.tokens == 10 * 31
    assert math.isfinite(p.reference) and p.reference > 1
    assert p.quantized == p.reference and p.relative_change == 0
    # without --data, the outputs are compared on the text windows in the same runs
    assert same.samples == 5 and "text.txt" in same.data and same.outputs[0].max_abs_error == 0

    q = evaluate(dec["int4"], dec["float"], text=text, tokenizer=tok, seq_len=32, max_windows=4, **{"samples": 1})
    assert q.perplexity is not None and q.perplexity.windows == 4
    assert math.isfinite(q.perplexity.quantized) and q.perplexity.quantized != q.perplexity.reference
    assert abs(q.perplexity.relative_change) < 0.2

    # with --data too, perplexity runs on the text and the comparison on the data
    both = evaluate(dec["int4"], dec["float"], data="random", text=text, tokenizer=tok, seq_len=32, samples=1)
    assert both.samples == 1 and both.perplexity is not None and both.perplexity.windows == 10
    # a text as --data goes through bitpress.calibration.data (windows of seq_len tokens)
    txt = evaluate(dec["int4"], dec["float"], data=str(text), tokenizer=tok, seq_len=32, samples=3)
    assert txt.samples == 3 and txt.perplexity is None and txt.data.endswith("text.txt")
    assert txt.outputs[0].shape == [1, 32, 256] and not any("random" in n for n in txt.notes)


def test_perplexity_on_genai_folder_finds_its_tokenizer(tmp_path: Path) -> None:
    ref = build_genai_folder(tmp_path / "float", hidden=64, layers=1)
    out = quantize(ref, tmp_path / "int4", algorithm="rtn", precision="int4", options={"block_size": 32},
                   registry=rtn_registry())
    text = word_text(tmp_path / "t.txt", 100, 256, prefix="tok")
    res = evaluate(out.output, ref, text=text, seq_len=20)
    assert res.quantized == out.output / "model.onnx"
    assert res.perplexity is not None and res.perplexity.windows == 5
    assert math.isfinite(res.perplexity.quantized)


def test_genai_folders_given_by_relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bitpress eval out --reference float`` from the folder above them: names are joined once."""
    ref = build_genai_folder(tmp_path / "float", hidden=64, layers=1)
    out = quantize(ref, tmp_path / "int4", algorithm="rtn", precision="int4", options={"block_size": 32},
                   registry=rtn_registry())
    word_text(tmp_path / "t.txt", 100, 256, prefix="tok")
    monkeypatch.chdir(tmp_path)
    res = evaluate(Path(out.output.name), Path("float"), text=Path("t.txt"), tokenizer=Path("float"), seq_len=20)
    assert res.perplexity is not None and res.perplexity.windows == 5


def test_perplexity_needs_tokenizer_and_package(dec: dict[str, Any], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    text = word_text(tmp_path / "t.txt", 50, 100)
    with pytest.raises(UsageError, match=r"no tokenizer\.json"):
        evaluate(dec["int4"], dec["float"], text=text, seq_len=8)
    tok = word_tokenizer(tmp_path / "tokenizer.json", 100)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(UsageError, match="'tokenizers' package"):
        evaluate(dec["int4"], dec["float"], text=text, tokenizer=tok, seq_len=8)


def test_tokenizer_larger_than_the_model_is_refused(dec: dict[str, Any], tmp_path: Path) -> None:
    tok = word_tokenizer(tmp_path / "tokenizer.json", 1000)
    text = tmp_path / "t.txt"
    text.write_text("w1 w999 w3 w4 w5 w6")
    with pytest.raises(UsageError, match="vocabulary has 256"):
        evaluate(dec["float"], dec["float"], text=text, tokenizer=tok, seq_len=4)


# -- errors -------------------------------------------------------------------------------------------
def test_mismatched_models(dec: dict[str, Any], tmp_path: Path) -> None:
    enc = build_encoder(tmp_path / "enc.onnx", hidden=64, layers=1)
    with pytest.raises(ModelMismatchError, match=r"different inputs.*attention_mask"):
        evaluate(dec["float"], enc)
    other_vocab = build_decoder(tmp_path / "v.onnx", **{**TINY, "vocab": 128})
    with pytest.raises(ModelMismatchError, match=r"vocabularies.*128.*256"):
        evaluate(other_vocab, dec["float"], samples=1, seq_len=8)
    narrow = build_encoder(tmp_path / "enc32.onnx", hidden=32, heads=2, layers=1)
    with pytest.raises(ModelMismatchError, match=r"last_hidden_state has shape \[1, 8, 32\].*\[1, 8, 64\]"):
        evaluate(narrow, enc, samples=1, seq_len=8, data={"source": "random", "seed": 0})
    with pytest.raises(BitpressError, match="not found"):
        evaluate(tmp_path / "missing.onnx", dec["float"])
    with pytest.raises(UsageError, match="samples"):
        evaluate(dec["float"], dec["float"], samples=0)


# -- CLI and reports ----------------------------------------------------------------------------------
class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def test_cli_json_and_html(dec: dict[str, Any], tmp_path: Path, run_cli: Any) -> None:
    report = tmp_path / "out" / "report.html"
    code, out, err = run_cli("eval", dec["int4"], "--reference", dec["float"], "--samples", "2", "--seq-len", "16",
                             "--json", "--html", report)
    assert code == 0, err
    data = json.loads(out)
    assert data["outputs"][0]["name"] == "logits" and data["outputs"][0]["top1_agreement"] > 0.5
    rows = {t["weight"]: t for t in data["tensors"]}
    assert len(rows) == 15 and all(isinstance(t["sqnr_db"], float) for t in rows.values())
    assert data["sqnr_summary"]["min_db"] == min(t["sqnr_db"] for t in rows.values())

    code, out8, err = run_cli("eval", dec["int8"], "--reference", dec["float"], "--samples", "1", "--seq-len", "8",
                              "--json")
    assert code == 0, err
    rows8 = {t["weight"]: t for t in json.loads(out8)["tensors"]}
    assert all(rows8[w]["sqnr_db"] > rows[w]["sqnr_db"] for w in rows)

    page = report.read_text()
    parser = _Tags()
    parser.feed(page)
    tags = {t for t, _ in parser.tags}
    assert "svg" in tags and "table" in tags
    assert not tags & {"script", "link", "img", "iframe", "object"}  # self-contained
    assert not re.search(r"(src|href)\s*=|@import|url\(", page)
    for weight in rows:
        assert weight in page
    worst = data["sqnr_summary"]["worst"]
    bars = [a for t, a in parser.tags if t == "rect"]
    assert len(bars) == 15
    red = [a for a in bars if a.get("fill") == "#cf222e"]
    assert len(red) == 1  # exactly one bar, the lowest SQNR, highlighted
    assert page.count('class="worst"') == 1 and worst in page.split('class="worst"')[1].split("</tr>")[0]

    code, out, err = run_cli("eval", dec["int4"], "--reference", dec["float"], "--samples", "1", "--seq-len", "8",
                             "--html", tmp_path / "r2.html")
    assert code == 0, err
    assert "logits" in out and "SQNR" in out and "wrote" in out and (tmp_path / "r2.html").exists()


def test_cli_exit_codes(dec: dict[str, Any], tmp_path: Path, run_cli: Any) -> None:
    code, out, err = run_cli("eval", dec["float"], "--reference", dec["float"], "--samples", "1", "--seq-len", "4")
    assert code == 0, err
    assert "100.00%" in out and "no MatMulNBits" in out
    code, _, err = run_cli("eval", tmp_path / "nope.onnx", "--reference", dec["float"])
    assert code == 1 and "not found" in err and "Traceback" not in err
    enc = build_encoder(tmp_path / "enc.onnx", hidden=64, layers=1)
    code, _, err = run_cli("eval", enc, "--reference", dec["float"])
    assert code == 1 and "different inputs" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli("eval", dec["float"])  # no --reference
    assert code == 2 and "--reference" in err
    code, _, err = run_cli("eval", dec["float"], "--reference", dec["float"], "--samples", "0")
    assert code == 2 and "samples" in err
    text = word_text(tmp_path / "t.txt", 40, 50)
    code, _, err = run_cli("eval", dec["float"], "--reference", dec["float"], "--text", text)
    assert code == 2 and "--tokenizer" in err
