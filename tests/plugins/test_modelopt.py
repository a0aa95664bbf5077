"""The NVIDIA ModelOpt plugin (bitpress-modelopt) with ModelOpt installed: every mode, and its side effects.

These tests need ``nvidia-modelopt`` (and torch): they run in the plugin's own environment
(``bitpress env create modelopt``) and are skipped elsewhere. ``modelopt`` is deliberately not
imported at collection: its import configures logging and imports torch.

Models are built here: ``decoder`` (bitpress.synthetic: hidden 128, 2 layers, intermediate 352,
vocab 256, an untied ``/lm_head/MatMul``; 14 linear MatMuls), ``outliers`` (``x * g -> MatMul ->
Relu -> MatMul``, K = N = 256, where ``g`` multiplies 4 of the 256 input channels by 30, as
activation outliers do in LLMs), and a tied decoder for the shared-table rule.

Error figures are ``||y_q - y|| / ||y||`` of the first output against the float model on held-out
random inputs (2 x 16 tokens, two seeds, the worse one), measured with nvidia-modelopt 0.47.0,
onnxruntime 1.32, torch 2.13 CPU; the bounds leave about 1.5x headroom. QDQ outputs are scored
with ``session.qdq_matmulnbits_accuracy_level=1``: ONNX Runtime fuses ``DequantizeLinear ->
MatMul`` into MatMulNBits when it loads a model, by default at accuracy level 4 (int8
activations), which adds its own error (0.4% of the logits here) to the quantizer's.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import os
import re
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

if importlib.util.find_spec("modelopt") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("NVIDIA ModelOpt is not installed here (bitpress env create modelopt)", allow_module_level=True)

import bitpress
from bitpress import synthetic, testing
from bitpress.api import quantize
from bitpress.cpu import int8_saturates
from bitpress.errors import BitpressError, QuantizationError, UsageError
from bitpress.testing import (
    initializer_protos,
    load_proto,
    matmul_nbits_nodes,
    op_counts,
    ort_outputs,
    output_error,
    process_state,
    random_feeds,
    restored_logger,
    run_python,
)

DATA = {"source": "random", "samples": 8, "seq_len": 32}
LINEARS = [f"/model/layers.{i}/{part}/MatMul" for i in range(2) for part in (
    "self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj", "mlp/gate_proj", "mlp/up_proj",
    "mlp/down_proj")]


# -- models and helpers ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.build_decoder(tmp_path_factory.mktemp("decoder") / "model.onnx", hidden=128, layers=2, heads=4,
                                   vocab=256, tied=False)


def build_outlier_model(path: Path, *, k: int = 256, n: int = 256, gain: float = 30.0, seed: int = 0) -> Path:
    """``y = MatMul(Relu(MatMul(x * g, w1)), w2)``; ``g`` is 1 but for 4 input channels at ``gain``."""
    rng = np.random.default_rng(seed)
    g = np.ones(k, np.float32)
    g[[3, 77, 150, 201]] = gain
    w1 = rng.normal(0, 0.05, (k, n)).astype(np.float32)
    w2 = rng.normal(0, 0.05, (n, n)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "g"], ["xs"], name="/model/norm/Mul"),
             helper.make_node("MatMul", ["xs", "w1"], ["h"], name="/model/fc1/MatMul"),
             helper.make_node("Relu", ["h"], ["r"], name="/model/act/Relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="/model/fc2/MatMul")]
    graph = helper.make_graph(
        nodes, "outliers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", n])],
        [numpy_helper.from_array(a, name) for a, name in ((g, "g"), (w1, "w1"), (w2, "w2"))])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), path)
    return path


@pytest.fixture(scope="module")
def outliers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_outlier_model(tmp_path_factory.mktemp("outliers") / "model.onnx")


def _run(src: Path, tmp_path: Path, pass_name: str = "modelopt_int4", /, data: object = None,
         name: str | None = None, **options: object) -> Path:
    """``bitpress.api.quantize`` (the host's whole path: checker and ONNX Runtime load included)."""
    out = tmp_path / f"{name or pass_name}.onnx"
    quantize(src, out, algorithm=pass_name, options=options, data=data)
    return out


def _outputs(path: Path, src: Path, seed: int = 123, exact: bool = True) -> list[np.ndarray]:
    """Every output on random inputs (2 x 16 tokens); ``exact``: ORT's own DQ -> MatMul fusion at fp32
    accuracy, as MatMulNBits with accuracy_level 0 computes."""
    return ort_outputs(path, random_feeds(src, seed), exact_qdq=exact)


def _rel_error(src: Path, out: Path) -> float:
    """The first output, the worse of two random batches, both models scored exactly (see _outputs)."""
    return output_error(src, out, exact_qdq=True)


def _nbits(path: Path) -> dict[str, dict[str, object]]:
    """MatMulNBits nodes by the name of the MatMul they replace (the host names them ``<MatMul>_Q<bits>``)."""
    return {re.sub(r"_Q\d+$", "", n.name): testing.attrs(n) for n in matmul_nbits_nodes(path)}


def _dq_weights(path: Path) -> dict[str, tuple[int, dict[str, object]]]:
    """The MatMul each DequantizeLinear feeds -> (its integer weight's ONNX type, the DQ's attributes)."""
    model = load_proto(path)
    inits = initializer_protos(model)
    readers = {i: n for n in model.graph.node for i in n.input}
    return {readers[n.output[0]].name: (inits[n.input[0]].data_type, testing.attrs(n))
            for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}


def _integer_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every integer and scale tensor of a quantized output (DQ / MatMulNBits inputs), by name."""
    model = load_proto(path)
    inits = initializer_protos(model)
    names = {i for n in model.graph.node if n.op_type in ("DequantizeLinear", "MatMulNBits") for i in n.input[1:]}
    names |= {n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return {k: numpy_helper.to_array(inits[k]) for k in names if k in inits}


def _check_runs(path: Path, src: Path) -> None:
    """ONNX Runtime runs the model; every output is there, shaped as the float model's, finite."""
    ref = _outputs(src, src)
    got = _outputs(path, src)
    assert len(got) == len(ref)
    for a, b in zip(ref, got, strict=True):
        assert a.shape == b.shape and np.isfinite(b).all()


# -- int4 ---------------------------------------------------------------------------------------------------
# measured on `decoder` (QDQ scored exactly; MatMulNBits gives the same logits): awq_lite .0728, awq_clip
# .0636, rtn_dq .0698; awq_lite without fusion and with zero points .0604 (random weights and random
# calibration data: AWQ has no outliers to protect here, see test_awq_beats_rtn_on_activation_outliers)
INT4 = {
    "awq_lite": ({}, 0.11),
    "awq_clip": ({"calibration_method": "awq_clip"}, 0.095),
    "rtn_dq": ({"algorithm": "rtn"}, 0.105),
    "awq_lite_zp_unfused": ({"use_zero_point": True, "awqlite_fuse_nodes": False}, 0.09),
}


@pytest.mark.parametrize("mode", sorted(INT4))
def test_int4_modes(mode: str, decoder: Path, tmp_path: Path) -> None:
    options, bound = INT4[mode]
    data = None if mode == "rtn_dq" else DATA  # RTN needs no data: the pass does not ask for it
    qdq = _run(decoder, tmp_path, data=data, name="qdq", output_format="qdq", **options)
    # accuracy_level 0 (float32 compute) for the comparison with the QDQ form below; the default (4: int8
    # activations, ONNX Runtime's fast kernels) is checked at the end
    nbits = _run(decoder, tmp_path, data=data, name="nbits", accuracy_level=0, **options)

    # ModelOpt's form: DequantizeLinear(int4 / uint4, blocks of 128 along K, axis 0) -> MatMul at opset 21;
    # the LM head left in float (ModelOpt's default exclusion)
    model = load_proto(qdq)
    assert {o.domain: o.version for o in model.opset_import}[""] == 21
    weights = _dq_weights(qdq)
    assert sorted(weights) == sorted(LINEARS)
    zero_points = bool(options.get("use_zero_point"))
    for dtype, attrs in weights.values():
        assert dtype == (TensorProto.UINT4 if zero_points else TensorProto.INT4)
        assert attrs == {"axis": 0, "block_size": 128}
    dq_inputs = [len(n.input) for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert dq_inputs == [3 if zero_points else 2] * 14
    head = next(n for n in model.graph.node if n.name == "/lm_head/MatMul")
    inits = initializer_protos(model)
    assert inits[head.input[1]].data_type == TensorProto.FLOAT

    # MatMulNBits: the same integers and scales, so the same logits (within float rounding)
    nb = _nbits(nbits)
    assert sorted(nb) == sorted(LINEARS) and op_counts(nbits)["DequantizeLinear"] == 0
    assert all(a["bits"] == 4 and a["block_size"] == 128 for a in nb.values())
    for seed in (123, 124):
        a, b = _outputs(qdq, decoder, seed)[0], _outputs(nbits, decoder, seed)[0]
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), mode
    _check_runs(nbits, decoder)
    err = _rel_error(decoder, nbits)
    assert 1e-3 < err < bound, f"{mode}: error {err:.4f}"
    if mode == "rtn_dq":  # the default accuracy_level: 4, the int8 kernels (bitpress.onnx.kernels)
        from bitpress.onnx.kernels import graph_paths

        fast = _run(decoder, tmp_path, data=data, name="fast", **options)
        assert all(a.get("accuracy_level") == 4 for a in _nbits(fast).values())
        assert not graph_paths(load_proto(fast).graph).slow()
        assert 1e-3 < _rel_error(decoder, fast) < bound


def test_awq_scales_are_folded_or_multiplied(decoder: Path, tmp_path: Path) -> None:
    """awq_lite's pre-quant scales: folded into the RMSNorm weights before q/k/v and gate/up (one scale per
    group reading the same activation), a Mul before o_proj and down_proj (their inputs come from no
    scaling op); without fusion, a Mul before every MatMul. ModelOpt 0.47.0 on CPU cannot fuse by itself
    (cupy's ``.get()`` on a numpy array): see test_awq_fusion_needs_the_cpu_fix."""
    float_model = load_proto(decoder)
    fused = load_proto(_run(decoder, tmp_path, data=DATA, name="fused", output_format="qdq"))
    unfused = load_proto(_run(decoder, tmp_path, data=DATA, name="unfused", output_format="qdq",
                              awqlite_fuse_nodes=False))
    base_muls = op_counts(float_model)["Mul"]
    assert op_counts(fused)["Mul"] == base_muls + 4
    assert op_counts(unfused)["Mul"] == base_muls + 14

    def norm_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
        return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if "layernorm.weight" in t.name}

    before, after, kept = norm_weights(float_model), norm_weights(fused), norm_weights(unfused)
    assert len(before) == 4 and before.keys() == after.keys() == kept.keys()
    assert all(not np.allclose(before[k], after[k]) for k in before), "fused scales change every norm weight"
    assert all(np.array_equal(before[k], kept[k]) for k in before)
    producers = {o: n for n in fused.graph.node for o in n.output}
    for name in ("/model/layers.0/self_attn/o_proj/MatMul", "/model/layers.1/mlp/down_proj/MatMul"):
        matmul = next(n for n in fused.graph.node if n.name == name)
        assert producers[matmul.input[0]].op_type == "Mul" and "pre_quant_scale" in producers[matmul.input[0]].name


def test_matmulnbits_output_is_not_larger(tmp_path: Path) -> None:
    """MatMulNBits stores the int4 integers packed as ModelOpt's int4 tensors, and the same scales: the
    same size, plus the padding of K to a whole block. Measured: with every K a multiple of 128
    (intermediate 384) 0.994x the QDQ file (515,405 / 518,538 bytes); with K = 352 (padded to 384)
    1.002x. What MatMulNBits saves is load time and memory (docs/modelopt.md), not disk."""
    src = synthetic.build_decoder(tmp_path / "src" / "model.onnx", hidden=128, layers=2, heads=4, vocab=256,
                                  tied=False, intermediate=384)
    qdq = _run(src, tmp_path, name="qdq", output_format="qdq", algorithm="rtn")
    nbits = _run(src, tmp_path, name="nbits", algorithm="rtn")
    assert len(_nbits(nbits)) == 14
    assert nbits.stat().st_size <= qdq.stat().st_size


def test_layers_8bit_gives_8bit_matmulnbits_for_exactly_those(decoder: Path, tmp_path: Path) -> None:
    """The seed's syntax: ModelOpt matches dot-separated parts of node names, per-channel int8."""
    patterns = "model.layers.0.mlp, model.layers.1.self_attn.q_proj"
    eight = {"/model/layers.0/mlp/gate_proj/MatMul", "/model/layers.0/mlp/up_proj/MatMul",
             "/model/layers.0/mlp/down_proj/MatMul", "/model/layers.1/self_attn/q_proj/MatMul"}
    for algorithm in ("rtn", "awq"):
        out = _run(decoder, tmp_path, data=DATA, name=algorithm, algorithm=algorithm, layers_8bit=patterns)
        nb = _nbits(out)
        assert sorted(nb) == sorted(LINEARS)
        assert {k for k, a in nb.items() if a["bits"] == 8} == eight, algorithm
        assert all(a["bits"] == 4 and a["block_size"] == 128 for k, a in nb.items() if k not in eight)
        _check_runs(out, decoder)
    qdq = _dq_weights(_run(decoder, tmp_path, name="qdq", output_format="qdq", algorithm="rtn", layers_8bit=patterns))
    assert {k for k, (dtype, _) in qdq.items() if dtype == TensorProto.INT8} == eight
    assert all(attrs == {"axis": 1} for k, (_, attrs) in qdq.items() if k in eight)  # one scale per output channel
    # 'model.layers.1' is not 'model.layers.10': a pattern that matches nothing is refused before any work
    with pytest.raises(UsageError, match=r"layers_8bit 'model.layers.10' matches no"):
        _run(decoder, tmp_path, name="bad", algorithm="rtn", layers_8bit="model.layers.0,model.layers.10")
    assert not (tmp_path / "bad.onnx").exists()


def test_enable_mixed_quant_uses_modelopts_default_layers(decoder: Path, tmp_path: Path) -> None:
    # ModelOpt's rule for 2 layers: v_proj and down_proj of layer 0 (every third layer from the first)
    out = _run(decoder, tmp_path, name="mixed", algorithm="rtn", enable_mixed_quant=True)
    eight = {k for k, a in _nbits(out).items() if a["bits"] == 8}
    assert eight == {"/model/layers.0/self_attn/v_proj/MatMul", "/model/layers.0/mlp/down_proj/MatMul"}


def test_nodes_to_exclude(decoder: Path, tmp_path: Path) -> None:
    # a list of its own replaces the default (as ModelOpt's): the LM head is quantized unless listed
    out = _run(decoder, tmp_path, name="ex", algorithm="rtn", nodes_to_exclude=["/model/layers.1/mlp/*"])
    assert sorted(_nbits(out)) == sorted(n for n in [*LINEARS, "/lm_head/MatMul"] if "/layers.1/mlp/" not in n)
    assert op_counts(out)["MatMul"] == 3 + 4  # the excluded three, the four attention MatMuls
    head = _run(decoder, tmp_path, name="head", algorithm="rtn", nodes_to_exclude=[])
    assert sorted(_nbits(head)) == sorted([*LINEARS, "/lm_head/MatMul"])
    with pytest.raises(UsageError, match="matches no node"):
        _run(decoder, tmp_path, name="typo", algorithm="rtn", nodes_to_exclude=["/model/layers.1/mlp_typo/*"])


def test_tied_table_stays_one_tensor(tmp_path: Path) -> None:
    """ModelOpt copies shared initializers by default (a tied table became a float copy for the Gather and
    an int4 copy for the LM head Gemm); the plugin turns that off: one table, quantized for both or neither."""
    src = synthetic.build_decoder(tmp_path / "tied" / "model.onnx", hidden=128, layers=1, heads=4, vocab=256,
                                  tied=True, head_via_transpose=False)
    table = "model.embed_tokens.weight"

    def tables(path: Path) -> list[str]:
        return [t.name for t in load_proto(path).graph.initializer if t.name.startswith(table)]

    default = _run(src, tmp_path, name="default", algorithm="rtn")
    assert tables(default) == [table]
    both = _run(src, tmp_path, name="both", algorithm="rtn", nodes_to_exclude=[])
    model = load_proto(both)
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(tables(both)) == 2 and any(n.input[0].startswith(table) for n in dq)  # the int4 table + its scales
    readers = {n.op_type for n in model.graph.node for i in n.input if i.startswith(table) and "DequantizeLinear" in i}
    assert readers == {"Gather", "Gemm"}, "both read the one dequantized table"
    _check_runs(both, src)


def test_a_model_the_onnx_checker_rejects_is_refused_clearly(tmp_path: Path) -> None:
    """ModelOpt checks its input with onnx.checker first: the ORT GenAI builder's exports (ONNX Runtime's
    SimplifiedLayerNormalization in the ONNX domain) fail there; the error says so and what to do."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["n"], name="/model/norm", axis=-1,
                              epsilon=1e-5),
             helper.make_node("MatMul", ["n", "w"], ["y"], name="/model/fc/MatMul")]
    graph = helper.make_graph(
        nodes, "builder_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 128])],
        [numpy_helper.from_array(np.ones(128, np.float32), "g"),
         numpy_helper.from_array(rng.normal(0, 0.05, (128, 128)).astype(np.float32), "w")])
    src = tmp_path / "builder_like.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), src)
    with pytest.raises(UsageError, match=r"ONNX checker .* SimplifiedLayerNormalization .* export with torch.onnx"):
        _run(src, tmp_path, name="out", algorithm="rtn")
    assert not (tmp_path / "out.onnx").exists()


# -- AWQ and its data ----------------------------------------------------------------------------------------
def test_awq_weights_depend_on_the_calibration_data(outliers: Path, tmp_path: Path) -> None:
    for method in ("awq_lite", "awq_clip"):
        a = _integer_tensors(_run(outliers, tmp_path, data=DATA, name=f"{method}_a", calibration_method=method))
        b = _integer_tensors(_run(outliers, tmp_path, data={**DATA, "seed": 5}, name=f"{method}_b",
                                  calibration_method=method))
        assert a.keys() == b.keys()
        assert any(not np.array_equal(a[k], b[k]) for k in a), f"{method}: other data, same weights"
    # round to nearest reads no data: the same weights whatever --data says
    r1 = _integer_tensors(_run(outliers, tmp_path, data=DATA, name="rtn_a", algorithm="rtn"))
    r2 = _integer_tensors(_run(outliers, tmp_path, data={**DATA, "seed": 5}, name="rtn_b", algorithm="rtn"))
    assert all(np.array_equal(r1[k], r2[k]) for k in r1)


def test_awq_beats_rtn_on_activation_outliers(outliers: Path, tmp_path: Path) -> None:
    """Measured: rtn_dq .159, awq_lite .124 (.78x), awq_clip .088 (.55x) on the outlier model."""
    err = {m: _rel_error(outliers, _run(outliers, tmp_path, data=DATA, name=m, calibration_method=m))
           for m in ("rtn_dq", "awq_lite", "awq_clip")}
    assert err["rtn_dq"] < 0.24, err
    assert err["awq_lite"] < 0.9 * err["rtn_dq"], err
    assert err["awq_clip"] < 0.75 * err["rtn_dq"], err


def test_awq_needs_data_and_rtn_does_not(decoder: Path, tmp_path: Path) -> None:
    # without data awq would calibrate on the model's own text, which needs its tokenizer: this decoder has none
    with pytest.raises(UsageError, match=r"own calibration text needs its tokenizer: .*give calibration data"):
        _run(decoder, tmp_path, name="awq")
    assert _nbits(_run(decoder, tmp_path, name="rtn", algorithm="rtn"))


def test_calibration_from_npz_file(outliers: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    npz = tmp_path / "calib.npz"
    np.savez(npz, x=rng.standard_normal((4, 24, 256)).astype(np.float32))
    out = _run(outliers, tmp_path, data={"source": str(npz), "samples": 4}, name="npz")
    assert len(_nbits(out)) == 2 and _rel_error(outliers, out) < 0.19  # measured .1285 (random data: .124)


def test_awq_calibrates_on_text_with_the_packages_tokenizer(genai_folder: Path, tmp_path: Path) -> None:
    """--data text.txt: the host cuts the text into windows with the package's tokenizer.json (no dataset
    download, unlike Olive's pass); other text, other AWQ weights; the package's other files are carried."""
    texts = []
    for seed in (0, 1):  # the synthetic tokenizer's words are tok3 .. tok255: two texts of different halves
        rng = np.random.default_rng(seed)
        words = [f"tok{i}" for i in (range(3, 128) if seed == 0 else range(128, 256))]
        path = tmp_path / f"text{seed}.txt"
        path.write_text("\n".join(" ".join(rng.choice(words, 40)) for _ in range(12)))
        texts.append(path)
    outs = []
    for i, text in enumerate(texts):
        out = tmp_path / f"pkg{i}"
        quantize(genai_folder, out, algorithm="modelopt_int4", options={"block_size": 32},
                 data={"source": str(text), "samples": 4, "seq_len": 16})
        assert (out / "genai_config.json").is_file() and (out / "tokenizer.json").is_file()
        outs.append(_integer_tensors(out / "model.onnx"))
    assert len(_nbits(tmp_path / "pkg0" / "model.onnx")) == 14
    assert any(not np.array_equal(outs[0][k], outs[1][k]) for k in outs[0]), "other text, same weights"


# -- int8 ---------------------------------------------------------------------------------------------------
# measured on `decoder`, VNNI (this machine): entropy .0181, max .0186; AVX2 (the same saved models run
# by ONNX Runtime under qemu-x86_64 -cpu Haswell): entropy .0338, max .0306. ModelOpt's int8 is symmetric
# 8-bit activations and per-channel 8-bit weights with no reduce_range: ONNX Runtime's u8s8 kernels
# saturate int16 pair sums on CPUs without VNNI. Bounds per CPU class (bitpress.cpu.int8_saturates).
INT8_BOUNDS = {"entropy": (0.028, 0.05), "max": (0.028, 0.046)}


@pytest.mark.parametrize("method", sorted(INT8_BOUNDS))
def test_int8(method: str, decoder: Path, tmp_path: Path) -> None:
    out = _run(decoder, tmp_path, "modelopt_int8", DATA, name=method, calibration_method=method)
    model = load_proto(out)
    inits = initializer_protos(model)
    ops = op_counts(out)
    assert ops["QuantizeLinear"] > 0
    # dq_only: the 15 MatMul weights (the LM head included) stored as int8, per output channel
    weights = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
               and inits[n.input[0]].data_type == TensorProto.INT8]
    assert len(weights) == 15 and all(testing.attrs(n).get("axis") == 1 for n in weights)
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] in inits for n in model.graph.node)
    _check_runs(out, decoder)
    vnni, avx2 = INT8_BOUNDS[method]
    err = _rel_error(decoder, out)
    assert 1e-3 < err < (avx2 if int8_saturates() else vnni), f"{method}: error {err:.4f}"


def test_int8_options(decoder: Path, tmp_path: Path) -> None:
    qdq = _run(decoder, tmp_path, "modelopt_int8", DATA, name="qdq", dq_only=False, calibration_method="max")
    small = _run(decoder, tmp_path, "modelopt_int8", DATA, name="dq", calibration_method="max")
    assert small.stat().st_size < 0.4 * qdq.stat().st_size  # int8 instead of float weights: 0.34x measured
    assert _rel_error(decoder, qdq) < INT8_BOUNDS["max"][1]
    fp16 = load_proto(_run(decoder, tmp_path, "modelopt_int8", DATA, name="fp16", high_precision_dtype="fp16",
                           calibration_method="max", nodes_to_exclude=["/lm_head/MatMul"]))
    assert any(t.data_type == TensorProto.FLOAT16 for t in fp16.graph.initializer)
    assert fp16.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT  # the graph's types are kept
    head = next(n for n in fp16.graph.node if n.name == "/lm_head/MatMul")
    producers = {o: n.op_type for n in fp16.graph.node for o in n.output}
    assert producers.get(head.input[1]) != "DequantizeLinear"
    with pytest.raises(UsageError, match="needs calibration data"):
        _run(decoder, tmp_path, "modelopt_int8", name="nodata")


# -- the command line, Olive's name ------------------------------------------------------------------------
@pytest.fixture
def cli_logging():
    """The CLI points the ``bitpress`` logger at this test's captured stderr: put it back after."""
    with restored_logger("bitpress"):
        yield


def test_cli_quantize_and_olive_style_recipe(run_cli, cli_logging, decoder: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli.onnx"
    code, stdout, err = run_cli("quantize", "-m", decoder, "-o", out, "--algorithm", "modelopt_int4",
                                "--precision", "int4", "--data", "random", "--option", "calibration_method=awq_clip")
    assert code == 0, err
    assert "modelopt_int4 on model.onnx: ModelOpt 0.47.0 int4 awq_clip (block 128)" in stdout, stdout
    assert "MatMulNBits x14" in stdout
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        input: {decoder}
        output: {tmp_path / 'olive.onnx'}
        data: {{source: random, samples: 4, seq_len: 16}}
        passes:
          - type: NVModelOptQuantization
            algorithm: awq
            calibration_method: awq_lite
            layers_8bit: model.layers.0,model.layers.1.mlp
        """))
    code, stdout, err = run_cli("run", recipe)
    assert code == 0, err
    bits = collections.Counter(a["bits"] for a in _nbits(tmp_path / "olive.onnx").values())
    assert bits == {8: 10, 4: 4}


def test_the_seeds_layers_8bit_example_as_written(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Olive's example as the seed writes it: tokenizer_dir, no data (the model's own text, read with that
    tokenizer), and ``layers_8bit`` naming lm_head, which ModelOpt's default exclusion would leave in float."""
    synthetic.build_decoder(tmp_path / "model" / "model.onnx", hidden=128, layers=3, heads=4, vocab=256,
                            tied=False)
    synthetic.write_tokenizer(tmp_path / "tok", vocab=256)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(textwrap.dedent("""\
        input_model: {type: ONNXModel, model_path: model/model.onnx}
        output_dir: out
        passes:
          quantization:
            type: NVModelOptQuantization
            algorithm: awq
            tokenizer_dir: tok
            calibration_method: awq_lite
            layers_8bit: "model.layers.0,model.layers.1,lm_head"
        """))
    with caplog.at_level(logging.INFO, logger="bitpress"), caplog.at_level(logging.INFO, logger="bitpress_modelopt"):
        result = bitpress.run(recipe)
    assert "calibrates on text the model writes itself" in caplog.text
    assert "layers_8bit names /lm_head/MatMul, which ModelOpt's default nodes_to_exclude leaves in float" in \
        caplog.text
    out = Path(result.output)
    nb = _nbits(out if out.suffix == ".onnx" else out / "model.onnx")
    eight = {k for k, a in nb.items() if a["bits"] == 8}
    assert eight == {*(n for n in LINEARS), "/lm_head/MatMul"}
    assert {k for k, a in nb.items() if a["bits"] == 4} == {n.replace("layers.0", "layers.2") for n in LINEARS[:7]}
    (tmp_path / "tok" / "tokenizer.json").unlink()  # the tokenizer named is the one read
    with pytest.raises(BitpressError, match="tok"):
        bitpress.run(recipe, overwrite=True)


# -- containment of ModelOpt's side effects -----------------------------------------------------------------
def _import_modelopt() -> None:
    from bitpress_modelopt.sandbox import import_modelopt

    import_modelopt()  # once per process; then only a run's own side effects are left to see


def _ort_and_gs_state() -> dict[str, object]:
    """What ModelOpt patches in ONNX Runtime's quantization tool and in onnx-graphsurgeon."""
    import onnx_graphsurgeon as gs
    from onnxruntime.quantization import base_quantizer, calibrate, qdq_quantizer, registry

    classes = (calibrate.CalibraterBase, calibrate.MinMaxCalibrater, calibrate.HistogramCalibrater,
               calibrate.HistogramCollector, qdq_quantizer.QDQQuantizer, base_quantizer.BaseQuantizer,
               gs.exporters.onnx_exporter.OnnxExporter)
    return {
        "classes": {c.__qualname__: dict(vars(c)) for c in classes},
        "create_calibrator": calibrate.create_calibrator,
        "qdq_registry": dict(registry.QDQRegistry), "qlinear_registry": dict(registry.QLinearOpsRegistry),
        "gs_attrs": {k for k in vars(gs) if k.startswith("make_")},
    }


def _process_state() -> dict[str, object]:
    mo = logging.getLogger("modelopt.onnx")
    return {
        **process_state(), "tempdir": tempfile.tempdir,
        "modelopt_logger": (list(mo.handlers), mo.propagate, mo.level, type(mo)),
        "int4_np": sys.modules["modelopt.onnx.quantization.int4"].np,
        "tqdm_init": sys.modules["tqdm.std"].tqdm.__dict__["__init__"],
        **_ort_and_gs_state(),
    }


def test_runs_leave_process_and_cwd_alone(decoder: Path, tmp_path: Path, monkeypatch) -> None:
    _import_modelopt()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    log_file = tmp_path / "app.log"
    handler = logging.FileHandler(log_file, mode="w")
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # the caller's own filter must survive
            before = _process_state()
            _run(decoder, tmp_path, data=DATA, name="lite")
            _run(decoder, tmp_path, "modelopt_int8", DATA, name="i8")
            after = _process_state()
        changed = [k for k in before if before[k] != after[k]]
        assert not changed, changed
        assert os.getcwd() == str(cwd) and list(cwd.iterdir()) == []
        logging.getLogger("app").warning("still logging")
        handler.flush()
        text = log_file.read_text()
        assert "still logging" in text
        assert "modelopt" not in text.lower() and "g++" not in text, "ModelOpt's records reached a root handler"
    finally:
        root.removeHandler(handler)
        handler.close()


def test_modelopt_patches_of_onnxruntime_are_undone(decoder: Path, tmp_path: Path) -> None:
    """int8 patches ONNX Runtime's calibrators and deletes op types from its registries; int4 patches
    onnx-graphsurgeon's exporter: without ``restored_packages`` both stay for the whole process."""
    from bitpress_modelopt import sandbox

    _import_modelopt()
    before = _ort_and_gs_state()
    _run(decoder, tmp_path, "modelopt_int8", DATA, name="i8")
    _run(decoder, tmp_path, name="i4", algorithm="rtn")
    assert _ort_and_gs_state() == before
    # what the hook undid, seen without it: ModelOpt called directly under the host's containment only
    from bitpress.toolkit.containment import contained as host_contained

    hook = sandbox.restored_packages()
    with host_contained(tmp_path / "raw", relay=sandbox.modelopt_log, loggers=sandbox.LOGGERS), \
            hook(None) as state:  # type: ignore[arg-type]
        sys.modules["modelopt.onnx.quantization.ort_utils"].configure_ort(
            ["MatMul", "Softmax"], [], None, ["cpu"], False, [], None)
        sys.modules["modelopt.onnx.quantization.gs_patching"].patch_gs_modules()
        changed = state.changes()
    assert any("CalibraterBase.__init__" in c for c in changed), changed
    assert any("OnnxExporter.export_tensor_proto" in c for c in changed), changed
    assert _ort_and_gs_state() == before


def test_modelopt_output_is_logged_not_printed(decoder: Path, tmp_path: Path, capfd, caplog) -> None:
    _import_modelopt()
    caplog.set_level(logging.DEBUG, logger="bitpress_modelopt")
    capfd.readouterr()
    _run(decoder, tmp_path, data=DATA, name="lite")
    _run(decoder, tmp_path, "modelopt_int8", DATA, name="entropy")  # ONNX Runtime's entropy calibrator prints
    _run(decoder, tmp_path, "modelopt_int8", DATA, name="max", calibration_method="max")  # looks for GPUs
    out, err = capfd.readouterr()
    assert "[modelopt]" not in out + err and "it/s" not in err, "ModelOpt's logs or tqdm bars reached the terminal"
    assert "Finding optimal threshold" not in out
    messages = [r.getMessage() for r in caplog.records if r.name == "bitpress_modelopt.modelopt"]
    # once: modelopt.onnx stays detached (ModelOpt sets propagate=True; its parent would relay it again)
    assert sum("Starting INT4 quantization" in m for m in messages) == 1
    assert any("Finding optimal threshold" in m for m in messages), "printed lines go to the log"
    assert not any(r.name.startswith("modelopt") for r in caplog.records), "raw ModelOpt records propagated"
    # ModelOpt's "no GPU here" ERROR (int8 max) and "no cupy" WARNING (int4): true on every CPU, so DEBUG
    noise = [r for r in caplog.records if r.name == "bitpress_modelopt.modelopt" and r.levelno > logging.DEBUG
             and ("GPU count" in r.getMessage() or "cupy" in r.getMessage())]
    assert not noise and any("GPU count" in m for m in messages) and any("cupy" in m for m in messages)


def test_modelopt_temp_files_stay_in_the_work_folder(decoder: Path, tmp_path: Path, monkeypatch) -> None:
    """AWQ and int8 write a full copy of the model with tempfile.mkstemp: the system temporary folder
    (here a path that is a file, so that any use of it fails) is never used."""
    _import_modelopt()
    blocked = tmp_path / "no-temp-here"
    blocked.write_text("a file, not a folder")
    monkeypatch.setattr(tempfile, "tempdir", str(blocked))
    _run(decoder, tmp_path, data=DATA, name="lite")
    _run(decoder, tmp_path, "modelopt_int8", DATA, name="i8")
    assert tempfile.tempdir == str(blocked)


def test_awq_fusion_needs_the_cpu_fix(outliers: Path, tmp_path: Path) -> None:
    """ModelOpt 0.47.0 without cupy: awq_lite's default fusion fails on its own (numpy arrays have no
    ``.get()``); with the plugin's fix it runs (test_awq_scales_are_folded_or_multiplied checks the result)."""
    from bitpress_modelopt.sandbox import contained

    _import_modelopt()
    moq = sys.modules["modelopt.onnx.quantization"]
    feeds = [{"x": np.random.default_rng(s).standard_normal((1, 16, 256)).astype(np.float32)} for s in range(2)]
    with pytest.raises(AttributeError, match="has no attribute 'get'"), contained(tmp_path / "w", awq_fix=False):
        moq.quantize(str(outliers), quantize_mode="int4", calibration_method="awq_lite", calibration_eps=["cpu"],
                     calibration_data={"x": np.concatenate([f["x"] for f in feeds])},
                     output_path=str(tmp_path / "raw.onnx"), log_level="ERROR")
    out = _run(outliers, tmp_path, data=DATA, name="fixed")
    assert len(_nbits(out)) == 2


def test_lazy_imports_find_the_paths_modelopt_added(tmp_path: Path) -> None:
    """ONNX Runtime's transformer tools put their folder on sys.path when first imported (during ModelOpt's
    import) and import their siblings as top-level modules: a module of theirs imported later, in a call,
    needs that entry, which the import's containment took away again."""
    import importlib

    from bitpress_modelopt.sandbox import contained

    _import_modelopt()
    folder = str(Path(importlib.util.find_spec("onnxruntime").origin).parent / "transformers")
    assert folder not in sys.path
    with contained(tmp_path / "w"):
        importlib.import_module("onnxruntime.transformers.fusion_bias_add")  # imports fusion_base, top-level
    assert folder not in sys.path


def test_state_is_restored_when_modelopt_fails(decoder: Path, tmp_path: Path, monkeypatch) -> None:
    _import_modelopt()
    monkeypatch.chdir(tmp_path)
    before = _process_state()
    # a failure in the middle of a call: ModelOpt's int4 writer raises
    int4 = sys.modules["modelopt.onnx.quantization.int4"]

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(int4, "quantize_rtn", broken)
    with pytest.raises(QuantizationError, match=r"ModelOpt int4 rtn_dq .* failed: RuntimeError: simulated failure"):
        _run(decoder, tmp_path, name="fail", algorithm="rtn")
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert _process_state() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == []


_FIRST_IMPORT = textwrap.dedent("""\
    import io, json, logging, os, sys, warnings
    handler = logging.StreamHandler(io.StringIO())
    # what reaches the root handlers besides bitpress's own loggers (the relay re-emits ModelOpt's, demoted)
    handler.addFilter(lambda record: not record.name.startswith("bitpress"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    warnings.simplefilter("error", DeprecationWarning)
    from bitpress_modelopt.sandbox import import_modelopt  # the host's imports come first
    before = (list(root.handlers), root.level, list(warnings.filters), dict(os.environ), list(sys.path))
    import_modelopt()
    after = (list(root.handlers), root.level, list(warnings.filters), dict(os.environ), list(sys.path))
    mo = logging.getLogger("modelopt.onnx")
    import tqdm
    bar = io.StringIO()
    for _ in tqdm.tqdm(range(3), file=bar):
        pass
    print(json.dumps({
        "imported": "modelopt.onnx.quantization" in sys.modules,
        "same": [a == b for a, b in zip(before, after)],
        "root_saw": handler.stream.getvalue(),
        "modelopt_logger": [len(mo.handlers), mo.propagate],
        "cwd_files": os.listdir("."),
        "tqdm_draws": bool(bar.getvalue()),
    }))
    """)


def test_first_import_is_contained(tmp_path: Path) -> None:
    """In a fresh process: ModelOpt's import (torch, logging set-up, warning filters, sys.path) leaves no trace."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = run_python(_FIRST_IMPORT, cwd=cwd, timeout=600)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["imported"] and result["same"] == [True] * 5, result
    assert result["root_saw"] == "", result["root_saw"][:300]
    assert result["modelopt_logger"] == [0, True]  # a library logger again: no handler, propagates
    assert result["cwd_files"] == []
    assert result["tqdm_draws"], "tqdm imported under the containment's TQDM_DISABLE=1 stays off for good"
    assert "[modelopt]" not in proc.stdout + proc.stderr
