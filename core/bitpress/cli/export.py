"""Packages: ``bitpress export`` (one model), ``bitpress publish CONFIG`` (a matrix of them), ``bitpress verify``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bitpress.cli.common import EXIT_FAIL, EXIT_OK, SUBFOLDER_HELP, mb, parse_kv, progress, report
from bitpress.errors import UsageError, ValidationError
from bitpress.hub_remote import parse_target


def add_export(sub: argparse._SubParsersAction) -> None:
    x = sub.add_parser("export", help="a Hugging Face model (float or quantized) to ONNX or an ONNX Runtime "
                                      "GenAI package")
    x.add_argument("model", help="a Hugging Face folder (float, or written by a bitpress *_hf pass), a Hub id "
                                 "org/name[@revision] (a local path wins), or a .gguf file (bitpress[gguf])")
    x.add_argument("--subfolder", help=SUBFOLDER_HELP)
    x.add_argument("-o", "--output", required=True, type=Path, help="output folder (mirrors the input's name)")
    x.add_argument("--runtime", choices=("genai", "onnx"), default="genai",
                   help="genai: a GenAI package by a real exporter (KV cache, genai_config.json); onnx: bitpress's "
                        "own graph without KV cache (hf_to_onnx)")
    x.add_argument("--exporter", choices=("auto", "builder", "mobius"), default="auto",
                   help="genai: auto (the exporter that builds this architecture right, docs/architectures.md), "
                        "builder (python -m onnxruntime_genai.models.builder) or mobius (mobius build)")
    x.add_argument("--dtype", choices=("auto", "f32", "f16", "bf16"), default="auto",
                   help="genai: weights and activations (auto: f32; the builder: float checkpoints only)")
    x.add_argument("--ep", default="cpu", help="genai: execution provider (builder: cpu, cuda, dml, webgpu, "
                                                "NvTensorRtRtx; mobius: default, cpu, cuda, dml, webgpu, trt-rtx, ...)")
    x.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the export pass (see `passes show hf_to_genai`); repeatable")
    x.add_argument("--overwrite", action="store_true", help="replace an existing output")
    x.add_argument("--json", action="store_true", help="print the result as JSON")
    x.set_defaults(func=_cmd_export)


def add_publish(sub: argparse._SubParsersAction) -> None:
    pb = sub.add_parser("publish", help="one Hugging Face model to a tree of GenAI packages: every dtype x EP "
                                        "and quantized variant of the config's matrix")
    pb.add_argument("config", type=Path, help="YAML or JSON: input, output, matrix (see docs/publishing.md)")
    pb.add_argument("--overwrite", action="store_true", help="replace cells that exist")
    pb.add_argument("--push", metavar="ORG/NAME",
                    help="then upload the built packages to this model repo on the Hub (created if missing; one "
                         "commit per package; files already there are not sent again, so running the same command "
                         "again resumes) and check the Hub's copy against every manifest. With --push, cells built "
                         "by an earlier run that still match their manifest are kept, not rebuilt")
    pb.add_argument("--revision", metavar="BRANCH", help="--push: the branch to commit to (default: main)")
    pb.add_argument("--private", action="store_true", help="--push: create the repo private")
    pb.add_argument("--dry-run", action="store_true",
                    help="build and upload nothing: list the cells (built or to build) and, with --push, the files "
                         "that would be sent (new or changed on the Hub) and those already there")
    pb.add_argument("--json", action="store_true", help="print the result as JSON")
    pb.set_defaults(func=_cmd_publish)


def add_verify(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("verify", help="check a package against its bitpress-manifest.json (missing, truncated or "
                                      "changed files): a local folder, or the packages of a Hub repo")
    v.add_argument("folder", help="a package folder, or org/name[@revision][/path] on the Hugging Face Hub: every "
                                  "package under the path, checked without downloading it (a local path wins)")
    v.add_argument("--revision", help="a Hub repo's branch, tag or commit (default: main)")
    v.add_argument("--json", action="store_true", help="print the result as JSON")
    v.set_defaults(func=_cmd_verify)


def _cmd_export(args: argparse.Namespace) -> int:
    from bitpress.api import run

    step: dict[str, Any] = {"type": "hf_to_onnx"}
    if Path(args.model).suffix.lower() == ".gguf":  # the gguf plugin's conversion (bitpress[gguf])
        if args.runtime != "genai" or args.exporter != "auto" or args.dtype != "auto":
            raise UsageError("a .gguf file is exported as a GenAI package by gguf_to_genai: only --ep and --option")
        step = {"type": "gguf_to_genai", "ep": args.ep}
    elif args.runtime == "genai":
        step = {"type": "hf_to_genai", "exporter": args.exporter, "dtype": args.dtype, "ep": args.ep}
    elif args.dtype != "auto" or args.ep != "cpu" or args.exporter != "auto":
        raise UsageError("--exporter, --dtype and --ep apply to --runtime genai")
    step.update(_typed_options(step["type"], parse_kv(args.option)))
    config: dict[str, Any] = {"input": args.model, "output": str(args.output), "passes": [step]}
    if args.subfolder:
        config["subfolder"] = args.subfolder
    result = run(config, overwrite=args.overwrite or None, progress=progress)
    report(result, args.json)
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


def _cmd_publish(args: argparse.Namespace) -> int:
    from bitpress.genai.publish import INDEX, load_publish_config, publish

    if (args.revision or args.private) and not args.push:
        raise UsageError("--revision and --private go with --push ORG/NAME")
    if args.push:
        target = parse_target(args.push, args.revision)
        if target is None or target.path:
            raise UsageError(f"--push {args.push}: expected a model repo id org/name (a branch: --revision)")
        args.push, args.revision = target.repo_id, target.revision
    config = load_publish_config(args.config)
    if args.dry_run:
        return _publish_dry_run(config, args)
    res = publish(config, overwrite=args.overwrite, progress=progress, keep=bool(args.push))
    if args.json and not args.push:
        print(json.dumps(res.to_json(), indent=2))
    elif not args.json:
        for c in res.cells:
            line = f"  {c.folder:<28} {'kept' if c.kept else c.status:<7} {c.seconds:6.1f} s"
            if c.eval and c.eval.get("perplexity") is not None:
                line += f"  perplexity {c.eval['perplexity']:.3f} ({c.eval['perplexity_change']:+.2%})"
            print(line + (f"  {c.reason}" if c.reason else ""))
        ok = len(res.cells) - len(res.failed)
        print(f"wrote {ok} of {len(res.cells)} packages under {res.output} (index: {res.output / INDEX})")
    code = EXIT_OK
    if args.push:
        code = _push(res.output, args, [c.folder for c in res.cells if c.status == "ok"], res.to_json())
    if res.failed:
        print(f"bitpress: error: {len(res.failed)} cell(s) failed: {', '.join(c.folder for c in res.failed)}"
              + (" (not pushed)" if args.push else ""), file=sys.stderr)
        return EXIT_FAIL
    return code


def _push(output: Path, args: argparse.Namespace, built: list[str], published: dict[str, Any] | None) -> int:
    from bitpress.genai.push import push

    if not built:
        return EXIT_OK
    _quiet_hub_bars()
    res = push(output, args.push, revision=args.revision, private=args.private or None, dry_run=args.dry_run,
               packages=built)
    if args.json:
        print(json.dumps({"publish": published, "push": res.to_json()} if published is not None
                         else {"push": res.to_json()}, indent=2))
    else:
        _print_push(res)
    if not res.ok:
        bad = [p for p in res.packages if p.verified is not None and not p.verified.ok]
        raise ValidationError(f"uploaded to {res.repo_id}, but the Hub's copy does not match the manifest: "
                              + "; ".join(f"{p.folder}: " + ", ".join(p.verified.problems()) for p in bad
                                          if p.verified is not None))
    return EXIT_OK


def _quiet_hub_bars() -> None:
    """huggingface_hub's upload bars only on a terminal, as bitpress's own (a log or a pipe gets the lines)."""
    if not sys.stderr.isatty():
        try:
            from huggingface_hub.utils import disable_progress_bars
        except ImportError:  # the push says what to install
            return
        disable_progress_bars()


def _print_push(res: Any) -> None:
    where = f"{res.repo_id}" + (f"@{res.revision}" if res.revision else "")
    if res.dry_run:
        head = f"would push to {where}" + (f" (now at commit {res.commit[:12]})" if res.commit else
                                           " (a new repo)" if res.remote_checked else
                                           " (the Hub not consulted: HF_HUB_OFFLINE; every file counted as new)")
        print(head)
    for p in res.packages:
        send = p.to_send
        state = p.status if not res.dry_run else ("send" if send else "there")
        print(f"  {p.folder:<28} {state:<9} {len(send)} of {len(p.files)} file(s) to send, "
              f"{mb(sum(f.size for f in send))}")
        if res.dry_run:
            for f in send:
                print(f"      {f.state:<8} {f.name} ({mb(f.size)})")
    if res.dry_run:
        print(f"{mb(res.bytes_to_send)} to send; nothing was sent")
        return
    checked = sum(p.verified.checked for p in res.packages if p.verified is not None)
    print(f"pushed to {where} at commit {res.commit}: {len(res.packages)} package(s) on the Hub, {checked} file(s) "
          "match their manifests")


def _publish_dry_run(config: dict[str, Any], args: argparse.Namespace) -> int:
    from bitpress.genai.manifest import MANIFEST
    from bitpress.genai.publish import plan_cells

    cells, _ = plan_cells(config)
    out = Path(config["output"])
    built = []
    rows = []
    for c in cells:
        there = (out / c.folder / MANIFEST).is_file()
        rows.append({"folder": c.folder, "state": "built" if there else "to build"})
        if there:
            built.append(c.folder)
    if args.json and not args.push:
        print(json.dumps({"cells": rows}, indent=2))
        return EXIT_OK
    if not args.json:
        for r in rows:
            print(f"  {r['folder']:<28} {r['state']}")
        print(f"{len(rows) - len(built)} of {len(rows)} cell(s) to build under {out}; nothing was built")
    if args.push and built:
        return _push(out, args, built, {"cells": rows} if args.json else None)
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from bitpress.genai.manifest import MANIFEST, verify

    first = Path(args.folder.split("/", 1)[0])
    if not Path(args.folder).exists() and not Path(args.folder).is_symlink() and not first.is_dir():
        # not a local path (nor a missing one inside an existing local folder: a typo is not looked up on the Hub)
        target = parse_target(args.folder, args.revision)
        if target is not None:
            return _verify_hub(target, args)
    if args.revision:
        raise UsageError(f"--revision goes with a Hub repo; {args.folder} is a local folder")
    res = verify(Path(args.folder))
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
        return EXIT_OK if res.ok else EXIT_FAIL
    if not res.ok:
        raise ValidationError(f"{args.folder} does not match its {MANIFEST}: " + "; ".join(res.problems()))
    print(f"{args.folder}: {res.checked} files ({mb(res.bytes)}) match {MANIFEST}")
    if res.unlisted:
        print(f"note: {len(res.unlisted)} file(s) the manifest does not list: {', '.join(res.unlisted[:5])}")
    return EXIT_OK


def _verify_hub(target: Any, args: argparse.Namespace) -> int:
    from bitpress.genai.manifest import MANIFEST
    from bitpress.genai.remote import verify_hub

    res = verify_hub(target)
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
        return EXIT_OK if res.ok else EXIT_FAIL
    if not res.ok:
        raise ValidationError(f"{target} (commit {str(res.commit)[:12]}) does not match its {MANIFEST}s: "
                              + " | ".join(res.problems()))
    for p in res.packages:
        print(f"  {p.folder!s:<48} {p.checked} files ({mb(p.bytes)}) match")
        if p.unlisted:
            print(f"    note: {len(p.unlisted)} file(s) the manifest does not list: {', '.join(p.unlisted[:5])}")
    print(f"{target} at commit {res.commit}: {len(res.packages)} package(s) match their {MANIFEST}")
    return EXIT_OK
