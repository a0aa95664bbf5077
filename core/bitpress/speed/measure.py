"""One model, loaded and timed: the worker-process side of ``bitpress bench``.

Two kinds of subject:

* a **GenAI package** (a folder with ``genai_config.json``): ``onnxruntime_genai`` loads it; one
  measurement appends a prompt of ``prompt_tokens`` tokens (timed: prompt tokens/s) and then
  generates ``decode_tokens`` greedy tokens (timed per step: decode tokens/s), as a user's
  application does;
* a **plain ONNX model**: an ONNX Runtime session; one measurement runs the model at batch 1
  (one token: ``[1, 1]`` ids or rows, after a cache of ``prompt_tokens`` positions for a KV-cache
  decoder) and at a prompt-sized batch (``[1, prompt_tokens]``).

Inputs are synthetic (token ids in the vocabulary, ones for masks, positions counted): speed
does not depend on their values, and generation is held to ``decode_tokens`` steps whatever
token comes out. Each subject runs in a process of its own (:mod:`bitpress.speed.worker`), so
its load time and peak resident memory are its own.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: the genai_config.json that makes a folder an ONNX Runtime GenAI package
GENAI_CONFIG = "genai_config.json"


@dataclass(frozen=True)
class SubjectSpec:
    """What a worker loads and how it measures (JSON-serialisable: sent to the worker process)."""

    path: str
    kind: str  # "genai" or "onnx"
    threads: int
    prompt_tokens: int
    decode_tokens: int
    #: a batch-1 ONNX call is repeated until one measurement takes about this long (its mean is reported)
    single_seconds: float = 0.2
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def kind_of(path: Path) -> str:
    """``genai`` for a folder with ``genai_config.json``, else ``onnx`` (a file, or a folder's model)."""
    return "genai" if path.is_dir() and (path / GENAI_CONFIG).is_file() else "onnx"


def _status(field: str) -> int:
    """A memory figure of ``/proc/self/status`` in bytes (0 where unknown)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    return _status("VmRSS")


def peak_rss_bytes() -> int:
    """This process's high-water mark of resident memory since it started its program.

    ``VmHWM`` belongs to the process's current address space; ``ru_maxrss`` would not do: a process
    started from a large one (fork, then exec) inherits the parent's high-water mark in it.
    Elsewhere than Linux, ``ru_maxrss`` (bytes on macOS, kilobytes on other systems) is the fallback.
    """
    peak = _status("VmHWM")
    if peak:
        return peak
    maxrss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def _vocab(path: Path, config: dict[str, Any] | None) -> int:
    model = (config or {}).get("model") or {}
    return int(model.get("vocab_size") or 0) or 1000


def prompt_ids(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    """``n`` deterministic token ids, away from the low ids special tokens tend to take."""
    lo = min(100, max(vocab // 10, 0))
    return np.random.default_rng(seed).integers(lo, max(vocab, lo + 1), size=n).astype(np.int32)


class GenaiSubject:
    """An ONNX Runtime GenAI package: prompt and decode tokens per second through ``onnxruntime_genai``."""

    def __init__(self, spec: SubjectSpec) -> None:
        import onnxruntime_genai as og

        self.og = og
        self.spec = spec
        folder = Path(spec.path)
        config = json.loads((folder / GENAI_CONFIG).read_text())
        self.prompt = prompt_ids(_vocab(folder, config), spec.prompt_tokens, spec.seed)
        from bitpress.genai.package import sliding_window

        self.window = sliding_window(config)  # a sliding-window KV cache must hold the window
        cfg = og.Config(str(folder))
        options = {"intra_op_num_threads": spec.threads, "inter_op_num_threads": 1}
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
        t0 = time.perf_counter()
        self.model = og.Model(cfg)
        self.load_s = time.perf_counter() - t0

    def measure(self) -> dict[str, float]:
        og, spec = self.og, self.spec
        total = spec.prompt_tokens + spec.decode_tokens + 1
        params = og.GeneratorParams(self.model)
        # min_length: an end-of-sequence token does not stop the run early
        params.set_search_options(max_length=max(total, self.window), min_length=total, do_sample=False)
        gen = og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(self.prompt[None, :])  # the prompt's forward pass
        t1 = time.perf_counter()
        gen.generate_next_token()  # picks the first token from the prompt's logits
        t2 = time.perf_counter()
        steps = 0
        while steps < spec.decode_tokens and not gen.is_done():
            gen.generate_next_token()  # one forward pass on the previous token, then its pick
            steps += 1
        t3 = time.perf_counter()
        if steps == 0:
            raise RuntimeError("the package generated no token after the prompt")
        return {"prompt_s": t1 - t0 + (t2 - t1), "decode_step_s": (t3 - t2) / steps, "decode_steps": steps}


class OnnxSubject:
    """A plain ONNX model in an ONNX Runtime session: latency at batch 1 and at a prompt-sized batch."""

    def __init__(self, spec: SubjectSpec, profile_prefix: str | None = None) -> None:
        import onnx
        import onnxruntime as ort

        from bitpress.speed.feeds import speed_feeds

        self.spec = spec
        path = Path(spec.path)
        proto = onnx.load(str(path), load_external_data=False)  # the signature only
        so = ort.SessionOptions()
        so.intra_op_num_threads = spec.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if profile_prefix:
            so.enable_profiling = True
            so.profile_file_prefix = profile_prefix
        t0 = time.perf_counter()
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.load_s = time.perf_counter() - t0
        self.feeds = speed_feeds(proto, path.parent, spec.prompt_tokens, spec.seed)
        self.reps = 0

    def _single(self) -> float:
        feed = self.feeds["single"]
        if not self.reps:  # the first call sets how many calls one measurement takes
            t0 = time.perf_counter()
            self.session.run(None, feed)
            first = time.perf_counter() - t0
            self.reps = int(min(1000, max(1, round(self.spec.single_seconds / max(first, 1e-6)))))
        t0 = time.perf_counter()
        for _ in range(self.reps):
            self.session.run(None, feed)
        return (time.perf_counter() - t0) / self.reps

    def measure(self) -> dict[str, float]:
        single = self._single()
        t0 = time.perf_counter()
        self.session.run(None, self.feeds["prompt"])
        return {"single_s": single, "prompt_s": time.perf_counter() - t0, "single_reps": self.reps}

    def end_profiling(self) -> str:
        return self.session.end_profiling()


def load(spec: SubjectSpec) -> GenaiSubject | OnnxSubject:
    return GenaiSubject(spec) if spec.kind == "genai" else OnnxSubject(spec)
