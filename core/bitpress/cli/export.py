"""Packages: ``bitpress export`` (one model), ``bitpress publish CONFIG`` (a matrix of them), ``bitpress verify``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bitpress.cli.common import EXIT_FAIL, EXIT_OK, SUBFOLDER_HELP, mb, parse_kv, progress, report
from bitpress.errors import UsageError, ValidationError


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


def add_publish(sub: argparse._SubParsersAction) -> None:
    pb = sub.add_parser("publish", help="one Hugging Face model to a tree of GenAI packages: every dtype x EP "
                                        "and quantized variant of the config's matrix")
    pb.add_argument("config", type=Path, help="YAML or JSON: input, output, matrix (see docs/publishing.md)")
    pb.add_argument("--overwrite", action="store_true", help="replace cells that exist")
    pb.add_argument("--json", action="store_true", help="print the result as JSON")
    pb.set_defaults(func=_cmd_publish)


def add_verify(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("verify", help="check a package against its bitpress-manifest.json (missing, truncated or "
                                      "changed files)")
    v.add_argument("folder", type=Path)
    v.add_argument("--json", action="store_true", help="print the result as JSON")
    v.set_defaults(func=_cmd_verify)


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

    res = publish(load_publish_config(args.config), overwrite=args.overwrite, progress=progress)
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


def _cmd_verify(args: argparse.Namespace) -> int:
    from bitpress.genai.manifest import MANIFEST, verify

    res = verify(args.folder)
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
        return EXIT_OK if res.ok else EXIT_FAIL
    if not res.ok:
        raise ValidationError(f"{args.folder} does not match its {MANIFEST}: " + "; ".join(res.problems()))
    print(f"{args.folder}: {res.checked} files ({mb(res.bytes)}) match {MANIFEST}")
    if res.unlisted:
        print(f"note: {len(res.unlisted)} file(s) the manifest does not list: {', '.join(res.unlisted[:5])}")
    return EXIT_OK
