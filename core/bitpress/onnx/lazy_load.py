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


def _varint(buf: memoryview | bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 70:
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


def _fields(buf: memoryview, start: int, end: int):
    """Yield ``(field_number, wire_type, field_start, value_start, value_end)``."""
    pos = start
    while pos < end:
        fstart = pos
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
            yield number, wire, fstart, fstart, pos
        elif wire == 1:
            pos += 8
            yield number, wire, fstart, pos - 8, pos
        elif wire == _LEN:
            length, vstart = _varint(buf, pos)
            pos = vstart + length
            if pos > end:
                raise ValueError("truncated length-delimited field")
            yield number, wire, fstart, vstart, pos
        elif wire == 5:
            pos += 4
            yield number, wire, fstart, pos - 4, pos
        else:
            raise ValueError(f"unsupported wire type {wire}")


def _len_field(number: int, payload: bytes) -> bytes:
    return _enc_varint((number << 3) | _LEN) + _enc_varint(len(payload)) + payload


def _entry(key: str, value: str) -> bytes:
    return _len_field(_TENSOR_EXTERNAL_DATA, _len_field(1, key.encode()) + _len_field(2, value.encode()))


def _tensor(buf: memoryview, start: int, end: int, location: str) -> bytes:
    """The TensorProto bytes with a large raw_data replaced by a reference into the file."""
    raw = None
    for number, wire, _, vstart, vend in _fields(buf, start, end):
        if number == _TENSOR_RAW_DATA and wire == _LEN:
            raw = (vstart, vend)
        elif number in (_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION):
            return bytes(buf[start:end])  # already external: leave it alone
    if raw is None or raw[1] - raw[0] < LAZY_THRESHOLD:
        return bytes(buf[start:end])
    out = bytearray()
    for number, _wire, fstart, _vstart, vend in _fields(buf, start, end):
        if number != _TENSOR_RAW_DATA:
            out += buf[fstart:vend]
    out += _entry("location", location)
    out += _entry("offset", str(raw[0]))
    out += _entry("length", str(raw[1] - raw[0]))
    out += _enc_varint((_TENSOR_DATA_LOCATION << 3) | 0) + _enc_varint(onnx.TensorProto.EXTERNAL)
    return bytes(out)


def _graph(buf: memoryview, start: int, end: int, location: str) -> bytes:
    out = bytearray()
    for number, wire, fstart, vstart, vend in _fields(buf, start, end):
        if number == _GRAPH_INITIALIZER and wire == _LEN:
            out += _len_field(_GRAPH_INITIALIZER, _tensor(buf, vstart, vend, location))
        else:
            out += buf[fstart:vend]
    return bytes(out)


def load_lazy(path: Path, location: str) -> onnx.ModelProto:
    """Parse ``path`` with large initializers left in the file under ``location``."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            out = bytearray()
            for number, wire, fstart, vstart, vend in _fields(buf, 0, len(buf)):
                if number == _MODEL_GRAPH and wire == _LEN:
                    out += _len_field(_MODEL_GRAPH, _graph(buf, vstart, vend, location))
                else:
                    out += buf[fstart:vend]
        finally:
            buf.release()
    model = onnx.ModelProto()
    model.ParseFromString(bytes(out))
    return model
