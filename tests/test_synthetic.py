"""The synthetic model builders: valid ONNX, runnable on ORT CPU, deterministic, streamed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from bitpress.synthetic import (
    PRESETS,
    build_decoder,
    build_encoder,
    build_genai_folder,
    build_preset,
    random_inputs,
)


def _run(path: Path, feeds: dict[str, np.ndarray] | None = None) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds if feeds is not None else random_inputs(path, batch=2, seq=5))[0]


def _inits(path: Path) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in onnx.load(str(path)).graph.initializer}


def _nodes(path: Path) -> dict[str, onnx.NodeProto]:
    return {n.name: n for n in onnx.load(str(path), load_external_data=False).graph.node}


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"dtype": "float16"},
        {"tied": False},
        {"head_via_transpose": False},
        {"kv_heads": 2},
        {"hidden": 72, "intermediate": 200, "heads": 4, "vocab": 100},
    ],
    ids=["default", "fp16", "untied", "tied-gemm", "gqa", "odd-sizes"],
)
def test_decoder_is_valid_and_runs(tmp_path: Path, kwargs: dict) -> None:
    path = build_decoder(tmp_path / "m.onnx", **kwargs)
    onnx.checker.check_model(str(path), full_check=True)
    logits = _run(path)
    vocab = kwargs.get("vocab", 256)
    assert logits.shape == (2, 5, vocab)
    assert logits.dtype == np.dtype(kwargs.get("dtype", "float32"))
    assert np.isfinite(logits).all()
    assert logits.astype(np.float32).std() > 0.1  # non-trivial logits


def test_decoder_names_and_shapes(tmp_path: Path) -> None:
    path = build_decoder(tmp_path / "m.onnx", hidden=72, intermediate=200, layers=2)
    nodes, inits = _nodes(path), _inits(path)
    for name in ["/model/embed_tokens/Gather", "/model/layers.0/self_attn/q_proj/MatMul",
                 "/model/layers.1/mlp/down_proj/MatMul", "/lm_head/MatMul",
                 "/lm_head/Transpose"]:
        assert name in nodes, name
    assert nodes["/lm_head/Transpose"].input[0] == "model.embed_tokens.weight"
    assert list(inits["model.embed_tokens.weight"].dims) == [256, 72]
    assert list(inits["model.layers.0.self_attn.q_proj.weight"].dims) == [72, 72]
    assert list(inits["model.layers.1.mlp.gate_proj.weight"].dims) == [72, 200]
    assert list(inits["model.layers.1.mlp.down_proj.weight"].dims) == [200, 72]
    assert nodes["/model/layers.1/mlp/down_proj/MatMul"].input[1] == (
        "model.layers.1.mlp.down_proj.weight"
    )
    assert "lm_head.weight" not in inits
    emb = numpy_helper.to_array(inits["model.embed_tokens.weight"])
    q = numpy_helper.to_array(inits["model.layers.0.self_attn.q_proj.weight"])
    assert 0.015 < q.std() < 0.025
    assert emb.std() > 0.1


def test_decoder_head_layouts(tmp_path: Path) -> None:
    via_t = build_decoder(tmp_path / "t.onnx")
    gemm = build_decoder(tmp_path / "g.onnx", head_via_transpose=False)
    untied = build_decoder(tmp_path / "u.onnx", tied=False, vocab=300, hidden=32, heads=2)
    node = _nodes(gemm)["/lm_head/Gemm"]
    assert node.input[1] == "model.embed_tokens.weight"
    assert {a.name: a.i for a in node.attribute}["transB"] == 1
    assert "lm_head.weight" not in _inits(gemm)
    # both tied layouts compute the same thing from the same table
    feeds = random_inputs(via_t, batch=2, seq=6)
    np.testing.assert_allclose(_run(via_t, feeds), _run(gemm, feeds), rtol=1e-4, atol=1e-4)
    assert list(_inits(untied)["lm_head.weight"].dims) == [32, 300]
    assert _nodes(untied)["/lm_head/MatMul"].input[1] == "lm_head.weight"


def test_gqa_attention_is_causal(tmp_path: Path) -> None:
    path = build_decoder(tmp_path / "m.onnx", heads=4, kv_heads=2)
    ids = random_inputs(path, batch=1, seq=6)["input_ids"]
    changed = ids.copy()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    a, b = _run(path, {"input_ids": ids}), _run(path, {"input_ids": changed})
    np.testing.assert_allclose(a[:, :-1], b[:, :-1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, -1], b[:, -1])


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    a = build_decoder(tmp_path / "a.onnx", seed=3)
    b = build_decoder(tmp_path / "b.onnx", seed=3)
    c = build_decoder(tmp_path / "c.onnx", seed=4)
    assert a.read_bytes() == b.read_bytes()
    feeds = random_inputs(a)
    assert np.array_equal(_run(a, feeds), _run(b, feeds))
    assert not np.allclose(_run(a, feeds), _run(c, feeds))
    assert all(np.array_equal(x, y) for x, y in
               zip(random_inputs(a, seed=1).values(), random_inputs(a, seed=1).values(),
                   strict=True))


def test_fp16_matches_fp32(tmp_path: Path) -> None:
    f32 = build_decoder(tmp_path / "f32.onnx")
    f16 = build_decoder(tmp_path / "f16.onnx", dtype="float16")
    inits = _inits(f16)
    assert all(t.data_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.INT64,
                               onnx.TensorProto.FLOAT)  # float32: rotary/mask constants
               for t in inits.values())
    assert inits["model.layers.0.mlp.up_proj.weight"].data_type == onnx.TensorProto.FLOAT16
    model = onnx.load(str(f16))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    feeds = random_inputs(f32)
    np.testing.assert_allclose(_run(f16, feeds).astype(np.float32), _run(f32, feeds),
                               atol=0.05, rtol=0.05)


def test_external_data_is_relative_and_portable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inline = build_decoder(tmp_path / "inline.onnx", dtype="float16")
    ext = build_decoder(tmp_path / "a" / "ext.onnx", dtype="float16", external_data=True)
    data = tmp_path / "a" / "ext.onnx.data"
    assert data.is_file()
    model = onnx.load(str(ext), load_external_data=False)
    locations = {e.value for t in model.graph.initializer for e in t.external_data
                 if e.key == "location"}
    assert locations == {"ext.onnx.data"}
    onnx.checker.check_model(str(ext), full_check=True)
    assert ext.stat().st_size < 60_000 < data.stat().st_size
    # same values as the inline build, from another working directory and a moved folder
    feeds = random_inputs(inline)
    expected = _run(inline, feeds)
    moved = shutil.copytree(tmp_path / "a", tmp_path / "b") / "ext.onnx"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert np.array_equal(_run(ext, feeds), expected)
    assert np.array_equal(_run(moved, feeds), expected)
    a = {t.name: numpy_helper.to_array(t, base_dir=str(tmp_path / "a"))
         for t in model.graph.initializer}
    b = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(inline)).graph.initializer}
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_too_big_for_one_file_asks_for_external_data(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="external_data=True"):
        build_preset("bench-4gb", tmp_path / "m.onnx", external_data=False)
    assert not (tmp_path / "m.onnx").exists()


def test_presets() -> None:
    assert set(PRESETS) >= {"tiny", "bench-447mb", "bench-4gb"}
    assert PRESETS["bench-4gb"]["external_data"] is True


def test_encoder(tmp_path: Path) -> None:
    path = build_encoder(tmp_path / "e.onnx", hidden=48, heads=3, intermediate=100)
    onnx.checker.check_model(str(path), full_check=True)
    nodes = _nodes(path)
    ops = {n.op_type for n in nodes.values()}
    assert {"Gemm", "MatMul", "Erf", "LayerNormalization", "Gather"} <= ops
    assert "/encoder/layer.0/attention/self/query/MatMul" in nodes
    gemm = nodes["/encoder/layer.1/attention/output/dense/Gemm"]
    assert {a.name: a.i for a in gemm.attribute}["transB"] == 1
    inits = _inits(path)
    assert list(inits[gemm.input[1]].dims) == [48, 48]
    assert list(inits["encoder.layer.0.intermediate.dense.weight"].dims) == [48, 100]
    assert list(inits["encoder.layer.0.output.dense.weight"].dims) == [48, 100]

    feeds = random_inputs(path, batch=2, seq=6)
    assert set(feeds) == {"input_ids", "attention_mask"}
    assert (feeds["attention_mask"] == 1).all() and feeds["input_ids"].max() < 512
    out = _run(path, feeds)
    assert out.shape == (2, 6, 48) and np.isfinite(out).all()
    # padding: a masked tail leaves the other positions as if it were absent
    masked = {"input_ids": feeds["input_ids"], "attention_mask": feeds["attention_mask"].copy()}
    masked["attention_mask"][:, 4:] = 0
    short = {k: v[:, :4] for k, v in feeds.items()}
    np.testing.assert_allclose(_run(path, masked)[:, :4], _run(path, short), atol=1e-5)


def test_encoder_fp16(tmp_path: Path) -> None:
    f32 = build_encoder(tmp_path / "a.onnx")
    f16 = build_encoder(tmp_path / "b.onnx", dtype="float16")
    onnx.checker.check_model(str(f16), full_check=True)
    feeds = random_inputs(f32)
    out = _run(f16, feeds)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float32), _run(f32, feeds), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("split", [False, True], ids=["single", "split-embedding"])
def test_genai_folder(tmp_path: Path, split: bool) -> None:
    folder = build_genai_folder(tmp_path / "pkg", split_embedding=split, vocab=200)
    for name in ["genai_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"]:
        json.loads((folder / name).read_text())
    cfg = json.loads((folder / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    assert cfg["model"]["vocab_size"] == 200
    assert {"max_length", "do_sample", "top_k"} <= set(cfg["search"])
    tok = json.loads((folder / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == 200
    decoder = folder / dec["filename"]
    onnx.checker.check_model(str(decoder), full_check=True)
    dec_inputs = {i.name for i in onnx.load(str(decoder)).graph.input}
    assert dec_inputs == set(dec["inputs"].values())
    ids = random_inputs(decoder if not split else folder / "embedding/model.onnx", seq=4)
    if split:
        assert dec["filename"] == "decoder/model.onnx"
        emb = folder / cfg["model"]["embedding"]["filename"]
        onnx.checker.check_model(str(emb), full_check=True)
        embeds = _run(emb, ids)
        assert embeds.shape == (1, 4, 64)
        logits = _run(decoder, {"inputs_embeds": embeds})
        assert random_inputs(decoder)["inputs_embeds"].shape == (1, 8, 64)
    else:
        assert dec["filename"] == "model.onnx" and not (folder / "decoder").exists()
        logits = _run(decoder, ids)
    assert logits.shape == (1, 4, 200) and np.isfinite(logits).all()


_STREAM_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, time
    from pathlib import Path
    from bitpress.synthetic import build_decoder

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    out = Path(sys.argv[1])
    kw = dict(hidden=512, layers=2, heads=8, vocab=32000, tied=False)
    base = peak()
    t = time.perf_counter()
    ext = build_decoder(out / "ext.onnx", external_data=True, **kw)
    t_ext = time.perf_counter() - t
    after_ext = peak()
    inline = build_decoder(out / "inline.onnx", **kw)
    after_inline = peak()
    size = (out / "ext.onnx.data").stat().st_size
    print(json.dumps({"base": base, "ext": after_ext - base, "inline": after_inline - base,
                      "size": size, "inline_size": inline.stat().st_size, "t_ext": t_ext}))
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units and page cache")
def test_medium_model_streams_with_low_memory(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _STREAM_SCRIPT, str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["size"] > 140e6  # ~157 MB of weights
    assert r["inline_size"] > 140e6
    assert r["ext"] < r["size"] / 4, r
    assert r["inline"] < r["size"] / 4, r
    assert r["t_ext"] < 30, r
