"""How fast a model runs: ``bitpress bench`` and the speed figures of eval, sweeps and publish.

Speed is measured like size and error: in ONNX Runtime (plain ``.onnx`` models: latency at one
token and at a prompt-sized batch) and in ONNX Runtime GenAI (packages: prompt and decode tokens
per second), each model in a process of its own (load time, peak resident memory), several
models alternately in one run so that machine noise falls on all of them: the ratios are the
result, the absolute figures come labelled with the CPU's flags and load
(:mod:`bitpress.speed.runner`). ``profile`` adds where the time goes: the slowest nodes by ONNX
Runtime's profiler, each with the kernel :mod:`bitpress.onnx.kernels` says it runs on.

May import: cpu, errors, genai, onnx.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bitpress.errors import BitpressError
from bitpress.speed.measure import kind_of
from bitpress.speed.report import Figures, SpeedReport, build, lines, machine
from bitpress.speed.runner import SpeedOptions, Subject, resolve_onnx, run, run_profile, subjects_of


def bench(
    models: list[str | Path], *, labels: list[str] | None = None, threads: list[int] | None = None, runs: int = 5,
    warmup: int = 1, prompt_tokens: int = 128, decode_tokens: int = 32, profile_nodes: int = 0,
    progress: Callable[[str], None] | None = None,
) -> SpeedReport:
    """Measure ``models`` (``.onnx`` files or GenAI package folders) alternately; ratios to the first of each kind."""
    options = SpeedOptions(threads=list(threads or [1]), runs=runs, warmup=warmup, prompt_tokens=prompt_tokens,
                           decode_tokens=decode_tokens, profile=profile_nodes)
    options.validate()
    subjects = subjects_of(models, labels)
    facts = machine()
    raw = run(subjects, options, progress)
    profiled = _with_kernels(subjects, run_profile(subjects, options, progress)) if profile_nodes else None
    return build(subjects, raw, asdict(options), facts, profiled)


def compare(quantized: str | Path, reference: str | Path, *, threads: int = 1, runs: int = 3, warmup: int = 1,
            prompt_tokens: int = 128, decode_tokens: int = 16,
            progress: Callable[[str], None] | None = None) -> dict:
    """A quantized model's speed against its float reference, measured alternately: the figures of both
    (JSON-ready) and the quantized model's ratios. What ``bitpress eval``, sweeps and publish record.

    Two GenAI packages are timed through ``onnxruntime_genai`` (prompt and decode tokens/s); when that
    cannot load them, or for anything else, their ``.onnx`` models through ONNX Runtime sessions (one
    token, a prompt-sized batch), with a ``note`` saying why.
    """
    paths = [Path(quantized), Path(reference)]
    note = None
    if {kind_of(p) for p in paths} != {"genai"}:
        paths = [resolve_onnx(p) for p in paths]  # a file and a package: both through a session
    options = {"threads": [threads], "runs": runs, "warmup": warmup, "prompt_tokens": prompt_tokens,
               "decode_tokens": decode_tokens, "progress": progress}
    try:
        report = bench([paths[1], paths[0]], labels=["reference", "quantized"], **options)
    except BitpressError as exc:
        if kind_of(paths[0]) != "genai":
            raise
        note = f"onnxruntime_genai could not run the packages ({exc}); their models were timed in sessions"
        paths = [resolve_onnx(p) for p in paths]
        report = bench([paths[1], paths[0]], labels=["reference", "quantized"], **options)
    ref, q = (report.get(label, threads) for label in ("reference", "quantized"))
    assert ref is not None and q is not None
    out = {"kind": q.kind, "threads": threads, "runs": runs, "prompt_tokens": prompt_tokens,
           "decode_tokens": decode_tokens, "machine": {**report.machine, "load_after": report.load_after},
           "quantized": q.to_json(), "reference": ref.to_json(),
           "ratios": {k: round(v, 4) for k, v in q.ratios.items()}}
    if note:
        out["note"] = note
    return out


def summary_line(speed: dict) -> str:
    """``decode 3.42x the reference (89.1 vs 26.0 tokens/s), prompt 0.92x (...); 1 thread, AMD EPYC ...``"""
    q, r, ratio = speed["quantized"], speed["reference"], speed["ratios"]
    if speed["kind"] == "genai":
        token = (f"decode {ratio['decode']:.2f}x the reference ({q['decode_tokens_per_s']:.1f} vs "
                 f"{r['decode_tokens_per_s']:.1f} tokens/s)")
    else:
        token = (f"one token {ratio['single']:.2f}x the reference ({q['single_ms']:.2f} vs {r['single_ms']:.2f} "
                 "ms per call)")
    m = speed["machine"]
    return (f"{token}, prompt {ratio['prompt']:.2f}x ({q['prompt_tokens_per_s']:.0f} vs "
            f"{r['prompt_tokens_per_s']:.0f} tokens/s), peak memory {ratio['peak_rss']:.2f}x; "
            f"{speed['threads']} thread(s), median of {speed['runs']} alternating rounds on {m['cpu']} "
            f"({' '.join(m['flags'])}; load {m['load']})")


def _with_kernels(subjects: list[Subject], profiled: dict[str, dict]) -> dict[str, dict]:
    """Each profiled node's kernel (packed int8, dequantize every call, ...), from the graph."""
    import onnx

    from bitpress.onnx.kernels import graph_paths

    for s in subjects:
        prof = profiled.get(s.label)
        if not prof:
            continue
        graph = onnx.load(str(s.model_file), load_external_data=False).graph
        paths = graph_paths(graph).paths
        for n in prof.get("nodes", []):
            p = paths.get(n["node"])
            if p is not None:
                n["kernel"] = p.label
    return profiled


__all__ = ["Figures", "SpeedOptions", "SpeedReport", "bench", "compare", "lines", "machine", "summary_line"]
