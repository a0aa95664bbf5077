"""Quantize a Hugging Face checkpoint tensor by tensor: the whole model is never in memory.

What loading the model would decide is decided on its structure alone: the model is built on
the meta device (:func:`bitpress.hf.stream_checkpoint.meta_model`, no weight memory), and
:func:`bitpress.hf.quantize.plan` runs on it unchanged (categories, MoE experts, ties, overrides,
``modules_to_not_convert``, split ties, tied-table group sizes). Then every tensor of the output
is known (name, dtype, shape) before any is computed, so each output shard's header is written
first (:mod:`bitpress.hf.safetensors_writer`) and the tensors after it, each at its offset:

* a quantized weight is read from its file in row chunks and solved by
  :func:`bitpress.hf.quantize.solve_rows`, the solve of the in-memory path, in ``jobs`` threads
  with a bounded number in flight; the driver writes ``P_qweight``, ``P_scales``, ``P_qzeros``.
  Transposed fused experts (gpt-oss's ``(E, K, OUT)``, ``quantize.Job.transposed``) are read one
  expert matrix at a time and solved as its ``[OUT, K]`` transpose, as in memory;
* every other tensor is copied through in bounded pieces, cast to the dtype the loaded model
  holds it in (transformers' ``dtype="auto"``: the parameter's).

``config.json`` and the companion files are written by :mod:`bitpress.hf.checkpoint`'s own
functions, so the folder is byte for byte what loading, quantizing and :func:`save_model` write
(one shard); past ``max_shard_size`` it is sharded with ``model.safetensors.index.json``.

:func:`why_not` and :class:`~bitpress.hf.stream_checkpoint.NotStreamable` say when streaming
cannot give that result (a model already in memory, model code in the folder, an already
quantized or pickled checkpoint, tensors transformers renames or fuses when loading, ...): the
pass then loads the whole model, after one log line saying why.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bitpress.executors import ExecutorSpec, open_executor
from bitpress.hf import checkpoint, quantize, safetensors_writer
from bitpress.hf.model import HfModel
from bitpress.hf.qtensor import DTYPES, QuantSpec, dtype_name, pack_bits
from bitpress.hf.rules import Rules, Settings
from bitpress.hf.safetensors_writer import (
    Entry,
    SafetensorsWriter,
    plan_shards,
    shard_names,
    write_index,
)
from bitpress.hf.stream_checkpoint import SAFETENSORS_CODES, CheckpointFiles, NotStreamable, meta_model
from bitpress.interrupts import cancel_pending
from bitpress.models import hf_files
from bitpress.onnx.weightonly import Report
from bitpress.quant.solver import BlockSolver

log = logging.getLogger(__name__)

#: bytes of a float tensor read (and written) at once when it is copied through
COPY_BYTES = 64 << 20


@dataclass
class Unit:
    """One group of the output's state dict: a quantized weight, or a tensor copied through."""

    name: str
    entries: list[Entry]
    source: str  # the checkpoint tensor it is made from
    job: quantize.Job | None = None
    dtype: torch.dtype | None = None  # of a copied tensor


@dataclass
class Prepared:
    """Everything decided before any tensor is read."""

    model: nn.Module
    plan: quantize.Plan
    units: list[Unit]
    modules: dict[str, Any] = field(default_factory=dict)
    tied: list[list[str]] = field(default_factory=list)


def why_not(model: HfModel) -> str | None:
    """Why ``model`` must be loaded whole instead of streamed (checks that need no torch), or None."""
    if model.loaded:
        return "the model is already in memory (an earlier pass loaded it)"
    raw = hf_files.read_json(model.source, "config.json")
    if not isinstance(raw, dict):
        return "config.json is not a JSON object"
    if raw.get("auto_map"):
        return "the folder ships its own model code (auto_map)"
    qc = raw.get("quantization_config")
    if isinstance(qc, dict) and qc.get("online") and not qc.get("modules"):
        return "the checkpoint carries a rotation's online product (quantization_config.online), which streaming " \
               "does not copy"
    if qc:
        return "the checkpoint is already quantized (its config.json has a quantization_config)"
    st, pk = hf_files.weight_files(model.source)
    if not st:
        return "its weights are pickled (.bin / .pt), not safetensors" if pk else "it has no safetensors weights"
    return None


def prepare(folder: Path, ckpt: CheckpointFiles, rules: Rules, *, float_zero_points: bool) -> Prepared:
    """The meta model, the plan (raises as :func:`quantize.plan` does) and the output's tensors."""
    try:
        model, source = meta_model(folder, ckpt)
    except NotStreamable:
        raise
    except Exception as exc:  # transformers cannot build it: loading the model says why, in its words
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise NotStreamable(f"its structure cannot be built on the meta device ({first[:200]})") from None
    p = quantize.plan(model, rules, float_zero_points=float_zero_points)
    # what apply() does to the parameters, with meta stand-ins: the groups save_model would see
    for job in p.jobs:
        new = nn.Parameter(torch.empty(job.param.shape, dtype=job.param.dtype, device="meta"), requires_grad=False)
        for ep in job.quantized:
            setattr(ep.module, ep.attr, new)
    by_stand_in = {id(getattr(job.quantized[0].module, job.quantized[0].attr)): job for job in p.jobs}
    out = Prepared(model, p, [])
    for names, value in checkpoint.parameter_groups(model):
        canonical = names[0]
        if len(names) > 1:
            out.tied.append(names)
        job = by_stand_in.get(id(value))
        if job is None:
            code = SAFETENSORS_CODES[value.dtype]
            out.units.append(Unit(canonical, [Entry(canonical, code, tuple(value.shape))], source[id(value)],
                                  dtype=value.dtype))
            continue
        s = job.settings
        spec = QuantSpec(s.bits, s.group_size, s.symmetric, tuple(job.param.shape), job.param.dtype, job.zero_points,
                         transposed=job.transposed)
        out.modules[canonical] = spec.to_json()
        entries = [Entry(f"{canonical}_qweight", "U8", (spec.rows, spec.n_blocks, s.group_size * s.bits // 8)),
                   Entry(f"{canonical}_scales", "F32", (spec.rows, spec.n_blocks))]
        if job.zero_points != "none":
            code = "F32" if job.zero_points == "float" else "U8"
            entries.append(Entry(f"{canonical}_qzeros", code, (spec.rows, spec.n_blocks)))
        out.units.append(Unit(canonical, entries, source[id(job.param)], job=job))
    return out


@dataclass
class _Solved:
    unit: Unit
    arrays: list[np.ndarray]
    error: float


@dataclass(frozen=True)
class RemoteSolve:
    """One weight's solve for a worker process (a Ray task): where its bytes are (a checked file of the
    input folder, resolved; byte offset; stored dtype; shape) and how to quantize it. Picklable and
    small: the worker reads the rows itself and returns the packed arrays."""

    path: str
    offset: int
    stored_dtype: str  # safetensors code
    shape: tuple[int, ...]
    dtype: str  # the parameter's (as loading casts it), a key of qtensor.DTYPES
    settings: Settings
    zero_points: str
    name: str
    chunk_elements: int
    transposed: bool = False  # (.., K, OUT) stored: solve each matrix's [OUT, K] transpose


def _rows(read_stored: Callable[[int, int], torch.Tensor], shape: tuple[int, ...],
          transposed: bool) -> tuple[Callable[[int, int], torch.Tensor], int, int]:
    """The rows the solve reads (``read(r0, r1)``), their count and width: the stored rows, or for a transposed
    ``(.., K, OUT)`` tensor the rows of each ``[K, OUT]`` matrix's transpose (one matrix read and kept at a time)."""
    if not shape or not shape[-1]:
        return read_stored, 0, 0
    if not transposed:
        return read_stored, int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    k, n = shape[-2], shape[-1]
    held: dict[int, torch.Tensor] = {}

    def read(r0: int, r1: int) -> torch.Tensor:
        parts, r = [], r0
        while r < r1:
            e, i = divmod(r, n)
            end = min(r1 - e * n, n)
            if e not in held:
                held.clear()
                held[e] = read_stored(e * k, (e + 1) * k).T  # [OUT, K]
            parts.append(held[e][i:end])
            r = e * n + end
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return read, int(np.prod(shape[:-2], dtype=np.int64)) * n, k


def _solve_with(read_stored: Callable[[int, int], torch.Tensor], rows: int, k: int, dtype: torch.dtype,
                settings: Settings, zero_points: str, name: str, solver: BlockSolver) -> tuple[list[np.ndarray], float]:
    def read(r0: int, r1: int) -> np.ndarray:
        # as loading (to the parameter's dtype), then the solve
        return read_stored(r0, r1).to(dtype).to(torch.float32).numpy()

    blocks, error = quantize.solve_rows(read, rows, k, settings, zero_points, name, solver)
    arrays = [pack_bits(blocks.q, settings.bits), np.ascontiguousarray(blocks.scales, dtype=np.float32)]
    if blocks.zero_points is not None:
        arrays.append(np.ascontiguousarray(blocks.zero_points))
    return arrays, error


def _solve(ckpt: CheckpointFiles, unit: Unit, solver: BlockSolver) -> _Solved:
    job = unit.job
    assert job is not None
    stored = ckpt.tensors[unit.source]
    read, rows, k = _rows(lambda r0, r1: ckpt.read_rows(unit.source, r0, r1), stored.shape, job.transposed)
    arrays, error = _solve_with(read, rows, k, job.param.dtype, job.settings, job.zero_points, job.name, solver)
    return _Solved(unit, arrays, error)


def remote_task(ckpt: CheckpointFiles, unit: Unit) -> RemoteSolve:
    job = unit.job
    assert job is not None
    stored = ckpt.tensors[unit.source]
    return RemoteSolve(str(ckpt.real_path(stored.file)), stored.offset, stored.dtype, stored.shape,
                       dtype_name(job.param.dtype), job.settings, job.zero_points, job.name, quantize.CHUNK_ELEMENTS,
                       job.transposed)


def solve_remote(task: RemoteSolve, solver: BlockSolver) -> tuple[list[np.ndarray], float]:
    """A worker's side of :class:`RemoteSolve` (module-level: what a Ray task runs)."""
    import os

    from bitpress.hf.stream_checkpoint import TORCH_DTYPES

    quantize.CHUNK_ELEMENTS = task.chunk_elements  # the driver's chunking (a test may lower it)
    k = task.shape[-1]  # of the stored rows
    itemsize = hf_files.SAFETENSORS_BITS[task.stored_dtype] // 8
    fd = os.open(task.path, os.O_RDONLY)
    try:
        def read_stored(r0: int, r1: int) -> torch.Tensor:
            buf = np.empty((r1 - r0) * k * itemsize, np.uint8)
            view, pos = memoryview(buf), task.offset + r0 * k * itemsize
            while view.nbytes:
                n = os.preadv(fd, [view], pos)
                if n <= 0:
                    raise OSError(f"{task.path} ended early while reading {task.name}")
                view, pos = view[n:], pos + n
            return torch.from_numpy(buf).view(TORCH_DTYPES[task.stored_dtype]).reshape(r1 - r0, k)

        read, rows, width = _rows(read_stored, task.shape, task.transposed)
        return _solve_with(read, rows, width, DTYPES[task.dtype], task.settings, task.zero_points, task.name,
                           solver)
    finally:
        os.close(fd)


def _copy(ckpt: CheckpointFiles, unit: Unit, out: SafetensorsWriter) -> None:
    stored = ckpt.tensors[unit.source]
    assert unit.dtype is not None
    size = torch.empty((), dtype=unit.dtype).element_size()
    step = max(1, COPY_BYTES // max(stored.itemsize, size))
    for e0 in range(0, stored.numel, step):
        e1 = min(stored.numel, e0 + step)
        x = ckpt.read_elements(unit.source, e0, e1)
        if x.dtype != unit.dtype:
            x = x.to(unit.dtype)
        out.write(unit.name, x.contiguous().view(torch.uint8).numpy(), e0 * size)


def write(prepared: Prepared, ckpt: CheckpointFiles, dest: Path, solver: BlockSolver, *, source: Path,
          history: list[dict[str, Any]], jobs: int = 1, progress: Callable[[int], None] | None = None,
          max_shard_size: int | None = None, executor: Any = None) -> tuple[Report, list[Path]]:
    """Write the quantized folder at ``dest`` (created, must not exist); returns the report and the files.

    ``max_shard_size``: bytes per safetensors file (default :data:`safetensors_writer.MAX_SHARD_BYTES`).
    ``executor``: where the solves run (:mod:`bitpress.executors`; threads here by default, which read
    through the checked file handles; Ray tasks read the files themselves).
    """
    p = prepared.plan
    report = Report(skipped=dict(p.skipped))
    p.log_notes()
    dest.mkdir(parents=True)
    limit_bytes = safetensors_writer.MAX_SHARD_BYTES if max_shard_size is None else max_shard_size
    shards = plan_shards([u.entries for u in prepared.units], limit_bytes)
    names = shard_names(len(shards))
    log.info("streaming %s: %d tensors into %d file(s), %d weights to quantize", source.name,
             sum(len(u.entries) for u in prepared.units), len(shards), len(p.jobs))
    writers = [SafetensorsWriter(dest / n, shard, {"format": "pt"}) for n, shard in zip(names, shards, strict=True)]
    try:
        where = {e.name: writers[i] for i, shard in enumerate(shards) for e in shard}
        floats = deque(u for u in prepared.units if u.job is None)
        quantized = sorted((u for u in prepared.units if u.job is not None), key=lambda u: -u.job.param.numel())

        def finish(future: Future[Any]) -> None:
            unit = order.popleft()
            solved = _Solved(unit, *future.result()) if remote else future.result()
            job = unit.job
            assert job is not None
            for entry, array in zip(unit.entries, solved.arrays, strict=True):
                where[entry.name].write(entry.name, array)
            report.quantized += 1
            report.weights += job.param.numel()
            report.stored_bytes += sum(a.size * a.itemsize for a in solved.arrays)
            report.errors[job.name] = solved.error
            if progress is not None:
                progress(1)

        spec = ExecutorSpec.from_value(executor)
        remote = spec.type != "threads"
        order: deque[Unit] = deque()
        with open_executor(spec, jobs=jobs) as pool, cancel_pending(pool):
            if remote:
                pool.check_shared([ckpt.real_path(i) for i in range(len(ckpt.files))])
            limit = pool.workers + 1  # solved or being solved, not yet written: bounds the memory
            pending: deque[Future[Any]] = deque()
            for unit in quantized:
                order.append(unit)
                pending.append(pool.submit(solve_remote, remote_task(ckpt, unit), solver) if remote
                               else pool.submit(_solve, ckpt, unit, solver))
                if len(pending) >= limit:
                    if floats:  # the driver copies while the workers solve
                        u = floats.popleft()
                        _copy(ckpt, u, where[u.name])
                    finish(pending.popleft())
            while floats:
                u = floats.popleft()
                _copy(ckpt, u, where[u.name])
            while pending:
                finish(pending.popleft())
        for w in writers:
            w.close()
    finally:
        for w in writers:
            w.close(check=False)
    files = [dest / n for n in names]
    if len(shards) > 1:
        files.append(write_index(dest, shards, names))
    if any(job.kept_float for job in p.jobs):
        quantize._untie_config(prepared.model, p)
    files.append(checkpoint.write_config(prepared.model.config, dest, prepared.modules, prepared.tied, history))
    files += checkpoint.copy_companions(source, dest)
    if not p.jobs:
        log.warning("no weights to quantize")
    return report, files


def quantize_streaming(model: HfModel, rules: Rules, solver: BlockSolver, dest: Path, *, float_zero_points: bool,
                       history: list[dict[str, Any]], jobs: int = 1,
                       step: Callable[[int, str], Any] | None = None,
                       max_shard_size: int | None = None, executor: Any = None) -> Report | None:
    """Stream ``model`` quantized into ``dest``; None (nothing written) when it must be loaded whole.

    Raises what planning raises (:class:`~bitpress.errors.QuantizationError`) before writing
    anything; a failure while writing leaves ``dest`` to the caller to remove.
    """
    reason = why_not(model)
    if reason is None:
        hf_files.check_folder(model.source)  # what loading checks first: the same refusals, before any read
        try:
            ckpt = CheckpointFiles(model.source)
        except NotStreamable as exc:
            reason = str(exc)
    if reason is not None:
        log.info("loading the whole model instead of streaming it: %s", reason)
        return None
    try:
        try:
            prepared = prepare(model.source, ckpt, rules, float_zero_points=float_zero_points)
        except NotStreamable as exc:
            log.info("loading the whole model instead of streaming it: %s", exc)
            return None
        if step is None:
            return write(prepared, ckpt, dest, solver, source=model.source, history=history, jobs=jobs,
                         max_shard_size=max_shard_size, executor=executor)[0]
        with step(len(prepared.plan.jobs), "quantizing") as advance:
            return write(prepared, ckpt, dest, solver, source=model.source, history=history, jobs=jobs,
                         progress=advance, max_shard_size=max_shard_size, executor=executor)[0]
    finally:
        ckpt.close()
