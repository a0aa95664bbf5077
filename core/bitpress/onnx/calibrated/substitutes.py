"""The weights later stages compute with once quantized, in scratch files: written by slabs, read mapped.

A sequential run computes every stage after a weight's solve with the weight's dequantized
value (what ``MatMulNBits`` computes). Held in memory, the ones alive at once are a layer's
worth of float weights (gate and up of a 7B decoder: 0.36 GB, a tied 32000 x 4096 table:
0.52 GB); in ONNX Runtime's initializers they were copied twice more. Here each goes to a file
of the work folder as the solve produces it, in its stored orientation and dtype, and a stage
gets it as an extra graph input fed with a read-only memory map (ONNX Runtime reads a contiguous
numpy input in place): the pages are the kernel's, resident while the stage runs, and gone when
the map is closed.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class _Entry:
    path: Path
    shape: tuple[int, int]  # stored orientation
    dtype: np.dtype


class SubstituteWriter:
    """Fills one substitute by slabs of solver rows; :meth:`close` when every row is written."""

    def __init__(self, entry: _Entry, transposed: bool) -> None:
        self.entry = entry
        self.transposed = transposed  # solver rows are the stored tensor's columns (a MatMul's B [K, N])
        self._fd = os.open(entry.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, int(np.prod(entry.shape)) * entry.dtype.itemsize)

    def write(self, r0: int, values: np.ndarray) -> None:
        """Solver rows ``r0 : r0 + len(values)`` (``values`` ``[rows, K]`` in the solver's orientation)."""
        v = np.asarray(values).astype(self.entry.dtype, copy=False)
        isz = self.entry.dtype.itemsize
        width = self.entry.shape[1]
        if not self.transposed:
            data = np.ascontiguousarray(v)
            os.pwrite(self._fd, memoryview(data.reshape(-1).view(np.uint8)), r0 * width * isz)
            return
        t = np.ascontiguousarray(v.T)  # [K, rows]: a piece of each stored row
        for i in range(t.shape[0]):
            os.pwrite(self._fd, memoryview(t[i].view(np.uint8)), (i * width + r0) * isz)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SubstituteWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SubstituteStore:
    """``weight name -> dequantized value`` in files under ``folder``; :meth:`open` maps them read-only."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._entries: dict[str, _Entry] = {}

    def writer(self, name: str, shape: tuple[int, int], dtype: np.dtype, transposed: bool) -> SubstituteWriter:
        """A writer of ``name``'s value, ``shape`` and ``dtype`` as stored in the model."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.discard(name)
        entry = _Entry(self.folder / f"substitute-{uuid.uuid4().hex}.bin", tuple(shape), np.dtype(dtype))
        self._entries[name] = entry
        return SubstituteWriter(entry, transposed)

    def put(self, name: str, value: np.ndarray) -> None:
        """A whole value at once, in its stored orientation."""
        w = self.writer(name, value.shape, value.dtype, transposed=False)
        try:
            w.write(0, value)
        finally:
            w.close()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def spec(self, name: str) -> tuple[tuple[int, int], np.dtype]:
        e = self._entries[name]
        return e.shape, e.dtype

    def open(self, name: str) -> np.ndarray:
        """The value, memory-mapped read-only (drop the reference to unmap it)."""
        e = self._entries[name]
        return np.memmap(e.path, dtype=e.dtype, mode="r", shape=e.shape)

    def discard(self, name: str) -> None:
        e = self._entries.pop(name, None)
        if e is not None:
            e.path.unlink(missing_ok=True)

    def close(self) -> None:
        for name in list(self._entries):
            self.discard(name)
