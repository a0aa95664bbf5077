"""The host's calibrated weight-only machinery (bitpress.onnx.calibrated), with a recording solver."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from bitpress import synthetic
from bitpress.calibration.data import DataConfig, iter_feeds
from bitpress.errors import UsageError
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx import layout
from bitpress.onnx.calibrated import CalibratedPass, apply_scalings, order_activations, plan_stages
from bitpress.onnx.calibrated import passes as cal_passes
from bitpress.onnx.calibrated.scaling import InputScaling
from bitpress.onnx.calibrated.stages import node_reads
from bitpress.onnx.save import save_onnx
from bitpress.onnx.weightonly import Group, plan
from bitpress.passes import PassContext
from bitpress.quant.calibrated import LayerStats, Target
from bitpress.quant.solver import BlockSpec, QuantizedBlocks

DATA = {"source": "random", "samples": 3, "seq_len": 12, "seed": 3}


def _rtn(w3: np.ndarray, spec: BlockSpec) -> QuantizedBlocks:
    """Asymmetric min/max rounding (the recording solver's answer)."""
    lo = np.minimum(w3.min(axis=-1), 0)
    hi = np.maximum(w3.max(axis=-1), 0)
    scale = np.where(hi > lo, (hi - lo) / (2**spec.bits - 1), 1).astype(np.float32)
    zp = np.clip(np.round(-lo / scale), 0, 2**spec.bits - 1)
    q = np.clip(np.round(w3 / scale[..., None] + zp[..., None]), 0, 2**spec.bits - 1)
    return QuantizedBlocks(q.astype(np.uint8), scale, zp.astype(np.uint8))


class Recording:
    """A calibrated solver that rounds to nearest and records what it was given and what it answered."""

    needs = frozenset({"hessian", "mean_abs"})

    def __init__(self) -> None:
        self.stats: dict[str, LayerStats] = {}
        self.answers: dict[str, list[QuantizedBlocks]] = {}

    def prepare(self, stats: LayerStats, spec: BlockSpec) -> LayerStats:
        return stats

    def solve(self, w: np.ndarray, spec: BlockSpec, prepared: Any, target: Target) -> QuantizedBlocks:
        self.stats[target.weight] = prepared
        out = _rtn(w.reshape(w.shape[0], -1, spec.block_size), spec)
        self.answers.setdefault(target.weight, []).append(out)
        return out


class RecordingPass(CalibratedPass):
    name = "recording"
    recorder: ClassVar[Recording]

    def calibrated_solver(self, group: Group) -> Recording:
        return self.recorder

    def solver(self) -> Any:
        return lambda w3, spec, importance=None: _rtn(w3, spec)


def _run(src: Path, tmp: Path, **options: Any) -> tuple[OnnxModel, Recording]:
    RecordingPass.recorder = Recording()
    model = OnnxModel.load(src)
    # accuracy_level 0: the saved model's activations, run by ONNX Runtime, are compared with float sums
    p = RecordingPass(RecordingPass.Options(block_size=32, accuracy_level=0, **options))
    p.run(model, PassContext(workdir=tmp / "work", data=dict(DATA)))
    return model, RecordingPass.recorder


def _save(model: OnnxModel, path: Path) -> Path:
    save_onnx(model, path)
    return path


def _activations(path: Path, names: list[str]) -> list[dict[str, np.ndarray]]:
    """Run a model on the test's calibration feeds, returning the named values of each sample."""
    proto = onnx.load(path)
    proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    sess = ort.InferenceSession(proto.SerializeToString())
    feeds = iter_feeds(proto, DataConfig.from_value(dict(DATA)), path.parent)
    return [dict(zip(names, sess.run(names, f), strict=True)) for f in feeds]


def _hessian(samples: list[dict[str, np.ndarray]], name: str) -> np.ndarray:
    x = np.concatenate([s[name].reshape(-1, s[name].shape[-1]) for s in samples]).astype(np.float64)
    return x.T @ x / len(x)


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.build_decoder(tmp_path_factory.mktemp("untied") / "model.onnx", hidden=64, layers=2,
                                   vocab=256, tied=False)


def test_stages_run_every_needed_node_once(tiny_decoder: Path) -> None:
    model = OnnxModel.load(tiny_decoder)
    p = plan(model, RecordingPass.Options(block_size=32))
    acts = {u.node.input[0] for g in p.groups for u in g.uses if not u.is_gather}
    order = order_activations(model.graph, acts)
    splan = plan_stages(model.graph, [[a] for a in order])
    ran = [i for st in splan.stages for i in st.nodes]
    assert len(ran) == len(set(ran))
    # each stage reads only graph inputs and values of earlier stages; the frontier is empty at the end
    made: set[str] = set(splan.feeds)
    for st in splan.stages:
        assert set(st.inputs) <= made
        made |= set(st.outputs)
        produced = {o for i in st.nodes for o in model.graph.node[i].output}
        for i in st.nodes:
            assert all(n in made or n in produced or n in model.initializers() for n in node_reads(model.graph.node[i]))
    released = {n for st in splan.stages for n in st.release}
    assert set(splan.feeds) <= released and {o for st in splan.stages for o in st.outputs} <= released
    # the LM head's MatMul is not needed to observe anything: it never runs
    head = next(i for i, n in enumerate(model.graph.node) if n.name == "/lm_head/MatMul")
    assert head not in ran
    assert len(splan.stages) == 2 * 4 + 1  # qkv, o, gate/up, down per layer; the head's input


def test_sequential_statistics_come_from_the_model_quantized_so_far(untied: Path, tmp_path: Path) -> None:
    seq_model, seq = _run(untied, tmp_path / "seq", sequential=True)
    flt_model, flt = _run(untied, tmp_path / "flt", sequential=False)
    quantized = _save(seq_model, tmp_path / "seq.onnx")
    w = "model.layers.1.mlp.down_proj.weight"
    act = next(n.input[0] for n in OnnxModel.load(untied).graph.node if n.input[1:2] == [w])
    want_q = _hessian(_activations(quantized, [act]), act)
    want_f = _hessian(_activations(untied, [act]), act)
    got_q, got_f = seq.stats[w].hessian, flt.stats[w].hessian
    assert got_q is not None and got_f is not None
    scale = np.abs(want_f).max()
    assert np.abs(got_q - want_q).max() < 1e-4 * scale  # from the model quantized up to this layer
    assert np.abs(got_f - want_f).max() < 1e-4 * scale  # from the float model
    assert np.abs(want_q - want_f).max() > 1e-3 * scale  # and the two differ
    assert seq.stats[w].rows == DATA["samples"] * DATA["seq_len"]
    del flt_model


def test_solver_integers_are_written_as_they_are(tiny_decoder: Path, tmp_path: Path) -> None:
    model, rec = _run(tiny_decoder, tmp_path)
    inits = model.initializers()
    w = "model.layers.0.self_attn.q_proj.weight"
    blocks = rec.answers[w]
    assert len(blocks) == 1
    b = onnx.numpy_helper.to_array(inits[f"{w}_Q4"])
    np.testing.assert_array_equal(b, layout.pack_along_last(blocks[0].q, 4))
    scales = onnx.numpy_helper.to_array(inits[f"{w}_scales"]).reshape(blocks[0].scales.shape)
    np.testing.assert_array_equal(scales, blocks[0].scales)
    # the tied table: quantized once, from the LM head's input statistics, read by the Gather too
    table = "model.embed_tokens.weight"
    assert table in rec.stats and rec.stats[table].hessian is not None
    ops = {n.op_type: n for n in model.graph.node}
    assert "GatherBlockQuantized" in ops and "Gather" not in ops


def test_a_spilled_frontier_gives_the_same_model(tiny_decoder: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    in_memory, _ = _run(tiny_decoder, tmp_path / "mem")
    spilled_bytes: list[int] = []
    on_disk: list[int] = []
    real = cal_passes.FrontierStore

    class Spilling(real):  # type: ignore[misc, valid-type]
        def __init__(self, folder: Path, budget_bytes: int) -> None:
            super().__init__(folder, 0)

        def put(self, sample: int, name: str, value: np.ndarray) -> None:
            super().put(sample, name, value)
            on_disk.append(len(list(self.folder.glob("frontier-*.npy"))))

        def close(self) -> None:
            spilled_bytes.append(self.spilled)
            super().close()

    monkeypatch.setattr(cal_passes, "FrontierStore", Spilling)
    spilled, _ = _run(tiny_decoder, tmp_path / "disk")
    assert spilled_bytes and spilled_bytes[0] > 0 and max(on_disk) > 0  # on disk while the run needs them
    assert not list((tmp_path / "disk").rglob("frontier-*.npy"))  # removed after the run
    a = {t.name: onnx.numpy_helper.to_array(t) for t in in_memory.graph.initializer}
    b = {t.name: onnx.numpy_helper.to_array(t) for t in spilled.graph.initializer}
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


@pytest.mark.parametrize("which", ["decoder", "encoder"])
def test_input_scaling_is_an_exact_rewrite(which: str, tiny_decoder: Path, tiny_encoder: Path,
                                           tmp_path: Path) -> None:
    src = tiny_decoder if which == "decoder" else tiny_encoder
    model = OnnxModel.load(src)
    p = plan(model, RecordingPass.Options(block_size=32))
    rng = np.random.default_rng(0)
    readers: dict[str, list[Any]] = {}
    for g in p.groups:
        for u in g.uses:
            if not u.is_gather and not any(v.is_gather for v in g.uses):
                readers.setdefault(u.node.input[0], []).append((g, u))
    scalings = []
    for act, uses in readers.items():
        if len({g.weight for g, _ in uses}) != len(uses):
            continue
        g0, u0 = uses[0]
        k = int(model.initializers()[g0.weight].dims[1 if u0.rows_are_table_rows else 0])
        s = rng.uniform(0.25, 4.0, k).astype(np.float32)
        for g, u in uses:  # the weights' K axis times s
            w = np.asarray(model.array(g.weight), dtype=np.float32)
            model.set_initializer(g.weight, w * s[None, :] if u.rows_are_table_rows else w * s[:, None])
        readers = frozenset(u.node.output[0] for _, u in uses)
        scalings.append(InputScaling(act, (1 / s).astype(np.float32), np.dtype(np.float32), readers))
    assert len(scalings) >= 3
    apply_scalings(model, scalings, set())
    hows = {sc.how.split(" ")[0] for sc in scalings}
    assert "Mul" in hows  # the o_proj and down_proj inputs have no per-channel producer
    if which == "decoder":  # pre-norm: the RMSNorm weights take 1 / s (post-norm BERT's LayerNorm
        assert "folded" in hows  # outputs are also the residual: a Mul on the MatMuls' side only)
    out = _save(model, tmp_path / "scaled.onnx")
    feeds = next(iter_feeds(onnx.load(src), DataConfig.from_value(dict(DATA)), src.parent))
    want = ort.InferenceSession(str(src)).run(None, feeds)[0]
    got = ort.InferenceSession(str(out)).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_calibrated_passes_need_data(tiny_decoder: Path) -> None:
    with pytest.raises(UsageError, match="needs calibration data"):
        RecordingPass().run(OnnxModel.load(tiny_decoder), PassContext(data=None))


def test_kv_cache_folder_is_fed_an_empty_past(genai_folder: Path, tmp_path: Path) -> None:
    src = next(genai_folder.glob("*.onnx"))
    model, rec = _run(src, tmp_path)
    assert any(n.op_type == "MatMulNBits" for n in model.graph.node)
    assert all(st.rows == DATA["samples"] * DATA["seq_len"] for st in rec.stats.values())
    out = _save(model, tmp_path / "q.onnx")
    ort.InferenceSession(str(out))


class RandomScaler:
    """An input scaler choosing arbitrary positive scales (what AWQ's search would return)."""

    needs = frozenset({"mean_abs"})

    def scales(self, weights: list[np.ndarray], stats: LayerStats, specs: list[BlockSpec],
               targets: list[Target]) -> np.ndarray:
        seed = sum(ord(c) for c in targets[0].weight)
        return np.random.default_rng(seed).uniform(0.5, 2.0, stats.channels).astype(np.float32)


class ScalingPass(RecordingPass):
    name = "recording_scaled"

    def input_scaler(self) -> RandomScaler:
        return RandomScaler()


def test_scaled_inputs_stay_sequential(untied: Path, tmp_path: Path) -> None:
    """With input scales, later stages compute with ``Q / s`` on the unscaled input: what the solver saw
    for layer 1 is what the written model (with its folds and Muls) feeds that layer's MatMulNBits."""
    ScalingPass.recorder = Recording()
    model = OnnxModel.load(untied)
    options = ScalingPass.Options(block_size=32, accuracy_level=0)  # compared with float sums: fp32 compute
    ScalingPass(options).run(model, PassContext(workdir=tmp_path / "w", data=dict(DATA)))
    rec = ScalingPass.recorder
    out = _save(model, tmp_path / "q.onnx")
    checked = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or "layers.1" not in node.input[1]:
            continue
        weight = node.input[1].removesuffix("_Q4")
        want = _hessian(_activations(out, [node.input[0]]), node.input[0])
        got = rec.stats[weight].hessian
        assert got is not None
        np.testing.assert_allclose(got[: want.shape[0], : want.shape[0]], want, atol=1e-4 * np.abs(want).max())
        checked += 1
    assert checked == 7
    assert any(n.op_type == "Mul" and n.name.endswith("_awq_Mul") for n in model.graph.node)
