"""The Ray executor against the thread pool, one run: the same quantization, the same bytes, the time each takes.

Writes ``docs/scaling-bench.md`` (``make -C bench ray``; the project's venv runs it). For each model
and algorithm, ``bitpress quantize`` runs twice in its own process (``benchkit.run_measured``: wall
time, peak RSS of the whole process tree, Ray's workers included):

* ``--jobs N``: the thread pool (the default executor);
* ``--executor ray --jobs N``: a private local Ray runtime of N CPUs, started and stopped by the run.

The outputs must be byte-identical (sha256 of every file); the table gives Ray's speed-up over
threads (below 1 means slower) on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchkit

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORK = BENCH / ".work" / "ray"
DOC = ROOT / "docs" / "scaling-bench.md"
BITPRESS = ROOT / ".venv" / "bin" / "bitpress"
MODELS = ("bench-447mb",)
BIG = "bench-4gb"
ALGORITHMS = {"rtn": ["--option", "block_size=32"], "kquant": ["--option", "block_size=32"],
              "hqq": ["--option", "block_size=64"]}


@dataclass
class Row:
    model: str
    algorithm: str
    executor: str
    command: str
    status: str = "-"
    wall_s: float | None = None
    peak_rss: int | None = None
    digest: str | None = None
    identical: bool | None = None
    others_cores: float | None = None  # other processes' CPU use during the best run, in cores
    note: str = ""


def _model(name: str) -> Path:
    from bitpress import synthetic

    folder = BENCH / ".work" / "models" / name
    path = folder / "model.onnx"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        synthetic.build_preset(name, path)
    return path


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode())
            with p.open("rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2, help="threads, and the local Ray runtime's CPUs")
    p.add_argument("--repeats", type=int, default=2, help="runs of each executor (the best time counts)")
    p.add_argument("--big", action="store_true", help=f"also {BIG} (4.6 GB, external data)")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    benchkit.doc_arguments(p, DOC)
    args = p.parse_args(argv)
    log = benchkit.Progress("ray")

    rows: list[Row] = []
    for name in (*MODELS, *((BIG,) if args.big else ())):
        src = _model(name)
        _digest(src.parent)  # the model in the page cache before the first timed run
        for algo in args.algorithms:
            pair: dict[str, Row] = {}
            for rep in range(args.repeats):  # alternating, the best time of each: no order effect
                for executor, extra in (("threads", []), ("ray", ["--executor", "ray"])):
                    out = WORK / "out" / f"{name}-{algo}-{executor}"
                    shutil.rmtree(out, ignore_errors=True)
                    cmd = [str(BITPRESS), "quantize", "-m", str(src), "-o", str(out), "--algorithm", algo,
                           *ALGORITHMS[algo], "--jobs", str(args.jobs), "--no-check", *extra]
                    logfile = WORK / "logs" / f"{name}-{algo}-{executor}.log"
                    log(f"{name} {algo} {executor} (run {rep + 1} of {args.repeats})")
                    m = benchkit.run_measured(cmd, logfile, timeout=3600)
                    row = pair.setdefault(executor, Row(name, algo, executor, shlex.join(cmd)))
                    if m.returncode or not out.exists():
                        row.status, row.note = "failed", benchkit.last_error(logfile)
                    elif row.status != "failed":
                        digest = _digest(out)
                        if row.digest not in (None, digest):
                            row.note = "outputs differ from run to run"
                        row.status, row.digest = "ok", digest
                        if row.wall_s is None or m.wall_s < row.wall_s:
                            row.wall_s, row.others_cores = m.wall_s, m.others_cores
                        row.peak_rss = max(row.peak_rss or 0, m.peak_rss)
                    shutil.rmtree(out, ignore_errors=True)
                    log(f"  {row.status} in {m.wall_s:.1f} s")
            t, r = pair["threads"], pair["ray"]
            if t.digest and r.digest:
                r.identical = t.digest == r.digest
            rows.extend((t, r))
    meta = benchkit.doc_meta("ray_executor.py", args, argv, log, ROOT / ".venv" / "bin" / "python",
                             ("bitpress", "ray", "numpy"), jobs=args.jobs, repeats=args.repeats)
    benchkit.write_report(WORK, args.out, meta, rows, render)
    log(f"wrote {args.out}")
    return 0


def render(meta: dict[str, Any], rows: list[Row]) -> str:
    rows = [r if isinstance(r, Row) else Row(**r) for r in rows]
    table = []
    for i in range(0, len(rows) - 1, 2):
        t, r = rows[i], rows[i + 1]
        speedup = t.wall_s / r.wall_s if t.wall_s and r.wall_s and t.status == r.status == "ok" else None
        table.append([t.model, t.algorithm, benchkit.cell(t.wall_s, ".1f"), benchkit.cell(r.wall_s, ".1f"),
                      benchkit.cell(speedup, ".2f"), benchkit.fmt_bytes(t.peak_rss or 0),
                      benchkit.fmt_bytes(r.peak_rss or 0),
                      "yes" if r.identical else ("NO" if r.identical is False else "-"),
                      f"{benchkit.cell(t.others_cores, '.2f')} / {benchkit.cell(r.others_cores, '.2f')}",
                      "; ".join(x.note for x in (t, r) if x.note)])
    lines = [
        "# The Ray executor against the thread pool", "",
        benchkit.provenance(meta), "",
        f"`bitpress quantize --jobs {meta['jobs']}` (threads) and `--executor ray --jobs {meta['jobs']}` (a private "
        f"local Ray runtime of {meta['jobs']} CPUs, started and stopped inside the run) on the same model, each in its "
        "own process; peak RSS of the whole process tree (Ray's raylet, object store and workers included). "
        "Speed-up: threads' time / Ray's (below 1: Ray is slower). Identical: every output file has the same "
        "sha256. Other load (threads / ray): CPU time, in cores, of processes outside the tool's own waited-for "
        "children during each best run: near 0 for threads says the machine was otherwise quiet; for Ray it is "
        "mostly Ray's own workers and raylet, which the tool does not wait for.", "",
        benchkit.markdown_table(["model", "algorithm", "threads s", "ray s", "speed-up", "threads peak RSS",
                                 "ray peak RSS", "identical", "other load (cores)", "note"], table), "",
        _verdict(table), "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), "",
    ]
    return "\n".join(lines)


def _verdict(table: list[list[str]]) -> str:
    ups = [float(r[4]) for r in table if r[4] != "-"]
    if not ups:
        return "No pair finished on both executors."
    slow = [r for r in table if r[4] != "-" and float(r[4]) < 1]
    fast = [r for r in table if r[4] != "-" and float(r[4]) >= 1]
    if slow and fast:
        slow_s = ", ".join(f"{r[0]} {r[1]}" for r in slow)
        fast_s = ", ".join(f"{r[0]} {r[1]} {r[4]}x" for r in fast)
        return (f"Ray is slower where a run takes seconds ({slow_s}: its runtime's start, a process per worker "
                "and a copy of every result through its object store cost more than the solve) and faster where "
                f"the solves are long ({fast_s}): most likely because its workers are processes, so the parts of a "
                "solver that hold Python's GIL run in parallel, which threads of one process cannot (not measured "
                "on its own). Across machines, more workers (docs/scaling.md).")
    if max(ups) < 1:
        return (f"On this one machine Ray is slower than the thread pool (speed-up {min(ups):.2f} to {max(ups):.2f}): "
                "the solvers are numpy code that already keeps every core busy from threads, and Ray adds its "
                "runtime's start, a process per worker and a copy of every result through its object store. What "
                "it buys is more machines than one (docs/scaling.md).")
    return (f"Speed-up {min(ups):.2f} to {max(ups):.2f} on this one machine; more machines add workers "
            "(docs/scaling.md).")


if __name__ == "__main__":
    sys.exit(main())
