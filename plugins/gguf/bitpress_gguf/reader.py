"""A GGUF file read safely: its header checked before ``gguf.GGUFReader`` parses it, every tensor's
extent checked against the file, nothing read but what is asked for (the file is memory-mapped).

A malformed file (bad magic or version, counts the file cannot hold, a tensor of an unknown
type, data past the end) is one :class:`bitpress.errors.ModelLoadError` saying what is wrong.
"""

from __future__ import annotations

import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bitpress.plugin import ModelLoadError

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
VERSIONS = (2, 3)
_MIN_KV_BYTES = 8 + 8 + 4  # key length, a one-byte key at least, value type
_MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length and a byte, dims count, one dim, type, offset


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # GGMLQuantizationType name: Q4_K, F32, ...
    shape: tuple[int, ...]  # numpy order: [rows, K] for a 2-D weight
    n_bytes: int
    offset: int  # absolute, in the file


class GgufFile:
    """The tensors and metadata of a GGUF file; :meth:`raw` gives a tensor's bytes by row chunks."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.size = self.path.stat().st_size
        check_header(self.path, self.size)
        import gguf

        try:
            self._reader = gguf.GGUFReader(str(self.path), "r")
        except ValueError as exc:  # gguf's own checks: unknown types, duplicates, alignment; short data
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {_reason(exc)}") from None
        except (IndexError, KeyError, OverflowError, struct.error, TypeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: its header is cut short or "
                                 f"inconsistent ({type(exc).__name__}: {str(exc)[:120]})") from None
        self.tensors: dict[str, TensorInfo] = {}
        for t in self._reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            info = TensorInfo(t.name, t.tensor_type.name, shape, int(t.n_bytes), int(t.data_offset))
            if info.offset < 0 or info.offset + info.n_bytes > self.size:
                raise ModelLoadError(
                    f"{self.path}: tensor {t.name} ({info.type_name} {list(shape)}) needs bytes {info.offset} to "
                    f"{info.offset + info.n_bytes}, past the end of the file ({self.size} bytes): truncated?"
                )
            self.tensors[t.name] = info
        self._by_name = {t.name: t for t in self._reader.tensors}

    # -- metadata ---------------------------------------------------------------------------------
    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value: a scalar, a string, or a list of them."""
        import gguf

        f = self._reader.get_field(key)
        if f is None:
            return default
        types = f.types
        if not types:
            return default
        if types[0] == gguf.GGUFValueType.ARRAY:
            items = [f.parts[i] for i in f.data]
            if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
                return [bytes(p).decode("utf-8", errors="replace") for p in items]
            return [p.tolist()[0] for p in items]
        value = f.parts[f.data[0]]
        if types[0] == gguf.GGUFValueType.STRING:
            return bytes(value).decode("utf-8", errors="replace")
        return value.tolist()[0]

    @property
    def architecture(self) -> str:
        return str(self.field("general.architecture", "?"))

    def keys(self) -> list[str]:
        return [k for k in self._reader.fields if not k.startswith("GGUF.")]

    # -- tensor data ------------------------------------------------------------------------------
    def raw(self, name: str, rows: slice | None = None) -> np.ndarray:
        """A tensor's stored bytes ``[rows, bytes per row]`` (a view of the mapped file; a row is one
        output channel of a 2-D weight)."""
        t = self._by_name[name]
        info = self.tensors[name]
        data = np.asarray(t.data)
        flat = data.reshape(info.shape[0] if len(info.shape) > 1 else 1, -1).view(np.uint8)
        return flat if rows is None else flat[rows]

    def array(self, name: str) -> np.ndarray:
        """A float tensor as float32 (F32 / F16 / BF16)."""
        info = self.tensors[name]
        t = self._by_name[name]
        if info.type_name == "F32":
            return np.asarray(t.data, np.float32).reshape(info.shape)
        if info.type_name == "F16":
            return np.asarray(t.data).astype(np.float32).reshape(info.shape)
        if info.type_name == "BF16":
            u = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
            return u.view(np.float32).reshape(info.shape)
        raise ModelLoadError(f"{name} is {info.type_name}, not a float tensor")

    def close(self) -> None:
        """Drop the mapping (views handed out keep it alive until they go)."""
        self._reader = None  # type: ignore[assignment]
        self._by_name = {}


def _reason(exc: ValueError) -> str:
    text = re.sub(r"np\.\w+\((-?\d+)\)", r"\1", str(exc))  # np.uint32(99) -> 99
    if "cannot reshape array" in text:
        return f"its tensor data ends before the tensors it lists end (truncated?): {text}"
    if "GGMLQuantizationType" in text:
        return f"{text} (a tensor type this gguf {_gguf_version()} does not know)"
    return text


def _gguf_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gguf")
    except metadata.PackageNotFoundError:  # pragma: no cover - imported above
        return "?"


def check_header(path: Path, size: int) -> None:
    """Magic, version and counts a file of ``size`` bytes can hold, before anything parses it."""
    if size < 24:
        raise ModelLoadError(f"{path} is not a GGUF file: {size} bytes, shorter than a GGUF header")
    with path.open("rb") as f:
        head = f.read(24)
    if head[:4] != MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file: it starts with {head[:4]!r}, not {MAGIC!r}")
    (version,) = struct.unpack("<I", head[4:8])
    if version not in VERSIONS:
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (versions "
                             f"{', '.join(map(str, VERSIONS))})")
    tensors, kvs = struct.unpack("<QQ", head[8:24])
    if tensors * _MIN_TENSOR_BYTES + kvs * _MIN_KV_BYTES > size:
        raise ModelLoadError(f"{path}: the header announces {tensors} tensors and {kvs} metadata entries, more "
                             f"than its {size} bytes can hold: truncated or corrupt")
