"""QuaRot and SpinQuant on a Hugging Face checkpoint, then RTN or GPTQ: perplexity and speed of the GenAI packages.

Writes ``docs/rotation-hf-bench.md`` (``make -C bench rotation-hf``; about 25 minutes on 2 cores)::

    .venv/bin/python bench/rotation_hf.py [--steps 50]

SmolLM2-135M-Instruct as a Hugging Face folder (the real-model test cache, ``bench/quality.py``'s
``locate``), int4 block 64 asymmetric on every linear and on the tied embedding / LM head table
(``lm_head: true, embeds: true``). Each row runs one workflow (rotation, quantizer, ``hf_to_genai``
with the GenAI builder) and is measured by ``bitpress.evaluate`` against the builder's fp32 package of
the float folder, as the other benches: perplexity on the first windows of ``lee_background.cor``,
prompt and decode tokens/s against float, one thread. Calibration (GPTQ, SpinQuant's training):
Python's documentation (``pydoc_data.topics``, out of domain), bitpress's defaults (half of the
windows the model's own text).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import benchkit
import calibration_text
import quality

BENCH = Path(__file__).resolve().parent
WORK = BENCH / ".work" / "rotation-hf"
OUT = BENCH.parent / "docs" / "rotation-hf-bench.md"
SEQ_LEN = quality.SEQ_LEN
WINDOWS = quality.WINDOWS
SAMPLES = 32
QUANT = {"bits": 4, "group_size": 64, "sym": False, "lm_head": True, "embeds": True}


def rows(steps: int) -> list[tuple[str, list[dict[str, Any]], str]]:
    spin = {"type": "SpinQuant", "w_bits": 4, "w_group_size": 64, "w_symmetric": False,
            "training_args": {"max_steps": steps}}
    spin_identity = {**spin, "rotate_mode": "identity"}
    folded = {**spin_identity, "training_args": {"max_steps": 0}}  # the norms folded, no rotation at all
    quarot = {"type": "QuaRot"}
    out = []
    for quantizer in ("rtn_hf", "gptq_hf"):
        q = {"type": quantizer, **QUANT}
        short = quantizer.removesuffix("_hf")
        out += [(short, [q], quantizer), (f"norms folded, no rotation + {short}", [folded, q], quantizer),
                (f"quarot + {short}", [quarot, q], quantizer),
                (f"spinquant from hadamard + {short}", [spin, q], quantizer),
                (f"spinquant from identity + {short}", [spin_identity, q], quantizer)]
    return out


class _Training(logging.Handler):
    """Keeps the last SpinQuant training summary the run logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        match = re.search(r"KL to the float model .*?\) ([0-9.]+) -> ([0-9.]+)", text)
        if match:
            self.last = f"{match.group(1)} -> {match.group(2)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50, help="SpinQuant's training steps")
    ap.add_argument("--command", default="python bench/rotation_hf.py")
    args = ap.parse_args(argv)
    import bitpress

    inputs = quality.locate({"smollm2"})
    c = quality.realmodels()
    src = quality.fixture_fn(c.smollm2_hf)(quality.fixture_fn(c.smollm2_gguf)(), quality.cache_root())
    reference, text = inputs.smollm2, inputs.text  # the builder's fp32 package of that folder
    docs = calibration_text.python_docs(WORK / "python-docs.txt")
    data = {"source": str(docs), "samples": SAMPLES, "seq_len": SEQ_LEN, "tokenizer": str(src / "tokenizer.json")}
    results = []
    ppl_float = None
    training = _Training()
    spin_log = logging.getLogger("bitpress_rotate.spinquant")
    spin_log.setLevel(logging.INFO)
    spin_log.addHandler(training)
    for label, passes, quantizer in rows(args.steps):
        out = WORK / "out"
        shutil.rmtree(out, ignore_errors=True)
        config: dict[str, Any] = {"input": str(src), "output": str(out), "passes": [*passes, {"type": "hf_to_genai"}]}
        if quantizer == "gptq_hf" or any(p["type"] == "SpinQuant" for p in passes):
            config["data"] = data
        training.last = None
        t0 = time.perf_counter()
        bitpress.run(config)
        seconds = time.perf_counter() - t0
        package = out / src.name
        res = bitpress.evaluate(package, reference, text=text, seq_len=SEQ_LEN, max_windows=WINDOWS, weights=False,
                                threads=1, speed=True)
        ppl = res.perplexity
        assert ppl is not None
        ppl_float = ppl.reference
        ratios = (res.speed or {}).get("ratios", {})
        size = sum(f.stat().st_size for f in package.rglob("*.onnx*"))
        results.append((label, ppl.quantized, ppl.relative_change, seconds, size, ratios.get("prompt"),
                        ratios.get("decode"), training.last))
        print(f"{label}: perplexity {ppl.quantized:.2f} ({ppl.relative_change:+.2%}), {seconds:.0f} s, "
              f"{size / 1e6:.1f} MB, prompt {ratios.get('prompt')}, decode {ratios.get('decode')}", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    by = {r[0]: r for r in results}
    flags, _ = benchkit.simd_flags()
    lines = [
        "# QuaRot and SpinQuant on a Hugging Face checkpoint, then RTN or GPTQ",
        "",
        f"Generated by `bench/rotation_hf.py` (`{args.command}`) on {benchkit.utc_now()}; do not edit by hand. "
        f"CPU: {quality.cpu_name()}; flags {' '.join(flags)}.",
        "",
        "SmolLM2-135M-Instruct (Hugging Face folder), int4, block 64 (the checkpoint the builder reads has no "
        "padding, and 576 is no multiple of 128), asymmetric, every linear and the tied "
        f"embedding / LM head table; each row is one workflow (rotation, quantizer, `hf_to_genai` with the GenAI "
        f"builder) measured by `bitpress.evaluate` against the builder's fp32 package of the float folder: "
        f"perplexity on the first {WINDOWS} windows of {SEQ_LEN} tokens of `lee_background.cor` (float: "
        f"{ppl_float:.2f}); prompt and decode tokens/s against float, one thread. Calibration (GPTQ and "
        f"SpinQuant's training): {SAMPLES} windows of {SEQ_LEN} tokens of Python's documentation (out of domain), "
        "half of them replaced by the model's own text (bitpress's default, [calibrated.md](calibrated.md)). "
        "QuaRot: randomized Hadamard, seed 0, value heads rotated. SpinQuant: from the same start or from no "
        f"rotation (`rotate_mode: identity`), {args.steps} Cayley steps (learning rate 0.05 decaying to 0, 4 "
        "windows a step) trained for int4 block 64 asymmetric weights; **training KL**: its loss on 8 "
        "calibration windows before -> after. *norms folded, no rotation*: what every rotation does first (each "
        "norm's scale moved into the weights that read it), alone (SpinQuant from identity, 0 steps). All keep "
        "the tied table one, with one float 576 x 576 product before the head ([rotation.md](rotation.md)). "
        "**recovered**: the share of the RTN row's perplexity increase taken back. "
        f"**workflow s**: wall time of the whole workflow, build included, on {os.cpu_count()} cores (load average "
        f"{load:.1f} at the end).",
        "",
        "| method | perplexity | change | recovered | size MB | prompt vs float | decode vs float | workflow s | "
        "training KL |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    rtn_change = by["rtn"][2]
    for label, p, change, seconds, size, prompt, decode, kl in results:
        rec = "-" if label == "rtn" else f"{1 - change / rtn_change:.0%}"
        fmt = (lambda x: "-" if x is None else f"{x:.2f}x")  # noqa: E731
        lines.append(f"| {label} | {p:.2f} | {change:+.1%} | {rec} | {size / 1e6:.1f} | {fmt(prompt)} | "
                     f"{fmt(decode)} | {seconds:.0f} | {kl or '-'} |")
    return benchkit.write_doc(OUT, lines)


if __name__ == "__main__":
    raise SystemExit(main())
