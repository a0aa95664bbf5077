"""An ONNX model held as its graph, with weights read only when a pass asks for them."""

from __future__ import annotations

import functools
import logging
import uuid
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from onnx import numpy_helper

from bitpress import paths
from bitpress.errors import ModelLoadError
from bitpress.models.base import ModelHandle
from bitpress.onnx.lazy_load import INLINE_PREFIX, load_lazy
from bitpress.onnx.tensors import (
    ExternalResolver,
    check_tensor,
    external_ref,
    is_external,
    iter_graphs,
    iter_tensors,
)
from bitpress.onnx.weight_reads import check_weight_reads

log = logging.getLogger(__name__)

#: new tensors at least this large go to a scratch file instead of memory
SPILL_THRESHOLD = 1 << 20


class OnnxModel(ModelHandle):
    """One ``.onnx`` graph.

    ``proto`` holds the graph; tensors stored as external data stay on disk (memory-mapped
    when read). Passes replace tensors with :meth:`set_initializer`, which writes large new
    tensors to a scratch file in the run's work folder, so the model is never held twice.
    """

    kind: ClassVar[str] = "onnx"

    def __init__(self, proto: onnx.ModelProto, source: Path, base_dir: Path | None = None) -> None:
        super().__init__(source)
        self.proto = proto
        self.resolver = ExternalResolver(base_dir if base_dir is not None else self.source.parent)
        self._spill: tuple[Path, object] | None = None
        self.modified = False
        #: set when saved: why ``onnx.checker`` rejects the output as it does the input (None: it passes)
        self.checker_note: str | None = None
        #: the source keeps weights in external data files (saving mirrors that by default)
        self.external_source = False
        #: the package folder this model is a component of (its genai_config.json, tokenizer), if any
        self.package_root: Path | None = None

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, path: Path | str) -> OnnxModel:
        """Read the graph of ``path`` and check its external data references (not the data)."""
        path = Path(path)
        if not path.exists():
            raise ModelLoadError(f"model not found: {path}")
        if path.is_dir():
            raise ModelLoadError(f"{path} is a folder; expected an .onnx file")
        if path.stat().st_size == 0:
            raise ModelLoadError(f"{path} is empty; expected an ONNX model")
        # in a Hugging Face cache snapshot the .onnx is a link: read the blob it was checked to lead to
        data = paths.inside(path.parent, path.name, "model") if paths.hf_snapshot(path.parent) else path
        # weights stored inside the .onnx stay in the file until a pass reads them
        location = f"{INLINE_PREFIX}{uuid.uuid4().hex}"
        try:
            proto = load_lazy(data, location)
        except (DecodeError, ValueError, IndexError, RuntimeError, OSError, OverflowError) as exc:
            raise ModelLoadError(
                f"{path} is not a valid ONNX model (truncated or another format): {_first_line(exc)}"
            ) from None
        # protobuf parses many non-ONNX byte strings without complaint: require a real graph
        if proto.ir_version <= 0 or not proto.opset_import or not proto.HasField("graph"):
            raise ModelLoadError(f"{path} is not a valid ONNX model (no IR version, opset or graph)")
        try:
            check_strings(proto)
            check_graphs(proto)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{path} is not a valid ONNX model: {exc}") from None
        model = cls(proto, path)
        model.resolver.extra[location] = data
        for tensor in iter_tensors(proto):
            if is_external(tensor):
                model.resolver.validate(tensor)
                if not external_ref(tensor).location.startswith(INLINE_PREFIX):
                    model.external_source = True
        try:
            # a weight its node cannot read (a STRING or 3-D Gemm weight): refused now, naming the node,
            # not at the final ONNX Runtime check of the output (after the tensors' own checks above)
            check_weight_reads(proto)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{path} is not a valid ONNX model: {exc}") from None
        return model

    # -- tensors -------------------------------------------------------------------------------
    @property
    def graph(self) -> onnx.GraphProto:
        return self.proto.graph

    def initializers(self) -> dict[str, onnx.TensorProto]:
        return {t.name: t for t in self.graph.initializer}

    def array(self, tensor: onnx.TensorProto | str) -> np.ndarray:
        """The data of a tensor (or of the named initializer), memory-mapped when external."""
        if isinstance(tensor, str):
            found = self.initializers().get(tensor)
            if found is None:
                raise KeyError(f"no initializer named {tensor!r}")
            tensor = found
        return self.resolver.read(tensor)

    def set_initializer(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        """Add or replace the initializer ``name`` with ``array``."""
        tensor = self.make_tensor(name, array)
        graph = self.graph
        for i, existing in enumerate(graph.initializer):
            if existing.name == name:
                graph.initializer[i].CopyFrom(tensor)
                break
        else:
            graph.initializer.append(tensor)
        self.modified = True
        return tensor

    def make_tensor(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        """A TensorProto for ``array``; large ones are written to the scratch file."""
        array = np.ascontiguousarray(array)
        if array.nbytes < SPILL_THRESHOLD or self._spill_dir is None:
            return numpy_helper.from_array(array, name)
        path, handle = self._spill_file()
        offset = handle.seek(0, 2)  # type: ignore[attr-defined]
        pad = (-offset) % 64
        handle.write(b"\0" * pad)  # type: ignore[attr-defined]
        offset += pad
        handle.write(memoryview(array.reshape(-1).view(np.uint8)))  # type: ignore[attr-defined]  # no copy
        handle.flush()  # type: ignore[attr-defined]
        empty = np.zeros((0,), dtype=array.dtype)
        tensor = numpy_helper.from_array(empty, name)
        del tensor.dims[:]
        tensor.dims.extend(array.shape)
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", path.name), ("offset", str(offset)), ("length", str(array.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        return tensor

    def remove_unused_initializers(self) -> list[str]:
        """Drop initializers no node (in any subgraph) or graph output uses."""
        from bitpress.onnx.graph import used_names

        used = used_names(self.graph)
        keep = [t for t in self.graph.initializer if t.name in used]
        dropped = [t.name for t in self.graph.initializer if t.name not in used]
        if dropped:
            del self.graph.initializer[:]
            self.graph.initializer.extend(keep)
            self.modified = True
        return dropped

    # -- scratch -------------------------------------------------------------------------------
    _spill_dir: Path | None = None

    def use_workdir(self, workdir: Path | None) -> None:
        """Let large new tensors spill to ``workdir`` (set by the host for each run)."""
        self._spill_dir = Path(workdir) if workdir is not None else None

    def _spill_file(self) -> tuple[Path, object]:
        if self._spill is None:
            assert self._spill_dir is not None
            self._spill_dir.mkdir(parents=True, exist_ok=True)
            path = self._spill_dir / f"spill-{uuid.uuid4().hex}.bin"
            self._spill = (path, open(path, "w+b"))  # noqa: SIM115 - lives as long as the model
            self.resolver.extra[path.name] = path
        return self._spill

    def close(self) -> None:
        if self._spill is not None:
            self._spill[1].close()  # type: ignore[attr-defined]


#: string fields that hold names (of values, nodes, ops, dims, metadata keys), and their longest length
_NAME_FIELDS = frozenset({"name", "input", "output", "op_type", "domain", "key", "dim_param", "denotation",
                          "ref_attr_name", "overload", "tensor_name"})
MAX_NAME_CHARS = 1 << 16


def check_strings(proto: onnx.ModelProto) -> None:
    """Every string field is valid UTF-8 (protobuf hands invalid ones over as bytes) and names are not absurd."""
    stack: list[Message] = [proto]
    while stack:
        msg = stack.pop()
        for fd, value in msg.ListFields():
            if fd.type == FieldDescriptor.TYPE_STRING:
                for v in (value if fd.is_repeated else (value,)):
                    if not isinstance(v, str):
                        raise ModelLoadError(
                            f"a {fd.containing_type.name}.{fd.name} is not valid UTF-8 text: {bytes(v)[:60]!r}"
                        )
                    if fd.name in _NAME_FIELDS and len(v) > MAX_NAME_CHARS:
                        raise ModelLoadError(
                            f"a {fd.containing_type.name}.{fd.name} is {len(v)} characters long "
                            f"(at most {MAX_NAME_CHARS}): {v[:40]!r}..."
                        )
            elif fd.type == FieldDescriptor.TYPE_MESSAGE:
                if fd.is_repeated:
                    stack.extend(value)
                else:
                    stack.append(value)


#: the value field each attribute type holds (the ONNX checker's rule: the type names the one field set)
_ATTR_FIELDS = {
    onnx.AttributeProto.FLOAT: "f", onnx.AttributeProto.INT: "i", onnx.AttributeProto.STRING: "s",
    onnx.AttributeProto.TENSOR: "t", onnx.AttributeProto.GRAPH: "g", onnx.AttributeProto.SPARSE_TENSOR: "sparse_tensor",
    onnx.AttributeProto.TYPE_PROTO: "tp", onnx.AttributeProto.FLOATS: "floats", onnx.AttributeProto.INTS: "ints",
    onnx.AttributeProto.STRINGS: "strings", onnx.AttributeProto.TENSORS: "tensors",
    onnx.AttributeProto.GRAPHS: "graphs", onnx.AttributeProto.SPARSE_TENSORS: "sparse_tensors",
    onnx.AttributeProto.TYPE_PROTOS: "type_protos",
}
_ATTR_VALUE_FIELDS = frozenset(_ATTR_FIELDS.values())


@functools.lru_cache(maxsize=1024)
def _arity(op_type: str, version: int) -> tuple[int, int, int, int] | None:
    try:
        s = onnx.defs.get_schema(op_type, version, "")
    except Exception:  # an unknown op (or version) is not this check's business
        return None
    return s.min_input, s.max_input, s.min_output, s.max_output


def check_nodes(graph: onnx.GraphProto, opset: int | None) -> None:
    """Every attribute has a known type and holds only that type's field; nodes of the standard
    domain have as many inputs and outputs as their operator takes (passes index them)."""
    for node in graph.node:
        where = f"node {node.name[:80]!r} ({node.op_type[:80]})" if node.name else f"a {node.op_type[:80]} node"
        for attr in node.attribute:
            want = _ATTR_FIELDS.get(attr.type)
            if want is None:
                raise ModelLoadError(f"{where}: attribute {attr.name[:80]!r} has no known type ({attr.type})")
            other = sorted(fd.name for fd, _ in attr.ListFields() if fd.name in _ATTR_VALUE_FIELDS and fd.name != want)
            if other:
                raise ModelLoadError(
                    f"{where}: attribute {attr.name[:80]!r} is of type "
                    f"{onnx.AttributeProto.AttributeType.Name(attr.type)} but holds {', '.join(other)}"
                )
        arity = _arity(node.op_type, opset) if opset and node.domain in ("", "ai.onnx") else None
        if arity is not None:
            lo_in, hi_in, lo_out, hi_out = arity
            n_in, n_out = len(node.input), len(node.output)
            if not lo_in <= n_in <= hi_in or not lo_out <= n_out <= hi_out:
                raise ModelLoadError(
                    f"{where} has {n_in} inputs and {n_out} outputs; {node.op_type} (opset {opset}) takes "
                    f"{_span(lo_in, hi_in)} inputs and {_span(lo_out, hi_out)} outputs"
                )


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo} or more" if hi >= (1 << 31) - 1 else f"{lo} to {hi}"


def check_graphs(proto: onnx.ModelProto) -> None:
    """Initializer names are unique in each graph, every node is well formed (:func:`check_nodes`),
    and every tensor's header is consistent."""
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    for graph in iter_graphs(proto.graph):
        check_nodes(graph, opset)
        seen: set[str] = set()
        names = [t.name for t in graph.initializer] + [s.values.name for s in graph.sparse_initializer]
        for name in names:
            if name in seen:
                where = f"graph {graph.name!r}" if graph.name else "the graph"
                raise ModelLoadError(f"{where} has two initializers named {name!r}")
            seen.add(name)
    for tensor in iter_tensors(proto):
        check_tensor(tensor)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
