"""``bitpress demo`` (``make demo``): the main job on a model it builds itself.

Builds a small random Llama-like decoder with tied embeddings, quantizes it with every
installed native algorithm at int4 and int8, and reports size, time, the error of the logits
against the float model through ONNX Runtime, and how fast each output runs against the float
model (one token and a 32-token batch, one thread, every model timed alternately in one run:
:mod:`bitpress.speed`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bitpress.api import quantize
from bitpress.errors import BitpressError
from bitpress.plugins import get_registry
from bitpress.speed import bench
from bitpress.synthetic import build_decoder, random_inputs

DEMO_PRESETS: dict[str, dict[str, Any]] = {
    "demo": {"hidden": 256, "layers": 4, "heads": 8, "vocab": 4096, "intermediate": 704, "tied": True},
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256, "tied": True},
}
CANDIDATES = [("rtn", "int8"), ("rtn", "int4"), ("hqq", "int4"), ("kquant", "int4"), ("nf4", "nf4")]


def logits_error(reference: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """Relative L2 error and top-1 agreement of two logits arrays."""
    rel = float(np.linalg.norm(other - reference) / np.linalg.norm(reference))
    top1 = float((other.argmax(-1) == reference.argmax(-1)).mean())
    return rel, top1


def run_demo(output: Path, *, preset: str = "demo", progress: Any = None) -> Iterator[str]:
    import onnxruntime as ort

    if preset not in DEMO_PRESETS:
        raise BitpressError(f"unknown demo preset {preset!r}; choose one of {', '.join(DEMO_PRESETS)}")
    output = Path(output)
    src = output / "float" / "model.onnx"
    yield f"building a random Llama-like decoder ({preset}) in {src.parent}"
    if not src.exists():
        build_decoder(src, seed=0, **DEMO_PRESETS[preset])
    feeds = random_inputs(src, batch=2, seq=32, seed=1)
    reference = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    registry = get_registry()
    rows = [("algorithm", "precision", "size", "ratio", "time", "logits rel. error", "top-1 agree")]
    size_in = _size(src.parent)
    notes: list[str] = []
    rows.append(("float32", "-", f"{size_in / 1e6:.1f} MB", "1.00x", "-", "0", "100%"))
    timed: list[Path] = [src]
    for algorithm, precision in CANDIDATES:
        try:
            registry.select(algorithm, precision, "onnx")
        except BitpressError:
            continue  # plugin not installed
        dest = output / f"{algorithm}-{precision}"
        t0 = time.perf_counter()
        result = quantize(src, dest, algorithm=algorithm, precision=precision, overwrite=True, progress=progress)
        seconds = time.perf_counter() - t0
        sess = ort.InferenceSession(str(dest / "model.onnx"), providers=["CPUExecutionProvider"])
        rel, top1 = logits_error(reference, sess.run(None, feeds)[0])
        notes += _float_notes(f"{algorithm} {precision}", result.reports)
        rows.append((
            algorithm, precision, f"{result.output_bytes / 1e6:.1f} MB", f"{size_in / result.output_bytes:.2f}x",
            f"{seconds:.2f} s", f"{rel:.4f}", f"{top1:.0%}",
        ))
        timed.append(dest / "model.onnx")
    yield f"timing {len(timed)} models alternately (one token, and 32 tokens at once; one thread)"
    speed = bench(timed, labels=[f"m{i}" for i in range(len(timed))], runs=3, prompt_tokens=32)
    rows = [(*rows[0], "1-token speed", "32-token speed")] + [
        (*row, f"{f.ratios['single']:.2f}x", f"{f.ratios['prompt']:.2f}x")
        for row, f in zip(rows[1:], (speed.get(f"m{i}", 1) for i in range(len(timed))), strict=True)
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        yield "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
    m = speed.machine
    yield (f"speed: calls per second against float32's, median of 3 alternating rounds on {m['cpu']} "
           f"({' '.join(m['flags'])}); the int4 / int8 rows run on ONNX Runtime's packed int8 kernels, nf4 "
           "(MatMulBnb4) dequantizes every weight on every call (docs/speed.md)")
    if notes:
        yield "rows that differ for a reason:"
        yield from notes
    yield f"outputs in {output}/ (inspect one with: bitpress inspect {output}/rtn-int4/model.onnx)"


def _float_notes(label: str, reports: list[tuple[str, Path, Any]]) -> list[str]:
    """What a run left in float and why: the reason a row is larger than its peers."""
    notes = []
    for _, _, report in reports:
        for weight, why in sorted(getattr(report, "skipped", {}).items()):
            notes.append(f"  {label}: {weight} stays float: {why}")
    return notes


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
