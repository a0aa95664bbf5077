"""Saving ONNX models that always load, and checking them after each save.

Every tensor ends up either inline (small ones, or all of them in a single-file model) or in
``<name>.onnx.data`` beside the model with a relative ``location``: the seed bug (references
to files that were never written) cannot happen because each tensor's bytes are copied from
wherever they live now — the input's data file, a scratch file, memory — into the output.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import numpy_helper

from bitpress import paths
from bitpress.errors import OutputError, ValidationError, one_line
from bitpress.memory import release_free_memory
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.graph import ensure_opsets
from bitpress.onnx.lazy_load import INLINE_PREFIX
from bitpress.onnx.tensors import external_ref, is_external, iter_graphs, iter_tensors, tensor_nbytes

log = logging.getLogger(__name__)

TWO_GB = 2**31
#: below this, a model without a request for external data is written as a single file
SINGLE_FILE_LIMIT = TWO_GB - (64 << 20)
INLINE_THRESHOLD = 1024  # tensors smaller than this stay inside the .onnx file
_COPY_CHUNK = 16 << 20


@dataclass
class SaveOptions:
    external_data: bool | None = None  # None: as the input (or when the model needs it, >= 2 GB)
    max_shard_size: int | None = None  # bytes per data file; None: one file
    check: bool = True  # checker + ONNX Runtime session after saving


def save_onnx(model: OnnxModel, dest: Path, options: SaveOptions | None = None) -> list[Path]:
    """Write ``model`` to ``dest`` (an ``.onnx`` path) and return the files written."""
    options = options or SaveOptions()
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    proto = model.proto
    ensure_opsets(proto)
    tensors = list(iter_tensors(proto))
    total = sum(tensor_nbytes(t) for t in tensors)
    external = options.external_data
    if external is None:
        # as the input: ONNX Runtime maps external data instead of parsing it into memory, so a
        # large model's output stays cheap to load (and the layout the user shipped is kept)
        external = total >= SINGLE_FILE_LIMIT or options.max_shard_size is not None or model.external_source
    if not external and total >= SINGLE_FILE_LIMIT:
        raise OutputError(
            f"the model holds {total / 2**30:.2f} GiB of tensors; a single .onnx file is limited "
            "to 2 GiB: save with external data (--external-data)"
        )

    # Work on a copy of the graph: the handle stays as it was. Large tensors are external
    # references (lazy loading, scratch files), so the copy holds the graph, not the weights.
    base = onnx.ModelProto()
    base.CopyFrom(proto)
    tensors = list(iter_tensors(base))
    if external:
        writer = _DataWriter(dest, options.max_shard_size)
        try:
            for tensor in tensors:
                nbytes = tensor_nbytes(tensor)
                if nbytes < INLINE_THRESHOLD:
                    if is_external(tensor):
                        _inline(model, tensor)
                    continue
                location, offset = writer.write_tensor(model, tensor, nbytes)
                _point_to(tensor, location, offset, nbytes)
        finally:
            files = writer.close()
        with open(dest, "wb") as f:
            f.write(base.SerializeToString())
        probe = None
    else:
        probe = _write_single_file(model, base, dest)
        files = []
    del base
    files.insert(0, dest)
    if options.check:
        release_free_memory()  # ONNX Runtime is about to load the whole output
        model.checker_note = check_saved(dest, reference=model.source, graph=probe)
    return files


def _write_single_file(model: OnnxModel, base: onnx.ModelProto, dest: Path) -> onnx.ModelProto:
    """One .onnx file, written without holding the weights in memory.

    Protobuf merges repeated messages: a ModelProto followed by more ``graph { initializer {..} }``
    fragments parses as one graph with those initializers appended. So the graph is serialized
    without its large initializers, and each of them is then streamed as such a fragment, its
    bytes copied from wherever they live (input file, scratch file, memory).

    Returns the written graph with each streamed tensor as a reference to its bytes inside
    ``dest``: what the ONNX checker needs, without reading the weights back into memory.
    """
    large = [t for t in base.graph.initializer if tensor_nbytes(t) >= INLINE_THRESHOLD]
    large_ids = {id(t) for t in large}
    small = [t for t in base.graph.initializer if id(t) not in large_ids]
    for tensor in iter_tensors(base):
        if id(tensor) not in large_ids and is_external(tensor):
            _inline(model, tensor)
    fragments = []
    for t in large:
        header = onnx.TensorProto()
        header.CopyFrom(t)
        for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                      "string_data", "external_data"):
            header.ClearField(field)
        header.data_location = onnx.TensorProto.DEFAULT
        fragments.append((t, header.SerializeToString(), tensor_nbytes(t)))
    kept = [onnx.TensorProto() for _ in small]
    for dst, src in zip(kept, small, strict=True):
        dst.CopyFrom(src)
    del base.graph.initializer[:]
    base.graph.initializer.extend(kept)
    probe = onnx.ModelProto()
    with open(dest, "wb") as f:
        f.write(base.SerializeToString())
        probe.CopyFrom(base)
        for tensor, header, nbytes in fragments:
            raw_field = _key(_TENSOR_RAW_DATA) + _varint(nbytes)
            tensor_len = len(header) + len(raw_field) + nbytes
            init_field = _key(_GRAPH_INITIALIZER) + _varint(tensor_len)
            graph_len = len(init_field) + tensor_len
            f.write(_key(_MODEL_GRAPH) + _varint(graph_len) + init_field + header + raw_field)
            ref = probe.graph.initializer.add()
            ref.ParseFromString(header)
            _point_to(ref, dest.name, f.tell(), nbytes)
            if is_external(tensor):
                src, ref = model.resolver.path(tensor)
                _copy_range(src, ref.offset, nbytes, f)
            elif tensor.HasField("raw_data"):
                f.write(tensor.raw_data)
            else:
                f.write(numpy_helper.to_array(tensor).tobytes())
    return probe


_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def _key(field_number: int) -> bytes:
    return _varint((field_number << 3) | 2)  # length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def _inline(model: OnnxModel, tensor: onnx.TensorProto) -> None:
    raw = model.resolver.read_bytes(tensor)
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = raw


def _point_to(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data",
                  "uint64_data", "string_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


class _DataWriter:
    """Appends tensors to ``<model>.data`` (and shards), aligned for memory mapping."""

    def __init__(self, dest: Path, max_shard: int | None) -> None:
        self.dest = dest
        self.max_shard = max_shard
        self.files: list[Path] = []
        self.handle = None
        self.size = 0
        self._open_next()

    def _open_next(self) -> None:
        if self.handle is not None:
            self.handle.close()
        n = len(self.files)
        path = self.dest.with_name(self.dest.name + (".data" if n == 0 else f".data.{n}"))
        self.files.append(path)
        self.handle = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.size = 0

    def write_tensor(self, model: OnnxModel, tensor: onnx.TensorProto, nbytes: int) -> tuple[str, int]:
        align = 4096 if nbytes >= (1 << 20) else 64
        pad = (-self.size) % align
        if self.max_shard is not None and self.size > 0 and self.size + pad + nbytes > self.max_shard:
            self._open_next()
            pad = 0
        assert self.handle is not None
        if pad:
            self.handle.write(b"\0" * pad)
            self.size += pad
        offset = self.size
        if is_external(tensor):
            src, ref = model.resolver.path(tensor)
            _copy_range(src, ref.offset, nbytes, self.handle)
        elif tensor.HasField("raw_data"):
            self.handle.write(tensor.raw_data)
        else:
            self.handle.write(numpy_helper.to_array(tensor).tobytes())
        self.size += nbytes
        return self.files[-1].name, offset

    def close(self) -> list[Path]:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        return list(self.files)


def _copy_range(src: Path, offset: int, length: int, out) -> None:
    """Copy bytes file-to-file in the kernel where possible (no user-space buffer)."""
    out.flush()
    with open(src, "rb") as f:
        remaining, pos = length, offset
        if hasattr(os, "copy_file_range"):
            try:
                while remaining:
                    n = os.copy_file_range(f.fileno(), out.fileno(), min(remaining, 1 << 30), pos)
                    if n == 0:
                        break
                    pos += n
                    remaining -= n
            except OSError:
                pass
        f.seek(pos)
        while remaining:
            chunk = f.read(min(remaining, _COPY_CHUNK))
            if not chunk:
                raise ValidationError(f"{src} ended before the tensor's bytes were read")
            out.write(chunk)
            remaining -= len(chunk)


def check_saved(path: Path, reference: Path | None = None, graph: onnx.ModelProto | None = None) -> str | None:
    """``onnx.checker.check_model(path)`` and an ONNX Runtime CPU session on the saved file.

    ``graph``: for a single-file output, the written graph with its large initializers as
    references to their bytes in ``path``; the checker reads it instead of loading every weight
    again (same graph, same tensor headers; ONNX Runtime then parses the real file).

    A checker failure that the input model shares (e.g. ORT GenAI exports with ORT-only ops
    in the default domain) is logged, not raised: the output must fail no check that the
    input passed; the checker's reason is returned then (the run reports it), else ``None``.
    The ONNX Runtime session must always open.
    """
    note = None
    try:
        if graph is None:
            onnx.checker.check_model(str(path))
        else:
            # the checker resolves external locations beside the file it reads: put the graph
            # next to the output for a moment (the output's folder is the run's private one)
            probe = path.with_name(f".{path.name}.check-{os.getpid()}.onnx")
            try:
                probe.write_bytes(graph.SerializeToString())
                onnx.checker.check_model(str(probe))
            finally:
                probe.unlink(missing_ok=True)
    except (onnx.checker.ValidationError, onnx.onnx_cpp2py_export.checker.ValidationError) as exc:  # type: ignore[attr-defined]
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if reference is not None and reference.suffix == ".onnx" and not _passes_checker(reference):
            log.info("%s fails the ONNX checker as its input does: %s", path.name, reason)
            note = reason
        else:
            raise ValidationError(f"saved model {path.name} fails the ONNX checker: {reason}") from None
    open_session(path)
    return note


def check_with_ort_ops(path: Path) -> None:
    """``onnx.checker.check_model`` on ``path``, where ONNX Runtime's own ops in the default domain
    (``SimplifiedLayerNormalization``: the GenAI builder writes it there) are taken as the custom
    ops they are and everything else is checked as usual. Raises the checker's error."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    proto = onnx.load(str(path), load_external_data=False)
    ort_default = {s.name for s in ort_state.get_all_operator_schema() if s.domain in ("", "ai.onnx")}
    relabeled = 0
    for g in iter_graphs(proto.graph):
        for node in g.node:
            if node.domain in ("", "ai.onnx") and node.op_type in ort_default and not onnx.defs.has(node.op_type):
                node.domain = _ORT_DEFAULT_DOMAIN
                relabeled += 1
    if not relabeled:
        onnx.checker.check_model(str(path))
        return
    proto.opset_import.append(onnx.helper.make_opsetid(_ORT_DEFAULT_DOMAIN, 1))
    probe = path.with_name(f".{path.name}.check-{os.getpid()}.onnx")  # beside it: external data resolves
    try:
        probe.write_bytes(proto.SerializeToString())
        onnx.checker.check_model(str(probe))
    finally:
        probe.unlink(missing_ok=True)


#: the domain ONNX Runtime's default-domain ops are moved to for the checker (it skips unknown domains)
_ORT_DEFAULT_DOMAIN = "bitpress.onnxruntime_default_domain"


def _passes_checker(path: Path) -> bool:
    try:
        check_model_file(path)
    except Exception:
        return False
    return True


def check_model_file(path: Path) -> None:
    """``onnx.checker.check_model(path)``, for a model in a Hugging Face cache snapshot too; raises its error.

    In a snapshot the model and its data files are links into the cache's blobs, and the checker
    refuses linked external data ("it is a symbolic link") that ONNX Runtime reads. Loading the model
    (:meth:`OnnxModel.load`) checks those links bitpress's stricter way (:mod:`bitpress.hfcache`: each
    leads to a regular blob of the repository or of the cache's marked shared store, and holds the bytes
    its tensors need); the checker checks everything else on a private stand-in folder: the model's
    blob, linked, beside an empty regular file for each data file the snapshot has (it reads no weight).
    """
    path = Path(path)
    if paths.hf_snapshot(path.parent) is None:
        onnx.checker.check_model(str(path))
        return
    model = OnnxModel.load(path)
    try:
        locations = {external_ref(t).location for t in iter_tensors(model.proto)
                     if is_external(t) and not external_ref(t).location.startswith(INLINE_PREFIX)}
    finally:
        model.close()
    blob = paths.inside(path.parent, path.name, "model")
    with tempfile.TemporaryDirectory(prefix="bitpress-check-") as tmp:
        probe = Path(tmp) / path.name
        try:
            if path.name in locations:  # data inside the .onnx named as a data file: the checker wants a file
                raise OSError
            os.symlink(blob, probe)
        except OSError:  # no links here: the bytes
            shutil.copyfile(blob, probe)
        for location in sorted(locations - {path.name}):
            if os.path.lexists(path.parent / location):  # a missing one: the checker says so, as for a folder
                stand_in = Path(tmp) / location
                stand_in.parent.mkdir(parents=True, exist_ok=True)
                stand_in.touch()
        onnx.checker.check_model(str(probe))


def open_session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    # fatal only: a failure is raised with its message below; ORT's own log line of it would be a
    # second error line on stderr (found by the fuzzer, tests/fuzz)
    opts.log_severity_level = 4
    # the check is that the file loads and every op resolves; optimizing is not needed
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.add_session_config_entry("session.disable_prepacking", "1")  # a packed copy of every weight
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        # ONNX Runtime's text can span lines: folded, so the CLI's error stays one line
        raise ValidationError(f"ONNX Runtime cannot open the saved model {path.name}: {one_line(exc)}") from None


__all__ = ["SaveOptions", "check_saved", "check_with_ort_ops", "external_ref", "open_session", "save_onnx"]
