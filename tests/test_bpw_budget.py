"""The bits-per-weight budget (``bpw`` / ``--bpw``): meets its budget, beats uniform bits at equal size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import bitpress
from bitpress.cli import main
from bitpress.errors import BitpressError
from bitpress.onnx.weightonly.budget import Choice, _frontier, fake_quantize, rounding_error
from bitpress.synthetic import build_decoder


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_decoder(tmp_path_factory.mktemp("bpw") / "decoder.onnx", hidden=128, layers=3, heads=4, vocab=512,
                         seed=3)


def _bpw(result: bitpress.RunResult) -> float:
    (_, _, report), = result.reports
    return float(report.bits_per_weight)


def _kl(reference: Path, quantized: Path, seed: int = 11) -> float:
    """Mean KL of the quantized model's next-token distribution from the float model's, on held-out ids."""
    ids = np.random.default_rng(seed).integers(0, 512, size=(4, 32), dtype=np.int64)
    outs = []
    for path in (reference, quantized):
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        logits = sess.run(["logits"], {"input_ids": ids})[0].astype(np.float64).reshape(-1, 512)
        logits -= logits.max(axis=1, keepdims=True)
        outs.append(logits - np.log(np.exp(logits).sum(axis=1, keepdims=True)))
    ref, out = outs
    return float((np.exp(ref) * (ref - out)).sum(axis=1).mean())


def test_budget_is_met_and_beats_uniform_bits_at_equal_size(decoder: Path, tmp_path: Path) -> None:
    uniform = bitpress.quantize(decoder, tmp_path / "uniform.onnx", algorithm="rtn", precision="int4",
                                options={"block_size": 32, "is_symmetric": False})
    size = _bpw(uniform)
    budget = bitpress.quantize(decoder, tmp_path / "budget.onnx", algorithm="rtn", precision="int4",
                               options={"block_size": 32, "is_symmetric": False, "bpw": size})
    got = _bpw(budget)
    assert got <= size + 1e-6
    assert got > size - 0.1  # it spends the budget
    layouts = {(r.bits, r.block_size) for r in budget.reports[0][2].rows if r.quantized}
    assert len(layouts) > 1  # a mixture, not the uniform layout again
    kl_uniform, kl_budget = _kl(decoder, tmp_path / "uniform.onnx"), _kl(decoder, tmp_path / "budget.onnx")
    assert kl_budget < kl_uniform


def test_tighter_budget_costs_quality_and_every_layout_runs_fast(decoder: Path, tmp_path: Path) -> None:
    errors = []
    for bpw in (4.4, 5.0, 6.0):
        out = tmp_path / f"b{bpw}.onnx"
        res = bitpress.quantize(decoder, out, algorithm="rtn", precision="int4", options={"bpw": bpw})
        assert _bpw(res) <= bpw + 1e-6
        (_, paths), = res.runtime
        assert not paths.slow(), paths.summary()  # mixed precision takes no fallback path
        errors.append(_kl(decoder, out))
    assert errors[0] > errors[1] > errors[2]


def test_overrides_stay_and_count_in_the_budget(decoder: Path, tmp_path: Path) -> None:
    res = bitpress.quantize(decoder, tmp_path / "o.onnx", algorithm="rtn", precision="int4",
                            options={"bpw": 5.6, "overrides": {"*down_proj*": {"bits": 8, "block_size": 32}}})
    rows = [r for r in res.reports[0][2].rows if r.quantized]
    down = [r for r in rows if "down_proj" in r.weight]
    assert down and all((r.bits, r.block_size) == (8, 32) for r in down)
    assert _bpw(res) <= 5.6 + 1e-6


def test_budget_below_the_smallest_layouts_is_refused(decoder: Path, tmp_path: Path) -> None:
    with pytest.raises(BitpressError, match=r"bpw 4.05 is below .* give at least 4\.[0-9]+"):
        bitpress.quantize(decoder, tmp_path / "x.onnx", algorithm="rtn", precision="int4", options={"bpw": 4.05})
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("bad", [1.5, 17, "many"])
def test_bad_budget_is_one_line(decoder: Path, tmp_path: Path, bad: object, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["quantize", "-m", str(decoder), "-o", str(tmp_path / "x.onnx"), "--algorithm", "rtn",
               "--option", f"bpw={bad}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and err[0].startswith("bitpress: error:") and "bpw" in err[0]


def test_q4_k_m_refuses_a_budget(decoder: Path, tmp_path: Path) -> None:
    with pytest.raises(BitpressError, match=r"q4_k_m .* no bpw budget"):
        bitpress.quantize(decoder, tmp_path / "x.onnx", algorithm="q4_k_m", options={"bpw": 5.0})


def test_cli_bpw_plan_shows_the_allocation_and_the_run_keeps_it(decoder: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    args = ["quantize", "-m", str(decoder), "-o", str(tmp_path / "p.onnx"), "--algorithm", "rtn", "--precision", "int4",
            "--bpw", "4.8", "--json"]
    assert main([*args, "--plan"]) == 0
    (step,) = json.loads(capsys.readouterr().out)
    assert not (tmp_path / "p.onnx").exists()
    assert step["bits_per_weight"] <= 4.8
    plan_rows = {r["weight"]: (r["bits"], r["block_size"]) for r in step["weights"] if r["quantized"]}
    assert all("bpw 4.8" in (r.get("note") or "") for r in step["weights"] if r["quantized"])
    assert main(args) == 0
    ran = json.loads(capsys.readouterr().out)
    (report,) = ran["reports"]
    run_rows = {r["weight"]: (r["bits"], r["block_size"]) for r in report["weights"] if r["quantized"]}
    assert run_rows == plan_rows  # the dry run and the run cannot disagree
    assert main(["quantize", "-m", str(decoder), "-o", str(tmp_path / "q.onnx"), "--algorithm", "rtn", "--bpw", "4.8",
                 "--option", "bpw=5"]) != 0
    assert "given twice" in capsys.readouterr().err


def test_frontier_keeps_the_lower_convex_hull() -> None:
    a, b, c, d = Choice(4, 128, 100, 0, 10.0), Choice(4, 64, 110, 0, 9.9), Choice(4, 32, 120, 0, 4.0), \
        Choice(8, 128, 200, 0, 5.0)
    assert _frontier([d, c, b, a]) == [a, c]  # b is above the a-c chord; d costs more and loses more than c


def test_fake_quantize_matches_the_rounding_error() -> None:
    w = np.random.default_rng(0).standard_normal((96, 40)).astype(np.float32)  # K not a multiple of 64
    for bits, block, sym in ((4, 32, False), (4, 64, True), (8, 128, False)):
        q = fake_quantize(w, bits, block, sym)
        assert q.shape == w.shape
        expected = np.linalg.norm(q.astype(np.float64) - w) / np.linalg.norm(w)
        assert rounding_error(w, bits, block, sym) == pytest.approx(expected, rel=1e-5)
        assert len(np.unique(q[:block, 0])) <= 1 << bits
    assert rounding_error(w, 8, 32, False) < rounding_error(w, 4, 32, False) < rounding_error(w, 4, 128, False)


def test_sensitivity_is_the_kl_of_the_model_with_that_weight_rounded(decoder: Path, tmp_path: Path) -> None:
    """The shared session with overridable initializers gives what a model with the one weight replaced gives."""
    import onnx
    from onnx import numpy_helper

    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.weightonly.planning import WeightOnlyOptions, plan
    from bitpress.onnx.weightonly.sensitivity import measure

    model = OnnxModel.load(decoder)
    p = plan(model, WeightOnlyOptions(block_size=32, is_symmetric=False))
    ids = np.random.default_rng(5).integers(0, 512, size=(1, 24), dtype=np.int64)
    names = ["model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"]
    got = measure(model, p.groups, {n: (4, 128) for n in names}, [{"input_ids": ids}])
    model.close()
    assert set(got) == set(names)
    proto = onnx.load(str(decoder))
    for name in names:
        group = next(g for g in p.groups if g.weight == name)
        init = next(t for t in proto.graph.initializer if t.name == name)
        w = numpy_helper.to_array(init)
        matrix = w.T if group.uses[0].rows_are_table_rows else w
        q = fake_quantize(matrix, 4, 128, False)
        replaced = onnx.ModelProto()
        replaced.CopyFrom(proto)
        target = next(t for t in replaced.graph.initializer if t.name == name)
        target.CopyFrom(numpy_helper.from_array(q.T if group.uses[0].rows_are_table_rows else q, name))
        onnx.save(replaced, str(tmp_path / "r.onnx"))
        outs = []
        for path in (decoder, tmp_path / "r.onnx"):
            logits = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
                ["logits"], {"input_ids": ids})[0].astype(np.float64).reshape(-1, 512)
            logits -= logits.max(axis=1, keepdims=True)
            outs.append(logits - np.log(np.exp(logits).sum(axis=1, keepdims=True)))
        expected = float((np.exp(outs[0]) * (outs[0] - outs[1])).sum(axis=1).mean())
        assert got[name] == pytest.approx(expected, rel=1e-3, abs=1e-9)
    assert got["model.embed_tokens.weight"] > 0


def test_encoder_with_transposed_square_weights_is_measured_on_its_features(tmp_path: Path) -> None:
    """No logits: the measure takes the first output's relative squared error; Gemm(transB) weights, square
    ones included, go back to their stored orientation (a wrong one would be a different model)."""
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.weightonly.planning import WeightOnlyOptions, plan
    from bitpress.onnx.weightonly.sensitivity import measure
    from bitpress.synthetic import build_encoder

    enc = build_encoder(tmp_path / "enc.onnx", hidden=64, layers=2, intermediate=128, seed=2)
    model = OnnxModel.load(enc)
    p = plan(model, WeightOnlyOptions(block_size=32))
    square = [g for g in p.groups if g.uses[0].rows_are_table_rows and len(set(model.array(g.weight).shape)) == 1]
    assert square
    feeds = [{"input_ids": np.arange(16, dtype=np.int64)[None] % 512, "attention_mask": np.ones((1, 16), np.int64)}]
    got = measure(model, p.groups, {g.weight: (4, 32) for g in square}, feeds)
    finer = measure(model, p.groups, {g.weight: (8, 32) for g in square}, feeds)
    model.close()
    for g in square:
        assert 0 < finer[g.weight] < got[g.weight] < 0.05  # 4-bit noise, not a transposed weight (error ~2)
    res = bitpress.quantize(enc, tmp_path / "q.onnx", algorithm="rtn", precision="int4", options={"bpw": 5.0})
    assert _bpw(res) <= 5.0 + 1e-6


def test_an_override_of_weight_plan_without_data_still_plans(decoder: Path) -> None:
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.weightonly.passes import WeightOnlyPass
    from bitpress.onnx.weightonly.planning import plan

    class Old(WeightOnlyPass):
        name = "old_style"

        def weight_plan(self, model):  # type: ignore[no-untyped-def,override]  # a plugin written before data
            return plan(model, self.options)

    model = OnnxModel.load(decoder)
    try:
        assert Old.from_config({}, None).planned(model, "random").groups
    finally:
        model.close()


def test_the_measure_runs_bpw_samples_of_the_data_whatever_the_pass_takes(decoder: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import bitpress.onnx.weightonly.sensitivity as sensitivity

    seen = []
    real = sensitivity.measure

    def spy(model, groups, layouts, feeds):  # type: ignore[no-untyped-def]
        feeds = list(feeds)
        seen.append(len(feeds))
        return real(model, groups, layouts, feeds)

    monkeypatch.setattr(sensitivity, "measure", spy)
    data = {"source": "random", "samples": 32, "seq_len": 16}
    bitpress.quantize(decoder, tmp_path / "a.onnx", algorithm="rtn", options={"bpw": 5.0}, data=data)
    bitpress.quantize(decoder, tmp_path / "b.onnx", algorithm="rtn", options={"bpw": 5.0, "bpw_samples": 3}, data=data)
    assert seen == [2, 3]
