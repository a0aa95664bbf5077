"""Where `bitpress quantize` spends its time and memory, phase by phase.

    ../.venv/bin/python profile_bitpress.py [--model bench-447mb] [--option block_size=32 ...]

Runs ``bitpress.quantize`` in this process (the same call the CLI makes) with

* cProfile on every thread (the worker threads that solve tensors included), merged;
* the wall time, CPU time and peak RSS (anon / file-backed) of each phase: load, plan + solve +
  write (the pass), save, check. The kernel's peak counter is reset between phases
  (``/proc/self/clear_refs``), so each phase's peak is its own.

Writes ``.work/profile-<model>.txt`` and prints it.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import io
import os
import pstats
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from benchkit import WORK

PHASES = [  # (module, attribute, phase name); patched where the caller looks the name up
    ("bitpress.models.onnx_model", "OnnxModel.load", "load (parse the .onnx)"),
    ("bitpress.onnx.weightonly.passes", "plan", "pass: plan"),
    ("bitpress.onnx.weightonly.passes", "quantize_weights", "pass: solve + write nodes"),
    ("bitpress.onnx.weightonly.writing", "Writer.finish", "pass: swap nodes"),
    ("onnx.checker", "check_model", "save: check: onnx.checker"),
    ("bitpress.onnx.save", "open_session", "save: check: ORT session"),
    ("bitpress.onnx.save", "check_saved", "save: check (both)"),
    ("bitpress.onnx.save", "save_onnx", "save (incl. check)"),
]


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class Sampler(threading.Thread):
    """Largest RSS (and its anon / file split) seen since the last ``take``."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = (0, 0, 0)
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            s = _status()
            anon = s.get("RssAnon", 0) + s.get("RssShmem", 0)
            total = anon + s.get("RssFile", 0)
            if total > self.peak[0]:
                self.peak = (total, anon, s.get("RssFile", 0))
            time.sleep(0.005)

    def take(self) -> tuple[int, int, int]:
        peak, self.peak = self.peak, (0, 0, 0)
        return peak


def _wrap(phases: list[tuple[str, float, float, int, int, int]], sampler: Sampler, name: str,
          fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = sampler.take()
        _reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            peak, anon, filed = sampler.take()
            hwm = _status().get("VmHWM", 0)
            phases.append((name, wall, cpu, max(peak, hwm), anon, filed))
            sampler.peak = max(sampler.peak, before, (peak, anon, filed))  # the enclosing phase's peak

    return wrapper


def _patch(phases: list, sampler: Sampler) -> None:
    for module_name, attr, label in PHASES:
        module = importlib.import_module(module_name)
        owner: Any = module
        *path, last = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, last)
        if isinstance(owner, type) and isinstance(owner.__dict__.get(last), classmethod):
            wrapped = classmethod(_wrap(phases, sampler, label, original.__func__))
        else:
            wrapped = _wrap(phases, sampler, label, original)
        setattr(owner, last, wrapped)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-447mb")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--no-cprofile", action="store_true", help="phases only (cProfile slows Python code)")
    args = p.parse_args()
    model = WORK / "models" / args.model / "model.onnx"
    if not model.exists():
        print(f"{model} is missing: run the benchmark once (it builds the models)", file=sys.stderr)
        return 2
    out_dir = WORK / "scratch" / f"profile-{args.model}"
    shutil.rmtree(out_dir, ignore_errors=True)
    options = dict(o.split("=", 1) for o in args.option)

    import bitpress

    phases: list[tuple[str, float, float, int, int, int]] = []
    sampler = Sampler()
    sampler.start()
    _patch(phases, sampler)
    profiles: list[cProfile.Profile] = []

    def thread_profiler(*_: Any) -> None:  # first profiler event of each new thread
        prof = cProfile.Profile()
        profiles.append(prof)
        prof.enable()

    main_prof = cProfile.Profile()
    if not args.no_cprofile:
        threading.setprofile(thread_profiler)
        main_prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    _reset_peak()
    bitpress.quantize(model, out_dir, algorithm="rtn", precision="int4", options=options, check=not args.no_check)
    total_wall, total_cpu = time.perf_counter() - t0, time.process_time() - c0
    main_prof.disable()
    threading.setprofile(None)  # type: ignore[arg-type]
    sampler.stop = True

    buf = io.StringIO()
    buf.write(f"bitpress.quantize({model.name} of {args.model}, rtn int4, {options or 'defaults'}) "
              f"in-process: {total_wall:.2f} s wall, {total_cpu:.2f} s CPU, {os.cpu_count()} cores\n\n")
    buf.write(f"{'phase':34} {'wall s':>8} {'CPU s':>8} {'peak RSS':>10} {'anon':>9} {'file':>9}\n")
    for name, wall, cpu, peak, anon, filed in phases:
        buf.write(f"{name:34} {wall:8.2f} {cpu:8.2f} {peak / 1e6:8.0f}MB {anon / 1e6:7.0f}MB {filed / 1e6:7.0f}MB\n")
    if not args.no_cprofile:
        stats = pstats.Stats(main_prof, stream=buf)
        for prof in profiles:
            stats.add(prof)
        stats.strip_dirs()
        buf.write(f"\ncProfile, all {1 + len(profiles)} threads merged, by own time:\n")
        stats.sort_stats("tottime").print_stats(args.top)
    text = buf.getvalue()
    dest = WORK / f"profile-{args.model}.txt"
    dest.write_text(text)
    print(text)
    print(f"wrote {dest}")
    shutil.rmtree(out_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
