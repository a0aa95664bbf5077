"""The gptq and awq ONNX passes on a small decoder: every layer's output error below RTN's."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from bitpress import synthetic
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.calibrated import CalibratedPass
from bitpress.onnx.weightonly import Group, Report
from bitpress.passes import PassContext
from bitpress.quant.calibrated import LayerStats, Target
from bitpress.quant.solver import BlockSolver, BlockSpec, QuantizedBlocks

gptq_passes = pytest.importorskip("bitpress_gptq.passes")
awq_passes = pytest.importorskip("bitpress_awq.passes")
rtn_solver = pytest.importorskip("bitpress_rtn.solver").rtn_solver

DATA = {"source": "random", "samples": 4, "seq_len": 32, "seed": 1}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wide enough for GPTQ to have room (K = 128, 352): two layers, tied head, outlier-free random weights."""
    return synthetic.build_decoder(tmp_path_factory.mktemp("dec") / "model.onnx", hidden=128, layers=2,
                                   heads=4, vocab=512, seed=5)


class _Rounding:
    """The baseline: the same block solver, no calibration (RTN), through the same machinery."""

    needs = frozenset({"hessian"})

    def __init__(self, solver: BlockSolver) -> None:
        self.block = solver

    def prepare(self, stats: LayerStats, spec: BlockSpec) -> None:
        return None

    def solve(self, w: np.ndarray, spec: BlockSpec, prepared: Any, target: Target) -> QuantizedBlocks:
        return self.block(w.reshape(w.shape[0], -1, spec.block_size), spec)


def _baseline(solver: BlockSolver) -> type[CalibratedPass]:
    class Baseline(CalibratedPass):
        name = "baseline"

        def calibrated_solver(self, group: Group) -> _Rounding:
            return _Rounding(solver)

        def solver(self) -> BlockSolver:
            return solver

    return Baseline


def _report(
    cls: type, src: Path, tmp: Path, data: dict[str, Any] | None = None, **options: Any,
) -> tuple[Report, OnnxModel]:
    model = OnnxModel.load(src)
    ctx = PassContext(workdir=tmp, data=dict(data or DATA))
    cls(cls.Options(**options)).run(model, ctx)
    return ctx.extras["reports"][-1][2], model


SETTINGS = [dict(bits=4, block_size=32, is_symmetric=False), dict(bits=4, block_size=128, is_symmetric=True),
            dict(bits=8, block_size=64, is_symmetric=False)]


@pytest.mark.parametrize("settings", SETTINGS, ids=["int4-b32-asym", "int4-b128-sym", "int8-b64-asym"])
def test_gptq_beats_rtn_on_every_layer(decoder: Path, tmp_path: Path, settings: dict[str, Any]) -> None:
    """Same statistics (float inputs) for both: each weight's layer-output error on the calibration data."""
    base, _ = _report(_baseline(gptq_passes.grid_solver(False)), decoder, tmp_path / "rtn", sequential=False,
                      **settings)
    gptq, _ = _report(gptq_passes.GptqPass, decoder, tmp_path / "gptq", sequential=False, **settings)
    assert base.output_errors.keys() == gptq.output_errors.keys() and len(gptq.output_errors) == 15
    for w, e in gptq.output_errors.items():
        assert e < 0.97 * base.output_errors[w], (w, e, base.output_errors[w])
    mean = np.mean(list(gptq.output_errors.values())) / np.mean(list(base.output_errors.values()))
    assert mean < 0.9


def test_gptq_options_and_sequential(decoder: Path, tmp_path: Path) -> None:
    base, _ = _report(_baseline(gptq_passes.grid_solver(False)), decoder, tmp_path / "rtn", block_size=32)
    for i, opts in enumerate([dict(desc_act=True), dict(mse=True), dict(block_size_solve=32), {}]):
        rep, _ = _report(gptq_passes.GptqPass, decoder, tmp_path / f"g{i}", block_size=32, **opts)
        mean = np.mean(list(rep.output_errors.values())) / np.mean(list(base.output_errors.values()))
        assert mean < 0.9, (opts, mean)
        assert rep.quantized == 15


def test_gptq_depends_on_the_calibration_data(decoder: Path, tmp_path: Path) -> None:
    _, a = _report(gptq_passes.GptqPass, decoder, tmp_path / "a", block_size=32)
    _, b = _report(gptq_passes.GptqPass, decoder, tmp_path / "b", dict(DATA, seed=2), block_size=32)
    _, c = _report(gptq_passes.GptqPass, decoder, tmp_path / "c", block_size=32)
    name = "model.layers.1.mlp.down_proj.weight_Q4"
    qa, qb, qc = (onnx.numpy_helper.to_array(m.initializers()[name]) for m in (a, b, c))
    assert (qa != qb).mean() > 0.05  # other data, other weights
    np.testing.assert_array_equal(qa, qc)  # the same data, the same bytes


@pytest.mark.parametrize("quantizer", ["rtn", "kquant"])
def test_awq_beats_its_rounding_on_every_layer(decoder: Path, tmp_path: Path, quantizer: str) -> None:
    from bitpress.onnx.calibrated.passes import rounding_solver

    solver, _ = rounding_solver(quantizer, 4, 32, False)
    base, _ = _report(_baseline(solver), decoder, tmp_path / "base", sequential=False, block_size=32,
                      is_symmetric=False)
    awq, model = _report(awq_passes.AwqPass, decoder, tmp_path / "awq", sequential=False, block_size=32,
                         is_symmetric=False, quantizer=quantizer)
    assert awq.output_errors.keys() == base.output_errors.keys()
    # the scales minimize the summed error of the weights sharing an input (q/k/v): one of them may
    # lose a little, every decoder layer gains
    worse = {w: (e, base.output_errors[w]) for w, e in awq.output_errors.items() if e > base.output_errors[w] * 1.01}
    assert not worse
    for layer in ("layers.0.", "layers.1."):
        mine = [w for w in awq.output_errors if layer in w]
        assert sum(awq.output_errors[w] for w in mine) < sum(base.output_errors[w] for w in mine)
    mean = np.mean(list(awq.output_errors.values())) / np.mean(list(base.output_errors.values()))
    assert mean < 0.97, mean
    out = tmp_path / "awq.onnx"
    from bitpress.onnx.save import save_onnx

    save_onnx(model, out)
    y = ort.InferenceSession(str(out)).run(None, {"input_ids": np.arange(9, dtype=np.int64)[None]})[0]
    assert np.isfinite(y).all()


def test_awq_refuses_a_quantizer_that_is_not_a_block_solver(decoder: Path, tmp_path: Path) -> None:
    from bitpress.errors import UsageError

    with pytest.raises(UsageError, match="not a block-solver pass"):
        _report(awq_passes.AwqPass, decoder, tmp_path, quantizer="gptq")


def test_rank_deficient_statistics_are_named(decoder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """128 calibration tokens for the MLP's 352-wide down projection: one warning names its inputs; enough, none."""
    with caplog.at_level(logging.WARNING, logger="bitpress"):
        _report(gptq_passes.GptqPass, decoder, tmp_path / "few", block_size=32)
    warned = [r.getMessage() for r in caplog.records if "rank-deficient" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "gptq: 2 layer input(s) saw 128 calibration tokens for up to 352 channels" in warned[0]
    assert "give at least 704 tokens" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bitpress"):
        _report(gptq_passes.GptqPass, decoder, tmp_path / "enough", dict(DATA, samples=12), block_size=32)
    assert not [r for r in caplog.records if "rank-deficient" in r.getMessage()]


def test_samples_default_to_enough_for_the_widest_input(decoder: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """No ``samples`` given: 2 tokens per channel of the widest input (352): 22 windows of 32 tokens, no warning."""
    from bitpress.calibration.data import DataConfig, samples_for

    assert samples_for(352, 32) == 22 and samples_for(1536, 128) == 24
    assert samples_for(64, 128) == 8 and samples_for(11008, 128) == 128  # from 8 to 128
    assert DataConfig().count == 8 and DataConfig(samples=3).enough_for(352, "x").samples == 3
    data = {k: v for k, v in DATA.items() if k != "samples"}
    with caplog.at_level(logging.INFO, logger="bitpress"):
        _report(gptq_passes.GptqPass, decoder, tmp_path, data, block_size=32)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("gptq: calibrating on up to 22 samples of 32 tokens (704 tokens") for m in messages)
    assert any("gptq: 22 samples" in m for m in messages)
    assert not [m for m in messages if "rank-deficient" in m]
