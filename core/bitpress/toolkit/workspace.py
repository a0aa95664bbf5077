"""A private folder for one toolkit call: the model saved there, the toolkit's output read back.

Toolkits take model paths and write their result as files. :class:`Workspace` saves the
current model handle into a scratch folder (external data only when the model needs it),
gives the toolkit an output path, and turns what it wrote into the new handle, whose tensors
are then read from that folder. The host saves that handle like any other (checker, ONNX
Runtime session), so every toolkit output is validated. The folder is the host's work folder
when it has one (removed with it), else a temporary one removed on failure or with the handle.
"""

from __future__ import annotations

import collections
import logging
import shutil
import tempfile
import uuid
import weakref
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import TracebackType
from typing import Any

import onnx

from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.save import SINGLE_FILE_LIMIT, SaveOptions, save_onnx
from bitpress.onnx.tensors import is_external, iter_graphs, iter_tensors, tensor_nbytes
from bitpress.passes import PassContext

log = logging.getLogger(__name__)


class Workspace:
    """Scratch folder of one toolkit call. Use :meth:`open`, then :meth:`load` the output."""

    def __init__(self, folder: Path, host_owned: bool) -> None:
        self.folder = folder
        #: the host's work folder holds it: the host removes it, not us
        self.host_owned = host_owned
        self.input = folder / "input" / "model.onnx"
        self.output = folder / "output" / "model.onnx"
        self.tmp = folder / "tmp"
        self.external = False

    @classmethod
    def open(cls, model: OnnxModel | None, context: PassContext, *, prefix: str, save_input: bool = True) -> Workspace:
        """A new workspace; ``model`` saved at :attr:`input` unless ``save_input`` is false."""
        if context.workdir is not None:
            folder = Path(context.workdir) / f"{prefix}-{uuid.uuid4().hex[:8]}"
            folder.mkdir(parents=True)
            ws = cls(folder, True)
        else:
            ws = cls(Path(tempfile.mkdtemp(prefix=f"bitpress-{prefix}-")), False)
        try:
            ws.output.parent.mkdir(parents=True)
            ws.tmp.mkdir()
            if model is not None and save_input:
                ws.save_input(model)
        except BaseException:
            ws.discard()
            raise
        return ws

    def save_input(self, model: OnnxModel) -> Path:
        """Save ``model`` at :attr:`input`; :attr:`external` tells whether it has external data."""
        files = save_onnx(model, self.input, SaveOptions(check=False))
        self.external = len(files) > 1 or sum(tensor_nbytes(t) for t in iter_tensors(model.proto)) >= SINGLE_FILE_LIMIT
        return self.input

    def drop_input(self) -> None:
        """Remove the saved input once the toolkit is done with it (disk space on large models)."""
        shutil.rmtree(self.input.parent, ignore_errors=True)

    def load(self, path: Path, model: OnnxModel) -> OnnxModel:
        """The toolkit's output at ``path`` as the new handle; ``source`` stays ``model``'s.

        Keeping the input's path as ``source`` lets the host's save compare checker results with
        the real input model, not with a scratch file.
        """
        loaded = OnnxModel.load(path)
        result = OnnxModel(loaded.proto, model.source, base_dir=path.parent)
        # large inline tensors were moved out of the proto when it was loaded: keep where they went
        result.resolver.extra.update(loaded.resolver.extra)
        result.modified = True
        return result

    def finish(self, result: OnnxModel) -> None:
        """Done: keep the folder as long as ``result`` reads tensors from it, else remove it."""
        if self.host_owned:
            return
        if any(is_external(t) for t in iter_tensors(result.proto)):
            weakref.finalize(result, shutil.rmtree, self.folder, True)
        else:
            shutil.rmtree(self.folder, ignore_errors=True)

    def discard(self) -> None:
        """Remove the folder (a failed call), unless it is in the host's work folder."""
        if not self.host_owned:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is not None:
            self.discard()


def count_ops(proto: onnx.ModelProto) -> collections.Counter[str]:
    """Op types of every node, subgraphs included."""
    return collections.Counter(n.op_type for g in iter_graphs(proto.graph) for n in g.node)


def drop_unused_opsets(proto: onnx.ModelProto) -> None:
    """Drop opset imports no node uses (toolkits declare their private domains on every output)."""
    used = {n.domain or "" for g in iter_graphs(proto.graph) for n in g.node}
    for function in proto.functions:
        used.add(function.domain)
        used.update(n.domain or "" for n in function.node)
    keep = [o for o in proto.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    if len(keep) != len(proto.opset_import):
        del proto.opset_import[:]
        proto.opset_import.extend(keep)


def dist_version(distribution: str) -> str:
    """The installed version of ``distribution``, ``"?"`` when it is not installed."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "?"


@dataclass
class ToolReport:
    """What one toolkit call produced, for ``bitpress quantize``'s summary and ``--json`` report."""

    tool: str
    version: str
    mode: str
    seconds: float
    quantized_ops: dict[str, int] = field(default_factory=dict)
    #: anything else worth reporting (decisions, trials); must be JSON-serializable
    details: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(self.quantized_ops.items()))
        return f"{self.tool} {self.version} {self.mode} in {self.seconds:.1f} s: {ops}"

    def to_json(self) -> dict[str, Any]:
        return {"tool": self.tool, "tool_version": self.version, "mode": self.mode,
                "seconds": round(self.seconds, 3), "quantized_ops": dict(self.quantized_ops), **self.details}


def record_report(context: PassContext, pass_name: str, model: OnnxModel, report: Any) -> None:
    """Add ``report`` (an object with ``summary()``) to the run's reports and log its summary."""
    context.extras.setdefault("reports", []).append((pass_name, model.source, report))
    log.info("%s", report.summary())
