"""Static and dynamic int8: ONNX Runtime, Intel Neural Compressor and AMD Quark on the same models, in one run.

    ../.venv/bin/python int8.py                     # everything (make -C bench int8), ~20 min on 2 cores
    ../.venv/bin/python int8.py --models convnet --tools ort   # a quick look (prints, writes nothing)
    ../.venv/bin/python int8.py --render-only       # docs/int8.md's tables again from the last results

Every mode runs as a user runs it, ``bitpress quantize`` in a fresh process (measured by
``benchkit.run_measured``: wall time and the peak resident memory of the whole process tree, the
plugin environment's worker included), with ``BITPRESS_ENVS`` pointing at the project's
environments (``../.bitpress-envs``, or ``$BITPRESS_ENVS``): Quark's and INC's passes run in
theirs, ONNX Runtime's in the host's. A toolkit whose passes are not available is skipped, and the
table says why. Models:

* ``decoder``: ``bitpress.synthetic`` Llama-like decoder, hidden 256, 4 layers, vocab 4096, tied head
  (random weights); ``encoder``: BERT-like, hidden 256, 4 layers; ``convnet``: the conv net of
  ``tests/plugins/test_ort.py`` at channels 32/64/128 on 64 x 64 images. Calibration: the host's random
  data (16 samples of 64 tokens); error: the worst output's relative L2 against the float model on
  4 other random batches;
* ``minilm-l3``: paraphrase-MiniLM-L3-v2 (real fp32 weights, docs/real-models.md), calibrated on 32
  sentences of gensim's ``lee_background.cor`` (an .npz of the tokenized batch); error: cosine
  similarity of the mean-pooled sentence embeddings and relative L2 of ``last_hidden_state`` on 64 other
  sentences;
* ``large``: peak memory on the 447 MB ``bench-447mb`` decoder, ONNX Runtime's own
  ``quantize_static`` / ``quantize_dynamic`` / ``quant_pre_process`` called directly against
  ``ort_static`` / ``ort_dynamic``.

Results go to ``.work/results/int8.json``; the tables replace the block between the markers of
``../docs/int8.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import benchkit
import numpy as np
from benchkit import BENCH_DIR, ROOT, markdown_table

WORK = BENCH_DIR / ".work" / "int8"
RESULTS = BENCH_DIR / ".work" / "results" / "int8.json"
DOC = ROOT / "docs" / "int8.md"
BITPRESS = str(ROOT / ".venv" / "bin" / "bitpress")
PYTHON = str(ROOT / ".venv" / "bin" / "python")
ENVS = Path(os.environ.get("BITPRESS_ENVS") or ROOT / ".bitpress-envs")
BEGIN, END = "<!-- bench/int8.py: begin -->", "<!-- bench/int8.py: end -->"
TIMEOUT_S = 1800
SYNTH_DATA = ["--data", "random", "--samples", "16", "--seq-len", "64"]
VERSIONED = ("onnxruntime", "onnx", "numpy", "bitpress", "bitpress-ort")
ENV_VERSIONED = {"quark": ("amd-quark", "onnxruntime", "onnx", "torch"),
                 "inc": ("onnx-neural-compressor", "onnxruntime", "onnx", "numpy")}


@dataclass(frozen=True)
class Mode:
    tool: str  # ort | inc | quark: the plugin
    label: str
    algorithm: str
    options: tuple[str, ...] = ()
    data: bool = True  # calibration data given
    precision: str = "int8"


MODES = [
    Mode("ort", "static QDQ MinMax", "ort_static"),
    Mode("ort", "static QDQ MinMax, float_masks=false (= quantize_static)", "ort_static", ("float_masks=false",)),
    Mode("ort", "static QOperator MinMax", "ort_static", ("quant_format=QOperator",)),
    Mode("ort", "static QDQ Entropy", "ort_static", ("calibrate_method=Entropy",)),
    Mode("ort", "static QDQ Percentile", "ort_static", ("calibrate_method=Percentile",)),
    Mode("ort", "static QDQ MinMax per-channel", "ort_static", ("per_channel=true",)),
    Mode("ort", "static QDQ MinMax, MatMul + Gather only, QUInt8 activations", "ort_static",
         ("op_types_to_quantize=MatMul,Gather", "activation_type=QUInt8")),
    Mode("ort", "static QDQ MinMax per-channel, MatMul + Gather only, QUInt8 activations", "ort_static",
         ("op_types_to_quantize=MatMul,Gather", "activation_type=QUInt8", "per_channel=true")),
    Mode("ort", "dynamic", "ort_dynamic", data=False),
    Mode("ort", "dynamic per-channel", "ort_dynamic", ("per_channel=true",), data=False),
    Mode("ort", "tuned (OnnxQuantization, 14 trials)", "ort_tune"),
    Mode("inc", "static QOperator MinMax", "inc_static"),
    Mode("inc", "static QDQ MinMax", "inc_static", ("quant_format=QDQ",)),
    Mode("inc", "static QOperator Percentile", "inc_static", ("calibrate_method=Percentile",)),
    Mode("inc", "dynamic", "inc_dynamic", data=False),
    Mode("inc", "weight-only int4 RTN", "inc_woq", data=False, precision="int4"),
    Mode("inc", "tuned (IncQuantization)", "inc"),
    Mode("quark", "static QDQ MinMax", "quark_static"),
    Mode("quark", "static QOperator MinMax", "quark_static", ("quant_format=qoperator",)),
    Mode("quark", "static QDQ Percentile", "quark_static", ("calibration_method=percentile",)),
    Mode("quark", "dynamic", "quark_dynamic", data=False),
]
TOOLS = {"ort": "ONNX Runtime (bitpress-ort, host)", "inc": "Intel Neural Compressor (bitpress-inc, env inc)",
         "quark": "AMD Quark (bitpress-quark, env quark)"}


# -- models ---------------------------------------------------------------------------------------------
def _convnet_builder() -> Callable[..., Path]:
    spec = importlib.util.spec_from_file_location("test_ort", ROOT / "tests" / "plugins" / "test_ort.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_convnet


def build_model(name: str) -> Path:
    from bitpress import synthetic

    path = WORK / "models" / name / "model.onnx"
    if path.exists():
        return path
    tmp = path.parent.with_name(name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    target = tmp / "model.onnx"
    if name == "decoder":
        synthetic.build_decoder(target, hidden=256, layers=4, heads=4, vocab=4096)
    elif name == "encoder":
        synthetic.build_encoder(target, hidden=256, layers=4, heads=4, vocab=4096)
    elif name == "convnet":
        _convnet_builder()(target, channels=(32, 64, 128), size=64)
    elif name == "large":
        synthetic.build_preset("bench-447mb", target)
    else:
        raise SystemExit(f"unknown model {name}")
    shutil.rmtree(path.parent, ignore_errors=True)
    tmp.rename(path.parent)
    return path


@dataclass
class MiniLM:
    model: Path
    calib: Path  # .npz
    eval_feeds: dict[str, np.ndarray]


def minilm() -> MiniLM:
    sys.path.insert(0, str(BENCH_DIR))
    import quality

    c = quality.realmodels()
    model = quality.fixture_fn(c.minilm_l3_onnx)()
    tokenizer = quality.fixture_fn(c.minilm_l6_folder)() / "tokenizer.json"
    lines = quality.sentences(quality.fixture_fn(c.lee_background)(), 96)
    calib = WORK / "data" / "minilm-calib.npz"
    calib.parent.mkdir(parents=True, exist_ok=True)
    np.savez(calib, **quality.minilm_batch(tokenizer, lines[0::3]))  # 32 sentences
    held = [s for i, s in enumerate(lines) if i % 3]  # the 64 others
    return MiniLM(model, calib, quality.minilm_batch(tokenizer, held))


# -- running ----------------------------------------------------------------------------------------------
def available() -> dict[str, str | None]:
    """pass name -> None when it can run, else why not (``bitpress passes list --json`` with the envs)."""
    out = subprocess.run([BITPRESS, "passes", "list", "--json"], capture_output=True, text=True,
                         env={**os.environ, "BITPRESS_ENVS": str(ENVS)}, check=False)
    try:
        rows = json.loads(out.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"bitpress passes list failed: {out.stderr.strip()[-500:]}") from None
    return {r["pass"]: None if r["available"] else (r.get("reason") or "unavailable") for r in rows}


@dataclass
class Row:
    model: str
    tool: str
    mode: str
    algorithm: str
    precision: str
    status: str = "ok"  # ok | skipped | failed
    note: str = ""
    wall_s: float = math.nan
    peak_rss: int = 0
    bytes: int = 0
    float_bytes: int = 0
    error: dict[str, float] = field(default_factory=dict)


def quantize_cmd(src: Path, out: Path, mode: Mode, data: list[str]) -> list[str]:
    cmd = [BITPRESS, "quantize", "-m", str(src), "-o", str(out), "--algorithm", mode.algorithm]
    for opt in mode.options:
        cmd += ["--option", opt]
    return cmd + (data if mode.data else [])


def run_mode(model: str, src: Path, mode: Mode, data: list[str], reasons: dict[str, str | None],
             judge: Callable[[Path], dict[str, float]]) -> Row:
    row = Row(model, mode.tool, mode.label, mode.algorithm, mode.precision, float_bytes=benchkit.model_size(src))
    if mode.algorithm not in reasons:
        row.status, row.note = "skipped", f"plugin bitpress-{mode.tool} is not installed"
        return row
    if reasons[mode.algorithm] is not None:
        row.status, row.note = "skipped", str(reasons[mode.algorithm])
        return row
    slug = "".join(ch if ch.isalnum() else "-" for ch in mode.label.lower()).strip("-")
    folder = WORK / "out" / model / f"{mode.tool}-{slug}"
    shutil.rmtree(folder, ignore_errors=True)
    out = folder / "model.onnx"
    log = WORK / "logs" / model / f"{folder.name}.log"
    m = benchkit.run_measured(quantize_cmd(src, out, mode, data), log, env={"BITPRESS_ENVS": str(ENVS)},
                              timeout=TIMEOUT_S)
    row.wall_s, row.peak_rss = m.wall_s, m.peak_rss
    if m.returncode != 0 or not out.exists():
        row.status = "failed"
        row.note = _last_error(log)
        return row
    row.bytes = benchkit.tree_size(folder)
    row.error = judge(out)
    tuned = re.search(r"ONNX Runtime \S+ (.+?) \(tuned\) in ", log.read_text(errors="replace"))
    if tuned:
        row.note = f"picked: {tuned.group(1)}"
    shutil.rmtree(folder, ignore_errors=True)
    return row


def _last_error(log: Path) -> str:
    """The command's error line, without the ``bitpress: error:`` prefix."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    line = (errors or lines or ["no output"])[-1]
    return line.split("error: ", 1)[-1][:300]


def _session(path: Path) -> Any:
    return benchkit.session(path, threads=1)


def synthetic_judge(src: Path) -> Callable[[Path], dict[str, float]]:
    """Worst relative L2 over the outputs on 4 random batches (seeds the calibration never saw)."""
    from bitpress import synthetic

    feeds = [synthetic.random_inputs(src, batch=2, seq=64, seed=1000 + i) for i in range(4)]
    ref = _session(src)
    reference = [ref.run(None, f) for f in feeds]

    def judge(out: Path) -> dict[str, float]:
        sess = _session(out)
        diff = [0.0] * len(reference[0])
        norm = [0.0] * len(reference[0])
        for f, r in zip(feeds, reference, strict=True):
            for i, (a, b) in enumerate(zip(r, sess.run(None, f), strict=True)):
                diff[i] += float(np.sum((a.astype(np.float64) - b) ** 2))
                norm[i] += float(np.sum(a.astype(np.float64) ** 2))
        return {"rel_l2": max(math.sqrt(d / n) for d, n in zip(diff, norm, strict=True))}

    return judge


def minilm_judge(m: MiniLM) -> Callable[[Path], dict[str, float]]:
    sys.path.insert(0, str(BENCH_DIR))
    import quality

    reference = quality.token_states(m.model, m.eval_feeds)

    def judge(out: Path) -> dict[str, float]:
        e = quality.embedding_errors(quality.token_states(out, m.eval_feeds), reference, m.eval_feeds["attention_mask"])
        return {"cosine_mean": e["cosine_mean"], "cosine_min": e["cosine_min"], "rel_l2": e["tokens_rel_l2"]}

    return judge


# -- the large model: ONNX Runtime called directly vs the plugin --------------------------------------------
_DIRECT = """
import contextlib, io, logging, sys
logging.disable(logging.WARNING)
from onnxruntime.quantization import CalibrationMethod, quantize_dynamic, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process
mode, src, out = sys.argv[1:4]
class Reader:
    def __init__(self, feeds): self.it = iter(feeds)
    def get_next(self): return next(self.it, None)
import numpy as np
vocab = int(sys.argv[4])  # random token ids, as the host's random data
feeds = [{"input_ids": np.random.default_rng(i).integers(0, vocab, (1, 64))} for i in range(16)]
with contextlib.redirect_stdout(io.StringIO()):
    if mode == "dynamic":
        quantize_dynamic(src, out)
    elif mode == "preprocess":
        quant_pre_process(src, out)
    else:
        quantize_static(src, out, Reader(feeds), calibrate_method=CalibrationMethod[mode])
"""

LARGE = [  # (label, ORT's own call or None, bitpress options or None)
    ("static MinMax, no pre-processing", "MinMax", ["ort_static", "quant_preprocess=false"]),
    ("static MinMax, pre-processed (ORT: quant_pre_process, then quantize_static)", "preprocess+MinMax",
     ["ort_static", "quant_preprocess=true"]),
    ("static Percentile, no pre-processing", "Percentile", ["ort_static", "calibrate_method=Percentile",
                                                            "quant_preprocess=false"]),
    ("dynamic, no pre-processing", "dynamic", ["ort_dynamic", "quant_preprocess=false"]),
    ("pre-processing alone (quant_pre_process)", "preprocess", None),
]


def run_large(src: Path) -> list[dict[str, Any]]:
    from bitpress import synthetic

    rows = []
    for label, direct, ours in LARGE:
        row: dict[str, Any] = {"mode": label}
        if direct is not None:
            steps = direct.split("+")
            peak, wall = 0, 0.0
            current = src
            for step in steps:  # ORT's pre-processing then quantization: two calls of ORT's API, as a script would
                out = WORK / "out" / "large" / f"direct-{step}.onnx"
                out.parent.mkdir(parents=True, exist_ok=True)
                vocab = str(synthetic.PRESETS["bench-447mb"]["vocab"])
                m = benchkit.run_measured([PYTHON, "-c", _DIRECT, step, str(current), str(out), vocab],
                                          WORK / "logs" / "large" / f"direct-{direct}-{step}.log", timeout=TIMEOUT_S)
                if m.returncode != 0:
                    row["direct_failed"] = _last_error(WORK / "logs" / "large" / f"direct-{direct}-{step}.log")
                peak, wall = max(peak, m.peak_rss), wall + m.wall_s
                current = out
            row["direct"] = {"peak_rss": peak, "wall_s": wall}
        if ours is not None:
            out = WORK / "out" / "large" / "bitpress" / "model.onnx"
            shutil.rmtree(out.parent, ignore_errors=True)
            cmd = [BITPRESS, "quantize", "-m", str(src), "-o", str(out), "--algorithm", ours[0], "--no-check",
                   *[a for o in ours[1:] for a in ("--option", o)]]
            if ours[0] == "ort_static":
                cmd += ["--data", "random", "--samples", "16", "--seq-len", "64"]
            log = WORK / "logs" / "large" / f"bitpress-{label[:20].replace(' ', '_')}.log"
            m = benchkit.run_measured(cmd, log, env={"BITPRESS_ENVS": str(ENVS)}, timeout=TIMEOUT_S)
            row["bitpress"] = {"peak_rss": m.peak_rss, "wall_s": m.wall_s}
            if m.returncode != 0:
                row["bitpress_failed"] = _last_error(log)
        rows.append(row)
        print(f"[int8] large: {label}: {row}", flush=True)
    shutil.rmtree(WORK / "out" / "large", ignore_errors=True)
    return rows


# -- rendering ------------------------------------------------------------------------------------------
def _mb(n: float) -> str:
    return "-" if not n else f"{n / 1e6:.1f} MB" if n < 1e8 else f"{n / 1e6:.0f} MB"


def _mib(n: float) -> str:
    return "-" if not n else f"{n / 2**20:,.0f} MiB"


def _sentence(text: str, limit: int = 110) -> str:
    """The first clause of an error message, short enough for a table cell."""
    first = text.split(" (")[0].split("; ")[0]
    return first if len(first) <= limit else first[:limit].rsplit(" ", 1)[0] + " ..."


def render(results: dict[str, Any]) -> str:
    rows = [Row(**r) for r in results["rows"]]
    out = [f"Measured {results['date']} on {results['machine']['cpu']} ({results['machine']['usable_cores']} cores, "
           f"{results['machine']['ram_bytes'] / 2**30:.0f} GiB), `bench/int8.py` (`make -C bench int8`), commit "
           f"{results['source']['commit']}{' + uncommitted changes' if results['source'].get('uncommitted') else ''}. "
           "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + ".", ""]
    out += ["Time is the wall clock of the whole `bitpress quantize` command (process start, imports, the plugin "
            "environment's worker, the host's checks of the output); memory is the peak resident set of its "
            "process tree. Sizes are the output's files.", ""]
    skipped = sorted({(r.tool, r.note) for r in rows if r.status == "skipped"})
    for tool, note in skipped:
        out.append(f"- {TOOLS.get(tool, tool)}: skipped: {note}")
    if skipped:
        out.append("")
    for model in results["models"]:
        mrows = [r for r in rows if r.model == model and r.status != "skipped"]
        if not mrows:
            continue
        out.append(f"### {model} ({results['model_notes'][model]})")
        out.append("")
        real = model == "minilm-l3"
        head = ["tool", "mode", "bits", "embedding cosine (mean / min)", "hidden-state rel. L2"] if real else [
            "tool", "mode", "bits", "output rel. L2"]
        head += ["size", "time", "peak memory"]
        table = []
        for r in mrows:
            if r.status == "failed":
                cells = ["failed: " + _sentence(r.note)] + [""] * (2 if real else 1)
                table.append([r.tool, r.mode, r.precision, *cells[:2 if real else 1], "", f"{r.wall_s:.1f} s",
                              _mib(r.peak_rss)])
                continue
            err = ([f"{r.error['cosine_mean']:.5f} / {r.error['cosine_min']:.5f}", f"{r.error['rel_l2']:.4f}"]
                   if real else [f"{r.error['rel_l2']:.4f}"])
            mode = f"{r.mode}: {r.note}" if r.note else r.mode
            table.append([r.tool, mode, r.precision, *err, f"{_mb(r.bytes)} ({r.bytes / r.float_bytes:.2f}x)",
                          f"{r.wall_s:.1f} s", _mib(r.peak_rss)])
        out.append(markdown_table(head, table, "lll" + "r" * (len(head) - 3)))
        out.append("")
    if results.get("large"):
        out.append(f"### Peak memory on a large model ({results['model_notes']['large']})")
        out.append("")
        table = []
        for r in results["large"]:
            d, b = r.get("direct"), r.get("bitpress")
            table.append([r["mode"], f"{_mib(d['peak_rss'])}, {d['wall_s']:.0f} s" if d else "-",
                          f"{_mib(b['peak_rss'])}, {b['wall_s']:.0f} s" if b else "-"])
        out.append(markdown_table(["mode", "ONNX Runtime's API, called directly", "bitpress quantize (ort plugin)"],
                                  table, "lrr"))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def write_doc(text: str) -> None:
    doc = DOC.read_text() if DOC.exists() else f"# int8\n\n{BEGIN}\n{END}\n"
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC} lacks the markers {BEGIN} / {END}")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")


# -- main -----------------------------------------------------------------------------------------------
MODEL_NOTES = {
    "decoder": "synthetic Llama-like, hidden 256, 4 layers, vocab 4096, tied head, random weights; "
               "random calibration data",
    "encoder": "synthetic BERT-like, hidden 256, 4 layers; random calibration data",
    "convnet": "3 residual Conv + BatchNormalization + Relu blocks (32/64/128 channels), 64 x 64 images; "
               "random calibration data",
    "minilm-l3": "paraphrase-MiniLM-L3-v2, real weights; calibrated on 32 sentences, judged on 64 others",
    "large": "bitpress.synthetic bench-447mb decoder, 447 MB, untied; 16 random samples of 64 tokens",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["decoder", "encoder", "convnet", "minilm-l3", "large"])
    p.add_argument("--tools", nargs="+", default=list(TOOLS))
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--update", action="store_true",
                   help="merge these models' / tools' rows into the last full results and rewrite the doc")
    args = p.parse_args(argv)
    if args.render_only:
        write_doc(render(json.loads(RESULTS.read_text())))
        return 0
    full = set(args.models) == set(MODEL_NOTES) and set(args.tools) == set(TOOLS)
    reasons = available()
    rows: list[Row] = []
    large: list[dict[str, Any]] = []
    for model in args.models:
        if model == "large":
            if "ort" in args.tools:
                large = run_large(build_model("large"))
            continue
        if model == "minilm-l3":
            m = minilm()
            src, data, judge = m.model, ["--data", str(m.calib)], minilm_judge(m)
        else:
            src = build_model(model)
            data, judge = SYNTH_DATA, synthetic_judge(src)
        for mode in MODES:
            if mode.tool not in args.tools:
                continue
            row = run_mode(model, src, mode, data, reasons, judge)
            rows.append(row)
            print(f"[int8] {model}: {mode.tool} {mode.label}: {row.status} {row.error or row.note} "
                  f"{row.wall_s:.1f} s {row.peak_rss / 2**20:.0f} MiB", flush=True)
    env_versions = {}
    for env, packages in ENV_VERSIONED.items():
        python = ENVS / env / "bin" / "python"
        if python.exists() and env in args.tools:
            env_versions.update({f"{k} ({env} env)": v for k, v in benchkit.versions(python, packages).items()})
    results = {
        "date": dt.date.today().isoformat(), "machine": benchkit.machine_info(), "source": benchkit.source_state(),
        "versions": {**benchkit.versions(Path(PYTHON), VERSIONED), **env_versions},
        "models": [m for m in args.models if m != "large"], "model_notes": MODEL_NOTES,
        "rows": [asdict(r) for r in rows], "large": large,
    }
    if args.update and not full:
        old = json.loads(RESULTS.read_text())
        done = {(r.model, r.tool) for r in rows}
        old["rows"] = [r for r in old["rows"] if (r["model"], r["tool"]) not in done] + [asdict(r) for r in rows]
        order = {m: i for i, m in enumerate(old["models"])}
        old["rows"].sort(key=lambda r: (order.get(r["model"], 99), list(TOOLS).index(r["tool"])))
        if large:
            old["large"] = large
        old["updated"] = f"{results['date']}: {', '.join(args.models)} x {', '.join(args.tools)}"
        results, full = old, True
    text = render(results)
    if full:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1))
        write_doc(text)
        print(f"[int8] wrote {RESULTS} and {DOC}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
