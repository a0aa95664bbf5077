"""Hugging Face checkpoint -> ONNX Runtime GenAI package by the real builder, on SmolLM2-135M, one run.

Writes ``docs/genai-bench.md`` (``make -C bench genai``; the project's venv runs it)::

    .venv/bin/python bench/genai.py                 # every row
    .venv/bin/python bench/genai.py --windows 4 --out /tmp/g.md

Rows: the float package (``bitpress export --dtype f32``, the perplexity reference), the
builder's own int4 (``python -m onnxruntime_genai.models.builder -p int4`` on the float folder:
its round-to-nearest, symmetric, block 32), and bitpress checkpoints built into packages by
``hf_to_genai`` (``rtn_hf`` / ``gptq_hf`` int4, block 32, integer zero points; the tied
embedding / LM head table quantized or float). Each build runs in its own process
(``benchkit.run_measured``: wall time, peak RSS); then ``bitpress.evaluate`` (perplexity on the
first ``--windows`` windows of 128 tokens of gensim's ``lee_background.cor``, the KV-cache
package fed an empty past) and one greedy ``onnxruntime_genai`` generation. Calibration text
(``gptq_hf``) is the END of the same file (``bench/gptq.py``'s windows), never evaluated on.
Every package keeps the builder's default ``accuracy_level`` (4 on CPU: int8 activations in
``MatMulNBits``), which depends on the CPU's features (listed in the document).
"""

from __future__ import annotations

import argparse
import json
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
WORK = BENCH / ".work" / "genai"
DOC = ROOT / "docs" / "genai-bench.md"
VENV_BIN = ROOT / ".venv" / "bin"
PROMPT = "The history of the city"
GEN_TOKENS = 16


@dataclass
class Row:
    key: str
    label: str
    status: str = "not run"
    note: str = ""
    wall_s: float | None = None
    peak_rss: int | None = None
    bytes: int | None = None
    perplexity: float | None = None
    change: float | None = None
    top1: float | None = None
    generated: str = ""
    command: str = ""


def _bitpress_cell(passes: list[dict[str, Any]], data: dict[str, Any] | None = None, **genai: Any) -> Any:
    def build(src: Path, out: Path, cfg_dir: Path) -> list[str]:
        cfg: dict[str, Any] = {"input": str(src), "output": str(out),
                               "passes": [*passes, {"type": "hf_to_genai", **genai}]}
        if data:
            cfg["data"] = data
        cfg_dir.mkdir(parents=True, exist_ok=True)
        path = cfg_dir / "run.json"
        path.write_text(json.dumps(cfg, indent=2))
        return [str(VENV_BIN / "bitpress"), "run", str(path)]
    return build


def _builder_int4(src: Path, out: Path, cfg_dir: Path) -> list[str]:
    return [str(VENV_BIN / "python"), "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o",
            str(out / src.name), "-p", "int4", "-e", "cpu", "-c", str(cfg_dir / "cache")]


def rows_spec(calib: Path, tokenizer: Path, samples: int) -> list[tuple[str, str, Any]]:
    rtn = {"type": "rtn_hf", "bits": 4, "group_size": 32, "sym": False}
    data = {"source": str(calib), "tokenizer": str(tokenizer), "samples": samples, "seq_len": gptq.SEQ_LEN}
    return [
        ("float", "float32 package (bitpress export --dtype f32)", _bitpress_cell([])),
        ("builder-int4", "the builder's own int4 (-p int4: RTN, symmetric, block 32; head and tied table too)",
         _builder_int4),
        ("rtn", "bitpress rtn_hf int4 b32 asym, linears (tied table float)", _bitpress_cell([rtn])),
        ("rtn-tied", "bitpress rtn_hf int4 b32 asym + tied table (lm_head, embeds)",
         _bitpress_cell([{**rtn, "lm_head": True, "embeds": True}])),
        ("kquant", "bitpress kquant_hf int4 b32, integer zero points, linears (tied table float)",
         _bitpress_cell([{"type": "kquant_hf", "bits": 4, "group_size": 32, "float_zero_points": False}])),
        ("gptq", "bitpress gptq_hf int4 b32 asym, linears (tied table float)",
         _bitpress_cell([{"type": "gptq_hf", "bits": 4, "group_size": 32, "sym": False}], data)),
        ("mobius-float", "float32 package by mobius (bitpress export --exporter mobius --dtype f32)",
         _bitpress_cell([], exporter="mobius")),
        ("mobius-rtn", "bitpress rtn_hf int4 b32 asym, linears, by mobius", _bitpress_cell([rtn], exporter="mobius")),
        ("mobius-rtn-tied", "bitpress rtn_hf int4 b32 asym + tied table, by mobius",
         _bitpress_cell([{**rtn, "lm_head": True, "embeds": True}], exporter="mobius")),
    ]


def generate(package: Path, tokenizer_dir: Path) -> str:
    from bitpress.calibration.text import load_tokenizer
    from bitpress.genai.export import greedy

    tok = load_tokenizer(tokenizer_dir / "tokenizer.json")
    return tok.decode(greedy(package, tok.encode(PROMPT, add_special_tokens=False).ids, GEN_TOKENS))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=gptq.SAMPLES, help="gptq_hf calibration windows")
    p.add_argument("--windows", type=int, default=gptq.WINDOWS, help="evaluation windows")
    p.add_argument("--only", default="", help="comma-separated row keys")
    benchkit.doc_arguments(p, DOC)
    args = p.parse_args(argv)
    os.environ.update(gptq.OFFLINE)
    log = benchkit.Progress("genai")

    import bitpress

    inputs = quality.locate({"smollm2"})
    c = quality.realmodels()
    hf = quality.fixture_fn(c.smollm2_hf)(quality.fixture_fn(c.smollm2_gguf)(), quality.cache_root())
    win = gptq.make_windows(inputs.text, inputs.smollm2 / "tokenizer.json", args.samples, args.windows)
    shutil.rmtree(WORK / "out", ignore_errors=True)
    rows: list[Row] = []
    packages: dict[str, Path] = {}
    only = {k for k in args.only.split(",") if k}
    for key, label, build in rows_spec(win.calib_text, hf, args.samples):
        if only and key not in only and key != "float":
            continue
        row = Row(key, label)
        out = WORK / "out" / key
        argv_ = build(hf, out, WORK / "cfg" / key)
        row.command = shlex.join(argv_)
        log(f"{key}: {row.command}")
        m = benchkit.run_measured(argv_, WORK / "logs" / f"{key}.log", timeout=3 * 3600)
        row.wall_s, row.peak_rss = m.wall_s, m.peak_rss
        pkg = out / hf.name
        if m.returncode or not (pkg / "genai_config.json").exists():
            row.status = "failed"
            row.note = benchkit.last_error(WORK / "logs" / f"{key}.log")
            log(f"  failed: {row.note}")
            rows.append(row)
            continue
        row.status = "ok"
        packages[key] = pkg
        row.bytes = quality.model_bytes(pkg / "model.onnx")
        if key != "float":
            res = bitpress.evaluate(pkg, packages["float"], text=inputs.text, tokenizer=hf, seq_len=gptq.SEQ_LEN,
                                    max_windows=args.windows, weights=False, threads=None)
            assert res.perplexity is not None
            row.perplexity, row.change = res.perplexity.quantized, res.perplexity.relative_change
            lg = res.logits()
            row.top1 = lg.top1_agreement if lg else None
            rows[0].perplexity = res.perplexity.reference
        row.generated = generate(pkg, hf)
        log(f"  ok in {row.wall_s:.1f} s, {row.bytes / 1e6:.0f} MB, perplexity {row.perplexity}, "
            f"generated {row.generated!r}")
        rows.append(row)
    meta = benchkit.doc_meta("genai.py", args, argv, log, VENV_BIN / "python",
                             ("bitpress", "onnxruntime", "onnxruntime-genai", "transformers", "torch"),
                             windows=args.windows, samples=args.samples)
    benchkit.write_report(WORK, args.out, meta, rows, render)
    log(f"wrote {args.out}")
    return 0


def render(meta: dict[str, Any], rows: list[Row]) -> str:
    c = benchkit.cell
    out = [
        "# GenAI packages from Hugging Face checkpoints: SmolLM2-135M", "",
        benchkit.provenance(meta), "",
        "SmolLM2-135M (the Hugging Face folder of the real-model cache, tied 49152 x 576 table) built into ONNX "
        "Runtime GenAI packages by the real exporters (the model builder; mobius where the row says so). "
        "Perplexity: the first "
        f"{meta['windows']} windows of 128 tokens of gensim's `lee_background.cor`, each package with its KV cache "
        "fed an empty past (`bitpress.evaluate`), against the float package; top-1: agreement of the next-token "
        "argmax with the float (builder) package. Every package keeps its exporter's default `accuracy_level` "
        "(4 on CPU: "
        "`MatMulNBits` with int8 activations, which depends on the CPU flags above). Wall time and peak RSS: "
        "quantizing (if any) and building, in a fresh process.", "",
        "| package | wall s | peak RSS MB | model MB | perplexity | change vs float | top-1 | "
        f"greedy continuation of \"{PROMPT}\" |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gen = r.generated.replace("|", "\\|").replace("\n", " ").strip()
        cells = [r.label, c(r.wall_s, ".1f"), c(None if r.peak_rss is None else r.peak_rss / 1e6, ".0f"),
                 c(None if r.bytes is None else r.bytes / 1e6, ".1f"), c(r.perplexity, ".3f"),
                 "-" if r.change is None else f"{r.change:+.2%}", c(r.top1, ".3f"),
                 gen if r.status == "ok" else f"**{r.status}**: {r.note}"]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Commands:", ""] + [f"- {r.key}: `{r.command}`" for r in rows] + [
        "", "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), ""]
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
