"""``bitpress env create|list|remove|root``: plugin environments of their own (conflicting toolkits)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bitpress.cli.common import EXIT_OK, print_table
from bitpress.errors import UsageError


def add_env(sub: argparse._SubParsersAction) -> None:
    env = sub.add_parser("env", help="virtual environments of their own for plugins (conflicting toolkits)")
    esub = env.add_subparsers(dest="env_command")
    ec = esub.add_parser("create", help="build the environment of a plugin (host + plugin + its toolkit)")
    ec.add_argument("plugin", help="the plugin's name, e.g. quark")
    ec.add_argument("--spec", action="append", default=[], metavar="PIP_SPEC",
                    help="what to pip install instead of the plugin's default (repeatable): a name, a folder, a wheel")
    ec.add_argument("--python", help="base interpreter of the environment (default: this one)")
    ec.add_argument("--force", action="store_true", help="rebuild an environment that exists")
    ec.set_defaults(func=_cmd_env_create)
    el = esub.add_parser("list", help="the environments, their passes and state")
    el.add_argument("--json", action="store_true")
    el.set_defaults(func=_cmd_env_list)
    er = esub.add_parser("remove", help="delete the environment of a plugin")
    er.add_argument("plugin")
    er.set_defaults(func=_cmd_env_remove)
    eroot = esub.add_parser("root", help="where the environments live; record a folder for this Python environment")
    eroot.add_argument("path", nargs="?", type=Path,
                       help="record this folder as the environments' root of the running Python environment")
    eroot.add_argument("--unset", action="store_true", help="remove the recorded root (back to the default)")
    eroot.add_argument("--json", action="store_true")
    eroot.set_defaults(func=_cmd_env_root)
    env.add_argument("--json", action="store_true")
    env.set_defaults(func=_cmd_env_list)


def _cmd_env_create(args: argparse.Namespace) -> int:
    import time

    from bitpress.envs import create_env, envs_root

    start = time.perf_counter()
    print(f"building the environment for {args.plugin} in {envs_root()} (pip's output follows; "
          "large toolkits take minutes)", file=sys.stderr)
    info = create_env(args.plugin, args.spec or None, args.python, force=args.force,
                      echo=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    passes = ", ".join(info.passes) or "none"
    print(f"created environment {info.name} at {info.path} in {time.perf_counter() - start:.0f} s; passes: {passes}")
    return EXIT_OK


def _cmd_env_list(args: argparse.Namespace) -> int:
    from bitpress.envs import list_envs, locate_envs_root

    root = locate_envs_root()
    rows = [e.to_json() for e in list_envs(root.path)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    if not rows:
        print(f"no plugin environments in {root.path} ({root.describe()}); "
              "create one with: bitpress env create PLUGIN")
        return EXIT_OK
    print(f"environments in {root.path} ({root.describe()})")
    table = [["ENV", "PASSES", "PYTHON", "HOST", "CREATED", "STATUS", "PATH"]]
    for r in rows:
        table.append([r["env"], ",".join(r["passes"]) or "-", r["python_version"] or "?", r["host_version"] or "?",
                      r["created"] or "?", f"broken: {r['problem']}" if r["problem"] else "ok", r["path"]])
    print_table(table)
    return EXIT_OK


def _cmd_env_root(args: argparse.Namespace) -> int:
    from bitpress.envs import locate_envs_root, record_envs_root

    if args.unset and args.path is not None:
        raise UsageError("env root: give a PATH to record or --unset, not both")
    if args.unset or args.path is not None:
        record = record_envs_root(None if args.unset else args.path)
        if not args.json:
            print(f"removed {record}" if args.unset else f"recorded {args.path.expanduser().absolute()} in {record}")
    root = locate_envs_root()
    if args.json:
        print(json.dumps({"root": str(root.path), "source": root.source,
                          "record": str(root.record) if root.record else None}, indent=2))
    else:
        print(f"{root.path} ({root.describe()})")
    return EXIT_OK


def _cmd_env_remove(args: argparse.Namespace) -> int:
    from bitpress.envs import remove_env

    path = remove_env(args.plugin)
    print(f"removed environment {args.plugin} ({path})")
    return EXIT_OK
