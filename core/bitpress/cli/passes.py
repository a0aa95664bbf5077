"""``bitpress passes list`` and ``bitpress passes show NAME``: the installed passes."""

from __future__ import annotations

import argparse
import json
from typing import Any

from bitpress.cli.common import EXIT_OK, print_table, registry
from bitpress.options import describe


def add_passes(sub: argparse._SubParsersAction) -> None:
    passes = sub.add_parser("passes", help="list or describe the installed passes")
    psub = passes.add_subparsers(dest="passes_command")
    pl = psub.add_parser("list", help="a table of every pass")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=_cmd_passes_list)
    ps = psub.add_parser("show", help="options, defaults and help of one pass")
    ps.add_argument("name")
    ps.add_argument("--json", action="store_true")
    ps.set_defaults(func=_cmd_passes_show)
    passes.add_argument("--json", action="store_true")
    passes.set_defaults(func=_cmd_passes_list)


def _pass_rows() -> list[dict[str, Any]]:
    from bitpress.envs import where

    reg = registry()
    rows = []
    for cls in sorted(reg.passes.values(), key=lambda c: (c.plugin, c.name)):
        reason = cls.unavailable_reason()
        rows.append({
            "pass": cls.name, "plugin": cls.plugin, "aliases": list(cls.aliases), "algorithms": list(cls.algorithms),
            "precisions": list(cls.precisions), "model_kinds": list(cls.model_kinds),
            "needs_data": cls.needs_data, "own_text_default": cls.own_text_default, "available": reason is None,
            "reason": reason, "summary": cls.summary, "where": where(cls), "experts": getattr(cls, "experts", None),
        })
    for info in reg.broken():
        rows.append({
            "pass": "?", "plugin": info.name, "aliases": [], "algorithms": [], "precisions": [], "model_kinds": [],
            "needs_data": None, "available": False, "reason": f"plugin failed to load: {info.error}",
            "summary": "", "where": "here", "experts": None,
        })
    return rows


def _cmd_passes_list(args: argparse.Namespace) -> int:
    rows = _pass_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    table = [["PASS", "PLUGIN", "ALGORITHMS", "PRECISIONS", "MODELS", "DATA", "EXPERTS", "WHERE", "AVAILABLE"]]
    for r in rows:
        table.append([
            r["pass"], r["plugin"], ",".join(r["algorithms"]), ",".join(r["precisions"]),
            ",".join(r["model_kinds"]), {True: "yes", False: "no", None: "?"}[r["needs_data"]], r["experts"] or "-",
            r["where"],
            "yes" if r["available"] else f"no: {r['reason']}",
        ])
    print_table(table)
    if not rows:
        print("no passes installed; try: pip install \"bitpress[native]\"")
    return EXIT_OK


def _cmd_passes_show(args: argparse.Namespace) -> int:
    from bitpress.envs import where
    from bitpress.options import OptionInfo

    reg = registry()
    cls = reg.pass_named(args.name)  # any case; "did you mean ...?" when there is none
    runs = where(cls)
    entry = getattr(cls, "manifest_entry", None)
    if runs != "here" and entry:
        # a pass of another environment: its option types and defaults as that environment described them
        opts = [OptionInfo(o["name"], o.get("type", "?"), o.get("default"), o.get("help", ""))
                for o in entry.get("options") or []]
    else:
        opts = describe(cls.Options)
    if args.json:
        print(json.dumps({
            "pass": cls.name, "plugin": cls.plugin, "summary": cls.summary, "aliases": list(cls.aliases),
            "algorithms": list(cls.algorithms), "precisions": list(cls.precisions),
            "model_kinds": list(cls.model_kinds), "needs_data": cls.needs_data,
            "own_text_default": cls.own_text_default, "unavailable": cls.unavailable_reason(), "where": runs,
            "options": [{"name": o.name, "type": o.type, "default": o.default, "help": o.help} for o in opts],
            "precision_defaults": {p: cls.precision_defaults(p) for p in cls.precisions} if runs == "here" else {},
        }, indent=2, default=str))
        return EXIT_OK
    print(f"{cls.name} (plugin {cls.plugin}): {cls.summary}")
    if cls.aliases:
        print(f"  also called: {', '.join(cls.aliases)}")
    print(f"  algorithms: {', '.join(cls.algorithms)}   precisions: {', '.join(cls.precisions)}")
    print(f"  models: {', '.join(cls.model_kinds)}   needs data: {'yes' if cls.needs_data else 'no'}   "
          f"mixture-of-experts weights: {getattr(cls, 'experts', None) or 'left as they are'}")
    if runs != "here":
        print(f"  runs in: {runs}")
    reason = cls.unavailable_reason()
    if reason:
        print(f"  unavailable: {reason}")
    print("options:")
    table = [["NAME", "TYPE", "DEFAULT", "HELP"]]
    table += [[o.name, o.type, json.dumps(o.default, default=str), o.help] for o in opts]
    print_table(table, indent="  ")
    for precision in cls.precisions if runs == "here" else ():
        implied = cls.precision_defaults(precision)
        if implied:
            print(f"  --precision {precision} defaults to " + ", ".join(f"{k}={json.dumps(v)}" for k, v in
                                                                       implied.items()) + " (unless given)")
    return EXIT_OK
