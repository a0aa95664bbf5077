"""rtn_hf on a synthetic ~8 GB sharded Llama-shaped checkpoint: streaming against the whole model, one run.

Writes ``docs/hf-streaming-bench.md`` (``make -C bench hf-streaming``; the project's venv runs it).

The checkpoint (``bench/.work/hf-streaming/ckpt``) is generated, not downloaded: a Llama config
whose layer count gives about ``--size-gb`` of float32 weights, random normal weights written
tensor by tensor into ~2 GB shards with ``model.safetensors.index.json`` (bitpress's own streaming
safetensors writer, so the generator never holds more than one tensor; no torch model is built).
It is reused by later runs of the same size.

Then ``bitpress quantize --algorithm rtn_hf --precision int4`` runs twice, each in a fresh process
(``benchkit.run_measured``: wall time, peak RSS of the process tree, sampled and the kernel's
``ru_maxrss``): streaming (the default) and ``--option stream=false`` (the whole model loaded
by transformers). The two outputs are compared file by file (sha256). ``--clean`` deletes the
checkpoint and both outputs afterwards.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchkit
import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORK = BENCH / ".work" / "hf-streaming"
DOC = ROOT / "docs" / "hf-streaming-bench.md"
VENV_BIN = ROOT / ".venv" / "bin"
SHARD_BYTES = 2 * 10**9
#: Llama-shaped, TinyLlama-like widths; the layer count sets the size
SHAPE = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
         "num_key_value_heads": 4, "max_position_embeddings": 2048}


@dataclass
class Row:
    key: str
    label: str
    command: str = ""
    status: str = "not run"
    note: str = ""
    wall_s: float | None = None
    peak_rss: int | None = None
    kernel_maxrss: int | None = None
    peak_anon: int | None = None
    peak_file: int | None = None
    bytes: int | None = None


def _tensors(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv = h // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def layers_for(size_gb: float) -> int:
    per_layer = sum(int(np.prod(s)) for _, s in _tensors(1)) - sum(int(np.prod(s)) for _, s in _tensors(0))
    fixed = sum(int(np.prod(s)) for _, s in _tensors(0))
    return max(1, round((size_gb * 1e9 / 4 - fixed) / per_layer))


def build_checkpoint(folder: Path, layers: int, log: Any) -> int:
    """The synthetic float32 checkpoint at ``folder`` (reused when complete); returns its weight bytes."""
    from transformers import LlamaConfig

    from bitpress.hf.safetensors_writer import Entry, SafetensorsWriter, plan_shards, shard_names, write_index

    entries = [Entry(n, "F32", s) for n, s in _tensors(layers)]
    total = sum(e.nbytes for e in entries)
    done = folder.with_name(folder.name + ".complete")  # beside it: a file inside would be copied as a companion
    if done.exists() and done.read_text() == str(total):
        log(f"reusing {folder} ({total / 1e9:.2f} GB)")
        return total
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg = LlamaConfig(**SHAPE, num_hidden_layers=layers, tie_word_embeddings=False, dtype="float32")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 2048}\n')
    shards = plan_shards([[e] for e in entries], SHARD_BYTES)
    names = shard_names(len(shards))
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for shard, name in zip(shards, names, strict=True):
        with SafetensorsWriter(folder / name, shard, {"format": "pt"}) as w:
            for e in shard:
                if e.name.endswith("norm.weight"):
                    w.write(e.name, np.ones(e.shape, np.float32))
                    continue
                rows = e.shape[0]
                step = max(1, (64 << 20) // (4 * e.shape[1]))  # 64 MB of rows at a time
                for r0 in range(0, rows, step):
                    block = rng.standard_normal((min(rows, r0 + step) - r0, e.shape[1]), np.float32)
                    block *= 0.02
                    w.write(e.name, block, r0 * e.shape[1] * 4)
        log(f"  wrote {name} ({sum(e.nbytes for e in shard) / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s)")
    if len(shards) > 1:
        write_index(folder, shards, names)
    done.write_text(str(total))
    return total


def digest(folder: Path) -> dict[str, str]:
    out = {}
    for f in sorted(folder.iterdir()):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while chunk := fh.read(16 << 20):
                h.update(chunk)
        out[f.name] = h.hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=8.0, help="float32 weights of the synthetic checkpoint")
    p.add_argument("--jobs", type=int, default=None, help="worker threads (default: all cores)")
    p.add_argument("--clean", action="store_true", help="delete the checkpoint and the outputs afterwards")
    benchkit.doc_arguments(p, DOC)
    args = p.parse_args(argv)
    log = benchkit.Progress("hf-streaming")

    layers = layers_for(args.size_gb)
    ckpt = WORK / "ckpt"
    log(f"checkpoint: {layers} layers, ~{args.size_gb:g} GB float32")
    ckpt_bytes = build_checkpoint(ckpt, layers, log)
    shards = sorted(ckpt.glob("*.safetensors"))
    rows: list[Row] = []
    outputs: dict[str, Path] = {}
    for key, label, extra in [("stream", "streaming (default)", []),
                              ("memory", "whole model (`stream=false`)", ["--option", "stream=false"])]:
        out = WORK / "out" / key
        shutil.rmtree(out, ignore_errors=True)
        cmd = [str(VENV_BIN / "bitpress"), "quantize", "-m", str(ckpt), "-o", str(out), "--algorithm", "rtn_hf",
               "--precision", "int4", *extra, *(["--jobs", str(args.jobs)] if args.jobs else [])]
        row = Row(key, label, shlex.join(cmd))
        log(f"{key}: {row.command}")
        m = benchkit.run_measured(cmd, WORK / "logs" / f"{key}.log", timeout=7200)
        row.wall_s, row.peak_rss, row.kernel_maxrss = m.wall_s, m.peak_rss, m.kernel_maxrss
        row.peak_anon, row.peak_file = m.peak_anon, m.peak_file
        if m.returncode or not (out / ckpt.name).is_dir():
            row.status, row.note = "failed", benchkit.last_error(WORK / "logs" / f"{key}.log")
        else:
            row.status, row.bytes = "ok", benchkit.tree_size(out / ckpt.name)
            outputs[key] = out / ckpt.name
        log(f"  {row.status} in {row.wall_s:.1f} s, peak RSS {row.peak_rss / 1e9:.2f} GB")
        rows.append(row)
    identical = None
    if len(outputs) == 2:
        identical = digest(outputs["stream"]) == digest(outputs["memory"])
        log(f"outputs identical: {identical}")
    meta = benchkit.doc_meta("hf_streaming.py", args, argv, log, VENV_BIN / "python",
                             ("bitpress", "torch", "transformers", "safetensors"),
                             layers=layers, shape=SHAPE, checkpoint_bytes=ckpt_bytes, shards=len(shards),
                             identical=identical, jobs=args.jobs,
                             config=json.loads((ckpt / "config.json").read_text()).get("model_type"))
    benchkit.write_report(WORK, args.out, meta, rows, render)
    log(f"wrote {args.out}")
    if args.clean:
        shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.with_name(ckpt.name + ".complete").unlink(missing_ok=True)
        shutil.rmtree(WORK / "out", ignore_errors=True)
        log("removed the checkpoint and the outputs (--clean)")
    return 0 if all(r.status == "ok" for r in rows) and identical else 1


def render(meta: dict[str, Any], rows: list[Row]) -> str:
    c = benchkit.cell
    size = meta["checkpoint_bytes"]
    s = meta["shape"]
    by = {r.key: r for r in rows}
    out = [
        f"# Streaming Hugging Face quantization: rtn_hf on a synthetic {size / 1e9:.0f} GB checkpoint", "",
        benchkit.provenance(meta), "",
        f"Input: a synthetic Llama-shaped float32 checkpoint ({meta['layers']} layers, hidden {s['hidden_size']}, "
        f"intermediate {s['intermediate_size']}, {s['num_attention_heads']} heads / {s['num_key_value_heads']} KV "
        f"heads, vocab {s['vocab_size']}, untied head; random normal weights), {size / 1e9:.2f} GB in "
        + (f"{meta['shards']} shards with `model.safetensors.index.json`" if meta["shards"] > 1 else "one file")
        + ". Each run: `bitpress quantize --algorithm "
        "rtn_hf --precision int4` (group 128, symmetric, linears only) in a fresh process; peak RSS of its "
        "process tree (the larger of the sampled total and the kernel's `ru_maxrss`), its anonymous and "
        "file-backed parts at the sampled peak. The checkpoint was just written, so both runs read it from the "
        "page cache.", "",
        "| path | wall s | peak RSS GB | peak RSS / checkpoint | anonymous GB | file-backed GB | output GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        frac = None if r.peak_rss is None else r.peak_rss / size
        cells = [r.label, c(r.wall_s, ".1f"), c(None if r.peak_rss is None else r.peak_rss / 1e9, ".2f"),
                 c(frac, ".3f"), c(None if r.peak_anon is None else r.peak_anon / 1e9, ".2f"),
                 c(None if r.peak_file is None else r.peak_file / 1e9, ".2f"),
                 c(None if r.bytes is None else r.bytes / 1e9, ".2f") if r.status == "ok"
                 else f"**{r.status}**: {r.note}"]
        out.append("| " + " | ".join(cells) + " |")
    st, mem = by.get("stream"), by.get("memory")
    if st and mem and st.wall_s and mem.wall_s and st.peak_rss and mem.peak_rss:
        out += ["", f"Streaming: peak RSS {st.peak_rss / size:.1%} of the checkpoint (goal: under 25%), "
                f"{st.peak_rss / mem.peak_rss:.1%} of the whole-model path's; time {st.wall_s / mem.wall_s:.2f}x "
                "the whole-model path's."]
    verdict = {True: "identical", False: "**different**", None: "not compared"}[meta["identical"]]
    out += ["", f"Outputs (every file, sha256): {verdict}.", "", "Commands:", ""]
    out += [f"- {r.key}: `{r.command}`" for r in rows]
    out += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), ""]
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
