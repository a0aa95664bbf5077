"""The sweep's driver: run the jobs through an executor, record each row as it comes, resume.

``OUT/results.jsonl`` holds one JSON row per finished job, appended whole (one write of one
line, flushed and synced) as each job finishes; ``OUT/runs/<id>/`` holds each job's output and
``OUT/report.html`` is rewritten after every row. A rerun skips the jobs whose latest row is
``ok`` (and whose output is still there); failed ones run again; ``fresh`` reruns everything
(and starts a new results.jsonl).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bitpress.errors import BitpressError, ConfigError, OutputError
from bitpress.sweep.config import SweepConfig, parse_sweep

log = logging.getLogger(__name__)

RESULTS = "results.jsonl"
REPORT = "report.html"
RUNS = "runs"
#: a workflow's temporary output folder (``.<name>.bitpress-<8 hex>``) and a job's (``.job-<id>-...``)
_STALE = re.compile(r"^\.(.+\.bitpress-[0-9a-f]{8}|job-[0-9a-f]+-.+)$")


@dataclass
class SweepResult:
    """What a sweep did, and every row of its jobs (in the config's order)."""

    output: Path
    rows: list[dict[str, Any]]
    ran: int = 0
    skipped: int = 0
    metric: str = "relative_error"
    x_metric: str = "bits_per_weight"
    #: model name (as the report shows it) -> the rows on its size / error Pareto front
    pareto: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # model path -> name in the report
    seconds: float = 0.0

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == "failed"]

    @property
    def report(self) -> Path:
        return self.output / REPORT

    @property
    def results(self) -> Path:
        return self.output / RESULTS

    def to_json(self) -> dict[str, Any]:
        return {
            "output": str(self.output), "report": str(self.report), "results": str(self.results),
            "jobs": len(self.rows), "ran": self.ran, "skipped": self.skipped, "failed": len(self.failed),
            "metric": self.metric, "x": self.x_metric, "seconds": round(self.seconds, 3),
            "pareto": {name: [r["id"] for r in rows] for name, rows in self.pareto.items()},
            "rows": self.rows,
        }


# -- results.jsonl ---------------------------------------------------------------------------------
class ResultStore:
    """``results.jsonl``: rows appended as whole lines; the latest row of an id counts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: Any = None

    def load(self) -> dict[str, dict[str, Any]]:
        """The latest row of every id; a partial last line (a writer killed mid-line) is dropped."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise OutputError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        if raw and not raw.endswith(b"\n"):
            cut = raw.rfind(b"\n") + 1
            log.warning("%s ends with a partial line (a sweep was killed while writing it): dropped", self.path)
            raw = raw[:cut]
            self._replace(raw)
        rows: dict[str, dict[str, Any]] = {}
        for n, line in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                log.warning("%s line %d is not JSON: ignored", self.path, n)
                continue
            if isinstance(row, dict) and isinstance(row.get("id"), str):
                rows[row["id"]] = row
        return rows

    def reset(self) -> None:
        """Start an empty file (``fresh``)."""
        self._replace(b"")

    def _replace(self, data: bytes) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise OutputError(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def append(self, row: dict[str, Any]) -> None:
        from bitpress.interrupts import deferred

        line = (json.dumps(row, sort_keys=True, default=str) + "\n").encode("utf-8")
        with deferred():  # a signal waits until the line is whole
            try:
                if self._file is None:
                    self._file = open(self.path, "ab")  # noqa: SIM115 - held open for the sweep
                self._file.write(line)
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as exc:
                raise OutputError(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# -- the driver ------------------------------------------------------------------------------------
def sweep(
    config: dict[str, Any] | str | Path | SweepConfig,
    *,
    output: str | Path | None = None,
    executor: Any = None,
    address: str | None = None,
    jobs: int | None = None,
    fresh: bool = False,
    progress: Callable[..., Any] | None = None,
    registry: Any = None,
) -> SweepResult:
    """Run a sweep config (a mapping, or a YAML / JSON file): every model x pass x grid point.

    The CLI's ``sweep`` flags, by name: ``output`` (``-o``, over the config's ``output``),
    ``executor`` (``--executor``: ``"threads"``, ``"ray"`` or ``{"type": "ray", "address": ...}``),
    ``address`` (``--address``: a Ray cluster, implies ray), ``jobs`` (``--jobs``: jobs at once),
    ``fresh`` (``--fresh``: rerun the jobs done before too). The whole config is validated first
    (:class:`~bitpress.errors.ConfigError` and the other errors of a workflow config); a job that
    fails is a row with its reason, not an error. Returns a :class:`~bitpress.sweep.runner.SweepResult`
    (``rows``, ``pareto``, ``report``; ``to_json()``). See docs/sweep.md.
    """
    from bitpress.sweep.config import load_sweep_config

    if isinstance(config, SweepConfig):
        cfg = config
    else:
        raw = dict(config) if isinstance(config, dict) else load_sweep_config(Path(config))
        cfg = parse_sweep(raw, registry)
    out = Path(output) if output is not None else cfg.output
    if out is None:
        raise ConfigError("the sweep needs an output folder: give 'output:' in the config or -o OUT")
    spec = _executor(executor if executor is not None else cfg.executor, address)
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ConfigError(f"jobs: expected a positive number of jobs at once, got {jobs!r}")
    if out.exists() and not out.is_dir():
        raise OutputError(f"the sweep's output {out} is a file; give a folder")
    start = time.perf_counter()
    runs = out / RUNS
    try:
        runs.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the sweep's output {out}: {exc.strerror or exc}") from None
    from bitpress.output import OutputLock

    with OutputLock(out / "sweep", out):  # one sweep per output folder at a time
        _remove_stale(runs)
        store = ResultStore(out / RESULTS)
        if fresh:
            store.reset()
        done = store.load()
        rows = {job.id: done.get(job.id) for job in cfg.jobs}
        todo = [job for job in cfg.jobs if fresh or not _finished(done.get(job.id), out)]
        state = _State(cfg, out, rows, skipped=len(cfg.jobs) - len(todo))
        state.write_report()
        if todo:
            log.info("sweep: %d job(s) to run, %d done before", len(todo), state.skipped)
            try:
                _run(cfg, todo, out, spec, jobs, store, state, progress)
            finally:
                store.close()
                state.write_report()
        result = state.result()
    result.seconds = time.perf_counter() - start
    return result


def _executor(value: Any, address: str | None) -> Any:
    from bitpress.executors import ExecutorSpec

    try:
        spec = ExecutorSpec.from_value(value)
        if address is not None and value is not None and spec.type != "ray":
            raise ConfigError(f"an address (--address {address}) is a Ray cluster's: use it with the ray executor, "
                              f"not {spec.type}")
        if address is not None:
            spec = ExecutorSpec.from_value({**spec.to_json(), "type": "ray", "address": address})
    except BitpressError as exc:
        raise ConfigError(f"executor: {exc}") from None
    return spec


def _finished(row: dict[str, Any] | None, out: Path) -> bool:
    """A job done before: its latest row is ok and its output is still there."""
    if row is None or row.get("status") != "ok":
        return False
    rel = row.get("output")
    return isinstance(rel, str) and (out / rel).exists()


def _remove_stale(runs: Path) -> None:
    """Temporary folders of jobs a killed sweep left (the sweep's lock is held: none is in use)."""
    for entry in runs.iterdir():
        if _STALE.match(entry.name) and entry.is_dir() and not entry.is_symlink():
            log.info("removing %s, left by an interrupted job", entry)
            shutil.rmtree(entry, ignore_errors=True)


class _State:
    """The rows so far, and the report written from them."""

    def __init__(self, cfg: SweepConfig, out: Path, rows: dict[str, dict[str, Any] | None], skipped: int) -> None:
        from bitpress.sweep.job import base_row

        self.cfg, self.out, self.skipped, self.ran = cfg, out, skipped, 0
        self.rows = {job.id: rows.get(job.id) or base_row(_job_spec(job, cfg, out, None)) for job in cfg.jobs}

    def add(self, row: dict[str, Any]) -> None:
        self.rows[row["id"]] = row
        self.ran += 1

    def write_report(self) -> None:
        from bitpress.sweep.report import write_report

        write_report(self.out / REPORT, list(self.rows.values()), self.cfg)

    def result(self) -> SweepResult:
        from bitpress.sweep.report import model_names, pareto_rows, x_metric

        rows = list(self.rows.values())
        metric = self.cfg.metric
        xkey = x_metric(rows, metric)
        names = model_names([str(m) for m in self.cfg.models], self.cfg.sources)
        front = pareto_rows(rows, xkey, metric)
        pareto = {names[m]: [r for r in rows if r["id"] in ids] for m, ids in front.items()}
        return SweepResult(self.out, rows, ran=self.ran, skipped=self.skipped, metric=metric, x_metric=xkey,
                           pareto=pareto, names=names)


def _job_spec(job: Any, cfg: SweepConfig, out: Path, threads: int | None) -> dict[str, Any]:
    """What a job needs to run (plain JSON: it travels to a child process or a Ray worker)."""
    run_dir = (out / RUNS / job.id).absolute()
    return {
        "id": job.id, "model": job.model, "pass": job.pass_name, "precision": job.precision,
        "options": job.options, "point": job.point, "label": job.label(),
        "output": str(run_dir), "root": str(out.absolute()), "threads": threads,
        "workflow": job.workflow(run_dir, threads=threads, data=cfg.data, save=cfg.save),
        "eval": cfg.eval.kwargs() if cfg.eval is not None else None,
        "cell": job.cell,
        "source": cfg.sources.get(job.model),  # a Hub id model's repo and commit
    }


def _held(todo: list[Any]) -> dict[str, list[Any]]:
    """Publish cells to run after their reference cell's job (when it runs in this sweep too), by its id."""
    ids = {job.id for job in todo}
    held: dict[str, list[Any]] = {}
    for job in todo:
        ref = job.cell.get("reference") if job.cell is not None else None
        if ref is not None and ref != job.id and ref in ids:
            held.setdefault(ref, []).append(job)
    return held


def _default_jobs(todo: int) -> int:
    """Jobs at once by default: half the cores (each job uses threads too), at most the jobs to run."""
    return max(1, min(todo, (os.cpu_count() or 2) // 2))


def _shared_files(cfg: SweepConfig, out: Path) -> list[Path]:
    """Files every Ray node must see: the models, the evaluation's text and tokenizer, a marker in OUT."""
    files: list[Path] = []
    for model in cfg.models:
        if model.is_file():
            files += [model, *sorted(model.parent.glob(model.name + ".data*"))]
        else:
            files += sorted(p for p in model.rglob("*") if p.is_file())[:200]
    if cfg.eval is not None:
        for value in (cfg.eval.text, cfg.eval.tokenizer, cfg.eval.data):
            if value and value != "random" and Path(value).is_file():
                files.append(Path(value))
    marker = out / ".bitpress-sweep"
    marker.write_text("the output of a bitpress sweep; the Ray workers check that they see this file\n")
    files.append(marker)
    return files


def _run(cfg: SweepConfig, todo: list[Any], out: Path, spec: Any, jobs: int | None, store: ResultStore,
         state: _State, progress: Callable[..., Any] | None) -> None:
    from bitpress.executors import open_executor
    from bitpress.interrupts import deferred, note_written
    from bitpress.sweep.job import Children, run_in_subprocess, run_job

    want = jobs or cfg.parallel or _default_jobs(len(todo))
    children = Children()
    bar = progress(None, total=len(todo), desc="sweep", unit="job") if progress is not None else None
    try:
        with open_executor(spec, jobs=want) as ex:
            if spec.type == "ray":
                ex.check_shared(_shared_files(cfg, out))
                threads = cfg.threads or max(1, int(spec.num_cpus))
            else:
                threads = cfg.threads or max(1, (os.cpu_count() or 1) // ex.workers)
            log.info("sweep: %d job(s) at once (%s), %d thread(s) each", ex.workers, spec.type, threads)
            futures: dict[Future[Any], Any] = {}

            def submit(job: Any) -> None:
                job_spec = _job_spec(job, cfg, out, threads)
                if spec.type == "ray":
                    fut = ex.submit(run_job, job_spec)
                else:
                    fut = ex.submit(run_in_subprocess, job_spec, children)
                futures[fut] = job

            # a publish cell compared with its reference cell starts once the reference's job is done
            held = _held(todo)
            waiting = {job.id for jobs_after in held.values() for job in jobs_after}
            for job in todo:
                if job.id not in waiting:
                    submit(job)
            try:
                while futures:
                    finished, _ = wait(list(futures), return_when=FIRST_COMPLETED)
                    for fut in finished:
                        job = futures.pop(fut)
                        row = _row(fut, job, cfg, out)
                        if row["status"] == "stopped":
                            continue
                        # the row, and what an interruption says was kept, together: a signal waits for both
                        with deferred():
                            store.append(row)
                            state.add(row)
                            note_written(_Recorded(store.path, state.ran))
                        state.write_report()
                        if row["status"] == "ok":
                            log.info("job %s (%s, %s): ok in %.1f s", job.id, job.label(), Path(job.model).name,
                                     row["seconds"].get("total", 0.0))
                        else:
                            log.warning("job %s (%s, %s) failed: %s", job.id, job.label(), Path(job.model).name,
                                        row["error"])
                        if bar is not None:
                            bar.update(1)
                        for dependent in held.pop(job.id, []):
                            submit(dependent)
            except BaseException:
                children.stop()  # every running job cleans up and exits; those not started never start
                for fut in futures:
                    fut.cancel()
                raise
    finally:
        close = getattr(bar, "close", None)
        if close is not None:
            close()


@dataclass(frozen=True)
class _Recorded:
    """The rows an interrupted sweep kept, as the CLI's "... had been written completely" names them."""

    path: Path
    count: int

    def __str__(self) -> str:
        return f"the rows of the {self.count} job(s) finished ({self.path}; rerun the sweep to resume)"


def _row(fut: Future[Any], job: Any, cfg: SweepConfig, out: Path) -> dict[str, Any]:
    """The row a job returned; the executor's own failure (a Ray worker lost) as a failed row."""
    from bitpress.sweep.job import base_row, one_line

    try:
        row = fut.result()
    except BitpressError as exc:
        row = base_row(_job_spec(job, cfg, out, None))
        row["status"], row["error"] = "failed", one_line(exc)
    except Exception as exc:
        row = base_row(_job_spec(job, cfg, out, None))
        row["status"], row["error"] = "failed", one_line(f"internal error: {type(exc).__name__}: {exc}")
    if not isinstance(row, dict) or row.get("id") != job.id:
        row = base_row(_job_spec(job, cfg, out, None))
        row["status"], row["error"] = "failed", "the job returned no row"
    return row
