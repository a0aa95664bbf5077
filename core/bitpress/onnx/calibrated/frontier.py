"""The values kept between stages, per calibration sample: in memory up to a budget, then on disk."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


class FrontierStore:
    """``(sample, name) -> array``; arrays past ``budget_bytes`` in memory go to ``.npy`` files in ``folder``.

    Spilled arrays come back memory-mapped, so a stage reads one sample's values at a time.
    """

    def __init__(self, folder: Path, budget_bytes: int) -> None:
        self.folder = folder
        self.budget = int(budget_bytes)
        self._mem: dict[tuple[int, str], np.ndarray] = {}
        self._disk: dict[tuple[int, str], Path] = {}
        self.resident = 0  # bytes held in memory
        self.peak = 0
        self.spilled = 0  # bytes written to disk over the run

    def put(self, sample: int, name: str, value: np.ndarray) -> None:
        key = (sample, name)
        self.drop_key(key)
        value = np.ascontiguousarray(value)
        if self.resident + value.nbytes <= self.budget:
            self._mem[key] = value
            self.resident += value.nbytes
            self.peak = max(self.peak, self.resident)
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"frontier-{uuid.uuid4().hex}.npy"
        np.save(path, value, allow_pickle=False)
        self._disk[key] = path
        self.spilled += value.nbytes

    def get(self, sample: int, name: str) -> np.ndarray:
        key = (sample, name)
        if key in self._mem:
            return self._mem[key]
        return np.load(self._disk[key], mmap_mode="r", allow_pickle=False)

    def __contains__(self, key: tuple[int, str]) -> bool:
        return key in self._mem or key in self._disk

    def drop_key(self, key: tuple[int, str]) -> None:
        value = self._mem.pop(key, None)
        if value is not None:
            self.resident -= value.nbytes
        path = self._disk.pop(key, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def drop(self, names: list[str], samples: int) -> None:
        for name in names:
            for s in range(samples):
                self.drop_key((s, name))

    def close(self) -> None:
        for key in list(self._disk):
            self.drop_key(key)
        self._mem.clear()
        self.resident = 0
