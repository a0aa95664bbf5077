"""Walking every tensor of a graph and reading tensor data without loading the model twice.

External data is the usual home of weights. ``location`` entries are resolved against the
model's folder and must stay inside it: absolute paths and ``..`` escapes are refused (a known
class of ONNX vulnerabilities).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import numpy as np
import onnx
from onnx import numpy_helper

from bitpress import paths
from bitpress.errors import ModelLoadError, UnsafeExternalDataError, UnsafePathError
from bitpress.onnx.lazy_load import INLINE_PREFIX
from bitpress.paths import MAX_NAME_BYTES, MAX_PART_BYTES


def iter_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph (If/Loop/Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from iter_graphs(g)


def iter_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto that can hold data: initializers, sparse parts, node attributes.

    The seed bug of this project was a ``Constant`` node's tensor left pointing at a file
    that was never written; walking attributes too is what prevents it.
    """
    for graph in iter_graphs(model.graph):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors
                elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


@dataclass(frozen=True)
class ExternalRef:
    location: str
    offset: int
    length: int | None


#: the largest offset / length / element count a tensor may claim (far beyond any real file)
MAX_BYTES = 1 << 60


def external_ref(tensor: onnx.TensorProto) -> ExternalRef:
    info: dict[str, str] = {}
    for e in tensor.external_data:
        if e.key in info:
            raise ModelLoadError(f"tensor {tensor.name!r} gives its external {e.key!r} twice")
        info[e.key] = e.value
    if "location" not in info:
        raise ModelLoadError(f"tensor {tensor.name!r} is marked external but has no location")
    try:
        offset = _nonneg_int(info.get("offset", "0"))
        length = _nonneg_int(info["length"]) if "length" in info else None
    except ValueError:
        raise ModelLoadError(
            f"tensor {tensor.name!r} has a malformed external offset/length "
            f"(offset={info.get('offset', '0')[:40]!r}, length={info.get('length', '')[:40]!r}): "
            f"expected whole numbers from 0 to {MAX_BYTES}"
        ) from None
    return ExternalRef(info["location"], offset, length)


def _nonneg_int(text: str) -> int:
    if not isinstance(text, str) or len(text) > 20 or not text.strip().isdigit():
        raise ValueError(text)
    value = int(text)
    if value > MAX_BYTES:
        raise ValueError(text)
    return value


def check_location(location: str, base_dir: Path, *, tensor: str) -> Path:
    """The file ``location`` names, refusing anything that leaves ``base_dir``."""
    if not isinstance(location, str) or any(ord(c) < 32 or c == "\x7f" for c in location):
        raise ModelLoadError(
            f"tensor {tensor!r}: external data location {str(location)[:80]!r} contains control characters; "
            "expected a file name beside the model"
        )
    encoded = location.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_NAME_BYTES or any(
        len(part.encode("utf-8", "surrogatepass")) > MAX_PART_BYTES for part in location.replace("\\", "/").split("/")
    ):
        raise ModelLoadError(
            f"tensor {tensor!r}: external data location {location[:60]!r}... is {len(encoded)} bytes long, "
            f"longer than a file name can be (at most {MAX_NAME_BYTES}, {MAX_PART_BYTES} per part)"
        )
    if (
        not location
        or PurePosixPath(location).is_absolute()
        or PureWindowsPath(location).is_absolute()
        or PureWindowsPath(location).drive
        or location.startswith(("/", "\\"))
    ):
        raise UnsafeExternalDataError(
            f"tensor {tensor!r}: external data location {location!r} is absolute; ONNX external "
            "data must be a path relative to the model's folder (refused for safety)"
        )
    parts = PurePosixPath(location.replace("\\", "/")).parts
    if ".." in parts:
        raise UnsafeExternalDataError(
            f"tensor {tensor!r}: external data location {location!r} leaves the model's folder; "
            "move the data file beside the model (refused for safety)"
        )
    if paths.hf_snapshot(base_dir):  # links must lead to the repository's blobs (bitpress.hfcache)
        where = f"tensor {tensor!r}: external data location {location!r}"
        try:
            return paths.inside(base_dir, Path(*parts), where)
        except UnsafePathError as exc:
            raise UnsafeExternalDataError(str(exc)) from None
    try:
        base = base_dir.resolve()
        path = (base / Path(*parts)).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a link loop
        raise ModelLoadError(f"tensor {tensor!r}: cannot resolve external data location {location!r}: {exc}") \
            from None
    if not path.is_relative_to(base):
        raise UnsafeExternalDataError(
            f"tensor {tensor!r}: external data location {location!r} resolves outside the "
            f"model's folder (through a symbolic link) to {path}; refused for safety"
        )
    return path


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    """Bytes of the tensor's data as stored (external length, raw bytes or typed fields)."""
    if is_external(tensor):
        ref = external_ref(tensor)
        if ref.length is not None:
            return ref.length
        return expected_nbytes(tensor) or 0
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    return expected_nbytes(tensor) or 0


def np_dtype(tensor: onnx.TensorProto) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))


#: bits per element of the packed sub-byte types
_SUB_BYTE_BITS = {
    onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4,
    getattr(onnx.TensorProto, "FLOAT4E2M1", -1): 4,
    getattr(onnx.TensorProto, "INT2", -2): 2, getattr(onnx.TensorProto, "UINT2", -3): 2,
}
#: types whose bytes onnx unpacks (sub-byte, and 6-bit floats whose packing we leave to onnx)
_UNPACKED_BY_ONNX = set(_SUB_BYTE_BITS) | {
    getattr(onnx.TensorProto, name) for name in ("FLOAT6E2M3", "FLOAT6E3M2") if hasattr(onnx.TensorProto, name)
}
UNPACKED_BY_ONNX = frozenset(_UNPACKED_BY_ONNX)
_KNOWN_TYPES = frozenset(v for v in onnx.TensorProto.DataType.values() if v != onnx.TensorProto.UNDEFINED)
_COMPLEX = {onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128}


def element_count(tensor: onnx.TensorProto) -> int:
    """Elements implied by the dims (Python integers: a product cannot wrap around)."""
    count = 1
    for d in tensor.dims:
        count *= int(d)
    return count


def expected_nbytes(tensor: onnx.TensorProto) -> int | None:
    """Size in bytes implied by dims and dtype (None for strings and types of unknown packing)."""
    if tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    bits = _SUB_BYTE_BITS.get(tensor.data_type)
    count = element_count(tensor)
    if bits is not None:
        return (count * bits + 7) // 8
    if tensor.data_type in _UNPACKED_BY_ONNX:
        return None
    try:
        itemsize = np_dtype(tensor).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    return count * itemsize


def check_tensor(tensor: onnx.TensorProto) -> None:
    """Refuse a tensor whose header cannot be true: unknown type, negative or overflowing dims,
    inline data of another size than its dims and type imply, a malformed external reference.

    External files are checked by :meth:`ExternalResolver.validate`.
    """
    name = tensor.name
    if tensor.data_type not in _KNOWN_TYPES:
        raise ModelLoadError(f"tensor {name!r} has an unknown data type {tensor.data_type}")
    for d in tensor.dims:
        if d < 0:
            raise ModelLoadError(f"tensor {name!r} has a negative dimension: dims {list(tensor.dims)}")
    count = element_count(tensor)
    if count > MAX_BYTES:
        raise ModelLoadError(f"tensor {name!r} claims {count} elements (dims {list(tensor.dims)}): not a real tensor")
    if is_external(tensor):
        if tensor.data_type == onnx.TensorProto.STRING:
            raise ModelLoadError(f"tensor {name!r} of type STRING is marked external (ONNX keeps strings inline)")
        ref = external_ref(tensor)
        if not ref.location:
            raise ModelLoadError(f"tensor {name!r} is marked external with an empty location")
        return
    if tensor.external_data:
        raise ModelLoadError(f"tensor {name!r} has external data entries but is not marked external")
    if tensor.HasField("segment"):
        return  # a chunk of a larger tensor: its dims are the whole one's
    type_name = onnx.TensorProto.DataType.Name(tensor.data_type)
    if tensor.HasField("raw_data"):
        if tensor.data_type == onnx.TensorProto.STRING:
            raise ModelLoadError(f"tensor {name!r} of type STRING holds raw_data (strings go in string_data)")
        want = expected_nbytes(tensor)
        if want is not None and len(tensor.raw_data) != want:
            raise ModelLoadError(
                f"tensor {name!r} holds {len(tensor.raw_data)} bytes of data, but its dims {list(tensor.dims)} "
                f"and type {type_name} need {want}"
            )
        return
    if tensor.data_type in _UNPACKED_BY_ONNX:
        return  # packed into int32_data in ways onnx itself checks
    field = onnx.helper.tensor_dtype_to_field(tensor.data_type)
    have = len(getattr(tensor, field))
    want = count * (2 if tensor.data_type in _COMPLEX else 1)
    if have != want:
        raise ModelLoadError(
            f"tensor {name!r} holds {have} values in {field}, but its dims {list(tensor.dims)} "
            f"and type {type_name} need {want}"
        )


def file_row_reader(path: str | Path, offset: int, shape: tuple[int, ...], dtype: np.dtype,
                    name: str) -> Callable[..., np.ndarray]:
    """``read(r0, r1, out=None)`` -> rows ``r0:r1`` (first axis) of the C-order tensor of ``shape`` and
    ``dtype`` stored at byte ``offset`` of the file ``path``, read with ``pread`` (see
    :meth:`ExternalResolver.row_reader`). Module-level, so a worker process can read a weight from
    where it lies on disk (:class:`bitpress.onnx.weightonly.reading.TensorSource`)."""
    row_elems = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    row_bytes = row_elems * dtype.itemsize

    def read(r0: int, r1: int, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.empty((r1 - r0, *shape[1:]), dtype)
        elif out.dtype != dtype or out.shape != (r1 - r0, *shape[1:]) or not out.flags.c_contiguous:
            raise ValueError(f"read buffer {out.dtype}{out.shape} does not fit rows {r0}:{r1} of {name!r}")
        view = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(path, os.O_RDONLY)
        try:
            done, want, pos = 0, (r1 - r0) * row_bytes, offset + r0 * row_bytes
            while done < want:
                n = os.preadv(fd, [view[done:]], pos + done)
                if n <= 0:
                    raise ModelLoadError(f"external data of {name!r} in {path} is truncated")
                done += n
        finally:
            os.close(fd)
        return out

    return read


class ExternalResolver:
    """Maps external locations to files: the model's folder plus scratch files of passes."""

    def __init__(self, base_dir: Path) -> None:
        #: the model's folder: external locations are names in it
        self.folder = Path(base_dir)
        self.extra: dict[str, Path] = {}

    @property
    def base_dir(self) -> Path:
        """The folder that every file :meth:`path` gives lies under, as far as it can be (what ONNX Runtime is
        pointed at when the graph is handed over as bytes, :func:`bitpress.onnx.activations.relocate`): the
        model's folder; for a model in a Hugging Face cache snapshot, the cache folder, which holds the
        snapshot and the blobs its links were checked to lead to (:mod:`bitpress.hfcache`)."""
        snap = paths.hf_snapshot(self.folder)
        return snap.cache if snap is not None else self.folder

    @base_dir.setter
    def base_dir(self, folder: Path) -> None:
        self.folder = Path(folder)

    def path(self, tensor: onnx.TensorProto) -> tuple[Path, ExternalRef]:
        ref = external_ref(tensor)
        if ref.location in self.extra:
            return self.extra[ref.location], ref
        return check_location(ref.location, self.folder, tensor=tensor.name), ref

    def read(self, tensor: onnx.TensorProto) -> np.ndarray:
        """The tensor as a numpy array; external data is memory-mapped, not copied."""
        if not is_external(tensor):
            return numpy_helper.to_array(tensor)
        path, ref = self.path(tensor)
        dtype = np_dtype(tensor)
        shape = tuple(tensor.dims)
        count = element_count(tensor)
        if count == 0:
            return np.zeros(shape, dtype=dtype)
        if tensor.data_type in _UNPACKED_BY_ONNX:
            # sub-byte types: let onnx unpack them from the bytes
            copy = onnx.TensorProto()
            copy.CopyFrom(tensor)
            del copy.external_data[:]
            copy.data_location = onnx.TensorProto.DEFAULT
            copy.raw_data = self.read_bytes(tensor)
            return numpy_helper.to_array(copy)
        try:
            return np.memmap(path, dtype=dtype, mode="r", offset=ref.offset, shape=shape)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read external data of {tensor.name!r} from {path}: {exc}") from None

    def row_reader(self, tensor: onnx.TensorProto) -> Callable[..., np.ndarray]:
        """``read(r0, r1, out=None)`` -> rows ``r0:r1`` (first axis) of a tensor.

        External data is read with ``pread`` into ``out`` when given (C-contiguous, the tensor's
        dtype and the rows' shape: a buffer reused across reads costs no page faults) or else a
        fresh array (no memory map stays resident); inline data is a read-only view of the bytes
        already in memory and ``out`` is not used.
        """
        dtype = np_dtype(tensor)
        shape = tuple(int(d) for d in tensor.dims)
        if is_external(tensor) and tensor.data_type not in _UNPACKED_BY_ONNX:
            path, ref = self.path(tensor)
            return file_row_reader(path, ref.offset, shape, dtype, tensor.name)
        if tensor.HasField("raw_data") and tensor.data_type not in _UNPACKED_BY_ONNX:
            full = np.frombuffer(tensor.raw_data, dtype=dtype).reshape(shape)
        else:
            full = self.read(tensor)
        return lambda r0, r1, out=None: full[r0:r1]

    def read_bytes(self, tensor: onnx.TensorProto) -> bytes:
        path, ref = self.path(tensor)
        length = ref.length if ref.length is not None else expected_nbytes(tensor) or 0
        with open(path, "rb") as f:
            f.seek(ref.offset)
            data = f.read(length)
        if len(data) != length:
            raise ModelLoadError(f"external data of {tensor.name!r} in {path} is truncated")
        return data

    def validate(self, tensor: onnx.TensorProto) -> Path:
        """Check that the tensor's external bytes exist, inside the folder and the file."""
        path, ref = self.path(tensor)
        if not path.is_file():
            raise ModelLoadError(
                f"tensor {tensor.name!r}: external data file {ref.location!r} is missing "
                f"(looked for {path}); keep the data file beside the model"
            )
        size = os.path.getsize(path)
        expected = expected_nbytes(tensor)
        length = ref.length if ref.length is not None else expected
        if ref.length is not None and expected is not None and ref.length != expected:
            if ref.location.startswith(INLINE_PREFIX):  # inline raw_data left in the .onnx file
                raise ModelLoadError(
                    f"tensor {tensor.name!r} holds {ref.length} bytes of data, but its dims {list(tensor.dims)} "
                    f"and type {onnx.TensorProto.DataType.Name(tensor.data_type)} need {expected}"
                )
            raise ModelLoadError(
                f"tensor {tensor.name!r}: external length {ref.length} does not match its shape "
                f"{list(tensor.dims)} ({expected} bytes)"
            )
        if length is not None and ref.offset + length > size:
            raise ModelLoadError(
                f"tensor {tensor.name!r}: external data {ref.location!r} is truncated "
                f"(needs bytes {ref.offset}..{ref.offset + length}, file has {size})"
            )
        return path
