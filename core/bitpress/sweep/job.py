"""One job of a sweep: run its workflow, evaluate the output against the input, give its row.

:func:`run_job` is what runs, wherever it runs: in a child process of the driver
(``python -m bitpress.sweep.job JOB.json RESULT.json``, the ``threads`` executor, so that a
crash or the memory of one job cannot take the sweep with it) or in a Ray worker process (the
``ray`` executor). Its argument and its result are plain JSON values.

A job's output is written by the workflow, atomically: a job that fails or is stopped leaves
no output (a previous output of the same job is replaced only by a complete new one).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bitpress.errors import BitpressError, ExportError, ModelLoadError

log = logging.getLogger(__name__)

#: thread pools of native libraries (OpenMP, BLAS) sized for each job's child process
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def one_line(text: Any, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def base_row(spec: dict[str, Any]) -> dict[str, Any]:
    """A job's row before it ran: what it is."""
    return {
        "id": spec["id"], "model": spec["model"], "pass": spec["pass"], "precision": spec["precision"],
        "options": spec["options"], "point": spec["point"], "label": spec["label"],
        "status": "pending", "error": None, "output": None, "output_bytes": None, "model_bytes": None,
        "input_bytes": None, "bits_per_weight": None, "metrics": None, "seconds": {},
        "source": spec.get("source"),  # a Hub id model: its repo, revision and commit (None: a local path)
    }


def quantized_path(model: Path, output: Path) -> Path:
    """What the workflow wrote for ``model`` in the folder ``output``: the file of the same name,
    or (a folder model) the folder itself."""
    return output / model.name if model.is_file() else output


def _failed(row: dict[str, Any], stage: str, job_id: str, exc: Exception) -> None:
    """``row`` as a failed job's: the error's one line (an unexpected exception is an internal error)."""
    if isinstance(exc, BitpressError):
        row["status"], row["error"] = "failed", one_line(f"{stage}: {exc}")
        return
    log.debug("job %s failed", job_id, exc_info=True)
    row["status"], row["error"] = "failed", one_line(f"{stage}: internal error: {type(exc).__name__}: {exc}")


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one job (see :mod:`bitpress.sweep.runner` for ``spec``) and return its row.

    A failure of the job (any error of the workflow or the evaluation) is the row's status, with
    its one-line reason: it never raises, except for an interruption (``KeyboardInterrupt``).
    """
    from bitpress.evaluate.runner import evaluate
    from bitpress.workflow.runner import run

    if spec.get("cell") is not None:
        return run_cell(spec)
    row = base_row(spec)
    start = time.perf_counter()
    model, output, root = Path(spec["model"]), Path(spec["output"]), Path(spec["root"])
    stage = "quantize"
    try:
        result = run(spec["workflow"], origin=spec.get("source"))  # a Hub id's commit, in the output's metadata
        row["seconds"]["quantize"] = round(time.perf_counter() - start, 3)
        row["output_bytes"] = result.output_bytes
        row["model_bytes"] = result.output_model_bytes
        row["input_bytes"] = result.input_model_bytes
        row["bits_per_weight"] = _reported_bits(result)
        quantized = quantized_path(model, output)
        row["output"] = os.path.relpath(quantized, root)
        if spec.get("eval") is not None:
            stage = "evaluate"
            t0 = time.perf_counter()
            res = evaluate(quantized, model, **spec["eval"])
            row["seconds"]["evaluate"] = round(time.perf_counter() - t0, 3)
            row["metrics"] = metrics(res)
            if res.bits_per_weight is not None:
                row["bits_per_weight"] = round(float(res.bits_per_weight), 6)
        row["status"] = "ok"
    except Exception as exc:  # a bitpress error, or a plugin's bug: the job fails, the sweep goes on
        _failed(row, stage, spec["id"], exc)
    row["seconds"]["total"] = round(time.perf_counter() - start, 3)
    return row


# -- a cell of the export matrix (``publish:``) ----------------------------------------------------------
#: bits of a float package's weights, by the matrix's dtype names
_FLOAT_BITS = {"f32": 32, "fp32": 32, "float32": 32, "f16": 16, "fp16": 16, "float16": 16, "bf16": 16,
               "bfloat16": 16}


def run_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """One cell of the export matrix: built by :func:`bitpress.genai.publish.publish` (a one-cell matrix)
    into a temporary folder, moved whole to the job's output; a cpu / default package is then
    evaluated against the reference cell's package (perplexity on the sweep's text), as publish's
    ``matrix.eval`` does. Never raises, except for an interruption (as :func:`run_job`)."""
    from bitpress.genai.publish import publish

    row = base_row(spec)
    start = time.perf_counter()
    cell, model = spec["cell"], Path(spec["model"])
    output, root = Path(spec["output"]), Path(spec["root"])
    stage = "build"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".job-{spec['id']}-publish-", dir=output.parent) as tmp:
            built = Path(tmp) / "out"
            res = publish({"input": str(model), "output": str(built), "matrix": cell["matrix"]}, overwrite=True)
            got = res.cells[0]
            if got.status != "ok":
                raise ExportError(got.reason or "the cell failed")
            _replace(built / got.folder, output)
        row["seconds"]["build"] = round(time.perf_counter() - start, 3)
        files = [p for p in output.rglob("*") if p.is_file()]
        row["output_bytes"] = sum(p.stat().st_size for p in files)
        row["model_bytes"] = sum(p.stat().st_size for p in files if ".onnx" in p.name)
        row["input_bytes"] = _hf_weight_bytes(model)
        row["bits_per_weight"] = _package_bits(output, cell.get("dtype"))
        row["output"] = os.path.relpath(output, root)
        ev = spec.get("eval")
        if ev is not None and ev.get("text") and cell.get("reference"):
            stage = "evaluate"
            t0 = time.perf_counter()
            row["metrics"] = evaluate_cell(output, Path(root) / "runs" / cell["reference"], cell, ev)
            row["seconds"]["evaluate"] = round(time.perf_counter() - t0, 3)
        row["status"] = "ok"
    except Exception as exc:  # a bitpress error, or a plugin's bug: the job fails, the sweep goes on
        _failed(row, stage, spec["id"], exc)
    row["seconds"]["total"] = round(time.perf_counter() - start, 3)
    return row


def evaluate_cell(package: Path, reference: Path, cell: dict[str, Any], ev: dict[str, Any]) -> dict[str, Any]:
    """A package against its reference cell's package, measured as publish's ``matrix.eval`` measures
    (:func:`bitpress.genai.publish.evaluate_cells`): perplexity on the text's windows, no weight SQNR."""
    from bitpress.evaluate.runner import evaluate

    if not (reference / "genai_config.json").is_file():
        raise ModelLoadError(f"the reference cell {cell['reference_folder']} (job {reference.name}) has no package: "
                            "its job failed; fix it (its row says why) and rerun the sweep")
    res = evaluate(package, reference, text=ev["text"], tokenizer=ev.get("tokenizer"), seq_len=ev["seq_len"],
                   max_windows=ev.get("max_windows"), weights=False, jobs=1, speed=ev.get("speed", True),
                   speed_runs=ev.get("speed_runs", 3))
    out = metrics(res)
    ppl = res.perplexity
    out["reference"] = cell["reference_folder"]
    out["windows"] = ppl.windows if ppl else None
    return out


def _replace(src: Path, dest: Path) -> None:
    """Move the folder ``src`` to ``dest``, a previous ``dest`` replaced only once ``src`` is there."""
    old = dest.with_name(f".job-{dest.name}-old")
    if dest.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(dest, old)
    os.replace(src, dest)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def _hf_weight_bytes(model: Path) -> int | None:
    if not model.is_dir():
        return None
    files = [p for p in model.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt")]
    return sum(p.stat().st_size for p in files) or None


def _package_bits(package: Path, dtype: str | None) -> float | None:
    """Bits per weight of a package: its dtype's for a float cell, else its quantized weights'
    (:func:`bitpress.evaluate.runner.bits_per_weight` of its decoder); None when unknown."""
    if dtype is not None:
        bits = _FLOAT_BITS.get(str(dtype).lower())
        return None if bits is None else float(bits)
    from bitpress.evaluate.runner import bits_per_weight
    from bitpress.models.onnx_model import OnnxModel

    bits: float | None = None
    for path in sorted(package.glob("*.onnx")):
        try:
            got = bits_per_weight(OnnxModel.load(path))
        except BitpressError:
            continue
        if got is not None:
            bits = round(float(got), 6)
            break
    return bits


def _reported_bits(result: Any) -> float | None:
    for _name, _src, rep in result.reports:
        bits = getattr(rep, "bits_per_weight", None)
        if isinstance(bits, int | float) and not isinstance(bits, bool):
            return round(float(bits), 6)
    return None


def metrics(res: Any) -> dict[str, Any]:
    """The figures of an :class:`~bitpress.evaluate.EvalResult` a sweep compares (JSON values)."""
    data = res.to_json()  # NaN and infinities as strings, as in `bitpress eval --json`
    outputs = data["outputs"]
    main = next((o for o in outputs if o.get("is_logits")), outputs[0] if outputs else None)
    ppl = data.get("perplexity") or {}
    sqnr = data.get("sqnr_summary") or {}
    out: dict[str, Any] = {
        "data": data["data"],
        "output": main["name"] if main else None,
        "relative_error": main["relative_l2"] if main else None,
        "cosine": main["cosine"] if main else None,
        "max_abs_error": main["max_abs_error"] if main else None,
        "top1_agreement": main["top1_agreement"] if main else None,
        "perplexity": ppl.get("quantized"),
        "reference_perplexity": ppl.get("reference"),
        "perplexity_change": ppl.get("relative_change"),
        "sqnr_median_db": sqnr.get("median_db"),
        "sqnr_min_db": sqnr.get("min_db"),
    }
    speed = data.get("speed")
    if speed:  # the output against its input, timed alternately: ratios, and the figures they come from
        q, key = speed["quantized"], "decode" if speed["kind"] == "genai" else "single"
        out.update({
            "speedup": speed["ratios"][key], "prompt_speedup": speed["ratios"]["prompt"],
            "tokens_per_s": q.get("decode_tokens_per_s", q.get("single_tokens_per_s")),
            "prompt_tokens_per_s": q["prompt_tokens_per_s"], "peak_rss": q["peak_rss"],
            "speed_machine": f"{speed['machine']['cpu']} ({' '.join(speed['machine']['flags'])}), "
                             f"{speed['threads']} thread(s)",
        })
    return out


# -- in a child process (the threads executor) -----------------------------------------------------
class Children:
    """The child processes of the running jobs, so that an interrupted sweep stops them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen[bytes]] = set()
        self.stopping = False

    def add(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._procs.add(proc)
            stop = self.stopping
        if stop:
            _terminate(proc)

    def remove(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._procs.discard(proc)

    def stop(self) -> None:
        """SIGTERM to every running job: each cleans up (its temporary output) and exits."""
        with self._lock:
            self.stopping = True
            procs = list(self._procs)
        for proc in procs:
            _terminate(proc)


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        proc.terminate()


def run_in_subprocess(spec: dict[str, Any], children: Children) -> dict[str, Any]:
    """:func:`run_job` in a child process of this Python (``python -m bitpress.sweep.job``).

    The child's death (a native crash, the kernel's out-of-memory killer) is the job's failure,
    with what the child printed last.
    """
    if children.stopping:
        row = base_row(spec)
        row["status"], row["error"] = "stopped", "the sweep was interrupted before the job started"
        return row
    runs = Path(spec["output"]).parent
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f".job-{spec['id']}-", dir=runs) as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(spec), encoding="utf-8")
        cmd = [sys.executable, "-m", "bitpress.sweep.job", str(job_file), str(result_file)]
        env = dict(os.environ)
        threads = spec.get("threads")
        if threads:  # the native libraries' pools the size of the job's share of the cores, as Ray does for its tasks
            for var in _THREAD_VARS:
                env.setdefault(var, str(threads))
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env)
        children.add(proc)
        try:
            printed, _ = proc.communicate()
        finally:
            children.remove(proc)
        text = printed.decode("utf-8", "replace")
        if text.strip():
            log.debug("job %s printed:\n%s", spec["id"], text.rstrip())
        if result_file.is_file():
            try:
                return json.loads(result_file.read_text(encoding="utf-8"))
            except ValueError:
                pass
    row = base_row(spec)
    code = proc.returncode
    how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
    if code in (-signal.SIGKILL, 137):
        how += " (out of memory?)"
    last = next((line for line in reversed(text.strip().splitlines()) if line.strip()), "")
    row["status"] = "stopped" if children.stopping else "failed"
    row["error"] = one_line(f"the job's process {how}" + (f": {last}" if last else ""))
    row["seconds"]["total"] = round(time.perf_counter() - start, 3)
    return row


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _watch_parent() -> None:
    """Stop this job (SIGTERM: its cleanup runs) when the sweep that started it is gone."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="bitpress-sweep-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """``python -m bitpress.sweep.job JOB.json RESULT.json``: run the job, write its row."""
    from bitpress.interrupts import handle_signals

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m bitpress.sweep.job JOB.json RESULT.json", file=sys.stderr)
        return 2
    job_file, result_file = Path(args[0]), Path(args[1])
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("bitpress")
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    root.propagate = False
    _watch_parent()
    try:
        with handle_signals():
            row = run_job(json.loads(job_file.read_text(encoding="utf-8")))
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", int(signal.SIGINT))
        print(f"job interrupted by {_signal_name(signum)}", file=sys.stderr)
        return 128 + signum
    tmp = result_file.with_name(result_file.name + ".tmp")
    tmp.write_text(json.dumps(row), encoding="utf-8")
    os.replace(tmp, result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
