"""AWQ's scale and clip searches (bitpress_awq.search) on single layers, against plain rounding.

Measured on this machine (2 shared cores), output error ||X W^T - X W_eff^T|| on the calibration
data of a [192, 256] layer whose 8 outlier input channels are 30x the others (``_layer(0)``),
int4 block 32, relative to the same block solver without AWQ:

    solver             | scale  scale+clip | clip alone
    rtn, integer zp    | 0.465  0.440      | 0.505
    rtn, symmetric     | 0.429  0.393      | 0.463
    kquant, float zp   | 0.376  0.362      | 0.482
    hqq, float zp      | 0.418  0.403      | 0.461
    rtn, zp, block 128 | 0.541  0.519      | 0.624
"""

from __future__ import annotations

import numpy as np
import pytest

from bitpress.quant.calibrated import LayerStats, Target, output_error
from bitpress.quant.solver import BlockSpec, QuantizedBlocks, dequantize

awq = pytest.importorskip("bitpress_awq.search")
rtn = pytest.importorskip("bitpress_rtn.solver")
kquant = pytest.importorskip("bitpress_kquant.solver")

UP = Target("model.layers.0.mlp.up_proj.weight", ("/model/layers.0/mlp/up_proj/MatMul",))
Q = Target("model.layers.0.self_attn.q_proj.weight", ("/model/layers.0/attn/q_proj/MatMul",))
V = Target("model.layers.0.self_attn.v_proj.weight", ("/model/layers.0/attn/v_proj/MatMul",))


def _layer(seed: int, k: int = 256, rows: int = 192, n: int = 2048, outliers: int = 8) -> tuple[np.ndarray, ...]:
    """Activations ``x [n, k]`` with a few large channels (as real LLMs have), a weight ``[rows, k]``."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, k)).astype(np.float32)
    x[:, r.choice(k, outliers, replace=False)] *= 30.0
    w = (r.standard_normal((rows, k)) * 0.05).astype(np.float32)
    return x, w


def _stats(x: np.ndarray) -> LayerStats:
    return LayerStats(
        rows=len(x),
        hessian=(x.T @ x / len(x)).astype(np.float32),
        mean_abs=np.abs(x).mean(axis=0),
        mean_sq=np.square(x).mean(axis=0),
    )


def _pad(w: np.ndarray, bs: int) -> np.ndarray:
    return np.pad(w, ((0, 0), (0, -w.shape[1] % bs)))


def _deq(blocks: QuantizedBlocks, spec: BlockSpec, k: int) -> np.ndarray:
    return dequantize(blocks, spec.bits).reshape(blocks.q.shape[0], -1)[:, :k]


def _plain(solver, w: np.ndarray, spec: BlockSpec) -> QuantizedBlocks:
    wp = _pad(w, spec.block_size)
    return solver(wp.reshape(len(w), -1, spec.block_size), spec)


def _awq(solver, x: np.ndarray, w: np.ndarray, spec: BlockSpec, target: Target = UP) -> np.ndarray:
    """The host's flow for one weight: scales, scaled weight and statistics, clip solve, unscale."""
    stats = _stats(x)
    s = awq.AwqScaler(solver).scales([w], stats, [spec], [target])
    assert s is not None
    clip = awq.AwqClipSolver(solver)
    bs = spec.block_size
    scaled = stats.scaled(s).padded(-(-w.shape[1] // bs) * bs)
    blocks = clip.solve(_pad(w * s, bs), spec, clip.prepare(scaled, spec), target)
    return _deq(blocks, spec, w.shape[1]) / s


def _out_err(x: np.ndarray, w: np.ndarray, w_eff: np.ndarray) -> float:
    return float(np.linalg.norm(x.astype(np.float64) @ (w - w_eff).T.astype(np.float64)))


@pytest.mark.parametrize(
    ("solver_name", "spec", "k"),
    [
        ("rtn", BlockSpec(4, 32, symmetric=False), 256),
        ("rtn", BlockSpec(4, 32, symmetric=True), 240),  # K not whole blocks: padded
        ("kquant", BlockSpec(4, 32, symmetric=False, float_zero_points=True), 256),
    ],
)
def test_awq_beats_plain_rounding_on_outlier_activations(solver_name: str, spec: BlockSpec, k: int) -> None:
    solver = rtn.rtn_solver if solver_name == "rtn" else kquant.kquant_solver
    x, w = _layer(0, k=k)
    plain = _out_err(x, w, _deq(_plain(solver, w, spec), spec, k))
    rtn_err = _out_err(x, w, _deq(_plain(rtn.rtn_solver, w, spec), spec, k))
    s = awq.AwqScaler(solver).scales([w], _stats(x), [spec], [UP])
    assert s is not None
    scaled_only = _out_err(x, w, _deq(_plain(solver, w * s, spec), spec, k) / s)
    got = _out_err(x, w, _awq(solver, x, w, spec))
    # measured: scaling alone 0.38-0.47 of the same solver unscaled, with the clip 0.36-0.44
    assert scaled_only < 0.6 * plain
    assert got < 0.98 * scaled_only
    assert got < 0.6 * rtn_err


def test_scales_follow_the_activations() -> None:
    _, w = _layer(1)
    spec = BlockSpec(4, 32, symmetric=False)
    xa, _ = _layer(2)
    xb, _ = _layer(3)  # other outlier channels
    scaler = awq.AwqScaler(rtn.rtn_solver)
    sa = scaler.scales([w], _stats(xa), [spec], [UP])
    sb = scaler.scales([w], _stats(xb), [spec], [UP])
    assert sa is not None and sb is not None
    assert not np.allclose(sa, sb, rtol=1e-2)
    for x, s in ((xa, sa), (xb, sb)):
        big = np.abs(x).mean(axis=0) > 5.0
        assert big.sum() == 8
        assert s[big].min() > 2.0 * np.median(s[~big])  # salient channels are scaled up


def test_search_scores_candidates_by_output_error() -> None:
    x, w = _layer(4)
    _, w2 = _layer(5, rows=64)
    stats = _stats(x)
    spec = BlockSpec(4, 32, symmetric=False)
    found = awq.AwqScaler(rtn.rtn_solver).search([w, w2], stats, [spec, spec], [UP, UP])
    assert found is not None
    plain = sum(output_error(stats, v - _deq(_plain(rtn.rtn_solver, v, spec), spec, 256)) for v in (w, w2))
    assert found.losses[None] == pytest.approx(plain, rel=1e-5)  # the identity candidate is plain RTN
    assert len(found.losses) == 21
    assert found.losses[found.ratio] == min(found.losses.values())
    assert found.losses[found.ratio] < 0.5 * plain
    # Scoring a subset of rows estimates the same losses (a Gaussian weight's rows are alike)
    sub = awq.AwqScaler(rtn.rtn_solver, max_rows=64).search([w, w2], stats, [spec, spec], [UP, UP])
    assert sub is not None
    for a, loss in found.losses.items():
        assert sub.losses[a] == pytest.approx(loss, rel=0.25)


def test_sample_rows_stand_in_for_a_wide_input() -> None:
    x, w = _layer(6)
    spec = BlockSpec(4, 32, symmetric=False)
    full = _stats(x)
    sample = x[::16]  # 128 rows < K = 256: the error comes from them
    stats = LayerStats(full.rows, hessian=full.hessian, mean_abs=full.mean_abs, sample=sample)
    found = awq.AwqScaler(rtn.rtn_solver).search([w], stats, [spec], [UP])
    assert found is not None
    on_sample = LayerStats(full.rows, sample=sample)
    plain = output_error(on_sample, w - _deq(_plain(rtn.rtn_solver, w, spec), spec, 256))
    assert found.losses[None] == pytest.approx(plain, rel=1e-5)
    assert awq.AwqScaler(rtn.rtn_solver, use_sample=False).needs == {"mean_abs", "hessian"}


def _block_err64(h: np.ndarray, d: np.ndarray) -> np.ndarray:
    """float64 ``[rows, nb]`` per-block output error written out here (not the module's)."""
    rows, nb, bs = d.shape
    h64 = h.astype(np.float64)
    out = np.empty((rows, nb))
    for b in range(nb):
        hb = h64[b * bs : (b + 1) * bs, b * bs : (b + 1) * bs]
        db = d[:, b, :].astype(np.float64)
        out[:, b] = np.einsum("ri,ij,rj->r", db, hb, db)
    return out


@pytest.mark.parametrize("symmetric", [False, True])
def test_clip_picks_the_best_ratio_per_block(symmetric: bool) -> None:
    x, w = _layer(7, rows=48)
    w[:, ::17] *= 6.0  # a few large weights per block: clipping them pays
    spec = BlockSpec(4, 32, symmetric=symmetric)
    stats = _stats(x)
    clip = awq.AwqClipSolver(rtn.rtn_solver)
    got = clip.solve(w, spec, clip.prepare(stats, spec), V)
    assert got.q.shape == (48, 8, 32) and got.q.dtype == np.uint8 and got.q.max() < 16
    w3 = w.reshape(48, 8, 32)
    err = _block_err64(stats.hessian, w3 - dequantize(got, 4))
    # every ratio of the grid, rounded by the plain solver
    peak = np.abs(w3).max(axis=-1, keepdims=True)
    limits = [peak * np.float32(1.0 - i / 20) for i in range(11)]
    cands = [rtn.rtn_solver(np.clip(w3, -lim, lim), spec) for lim in limits]
    errs = np.stack([_block_err64(stats.hessian, w3 - dequantize(c, 4)) for c in cands])
    np.testing.assert_allclose(err, errs.min(axis=0), rtol=1e-4)
    assert np.all(err <= errs[0] * (1 + 1e-5))  # never worse than no clipping (ratio 1 is tried)
    assert (err < 0.95 * errs[0]).mean() > 0.2  # and clipping does win on many blocks
    # each block's answer is the solver's own for one of the ratios
    match = np.zeros(err.shape, dtype=bool)
    for c in cands:
        same = (c.q == got.q).all(axis=-1) & (c.scales == got.scales)
        if not symmetric:
            same &= c.zero_points == got.zero_points
        match |= same
    assert match.all()


def test_clip_skip_rounds_query_and_key_plainly() -> None:
    x, w = _layer(8, rows=48)
    w[:, ::17] *= 6.0
    spec = BlockSpec(4, 32, symmetric=False)
    clip = awq.AwqClipSolver(rtn.rtn_solver)
    prepared = clip.prepare(_stats(x), spec)
    plain = rtn.rtn_solver(w.reshape(48, 8, 32), spec)
    q = clip.solve(w, spec, prepared, Q)
    np.testing.assert_array_equal(q.q, plain.q)
    np.testing.assert_array_equal(q.scales, plain.scales)
    np.testing.assert_array_equal(q.zero_points, plain.zero_points)
    assert not np.array_equal(clip.solve(w, spec, prepared, V).q, plain.q)  # v is clipped
    unskipped = awq.AwqClipSolver(rtn.rtn_solver, clip_skip=())
    assert not np.array_equal(unskipped.solve(w, spec, prepared, Q).q, plain.q)
    for name, skipped in [
        ("/model/layers.3/attn/k_proj/MatMul", True),
        ("/model/layers.3/attn/qkv_proj/MatMul", True),
        ("encoder.layer.0.attention.self.query.weight", True),
        ("encoder.layer.0.attention.self.key.weight", True),
        ("transformer.h.0.attn.c_attn.weight", True),
        ("encoder.block.0.layer.0.SelfAttention.q.weight", True),
        ("/model/layers.3/attn/v_proj/MatMul", False),
        ("/model/layers.3/attn/o_proj/MatMul", False),
        ("model.layers.3.mlp.down_proj.weight", False),
        ("encoder.layer.0.attention.self.value.weight", False),
        ("monkey_proj.weight", False),
    ]:
        assert clip.skips(Target(name, ())) is skipped, name
    assert clip.skips(Target("w0", ("/blk/self_attn/q_proj/MatMul",)))  # node names count too


def test_float_zero_points_survive_the_clip_search() -> None:
    x, w = _layer(9, rows=32)
    spec = BlockSpec(4, 32, symmetric=False, float_zero_points=True)
    clip = awq.AwqClipSolver(kquant.kquant_solver)
    got = clip.solve(w, spec, clip.prepare(_stats(x), spec), V)
    assert got.zero_points is not None and got.zero_points.dtype == np.float32
    plain = kquant.kquant_solver(w.reshape(32, 8, 32), spec)
    w3 = w.reshape(32, 8, 32)
    h = _stats(x).hessian
    assert np.all(_block_err64(h, w3 - dequantize(got, 4)) <= _block_err64(h, w3 - dequantize(plain, 4)) * (1 + 1e-5))


def test_candidate_scales_are_awqs_formula() -> None:
    r = np.random.default_rng(11)
    x_mean = r.uniform(0.1, 10.0, 64)
    w_mean = r.uniform(0.05, 1.0, 64)
    for a in (0.0, 0.3, 0.75):
        duo = awq.awq_scales(x_mean, w_mean, a)
        want = x_mean**a / w_mean ** (1 - a)
        np.testing.assert_allclose(duo, want / np.sqrt(want.max() * want.min()), rtol=1e-6)
        plain = awq.awq_scales(x_mean, None, a)
        np.testing.assert_allclose(plain, x_mean**a / np.sqrt(x_mean.max() ** a * x_mean.min() ** a), rtol=1e-6)
    # w_mean: |w| over its block's largest |w|, averaged over every row of every weight
    w1 = np.array([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 4.0, -4.0]], np.float32)
    w2 = np.array([[3.0, 1.0, -1.0, 0.0]], np.float32)
    wm = awq.weight_magnitude([w1, w2], [BlockSpec(4, 2, False), BlockSpec(4, 4, False)])
    np.testing.assert_allclose(wm, [(0.5 + 0 + 1) / 3, (1 + 0 + 1 / 3) / 3, (1 + 1 + 1 / 3) / 3, (0 + 1 + 0) / 3])


@pytest.mark.parametrize(("duo", "identity"), [(True, True), (False, True), (True, False)])
def test_scales_positive_and_finite_with_dead_channels_and_zero_columns(duo: bool, identity: bool) -> None:
    x, w = _layer(10, k=128, rows=64)
    x[:, :8] = 0.0  # dead inputs
    w[:, 8:16] = 0.0  # zero weight columns
    w[:, 120:] = 0.0  # and one whole block of them
    spec = BlockSpec(4, 32, symmetric=False)
    found = awq.AwqScaler(rtn.rtn_solver, duo_scaling=duo, try_identity=identity).search([w], _stats(x), [spec], [UP])
    assert found is not None and found.ratio is not None  # a real scaling wins on this layer
    assert all(np.isfinite(v) for v in found.losses.values()) and len(found.losses) == 20 + identity
    s = found.scales
    assert s.dtype == np.float32 and s.shape == (128,)
    assert np.all(np.isfinite(s)) and np.all(s > 0)
    assert s.max() / s.min() < 1e5
    assert np.all(np.isfinite(_awq(rtn.rtn_solver, x, w, spec)))
    dead = LayerStats(len(x), hessian=np.zeros((128, 128), np.float32), mean_abs=np.zeros(128, np.float32))
    assert awq.AwqScaler(rtn.rtn_solver).scales([w], dead, [spec], [UP]) is None  # nothing to scale


def test_importance_reaches_the_solver() -> None:
    x, w = _layer(12, rows=64)
    spec = BlockSpec(4, 32, symmetric=False, float_zero_points=True)
    stats = _stats(x)
    seen: list[np.ndarray | None] = []

    def spy(w3: np.ndarray, spec: BlockSpec, importance: np.ndarray | None = None) -> QuantizedBlocks:
        seen.append(importance)
        return kquant.kquant_solver(w3, spec, importance)

    found = awq.AwqScaler(spy, importance=True, n_grid=4).search([w], stats, [spec], [UP])
    assert found is not None and len(seen) == 5
    w_mean = awq.weight_magnitude([w], [spec])
    tried = [np.ones(256, np.float32)] + [awq.awq_scales(np.abs(x).mean(0), w_mean, i / 4) for i in range(4)]
    for s, imp in zip(tried, seen, strict=True):  # each candidate rounded knowing its scaled input
        np.testing.assert_allclose(imp, np.diagonal(stats.hessian) / s**2, rtol=1e-4)
    seen.clear()
    clip = awq.AwqClipSolver(spy, importance=True)
    got = clip.solve(w * found.scales, spec, clip.prepare(stats.scaled(found.scales), spec), V)
    assert len(seen) == 11
    np.testing.assert_allclose(seen[0], np.diagonal(stats.hessian) / found.scales**2, rtol=1e-4)
    plain = _out_err(x, w, _deq(_plain(kquant.kquant_solver, w, spec), spec, 256))
    assert _out_err(x, w, _deq(got, spec, 256) / found.scales) < 0.6 * plain
