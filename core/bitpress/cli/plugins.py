"""``bitpress plugins`` (the installed plugins) and ``bitpress plugin new NAME`` (start a plugin)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bitpress.cli.common import EXIT_OK, EXIT_USAGE, print_table, registry


def add_plugins(sub: argparse._SubParsersAction) -> None:
    pg = sub.add_parser("plugins", help="installed plugins, versions, broken ones")
    pg.add_argument("--json", action="store_true")
    pg.set_defaults(func=_cmd_plugins)


def add_plugin(sub: argparse._SubParsersAction) -> None:
    plugin = sub.add_parser("plugin", help="tools for plugin authors: `plugin new NAME` starts a plugin")
    plsub = plugin.add_subparsers(dest="plugin_command")
    pn = plsub.add_parser("new", help="write a working weight-only plugin package (pyproject, pass, README, test)")
    pn.add_argument("name", help="the plugin's name: a lowercase identifier (module bitpress_NAME, pass NAME)")
    pn.add_argument("--dir", type=Path, metavar="PATH",
                    help="the folder to create (default: ./bitpress-NAME); must not exist or be empty")
    pn.set_defaults(func=_cmd_plugin_new)
    plugin.set_defaults(func=lambda args: plugin.print_help() or EXIT_USAGE)


def _cmd_plugin_new(args: argparse.Namespace) -> int:
    from bitpress.scaffold import check_plugin_name, new_plugin

    name = check_plugin_name(args.name)
    reg = registry()
    clash = [what for what, taken in (("plugin", reg.plugins), ("pass", reg.passes)) if name in taken]
    if clash:
        print(f"bitpress: warning: {name!r} already names an installed {' and '.join(clash)}; with both "
              "installed, the one loaded second is broken", file=sys.stderr)
    made = new_plugin(name, args.dir)
    print(f"created plugin {name} (distribution bitpress-{name}) in {made.path}")
    for f in made.files:
        print(f"  {f.relative_to(made.path)}")
    print(f"next: pip install -e \"{made.path}[test]\" && python -m pytest -q {made.path}; "
          f"then bitpress passes show {name}")
    return EXIT_OK


def _cmd_plugins(args: argparse.Namespace) -> int:
    reg = registry()
    rows = [
        {"plugin": p.name, "distribution": p.distribution, "version": p.version, "module": p.module,
         "ok": p.ok, "error": p.error, "passes": p.passes}
        for p in reg.plugins.values()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    table = [["PLUGIN", "DISTRIBUTION", "VERSION", "PASSES", "STATUS"]]
    for r in rows:
        table.append([r["plugin"], r["distribution"] or "-", r["version"] or "-",
                      ",".join(r["passes"]) or "-", "ok" if r["ok"] else f"broken: {r['error']}"])
    print_table(table)
    return EXIT_OK
