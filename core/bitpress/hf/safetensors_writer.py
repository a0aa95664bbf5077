"""Write safetensors files tensor by tensor, with the header computed first (no torch needed).

A safetensors file is an 8-byte little-endian header length, a JSON header (padded with spaces
to a multiple of 8 bytes) and the tensors' bytes. When every name, dtype and shape is known
beforehand, the header and every tensor's offset are too: :class:`SafetensorsWriter` writes the
header, then each tensor's bytes at its offset as they become available (in any order, in
pieces), so no tensor has to be held with the others.

The layout is the safetensors library's own (``prepare`` in its ``tensor.rs``): tensors sorted
by dtype, largest alignment first (the ``Dtype`` enum's order, reversed), then by name; the
header lists ``__metadata__`` first, then the tensors in that order, as compact JSON. A file
written here is byte for byte what ``safetensors.torch.save_file(tensors, path, metadata)``
writes for the same tensors (tests/hf/test_hf_streaming.py compares them).

:func:`plan_shards` splits a checkpoint into files of at most ``max_shard_size`` bytes, named
and indexed as Hugging Face does (``model-00001-of-00003.safetensors`` and
``model.safetensors.index.json``); one file is ``model.safetensors``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from bitpress.errors import OutputError
from bitpress.models.hf_files import MAX_HEADER_BYTES, SAFETENSORS_BITS

#: safetensors' ``Dtype`` enum in declaration order: data is laid out from the last to the first
DTYPE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
               "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")
_RANK = {name: i for i, name in enumerate(DTYPE_ORDER)}
#: Hugging Face's default largest shard ("5GB")
MAX_SHARD_BYTES = 5 * 10**9
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name, safetensors dtype (``F32``, ``BF16``, ``U8``, ...) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count * SAFETENSORS_BITS[self.dtype] // 8


def layout(entries: Sequence[Entry], metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """The header bytes (length prefix included) and each tensor's offset from the start of the file."""
    unknown = [e.dtype for e in entries if e.dtype not in _RANK or SAFETENSORS_BITS[e.dtype] % 8]
    if unknown:
        raise ValueError(f"cannot write safetensors dtype {unknown[0]!r}")
    names = [e.name for e in entries]
    if len(set(names)) != len(names) or "__metadata__" in names:
        raise ValueError("tensor names must be unique and not __metadata__")
    ordered = sorted(entries, key=lambda e: (-_RANK[e.dtype], e.name))
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    pos = 0
    rel: dict[str, int] = {}
    for e in ordered:
        n = e.nbytes
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [pos, pos + n]}
        rel[e.name] = pos
        pos += n
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"a safetensors header of {len(raw)} bytes is over the format's {MAX_HEADER_BYTES}")
    head = struct.pack("<Q", len(raw)) + raw
    return head, {name: len(head) + offset for name, offset in rel.items()}


class SafetensorsWriter:
    """One safetensors file, written piece by piece at offsets known from the start.

    ``write(name, data, start)`` puts ``data``'s bytes at byte ``start`` of tensor ``name``;
    :meth:`close` checks that every tensor got exactly its bytes. The file is created new
    (never over an existing one).
    """

    def __init__(self, path: Path, entries: Sequence[Entry], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        head, self.offsets = layout(entries, metadata)
        self.sizes = {e.name: e.nbytes for e in entries}
        self.written = dict.fromkeys(self.sizes, 0)
        self.total = len(head) + sum(self.sizes.values())
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            self._pwrite(memoryview(head), 0)
            os.ftruncate(self.fd, self.total)
        except BaseException:
            os.close(self.fd)
            raise

    def _pwrite(self, view: memoryview, offset: int) -> None:
        while view.nbytes:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def write(self, name: str, data: np.ndarray | bytes | bytearray | memoryview, start: int = 0) -> None:
        view = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
        if start < 0 or start + view.nbytes > self.sizes[name]:
            raise ValueError(f"{view.nbytes} bytes at {start} do not fit tensor {name} ({self.sizes[name]} bytes)")
        self._pwrite(view, self.offsets[name] + start)
        self.written[name] += view.nbytes

    def close(self, *, check: bool = True) -> None:
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        os.close(fd)
        if check:
            wrong = [n for n, size in self.sizes.items() if self.written[n] != size]
            if wrong:
                raise OutputError(f"{self.path}: tensor {wrong[0]} got {self.written[wrong[0]]} of its "
                                  f"{self.sizes[wrong[0]]} bytes (a bug: please report it)")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(check=kind is None)


def plan_shards(groups: Sequence[Sequence[Entry]], max_shard_size: int = MAX_SHARD_BYTES) -> list[list[Entry]]:
    """Greedy split, in order, of groups of tensors that stay together (a quantized weight's three).

    A shard is closed when the next group would take it over ``max_shard_size``; a group larger
    than that gets a shard of its own. Always at least one shard.
    """
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    shards: list[list[Entry]] = [[]]
    size = 0
    for group in groups:
        n = sum(e.nbytes for e in group)
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += n
    return shards


def shard_names(count: int) -> list[str]:
    """``model.safetensors``, or Hugging Face's ``model-0000i-of-0000n.safetensors``."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_index(folder: Path, shards: Sequence[Sequence[Entry]], names: Sequence[str]) -> Path:
    """``model.safetensors.index.json`` for sharded files: every tensor's file, and the total size."""
    weight_map = {e.name: name for shard, name in zip(shards, names, strict=True) for e in shard}
    total = sum(e.nbytes for shard in shards for e in shard)
    path = Path(folder) / INDEX_FILE
    path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                               indent=2, sort_keys=True) + "\n")
    return path
