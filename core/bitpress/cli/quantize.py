"""``bitpress quantize`` (one pass) and ``bitpress run CONFIG`` (a workflow), and their ``--plan`` dry run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bitpress.cli.common import EXIT_OK, SUBFOLDER_HELP, hub_path, parse_kv, progress, report, size
from bitpress.errors import UsageError


def add_quantize(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser("quantize", help="quantize a model with one pass")
    q.add_argument("-m", "--model", required=True,
                   help=".onnx file or ONNX folder, or a Hugging Face Hub id org/name[@revision] (a local path wins)")
    q.add_argument("--subfolder", help=SUBFOLDER_HELP)
    q.add_argument("-o", "--output", required=True, type=Path,
                   help="output .onnx file, or a folder (mirrors the input's name / layout)")
    q.add_argument("--algorithm", required=True, help="e.g. rtn, hqq, kquant (see `passes list`)")
    q.add_argument("--precision", help="e.g. int4, int8, nf4")
    q.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a pass option; repeatable (see `passes show NAME`)")
    _add_run_args(q)
    q.add_argument("--bpw", type=float, metavar="BITS",
                   help="a bits-per-weight budget, e.g. 4.5: each weight gets the bits (4/8) and block size "
                        "(128/64/32) that lose least, measured on --data (the option bpw; --plan shows the choice)")
    q.add_argument("--components", nargs="+", help="sub-models of a folder to quantize (default: decoder)")
    q.add_argument("--save-config", type=Path, metavar="FILE",
                   help="also write the equivalent workflow config (YAML, or JSON for a .json name): "
                        "`bitpress run FILE` repeats the run")
    q.set_defaults(func=_cmd_quantize)


def add_run(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="run a workflow config (JSON or YAML)")
    r.add_argument("config", type=Path)
    _add_run_args(r)
    r.set_defaults(func=_cmd_run)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """The flags ``quantize`` and ``run`` share."""
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
    p.add_argument("--max-shard-size", type=size, help="split external data, e.g. 2GB, 500MB")
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
    d.add_argument("--data", help="random, a .npz file or folder of .npz, a .txt file (with a tokenizer), "
                   "or generated (text the model writes itself)")
    d.add_argument("--samples", type=int, help="calibration samples (default: enough for the widest layer input, "
                   "2 tokens per channel, 8 to 128, for GPTQ and AWQ; 8 for other passes)")
    d.add_argument("--seq-len", type=int, default=128, help="tokens per text sample (default 128)")
    d.add_argument("--tokenizer", help="tokenizer.json (or its folder) for text data; default: the model's folder")
    d.add_argument("--generated", type=int, metavar="N",
                   help="how many of the samples are text the model writes itself, beside a text (default: half "
                        "for gptq / awq, none for other passes; 0 keeps to the text)")


def _cmd_quantize(args: argparse.Namespace) -> int:
    from bitpress.api import quantize

    if args.plan:
        from bitpress.api import resolve_input
        from bitpress.workflow.plan import plan_quantize

        model, _ = resolve_input(args.model, args.subfolder, "--model")  # a local folder's subfolder too
        return _show_plan(plan_quantize(model, algorithm=args.algorithm, precision=args.precision,
                                        options=_options(args), components=args.components,
                                        strict=False, data=_plan_data(args)), args.json)
    result = quantize(
        args.model, args.output, algorithm=args.algorithm, precision=args.precision,
        options=_options(args), strict=False, components=args.components, jobs=args.jobs,
        overwrite=args.overwrite, external_data=args.external_data,
        max_shard_size=args.max_shard_size, check=not args.no_check, data=_data(args), progress=progress,
        env_timeout=args.env_timeout, save_config=args.save_config, isolate=args.isolate,
        executor=_executor(args), subfolder=args.subfolder,
    )
    report(result, args.json, args.show_weights)
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from bitpress.api import run

    if args.plan:
        from bitpress.api import resolve_config
        from bitpress.workflow.plan import plan_run

        config, _ = resolve_config(args.config)  # a Hub id input: the snapshot folder it resolves to
        return _show_plan(plan_run(config, data=_plan_data(args)), args.json)
    # the flags override the config's settings; those not given leave them as the config says
    result = run(
        args.config, overwrite=True if args.overwrite else None, jobs=args.jobs, external_data=args.external_data,
        max_shard_size=args.max_shard_size, check=False if args.no_check else None, data=_data(args),
        env_timeout=args.env_timeout, progress=progress, isolate=args.isolate, executor=_executor(args),
    )
    report(result, args.json, args.show_weights)
    return EXIT_OK


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """``--option`` pairs, and ``--bpw`` as the option ``bpw``."""
    options = parse_kv(args.option)
    if args.bpw is not None:
        if "bpw" in options:
            raise UsageError("the budget is given twice (--bpw and --option bpw=...); give it once")
        options["bpw"] = args.bpw
    return options


def _executor(args: argparse.Namespace) -> Any:
    """``--executor`` / ``--address`` as an executor setting (None: the config's, or threads)."""
    if args.address and args.executor != "ray":
        raise UsageError("--address needs --executor ray")
    if args.executor is None:
        return None
    return {"type": args.executor, **({"address": args.address} if args.address else {})}


def _data(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.data:
        return None
    data = {"source": args.data, "samples": args.samples, "seq_len": args.seq_len, "tokenizer": args.tokenizer,
            "generated": args.generated}
    return {k: v for k, v in data.items() if v is not None or k == "tokenizer"}


def _plan_data(args: argparse.Namespace) -> dict[str, Any] | None:
    """``_data`` with a Hub id ``--tokenizer`` resolved (a run resolves it in the API)."""
    data = _data(args)
    if data and data.get("tokenizer"):
        data["tokenizer"] = str(hub_path(data["tokenizer"], "--tokenizer", kind="tokenizer"))
    return data


def _show_plan(result: Any, as_json: bool) -> int:
    from bitpress.workflow.plan import plan_lines

    if as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        for line in plan_lines(result):
            print(line)
    return EXIT_OK
