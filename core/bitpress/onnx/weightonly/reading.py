"""Reading a weight in bounded chunks, in the orientation its solver needs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.tensors import UNPACKED_BY_ONNX, file_row_reader, is_external, np_dtype
from bitpress.onnx.weightonly.planning import Group

#: float32 elements per chunk handed to a solver (bounds memory per tensor in flight). The knob is
#: ``bitpress.onnx.weightonly.CHUNK_ELEMENTS`` (read at each call, so tests and benchmarks set it there).
CHUNK_ELEMENTS = 1 << 20  # 4 MB of float32: small enough for the allocator to reuse (no page-fault storms)


@dataclass
class Chunk:
    """A slab of one weight, K padded with zeros to whole blocks.

    ``data`` is float32 as stored: ``[rows, K]`` for row-oriented weights (tables, ``[N, K]``
    sources), ``[K, N]`` bands for MatMul weights (``k_major``). :attr:`w` gives the solver's
    orientation ``[rows, blocks, block_size]``; :meth:`kn` a packing kernel's ``[K, rows]``.
    """

    rows: slice
    blocks: slice
    data: np.ndarray
    k_major: bool
    block_size: int
    k_valid: int  # real (unpadded) K elements in this chunk

    @property
    def w(self) -> np.ndarray:
        d = transposed(self.data) if self.k_major else self.data
        return d.reshape(d.shape[0], -1, self.block_size)

    def kn(self) -> np.ndarray:
        return self.data if self.k_major else transposed(self.data)

    def sample_rows(self, step: int) -> np.ndarray:
        """Every ``step``-th row in the solver's orientation, ``[rows / step, K]``."""
        return np.ascontiguousarray(self.data[:, ::step].T if self.k_major else self.data[::step])


#: rows per strip of :func:`transposed`
_TRANSPOSE_STRIP = 64


def transposed(a: np.ndarray) -> np.ndarray:
    """``a.T`` of a 2-D array, C-contiguous, copied in strips of rows.

    numpy's plain transposing copy walks the source with a stride of one row; with power-of-two
    row lengths (every hidden size) those addresses share cache sets and the copy runs 5-7x
    slower than in strips of a few dozen rows.
    """
    out = np.empty(a.shape[::-1], a.dtype)
    for r in range(0, a.shape[0], _TRANSPOSE_STRIP):
        out[:, r : r + _TRANSPOSE_STRIP] = a[r : r + _TRANSPOSE_STRIP].T
    return out


class _ReadBuffers:
    """Per-weight scratch for chunk reads: reused, so reading costs no page faults per chunk."""

    def __init__(self, dtype: np.dtype, elements: int) -> None:
        self.raw = np.empty(elements, dtype)
        self.f32 = self.raw if dtype == np.float32 else np.empty(elements, np.float32)

    def read(self, reader: Any, r0: int, r1: int, row_shape: tuple[int, ...]) -> np.ndarray:
        n = (r1 - r0) * int(np.prod(row_shape, dtype=np.int64))
        raw = reader(r0, r1, out=self.raw[:n].reshape(r1 - r0, *row_shape))
        if raw.dtype == np.float32 and raw.flags.c_contiguous:
            return raw  # read into the buffer, or a view of weights already in memory
        out = self.f32[:n].reshape(r1 - r0, *row_shape)
        np.copyto(out, raw, casting="unsafe")
        return out


@dataclass(frozen=True)
class TensorSource:
    """Where one weight's values are: a byte range of a file (external data), or the values themselves
    (a tensor stored inside the .onnx file). Small and picklable: what a solve task carries to a worker
    process (:mod:`bitpress.executors`), which reads the rows it needs itself."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name
    path: str | None = None
    offset: int = 0
    values: np.ndarray | None = None

    @classmethod
    def of(cls, model: OnnxModel, name: str) -> TensorSource:
        tensor = model.initializers()[name]
        shape = tuple(int(d) for d in tensor.dims)
        dtype = np_dtype(tensor)
        if is_external(tensor) and tensor.data_type not in UNPACKED_BY_ONNX:
            path, ref = model.resolver.path(tensor)
            return cls(name, shape, dtype.name, str(path), ref.offset)
        values = model.resolver.row_reader(tensor)(0, shape[0])
        return cls(name, shape, dtype.name, values=values)

    def row_reader(self) -> Any:
        """``read(r0, r1, out=None)``, as :meth:`bitpress.onnx.tensors.ExternalResolver.row_reader`."""
        if self.path is None:
            full = self.values
            assert full is not None
            return lambda r0, r1, out=None: full[r0:r1]
        return file_row_reader(self.path, self.offset, self.shape, np.dtype(self.dtype), self.name)


def iter_chunks(model: OnnxModel, group: Group) -> Iterator[Chunk]:
    """:func:`iter_source_chunks` of a planned weight of ``model``."""
    return iter_source_chunks(TensorSource.of(model, group.weight), group.uses[0].rows_are_table_rows,
                              group.block_size)


def iter_source_chunks(source: TensorSource, by_rows: bool, bs: int,
                       chunk_elements: int | None = None) -> Iterator[Chunk]:
    """Read a weight in slabs of at most ``chunk_elements`` (default ``CHUNK_ELEMENTS``) elements.

    Row-oriented weights (``by_rows``: tables, ``[N, K]`` Gemm/Transpose sources) are read as row
    ranges; ``[K, N]`` MatMul weights as bands of whole blocks along K (contiguous rows of the stored
    tensor). Reads are explicit (no memory map left behind) into buffers reused from chunk to
    chunk, so resident memory stays at a few slabs per worker however large the model. A
    chunk's arrays are valid until the next chunk is asked for.
    """
    a, b = source.shape
    dtype = np.dtype(source.dtype)
    reader = source.row_reader()
    limit = chunk_elements if chunk_elements is not None else current_chunk_elements()
    if by_rows:
        rows, k = a, b
        n_blocks = -(-k // bs)
        step = max(1, limit // max(k, 1))
        bufs = _ReadBuffers(dtype, min(rows, step) * k)
        pad = np.zeros((min(rows, step), n_blocks * bs), np.float32) if n_blocks * bs != k else None
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            w = bufs.read(reader, r0, r1, (k,))
            if pad is not None:
                pad[: r1 - r0, :k] = w
                w = pad[: r1 - r0]
            yield Chunk(slice(r0, r1), slice(0, n_blocks), w, False, bs, k)
    else:
        k, rows = a, b
        n_blocks = -(-k // bs)
        blocks_per_step = max(1, limit // max(rows * bs, 1))
        bufs = _ReadBuffers(dtype, min(n_blocks, blocks_per_step) * bs * rows)
        for b0 in range(0, n_blocks, blocks_per_step):
            b1 = min(n_blocks, b0 + blocks_per_step)
            k0, k1 = b0 * bs, min(k, b1 * bs)
            band = bufs.read(reader, k0, k1, (rows,))  # [k1 - k0, N]
            if k1 - k0 != (b1 - b0) * bs:  # the last band: pad K with zeros to whole blocks
                padded = np.zeros(((b1 - b0) * bs, rows), np.float32)
                padded[: k1 - k0] = band
                band = padded
            yield Chunk(slice(0, rows), slice(b0, b1), band, True, bs, k1 - k0)


def current_chunk_elements() -> int:
    """``bitpress.onnx.weightonly.CHUNK_ELEMENTS`` as it is now (a worker process is told it)."""
    from bitpress.onnx import weightonly

    return int(weightonly.CHUNK_ELEMENTS)
