"""``bitpress inspect MODEL``: op counts, weights by dtype, quantized nodes, the checker's result."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bitpress.cli.common import EXIT_OK, mb


def add_inspect(sub: argparse._SubParsersAction) -> None:
    i = sub.add_parser("inspect", help="op counts, weights by dtype, quantized nodes, checker result")
    i.add_argument("model", type=Path)
    i.add_argument("--json", action="store_true")
    i.add_argument("--no-check", action="store_true", help="skip the ONNX checker")
    i.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from bitpress.api import load_model
    from bitpress.inspect_model import inspect_path

    reports = inspect_path(load_model(args.model), check=not args.no_check)
    if args.json:
        print(json.dumps(reports if len(reports) > 1 else reports[0], indent=2))
        return EXIT_OK
    for rep in reports:
        if "nodes" not in rep:  # another kind of model (a plugin's): its own lines, or its kind
            print(f"{rep['model']}: {rep['kind']} model")
            for line in rep.get("lines", []):
                print(f"  {line}")
            continue
        print(f"{rep['model']}: {rep['nodes']} nodes, checker: {rep['checker']}")
        print("  opsets: " + ", ".join(f"{k} {v}" for k, v in rep["opsets"].items()))
        print("  ops: " + ", ".join(f"{k} x{v}" for k, v in rep["ops"].items()))
        if rep["quantized_nodes"]:
            print("  quantized: " + ", ".join(f"{k} x{v}" for k, v in rep["quantized_nodes"].items()))
        for e in rep.get("experts", []):
            how = (f"{e['bits']}-bit, block {e['block_size']}, {'uint8' if e['zero_points'] else 'no'} zero points, "
                   f"accuracy_level {e['accuracy_level']} ({e['kernel']})" if e["op"] == "QMoE" else
                   f"{e.get('dtype') or 'float'}, not quantized")
            print(f"  experts: {e['node']}: {e['op']}, {e['experts']} experts (top {e['top_k']}, {e['activation']}, "
                  f"hidden {e['hidden']}): {how}")
        print("  weights: " + ", ".join(f"{k} {mb(v)}" for k, v in rep["weight_bytes_by_dtype"].items()))
        if rep["external_data"]:
            print("  external data: " + ", ".join(f"{k} ({mb(v)})" for k, v in rep["external_data"].items()))
    return EXIT_OK
