"""RTN int4 kernels alone, per million weights: where the time of ``bitpress quantize`` goes.

    ../.venv/bin/python bench_kernels.py [--repeats 20]

Quantizes the same ``[K, N]`` float32 bands (the chunks ``bitpress quantize`` hands a kernel:
about a million weights each) with

* **bitpress rtn block solver**: transpose to ``[N, blocks, block]``, ``rtn_solver``, pack;
* **bitpress rtn packing kernel**: ``rtn_packing_kernel`` on the stored layout (what runs);
* **ONNX Runtime MLAS**: ``quantize_matmul_4bits``, the C++ kernel behind ORT's
  ``MatMulNBitsQuantizer`` (its own thread pool, all cores).

and checks that the three give the same bytes. Reports wall and CPU milliseconds per million
weights (best of the repeats), in this one process, and writes ``.work/results/kernels.json``
for ``report.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from benchkit import RESULTS, machine_info, markdown_table, source_state

SHAPES = [  # (K band, N, block size): bands of the 447 MB model's weights at ~1M elements
    (352, 2912, 32, "gate/up band, block 32"),
    (256, 4096, 128, "4096-wide band, block 128"),
    (1024, 1024, 32, "[1024, 1024] band, block 32"),
]


def _block_solver(w_kn: np.ndarray, bs: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    from bitpress.onnx.layout import pack_along_last
    from bitpress.onnx.weightonly import transposed
    from bitpress.quant.solver import BlockSpec
    from bitpress_rtn.solver import rtn_solver

    n = w_kn.shape[1]
    out = rtn_solver(transposed(w_kn).reshape(n, -1, bs), BlockSpec(4, bs, symmetric))
    return pack_along_last(out.q, 4), out.scales


def _packing_kernel(w_kn: np.ndarray, bs: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    from bitpress.quant.solver import BlockSpec
    from bitpress_rtn.solver import rtn_packing_kernel

    out = rtn_packing_kernel(w_kn, BlockSpec(4, bs, symmetric))
    assert out is not None
    return out.packed, out.scales


def _ort(w_kn: np.ndarray, bs: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    k, n = w_kn.shape
    packed = np.empty((n, k // bs, bs // 2), np.uint8)
    scales = np.empty((n, k // bs), np.float32)
    zp = np.empty(n * (-(-(k // bs) // 2)), np.uint8)
    quantize_matmul_4bits(packed, w_kn, scales, zp, bs, n, k, symmetric)
    return packed, scales


KERNELS: list[tuple[str, Callable[[np.ndarray, int, bool], tuple[np.ndarray, np.ndarray]]]] = [
    ("bitpress rtn block solver (transpose + solve + pack)", _block_solver),
    ("bitpress rtn packing kernel", _packing_kernel),
    ("ONNX Runtime MLAS quantize_matmul_4bits", _ort),
]


def _time(fn: Callable[..., Any], args: tuple[Any, ...], repeats: int) -> tuple[float, float]:
    fn(*args)  # warm up (allocator, thread pools)
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn(*args)
        best_wall = min(best_wall, time.perf_counter() - w0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best_wall, best_cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for k, n, bs, label in SHAPES:
        w = rng.standard_normal((k, n), dtype=np.float32)
        for symmetric in (True, False):
            answers = [fn(w, bs, symmetric) for _, fn in KERNELS]
            same = all(np.array_equal(a[0], answers[0][0]) and np.array_equal(a[1], answers[0][1])
                       for a in answers[1:])
            for name, fn in KERNELS:
                wall, cpu = _time(fn, (w, bs, symmetric), args.repeats)
                per_m = 1e3 / (k * n / 1e6)  # seconds per call -> ms per million weights
                rows.append({"shape": f"[{k}, {n}]", "what": label, "symmetric": symmetric, "kernel": name,
                             "wall_ms_per_m": wall * per_m, "cpu_ms_per_m": cpu * per_m, "same_bytes": same})
                print(f"{label:45s} sym={symmetric!s:5s} {name:55s} wall {wall * per_m:6.2f} "
                      f"cpu {cpu * per_m:6.2f} ms/M  same bytes: {same}", flush=True)
    result = {"suite": "kernels", "kind": "kernels", "source": source_state(), "machine": machine_info(),
              "repeats": args.repeats, "cores": os.cpu_count(), "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kernels.json").write_text(json.dumps(result, indent=1))
    print(markdown_table(["what", "sym", "kernel", "wall ms / M", "CPU ms / M"],
                         [[r["what"], r["symmetric"], r["kernel"], f"{r['wall_ms_per_m']:.2f}",
                           f"{r['cpu_ms_per_m']:.2f}"] for r in rows], "lllrr"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
