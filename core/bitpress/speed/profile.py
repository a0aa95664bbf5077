"""Where the time goes: ONNX Runtime's profiler output, summed per node and per op type."""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


def slowest_nodes(profile_file: str) -> dict[str, Any]:
    """Kernel time per node (``<node>_kernel_time`` events of category ``Node``): the median over the
    profiled runs, so that a first call's one-off work (or a hiccup) does not count.

    Returns ``{"nodes": [{"node", "op", "ms", "share"}...] (slowest first), "ops": {op: {"ms", "share",
    "nodes"}}, "total_ms"}``, times per call. The profile file is deleted.
    """
    path = Path(profile_file)
    try:
        events = json.loads(path.read_text())
    finally:
        try:
            os.remove(path)
            path.parent.rmdir()
        except OSError:
            pass
    durations: dict[str, list[float]] = defaultdict(list)
    op_of: dict[str, str] = {}
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        name = e["name"][: -len("_kernel_time")]
        durations[name].append(float(e.get("dur", 0)) / 1000.0)
        op_of[name] = str((e.get("args") or {}).get("op_name", "?"))
    per_node = {name: statistics.median(d) for name, d in durations.items()}
    total = sum(per_node.values())
    ops: dict[str, dict[str, float]] = {}
    for name, ms in per_node.items():
        entry = ops.setdefault(op_of[name], {"ms": 0.0, "share": 0.0, "nodes": 0})
        entry["ms"] += ms
        entry["nodes"] += 1
    for entry in ops.values():
        entry["share"] = entry["ms"] / total if total else 0.0
    nodes = [{"node": n, "op": op_of[n], "ms": ms, "share": ms / total if total else 0.0}
             for n, ms in sorted(per_node.items(), key=lambda kv: -kv[1])]
    return {"nodes": nodes, "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]["ms"])), "total_ms": total}
