"""Several models timed alternately, each in a worker process of its own.

For each thread count, every model is loaded in its own process (one after another, so load
times do not overlap), then the models are measured in rounds: in each round every model runs
one measurement, the order rotated from round to round, while the others wait idle. Machine
noise (another process, a frequency change) thus falls on all of them alike, and the ratios
between models are the result. The first ``warmup`` rounds are discarded; each figure is the
median of the ``runs`` rounds after them, with the spread (interquartile range over median)
beside it.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bitpress.errors import BitpressError, ModelLoadError, UsageError
from bitpress.speed.measure import SubjectSpec, kind_of

log = logging.getLogger(__name__)

#: seconds a worker may take for one answer (a load, one measurement) before the run is given up
ANSWER_TIMEOUT_S = 1800.0


@dataclass
class SpeedOptions:
    """How ``bitpress bench`` measures."""

    threads: list[int] = field(default_factory=lambda: [1])
    runs: int = 5  # measured rounds; each figure is their median
    warmup: int = 1  # rounds run first and discarded
    prompt_tokens: int = 128
    decode_tokens: int = 32
    profile: int = 0  # the N slowest nodes by ONNX Runtime's profiler (0: no profile)
    single_seconds: float = 0.2

    def validate(self) -> None:
        if not self.threads or any(not isinstance(t, int) or t < 1 or t > 1024 for t in self.threads):
            raise UsageError(f"threads must be whole numbers from 1 to 1024, got {self.threads}")
        for name, lo in (("runs", 1), ("warmup", 0), ("prompt_tokens", 1), ("decode_tokens", 1), ("profile", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < lo or value > 100_000:
                raise UsageError(f"{name} must be a whole number from {lo} to 100000, got {value!r}")


class External(Protocol):
    """A peer measured in the same rounds as the models (llama.cpp's ``llama-bench`` in bench/speed.py): it
    times one prompt and its decode steps as a GenAI package's measurement does (``prompt_s``,
    ``decode_step_s``), in whatever process it runs."""

    def load(self, threads: int) -> dict[str, Any]:
        """Prepare for ``threads``; ``{"load_s", "rss_after_load"}``."""
        ...

    def measure(self) -> dict[str, Any]:
        """One measurement: ``{"prompt_s", "decode_step_s"}``."""
        ...

    def close(self) -> int:
        """Its peak resident memory in bytes."""
        ...


@dataclass
class Subject:
    """One model as the user named it."""

    path: Path
    label: str
    kind: str  # "genai" or "onnx"
    bytes: int
    #: measured by this object in the rounds instead of a worker process (kind "genai": its figures are
    #: prompt and decode tokens per second)
    external: External | None = None

    @property
    def model_file(self) -> Path:
        """The .onnx file an ONNX Runtime session loads (for a package, its decoder)."""
        return resolve_onnx(self.path)


def resolve_onnx(path: Path) -> Path:
    """A .onnx file as given, a GenAI package's decoder, or a folder's only .onnx file."""
    from bitpress.genai.package import resolve_model

    return resolve_model(path, "benchmarked").path


def folder_bytes(path: Path) -> int:
    """Bytes of a model: a file and its external data (``<name>.data`` / ``.onnx.data`` beside it), or a folder."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    total = path.stat().st_size
    for extra in (path.with_name(path.name + ".data"), path.with_suffix(".data")):
        if extra != path and extra.is_file():
            total += extra.stat().st_size
    return total


def subjects_of(paths: list[str | Path], labels: list[str] | None = None) -> list[Subject]:
    """Check every path before anything is loaded: each must exist and be an ONNX model or a GenAI package."""
    if not paths:
        raise UsageError("bench needs at least one model (a .onnx file or an ONNX Runtime GenAI package folder)")
    if labels is not None and len(labels) != len(paths):
        raise UsageError(f"{len(labels)} labels for {len(paths)} models: give one label per model")
    out = []
    for i, raw in enumerate(paths):
        path = Path(raw)
        if not path.exists():
            raise ModelLoadError(f"model not found: {path}")
        kind = kind_of(path)
        if kind == "onnx":
            resolve_onnx(path)  # a folder without a single .onnx file is refused here, naming it
        label = labels[i] if labels is not None else (path.name if path.name not in ("model.onnx", "") else
                                                      path.parent.name)
        out.append(Subject(path, label, kind, folder_bytes(path)))
    seen: dict[str, int] = {}
    for s in out:  # two models of one name (a/model.onnx, b/model.onnx): keep the labels apart
        seen[s.label] = seen.get(s.label, 0) + 1
        if seen[s.label] > 1:
            s.label = f"{s.label}#{seen[s.label]}"
    return out


class Worker:
    """A ``python -m bitpress.speed.worker`` process holding one loaded model."""

    def __init__(self, spec: dict[str, Any], label: str) -> None:
        self.label = label
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(spec.get("threads", 1)))
        # what the worker's libraries print goes to a file: a pipe nobody reads could fill and stall it
        self.errors = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by kill(), the worker's end)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bitpress.speed.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.errors, text=True, env=env,
        )
        self.loaded = self.ask(spec, "load")

    def ask(self, payload: dict[str, Any], what: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(payload) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.proc.wait(timeout=30)
            self.errors.seek(0)
            err = self.errors.read().strip().splitlines()
            tail = err[-1] if err else f"exit code {self.proc.returncode}"
            raise BitpressError(f"bench: the process measuring {self.label} stopped during {what}: {tail[:400]}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise BitpressError(f"bench: {self.label}: {what} failed: {answer.get('error')}")
        return answer

    def close(self) -> int:
        """Ask the worker to exit; its peak resident memory in bytes (0 if it is already gone)."""
        peak = 0
        try:
            peak = int(self.ask({"cmd": "exit"}, "exit").get("peak_rss", 0))
        except BitpressError:
            pass
        finally:
            self.kill()
        return peak

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.errors):
            if f is not None:
                f.close()


class ExternalWorker:
    """An :class:`External` peer behind the :class:`Worker` interface."""

    def __init__(self, peer: External, threads: int, label: str) -> None:
        self.peer, self.label = peer, label
        try:
            self.loaded = peer.load(threads)
        except (OSError, RuntimeError, ValueError) as exc:
            raise BitpressError(f"bench: {label}: load failed: {exc}") from None

    def ask(self, payload: dict[str, Any], what: str) -> dict[str, Any]:
        try:
            return {"ok": True, **self.peer.measure()}
        except (OSError, RuntimeError, ValueError) as exc:
            raise BitpressError(f"bench: {self.label}: {what} failed: {exc}") from None

    def close(self) -> int:
        return int(self.peer.close())

    def kill(self) -> None:
        pass


def _spec(s: Subject, threads: int, o: SpeedOptions, *, profile: bool = False) -> dict[str, Any]:
    path = s.path if s.kind == "genai" and not profile else s.model_file
    spec = SubjectSpec(str(path), s.kind if not profile else "onnx", threads, o.prompt_tokens, o.decode_tokens,
                       o.single_seconds if not profile else 0.0).to_json()
    if profile:
        spec["profile"] = True
    return spec


def run(subjects: list[Subject], options: SpeedOptions,
        progress: Callable[[str], None] | None = None) -> dict[int, dict[str, Any]]:
    """Raw samples per thread count and model label: ``{threads: {label: {"load_s", "rss_after_load",
    "peak_rss", "samples": [measurement dicts], "order": [positions in each round]}}}``."""
    options.validate()
    say = progress or (lambda text: log.info("%s", text))
    results: dict[int, dict[str, Any]] = {}
    for threads in options.threads:
        workers: list[Worker | ExternalWorker] = []
        out: dict[str, Any] = {}
        try:
            for s in subjects:
                say(f"loading {s.label} ({threads} thread{'s' if threads > 1 else ''})")
                w = (ExternalWorker(s.external, threads, s.label) if s.external is not None
                     else Worker(_spec(s, threads, options), s.label))
                workers.append(w)
                out[s.label] = {"load_s": w.loaded["load_s"], "rss_after_load": w.loaded["rss_after_load"],
                                "samples": [], "order": []}
            rounds = options.warmup + options.runs
            n = len(workers)
            for r in range(rounds):
                say(f"round {r + 1}/{rounds}" + (" (warm-up)" if r < options.warmup else "")
                    + f", {threads} thread{'s' if threads > 1 else ''}")
                for pos in range(n):
                    w = workers[(r + pos) % n]  # the order rotates: each model runs first in some round
                    answer = w.ask({"cmd": "measure"}, "a measurement")
                    if r >= options.warmup:
                        out[w.label]["samples"].append({k: v for k, v in answer.items() if k != "ok"})
                        out[w.label]["order"].append(pos)
            for w in workers:
                out[w.label]["peak_rss"] = w.close()
        finally:
            for w in workers:
                w.kill()
        results[threads] = out
    return results


def run_profile(subjects: list[Subject], options: SpeedOptions,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The slowest nodes of each model's ONNX Runtime session at batch 1 (one token), first thread count."""
    say = progress or (lambda text: log.info("%s", text))
    threads = options.threads[0]
    out = {}
    for s in subjects:
        if s.external is not None:
            continue
        say(f"profiling {s.label}")
        w = Worker(_spec(s, threads, options, profile=True), s.label)
        try:
            out[s.label] = {k: v for k, v in w.ask({"cmd": "profile", "runs": max(3, options.runs)}, "profiling")
                            .items() if k != "ok"}
        finally:
            w.kill()
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> float:
    """Interquartile range over the median (0 for fewer than 4 values: the range over the median)."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    if not med:
        return 0.0
    if len(values) < 4:
        return (max(values) - min(values)) / med
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / med
