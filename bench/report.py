"""Render ``docs/benchmarks.md`` from every ``.work/results/<suite>.json`` the benchmark scripts wrote.

    ../.venv/bin/python report.py [--output ../docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from benchkit import RESULTS, ROOT, fmt_bytes, fmt_ratio, markdown_table

SUITE_ORDER = ["rtn", "hqq", "kquant"]


def _num(x: Any, spec: str, nan: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return nan
    return format(x, spec)


def _machine(m: dict[str, Any]) -> str:
    return "\n".join([
        f"- CPU: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable by the benchmark)",
        f"- RAM: {m['ram_bytes'] / 2**30:.1f} GiB, no swap in use" if m.get("ram_bytes") else "- RAM: unknown",
        f"- Linux {m['kernel']}, Python {m['python']}",
    ])


def _source(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        src = r.get("source") or {}
        text = f"commit `{src.get('commit', '?')}`"
        if src.get("uncommitted"):
            text += f" plus uncommitted changes to core/ and plugins/ (digest `{src['uncommitted']}`)"
        lines.append(f"Code measured ({r['suite']}): {text}.")
        sides = {t["name"]: t["side"] for t in r["tools"]}
        bp_rows = [row for row in r["rows"] if sides.get(row["tool"]) == "bitpress"]
        sources = {json.dumps(row.get("source"), sort_keys=True) for row in bp_rows}
        if len(sources) > 1:
            lines.append(f"**Warning**: the bitpress rows of {r['suite']} were measured on {len(sources)} different "
                         "versions of the code (partial reruns); rerun the whole suite.")
        elif bp_rows and r.get("source") != bp_rows[0].get("source"):
            bp = bp_rows[0].get("source") or {}
            lines.append(f"The bitpress rows were measured on commit `{bp.get('commit')}`"
                         + (f" plus uncommitted changes (digest `{bp['uncommitted']}`)" if bp.get("uncommitted")
                            else "") + "; the peers' rows do not depend on the bitpress code.")
        if r.get("source_changed_during_run"):
            lines.append(f"**Warning**: the code changed while the {r['suite']} suite ran; rerun it.")
    return "\n".join(lines)


def _versions(results: list[dict[str, Any]]) -> str:
    envs: dict[str, dict[str, str]] = {}
    for r in results:
        for env, pkgs in r.get("versions", {}).items():
            envs.setdefault(env, {}).update(pkgs)
    names = sorted({p for pkgs in envs.values() for p in pkgs})
    cols = list(envs)
    rows = [[p, *(envs[e].get(p, "") for e in cols)] for p in names]
    return markdown_table(["package", *cols], rows)


def _quantized(q: dict[str, Any]) -> str:
    nodes = q.get("quantized_nodes") or {}
    text = f"{nodes.get('MatMulNBits', 0)} / {nodes.get('GatherBlockQuantized', 0)}"
    left = q.get("float_weight_matmuls_left")
    return text + (f" ({left} float)" if left else "")


def _model_table(result: dict[str, Any], model: str) -> str:
    rows = []
    labels = {v["key"]: v["key"] for v in result["variants"]}
    v_order = {v["key"]: i for i, v in enumerate(result["variants"])}
    t_order = {t["name"]: i for i, t in enumerate(result["tools"])}
    for r in sorted(result["rows"], key=lambda r: (v_order.get(r["variant"], 99), t_order.get(r["tool"], 99))):
        if r["model"] != model:
            continue
        q = r.get("quality") or {}
        runs = [x for x in r["runs"] if x["returncode"] == 0]
        if r.get("error") and not runs:
            rows.append([labels.get(r["variant"], r["variant"]), f"**{r['tool']}**" if "bitpress" in r["tool"]
                         else r["tool"], "failed: " + r["error"][:200], *[""] * 10])
            continue
        rows.append([
            labels.get(r["variant"], r["variant"]),
            f"**{r['tool']}**" if r["tool"].startswith("bitpress") else r["tool"],
            _num(r["wall_s"], ".2f"),
            _num(r["wall_median_s"], ".2f"),
            _num(r["cpu_s"], ".2f"),
            fmt_bytes(r["peak_rss"]),
            f"{fmt_bytes(r['peak_anon'])} / {fmt_bytes(r['peak_file'])}",
            fmt_bytes(r["output_bytes"]) if r["output_bytes"] else "-",
            _num(q.get("weight_rel_err"), ".4f"),
            _num(q.get("logits_rel_l2"), ".4f"),
            _num(q.get("top1_agreement"), ".3f"),
            _quantized(q) if q else "-",
            _num(r["others_cores"], ".2f"),
        ])
        if r.get("error"):
            rows[-1][2] += f" (error: {r['error'][:120]})"
    return markdown_table(
        ["variant", "tool", "wall s (best)", "wall s (median)", "CPU s", "peak RSS", "anon / file-backed",
         "output", "weight rel. err", "logits rel. L2", "top-1 agree", "MatMulNBits / GatherBQ", "others' load"],
        rows, "llrrrrrrrrrrr",
    )


def _ratios(result: dict[str, Any]) -> str:
    rows = [[r["model"], r["variant"], r["bitpress"], r["peer"], fmt_ratio(r["speed"]),
             fmt_ratio(r.get("cpu", math.nan)), fmt_ratio(r["rss"]), fmt_ratio(r["size"])]
            for r in result.get("ratios", [])]
    return markdown_table(["model", "variant", "bitpress row", "peer", "faster (peer wall / bitpress wall)",
                           "less CPU (peer CPU s / bitpress CPU s)", "less memory (peer RSS / bitpress RSS)",
                           "smaller output"], rows, "llllrrrr")


def _targets(result: dict[str, Any]) -> str:
    rows = []
    for t in result.get("targets", []):
        value = f"{t['value']:.2f}x" if t["what"] == "speed" else f"{t['value']:.2f} of the model"
        rows.append([t["model"], t["variant"], t["text"], value, "met" if t["met"] else "**missed**"])
    return markdown_table(["model", "variant", "target", "measured", ""], rows, "lllrl")


def _kernels(k: dict[str, Any]) -> list[str]:
    rows = [[r["what"], "sym" if r["symmetric"] else "asym", r["kernel"], f"{r['wall_ms_per_m']:.2f}",
             f"{r['cpu_ms_per_m']:.2f}", "yes" if r["same_bytes"] else "**no**"] for r in k["rows"]]
    src = k.get("source") or {}
    return [
        "## RTN int4 kernels alone",
        "",
        "`bench/bench_kernels.py` (`make -C bench kernels`): the same float32 `[K, N]` bands of about a million "
        f"weights quantized by each kernel in one process, best of {k['repeats']} runs, milliseconds per million "
        f"weights ({k['cores']} cores; ONNX Runtime's kernel runs its own thread pool, the numpy ones one thread). "
        f"Code measured: commit `{src.get('commit', '?')}`"
        + (f" plus uncommitted changes (digest `{src['uncommitted']}`)" if src.get("uncommitted") else "") + ".",
        "",
        markdown_table(["band", "", "kernel", "wall ms / M", "CPU ms / M", "same bytes"], rows, "lllrrl"),
        "",
    ]


def render(results: list[dict[str, Any]]) -> str:
    kernels = [r for r in results if r.get("kind") == "kernels"]
    results = [r for r in results if r.get("kind") != "kernels"]
    first = results[0]
    out = [
        "# Benchmarks",
        "",
        "Produced by `make bench` (root Makefile -> `bench/Makefile` -> `bench/bench_rtn.py`, then "
        "`bench/report.py` renders this file from `bench/.work/results/*.json`). Do not edit by hand: "
        f"rerun `make bench`. Last run: {time.strftime('%Y-%m-%d %H:%M %Z')}.",
        "",
        _source(results),
        "",
        "## Machine",
        "",
        _machine(first["machine"]),
        "",
        "## Versions",
        "",
        "bitpress runs from the project's `.venv`, ONNX Runtime's quantizer from the same venv (it needs "
        "`onnx_ir`), Olive from its own `bench/.venv-olive`.",
        "",
        _versions(results),
        "",
        "## How it is measured",
        "",
        "- Every tool runs in a fresh process, one after the other (runs of different tools interleaved), "
        "on the same model files with a warm page cache (the float model is run once for reference "
        "logits before the timed runs). Outputs and tool caches (Olive's `.olive-cache`) are removed "
        "before every run.",
        "- **wall s (best)**: the fastest of the runs, process start to exit, imports and writing the "
        "output included; **median** beside it. The machine is shared with other work: **others' load** "
        "is how many CPU cores other processes kept busy during the best run (from `/proc/stat`, this "
        "tool's own CPU time subtracted); **CPU s** is user + system time of the tool's process tree "
        "(least of the runs), which contention disturbs less.",
        "- **peak RSS**: the largest resident set of the whole process tree, sampled every 5 ms from "
        "`/proc/<pid>/status`, or the kernel's exact `ru_maxrss` of the largest process if larger (the tool "
        "is started by a few-MB helper so the benchmark's own memory is not inherited by it). "
        "Memory-mapped file pages count: **anon / file-backed** splits the sampled peak into anonymous "
        "memory and file pages (memory-mapped weights, libraries). Median of the runs.",
        "- **output**: bytes on disk of everything the tool wrote.",
        "- **weight rel. err**: `sqrt(sum ||W_deq - W||^2 / sum ||W||^2)` over every quantized weight, "
        "`W_deq` decoded from the output's `MatMulNBits` tensors (the op's documented layout) and, for "
        "`GatherBlockQuantized`, by running the node in ONNX Runtime on every row id.",
        "- **logits rel. L2** `||logits_q - logits||/ ||logits||` and **top-1 agree** (share of positions "
        "whose arg-max token is unchanged) of the quantized vs the float model in ONNX Runtime (CPU) on "
        "the same random `input_ids`.",
        "- **MatMulNBits / GatherBQ**: quantized nodes in the output; `(n float)` counts MatMul/Gemm "
        "nodes that still read a float initializer.",
        "",
    ]
    for result in sorted(results, key=lambda r: SUITE_ORDER.index(r["suite"]) if r["suite"] in SUITE_ORDER
                         else 99):
        out += [f"## {result.get('title', result['suite'])}", "", "Tools:", ""]
        out += [f"- **{t['name']}**: {t['label']}" for t in result["tools"]]
        out.append("")
        for note in result.get("notes", []):
            out += [note, ""]
        for m in result["models"]:
            out += [
                f"### {m['name']} ({fmt_bytes(m['bytes'])})",
                "",
                f"{m['description']}. {m['repeats']} timed run(s) per row; quality on {m['eval']} tokens.",
                "",
                _model_table(result, m["name"]),
                "",
            ]
        if result.get("ratios"):
            out += ["### Ratios", "", "bitpress vs each peer, same model and variant (above 1: bitpress better; "
                    "time = best wall time, memory = peak RSS).", "", _ratios(result), ""]
        if result.get("targets"):
            out += ["### Targets", "", _targets(result), ""]
    for k in kernels:
        out += _kernels(k)
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = p.parse_args()
    results = [json.loads(f.read_text()) for f in sorted(RESULTS.glob("*.json"))]
    if not results:
        print(f"no results in {RESULTS}; run a benchmark first")
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(results))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
