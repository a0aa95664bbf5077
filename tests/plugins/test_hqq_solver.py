"""The HQQ solver against plain min/max RTN, plus the block-solver contract.

Measured on this machine (2 cores), relative Frobenius error ||W - Wq|| / ||W|| at 4 bits of a
1024x1024 N(0, 1) matrix (seed 0) and a Student-t (3 d.o.f., seed 1) one with heavy tails.
RTN = min/max asymmetric with integer ``zp = round(-min / s)`` (``_rtn`` below; the sym
column uses ONNX Runtime's symmetric RTN against the symmetric variant); "plain" is HQQ alone
(``refit_iters=0``), "full" the default (HQQ, then least-squares refits):

    matrix     block | RTN    | float-zp plain full   | int-zp plain full   | sym RTN  full
    gaussian   32    | 0.0808 | 0.0746         0.0720 | 0.0810       0.0778 | 0.0859   0.0829
    gaussian   64    | 0.0911 | 0.0864         0.0838 | 0.0913       0.0882 | 0.0949   0.0922
    gaussian   128   | 0.1005 | 0.0970         0.0940 | 0.1006       0.0972 | 0.1031   0.0996
    student-t3 32    | 0.1019 | 0.0948         0.0913 | 0.1022       0.0991 | 0.1277   0.1244
    student-t3 64    | 0.1300 | 0.1253         0.1202 | 0.1302       0.1266 | 0.1606   0.1551
    student-t3 128   | 0.1640 | 0.1620         0.1534 | 0.1641       0.1579 | 0.1991   0.1878

Plain HQQ with a float zero point matches the ``hqq`` package (0.0859 here at block 64, 0.0860
on 4096x4096); rounding its zero point to an integer throws the gain away (0.0913 vs RTN's
0.0911), which the scale refit after rounding wins back. For reference the brute-force optimum
(grid over scale and zero point) at block 64 is about 0.0806 (float) and 0.0869 (integer zp).
"""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest

from bitpress.quant.solver import BlockSpec, QuantizedBlocks, dequantize
from bitpress.testing import relative_error
from bitpress_hqq.solver import bits_per_weight, hqq_solver

MODES = {
    "float-zp": dict(symmetric=False, float_zero_points=True),
    "int-zp": dict(symmetric=False, float_zero_points=False),
    "sym": dict(symmetric=True, float_zero_points=False),
}


def _spec(bits: int, block: int, mode: str) -> BlockSpec:
    return BlockSpec(bits=bits, block_size=block, **MODES[mode])


@pytest.fixture(scope="module")
def matrices() -> dict[str, np.ndarray]:
    return {
        "gaussian": np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32),
        "student-t3": np.random.default_rng(1).standard_t(3, (1024, 1024)).astype(np.float32),
    }


def _rtn(w: np.ndarray, bits: int, symmetric: bool = False) -> np.ndarray:
    """Plain min/max round-to-nearest, dequantised (the baseline to beat)."""
    qmax = 2**bits - 1
    lo = w.min(-1, keepdims=True)
    hi = w.max(-1, keepdims=True)
    if symmetric:  # ONNX Runtime's: the largest magnitude lands on q = 0
        mid = 2 ** (bits - 1)
        s = -np.where(np.abs(hi) > np.abs(lo), hi, lo) / mid
        return (np.clip(np.rint(w / s + mid), 0, qmax) - mid) * s
    s = (hi - lo) / qmax
    zp = np.clip(np.rint(-lo / s), 0, qmax)
    return (np.clip(np.rint(w / s + zp), 0, qmax) - zp) * s


def _check_contract(blocks: QuantizedBlocks, spec: BlockSpec, shape: tuple[int, ...]) -> None:
    rows, n_blocks, _ = shape
    assert blocks.q.dtype == np.uint8 and blocks.q.shape == shape
    assert int(blocks.q.max()) < 2**spec.bits
    assert blocks.scales.dtype == np.float32 and blocks.scales.shape == (rows, n_blocks)
    assert np.isfinite(blocks.scales).all()
    zp = blocks.zero_points
    if spec.symmetric:
        assert zp is None
    elif spec.float_zero_points:
        assert zp.dtype == np.float32 and zp.shape == (rows, n_blocks)
        assert np.isfinite(zp).all()
    else:
        assert zp.dtype == np.uint8 and zp.shape == (rows, n_blocks)
        assert int(zp.max()) < 2**spec.bits


@pytest.mark.parametrize("kind", ["gaussian", "student-t3"])
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize(
    ("mode", "margin"),
    # measured gains over RTN (table above): float-zp >= 6%, int-zp >= 2.6%, sym >= 2.6%
    [("float-zp", 0.04), ("int-zp", 0.015), ("sym", 0.015)],
)
def test_beats_rtn(
    matrices: dict[str, np.ndarray], kind: str, block: int, mode: str, margin: float
):
    w = matrices[kind].reshape(1024, -1, block)
    spec = _spec(4, block, mode)
    blocks = hqq_solver(w, spec)
    _check_contract(blocks, spec, w.shape)
    err = relative_error(w, dequantize(blocks, 4))
    rtn = relative_error(w, _rtn(w, 4, symmetric=spec.symmetric))
    assert err < rtn * (1 - margin), (err, rtn)


def test_plain_hqq_matches_the_reference(matrices: dict[str, np.ndarray]):
    # Plain HQQ (no refit) reproduces the hqq package's figure (0.0859 on this matrix);
    # the default beats it and the 0.086 target.
    w = matrices["gaussian"].reshape(1024, -1, 64)
    spec = _spec(4, 64, "float-zp")
    plain = relative_error(w, dequantize(hqq_solver(w, spec, refit_iters=0), 4))  # measured 0.0864
    full = relative_error(w, dequantize(hqq_solver(w, spec), 4))  # measured 0.0838
    assert 0.084 < plain < 0.0875
    assert full < 0.085


@pytest.mark.parametrize("mode", ["float-zp", "int-zp", "sym"])
def test_refits_never_increase_the_error(matrices: dict[str, np.ndarray], mode: str):
    w = matrices["student-t3"][:256].reshape(256, -1, 64)
    spec = _spec(4, 64, mode)
    # int-zp's first refit step also moves z from nearest to floor/ceil: start the chain there
    start = 1 if mode == "int-zp" else 0
    errs = [relative_error(w, dequantize(hqq_solver(w, spec, refit_iters=k), 4)) for k in range(start, 9)]
    assert all(b <= a * (1 + 1e-6) for a, b in itertools.pairwise(errs)), errs


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("block", [16, 32, 256])
@pytest.mark.parametrize("mode", ["float-zp", "int-zp", "sym"])
def test_contract_all_bits_and_blocks(bits: int, block: int, mode: str):
    w = np.random.default_rng(bits * 1000 + block).standard_normal((64, 512), dtype=np.float32)
    w = w.reshape(64, -1, block)
    spec = _spec(bits, block, mode)
    blocks = hqq_solver(w, spec)
    _check_contract(blocks, spec, w.shape)
    # never worse than RTN, at any width (smallest measured gain: ~1% at 8 bits, block 256)
    assert relative_error(w, dequantize(blocks, bits)) <= relative_error(w, _rtn(w, bits, spec.symmetric)) * 1.001


@pytest.mark.parametrize("mode", ["float-zp", "int-zp", "sym"])
def test_input_untouched_and_deterministic(mode: str):
    w = np.random.default_rng(3).standard_t(4, (300, 8, 32)).astype(np.float32)
    before = w.copy()
    w.setflags(write=False)  # a read-only input must work too
    spec = _spec(4, 32, mode)
    first = hqq_solver(w, spec)
    np.testing.assert_array_equal(w, before)
    # Chunking and threads change nothing: every block is solved on its own.
    for kw in ({}, {"workers": 1}, {"workers": 2, "chunk_elems": 1000}, {"chunk_elems": 1 << 22}):
        again = hqq_solver(w, spec, **kw)
        np.testing.assert_array_equal(again.q, first.q)
        np.testing.assert_array_equal(again.scales, first.scales)
        if first.zero_points is not None:
            np.testing.assert_array_equal(again.zero_points, first.zero_points)


@pytest.mark.parametrize("kw", [{"optimize_scale": True}, {"lp_norm": 1.0}, {"early_stop": False}])
def test_options_beat_rtn(matrices: dict[str, np.ndarray], kw: dict):
    w = matrices["gaussian"][:256].reshape(256, -1, 64)
    for mode in ("float-zp", "int-zp"):
        spec = _spec(4, 64, mode)
        err = relative_error(w, dequantize(hqq_solver(w, spec, **kw), 4))
        assert err < relative_error(w, _rtn(w, 4)) * 0.98, (mode, err)


def test_importance_lowers_the_weighted_error(matrices: dict[str, np.ndarray]):
    w = matrices["student-t3"][:256].reshape(256, -1, 64)
    imp = np.random.default_rng(5).gamma(0.5, size=1024).astype(np.float32)
    for mode in ("float-zp", "int-zp", "sym"):
        spec = _spec(4, 64, mode)

        def weighted(blocks: QuantizedBlocks) -> float:
            d = (dequantize(blocks, 4) - w).reshape(256, -1)
            return float((d * d * imp).sum())

        assert weighted(hqq_solver(w, spec, imp)) < weighted(hqq_solver(w, spec)), mode


@pytest.mark.filterwarnings("error")  # no overflow or divide warnings either
@pytest.mark.parametrize("mode", ["float-zp", "int-zp", "sym"])
def test_degenerate_blocks(mode: str):
    w = np.zeros((5, 2, 16), dtype=np.float32)
    w[1] = 3.5  # constant
    w[2] = -1e-35  # constant, subnormal
    w[3] = np.random.default_rng(0).standard_normal((2, 16)) * 1e-30  # tiny
    w[4, 0, :8] = 1.0  # two values
    spec = _spec(4, 16, mode)
    blocks = hqq_solver(w, spec)
    _check_contract(blocks, spec, w.shape)
    err = np.abs(dequantize(blocks, 4) - w)
    assert err[0].max() == 0 and err[4].max() <= 1e-6
    assert err[3].max() <= 0.1 * np.abs(w[3]).max()  # quantised at its own scale, not flushed
    if mode == "float-zp":  # a free offset reproduces any constant block
        assert err[1].max() <= 1e-6 and err[2].max() <= 1e-40


def test_other_float_dtypes():
    w = np.random.default_rng(0).standard_normal((16, 4, 32))
    spec = _spec(4, 32, "float-zp")
    ref = hqq_solver(w.astype(np.float32), spec)
    for dtype in (np.float64, np.float16):
        blocks = hqq_solver(w.astype(dtype), spec)
        _check_contract(blocks, spec, w.shape)
        if dtype == np.float64:
            np.testing.assert_array_equal(blocks.q, ref.q)


def test_memory_stays_bounded():
    # 2048 x 4096 float32 = 32 MiB in; q alone is 8 MiB out. Unchunked, the solver's
    # temporaries would be several times the input; chunked they stay a few MiB.
    w = np.random.default_rng(0).standard_normal((2048, 64, 64), dtype=np.float32)
    tracemalloc.start()
    try:
        hqq_solver(w, _spec(4, 64, "float-zp"), workers=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 24 * 2**20, peak / 2**20


def test_bits_per_weight():
    assert bits_per_weight(_spec(4, 32, "int-zp")) == 4 + (16 + 4) / 32  # 4.625
    assert bits_per_weight(_spec(4, 32, "float-zp")) == 5.0
    assert bits_per_weight(_spec(4, 32, "sym")) == 4.5
    assert bits_per_weight(_spec(8, 128, "float-zp"), scale_bytes=4) == 8 + 64 / 128


@pytest.mark.parametrize(
    ("shape", "spec", "kw", "match"),
    [
        ((4, 2, 32), BlockSpec(4, 64, False), {}, "block_size"),
        ((4, 64), BlockSpec(4, 64, False), {}, "rows, n_blocks"),
        ((4, 2, 32), BlockSpec(1, 32, False), {}, "2..8"),
        ((4, 2, 32), BlockSpec(9, 32, False), {}, "2..8"),
        ((4, 2, 32), BlockSpec(4, 32, False), {"importance": np.ones(10)}, "importance"),
        ((4, 2, 32), BlockSpec(4, 32, False), {"importance": -np.ones(64)}, "importance"),
        ((4, 2, 32), BlockSpec(4, 32, False), {"lp_norm": 1.5}, "lp_norm"),
        ((4, 2, 32), BlockSpec(4, 32, False), {"kappa": 0.5}, "kappa"),
    ],
)
def test_bad_arguments(shape, spec, kw, match):
    with pytest.raises(ValueError, match=match):
        hqq_solver(np.ones(shape, dtype=np.float32), spec, **kw)


def test_non_finite_weights_are_refused():
    w = np.ones((4, 2, 32), dtype=np.float32)
    w[1, 1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        hqq_solver(w, _spec(4, 32, "float-zp"))


def test_torch_path_matches_numpy():
    pytest.importorskip("torch")
    w = np.random.default_rng(0).standard_normal((128, 4, 64), dtype=np.float32)
    for mode in ("float-zp", "int-zp", "sym"):
        spec = _spec(4, 64, mode)
        a = hqq_solver(w, spec, device="numpy")
        b = hqq_solver(w, spec, device="cpu")  # torch on the CPU: the same code as on CUDA
        _check_contract(b, spec, w.shape)
        assert abs(relative_error(w, dequantize(a, 4)) - relative_error(w, dequantize(b, 4))) < 1e-5
