"""``bitpress demo``: build a small model, quantize it, report size, time and error."""

from __future__ import annotations

import argparse
from pathlib import Path

from bitpress.cli.common import EXIT_OK, progress


def add_demo(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="build a small model, quantize it, report size/time/error")
    d.add_argument("--output", type=Path, default=Path("demo-out"))
    d.add_argument("--preset", default="demo")
    d.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from bitpress.demo import run_demo

    for line in run_demo(args.output, preset=args.preset, progress=progress):
        print(line)
    return EXIT_OK
