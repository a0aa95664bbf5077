"""The Qualcomm AIMET plugin (bitpress-aimet) with aimet-onnx installed: every technique, and AIMET's side effects.

These tests need ``aimet-onnx`` (and torch): they run in the plugin's own environment
(``bitpress env create aimet``) and are skipped elsewhere. ``aimet_onnx`` is deliberately not
imported at collection: its import closes every logging handler of the process (see
``bitpress_aimet.sandbox``), which would break pytest's own logging capture.

Error figures are ``||y_q - y|| / ||y||`` of the first output against the float model, the
worse of two random batches (2 x 16 tokens), calibrated on the host's random data (8 x 32
tokens), measured with aimet-onnx 2.42.0, onnxruntime 1.32, torch 2.13 CPU on a CPU with
avx512_vnni; bounds leave about 1.5x headroom. Models: ``tiny_decoder`` (conftest: Llama-like,
hidden 64, 2 layers, tied embedding / LM head), ``tiny_encoder`` (BERT-like, hidden 64, 2
layers) and a 1-layer encoder built here for AdaRound (fast enough for 1000 iterations).

The technique comparisons use ``activation_type=fp16``: AIMET's QDQ export then quantizes the
weights only, so the error measures what the technique did to the weights. With uint8 / uint16
activations the tiny models' error is dominated by activation ranges clipped on 8 calibration
samples (measured: 1-layer encoder, uint16 activations, all weight quantizers off: .014 with one
random data set, .005 with another), which would hide the techniques' effect.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

if importlib.util.find_spec("aimet_onnx") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("AIMET is not installed here (bitpress env create aimet)", allow_module_level=True)

from bitpress import synthetic
from bitpress.api import quantize
from bitpress.cpu import int8_saturates
from bitpress.errors import OptionError, QuantizationError, UsageError
from bitpress.testing import attrs, initializer_protos, initializers, load_proto, op_counts, output_error

#: calibration data: the host's random source, 8 samples of 32 tokens
DATA = {"source": "random", "samples": 8, "seq_len": 32}
OTHER_DATA = {**DATA, "seed": 1}
W4 = {"precision": "int4", "activation_type": "fp16"}  # int4 weights, error from the weights only


@pytest.fixture(scope="module")
def encoder1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer BERT-like encoder (6 linears): AdaRound's 1000 iterations per layer stay quick."""
    return synthetic.build_encoder(tmp_path_factory.mktemp("encoder1") / "model.onnx", hidden=64, layers=1)


def _run(src: Path, tmp_path: Path, name: str, /, data: object = DATA, **options: object) -> Path:
    """``bitpress.api.quantize`` with the aimet pass (the host's whole path: checker, ONNX Runtime load)."""
    out = tmp_path / f"{name}.onnx"
    quantize(src, out, algorithm="aimet", options=options, data=data, jobs=1)
    return out


def _weight_dqs(path: Path) -> list[tuple[onnx.NodeProto, onnx.TensorProto]]:
    """The DequantizeLinear of each linear weight (x: its integers), with that initializer.

    A weight reaches its MatMul / Gemm (input 1) from the DequantizeLinear directly or through a
    Transpose (the tied LM head); embedding tables and LPBQ's block scales are not counted.
    """
    model = load_proto(path)
    inits = initializer_protos(path)
    producers = {o: n for n in model.graph.node for o in n.output}
    out = []
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        src = producers.get(node.input[1])
        if src is not None and src.op_type == "Transpose":
            src = producers.get(src.input[0])
        if src is not None and src.op_type == "DequantizeLinear" and src.input[0] in inits:
            out.append((src, inits[src.input[0]]))
    return out


def _int_weights(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for _, t in _weight_dqs(path)}


def _linear_weight_nodes(path: Path) -> list[str]:
    model = load_proto(path)
    inits = {t.name for t in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in inits]


# -- containment of AIMET's side effects (first in the file: a fresh process is cleanest) ---------------
_SCRIPT = textwrap.dedent("""\
    import json, logging, os, random, sys, tempfile, threading, warnings
    from pathlib import Path
    made = []
    sys.addaudithook(lambda event, args: made.append(str(args[0])) if event in ("tempfile.mkdtemp",
                     "tempfile.mkstemp") else None)
    log_file, src, out, work = sys.argv[1:5]
    handler = logging.FileHandler(log_file, mode="w")  # mode "w": a closed handler writes nothing again
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    import numpy as np, torch
    from bitpress.api import quantize
    np.random.seed(5); random.seed(5)
    tempfile.gettempdir()  # caches tempfile.tempdir, as any first use would
    def state():
        return {"root": [repr(h) for h in root.handlers], "level": root.level, "filters": repr(warnings.filters),
                "environ": dict(os.environ), "sys_path": list(sys.path),
                "np_random": repr(np.random.get_state()[1][:4]),
                "random": repr(random.getstate()[1][:4]), "torch_threads": torch.get_num_threads(),
                "tempdir": tempfile.tempdir, "threads": sorted(t.name for t in threading.enumerate())}
    before = state()
    quantize(src, out, algorithm="aimet", jobs=1, data={"source": "random", "samples": 4, "seq_len": 16},
             options={"precision": "int4", "techniques": [
                 {"name": "lpbq", "block_size": 16, "op_types": ["MatMul"]}, {"name": "seqmse", "num_candidates": 4},
                 {"name": "adaround", "num_iterations": 20, "nodes_to_exclude": sys.argv[5].split(",")}]})
    after = state()
    logging.getLogger("app").warning("after the run")
    handler.flush()
    print(json.dumps({
        "changed": sorted(k for k in before if before[k] != after[k]),
        "environ_added": sorted(set(after["environ"]) - set(before["environ"])),
        "threads_added": sorted(set(after["threads"]) - set(before["threads"])),
        "log": Path(log_file).read_text(), "cwd": sorted(os.listdir(".")),
        "temp_outside_work": [p for p in made if not p.startswith(work)],
        "temp_made": len(made), "aimet_imported": "aimet_onnx" in sys.modules,
    }))
    """)


@pytest.fixture(scope="module")
def fresh_run(tiny_encoder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One AIMET run (LPBQ, SeqMSE, AdaRound) in a fresh process; what it left behind."""
    folder = tmp_path_factory.mktemp("fresh")
    cwd = folder / "cwd"
    cwd.mkdir()
    script = folder / "run.py"
    script.write_text(_SCRIPT)
    # the run's work folder sits beside the output: every temporary file AIMET makes must be in there
    out = folder / "out" / "q.onnx"
    out.parent.mkdir()
    matmuls = [n for n in _linear_weight_nodes(tiny_encoder) if "MatMul" in n]
    proc = subprocess.run(
        [sys.executable, str(script), str(folder / "app.log"), str(tiny_encoder), str(out), str(out.parent),
         ",".join(matmuls)], cwd=cwd, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    return {"stdout_lines": lines, "stderr": proc.stderr, "result": json.loads(lines[-1]), "out": out}


def test_aimet_prints_nothing_on_stdout(fresh_run) -> None:
    """AIMET's loggers write to the process's stdout (a handler bound at import): diverted to the log."""
    assert fresh_run["result"]["aimet_imported"]
    assert len(fresh_run["stdout_lines"]) == 1, fresh_run["stdout_lines"][:5]


def test_import_does_not_close_the_callers_log_handlers(fresh_run) -> None:
    """``import aimet_onnx`` runs logging.config.dictConfig, which closes every handler first."""
    assert "after the run" in fresh_run["result"]["log"]


def test_no_progress_bars_or_warnings_on_stderr(fresh_run) -> None:
    err = fresh_run["stderr"]
    assert "it/s]" not in err and "s/it]" not in err, err[-1000:]  # tqdm bars of SeqMSE / AdaRound
    assert "UserWarning" not in err, err[-1000:]  # torch's, raised inside AIMET: logged at DEBUG instead


def test_no_thread_left_running(fresh_run) -> None:
    assert fresh_run["result"]["threads_added"] == []  # tqdm's monitor thread, started by a bar


def test_process_state_is_restored(fresh_run) -> None:
    """NumPy's global random state (SeqMSE draws from it), os.environ (AdaRound sets
    TORCHINDUCTOR_CACHE_DIR; the import KMP_* variables), sys.path, warning filters, torch threads."""
    result = fresh_run["result"]
    assert result["environ_added"] == []
    assert result["changed"] == []


def test_temporary_files_stay_in_the_run_folder(fresh_run) -> None:
    """SeqMSE saves the whole model, AdaRound its cached data, with ``tempfile``: not in the system temp folder."""
    result = fresh_run["result"]
    assert result["temp_made"] > 0
    assert result["temp_outside_work"] == []


def test_nothing_written_in_the_working_directory(fresh_run) -> None:
    assert fresh_run["result"]["cwd"] == []


def test_aimet_messages_reach_the_plugin_logger(tiny_encoder: Path, tmp_path: Path, caplog, capfd) -> None:
    caplog.set_level(logging.DEBUG, logger="bitpress_aimet")
    capfd.readouterr()
    _run(tiny_encoder, tmp_path, "msgs", precision="int4", techniques=[{"name": "seqmse", "num_candidates": 4}])
    out, err = capfd.readouterr()
    assert " - Quant - " not in out + err and " - SeqMse - " not in out + err
    messages = [r.getMessage() for r in caplog.records if r.name == "bitpress_aimet.aimet"]
    assert any("Computed optimal parameter encodings" in m for m in messages)  # SeqMse's own INFO
    assert all(r.levelno <= logging.INFO for r in caplog.records if r.name == "bitpress_aimet.aimet")


# -- plain static quantization (no techniques) -------------------------------------------------------
# measured, int8 weights and uint8 activations: encoder .032, decoder .028 on VNNI; "AVX2" (the same
# saved models run by ONNX Runtime 1.32 under qemu-x86_64 -cpu Haswell: AVX2, no VNNI): encoder .032,
# decoder .098: ONNX Runtime's u8 x s8 kernels saturate there (AIMET has no reduce_range), see docs/aimet.md
INT8_BOUND = {"enc": (0.05, 0.05), "dec": (0.045, 0.15)}  # (VNNI, AVX2)


def test_static_int8_default(tiny_encoder: Path, tiny_decoder: Path, tmp_path: Path) -> None:
    for which, src in (("enc", tiny_encoder), ("dec", tiny_decoder)):
        out = _run(src, tmp_path, which)
        ops = op_counts(out)
        assert ops["QuantizeLinear"] > 0 and ops["DequantizeLinear"] > ops["QuantizeLinear"]
        weights = [t for _, t in _weight_dqs(out)]
        assert weights and all(t.data_type == onnx.TensorProto.INT8 for t in weights)
        # every linear weight quantized, per output channel
        assert len(weights) >= len(_linear_weight_nodes(src))
        assert {o.domain for o in load_proto(out).opset_import} <= {"", "ai.onnx"}
        bound = INT8_BOUND[which][1 if int8_saturates() else 0]
        assert 1e-3 < output_error(src, out) < bound, which


def test_precision_and_activation_types(tiny_encoder: Path, tmp_path: Path) -> None:
    # measured: int16 weights + uint16 activations .014; int8 + fp16 .003; int4 + fp16 .005 (1 layer)
    out = _run(tiny_encoder, tmp_path, "w16a16", precision="int16", activation_type="uint16")
    assert {t.data_type for _, t in _weight_dqs(out)} == {onnx.TensorProto.INT16}
    zero_points = [t for t in load_proto(out).graph.initializer if t.name.endswith("_zero_point") and not t.dims]
    assert onnx.TensorProto.UINT16 in {t.data_type for t in zero_points}
    assert output_error(tiny_encoder, out) < 0.021
    out = _run(tiny_encoder, tmp_path, "w8fp16", activation_type="fp16")
    ops = op_counts(out)
    assert ops["QuantizeLinear"] == 0  # no activation quantized: weights (and embedding tables) only
    assert len(_weight_dqs(out)) == len(_linear_weight_nodes(tiny_encoder))
    assert output_error(tiny_encoder, out) < 0.0045
    out = _run(tiny_encoder, tmp_path, "tfe", quant_scheme="tf_enhanced")
    assert op_counts(out)["QuantizeLinear"] > 0 and output_error(tiny_encoder, out) < 0.05  # measured .032


def test_op_types_and_nodes_to_exclude(tiny_encoder: Path, tmp_path: Path) -> None:
    model = load_proto(tiny_encoder)
    gemms = [n.name for n in model.graph.node if n.op_type == "Gemm"]
    out = _run(tiny_encoder, tmp_path, "nogemm", op_types_to_exclude=["Gemm"])
    quantized_b = {n.name for n in load_proto(out).graph.node if n.op_type == "Gemm" and n.input[1].endswith("_qdq")}
    assert len(gemms) == 4 and not quantized_b, "Gemm weights must stay float"
    assert len(_weight_dqs(out)) == len(_linear_weight_nodes(tiny_encoder)) - 4
    out = _run(tiny_encoder, tmp_path, "onenode", nodes_to_exclude=[gemms[0]])
    assert len(_weight_dqs(out)) == len(_linear_weight_nodes(tiny_encoder)) - 1
    float_b = next(n for n in load_proto(out).graph.node if n.name == gemms[0]).input[1]
    assert float_b in initializer_protos(out) and initializer_protos(out)[float_b].data_type == onnx.TensorProto.FLOAT
    with pytest.raises(UsageError, match="op_types_to_exclude: the model has no Conv nodes"):
        _run(tiny_encoder, tmp_path, "bad", op_types_to_exclude=["Conv"])
    with pytest.raises(UsageError, match=r"nodes_to_exclude: the model has no node named .*Gemmx \(did you mean"):
        _run(tiny_encoder, tmp_path, "bad", nodes_to_exclude=[gemms[0] + "x"])
    assert not (tmp_path / "bad.onnx").exists()


def test_tied_embedding_stays_one_tensor(tiny_decoder: Path, tmp_path: Path) -> None:
    """AIMET refuses a weight shared by a Gather and a MatMul; the output uses one quantized table for both."""
    out = _run(tiny_decoder, tmp_path, "tied", **W4)
    model = load_proto(out)
    gather = next(n for n in model.graph.node if n.op_type == "Gather")
    head = next(n for n in model.graph.node if n.name == "/lm_head/Transpose")
    assert gather.input[0] == head.input[0]
    producer = next(n for n in model.graph.node if gather.input[0] in n.output)
    assert producer.op_type == "DequantizeLinear"
    table = initializer_protos(out)[producer.input[0]]
    assert table.name == "model.embed_tokens.weight_q" and table.data_type == onnx.TensorProto.INT4
    assert list(table.dims) == [256, 64]
    assert not [t.name for t in model.graph.initializer if "bitpress_tied" in t.name]
    tables = [t.name for t in model.graph.initializer if "embed_tokens" in t.name and len(t.dims) == 2]
    assert tables == ["model.embed_tokens.weight_q"]  # no float copy, no second quantized copy


def test_needs_data(tiny_encoder: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="needs calibration data"):
        quantize(tiny_encoder, tmp_path / "x.onnx", algorithm="aimet")


def test_quantized_input_is_refused(tiny_encoder: Path, tmp_path: Path) -> None:
    out = _run(tiny_encoder, tmp_path, "once")
    with pytest.raises(UsageError, match="quantized already"):
        _run(out, tmp_path, "twice")


# -- LPBQ -----------------------------------------------------------------------------------------
# measured (decoder, int4 weights, fp16 activations): per-channel .128, LPBQ block 16 .103,
# SeqMSE .119 (other data .120), LPBQ + SeqMSE .100
DEC_INT4 = 0.128


def _assert_lpbq(path: Path, block: int) -> int:
    """LPBQ weights: int4 blocks whose scales are uint8 integers times a float per-channel scale."""
    model = load_proto(path)
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = initializer_protos(path)
    lpbq = 0
    for node, weight in _weight_dqs(path):
        if attrs(node).get("block_size") is None:
            continue
        lpbq += 1
        assert weight.data_type == onnx.TensorProto.INT4 and attrs(node).get("block_size") == block
        scale = producers[node.input[1]]  # the block scales are themselves dequantized
        assert scale.op_type == "DequantizeLinear"
        ints, per_channel = inits[scale.input[0]], inits[scale.input[1]]
        assert ints.data_type == onnx.TensorProto.UINT8 and per_channel.data_type == onnx.TensorProto.FLOAT
        assert list(ints.dims)[attrs(node).get("axis")] == weight.dims[attrs(node).get("axis")] // block
    return lpbq


def test_lpbq(tiny_decoder: Path, tmp_path: Path) -> None:
    out = _run(tiny_decoder, tmp_path, "lpbq", **W4, techniques=[{"name": "lpbq", "block_size": 16}])
    assert _assert_lpbq(out, 16) == 15  # 7 linears x 2 layers and the (tied) head
    assert output_error(tiny_decoder, out) < 0.9 * DEC_INT4  # finer than per-channel: measured .103
    assert "ai.onnx" not in {o.domain for o in load_proto(out).opset_import}
    assert max(o.version for o in load_proto(out).opset_import if o.domain in ("", "ai.onnx")) >= 21


def test_lpbq_options(tiny_decoder: Path, tmp_path: Path) -> None:
    excluded = "/model/layers.0/mlp/down_proj/MatMul"
    out = _run(tiny_decoder, tmp_path, "lpbq2", precision="int4", techniques=[
        {"name": "lpbq", "block_size": 32, "nodes_to_exclude": [excluded]}])
    assert _assert_lpbq(out, 32) == 14
    down = next(n for n in load_proto(out).graph.node if n.name == excluded)
    dq = next(n for n in load_proto(out).graph.node if down.input[1] in n.output)
    assert attrs(dq).get("block_size") is None and attrs(dq).get("axis") is not None  # per-channel
    with pytest.raises(UsageError, match="lpbq with block_size=48 applies to no weight"):
        _run(tiny_decoder, tmp_path, "bad", precision="int4", techniques=[{"name": "lpbq", "block_size": 48}])
    with pytest.raises(UsageError, match="lpbq op_types Conv: the model has none of them"):
        _run(tiny_decoder, tmp_path, "bad", techniques=[{"name": "lpbq", "op_types": ["Conv"]}])


# -- SeqMSE ---------------------------------------------------------------------------------------
def test_seqmse_beats_per_channel_and_depends_on_data(tiny_decoder: Path, tmp_path: Path) -> None:
    plain = _run(tiny_decoder, tmp_path, "plain", **W4)
    seq = _run(tiny_decoder, tmp_path, "seq", **W4, techniques=[{"name": "seqmse"}])
    seq_other = _run(tiny_decoder, tmp_path, "seq_other", OTHER_DATA, **W4, techniques=[{"name": "seqmse"}])
    e_plain, e_seq, e_other = (output_error(tiny_decoder, p) for p in (plain, seq, seq_other))
    assert e_plain < 1.5 * DEC_INT4
    assert e_seq < 0.97 * e_plain and e_other < 0.97 * e_plain, (e_plain, e_seq, e_other)  # measured .926, .935
    # SeqMSE picks the weight scales from the data: other data, other scales
    scales = [{n.input[1]: numpy_helper.to_array(initializer_protos(p)[n.input[1]]) for n, _ in _weight_dqs(p)}
              for p in (plain, seq, seq_other)]
    assert scales[0].keys() == scales[1].keys() == scales[2].keys()
    assert sum(not np.allclose(scales[1][k], scales[2][k]) for k in scales[1]) > len(scales[1]) // 2
    assert sum(not np.allclose(scales[0][k], scales[1][k]) for k in scales[0]) > len(scales[0]) // 2


def test_lpbq_then_seqmse(tiny_decoder: Path, tmp_path: Path) -> None:
    out = _run(tiny_decoder, tmp_path, "lpbq_seq", **W4,
               techniques=[{"name": "lpbq", "block_size": 16}, {"name": "seqmse", "num_candidates": 20}])
    assert _assert_lpbq(out, 16) == 15
    assert output_error(tiny_decoder, out) < 0.86 * DEC_INT4  # measured .100 (LPBQ alone .103)


# -- AdaRound -------------------------------------------------------------------------------------
# measured (1-layer encoder, int4 weights, fp16 activations): nearest .0050, AdaRound 1000
# iterations .0038 (other data .0037)
def test_adaround_beats_nearest_and_depends_on_data(encoder1: Path, tmp_path: Path) -> None:
    ada = [{"name": "adaround", "num_iterations": 1000}]
    plain = _run(encoder1, tmp_path, "plain", **W4)
    rounded = _run(encoder1, tmp_path, "ada", **W4, techniques=ada)
    rounded_other = _run(encoder1, tmp_path, "ada_other", OTHER_DATA, **W4, techniques=ada)
    e_plain, e_ada, e_other = (output_error(encoder1, p) for p in (plain, rounded, rounded_other))
    assert e_plain < 0.0075
    assert e_ada < 0.9 * e_plain and e_other < 0.9 * e_plain, (e_plain, e_ada, e_other)
    # AdaRound learns the rounding from the data: integers differ from nearest, and between data sets
    w = [_int_weights(p) for p in (plain, rounded, rounded_other)]
    assert w[0].keys() == w[1].keys() == w[2].keys() and len(w[0]) == 6
    changed = [float(np.mean(w[0][k] != w[1][k])) for k in w[0]]
    assert all(c > 0.005 for c in changed), changed
    assert all(not np.array_equal(w[1][k], w[2][k]) for k in w[1])
    # the rounding moves each integer by at most one step (nearest +- 1)
    assert all(int(np.abs(w[0][k].astype(np.int16) - w[1][k].astype(np.int16)).max()) <= 1 for k in w[0])


def test_lpbq_with_adaround_on_other_nodes(tiny_encoder: Path, tmp_path: Path) -> None:
    """LPBQ on the MatMul weights, AdaRound on the Gemm ones: AIMET's AdaRound cannot take LPBQ weights."""
    matmuls = [n for n in _linear_weight_nodes(tiny_encoder) if "MatMul" in n]
    out = _run(tiny_encoder, tmp_path, "lpbq_ada", **W4, techniques=[
        {"name": "lpbq", "block_size": 16, "op_types": ["MatMul"]},
        {"name": "adaround", "num_iterations": 50, "nodes_to_exclude": matmuls}])
    assert _assert_lpbq(out, 16) == len(matmuls) == 8
    per_channel = [n for n, _ in _weight_dqs(out) if attrs(n).get("block_size") is None]
    assert len(per_channel) == 4  # the Gemm weights, AdaRounded
    assert output_error(tiny_encoder, out) < 0.008
    with pytest.raises(UsageError, match=r"adaround cannot optimise LPBQ .* add them to adaround's nodes_to_exclude"):
        _run(tiny_encoder, tmp_path, "both", **W4, techniques=[
            {"name": "lpbq", "block_size": 16}, {"name": "adaround", "num_iterations": 10000}])
    assert not (tmp_path / "both.onnx").exists()


def test_tied_head_is_left_to_nearest_by_adaround(tiny_decoder: Path, tmp_path: Path) -> None:
    out = _run(tiny_decoder, tmp_path, "ada_dec", **W4, techniques=[
        {"name": "adaround", "num_iterations": 5, "nodes_to_exclude": [
            n for n in _linear_weight_nodes(tiny_decoder) if "layers.1" in n or "mlp" in n]}])
    assert output_error(tiny_decoder, out) < 1.5 * DEC_INT4


# -- the toolkit facts behind the refusals (a failure here: a newer AIMET changed; revisit the rules) -----
@contextlib.contextmanager
def _aimet_call(folder: Path) -> Iterator[None]:
    """Direct AIMET calls, contained as the pass contains them (one torch thread, as jobs=1)."""
    from bitpress_aimet.sandbox import contained, torch_threads

    with contained(folder), torch_threads(1):
        yield


def _sim(src: Path, folder: Path):
    from bitpress_aimet.sandbox import import_aimet

    import_aimet(folder)
    from aimet_onnx.quantsim import QuantizationSimModel

    return _aimet_call(folder), QuantizationSimModel


def _weights_of(sim) -> dict[str, np.ndarray]:
    proto = sim.to_onnx_qdq(prequantize_constants=True)
    inits = initializers(proto)
    return {k: v for k, v in inits.items() if k.endswith("_q") and v.ndim == 2}


def test_aimet_adaround_fails_on_lpbq_weights(encoder1: Path, tmp_path: Path) -> None:
    box, QuantizationSimModel = _sim(encoder1, tmp_path)
    feeds = [synthetic.random_inputs(encoder1, batch=1, seq=16, seed=s) for s in range(2)]
    with box:
        from aimet_onnx import apply_adaround
        from aimet_onnx.quantsim import set_lpbq_for_params

        sim = QuantizationSimModel(onnx.load(str(encoder1)), param_type="int4", activation_type="float16",
                                   path=str(tmp_path / "sim"))
        set_lpbq_for_params(sim, 4, 16, op_types={"Gemm"})
        with pytest.raises(AssertionError):
            apply_adaround(sim, feeds, 2)


def test_aimet_ignores_lpbq_after_seqmse_and_seqmse_after_adaround(encoder1: Path, tmp_path: Path) -> None:
    """Why techniques must be listed lpbq, seqmse, adaround: later ones find the encodings frozen."""
    box, QuantizationSimModel = _sim(encoder1, tmp_path)
    feeds = [synthetic.random_inputs(encoder1, batch=1, seq=16, seed=s) for s in range(2)]
    with box:
        from aimet_onnx import apply_adaround, apply_seq_mse
        from aimet_onnx.quantsim import set_lpbq_for_params

        def sim():
            return QuantizationSimModel(onnx.load(str(encoder1)), param_type="int4", activation_type="float16",
                                        path=str(tmp_path / "sim"))

        s1 = sim()
        apply_seq_mse(s1, feeds, num_candidates=4)
        set_lpbq_for_params(s1, 4, 16, op_types={"Gemm"})
        s1.compute_encodings(feeds)
        assert not any("meta_scale" in t.name for t in s1.to_onnx_qdq().graph.initializer), "LPBQ was applied"
        s2 = sim()
        apply_seq_mse(s2, feeds, num_candidates=4)
        s2.compute_encodings(feeds)
        w1, w2 = _weights_of(s1), _weights_of(s2)
        assert w1.keys() == w2.keys() and all(np.array_equal(w1[k], w2[k]) for k in w1)
        a = sim()
        apply_adaround(a, feeds, 20)
        b = sim()
        apply_adaround(b, feeds, 20)
        apply_seq_mse(b, feeds, num_candidates=4)
        a.compute_encodings(feeds)
        b.compute_encodings(feeds)
        wa, wb = _weights_of(a), _weights_of(b)
        assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


# -- options checked before any work ---------------------------------------------------------------
@pytest.mark.parametrize(("techniques", "message"), [
    ([{"name": "gptq"}], r"techniques\[0\]: unknown technique 'gptq'; valid names: lpbq, seqmse, adaround"),
    ([{"block_size": 64}], r"techniques\[0\] has no name; valid names: lpbq, seqmse, adaround"),
    (["lpbq"], r"techniques=\['lpbq'\] is not a valid .*\[0\]: expected a mapping"),
    ([{"name": "lpbq", "blocksize": 32}], r"unknown option\(s\) blocksize; valid options for lpbq: bitwidth, "
                                          r"block_size, decompressed_bw, nodes_to_exclude, op_types"),
    ([{"name": "lpbq", "block_size": "32"}], r"block_size='32' is not valid: expected an integer"),
    ([{"name": "lpbq", "block_size": 0}], r"block_size must be a positive number"),
    ([{"name": "lpbq", "decompressed_bw": 16}], r"decompressed_bw=16 with bitwidth=4"),
    ([{"name": "seqmse", "num_candidates": 0}], r"num_candidates must be at least 1"),
    ([{"name": "seqmse", "data_config": "calib"}], r"data_config is not supported"),
    ([{"name": "adaround", "num_iterations": -1}], r"num_iterations must be at least 1"),
    ([{"name": "adaround", "nodes_to_exclude": "x"}], r"nodes_to_exclude='x' is not valid: expected a list"),
    ([{"name": "seqmse"}, {"name": "lpbq"}], r"must be listed in the order lpbq, seqmse: .* silently change"),
    ([{"name": "adaround"}, {"name": "seqmse"}], r"order seqmse, adaround"),
    ([{"name": "seqmse"}, {"name": "SeqMSE"}], r"seqmse is listed 2 times"),
])
def test_bad_techniques_fail_before_work(techniques, message, tiny_encoder: Path, tmp_path: Path) -> None:
    with pytest.raises(OptionError, match=message):
        quantize(tiny_encoder, tmp_path / "x.onnx", algorithm="aimet", options={"techniques": techniques},
                 data=DATA)
    assert list(tmp_path.iterdir()) == []


def test_bad_options_fail_before_work(tiny_encoder: Path, tmp_path: Path) -> None:
    for options, message in (
        ({"precision": "int2"}, "precision"), ({"activation_type": "int8"}, "activation_type"),
        ({"quant_scheme": "percentile"}, "quant_scheme"),
        ({"quant_scheme": "tf_enhanced", "techniques": [{"name": "seqmse"}]}, "seqmse needs quant_scheme=min_max"),
        ({"calibration_providers": ["CPUExecutionProvider"]}, "unknown option"),
    ):
        with pytest.raises(OptionError, match=message):
            quantize(tiny_encoder, tmp_path / "x.onnx", algorithm="aimet", options=options, data=DATA)
    with pytest.raises(UsageError, match=r"config_file 'nope\.json' is neither an AIMET alias"):
        _run(tiny_encoder, tmp_path, "x", config_file="nope.json")
    assert not (tmp_path / "x.onnx").exists()


def test_olive_config_ports_by_changing_type(tiny_encoder: Path, tmp_path: Path) -> None:
    """Olive's example pass config, with ``type: AimetQuantization`` (the alias) and bitpress's data."""
    import bitpress

    config = {"input": str(tiny_encoder), "output": str(tmp_path / "olive.onnx"), "data": DATA, "jobs": 1,
              "passes": [{"type": "AimetQuantization", "precision": "int4", "config_file": "htp_v73",
                          "techniques": [{"name": "seqmse", "num_candidates": 8}]}]}
    bitpress.run(config)
    assert op_counts(tmp_path / "olive.onnx")["DequantizeLinear"] > 0


# -- outputs --------------------------------------------------------------------------------------
def test_export_encodings_beside_the_output(tiny_decoder: Path, tmp_path: Path) -> None:
    out = tmp_path / "enc.onnx"
    result = quantize(tiny_decoder, out, algorithm="aimet", data=DATA, jobs=1, options={
        "precision": "int4", "techniques": [{"name": "lpbq", "block_size": 16}], "export_encodings": True})
    encodings_file = tmp_path / "enc.encodings"
    assert encodings_file in result.files and out in result.files
    encodings = json.loads(encodings_file.read_text())
    assert {"activation_encodings", "param_encodings", "version"} <= set(encodings)
    params = {e["name"]: e for e in encodings["param_encodings"]}
    q_proj = params["model.layers.0.self_attn.q_proj.weight"]
    assert q_proj["enc_type"] == "LPBQ" and q_proj["block_size"] == 16
    assert q_proj["compressed_bw"] == 4 and q_proj["bw"] == 8  # int4 weights, 4-bit block scales: 8 bits
    assert "model.embed_tokens.weight" in params  # the tied table, once, under its own name
    assert not any("bitpress_tied" in e["name"] for k in encodings if isinstance(encodings[k], list)
                   for e in encodings[k])
    plain = quantize(tiny_decoder, tmp_path / "plain.onnx", algorithm="aimet", data=DATA, jobs=1)
    assert not (tmp_path / "plain.encodings").exists() and len(plain.files) == 1


def test_report(tiny_encoder: Path, tmp_path: Path) -> None:
    result = quantize(tiny_encoder, tmp_path / "r.onnx", algorithm="aimet", data=DATA, jobs=1,
                      options={"techniques": [{"name": "seqmse", "num_candidates": 4}]})
    (name, _, report), = result.reports
    assert name == "aimet"
    text = report.summary()
    assert text.startswith("AIMET 2.42") and "seqmse (weights int8, activations uint8, min_max)" in text
    assert "DequantizeLinear x" in text and "QuantizeLinear x" in text
    data = report.to_json()
    assert data["techniques"] == ["seqmse(num_candidates=4)"] and "seqmse" in data["seconds_by_step"]


def test_failure_is_a_quantization_error(tiny_encoder: Path, tmp_path: Path, monkeypatch) -> None:
    import bitpress_aimet.runner as runner

    def boom(*args, **kwargs):
        raise RuntimeError("simulated AIMET failure\nwith a second line")

    real = runner.run_aimet

    def failing(proto, feeds, o, plan, folder, jobs):
        from aimet_onnx.quantsim import QuantizationSimModel

        monkeypatch.setattr(QuantizationSimModel, "compute_encodings", boom)
        return real(proto, feeds, o, plan, folder, jobs)

    monkeypatch.setattr(runner, "run_aimet", failing)
    with pytest.raises(QuantizationError, match=r"AIMET failed: simulated AIMET failure$"):
        _run(tiny_encoder, tmp_path, "fail")
    assert not (tmp_path / "fail.onnx").exists()
