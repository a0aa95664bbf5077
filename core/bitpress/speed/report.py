"""The figures of a ``bitpress bench`` run: medians, ratios to the reference, the machine they came from."""

from __future__ import annotations

import contextlib
import math
import os
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from bitpress.speed.runner import Subject, median, spread

#: the CPU flags that decide which ONNX Runtime kernels run (int8 dot products, AVX-512, AMX)
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8",
                "amx_bf16", "asimddp", "i8mm", "sve")


def machine() -> dict[str, Any]:
    """What the figures depend on: CPU model and flags, cores, load, library versions."""
    from bitpress.cpu import cpu_flags

    cpu = cpu_flags()
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for dist in ("bitpress", "onnxruntime", "onnxruntime-genai"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    return {"cpu": model, "flags": [f for f in KERNEL_FLAGS if f in cpu.flags], "cores": os.cpu_count(),
            "load": _load(), "versions": versions}


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


@dataclass
class Figures:
    """One model at one thread count."""

    label: str
    path: str
    kind: str
    threads: int
    bytes: int
    load_s: float
    rss_after_load: int
    peak_rss: int
    prompt_tokens_per_s: float
    #: genai: decode tokens/s (one generated token per step); onnx: calls/s at batch 1 (one token)
    token_per_s: float
    single_ms: float
    prompt_spread: float
    token_spread: float
    runs: int
    #: ratios to the reference (the first model of the same kind): prompt, token, bytes, peak RSS
    ratios: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["decode_tokens_per_s" if self.kind == "genai" else "single_tokens_per_s"] = d.pop("token_per_s")
        return {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v) for k, v in d.items()}


@dataclass
class SpeedReport:
    options: dict[str, Any]
    machine: dict[str, Any]
    figures: list[Figures]
    profile: dict[str, Any] = field(default_factory=dict)
    load_after: float | None = None

    def reference(self, kind: str) -> str | None:
        return next((f.label for f in self.figures if f.kind == kind), None)

    def get(self, label: str, threads: int) -> Figures | None:
        return next((f for f in self.figures if f.label == label and f.threads == threads), None)

    def to_json(self) -> dict[str, Any]:
        return {"options": self.options, "machine": {**self.machine, "load_after": self.load_after},
                "references": {k: self.reference(k) for k in ("genai", "onnx") if self.reference(k)},
                "results": [f.to_json() for f in self.figures], "profile": self.profile}


def build(subjects: list[Subject], raw: dict[int, dict[str, Any]], options: dict[str, Any],
          facts: dict[str, Any], profiled: dict[str, Any] | None = None) -> SpeedReport:
    """Medians and ratios from the raw samples of :func:`bitpress.speed.runner.run`."""
    prompt_tokens = int(options["prompt_tokens"])
    figures = []
    for threads, per_model in raw.items():
        refs: dict[str, Figures] = {}
        for s in subjects:
            r = per_model[s.label]
            samples = r["samples"]
            prompt = [prompt_tokens / x["prompt_s"] for x in samples]
            if s.kind == "genai":
                token = [1.0 / x["decode_step_s"] for x in samples]
                single_ms = median([x["decode_step_s"] for x in samples]) * 1e3
            else:
                token = [1.0 / x["single_s"] for x in samples]
                single_ms = median([x["single_s"] for x in samples]) * 1e3
            f = Figures(s.label, str(s.path), s.kind, threads, s.bytes, r["load_s"], r["rss_after_load"],
                        r.get("peak_rss", 0), median(prompt), median(token), single_ms, spread(prompt),
                        spread(token), len(samples))
            ref = refs.setdefault(s.kind, f)
            f.ratios = {
                "prompt": f.prompt_tokens_per_s / ref.prompt_tokens_per_s,
                "decode" if s.kind == "genai" else "single": f.token_per_s / ref.token_per_s,
                "bytes": f.bytes / ref.bytes if ref.bytes else float("nan"),
                "peak_rss": f.peak_rss / ref.peak_rss if ref.peak_rss else float("nan"),
            }
            figures.append(f)
    return SpeedReport(options, facts, figures, profiled or {}, _load())


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def lines(report: SpeedReport, top: int = 10) -> list[str]:
    """The report as text: per thread count a table, ratios to the reference; then the profile."""
    m = report.machine
    out = [f"machine: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['flags']) or '-'}; load "
           f"{m['load']} before, {report.load_after} after; "
           + ", ".join(f"{k} {v}" for k, v in m["versions"].items())]
    o = report.options
    out.append(f"each figure: median of {o['runs']} rounds after {o['warmup']} warm-up, models alternating; "
               f"prompt {o['prompt_tokens']} tokens, decode {o['decode_tokens']} tokens")
    for threads in dict.fromkeys(f.threads for f in report.figures):
        rows = [f for f in report.figures if f.threads == threads]
        out.append("")
        out.append(f"{threads} thread{'s' if threads > 1 else ''}:")
        table = [["MODEL", "KIND", "SIZE", "LOAD", "PEAK RSS", "PROMPT tok/s", "x", "TOKEN tok/s", "x", "ms/token",
                  "spread"]]
        for f in rows:
            key = "decode" if f.kind == "genai" else "single"
            table.append([f.label, f.kind, _mb(f.bytes), f"{f.load_s:.2f} s", _mb(f.peak_rss),
                          f"{f.prompt_tokens_per_s:.1f}", f"{f.ratios['prompt']:.2f}", f"{f.token_per_s:.1f}",
                          f"{f.ratios[key]:.2f}", f"{f.single_ms:.2f}",
                          f"{100 * max(f.prompt_spread, f.token_spread):.0f}%"])
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        out += ["  " + "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in
                                 enumerate(zip(r, widths, strict=True))) for r in table]
    refs = {k: report.reference(k) for k in ("genai", "onnx") if report.reference(k)}
    out.append("")
    out.append("x: ratio to " + "; ".join(f"{ref} ({kind})" for kind, ref in refs.items())
               + ". TOKEN: decode tokens/s for GenAI packages, one-token calls/s for ONNX models "
               "(after a cache of the prompt's length for KV-cache decoders).")
    for label, prof in report.profile.items():
        out.append("")
        out.append(f"where the time goes, {label} (one token, {prof.get('total_ms', 0):.2f} ms of kernels per call):")
        for op, entry in list(prof.get("ops", {}).items())[:6]:
            out.append(f"  {op:<24} {100 * entry['share']:5.1f}%  {entry['ms']:8.3f} ms  {int(entry['nodes'])} nodes")
        out.append("  slowest nodes:")
        for n in prof.get("nodes", [])[:top]:
            kernel = f"  [{n['kernel']}]" if n.get("kernel") else ""
            out.append(f"  {n['share'] * 100:5.1f}%  {n['ms']:8.3f} ms  {n['op']:<20} {n['node']}{kernel}")
    return out
