"""What the calibration machinery holds: one float32 Hessian per input, substitutes in files."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from bitpress.onnx.calibrated import stats as stats_mod
from bitpress.onnx.calibrated.stats import StatsAccumulator
from bitpress.onnx.calibrated.substitutes import SubstituteStore

K = 384


def _samples(n: int = 5) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    scale = np.geomspace(0.01, 10, K).astype(np.float32)
    return [(rng.standard_normal((1, 40 + 7 * i, K)) * scale).astype(np.float32) for i in range(n)]


def test_hessian_is_the_float64_gram_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats_mod, "GRAM_CHUNK_ELEMENTS", 50 * K)  # bands that do not divide K
    xs = _samples()
    acc = StatsAccumulator(frozenset({"hessian", "mean_sq", "mean_abs"}), len(xs))
    for x in xs:
        acc.add(x)
    st = acc.result()
    flat = np.concatenate([x.reshape(-1, K) for x in xs]).astype(np.float64)
    ref = flat.T @ flat / len(flat)
    assert st.rows == len(flat) and st.hessian is not None and st.hessian.dtype == np.float32
    np.testing.assert_array_equal(st.hessian, st.hessian.T)
    np.testing.assert_allclose(st.hessian, ref, rtol=2e-5, atol=2e-6 * np.abs(ref).max())
    np.testing.assert_allclose(st.mean_sq, np.diagonal(ref), rtol=2e-5)
    np.testing.assert_allclose(st.mean_abs, np.abs(flat).mean(axis=0), rtol=2e-5)


def test_accumulating_holds_one_float32_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy reports its buffers to tracemalloc: summing and handing over the Hessian takes one
    [K, K] float32 and band-sized temporaries (a float64 sum and its copy took 3x that)."""
    monkeypatch.setattr(stats_mod, "GRAM_CHUNK_ELEMENTS", 16 * K)
    xs = _samples(3)
    acc = StatsAccumulator(frozenset({"hessian"}), len(xs))
    tracemalloc.start()
    try:
        for x in xs:
            acc.add(x)
        st = acc.result()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    inputs = sum(x.nbytes for x in xs)
    assert st.hessian is not None
    assert peak < 1.2 * 4 * K * K + inputs, f"{peak} bytes for a {4 * K * K}-byte Hessian"


@pytest.mark.parametrize("transposed", [False, True])
def test_substitutes_are_written_by_slabs(tmp_path: Path, transposed: bool) -> None:
    rng = np.random.default_rng(0)
    value = rng.standard_normal((48, 80)).astype(np.float16)  # stored orientation
    solver_rows = value.T if transposed else value  # what the solve produces, slab by slab
    store = SubstituteStore(tmp_path / "subs")
    with store.writer("w", value.shape, value.dtype, transposed=transposed) as out:
        for r0 in range(0, len(solver_rows), 13):
            out.write(r0, solver_rows[r0 : r0 + 13].astype(np.float32))
    assert "w" in store and store.spec("w") == ((48, 80), np.dtype(np.float16))
    mapped = store.open("w")
    np.testing.assert_array_equal(mapped, value)
    assert not mapped.flags.writeable
    del mapped
    store.put("t", value[:5])
    np.testing.assert_array_equal(store.open("t"), value[:5])
    files = list((tmp_path / "subs").iterdir())
    assert len(files) == 2
    store.discard("w")
    assert "w" not in store and len(list((tmp_path / "subs").iterdir())) == 1
    store.close()
    assert not list((tmp_path / "subs").iterdir())
