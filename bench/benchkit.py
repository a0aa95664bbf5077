"""Shared machinery of the benchmark scripts: run a tool in a fresh process and measure it,
judge the quality of its output, collect machine facts, write markdown tables.

A benchmark script (``bench_rtn.py``, later ``bench_hqq.py`` ...) only declares its models,
its variants and a table of tools (name -> command builder); :func:`run_suite` does the rest
and writes ``.work/results/<suite>.json``, which ``report.py`` turns into
``docs/benchmarks.md``.

Memory is the peak resident set of the whole process tree, sampled every few milliseconds from
``/proc/<pid>/status`` (RssAnon + RssFile + RssShmem, so pages of memory-mapped files count),
and cross-checked with the kernel's exact high-water mark of the largest single process
(``ru_maxrss`` from ``wait4``): the reported peak is the larger of the two.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
WORK = BENCH_DIR / ".work"
RESULTS = WORK / "results"
POLL_S = 0.005


# -- models, variants, tools ----------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    """A benchmark model: built once into ``.work/models/<name>/model.onnx`` and reused."""

    name: str
    description: str
    build: Callable[[Path], Path]  # path -> path, builds the model there
    repeats: int = 1  # timed runs per (tool, variant); the median is reported
    eval_batch: int = 1
    eval_seq: int = 32

    @property
    def path(self) -> Path:
        return WORK / "models" / self.name / "model.onnx"

    def ensure(self) -> Path:
        path = self.path
        if not path.exists():
            print(f"[bench] building {self.name} into {path.parent}", flush=True)
            tmp = path.parent.with_name(path.parent.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            self.build(tmp / "model.onnx")
            shutil.rmtree(path.parent, ignore_errors=True)
            tmp.rename(path.parent)
        return path


@dataclass(frozen=True)
class Variant:
    """One configuration every tool is asked to reproduce."""

    block_size: int
    symmetric: bool

    @property
    def key(self) -> str:
        return f"b{self.block_size}-{'sym' if self.symmetric else 'asym'}"

    @property
    def label(self) -> str:
        return f"block {self.block_size}, {'symmetric' if self.symmetric else 'asymmetric'}"


@dataclass(frozen=True)
class Job:
    """What a command builder gets: the input, where to write, the variant, a scratch folder."""

    model: Path
    output: Path  # a folder that does not exist yet; the tool creates it
    variant: Variant
    scratch: Path  # exists; for config files a tool needs


#: returns the argv (and optional extra environment), or None when the tool cannot do the variant
CommandBuilder = Callable[[Job], "tuple[list[str], dict[str, str]] | None"]


@dataclass(frozen=True)
class Tool:
    name: str  # short key used in tables: "bitpress", "ort", "olive", ...
    label: str  # what it is, for the docs
    command: CommandBuilder
    side: str = "peer"  # "bitpress" or "peer": ratios are bitpress rows over peer rows
    baseline: bool = True  # bitpress rows: the row ratios are computed for
    quality_from: str | None = None  # writes the same output as this tool: its quality is not re-measured

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.]+", "-", self.name).strip("-")


# -- measuring one process tree ----------------------------------------------------------------------
@dataclass
class Measurement:
    wall_s: float
    user_s: float
    sys_s: float
    peak_rss: int  # bytes: max(sampled tree peak, kernel max of the largest process)
    kernel_maxrss: int  # bytes: ru_maxrss of the largest process of the tree (exact)
    sampled_peak: int  # bytes: largest sum over the tree seen by sampling
    peak_anon: int  # bytes: anonymous (+shmem) part of the sampled peak
    peak_file: int  # bytes: file-backed part of the sampled peak (mmapped files, libraries)
    processes: int  # distinct processes seen in the tree
    others_cores: float  # CPU cores that other processes of the machine kept busy meanwhile
    returncode: int


# The tool is started by this helper, not by the benchmark process itself: Linux carries a
# process's RSS high-water mark across fork + exec, so a child spawned straight from a
# benchmark process holding 1+ GB would report that as its own ru_maxrss. The helper is a few MB.
_SPAWN = """
import json, os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, ru = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"maxrss": ru.ru_maxrss * 1024, "user": ru.ru_utime, "sys": ru.ru_stime}, f)
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def _proc_mem(pid: int) -> tuple[int, int, int] | None:
    """(RssAnon, RssFile, RssShmem) in bytes, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read()
    except OSError:
        return None
    vals = {b"RssAnon:": 0, b"RssFile:": 0, b"RssShmem:": 0}
    for line in text.splitlines():
        key = line.split(b"\t", 1)[0].split(b" ", 1)[0]
        if key in vals:
            vals[key] = int(line.split()[1]) * 1024
    return vals[b"RssAnon:"], vals[b"RssFile:"], vals[b"RssShmem:"]


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (via /proc/<pid>/task/*/children)."""
    out: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out += kids
            stack += kids
    return out


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_measured(
    argv: Sequence[str], log: Path, env: dict[str, str] | None = None, timeout: float = 3600,
    cwd: Path | None = None,
) -> Measurement:
    """Run ``argv`` in a fresh process (output to ``log``), sampling its tree's memory."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    usage_file = log.with_suffix(".rusage.json")
    usage_file.unlink(missing_ok=True)
    with open(log, "wb") as out:
        out.write(("$ " + " ".join(str(a) for a in argv) + "\n").encode())
        out.flush()
        self0 = os.times()
        busy0 = _busy_cpu_s()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _SPAWN, str(usage_file), *(str(a) for a in argv)],
            stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=cwd, start_new_session=True,
        )
        helper = proc.pid
        seen: set[int] = set()
        try:
            _sample(proc, helper, t0, timeout, seen, peaks := [0, 0, 0])
        except BaseException:  # interrupted: do not leave the tool running in its own session
            os.killpg(helper, 9)
            raise
        peak, peak_anon, peak_file = peaks
        wall = time.perf_counter() - t0
        busy = _busy_cpu_s() - busy0
        self1 = os.times()
    try:
        usage = json.loads(usage_file.read_text())
    except (OSError, json.JSONDecodeError):
        usage = {"maxrss": 0, "user": math.nan, "sys": math.nan}
    mine = usage["user"] + usage["sys"] + (self1.user - self0.user) + (self1.system - self0.system)
    return Measurement(
        wall_s=wall, user_s=usage["user"], sys_s=usage["sys"], peak_rss=max(usage["maxrss"], peak),
        kernel_maxrss=usage["maxrss"], sampled_peak=peak, peak_anon=peak_anon, peak_file=peak_file,
        processes=len(seen), others_cores=max(0.0, (busy - mine) / wall) if wall else 0.0,
        returncode=proc.returncode,
    )


def _sample(proc: subprocess.Popen[bytes], helper: int, t0: float, timeout: float, seen: set[int],
            peaks: list[int]) -> None:
    """Poll the tool's process tree until it exits; ``peaks`` = [total, anon, file] at the largest total."""
    peak = 0
    while proc.poll() is None:
        tree = _children(helper)
        seen.update(tree)
        anon = filed = 0
        for p in tree:
            mem = _proc_mem(p)
            if mem is not None:
                anon += mem[0] + mem[2]
                filed += mem[1]
        if anon + filed > peak:
            peak = anon + filed
            peaks[:] = [peak, anon, filed]
        if time.perf_counter() - t0 > timeout:
            os.killpg(helper, 9)  # the tool's whole process group
        time.sleep(POLL_S)


def tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def model_size(path: Path) -> int:
    """An .onnx file plus its external data files."""
    return path.stat().st_size + sum(p.stat().st_size for p in path.parent.glob(path.name + ".data*"))


def find_onnx(output: Path) -> Path:
    if output.is_file():
        return output
    found = sorted(output.rglob("*.onnx"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one .onnx under {output}, found {[str(p) for p in found]}")
    return found[0]


# -- quality -----------------------------------------------------------------------------------
def session(path: Path | str, *, threads: int | None = None, exact_qdq: bool = False) -> Any:
    """A quiet ONNX Runtime CPU session of the saved model at ``path`` (ONNX Runtime is imported here, so
    that benchkit imports in any environment).

    ``threads``: its intra-op threads (default: ONNX Runtime's, every core). ``exact_qdq``: ONNX Runtime's own
    ``DequantizeLinear -> MatMul`` fusion at float32 accuracy (``session.qdq_matmulnbits_accuracy_level=1``)
    instead of its default int8 activations, so that a QDQ model computes what its graph says.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads is not None:
        opts.intra_op_num_threads = threads
    if exact_qdq:
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_logits(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    sess = session(path)
    out = sess.run(None, feeds)[0]
    del sess
    return np.asarray(out, dtype=np.float32)


def reference_logits(model: Model) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Random feeds and the float model's logits, cached beside the model."""
    from bitpress.synthetic import random_inputs

    path = model.path
    cache = path.parent / f"reference-b{model.eval_batch}-s{model.eval_seq}.npz"
    stamp = f"{model_size(path)}-{path.stat().st_mtime_ns}"
    if cache.exists():
        data = np.load(cache)
        if str(data["stamp"]) == stamp:
            feeds = {k.removeprefix("feed:"): data[k] for k in data.files if k.startswith("feed:")}
            return feeds, data["logits"]
    feeds = random_inputs(path, batch=model.eval_batch, seq=model.eval_seq, seed=0)
    logits = run_logits(path, feeds)
    np.savez(cache, stamp=np.array(stamp), logits=logits, **{f"feed:{k}": v for k, v in feeds.items()})
    return feeds, logits


def logits_metrics(ref: np.ndarray, out: np.ndarray) -> dict[str, float]:
    ref64 = ref.astype(np.float64)
    diff = out.astype(np.float64) - ref64
    top1 = float(np.mean(ref.argmax(-1) == out.argmax(-1)))
    return {"logits_rel_l2": float(np.linalg.norm(diff) / np.linalg.norm(ref64)), "top1_agreement": top1}


def _sumsq(a: np.ndarray) -> float:
    flat = a.reshape(-1)
    step = 1 << 24
    return float(sum(np.dot(flat[i:i + step].astype(np.float64), flat[i:i + step].astype(np.float64))
                     for i in range(0, flat.size, step)))


class _Tensors:
    """Initializers of a model by name, read lazily (external data memory-mapped)."""

    def __init__(self, path: Path, load_external: bool) -> None:
        import onnx

        self.path = path
        self.proto = onnx.load(str(path), load_external_data=load_external)
        self.inits = {t.name: t for t in self.proto.graph.initializer}
        self.producers = {o: n for n in self.proto.graph.node for o in n.output}
        self.by_name = {n.name: n for n in self.proto.graph.node if n.name}

    def array(self, name: str) -> np.ndarray:
        import onnx
        from onnx import numpy_helper

        t = self.inits[name]
        if t.data_location != onnx.TensorProto.EXTERNAL:
            return numpy_helper.to_array(t)
        info = {e.key: e.value for e in t.external_data}
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        return np.memmap(self.path.parent / info["location"], dtype=dtype, mode="r",
                         offset=int(info.get("offset", 0)), shape=tuple(t.dims))


def _original_node(orig: _Tensors, qnode: Any) -> Any:
    """The float model's node a quantized node replaced: by name (every tool names it
    ``<original name>_Q<bits>``), else by output name, with the tools' suffixes stripped."""
    name = re.sub(r"_Q\d+$", "", qnode.name)
    if name and name in orig.by_name:
        return orig.by_name[name]
    out = qnode.output[0]
    for candidate in (out, re.sub(r"_Q\d+$", "", out), out.removesuffix("_MatMulNBits")):
        if candidate in orig.producers:
            return orig.producers[candidate]
    return None


def _float_weight(orig: _Tensors, qnode: Any) -> np.ndarray | None:
    """The float weight (as ``[K, N]`` for MatMul-like ops, ``[vocab, hidden]`` for Gather) that
    ``qnode`` replaced."""
    node = _original_node(orig, qnode)
    op_type = qnode.op_type
    if node is None:
        return None
    if op_type == "GatherBlockQuantized":
        return orig.array(node.input[0]) if node.op_type == "Gather" and node.input[0] in orig.inits else None
    b = node.input[1] if len(node.input) > 1 else ""
    if b in orig.inits:
        w = orig.array(b)
        trans_b = any(a.name == "transB" and a.i for a in node.attribute)
        return w.T if node.op_type == "Gemm" and trans_b else w
    tr = orig.producers.get(b)
    if tr is not None and tr.op_type == "Transpose" and tr.input[0] in orig.inits:
        return orig.array(tr.input[0]).T
    return None


def _unpack4(p: np.ndarray) -> np.ndarray:
    return np.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)


def _dequant_matmul_nbits(q: _Tensors, node: Any) -> np.ndarray:
    """``[K, N]`` float32 weight of a MatMulNBits node (layout of the com.microsoft op spec)."""
    attrs = {a.name: a.i for a in node.attribute}
    k, n, bits, bs = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
    nb = -(-k // bs)
    b = np.asarray(q.array(node.input[1]), dtype=np.uint8).reshape(n, nb, -1)
    vals = (_unpack4(b) if bits == 4 else b).astype(np.float32)  # [N, nb, bs]
    scales = np.asarray(q.array(node.input[2]), dtype=np.float32).reshape(n, nb)
    zp_name = node.input[3] if len(node.input) > 3 else ""
    if not zp_name:
        zp = np.full((n, nb), 2 ** (bits - 1), np.float32)
    else:
        z = np.asarray(q.array(zp_name))
        if z.dtype == np.uint8:
            z = z.reshape(n, -1)
            zp = (_unpack4(z) if bits == 4 else z)[:, :nb].astype(np.float32)
        else:
            zp = z.astype(np.float32).reshape(n, nb)
    w = (vals - zp[..., None]) * scales[..., None]
    return w.reshape(n, nb * bs)[:, :k].T


def _dequant_by_ort(q: _Tensors, node: Any, rows: int) -> np.ndarray:
    """Run a GatherBlockQuantized node (and the constant nodes feeding it) on ids 0..rows-1,
    so whatever data type and zero-point convention a tool chose, the kernel decides."""
    import onnx
    from onnx import helper

    ids = node.input[1]
    nodes, inits, stack = [node], set(), [i for i in node.input if i and i != ids]
    while stack:
        name = stack.pop()
        if name in q.inits:
            inits.add(name)
        elif name in q.producers:
            prod = q.producers[name]
            nodes.insert(0, prod)
            stack += [i for i in prod.input if i]
    graph = helper.make_graph(
        nodes, "dequant", [helper.make_tensor_value_info(ids, onnx.TensorProto.INT64, [rows])],
        [helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)],
        initializer=[q.inits[i] for i in sorted(inits)],
    )
    m = helper.make_model(graph, opset_imports=list(q.proto.opset_import), ir_version=q.proto.ir_version)
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {ids: np.arange(rows, dtype=np.int64)})[0], dtype=np.float32)


def weight_error(float_model: Path, quant_model: Path) -> dict[str, Any]:
    """Relative Frobenius error of every dequantized weight vs its float original, pooled."""
    orig = _Tensors(float_model, load_external=False)
    q = _Tensors(quant_model, load_external=True)
    num = den = 0.0
    worst = 0.0
    counts: dict[str, int] = {}
    unmatched = 0
    for node in q.proto.graph.node:
        if node.op_type not in ("MatMulNBits", "GatherBlockQuantized"):
            continue
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
        w = _float_weight(orig, node)
        if w is None:
            unmatched += 1
            continue
        wf = np.asarray(w, dtype=np.float32)
        by_ort = node.op_type != "MatMulNBits"
        deq = _dequant_by_ort(q, node, wf.shape[0]) if by_ort else _dequant_matmul_nbits(q, node)
        d2 = _sumsq(deq - wf)
        w2 = _sumsq(wf)
        num += d2
        den += w2
        worst = max(worst, math.sqrt(d2 / w2) if w2 else 0.0)
        del deq, wf, w
    float_matmuls = sum(1 for n in q.proto.graph.node if n.op_type in ("MatMul", "Gemm")
                        and any(i in q.inits for i in n.input[1:2]))
    return {
        "weight_rel_err": math.sqrt(num / den) if den else float("nan"),
        "weight_rel_err_worst": worst,
        "quantized_nodes": counts,
        "unmatched_nodes": unmatched,
        "float_weight_matmuls_left": float_matmuls,
    }


def evaluate(model: Model, quant_model: Path) -> dict[str, Any]:
    feeds, ref = reference_logits(model)
    result: dict[str, Any] = logits_metrics(ref, run_logits(quant_model, feeds))
    result.update(weight_error(model.path, quant_model))
    return result


# -- the suite ---------------------------------------------------------------------------------
@dataclass
class Row:
    model: str
    tool: str
    variant: str
    command: list[str]
    runs: list[dict[str, Any]] = field(default_factory=list)
    output_bytes: int = 0
    quality: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def values(self, key: str) -> list[float]:
        return [r[key] for r in self.runs if r["returncode"] == 0]

    def summary(self) -> dict[str, float]:
        """Best (minimum) wall time: other processes can only slow a run down; median memory."""
        ok = [r for r in self.runs if r["returncode"] == 0]
        if not ok:
            return {"wall_s": math.nan, "wall_median_s": math.nan, "cpu_s": math.nan, "peak_rss": math.nan,
                    "peak_anon": math.nan, "peak_file": math.nan, "others_cores": math.nan}
        best = min(ok, key=lambda r: r["wall_s"])
        return {
            "wall_s": best["wall_s"],
            "wall_median_s": statistics.median(r["wall_s"] for r in ok),
            "cpu_s": min(r["user_s"] + r["sys_s"] for r in ok),
            "peak_rss": statistics.median(r["peak_rss"] for r in ok),
            "peak_anon": statistics.median(r["peak_anon"] for r in ok),
            "peak_file": statistics.median(r["peak_file"] for r in ok),
            "others_cores": best["others_cores"],
        }


def run_suite(
    suite: str, models: Sequence[Model], variants: Sequence[Variant], tools: Sequence[Tool], *,
    only_models: Iterable[str] | None = None, only_tools: Iterable[str] | None = None,
    keep_outputs: bool = False, extra: dict[str, Any] | None = None, merge: bool = False,
) -> dict[str, Any]:
    """Every tool on every model and variant; timed runs interleaved across tools, then quality."""
    chosen_models = [m for m in models if not only_models or m.name in set(only_models)]
    chosen_tools = [t for t in tools if not only_tools or t.name in set(only_tools)]
    rows: list[Row] = []
    model_info = []
    source_before = source_state()
    for model in chosen_models:
        path = model.ensure()
        size = model_size(path)
        model_info.append({"name": model.name, "description": model.description, "bytes": size,
                           "repeats": model.repeats, "eval": f"batch {model.eval_batch} x seq {model.eval_seq}"})
        print(f"[bench] {model.name}: {size / 1e6:.0f} MB; reference logits", flush=True)
        reference_logits(model)  # also warms the page cache for every tool alike
        out_root = WORK / "out" / model.name
        jobs: list[tuple[Row, Tool, Job]] = []
        for variant in variants:
            for tool in chosen_tools:
                job = Job(path, out_root / f"{tool.slug}-{variant.key}", variant,
                          WORK / "scratch" / model.name / f"{tool.slug}-{variant.key}")
                built = _fresh(tool, job)
                if built is None:
                    continue
                row = Row(model.name, tool.name, variant.key, [str(a) for a in built[0]])
                rows.append(row)
                jobs.append((row, tool, job))
        for rep in range(model.repeats):
            for row, tool, job in jobs:
                if row.error:
                    continue
                built = _fresh(tool, job)  # a fresh scratch (tool caches) and output every run
                assert built is not None
                argv, env = built
                log = WORK / "logs" / model.name / f"{tool.slug}-{job.variant.key}-{rep}.log"
                print(f"[bench] {model.name} {tool.name} {job.variant.key} run {rep + 1}/{model.repeats}",
                      end="", flush=True)
                m = run_measured(argv, log, env, cwd=job.scratch)
                print(f": {m.wall_s:.2f} s, {m.peak_rss / 1e9:.2f} GB"
                      + ("" if m.returncode == 0 else f", FAILED rc={m.returncode} (see {log})"), flush=True)
                row.runs.append(asdict(m))
                if m.returncode != 0:
                    row.error = f"exit code {m.returncode}; last lines of {log.name}: " + _tail(log)
                    continue
                if rep == 0:
                    try:
                        onnx_path = find_onnx(job.output)
                        row.output_bytes = tree_size(job.output)
                        same = [r for r in rows if r.tool == tool.quality_from and r.model == row.model
                                and r.variant == row.variant and r.quality]
                        row.quality = (dict(same[0].quality, same_as=tool.quality_from) if same
                                       else evaluate(model, onnx_path))
                    except Exception as exc:  # a tool's broken output is a result, not a crash
                        row.error = f"evaluation failed: {type(exc).__name__}: {exc}"
                if not keep_outputs and rep == model.repeats - 1:
                    shutil.rmtree(job.output, ignore_errors=True)
                    shutil.rmtree(job.scratch, ignore_errors=True)
    source_after = source_state()
    if source_after != source_before:
        print(f"[bench] WARNING: the code under test changed during the run ({source_before} -> {source_after})",
              flush=True)
    result = {
        "suite": suite,
        "source": source_before,
        "source_changed_during_run": source_after != source_before,
        "machine": machine_info(),
        "models": model_info,
        "variants": [{"key": v.key, "label": v.label} for v in variants],
        "tools": [{"name": t.name, "label": t.label, "side": t.side} for t in chosen_tools],
        "rows": [asdict(r) | r.summary() | {"source": source_before} for r in rows],
        **(extra or {}),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{suite}.json"
    if out.exists() and (only_models or only_tools or merge):
        result = _merge(json.loads(out.read_text()), result, [m.name for m in models])
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"[bench] wrote {out}", flush=True)
    return result


def _merge(old: dict[str, Any], new: dict[str, Any], model_order: list[str]) -> dict[str, Any]:
    """``new`` rows replace the same (model, tool, variant) of an earlier, partial run; the rest stays."""
    keys = {(r["model"], r["tool"], r["variant"]) for r in new["rows"]}
    rows = [r for r in old.get("rows", []) if (r["model"], r["tool"], r["variant"]) not in keys] + new["rows"]
    order = {name: i for i, name in enumerate(model_order)}
    models = {m["name"]: m for m in old.get("models", [])} | {m["name"]: m for m in new["models"]}
    tools = {t["name"]: t for t in old.get("tools", [])} | {t["name"]: t for t in new["tools"]}
    variants = {v["key"]: v for v in old.get("variants", [])} | {v["key"]: v for v in new["variants"]}
    return new | {
        "rows": rows,
        "models": sorted(models.values(), key=lambda m: order.get(m["name"], -1)),
        "tools": list(tools.values()),
        "variants": list(variants.values()),
    }


def _fresh(tool: Tool, job: Job) -> tuple[list[str], dict[str, str]] | None:
    shutil.rmtree(job.output, ignore_errors=True)
    shutil.rmtree(job.scratch, ignore_errors=True)
    job.scratch.mkdir(parents=True)
    return tool.command(job)


def _tail(log: Path, lines: int = 5) -> str:
    text = log.read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])


def last_error(log: Path) -> str:
    """The most telling line of a failed run's log: its last exception line, else its last line."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").replace("\r", "\n").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error:" in ln or ln.startswith("bitpress: "):
            return ln[:400]
    return lines[-1][:400] if lines else "(no output)"


class Progress:
    """A run's clock, and its log lines: ``[name   12.3s] message`` (seconds since the start), flushed."""

    def __init__(self, name: str, width: int = 7) -> None:
        self.name, self.width, self.start = name, width, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, msg: str) -> None:
        print(f"[{self.name} {self.elapsed():{self.width}.1f}s] {msg}", flush=True)


# -- facts about the machine and the software -----------------------------------------------------------
#: the CPU flags that decide how fast numpy / ORT / torch kernels run here
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx_vnni", "amx_bf16", "amx_int8", "asimd", "asimddp", "sve")


def simd_flags() -> tuple[list[str], str]:
    """The :data:`SIMD_FLAGS` this CPU has, and where ``bitpress.cpu`` read the CPU's flags."""
    from bitpress.cpu import cpu_flags

    flags = cpu_flags()
    return [f for f in SIMD_FLAGS if f in flags.flags], flags.source


def write_doc(out: Path, lines: list[str]) -> int:
    """Write a bench's Markdown table (``lines``) to ``out``, say so, and give the script's exit status."""
    out.write_text("\n".join([*lines, ""]), encoding="utf-8")
    print(f"wrote {out}")
    return 0


def utc_now() -> str:
    """The date and time a document is generated: ``2025-01-31 12:34 UTC``."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def git_state() -> str:
    """The commit checked out, ``+ uncommitted changes`` when the work tree has any; ``unknown`` without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}{' + uncommitted changes' if dirty else ''}"


def machine_info() -> dict[str, Any]:
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
        "ram_bytes": mem, "kernel": platform.release(), "python": sys.version.split()[0],
    }


def source_state(paths: Sequence[str] = ("core", "plugins")) -> dict[str, Any]:
    """The git commit of the code under test, and a digest of uncommitted changes to it."""
    import hashlib

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                                  check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    diff = git("diff", "HEAD", "--", *paths) + git("ls-files", "--others", "--exclude-standard", "--", *paths)
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip() or "unknown",
        "uncommitted": hashlib.sha1(diff.encode()).hexdigest()[:10] if diff else None,
    }


def versions(python: Path, packages: Sequence[str]) -> dict[str, str]:
    """Installed versions of ``packages`` in the environment of ``python``."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for p in sys.argv[1:]:\n"
        "    try: out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: out[p] = 'not installed'\n"
        "print(json.dumps(out))\n"
    )
    try:
        res = subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True, check=True)
        return json.loads(res.stdout)
    except (OSError, subprocess.CalledProcessError, json.JSONDecodeError):
        return dict.fromkeys(packages, "unavailable")


# -- markdown ------------------------------------------------------------------------------------
def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub table; ``align`` is one letter per column (l, r, c), default left."""
    align = align or "l" * len(headers)
    marks = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(marks[a] for a in align) + " |"]
    for r in rows:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |")
    return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def fmt_ratio(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}x"


# -- the documents the one-run comparisons write -------------------------------------------------------
def doc_arguments(p: argparse.ArgumentParser, doc: Path) -> None:
    """The options every document-writing script has: ``--out`` (default ``doc``) and ``--command``."""
    p.add_argument("--out", type=Path, default=doc)
    p.add_argument("--command", default=None, help="the command to record in the document")


def doc_meta(script: str, args: argparse.Namespace, argv: Sequence[str] | None, progress: Progress,
             python: Path, packages: Sequence[str], **extra: Any) -> dict[str, Any]:
    """What :func:`provenance` and a document's footer say: the command (``args.command``, else ``python
    bench/<script> <argv>``), date, total seconds so far, machine, :data:`SIMD_FLAGS`, git state, ``extra``, and
    the versions of ``packages`` in the environment of ``python``."""
    return {
        "command": args.command or f"python bench/{script} " + shlex.join(argv or sys.argv[1:]),
        "date": utc_now(), "total_s": progress.elapsed(), "machine": machine_info(),
        "cpu_flags": simd_flags()[0], "git": git_state(), **extra, "versions": versions(python, packages),
    }


def cell(x: float | None, spec: str) -> str:
    """A table cell: ``x`` formatted, or ``-`` when it was not measured."""
    return "-" if x is None else format(x, spec)


def provenance(meta: dict[str, Any]) -> str:
    """The line saying how, when, on what and from which commit a document was generated."""
    m = meta["machine"]
    return (f"Generated by `{meta['command']}` on {meta['date']} ({meta['total_s'] / 60:.1f} min); git {meta['git']}. "
            f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.0f} GiB RAM; CPU flags: "
            f"{', '.join(meta['cpu_flags'])}.")


def write_report(work: Path, out: Path, meta: dict[str, Any], rows: list[Any], render: Callable[..., str]) -> None:
    """``work/results.json`` (the raw figures) and the document ``out`` rendered from them."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "results.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    out.write_text(render(meta, rows), encoding="utf-8")
