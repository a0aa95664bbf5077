"""The ``bitpress`` command line. Only this module prints; the library logs."""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bitpress import __version__, crashwatch
from bitpress.errors import BitpressError, Interrupted, UsageError, ValidationError
from bitpress.interrupts import Caught, handle_signals
from bitpress.options import describe

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    if args.json and not getattr(args, "json_output", False):
        command = " ".join(str(getattr(args, k)) for k in vars(args) if k.endswith("command") and getattr(args, k))
        print(f"bitpress: error: `bitpress {command}` has no JSON output (--json)", file=sys.stderr)
        return EXIT_USAGE
    caught = Caught()  # the first signal; an interrupt can surface as another error (see Caught)
    # plugins run in this process: a native crash in one prints Python's stack and a line naming it
    crashwatch.enable()
    try:
        with handle_signals(caught):  # SIGINT, SIGTERM, SIGHUP raise Interrupted: the library's cleanup runs
            return int(args.func(args) or 0)
    except BitpressError as exc:
        if caught.signum is not None:
            return _interrupted(Interrupted(caught.signum), args.verbose, exc)
        if args.verbose:
            logging.getLogger("bitpress").exception("failed")
        print(f"bitpress: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        return _interrupted(exc, args.verbose)
    except Exception as exc:
        if caught.signum is not None:
            return _interrupted(Interrupted(caught.signum), args.verbose, exc)
        if args.verbose:
            raise
        print(f"bitpress: internal error: {type(exc).__name__}: {exc} (rerun with --verbose)", file=sys.stderr)
        return EXIT_FAIL
    finally:
        crashwatch.disable()


def _interrupted(exc: KeyboardInterrupt, verbose: bool, surfaced: BaseException | None = None) -> int:
    """One line for a run stopped by a signal; exit code 128 + the signal's number."""
    if surfaced is not None and verbose:  # the interrupt came out of library code as this error
        logging.getLogger("bitpress").debug("interrupted; it surfaced as:", exc_info=surfaced)
    signum = exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT)
    name = exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"
    written = getattr(exc, "written", None)
    done = f"{written} had been written completely" if written is not None else "nothing was written"
    print(f"bitpress: interrupted by {name}; {done}", file=sys.stderr)
    return 128 + signum


# -- argument parsing -----------------------------------------------------------------------------
#: flags of the whole command line, accepted before and after the (sub)command's name
_GLOBAL_FLAGS = ("-v", "--verbose", "--json")


class _Parser(argparse.ArgumentParser):
    """The parser of ``bitpress`` and, through ``add_subparsers``, of every (nested) subcommand.

    Every subcommand accepts ``-v/--verbose`` after its name (``bitpress quantize ... -v``,
    ``bitpress passes list -v``); a subcommand that prints JSON declares ``--json`` itself.
    In subcommands both default to ``argparse.SUPPRESS``, so a flag given before the
    subcommand (``bitpress -v passes list``) is not overwritten by the subcommand's default.
    """

    def __init__(self, *args: Any, root: bool = False, **kwargs: Any) -> None:
        self._root = root  # set first: the base class adds -h through add_argument
        super().__init__(*args, **kwargs)
        self.add_argument("-v", "--verbose", action="store_true", help="debug logs and tracebacks")
        if root:
            self.add_argument("--json", action="store_true",
                              help="print the result as JSON (commands that have a JSON output)")

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        if not self._root and any(a in _GLOBAL_FLAGS for a in args):
            kwargs["default"] = argparse.SUPPRESS
            if "--json" in args:
                self.set_defaults(json_output=True)  # checked in main(): `bitpress --json demo` is refused
                kwargs.setdefault("help", "print the result as JSON")
        return super().add_argument(*args, **kwargs)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bitpress", description="Quantize models with pluggable backends.", root=True)
    p.add_argument("--version", action="version", version=f"bitpress {__version__}")
    sub = p.add_subparsers(dest="command")

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

    pg = sub.add_parser("plugins", help="installed plugins, versions, broken ones")
    pg.add_argument("--json", action="store_true")
    pg.set_defaults(func=_cmd_plugins)

    plugin = sub.add_parser("plugin", help="tools for plugin authors: `plugin new NAME` starts a plugin")
    plsub = plugin.add_subparsers(dest="plugin_command")
    pn = plsub.add_parser("new", help="write a working weight-only plugin package (pyproject, pass, README, test)")
    pn.add_argument("name", help="the plugin's name: a lowercase identifier (module bitpress_NAME, pass NAME)")
    pn.add_argument("--dir", type=Path, metavar="PATH",
                    help="the folder to create (default: ./bitpress-NAME); must not exist or be empty")
    pn.set_defaults(func=_cmd_plugin_new)
    plugin.set_defaults(func=lambda args: plugin.print_help() or EXIT_USAGE)

    q = sub.add_parser("quantize", help="quantize a model with one pass")
    q.add_argument("-m", "--model", required=True, type=Path, help=".onnx file or ONNX folder")
    q.add_argument("-o", "--output", required=True, type=Path,
                   help="output .onnx file, or a folder (mirrors the input's name / layout)")
    q.add_argument("--algorithm", required=True, help="e.g. rtn, hqq, kquant (see `passes list`)")
    q.add_argument("--precision", help="e.g. int4, int8, nf4")
    q.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a pass option; repeatable (see `passes show NAME`)")
    _add_run_args(q)
    q.add_argument("--components", nargs="+", help="sub-models of a folder to quantize (default: decoder)")
    q.add_argument("--save-config", type=Path, metavar="FILE",
                   help="also write the equivalent workflow config (YAML, or JSON for a .json name): "
                        "`bitpress run FILE` repeats the run")
    q.set_defaults(func=_cmd_quantize)

    x = sub.add_parser("export", help="a Hugging Face model (float or quantized) to ONNX or an ONNX Runtime "
                                      "GenAI package")
    x.add_argument("model", type=Path, help="a Hugging Face folder (float, or written by a bitpress *_hf pass), "
                                            "or a .gguf file (bitpress[gguf])")
    x.add_argument("-o", "--output", required=True, type=Path, help="output folder (mirrors the input's name)")
    x.add_argument("--runtime", choices=("genai", "onnx"), default="genai",
                   help="genai: a GenAI package by a real exporter (KV cache, genai_config.json); onnx: bitpress's "
                        "own graph without KV cache (hf_to_onnx)")
    x.add_argument("--exporter", choices=("builder", "mobius"), default="builder",
                   help="genai: builder (python -m onnxruntime_genai.models.builder) or mobius (mobius build)")
    x.add_argument("--dtype", choices=("auto", "f32", "f16", "bf16"), default="auto",
                   help="genai: weights and activations (auto: f32; the builder: float checkpoints only)")
    x.add_argument("--ep", default="cpu", help="genai: execution provider (builder: cpu, cuda, dml, webgpu, "
                                                "NvTensorRtRtx; mobius: default, cpu, cuda, dml, webgpu, trt-rtx, ...)")
    x.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the export pass (see `passes show hf_to_genai`); repeatable")
    x.add_argument("--overwrite", action="store_true", help="replace an existing output")
    x.add_argument("--json", action="store_true", help="print the result as JSON")
    x.set_defaults(func=_cmd_export)

    pb = sub.add_parser("publish", help="one Hugging Face model to a tree of GenAI packages: every dtype x EP "
                                        "and quantized variant of the config's matrix")
    pb.add_argument("config", type=Path, help="YAML or JSON: input, output, matrix (see docs/publishing.md)")
    pb.add_argument("--overwrite", action="store_true", help="replace cells that exist")
    pb.add_argument("--json", action="store_true", help="print the result as JSON")
    pb.set_defaults(func=_cmd_publish)

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

    v = sub.add_parser("verify", help="check a package against its bitpress-manifest.json (missing, truncated or "
                                      "changed files)")
    v.add_argument("folder", type=Path)
    v.add_argument("--json", action="store_true", help="print the result as JSON")
    v.set_defaults(func=_cmd_verify)

    r = sub.add_parser("run", help="run a workflow config (JSON or YAML)")
    r.add_argument("config", type=Path)
    _add_run_args(r)
    r.set_defaults(func=_cmd_run)

    i = sub.add_parser("inspect", help="op counts, weights by dtype, quantized nodes, checker result")
    i.add_argument("model", type=Path)
    i.add_argument("--json", action="store_true")
    i.add_argument("--no-check", action="store_true", help="skip the ONNX checker")
    i.set_defaults(func=_cmd_inspect)

    ev = sub.add_parser("eval", help="compare a quantized model with its float reference (errors, perplexity, SQNR)")
    ev.add_argument("quantized", type=Path, help="the quantized .onnx file or ONNX folder")
    ev.add_argument("--reference", required=True, type=Path, help="the float .onnx file or folder it came from")
    ev.add_argument("--data", help="inputs to compare on: random (default), a .npz file or folder, a .txt (tokenizer)")
    ev.add_argument("--samples", type=int, default=8, help="model runs to compare (default 8)")
    ev.add_argument("--seq-len", type=int, default=128, help="tokens per sample / perplexity window (default 128)")
    ev.add_argument("--batch", type=int, default=1, help="samples per run (default 1)")
    ev.add_argument("--seed", type=int, default=0, help="seed of random inputs (default 0)")
    ev.add_argument("--text", type=Path, help="text file: perplexity of both models on it (needs a tokenizer)")
    ev.add_argument("--tokenizer", help="tokenizer.json or its folder (default: the models' folders)")
    ev.add_argument("--max-windows", type=int, help="perplexity on at most this many windows (default: all)")
    ev.add_argument("--jobs", type=int, default=1, help="ONNX Runtime intra-op threads (default 1)")
    ev.add_argument("--threads", dest="jobs", type=int, action=_Deprecated, replacement="--jobs",
                    help=argparse.SUPPRESS)  # the old name, still accepted
    ev.add_argument("--no-weights", action="store_true", help="skip the per-tensor weight error (SQNR)")
    ev.add_argument("--no-speed", action="store_true",
                    help="skip timing both models (prompt / decode tokens per second, alternating rounds)")
    ev.add_argument("--speed-runs", type=int, default=3, help="timed rounds per model, after a warm-up (default 3)")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.add_argument("--html", type=Path, metavar="REPORT.html", help="also write a self-contained HTML report")
    ev.set_defaults(func=_cmd_eval)

    bn = sub.add_parser("bench", help="how fast models run: prompt and decode tokens/s (GenAI packages), latency "
                        "at one token and a prompt-sized batch (ONNX), load time, peak memory; models alternate")
    bn.add_argument("models", nargs="+", type=Path, metavar="MODEL",
                    help=".onnx files or ONNX Runtime GenAI package folders; ratios are to the first of each kind")
    bn.add_argument("--label", action="append", dest="labels", metavar="NAME",
                    help="a name per model, in order (default: the file or folder name)")
    bn.add_argument("--jobs", type=_int_list, default=[1], metavar="N[,N...]",
                    help="ONNX Runtime intra-op threads, e.g. 1,2: each count measured in turn (default 1)")
    bn.add_argument("--runs", type=int, default=5, help="measured rounds; figures are their medians (default 5)")
    bn.add_argument("--warmup", type=int, default=1, help="rounds run first and discarded (default 1)")
    bn.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    bn.add_argument("--decode-tokens", type=int, default=32, help="generated tokens per round (default 32)")
    bn.add_argument("--profile", type=int, nargs="?", const=10, default=0, metavar="N",
                    help="also show where the time goes: the N slowest nodes (default 10) by ONNX Runtime's "
                         "profiler, at one token, with the kernel each quantized node runs on")
    bn.add_argument("--json", action="store_true", help="print the result as JSON")
    bn.set_defaults(func=_cmd_bench)

    d = sub.add_parser("demo", help="build a small model, quantize it, report size/time/error")
    d.add_argument("--output", type=Path, default=Path("demo-out"))
    d.add_argument("--preset", default="demo")
    d.set_defaults(func=_cmd_demo)
    return p


class _Deprecated(argparse.Action):
    """An old option name that still works: stores like its replacement and says so on stderr."""

    def __init__(self, *args: Any, replacement: str, **kwargs: Any) -> None:
        self.replacement = replacement
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"bitpress: warning: {option_string} is deprecated; use {self.replacement}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=int, help="worker threads (default: all cores); with --executor ray and no "
                   "--address, the CPUs of the local Ray runtime")
    p.add_argument("--executor", choices=("threads", "ray"),
                   help="where per-tensor work runs: threads here (default) or Ray tasks (bitpress[ray])")
    p.add_argument("--address", help="with --executor ray: the cluster to join (auto, ray://HOST:PORT); "
                   "default: a local Ray runtime for this run")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    ext = p.add_mutually_exclusive_group()
    ext.add_argument("--external-data", dest="external_data", action="store_true", default=None,
                     help="always write weights to <model>.onnx.data (default: as the input, or when over 2 GB)")
    ext.add_argument("--single-file", dest="external_data", action="store_false",
                     help="always write one .onnx file (models under 2 GB)")
    p.add_argument("--max-shard-size", type=_size, help="split external data, e.g. 2GB, 500MB")
    p.add_argument("--no-check", action="store_true",
                   help="skip the ONNX checker and ONNX Runtime load after saving")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plan", action="store_true",
                   help="dry run: what would happen to every weight (bits, block size, ties, skips and why, "
                        "expected bits per weight); nothing is written")
    p.add_argument("--show-weights", action="store_true",
                   help="after the run, print the per-weight table with each weight's measured error")
    p.add_argument("--env-timeout", type=float, metavar="SECONDS",
                   help="kill a pass running in a plugin environment after this long (default: none)")
    p.add_argument("--isolate", action="store_true",
                   help="run each pass in a worker process of this environment: a native crash (abort, "
                        "segfault) is then a clean error and writes nothing")
    d = p.add_argument_group("calibration data (passes that need or use it)")
    d.add_argument("--data", help="random, a .npz file or folder of .npz, or a .txt file (with a tokenizer)")
    d.add_argument("--samples", type=int, default=8, help="calibration samples (default 8)")
    d.add_argument("--seq-len", type=int, default=128, help="tokens per text sample (default 128)")
    d.add_argument("--tokenizer", help="tokenizer.json (or its folder) for text data; default: the model's folder")


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 500MB)")
    unit = (m.group(2) or "").upper().replace("I", "").rstrip("B")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    return int(float(m.group(1)) * scale)


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("bitpress")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)
    root.propagate = False


def _progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    from tqdm import tqdm

    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, leave=False,
                disable=not sys.stderr.isatty(), **kwargs)


# -- commands --------------------------------------------------------------------------------------
def _registry():
    from bitpress.plugins import get_registry

    return get_registry()


def _pass_rows() -> list[dict[str, Any]]:
    from bitpress.envs import where

    reg = _registry()
    rows = []
    for cls in sorted(reg.passes.values(), key=lambda c: (c.plugin, c.name)):
        reason = cls.unavailable_reason()
        rows.append({
            "pass": cls.name, "plugin": cls.plugin, "aliases": list(cls.aliases), "algorithms": list(cls.algorithms),
            "precisions": list(cls.precisions), "model_kinds": list(cls.model_kinds),
            "needs_data": cls.needs_data, "available": reason is None, "reason": reason,
            "summary": cls.summary, "where": where(cls),
        })
    for info in reg.broken():
        rows.append({
            "pass": "?", "plugin": info.name, "aliases": [], "algorithms": [], "precisions": [], "model_kinds": [],
            "needs_data": None, "available": False, "reason": f"plugin failed to load: {info.error}",
            "summary": "", "where": "here",
        })
    return rows


def _cmd_passes_list(args: argparse.Namespace) -> int:
    rows = _pass_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    table = [["PASS", "PLUGIN", "ALGORITHMS", "PRECISIONS", "MODELS", "DATA", "WHERE", "AVAILABLE"]]
    for r in rows:
        table.append([
            r["pass"], r["plugin"], ",".join(r["algorithms"]), ",".join(r["precisions"]),
            ",".join(r["model_kinds"]), {True: "yes", False: "no", None: "?"}[r["needs_data"]], r["where"],
            "yes" if r["available"] else f"no: {r['reason']}",
        ])
    _print_table(table)
    if not rows:
        print("no passes installed; try: pip install \"bitpress[native]\"")
    return EXIT_OK


def _cmd_passes_show(args: argparse.Namespace) -> int:
    from bitpress.envs import where
    from bitpress.options import OptionInfo

    reg = _registry()
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
            "unavailable": cls.unavailable_reason(), "where": runs,
            "options": [{"name": o.name, "type": o.type, "default": o.default, "help": o.help} for o in opts],
            "precision_defaults": {p: cls.precision_defaults(p) for p in cls.precisions} if runs == "here" else {},
        }, indent=2, default=str))
        return EXIT_OK
    print(f"{cls.name} (plugin {cls.plugin}): {cls.summary}")
    if cls.aliases:
        print(f"  also called: {', '.join(cls.aliases)}")
    print(f"  algorithms: {', '.join(cls.algorithms)}   precisions: {', '.join(cls.precisions)}")
    print(f"  models: {', '.join(cls.model_kinds)}   needs data: {'yes' if cls.needs_data else 'no'}")
    if runs != "here":
        print(f"  runs in: {runs}")
    reason = cls.unavailable_reason()
    if reason:
        print(f"  unavailable: {reason}")
    print("options:")
    table = [["NAME", "TYPE", "DEFAULT", "HELP"]]
    table += [[o.name, o.type, json.dumps(o.default, default=str), o.help] for o in opts]
    _print_table(table, indent="  ")
    for precision in cls.precisions if runs == "here" else ():
        implied = cls.precision_defaults(precision)
        if implied:
            print(f"  --precision {precision} defaults to " + ", ".join(f"{k}={json.dumps(v)}" for k, v in
                                                                       implied.items()) + " (unless given)")
    return EXIT_OK


def _cmd_plugin_new(args: argparse.Namespace) -> int:
    from bitpress.scaffold import check_plugin_name, new_plugin

    name = check_plugin_name(args.name)
    reg = _registry()
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
    reg = _registry()
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
    _print_table(table)
    return EXIT_OK


def _parse_kv(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--option expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


def _cmd_quantize(args: argparse.Namespace) -> int:
    from bitpress.api import quantize

    if args.plan:
        from bitpress.dry_run import plan_quantize

        return _show_plan(plan_quantize(args.model, algorithm=args.algorithm, precision=args.precision,
                                        options=_parse_kv(args.option), components=args.components,
                                        strict=False), args.json)
    result = quantize(
        args.model, args.output, algorithm=args.algorithm, precision=args.precision,
        options=_parse_kv(args.option), strict=False, components=args.components, jobs=args.jobs,
        overwrite=args.overwrite, external_data=args.external_data,
        max_shard_size=args.max_shard_size, check=not args.no_check, data=_data(args), progress=_progress,
        env_timeout=args.env_timeout, save_config=args.save_config, isolate=args.isolate,
        executor=_executor(args),
    )
    _report(result, args.json, args.show_weights)
    return EXIT_OK


def _cmd_export(args: argparse.Namespace) -> int:
    from bitpress.api import run

    step: dict[str, Any] = {"type": "hf_to_onnx"}
    if Path(args.model).suffix.lower() == ".gguf":  # the gguf plugin's conversion (bitpress[gguf])
        if args.runtime != "genai" or args.exporter != "builder" or args.dtype != "auto":
            raise UsageError("a .gguf file is exported as a GenAI package by gguf_to_genai: only --ep and --option")
        step = {"type": "gguf_to_genai", "ep": args.ep}
    elif args.runtime == "genai":
        step = {"type": "hf_to_genai", "exporter": args.exporter, "dtype": args.dtype, "ep": args.ep}
    elif args.dtype != "auto" or args.ep != "cpu" or args.exporter != "builder":
        raise UsageError("--exporter, --dtype and --ep apply to --runtime genai")
    step.update(_typed_options(step["type"], _parse_kv(args.option)))
    result = run({"input": str(args.model), "output": str(args.output), "passes": [step]},
                 overwrite=args.overwrite or None, progress=_progress)
    _report(result, args.json)
    return EXIT_OK


def _cmd_publish(args: argparse.Namespace) -> int:
    from bitpress.publish import INDEX, load_publish_config, publish

    res = publish(load_publish_config(args.config), overwrite=args.overwrite, progress=_progress)
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
    else:
        for c in res.cells:
            line = f"  {c.folder:<28} {c.status:<7} {c.seconds:6.1f} s"
            if c.eval and c.eval.get("perplexity") is not None:
                line += f"  perplexity {c.eval['perplexity']:.3f} ({c.eval['perplexity_change']:+.2%})"
            print(line + (f"  {c.reason}" if c.reason else ""))
        ok = len(res.cells) - len(res.failed)
        print(f"wrote {ok} of {len(res.cells)} packages under {res.output} (index: {res.output / INDEX})")
    if res.failed:
        print(f"bitpress: error: {len(res.failed)} cell(s) failed: {', '.join(c.folder for c in res.failed)}",
              file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def _cmd_sweep(args: argparse.Namespace) -> int:
    from bitpress.api import sweep

    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs: expected a positive number of jobs at once, got {args.jobs}")
    res = sweep(args.config, output=args.output, executor=args.executor, address=args.address, jobs=args.jobs,
                fresh=args.fresh, progress=_progress)
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


def _cmd_verify(args: argparse.Namespace) -> int:
    from bitpress.manifest import MANIFEST, verify

    res = verify(args.folder)
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
        return EXIT_OK if res.ok else EXIT_FAIL
    if not res.ok:
        raise ValidationError(f"{args.folder} does not match its {MANIFEST}: " + "; ".join(res.problems()))
    print(f"{args.folder}: {res.checked} files ({_mb(res.bytes)}) match {MANIFEST}")
    if res.unlisted:
        print(f"note: {len(res.unlisted)} file(s) the manifest does not list: {', '.join(res.unlisted[:5])}")
    return EXIT_OK


def _typed_options(pass_name: str, values: dict[str, str]) -> dict[str, Any]:
    """``--option`` strings parsed as the pass's option types (as ``quantize --option`` does)."""
    from typing import get_type_hints

    from bitpress.options import coerce
    from bitpress.plugins import get_registry

    hints = get_type_hints(get_registry().get_pass(pass_name).Options)
    out: dict[str, Any] = {}
    for key, value in values.items():
        try:
            out[key] = coerce(value, hints[key]) if key in hints else value  # unknown: the pass says so
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--option {key}: {exc}") from None
    return out


def _executor(args: argparse.Namespace) -> Any:
    """``--executor`` / ``--address`` as an executor setting (None: the config's, or threads)."""
    from bitpress.errors import UsageError

    if args.address and args.executor != "ray":
        raise UsageError("--address needs --executor ray")
    if args.executor is None:
        return None
    return {"type": args.executor, **({"address": args.address} if args.address else {})}


def _cmd_run(args: argparse.Namespace) -> int:
    from bitpress.api import run

    if args.plan:
        from bitpress.dry_run import plan_run

        return _show_plan(plan_run(args.config), args.json)
    # the flags override the config's settings; those not given leave them as the config says
    result = run(
        args.config, overwrite=True if args.overwrite else None, jobs=args.jobs, external_data=args.external_data,
        max_shard_size=args.max_shard_size, check=False if args.no_check else None, data=_data(args),
        env_timeout=args.env_timeout, progress=_progress, isolate=args.isolate, executor=_executor(args),
    )
    _report(result, args.json, args.show_weights)
    return EXIT_OK


def _show_plan(result: Any, as_json: bool) -> int:
    from bitpress.dry_run import plan_lines

    if as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        for line in plan_lines(result):
            print(line)
    return EXIT_OK


def _data(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.data:
        return None
    return {"source": args.data, "samples": args.samples, "seq_len": args.seq_len, "tokenizer": args.tokenizer}


def _report(result: Any, as_json: bool, show_weights: bool = False) -> None:
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    from bitpress.dry_run import weight_table_lines

    total = sum(result.seconds.values())
    # the ratio is over the models (.onnx + external data); tokenizer and config files are counted apart
    model_out = result.output_model_bytes if result.output_model_bytes is not None else result.output_bytes
    model_in = result.input_model_bytes if result.input_model_bytes is not None else result.input_bytes
    extra = f" + {_mb(result.companion_bytes)} of companion files" if result.companion_bytes else ""
    print(f"wrote {result.output} ({_mb(model_out)} of model{extra}; the model is {result.ratio:.2f}x smaller "
          f"than {_mb(model_in)}) in {total:.1f} s")
    for name, src, rep in result.reports:
        summary = rep.summary() if hasattr(rep, "summary") else str(rep)
        print(f"  {name} on {Path(src).name}: {summary}")
        if show_weights:
            for line in weight_table_lines(rep):
                print(f"    {line}")
    for where, paths in getattr(result, "runtime", []):
        print(f"  runs on ({paths.target}, {where}): {paths.summary()}")
    for f in result.files:
        print(f"  {f}")
    for note in result.notes:
        print(f"note: {note}")
    for name, src, rep in result.reports:
        if getattr(rep, "quantized", None) == 0:
            print(f"warning: {name} quantized no weights of {Path(src).name}; its weights are the input's, "
                  "in float (see the patterns above, or --plan)")


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
    _print_table(table)
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
        print("  weights: " + ", ".join(f"{k} {_mb(v)}" for k, v in rep["weight_bytes_by_dtype"].items()))
        if rep["external_data"]:
            print("  external data: " + ", ".join(f"{k} ({_mb(v)})" for k, v in rep["external_data"].items()))
    return EXIT_OK


def _cmd_eval(args: argparse.Namespace) -> int:
    from bitpress.api import evaluate
    from bitpress.evaluate.report import text_lines

    result = evaluate(
        args.quantized, args.reference, data=args.data, samples=args.samples, seq_len=args.seq_len,
        batch=args.batch, seed=args.seed, text=args.text, tokenizer=args.tokenizer, max_windows=args.max_windows,
        jobs=args.jobs, weights=not args.no_weights, progress=_progress, speed=not args.no_speed,
        speed_runs=args.speed_runs,
    )
    if args.html:
        result.write_html(args.html)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        for line in text_lines(result):
            print(line)
        if args.html:
            print(f"wrote {args.html}")
    return EXIT_OK


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _cmd_bench(args: argparse.Namespace) -> int:
    from bitpress.speed import bench, lines

    report = bench(args.models, labels=args.labels, threads=args.jobs, runs=args.runs, warmup=args.warmup,
                   prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens, profile_nodes=args.profile,
                   progress=lambda text: print(f"bench: {text}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for line in lines(report, top=args.profile or 10):
            print(line)
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from bitpress.demo import run_demo

    for line in run_demo(args.output, preset=args.preset, progress=_progress):
        print(line)
    return EXIT_OK


# -- formatting --------------------------------------------------------------------------------
def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _print_table(rows: list[list[str]], indent: str = "") -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
