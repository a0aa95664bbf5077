"""``bitpress eval`` (a quantized model against its float reference) and ``bitpress bench`` (how fast models run)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bitpress.cli.common import EXIT_OK, SUBFOLDER_HELP, Deprecated, int_list, progress


def add_eval(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser("eval", help="compare a quantized model with its float reference (errors, perplexity, SQNR)")
    ev.add_argument("quantized", help="the quantized .onnx file or ONNX folder (or a Hub id org/name[@revision])")
    ev.add_argument("--reference", required=True,
                    help="the float .onnx file or folder it came from, or a Hugging Face Hub id org/name[@revision] "
                         "(a local path wins)")
    ev.add_argument("--subfolder", help=SUBFOLDER_HELP + " (for each Hub id given)")
    ev.add_argument("--data", help="inputs to compare on: random (default), a .npz file or folder, a .txt (tokenizer)")
    ev.add_argument("--samples", type=int, default=8, help="model runs to compare (default 8)")
    ev.add_argument("--seq-len", type=int, default=128, help="tokens per sample / perplexity window (default 128)")
    ev.add_argument("--batch", type=int, default=1, help="samples per run (default 1)")
    ev.add_argument("--seed", type=int, default=0, help="seed of random inputs (default 0)")
    ev.add_argument("--text", type=Path, help="text file: perplexity of both models on it (needs a tokenizer)")
    ev.add_argument("--tokenizer", help="tokenizer.json or its folder, or a Hub id (default: the models' folders)")
    ev.add_argument("--max-windows", type=int, help="perplexity on at most this many windows (default: all)")
    ev.add_argument("--jobs", type=int, default=1, help="ONNX Runtime intra-op threads (default 1)")
    ev.add_argument("--threads", dest="jobs", type=int, action=Deprecated, replacement="--jobs",
                    help=argparse.SUPPRESS)  # the old name, still accepted
    ev.add_argument("--no-weights", action="store_true", help="skip the per-tensor weight error (SQNR)")
    ev.add_argument("--no-speed", action="store_true",
                    help="skip timing both models (prompt / decode tokens per second, alternating rounds)")
    ev.add_argument("--speed-runs", type=int, default=3, help="timed rounds per model, after a warm-up (default 3)")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.add_argument("--html", type=Path, metavar="REPORT.html", help="also write a self-contained HTML report")
    ev.set_defaults(func=_cmd_eval)


def add_bench(sub: argparse._SubParsersAction) -> None:
    bn = sub.add_parser("bench", help="how fast models run: prompt and decode tokens/s (GenAI packages), latency "
                        "at one token and a prompt-sized batch (ONNX), load time, peak memory; models alternate")
    bn.add_argument("models", nargs="+", type=Path, metavar="MODEL",
                    help=".onnx files or ONNX Runtime GenAI package folders; ratios are to the first of each kind")
    bn.add_argument("--label", action="append", dest="labels", metavar="NAME",
                    help="a name per model, in order (default: the file or folder name)")
    bn.add_argument("--jobs", type=int_list, default=[1], metavar="N[,N...]",
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


def _cmd_eval(args: argparse.Namespace) -> int:
    from bitpress.api import evaluate
    from bitpress.evaluate.report import text_lines

    # Hub ids (the models, --tokenizer) are resolved by evaluate(), which records their commits
    result = evaluate(
        args.quantized, args.reference, data=args.data, samples=args.samples, seq_len=args.seq_len,
        batch=args.batch, seed=args.seed, text=args.text, tokenizer=args.tokenizer, max_windows=args.max_windows,
        jobs=args.jobs, weights=not args.no_weights, progress=progress, speed=not args.no_speed,
        speed_runs=args.speed_runs, subfolder=args.subfolder,
    )
    if args.html:
        result.write_html(args.html)
    if args.json:
        for key, src in result.sources.items():  # stdout is JSON: which commits were compared, on stderr too
            sub = f" (subfolder {src['subfolder']})" if src.get("subfolder") else ""
            print(f"note: {key}: {src['hub']} at commit {src['commit']}{sub}", file=sys.stderr)
        print(json.dumps(result.to_json(), indent=2))
    else:
        for line in text_lines(result):
            print(line)
        if args.html:
            print(f"wrote {args.html}")
    return EXIT_OK


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
