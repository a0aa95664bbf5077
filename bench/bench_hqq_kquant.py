"""HQQ and k-quant int4: bitpress vs ONNX Runtime's HQQ and Olive's HQQ / k-quant, in one run.

    ../.venv/bin/python bench_hqq_kquant.py [--models bench-447mb] [--tools ...]

Same models, measurements and tables as ``bench_rtn.py`` (see ``benchkit``); bitpress RTN at the
same block size is a row too, so each algorithm's gain over plain rounding is in the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

import benchkit
from bench_rtn import MODELS as RTN_MODELS
from bench_rtn import OLIVE_ENV, OLIVE_VENV, PROJECT_PY, ratios
from benchkit import BENCH_DIR, Job, Tool, Variant

BITPRESS = str(BENCH_DIR.parent / ".venv" / "bin" / "bitpress")
# HQQ and k-quant are asymmetric; HQQ's usual blocks are 64/128, k-quant's is llama.cpp's 32
VARIANTS = [Variant(32, False), Variant(64, False), Variant(128, False)]
HQQ_BLOCKS = {64, 128}
PEER_HQQ_BLOCKS = {128}  # the peers' HQQ takes minutes per run: compared at one block size
KQUANT_BLOCKS = {32}
# the same models as the RTN suite; one timed run each (the peers' HQQ takes minutes)
MODELS = [dataclasses.replace(m, repeats=1) for m in RTN_MODELS]


def _bitpress(algorithm: str, blocks: set[int]):
    def command(job: Job) -> tuple[list[str], dict[str, str]] | None:
        if job.variant.block_size not in blocks:
            return None
        return [BITPRESS, "quantize", "-m", str(job.model), "-o", str(job.output), "--algorithm", algorithm,
                "--precision", "int4", "--option", f"block_size={job.variant.block_size}",
                "--option", "is_symmetric=false"], {}

    return command


def _ort_hqq(job: Job) -> tuple[list[str], dict[str, str]] | None:
    if job.variant.block_size not in PEER_HQQ_BLOCKS:
        return None
    return [str(PROJECT_PY), str(BENCH_DIR / "peers" / "ort_hqq.py"), str(job.model), str(job.output),
            "--block-size", str(job.variant.block_size)], {}


def _olive(pass_type: str, blocks: set[int], **fields: Any):
    def command(job: Job) -> tuple[list[str], dict[str, str]] | None:
        if job.variant.block_size not in blocks:
            return None
        config = {
            "input_model": {"type": "OnnxModel", "model_path": str(job.model)},
            "systems": {"local_system": {"type": "LocalSystem", "accelerators": [
                {"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}]}},
            "passes": {"q": {"type": pass_type, "block_size": job.variant.block_size, **fields}},
            "host": "local_system", "target": "local_system", "output_dir": str(job.output),
            "no_artifacts": True, "log_severity_level": 3,
        }
        path = job.scratch / "olive-config.json"
        path.write_text(json.dumps(config, indent=1))
        return [str(OLIVE_VENV / "bin" / "olive"), "run", "--config", str(path)], {**OLIVE_ENV, "CI": "1"}

    return command


TOOLS = [
    Tool("bitpress hqq", "`bitpress quantize --algorithm hqq --precision int4` (float zero points, defaults)",
         _bitpress("hqq", HQQ_BLOCKS), side="bitpress"),
    Tool("bitpress kquant", "`bitpress quantize --algorithm kquant --precision int4` (float zero points)",
         _bitpress("kquant", KQUANT_BLOCKS), side="bitpress"),
    Tool("bitpress rtn", "`bitpress quantize --algorithm rtn --precision int4`, asymmetric: the plain-rounding "
         "baseline at the same block size", _bitpress("rtn", HQQ_BLOCKS | KQUANT_BLOCKS), side="bitpress",
         baseline=False),
    Tool("ort hqq", "ONNX Runtime `MatMulNBitsQuantizer` + `HQQWeightOnlyQuantConfig`, `peers/ort_hqq.py`",
         _ort_hqq),
    Tool("olive hqq", "Olive `OnnxHqqQuantization` through `olive run` (CI=1, telemetry off)",
         _olive("OnnxHqqQuantization", PEER_HQQ_BLOCKS)),
    Tool("olive kquant", "Olive `OnnxKQuantQuantization` through `olive run` (bits 4; CI=1, telemetry off)",
         _olive("OnnxKQuantQuantization", KQUANT_BLOCKS, bits=4)),
]

# targets stated by the issue: 5x faster than ORT's HQQ / Olive's k-quant on the 447 MB model
PAIRS = {"bitpress hqq": {"ort hqq", "olive hqq"}, "bitpress kquant": {"olive kquant"}}
TARGETS = [("bitpress hqq", "ort hqq", 5.0), ("bitpress kquant", "olive kquant", 5.0)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=[m.name for m in MODELS])
    p.add_argument("--tools", nargs="+", choices=[t.name for t in TOOLS])
    p.add_argument("--keep-outputs", action="store_true")
    args = p.parse_args(argv)
    if not (OLIVE_VENV / "bin" / "olive").exists():
        print(f"{OLIVE_VENV}/bin/olive is missing: run `make -C bench olive-venv` first", file=sys.stderr)
        return 2
    extra = {
        "title": "HQQ and k-quant int4: bitpress vs ONNX Runtime vs Olive",
        "notes": [
            "bitpress stores HQQ's and k-quant's optimum as a float zero point (MatMulNBits takes zero points "
            "of the scales' type); the peers round it to an integer. Tied tables read by GatherBlockQuantized "
            "use uint8 zero points in every tool.",
            "Random-weight models: compare tools on weight error; logits of random networks have no margin.",
        ],
        "versions": {
            "bitpress venv": benchkit.versions(PROJECT_PY, ["bitpress", "bitpress-hqq", "bitpress-kquant", "numpy",
                                                            "onnx", "onnxruntime", "torch"]),
            "olive venv": benchkit.versions(OLIVE_VENV / "bin" / "python", ["olive-ai", "numpy", "onnx",
                                                                          "onnxruntime", "torch"]),
        },
    }
    result = benchkit.run_suite("hqq_kquant", MODELS, VARIANTS, TOOLS, only_models=args.models,
                                only_tools=args.tools, keep_outputs=args.keep_outputs, extra=extra,
                                merge=bool(args.models or args.tools))
    result["ratios"] = [r for r in ratios(result) if r["peer"] in PAIRS.get(r["bitpress"], set())]
    result["targets"] = []
    for mine, peer, at_least in TARGETS:
        for r in result["ratios"]:
            if r["model"] == "bench-447mb" and r["bitpress"] == mine and r["peer"] == peer:
                result["targets"].append({"model": r["model"], "variant": r["variant"], "value": r["speed"],
                                          "what": "speed", "peer": peer, "at_least": at_least,
                                          "met": r["speed"] >= at_least,
                                          "text": f"{mine} >= {at_least}x faster than {peer}"})
    (benchkit.RESULTS / "hqq_kquant.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    for t in result["targets"]:
        print(f"[bench] target {t['model']} {t['variant']}: {t['text']}: {t['value']:.2f} "
              f"{'met' if t['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
