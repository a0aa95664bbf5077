"""Text calibration data on KV-cache exports (ONNX Runtime GenAI builder style), BOS, statistics.

Models are built here: the one-layer cache decoder of test_eval (``Concat`` of past and new
keys, dynamic past) in a GenAI package whose decoder sits in a sub-folder, and a
``GroupQueryAttention`` decoder shaped like the GenAI builder's Gemma-3 export (a sliding-window
layer whose cache must have the window's capacity, and a global layer with a dynamic past).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_eval import build_kv_decoder

from bitpress.calibration.data import DataConfig, iter_feeds
from bitpress.errors import UnsafePathError
from bitpress.genai.kvcache import cache_plan, kv_hints
from bitpress.models.onnx_model import OnnxModel
from bitpress.models.onnx_package import OnnxPackage
from bitpress.onnx.activations import channel_importance

pytest.importorskip("tokenizers")

BOS, VOCAB = 1, 64


def write_tokenizer(folder: Path, *, bos: str | None = "config", vocab: int = VOCAB) -> Path:
    """tokenizer.json (WordLevel: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``w3`` ..) and, per ``bos``:

    ``"config"``: tokenizer_config.json with ``add_bos_token: true``; ``"template"``: a
    ``<s> $A`` post-processor and no config; ``"off"``: the post-processor, but the config says
    ``add_bos_token: false``; ``None``: neither.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = {"<unk>": 0, "<s>": BOS, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos in ("template", "off"):
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if bos in ("config", "off"):
        cfg = {"add_bos_token": bos == "config", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder / "tokenizer.json"


def write_text(path: Path, n: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    # two vocabularies: texts of different seeds use different halves, so their statistics differ
    lo, hi = (3, VOCAB // 2) if seed % 2 == 0 else (VOCAB // 2, VOCAB)
    path.write_text(" ".join(f"w{i}" for i in rng.integers(lo, hi, n)))
    return path


def genai_config(filename: str, **decoder: Any) -> dict[str, Any]:
    return {"model": {"bos_token_id": BOS, "eos_token_id": 2, "type": "llama", "vocab_size": VOCAB,
                      "decoder": {"filename": filename, **decoder}},
            "search": {"max_length": 256, "past_present_share_buffer": False}}


@pytest.fixture
def concat_package(tmp_path: Path) -> Path:
    """A GenAI package with the decoder in ``decoder/`` and genai_config.json + tokenizer at the root.

    The cache dims are names (``num_key_value_heads``, ``head_size``): only the root's
    genai_config.json tells their sizes.
    """
    pkg = tmp_path / "pkg"
    build_kv_decoder(pkg / "decoder" / "model.onnx", symbolic=True)
    cfg = genai_config("decoder/model.onnx", num_key_value_heads=2, head_size=16, num_attention_heads=2,
                       hidden_size=32, num_hidden_layers=1)
    (pkg / "genai_config.json").write_text(json.dumps(cfg))
    write_tokenizer(pkg)
    return pkg


# -- a GroupQueryAttention decoder shaped like the GenAI builder's Gemma-3 export ------------------------
def build_gqa_decoder(folder: Path, *, window: int = 4, sliding: tuple[int, ...] = (0,), layers: int = 2,
                      heads: int = 2, kv_heads: int = 1, head_size: int = 16, seed: int = 0) -> Path:
    """``model.onnx`` + genai_config.json in ``folder`` (the builder's flat layout).

    Inputs ``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.{i}.key/value``
    ``[batch_size, kv_heads, past_sliding_length | past_sequence_length, kv_cache_dim]``;
    ``GroupQueryAttention`` takes ``seqlens_k`` / ``total_sequence_length`` from the mask as the
    builder computes them; the sliding layers have ``local_window_size`` and ``sliding_window_cache=1``
    (ONNX Runtime then needs a cache of at least the window's capacity).
    """
    rng = np.random.default_rng(seed)
    hidden = heads * head_size
    inits = []

    def w(name: str, *shape: int) -> str:
        inits.append(numpy_helper.from_array((0.3 * rng.standard_normal(shape)).astype(np.float32), name))
        return name

    def c(name: str, value: Any, dtype: Any = np.int64) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    n = helper.make_node
    nodes = [
        n("Gather", [w("embed.weight", VOCAB, hidden), "input_ids"], ["tok"], name="/embed/Gather"),
        n("Gather", [w("pos.weight", 256, hidden), "position_ids"], ["pos"], name="/pos/Gather"),
        n("Add", ["tok", "pos"], ["h0"], name="/Add"),
        n("ReduceSum", ["attention_mask", c("axis1", [1])], ["mask_sum"], name="/mask/ReduceSum", keepdims=0),
        n("Sub", ["mask_sum", c("one", 1)], ["mask_sub"], name="/mask/Sub"),
        n("Cast", ["mask_sub"], ["seqlens_k"], name="/mask/Cast", to=TensorProto.INT32),
        n("Shape", ["attention_mask"], ["mask_shape"], name="/mask/Shape"),
        n("Gather", ["mask_shape", c("idx1", 1)], ["total_len"], name="/mask/Gather", axis=0),
        n("Cast", ["total_len"], ["total_sequence_length"], name="/mask/Gather/Cast", to=TensorProto.INT32),
    ]
    vi = helper.make_tensor_value_info
    inputs = [vi("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              vi("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
              vi("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"])]
    outputs = [vi("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", VOCAB])]
    h = "h0"
    for i in range(layers):
        p = f"/model/layers.{i}/attn"
        past, total = ("past_sliding_length", "total_sliding_length") if i in sliding else (
            "past_sequence_length", "total_sequence_length")
        for kv in ("key", "value"):
            inputs.append(vi(f"past_key_values.{i}.{kv}", TensorProto.FLOAT, ["batch_size", kv_heads, past,
                                                                             "kv_cache_dim"]))
            outputs.append(vi(f"present.{i}.{kv}", TensorProto.FLOAT, ["batch_size", kv_heads, total,
                                                                      "kv_cache_dim"]))
        nodes += [
            n("MatMul", [h, w(f"layers.{i}.q.weight", hidden, hidden)], [f"{p}/q"], name=f"{p}/q_proj/MatMul"),
            n("MatMul", [h, w(f"layers.{i}.k.weight", hidden, kv_heads * head_size)], [f"{p}/k"],
              name=f"{p}/k_proj/MatMul"),
            n("MatMul", [h, w(f"layers.{i}.v.weight", hidden, kv_heads * head_size)], [f"{p}/v"],
              name=f"{p}/v_proj/MatMul"),
        ]
        attrs: dict[str, Any] = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": head_size ** -0.5}
        if i in sliding:
            attrs.update(local_window_size=window, sliding_window_cache=1)
        nodes += [
            n("GroupQueryAttention", [f"{p}/q", f"{p}/k", f"{p}/v", f"past_key_values.{i}.key",
                                      f"past_key_values.{i}.value", "seqlens_k", "total_sequence_length"],
              [f"{p}/out", f"present.{i}.key", f"present.{i}.value"], name=f"{p}/GroupQueryAttention",
              domain="com.microsoft", **attrs),
            n("MatMul", [f"{p}/out", w(f"layers.{i}.o.weight", hidden, hidden)], [f"{p}/o"],
              name=f"{p}/o_proj/MatMul"),
            n("Add", [h, f"{p}/o"], [f"h{i + 1}"], name=f"/model/layers.{i}/Add"),
        ]
        h = f"h{i + 1}"
    nodes.append(n("MatMul", [h, w("lm_head.weight", hidden, VOCAB)], ["logits"], name="/lm_head/MatMul"))
    graph = helper.make_graph(nodes, "gqa_decoder", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                   helper.make_opsetid("com.microsoft", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "model.onnx"))
    cfg = genai_config("model.onnx", head_size=head_size, num_key_value_heads=kv_heads, num_attention_heads=heads,
                       hidden_size=hidden, num_hidden_layers=layers,
                       sliding_window={"window_size": window, "slide_key_value_cache": False,
                                       "layers": list(sliding), "cache_slack": 0})
    cfg["search"]["past_present_share_buffer"] = True
    (folder / "genai_config.json").write_text(json.dumps(cfg))
    return folder / "model.onnx"


@pytest.fixture
def gqa_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "gqa"
    path = build_gqa_decoder(folder)
    write_tokenizer(folder)
    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # an ONNX Runtime without the sliding-window cache of GroupQueryAttention
        pytest.skip(f"this ONNX Runtime cannot run the test model: {str(exc).splitlines()[0]}")
    return folder


def text_feeds(model: OnnxModel, text: Path, seq_len: int = 16, samples: int = 2, **kw: Any) -> list[dict]:
    config = DataConfig(source=str(text), seq_len=seq_len, samples=samples, **kw)
    return list(iter_feeds(model.proto, config, model.source.parent, root=model.package_root))


def matmul_readers(model: OnnxModel) -> dict[str, list[str]]:
    inits = {t.name for t in model.graph.initializer}
    return {n.input[1]: [n.input[0]] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits}


def direct_importance(path: Path, readers: dict[str, list[str]], feeds: list[dict]) -> dict[str, np.ndarray]:
    """mean(x**2) per channel the plain way: the activations as outputs of the original graph."""
    model = onnx.load(str(path))
    acts = sorted({a for v in readers.values() for a in v})
    model.graph.output.extend(onnx.ValueInfoProto(name=a) for a in acts)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sums: dict[str, np.ndarray] = {}
    rows: dict[str, int] = {}
    for feed in feeds:
        for a, x in zip(acts, sess.run(acts, feed), strict=True):
            x = x.reshape(-1, x.shape[-1]).astype(np.float64)
            sums[a] = sums.get(a, 0) + (x**2).sum(axis=0)
            rows[a] = rows.get(a, 0) + x.shape[0]
    return {w: sum(sums[a] for a in v) / sum(rows[a] for a in v) for w, v in readers.items()}


# -- tests ------------------------------------------------------------------------------------------
def test_text_calibration_on_a_package_with_the_decoder_in_a_subfolder(concat_package: Path, tmp_path: Path) -> None:
    model = OnnxPackage.load(concat_package).component("decoder/model.onnx")
    assert model.package_root == concat_package
    feeds = text_feeds(model, write_text(tmp_path / "a.txt", 200, 0))
    assert len(feeds) == 2
    for feed in feeds:
        # an empty cache of the sizes the root's genai_config.json gives; the mask covers the window
        assert feed["past_key_values.0.key"].shape == (1, 2, 0, 16)
        assert feed["attention_mask"].shape == (1, 16) and feed["attention_mask"].all()
        assert feed["position_ids"].tolist() == [list(range(16))]
        assert feed["input_ids"][0, 0] == BOS and (feed["input_ids"][0, 1:] >= 3).all()

    readers = matmul_readers(model)
    got = channel_importance(model, readers, feeds, tmp_path / "work")
    want = direct_importance(concat_package / "decoder" / "model.onnx", readers, feeds)
    assert set(got) == set(readers) == {"q.weight", "k.weight", "v.weight", "o.weight", "head.weight"}
    for name in readers:
        assert got[name].shape == (32,) and np.isfinite(got[name]).all() and (got[name] > 0).all()
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4)
    assert not (tmp_path / "work").exists()  # nothing written: the session reads the model's own files

    other = channel_importance(model, readers, text_feeds(model, write_text(tmp_path / "b.txt", 200, 1)), tmp_path)
    assert all(np.abs(other[w] / got[w] - 1).max() > 0.05 for w in readers)  # the text decides


def test_quantize_kquant_with_text_data_on_kv_exports(concat_package: Path, gqa_folder: Path, tmp_path: Path,
                                                     run_cli: Any) -> None:
    text = write_text(tmp_path / "calib.txt", 300, 0)
    for name, src in (("concat", concat_package), ("gqa", gqa_folder)):
        out = tmp_path / f"out-{name}"
        code, _, err = run_cli("-v", "quantize", "-m", src, "-o", out, "--algorithm", "kquant", "--precision", "int4",
                               "--option", "block_size=16", "--data", text, "--seq-len", "16", "--samples", "3")
        assert code == 0, err
        assert "collected activation statistics" in err and "from 3 samples" in err, err[-2000:]
        rel = "decoder/model.onnx" if name == "concat" else "model.onnx"
        q = onnx.load(str(out / rel), load_external_data=False)
        assert sum(n.op_type == "MatMulNBits" for n in q.graph.node) >= 5, name
        assert (out / "genai_config.json").read_bytes() == (src / "genai_config.json").read_bytes()


def test_sliding_window_cache_gets_the_window_capacity(gqa_folder: Path, tmp_path: Path) -> None:
    model = OnnxModel.load(gqa_folder / "model.onnx")
    feeds = text_feeds(model, write_text(tmp_path / "a.txt", 200, 0), seq_len=12)
    feed = feeds[0]
    # layer 0 slides over 4 positions: zeros of that capacity; layer 1 is global: empty
    assert feed["past_key_values.0.key"].shape == (1, 1, 4, 16) and not feed["past_key_values.0.key"].any()
    assert feed["past_key_values.1.value"].shape == (1, 1, 0, 16)
    # GroupQueryAttention counts the real tokens from the mask: it covers the window only
    assert feed["attention_mask"].shape == (1, 12) and feed["attention_mask"].all()

    sess = ort.InferenceSession(str(gqa_folder / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = sess.run(["logits"], feed)[0]
    # a larger zero cache gives the same logits: the zeros are capacity, not context
    roomy = {**feed, **{k: np.zeros((1, 1, 32, 16), np.float32) for k in feed if k.startswith("past")}}
    np.testing.assert_allclose(sess.run(["logits"], roomy)[0], logits, rtol=1e-5, atol=1e-5)
    # what an empty cache does, and why the capacity is needed
    empty = {**feed, **{k: np.zeros((1, 1, 0, 16), np.float32) for k in feed if k.startswith("past")}}
    with pytest.raises(Exception, match="local_window_size"):
        sess.run(["logits"], empty)

    readers = matmul_readers(model)
    got = channel_importance(model, readers, feeds, tmp_path)
    want = direct_importance(gqa_folder / "model.onnx", readers, feeds)
    for name in readers:
        assert np.isfinite(got[name]).all() and (got[name] > 0).all()
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4)
    other = channel_importance(model, readers, text_feeds(model, write_text(tmp_path / "b.txt", 200, 1), seq_len=12),
                               tmp_path)
    assert any(np.abs(other[w] / got[w] - 1).max() > 0.05 for w in readers)


def test_window_size_from_genai_config_or_the_graph(tmp_path: Path) -> None:
    path = build_gqa_decoder(tmp_path / "m", window=6)
    model = onnx.load(str(path), load_external_data=False)
    cfg = json.loads((tmp_path / "m" / "genai_config.json").read_text())
    plan = cache_plan(model, kv_hints(cfg))
    assert {p.name: p.shape for p in plan.past}["past_key_values.0.key"] == (None, 1, 6, 16)
    assert plan.mask_past == 0 and "sliding window 6" in (plan.note() or "")
    # no genai_config.json: the head size is unknown, but the graph alone gives the window
    with pytest.raises(Exception, match="genai_config"):
        cache_plan(model, {})
    plan = cache_plan(model, {"head_size": 16})
    assert {p.name: p.capacity for p in plan.past} == {
        "past_key_values.0.key": 6, "past_key_values.0.value": 6, "past_key_values.1.key": 0,
        "past_key_values.1.value": 0,
    }


def test_static_concat_cache_is_masked(tmp_path: Path) -> None:
    """A static cache read by Concat: zeros of its capacity, and zeros over them in the mask."""
    path = build_kv_decoder(tmp_path / "m" / "model.onnx", static_past=4)
    write_tokenizer(tmp_path / "m")
    model = OnnxModel.load(path)
    feed = text_feeds(model, write_text(tmp_path / "a.txt", 100, 0), seq_len=8, samples=1)[0]
    assert feed["past_key_values.0.key"].shape == (1, 2, 4, 16)
    assert feed["attention_mask"].tolist() == [[0] * 4 + [1] * 8]


@pytest.mark.parametrize(("bos", "first"), [("config", BOS), ("template", BOS), ("off", None), (None, None)])
def test_bos_when_the_tokenizer_asks(tmp_path: Path, bos: str | None, first: int | None) -> None:
    folder = tmp_path / "m"
    build_kv_decoder(folder / "model.onnx")
    write_tokenizer(folder, bos=bos)
    model = OnnxModel.load(folder / "model.onnx")
    feeds = text_feeds(model, write_text(tmp_path / "a.txt", 100, 0), seq_len=10, samples=3)
    ids = np.concatenate([f["input_ids"] for f in feeds])
    assert ids.shape == (3, 10)
    if first is None:
        assert (ids >= 3).all()  # text only
    else:
        assert (ids[:, 0] == first).all() and (ids[:, 1:] >= 3).all()
        # the text continues across windows: 9 text tokens each
        words = (tmp_path / "a.txt").read_text().split()
        assert ids[1, 1:].tolist() == [int(w[1:]) for w in words[9:18]]


def test_tokenizer_config_is_read_through_a_relative_tokenizer_path(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``--tokenizer m`` (relative): its tokenizer_config.json is found once, not under ``m/m``."""
    from bitpress.calibration.text import bos_tokens, load_tokenizer

    folder = tmp_path / "m"
    folder.mkdir()
    write_tokenizer(folder, bos="config")
    monkeypatch.chdir(tmp_path)
    rel = Path("m") / "tokenizer.json"
    assert bos_tokens(load_tokenizer(rel), rel) == (BOS,)


def test_a_truncating_tokenizer_still_reads_the_whole_text(tmp_path: Path) -> None:
    """Encoders' tokenizer.json truncate to max_length (128): the text is still read whole, then windowed."""
    from tokenizers import Tokenizer

    from bitpress.calibration.text import token_windows, tokenize

    path = write_tokenizer(tmp_path / "m", bos=None)
    tok = Tokenizer.from_file(str(path))
    tok.enable_truncation(max_length=8)
    tok.enable_padding(length=8)
    tok.save(str(path))
    tokens = tokenize(write_text(tmp_path / "a.txt", 100, 0), path)
    assert tokens.ids.size == 100
    assert token_windows(tokens, 10).shape == (10, 10)


def test_eval_perplexity_uses_the_same_windows(gqa_folder: Path, tmp_path: Path) -> None:
    from bitpress import evaluate

    res = evaluate(gqa_folder, gqa_folder, text=write_text(tmp_path / "a.txt", 100, 0), seq_len=12)
    assert res.perplexity is not None and np.isfinite(res.perplexity.reference)
    assert res.perplexity.relative_change == 0 and res.perplexity.windows == 100 // 11
    assert any("sliding window 4" in n for n in res.notes), res.notes


def test_tokenizer_linked_from_outside_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    build_kv_decoder(folder / "model.onnx")
    outside = write_tokenizer(tmp_path / "elsewhere")
    os.symlink(outside, folder / "tokenizer.json")
    model = OnnxModel.load(folder / "model.onnx")
    with pytest.raises(UnsafePathError, match="outside"):
        text_feeds(model, write_text(tmp_path / "a.txt", 100, 0))
    # given explicitly, a tokenizer anywhere is fine
    assert len(text_feeds(model, tmp_path / "a.txt", tokenizer=str(outside))) == 2


def test_builder_tied_embedding_is_gathered_without_a_transposed_copy(tmp_path: Path) -> None:
    """The GenAI builder's fp32 tie: the head reads W [hidden, vocab], the embedding Gather(Transpose(W))."""
    from bitpress.onnx.activations import stats_model

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((32, VOCAB)).astype(np.float32), "lm_head.MatMul.weight"),
             numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "q.weight")]
    n = helper.make_node
    nodes = [n("Transpose", ["lm_head.MatMul.weight"], ["table"], name="/embed/Transpose", perm=[1, 0]),
             n("Gather", ["table", "input_ids"], ["x"], name="/embed/Gather"),
             n("MatMul", ["x", "q.weight"], ["y"], name="/q/MatMul"),
             n("MatMul", ["y", "lm_head.MatMul.weight"], ["logits"], name="/lm_head/MatMul")]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "tied", [vi("input_ids", TensorProto.INT64, ["batch", "seq"])],
                              [vi("logits", TensorProto.FLOAT, ["batch", "seq", VOCAB])], initializer=inits)
    path = tmp_path / "m" / "model.onnx"
    path.parent.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    write_tokenizer(path.parent)
    model = OnnxModel.load(path)
    readers = {"q.weight": ["x"], "lm_head.MatMul.weight": ["y"]}
    stats = onnx.load_from_string(stats_model(model, ["x", "y"])[0])
    assert not [nd for nd in stats.graph.node if nd.op_type == "Transpose" and nd.input[0] == "lm_head.MatMul.weight"]
    assert not [nd for nd in stats.graph.node if nd.name == "/lm_head/MatMul"]  # the head's output is not needed
    assert [o.name for o in stats.graph.output if "logits" in o.name] == []
    feeds = text_feeds(model, write_text(tmp_path / "a.txt", 100, 0), seq_len=8, samples=2, batch=2)
    got = channel_importance(model, readers, feeds, tmp_path)
    want = direct_importance(path, readers, feeds)
    for name in readers:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5)
