"""Reading a single-file ``.onnx`` without loading its weights.

A model under 2 GB usually keeps its weights inside the protobuf, and ``onnx.load`` copies
all of them into memory. Here the file is walked at the protobuf wire level instead: every
large ``raw_data`` field of a graph initializer is left in the file and the tensor is turned
into an external-data reference to a byte range *of the .onnx file itself*, under a private
location name the model's resolver maps back to that file. Everything else is parsed as usual.
The result behaves like a model with external data: weights are read when a pass needs them,
and saving copies them file to file.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import onnx

#: initializers whose raw bytes are at least this large stay in the file
LAZY_THRESHOLD = 4096
#: prefix of the private location names (never written to an output)
INLINE_PREFIX = "\x00bitpress-inline:"

_LEN = 2  # wire type of length-delimited fields
_MODEL_GRAPH = 7
_GRAPH_INITIALIZER = 5
_TENSOR_RAW_DATA = 9
_TENSOR_EXTERNAL_DATA = 13
_TENSOR_DATA_LOCATION = 14


#: protobuf cannot parse a message above 2 GiB: a larger single-file .onnx is not a model
MAX_FILE_BYTES = (1 << 31) - 1
#: protobuf fields walked in Python per file, at most (real graphs have far fewer than this:
#: nodes, inputs and initializers, not weights); beyond it the input is refused, not walked on
MAX_FIELDS = 8_000_000

# wire types of ModelProto's fields (1 ir_version and 5 model_version are varints, the rest
# strings or messages); GraphProto's fields are all length-delimited
_MODEL_WIRE = {1: 0, 2: _LEN, 3: _LEN, 4: _LEN, 5: 0, 6: _LEN, 7: _LEN, 8: _LEN, 14: _LEN, 20: _LEN, 25: _LEN,
               26: _LEN}


class _Budget:
    __slots__ = ("left",)

    def __init__(self, fields: int) -> None:
        self.left = fields


def _varint(buf: memoryview | bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    end = len(buf)
    while True:
        if pos >= end:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint")


def _enc_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _fields(buf: memoryview, start: int, end: int, budget: _Budget, wires: dict[int, int] | None = None,
            only: int | None = None):
    """Yield ``(field_number, wire_type, field_start, value_start, value_end)``.

    Malformed input raises ValueError at once: field number 0 (so a file of zeros stops at its
    first byte), a wire type that ``wires`` (or ``only``) does not allow, a value past ``end``.
    """
    pos = start
    while pos < end:
        budget.left -= 1
        if budget.left < 0:
            raise ValueError(f"more than {MAX_FIELDS} protobuf fields outside the weights; not a model this "
                             "loader reads")
        fstart = pos
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError(f"invalid protobuf field number 0 at byte {fstart}")
        want = only if only is not None else (wires or {}).get(number)
        if want is not None and wire != want:
            raise ValueError(f"field {number} at byte {fstart} has wire type {wire}, expected {want}")
        if wire == 0:
            _, pos = _varint(buf, pos)
            if pos > end:
                raise ValueError("truncated varint field")
            yield number, wire, fstart, fstart, pos
        elif wire == 1:
            pos += 8
            if pos > end:
                raise ValueError("truncated fixed64 field")
            yield number, wire, fstart, pos - 8, pos
        elif wire == _LEN:
            length, vstart = _varint(buf, pos)
            pos = vstart + length
            if pos > end:
                raise ValueError("truncated length-delimited field")
            yield number, wire, fstart, vstart, pos
        elif wire == 5:
            pos += 4
            if pos > end:
                raise ValueError("truncated fixed32 field")
            yield number, wire, fstart, pos - 4, pos
        else:
            raise ValueError(f"unsupported wire type {wire} at byte {fstart}")


def _len_field(number: int, payload: bytes) -> bytes:
    return _enc_varint((number << 3) | _LEN) + _enc_varint(len(payload)) + payload


def _entry(key: str, value: str) -> bytes:
    return _len_field(_TENSOR_EXTERNAL_DATA, _len_field(1, key.encode()) + _len_field(2, value.encode()))


def _tensor(buf: memoryview, start: int, end: int, location: str, budget: _Budget) -> bytes:
    """The TensorProto bytes with a large raw_data replaced by a reference into the file."""
    raw = None
    for number, wire, _, vstart, vend in _fields(buf, start, end, budget):
        if number == _TENSOR_RAW_DATA and wire == _LEN:
            raw = (vstart, vend)
        elif number in (_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION):
            return bytes(buf[start:end])  # already external: leave it alone
    if raw is None or raw[1] - raw[0] < LAZY_THRESHOLD:
        return bytes(buf[start:end])
    out = bytearray()
    for number, _wire, fstart, _vstart, vend in _fields(buf, start, end, budget):
        if number != _TENSOR_RAW_DATA:
            out += buf[fstart:vend]
    out += _entry("location", location)
    out += _entry("offset", str(raw[0]))
    out += _entry("length", str(raw[1] - raw[0]))
    out += _enc_varint((_TENSOR_DATA_LOCATION << 3) | 0) + _enc_varint(onnx.TensorProto.EXTERNAL)
    return bytes(out)


def _graph(buf: memoryview, start: int, end: int, location: str, budget: _Budget) -> bytes:
    out = bytearray()
    for number, wire, fstart, vstart, vend in _fields(buf, start, end, budget, only=_LEN):
        if number == _GRAPH_INITIALIZER and wire == _LEN:
            out += _len_field(_GRAPH_INITIALIZER, _tensor(buf, vstart, vend, location, budget))
        else:
            out += buf[fstart:vend]
    return bytes(out)


def load_lazy(path: Path, location: str) -> onnx.ModelProto:
    """Parse ``path`` with large initializers left in the file under ``location``.

    Raises ValueError for input that is not a protobuf model (checked as the bytes are walked,
    so a huge file of zeros is refused at its first byte, not walked).
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_FILE_BYTES:
            raise ValueError(
                f"the file is {size} bytes; a single .onnx file cannot exceed 2 GiB (protobuf's limit): "
                "models this large keep their weights in external data files"
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            budget = _Budget(MAX_FIELDS)
            try:
                out = bytearray()
                # the graph may come in several pieces (protobuf merges them): streaming writers do that
                for number, wire, fstart, vstart, vend in _fields(buf, 0, len(buf), budget, _MODEL_WIRE):
                    if number == _MODEL_GRAPH and wire == _LEN:
                        out += _len_field(_MODEL_GRAPH, _graph(buf, vstart, vend, location, budget))
                    else:
                        out += buf[fstart:vend]
            finally:
                buf.release()
    model = onnx.ModelProto()
    model.ParseFromString(bytes(out))
    return model
