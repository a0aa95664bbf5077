"""The host's weight-only machinery, exercised through the RTN plugin.

Models are built here with bitpress.synthetic (tiny random transformers, no network).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import bitpress
from bitpress.errors import OptionError
from bitpress.onnx import layout, weightonly
from bitpress.synthetic import build_decoder, build_encoder, random_inputs


def run(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def nodes(path: Path, op: str) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(path)).graph.node if n.op_type == op]


def attr(node: onnx.NodeProto, name: str) -> object:
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_decoder(tmp_path_factory.mktemp("dec") / "model.onnx", hidden=64, layers=2, vocab=256, tied=True)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_encoder(tmp_path_factory.mktemp("enc") / "model.onnx", hidden=64, layers=2, vocab=512)


# Measured with these seeds: decoder int8 0.006-0.007, int4 0.10-0.11; encoder int8 ~0.004, int4 ~0.06.
@pytest.mark.parametrize("which", ["decoder", "encoder"])
@pytest.mark.parametrize(("precision", "bound"), [("int8", 0.02), ("int4", 0.2)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_outputs_check_run_and_stay_close(request, tmp_path, which, precision, bound, symmetric):
    src = request.getfixturevalue(which)
    out = tmp_path / "q.onnx"
    bitpress.quantize(src, out, algorithm="rtn", precision=precision,
                      options={"block_size": 32, "is_symmetric": symmetric})
    onnx.checker.check_model(str(out))
    feeds = random_inputs(src)
    err = rel(run(src, feeds), run(out, feeds))
    assert err < bound, f"{which} {precision}: logits relative error {err:.4f}"
    assert nodes(out, "MatMulNBits"), "no MatMulNBits written"
    q = onnx.load(str(out))
    consts = {t.name for t in q.graph.initializer}
    assert not [n.name for n in q.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in consts]
    assert any(o.domain == "com.microsoft" for o in q.opset_import)
    for n in nodes(out, "MatMulNBits"):
        assert attr(n, "bits") == int(precision[-1])


def test_int8_much_tighter_than_int4(decoder, tmp_path):
    feeds = random_inputs(decoder)
    ref = run(decoder, feeds)
    errs = {}
    for p in ("int4", "int8"):
        bitpress.quantize(decoder, tmp_path / f"{p}.onnx", algorithm="rtn", precision=p, options={"block_size": 32})
        errs[p] = rel(ref, run(tmp_path / f"{p}.onnx", feeds))
    assert errs["int8"] * 5 < errs["int4"], errs


def test_tied_table_is_one_quantized_tensor(decoder, tmp_path):
    out = tmp_path / "q.onnx"
    bitpress.quantize(decoder, out, algorithm="rtn", precision="int4", options={"block_size": 32})
    model = onnx.load(str(out))
    inits = {t.name: t for t in model.graph.initializer}
    gather = nodes(out, "GatherBlockQuantized")
    assert len(gather) == 1
    head = next(n for n in nodes(out, "MatMulNBits") if "lm_head" in n.name)
    reshape = next(n for n in model.graph.node if n.output[0] == gather[0].input[0])
    assert reshape.op_type == "Reshape"
    # the Gather's data and the head's B are the same initializer; scales too
    assert reshape.input[0] == head.input[1]
    assert gather[0].input[2] == head.input[2]
    assert "model.embed_tokens.weight" not in inits  # no float copy left behind
    assert not nodes(out, "Transpose") or all("embed" not in n.input[0] for n in nodes(out, "Transpose"))
    # the shared bytes really serve both: dequantizing B gives the Gather's table
    b = numpy_helper.to_array(inits[head.input[1]])
    assert b.shape[0] == 256
    feeds = random_inputs(decoder)
    assert rel(run(decoder, feeds), run(out, feeds)) < 0.2


@pytest.mark.parametrize("excluded", ["/lm_head/MatMul", "/model/embed_tokens/Gather", "re:.*embed.*"])
def test_tied_table_stays_float_when_either_end_is_excluded(decoder, tmp_path, excluded):
    out = tmp_path / "q.onnx"
    bitpress.quantize(decoder, out, algorithm="rtn", precision="int4",
                      options={"block_size": 32, "nodes_to_exclude": [excluded]})
    model = onnx.load(str(out))
    inits = {t.name for t in model.graph.initializer}
    assert "model.embed_tokens.weight" in inits
    assert not nodes(out, "GatherBlockQuantized")
    assert not any("lm_head" in n.name for n in nodes(out, "MatMulNBits"))
    assert nodes(out, "Gather") and any("lm_head" in n.name for n in nodes(out, "MatMul"))
    assert len(nodes(out, "MatMulNBits")) == 14  # the layers' projections are still quantized


def test_tied_table_with_conflicting_overrides_stays_float(decoder, tmp_path):
    out = tmp_path / "q.onnx"
    bitpress.quantize(decoder, out, algorithm="rtn", precision="int4",
                      options={"block_size": 32, "overrides": {"/lm_head/MatMul": {"bits": 8}}})
    assert not nodes(out, "GatherBlockQuantized")
    assert "model.embed_tokens.weight" in {t.name for t in onnx.load(str(out)).graph.initializer}


def test_untied_head_and_odd_sizes_pad_k(tmp_path):
    # hidden 72 and intermediate 200 are not multiples of the block: K is padded
    src = build_decoder(tmp_path / "m.onnx", hidden=72, layers=1, heads=4, intermediate=200, vocab=130, tied=False)
    out = tmp_path / "q.onnx"
    bitpress.quantize(src, out, algorithm="rtn", precision="int4", options={"block_size": 32})
    down = next(n for n in nodes(out, "MatMulNBits") if "down_proj" in n.name)
    assert attr(down, "K") == 200 and attr(down, "block_size") == 32
    inits = {t.name: t for t in onnx.load(str(out)).graph.initializer}
    assert list(inits[down.input[1]].dims) == [72, 7, 16]  # ceil(200 / 32) = 7 blocks of 16 bytes
    feeds = random_inputs(src)
    assert rel(run(src, feeds), run(out, feeds)) < 0.2


def test_fp16_model_stays_fp16(tmp_path):
    src = build_decoder(tmp_path / "m.onnx", hidden=64, layers=1, vocab=256, tied=True, dtype="float16")
    out = tmp_path / "q.onnx"
    bitpress.quantize(src, out, algorithm="rtn", precision="int4", options={"block_size": 32})
    model = onnx.load(str(out))
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    inits = {t.name: t for t in model.graph.initializer}
    for n in nodes(out, "MatMulNBits") + nodes(out, "GatherBlockQuantized"):
        assert inits[n.input[2]].data_type == TensorProto.FLOAT16, n.name
    feeds = random_inputs(src)
    a, b = run(src, feeds), run(out, feeds)
    assert b.dtype == np.float16
    assert rel(a, b) < 0.2


def test_rtn_matches_onnxruntime_quantizer(tmp_path):
    """bitpress rtn and ORT's MatMulNBitsQuantizer give the same dequantized weights."""
    pytest.importorskip("onnx_ir")
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    src = build_decoder(tmp_path / "m.onnx", hidden=64, layers=1, vocab=256, tied=False)
    for symmetric in (True, False):
        ours = tmp_path / f"ours_{symmetric}.onnx"
        bitpress.quantize(src, ours, algorithm="rtn", precision="int4",
                          options={"block_size": 32, "is_symmetric": symmetric, "op_types": ["MatMul"]})
        cfg = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=symmetric)
        q = MatMulNBitsQuantizer(onnx.load(str(src)), algo_config=cfg)
        q.process()
        theirs = q.model.model
        t_inits = {t.name: numpy_helper.to_array(t) for t in theirs.graph.initializer}
        o_model = onnx.load(str(ours))
        o_inits = {t.name: numpy_helper.to_array(t) for t in o_model.graph.initializer}
        t_nodes = {n.name.removesuffix("_Q4"): n for n in theirs.graph.node if n.op_type == "MatMulNBits"}
        compared = 0
        for n in o_model.graph.node:
            if n.op_type != "MatMulNBits":
                continue
            peer = t_nodes[n.name.removesuffix("_Q4")]

            def deq(node, inits):
                zp = inits[node.input[3]] if len(node.input) > 3 and node.input[3] else None
                t = layout.MatMulNBitsTensors(
                    inits[node.input[1]], inits[node.input[2]], zp, attr(node, "K"), attr(node, "N"),
                    attr(node, "bits"), attr(node, "block_size"),
                )
                return layout.dequantize_matmul_nbits(t)

            np.testing.assert_allclose(deq(n, o_inits), deq(peer, t_inits), rtol=1e-6, atol=1e-7)
            compared += 1
        assert compared == 8  # 7 projections + the untied head


def test_overrides_give_mixed_precision(decoder, tmp_path):
    out = tmp_path / "q.onnx"
    bitpress.quantize(decoder, out, algorithm="rtn", precision="int4",
                      options={"block_size": 32,
                               "overrides": {r"re:.*/mlp/down_proj/.*": {"bits": 8, "block_size": 16}}})
    for n in nodes(out, "MatMulNBits"):
        if "down_proj" in n.name:
            assert (attr(n, "bits"), attr(n, "block_size")) == (8, 16)
        else:
            assert (attr(n, "bits"), attr(n, "block_size")) == (4, 32)


def test_include_and_exclude_patterns(decoder, tmp_path):
    out = tmp_path / "q.onnx"
    bitpress.quantize(decoder, out, algorithm="rtn", precision="int4",
                      options={"nodes_to_include": ["/model/layers.0/*"], "nodes_to_exclude": ["*/k_proj/*"]})
    names = [n.name for n in nodes(out, "MatMulNBits")]
    assert names and all(n.startswith("/model/layers.0/") for n in names)
    assert not any("k_proj" in n for n in names)
    assert len(names) == 6


def test_regex_re2_cannot_express_is_refused_before_work(decoder, tmp_path):
    # matched by RE2 in linear time: a pattern that backtracks catastrophically elsewhere is fine here
    bitpress.quantize(decoder, tmp_path / "ok.onnx", algorithm="rtn", precision="int4",
                      options={"nodes_to_exclude": ["re:(a+)+$", r"re:(.*/)+k_proj(/.*)+"]})
    names = [n.name for n in nodes(tmp_path / "ok.onnx", "MatMulNBits")]
    assert names and not any("k_proj" in n for n in names)
    # what needs backtracking (backreferences, lookaround) is refused, naming the pattern
    with pytest.raises(OptionError, match=r"'re:\(a\)\\\\1' uses a backreference"):
        bitpress.quantize(decoder, tmp_path / "q.onnx", algorithm="rtn", precision="int4",
                          options={"nodes_to_exclude": [r"re:(a)\1"]})
    with pytest.raises(OptionError, match="uses a lookahead"):
        bitpress.quantize(decoder, tmp_path / "q.onnx", algorithm="rtn", precision="int4",
                          options={"overrides": {"re:.*(?=proj)": {"bits": 8}}})
    assert not (tmp_path / "q.onnx").exists()


def _shared_weight_model(path: Path, extra_reader: bool) -> Path:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 48)).astype(np.float32), "W")
    nodes_ = [
        helper.make_node("MatMul", ["x", "W"], ["a"], name="mm_a"),
        helper.make_node("MatMul", ["x", "W"], ["b"], name="mm_b"),
        helper.make_node("Add", ["a", "b"], ["y"], name="add"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 48])]
    if extra_reader:
        nodes_.append(helper.make_node("ReduceSum", ["W"], ["s"], name="reads_w", keepdims=0))
        outputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, []))
    g = helper.make_graph(nodes_, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                          outputs, [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return path


def test_weight_shared_by_two_matmuls_is_quantized_once(tmp_path):
    src = _shared_weight_model(tmp_path / "m.onnx", extra_reader=False)
    out = tmp_path / "q.onnx"
    bitpress.quantize(src, out, algorithm="rtn", precision="int4", options={"block_size": 32})
    mm = nodes(out, "MatMulNBits")
    assert len(mm) == 2 and mm[0].input[1:] == mm[1].input[1:]
    assert len(onnx.load(str(out)).graph.initializer) in (2, 3)  # B, scales (and zero points)


def test_weight_with_a_float_reader_is_left_float(tmp_path):
    src = _shared_weight_model(tmp_path / "m.onnx", extra_reader=True)
    out = tmp_path / "q.onnx"
    bitpress.quantize(src, out, algorithm="rtn", precision="int4", options={"block_size": 32})
    assert not nodes(out, "MatMulNBits")


def test_gemm_forms_and_bias(tmp_path):
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.standard_normal((48, 64)).astype(np.float32), "Wt"),  # [N, K] for transB=1
        numpy_helper.from_array(rng.standard_normal((64, 48)).astype(np.float32), "W"),  # [K, N]
        numpy_helper.from_array(rng.standard_normal(48).astype(np.float32), "bias"),
    ]
    g = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "Wt", "bias"], ["a"], name="gemm_t", transB=1),
            helper.make_node("Gemm", ["x", "W"], ["b"], name="gemm"),
            helper.make_node("Gemm", ["x", "W", "bias"], ["c"], name="gemm_alpha", alpha=0.5),
        ],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 64])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 48]) for n in "abc"], inits,
    )
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(src))
    out = tmp_path / "q.onnx"
    bitpress.quantize(src, out, algorithm="rtn", precision="int8", options={"block_size": 32})
    # gemm_alpha shares W with gemm but cannot be rewritten: W stays float for both
    assert [n.name for n in nodes(out, "MatMulNBits")] == ["gemm_t_Q8"]
    feeds = {"x": np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)}
    sa, sb = ort.InferenceSession(str(src)), ort.InferenceSession(str(out))
    for ra, rb in zip(sa.run(None, feeds), sb.run(None, feeds), strict=True):
        assert rel(ra, rb) < 0.01


def test_jobs_and_chunking_do_not_change_the_result(decoder, tmp_path, monkeypatch):
    outs = []
    for i, (jobs, chunk) in enumerate([(1, weightonly.CHUNK_ELEMENTS), (2, weightonly.CHUNK_ELEMENTS), (2, 1000)]):
        monkeypatch.setattr(weightonly, "CHUNK_ELEMENTS", chunk)
        out = tmp_path / f"q{i}.onnx"
        bitpress.quantize(decoder, out, algorithm="rtn", precision="int4", jobs=jobs,
                          options={"block_size": 32, "is_symmetric": False})
        outs.append({t.name: t.raw_data for t in onnx.load(str(out)).graph.initializer})
    assert outs[0] == outs[1] == outs[2]


def test_no_dangling_initializers(decoder, tmp_path):
    out = tmp_path / "q.onnx"
    bitpress.quantize(decoder, out, algorithm="rtn", precision="int4")
    model = onnx.load(str(out))
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    assert {t.name for t in model.graph.initializer} <= used


@pytest.mark.parametrize("precision", ["nf4", "fp4"])
def test_bnb4_codebooks(tmp_path, precision):
    src = build_decoder(tmp_path / "m.onnx", hidden=64, layers=1, vocab=256, tied=True)
    out = tmp_path / "q.onnx"
    bitpress.quantize(src, out, algorithm=precision, precision=precision, options={"block_size": 32})
    mm = nodes(out, "MatMulBnb4")
    assert len(mm) == 7  # the layer's projections; the tied head stays float with its Gather
    assert attr(mm[0], "quant_type") == {"fp4": 0, "nf4": 1}[precision]
    assert "model.embed_tokens.weight" in {t.name for t in onnx.load(str(out)).graph.initializer}
    onnx.checker.check_model(str(out))
    feeds = random_inputs(src)
    assert rel(run(src, feeds), run(out, feeds)) < 0.25


def _tied_pair_model(path: Path, hidden: int, vocab: int, builder_style: bool) -> Path:
    """ids -> embedding -> LM head, the table tied as the ORT GenAI builder or torch.onnx writes it.

    builder_style: ``MatMul(x, W[hidden, vocab])`` and ``Gather(Transpose(W), ids)``;
    otherwise ``Gather(T[vocab, hidden], ids)`` and ``MatMul(x, Transpose(T))``.
    """
    rng = np.random.default_rng(3)
    table = (rng.standard_normal((vocab, hidden)) / np.sqrt(hidden)).astype(np.float32)
    if builder_style:
        init = numpy_helper.from_array(np.ascontiguousarray(table.T), "lm_head.MatMul.weight")
        nodes_ = [
            helper.make_node("Transpose", ["lm_head.MatMul.weight"], ["table"], name="/model/embed_tokens/Transpose",
                             perm=[1, 0]),
            helper.make_node("Gather", ["table", "input_ids"], ["h"], name="/model/embed_tokens/Gather"),
            helper.make_node("MatMul", ["h", "lm_head.MatMul.weight"], ["logits"], name="/lm_head/MatMul"),
        ]
    else:
        init = numpy_helper.from_array(table, "model.embed_tokens.weight")
        nodes_ = [
            helper.make_node("Gather", ["model.embed_tokens.weight", "input_ids"], ["h"],
                             name="/model/embed_tokens/Gather"),
            helper.make_node("Transpose", ["model.embed_tokens.weight"], ["head_w"], name="/lm_head/Transpose",
                             perm=[1, 0]),
            helper.make_node("MatMul", ["h", "head_w"], ["logits"], name="/lm_head/MatMul"),
        ]
    g = helper.make_graph(nodes_, "tied", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "s", vocab])], [init])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return path


@pytest.mark.parametrize("builder_style", [True, False])
def test_both_tie_layouts_are_quantized_once_and_shared(tmp_path, builder_style):
    src = _tied_pair_model(tmp_path / "m.onnx", hidden=64, vocab=512, builder_style=builder_style)
    out = tmp_path / "q.onnx"
    bitpress.quantize(src, out, algorithm="rtn", precision="int4", options={"block_size": 32})
    model = onnx.load(str(out))
    gather, head = nodes(out, "GatherBlockQuantized"), nodes(out, "MatMulNBits")
    assert len(gather) == 1 and len(head) == 1
    reshape = next(n for n in model.graph.node if n.output[0] == gather[0].input[0])
    assert reshape.input[0] == head[0].input[1] and gather[0].input[2:] == head[0].input[2:]
    assert not nodes(out, "Transpose") and len(model.graph.initializer) == 3  # B, scales, shape (symmetric)
    feeds = {"input_ids": np.arange(0, 512, 7, dtype=np.int64)[None]}
    assert rel(run(src, feeds), run(out, feeds)) < 0.15


def test_tied_table_block_size_adjusted_to_tile_the_rows(tmp_path):
    # hidden 192 is not a multiple of 128: the pair is quantized at block 64 instead of left float
    src = _tied_pair_model(tmp_path / "m.onnx", hidden=192, vocab=256, builder_style=True)
    out = tmp_path / "q.onnx"
    bitpress.quantize(src, out, algorithm="rtn", precision="int4", options={"block_size": 128})
    (gather,), (head,) = nodes(out, "GatherBlockQuantized"), nodes(out, "MatMulNBits")
    assert attr(gather, "block_size") == attr(head, "block_size") == 64


def test_tiny_gather_tables_stay_float(tmp_path):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((2, 64)).astype(np.float32), "token_type"),
             numpy_helper.from_array(rng.standard_normal((128, 64)).astype(np.float32), "words")]
    g = helper.make_graph(
        [helper.make_node("Gather", ["token_type", "tt"], ["a"], name="tt_gather"),
         helper.make_node("Gather", ["words", "ids"], ["b"], name="word_gather"),
         helper.make_node("Add", ["a", "b"], ["y"])],
        "g", [helper.make_tensor_value_info(n, TensorProto.INT64, [1, 4]) for n in ("tt", "ids")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 64])], inits,
    )
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(src))
    out = tmp_path / "q.onnx"
    bitpress.quantize(src, out, algorithm="rtn", precision="int4", options={"block_size": 32})
    assert [n.name for n in nodes(out, "GatherBlockQuantized")] == ["word_gather_Q4"]
    out2 = tmp_path / "q2.onnx"
    bitpress.quantize(src, out2, algorithm="rtn", precision="int4", options={"block_size": 32, "gather_min_rows": 1})
    assert len(nodes(out2, "GatherBlockQuantized")) == 2


def test_decoder_component_of_a_top_level_genai_package(genai_folder, tmp_path):
    """`--components decoder` finds the decoder named by genai_config.json, even at the top level."""
    out = tmp_path / "out"
    result = bitpress.quantize(genai_folder, out, algorithm="rtn", precision="int4", components=["decoder"])
    assert (out / "genai_config.json").is_file()
    assert nodes(out / "model.onnx", "MatMulNBits")
    assert {f.name for f in result.files} >= {"model.onnx", "genai_config.json", "tokenizer.json"}


# -- the packing fast path (rtn's stored-layout kernel) against the block solver -----------------------
def _matmul_model(path: Path, w: np.ndarray, *, transposed: bool = False) -> Path:
    """One MatMul reading ``w`` ([K, N]), or ``w.T`` stored [N, K] through a Transpose."""
    k, n = w.shape
    nodes_ = [helper.make_node("MatMul", ["A", "Wt" if transposed else "W"], ["Y"], name="mm")]
    init = numpy_helper.from_array(np.ascontiguousarray(w.T) if transposed else w, "W")
    if transposed:
        nodes_.insert(0, helper.make_node("Transpose", ["W"], ["Wt"], name="t", perm=[1, 0]))
    graph = helper.make_graph(
        nodes_, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])], initializer=[init],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return path


@pytest.mark.parametrize("transposed", [False, True], ids=["KxN", "NxK-through-Transpose"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_packing_kernel_gives_the_block_solvers_bytes_and_a_close_error(tmp_path, monkeypatch, symmetric,
                                                                         transposed):
    from bitpress.models.onnx_model import OnnxModel
    from bitpress_rtn.solver import rtn_packing_kernel, rtn_solver

    monkeypatch.setattr(weightonly, "CHUNK_ELEMENTS", 1 << 16)  # several chunks per weight
    rng = np.random.default_rng(7)
    w = rng.standard_normal((200, 3000)).astype(np.float32)  # K = 200: a padded last block
    w[:, :40] *= 5  # uneven rows: a sampled error must still be close to the exact one
    model = OnnxModel.load(_matmul_model(tmp_path / "m.onnx", w, transposed=transposed))
    (group,) = weightonly.plan(model, weightonly.WeightOnlyOptions(bits=4, block_size=32,
                                                                   is_symmetric=symmetric)).groups
    fast = weightonly.solve_group(model, group, rtn_solver, False, None, rtn_packing_kernel)
    exact = weightonly.solve_group(model, group, rtn_solver, False, None, None)
    np.testing.assert_array_equal(fast.packed, exact.packed)
    np.testing.assert_array_equal(fast.blocks.scales, exact.blocks.scales)
    if not symmetric:
        np.testing.assert_array_equal(fast.blocks.zero_points, exact.blocks.zero_points)
    # the kernel path measures every 2nd row of this 3000-row weight: within 3% of the exact error
    assert abs(fast.error - exact.error) < 0.03 * exact.error


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_packing_kernel_and_block_solver_write_the_same_model(tmp_path, monkeypatch, dtype):
    from bitpress_rtn.passes import RtnPass

    src = build_decoder(tmp_path / "m.onnx", hidden=80, layers=1, vocab=320, tied=True, dtype=dtype)
    outputs = []
    for label in ("kernel", "solver"):
        if label == "solver":
            monkeypatch.setattr(RtnPass, "packing_kernel", lambda self: None)
        out = tmp_path / f"{label}.onnx"
        bitpress.quantize(src, out, algorithm="rtn", precision="int4", options={"block_size": 16})
        outputs.append({t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer})
    assert outputs[0].keys() == outputs[1].keys()
    assert any(name.endswith("_Q4") for name in outputs[0])
    for name, value in outputs[0].items():
        np.testing.assert_array_equal(value, outputs[1][name], err_msg=name)


def test_a_packing_kernel_with_wrong_shapes_is_a_clear_error(tmp_path):
    from bitpress.errors import QuantizationError
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.quant.solver import PackedBlocks
    from bitpress_rtn.solver import rtn_solver

    def broken(w_kn, spec):
        return PackedBlocks(np.zeros((1, 1, 1), np.uint8), np.zeros((1, 1), np.float32), None)

    model = OnnxModel.load(_matmul_model(tmp_path / "m.onnx", np.ones((64, 8), np.float32)))
    (group,) = weightonly.plan(model, weightonly.WeightOnlyOptions(bits=4, block_size=32,
                                                                   is_symmetric=True)).groups
    with pytest.raises(QuantizationError, match="packing kernel returned unexpected shapes"):
        weightonly.solve_group(model, group, rtn_solver, False, None, broken)


@pytest.mark.parametrize("shape", [(1, 1), (3, 1000), (64, 64), (130, 1024), (1024, 7)])
def test_transposed(shape):
    a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    t = weightonly.transposed(a)
    assert t.flags.c_contiguous
    np.testing.assert_array_equal(t, a.T)


def test_node_marked_keep_float_stays_float(tmp_path):
    """A MatMul with the ``bitpress.keep_float`` metadata (QuaRot's online product) is skipped, with its reason."""
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.graph import KEEP_FLOAT, keeps_float

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w2")
    first = helper.make_node("MatMul", ["x", "w1"], ["h"], name="first")
    second = helper.make_node("MatMul", ["h", "w2"], ["y"], name="second")
    entry = second.metadata_props.add()
    entry.key, entry.value = KEEP_FLOAT, "an online rotation"
    graph = helper.make_graph([first, second], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w1, w2])
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    assert keeps_float(second) == "an online rotation" and keeps_float(first) is None
    plan = weightonly.plan(OnnxModel.load(src), weightonly.WeightOnlyOptions(block_size=32))
    assert [g.weight for g in plan.groups] == ["w1"]
    assert plan.skipped["second"] == "an online rotation"
    bitpress.quantize(src, tmp_path / "q.onnx", algorithm="rtn", precision="int4", options={"block_size": 32})
    assert [n.name for n in nodes(tmp_path / "q.onnx", "MatMul")] == ["second"]
    assert len(nodes(tmp_path / "q.onnx", "MatMulNBits")) == 1


def test_only_token_embeddings_are_gathered_quantized(tmp_path):
    """A table read at the token ids is quantized; one read at position ids or at computed indices (a rotary
    cache, a position table) stays float unless nodes_to_include names it (the issue: rounding cos / sin caches
    to 4 bits cost 6 % of a VL decoder's logits)."""
    rng = np.random.default_rng(0)
    tables = [numpy_helper.from_array(rng.standard_normal((128, 64)).astype(np.float32), n)
              for n in ("tok", "pos", "cos")]
    n = [
        helper.make_node("Gather", ["tok", "input_ids"], ["e"], name="embed_tokens"),
        helper.make_node("Gather", ["pos", "position_ids"], ["p"], name="embed_positions"),
        helper.make_node("Range", ["zero", "len", "one"], ["r"], name="range"),
        helper.make_node("Gather", ["cos", "r"], ["c"], name="rotary_cos"),
        helper.make_node("Add", ["e", "p"], ["ep"], name="add"),
        helper.make_node("Add", ["ep", "c"], ["y"], name="add2"),
    ]
    consts = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in (("zero", 0), ("len", 4), ("one", 1))]
    ids = [helper.make_tensor_value_info(k, TensorProto.INT64, [1, 4]) for k in ("input_ids", "position_ids")]
    g = helper.make_graph(n, "g", ids, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 64])],
                          [*tables, *consts])
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(src))
    out = tmp_path / "q.onnx"
    bitpress.quantize(src, out, algorithm="rtn", precision="int4", options={"block_size": 32})
    assert len(nodes(out, "GatherBlockQuantized")) == 1
    assert {x.input[0] for x in nodes(out, "Gather")} == {"pos", "cos"}
    out2 = tmp_path / "q2.onnx"
    bitpress.quantize(src, out2, algorithm="rtn", precision="int4",
                      options={"block_size": 32, "nodes_to_include": ["embed_tokens", "rotary_cos"]})
    assert {x.input[0] for x in nodes(out2, "Gather")} == {"pos"} and len(nodes(out2, "GatherBlockQuantized")) == 2
