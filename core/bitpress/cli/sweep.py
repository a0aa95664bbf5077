"""``bitpress sweep CONFIG``: every model x pass x grid point, in parallel, and the size / error Pareto front."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bitpress.cli.common import EXIT_FAIL, EXIT_OK, progress
from bitpress.errors import UsageError


def add_sweep(sub: argparse._SubParsersAction) -> None:
    sw = sub.add_parser("sweep", help="every model x pass x grid point of a config, in parallel: outputs, "
                                      "errors and the size / error Pareto front (report.html)")
    sw.add_argument("config", type=Path, help="YAML or JSON: models, passes, grid, eval, output (see docs/sweep.md)")
    sw.add_argument("-o", "--output", type=Path, help="the sweep's folder (default: the config's output)")
    sw.add_argument("--executor", choices=("threads", "ray"),
                    help="threads: each job in a child process here (default); ray: each job a Ray task")
    sw.add_argument("--address", help="ray: the cluster to join (auto, ray://HOST:PORT); implies --executor ray "
                                      "(default: a local Ray runtime)")
    sw.add_argument("--jobs", type=int, help="jobs at once (default: the config's jobs, else half the cores; "
                                             "ray: the local runtime's CPUs)")
    sw.add_argument("--fresh", action="store_true", help="rerun every job, also those results.jsonl has as done")
    sw.add_argument("--json", action="store_true", help="print the result as JSON")
    sw.set_defaults(func=_cmd_sweep)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from bitpress.api import sweep

    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs: expected a positive number of jobs at once, got {args.jobs}")
    res = sweep(args.config, output=args.output, executor=args.executor, address=args.address, jobs=args.jobs,
                fresh=args.fresh, progress=progress)
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
    else:
        from bitpress.sweep.report import METRIC_TITLES, X_TITLES, number

        print(f"sweep: {len(res.rows)} job(s): {res.ran} run, {res.skipped} skipped (done before), "
              f"{len(res.failed)} failed; {res.seconds:.1f} s")
        unit = "bpw" if res.x_metric == "bits_per_weight" else "bytes"
        if res.pareto:
            print(f"Pareto-optimal ({X_TITLES[res.x_metric]} vs {METRIC_TITLES.get(res.metric, res.metric)}):")
        for name, rows in res.pareto.items():
            best = sorted(rows, key=lambda r: number(r.get(res.x_metric)) or 0.0)
            text = ", ".join(
                f"{r['label']} ({number(r.get(res.x_metric)) or 0:.4g} {unit}, "
                f"{number((r.get('metrics') or {}).get(res.metric)) or 0:.3g})" for r in best)
            print(f"  {name}: {text}")
        for r in res.failed:
            print(f"  failed {r['id']} ({r['label']}, {res.names.get(r['model'], r['model'])}): {r['error']}")
        print(f"report: {res.report}  rows: {res.results}")
    if res.failed:
        print(f"bitpress: error: {len(res.failed)} of {len(res.rows)} job(s) failed (their reasons are in "
              f"{res.results}); fix them and rerun: the jobs done are skipped", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK
