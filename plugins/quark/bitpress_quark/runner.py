"""Hand an :class:`~bitpress.models.onnx_model.OnnxModel` to Quark and take its result back.

Quark's API takes model paths, so the model is saved to a scratch folder, Quark writes its
result beside it, and the result is loaded as the new model handle. The host then saves that
handle like any other (checker, ONNX Runtime session), so every Quark output is validated.
Nothing from ``quark`` is imported at module level.
"""

from __future__ import annotations

import collections
import logging
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bitpress.data import DataConfig, input_specs, iter_feeds
from bitpress.errors import QuantizationError, UsageError
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.save import SINGLE_FILE_LIMIT, SaveOptions, save_onnx
from bitpress.onnx.tensors import is_external, iter_graphs, iter_tensors, tensor_nbytes
from bitpress.passes import PassContext
from bitpress_quark.sandbox import QuarkMessages, contained, import_quark

log = logging.getLogger(__name__)

#: what Quark logs when a histogram calibration failed and it silently retried with another method
_FALLBACK = "Will automatically set the 'calibrate_method'"


class FeedReader:
    """Quark's ``CalibrationDataReader`` interface over a list of ONNX Runtime feeds.

    Quark only calls ``get_next()`` (its ``CachedDataReader`` copies the feeds once); iteration
    and ``len`` are there for code paths that loop over a reader.
    """

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = feeds
        self._it: Iterator[dict[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self.feeds)

    def __len__(self) -> int:
        return len(self.feeds)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return iter(self.feeds)


def calibration_feeds(model: OnnxModel, data: Any) -> list[dict[str, np.ndarray]]:
    """The host's calibration data (``context.data``) as a list of feeds."""
    if data is None:
        raise UsageError(
            "Quark static quantization needs calibration data: give --data (random, a .npz file or "
            "folder, or a .txt file with a tokenizer) or 'data:' in the config"
        )
    config = DataConfig.from_value(data)
    feeds = list(iter_feeds(model.proto, config, model.source.parent, root=getattr(model, "package_root", None)))
    if not feeds:
        raise UsageError(f"calibration data {config.source!r} gave no samples")
    return feeds


def placeholder_feeds(model: OnnxModel) -> list[dict[str, np.ndarray]]:
    """One all-zero feed. Quark's int4 path demands a non-empty reader but never runs it."""
    feed = {}
    for spec in input_specs(model.proto):
        shape = tuple(d if isinstance(d, int) and d > 0 else (1 if i == 0 else 8) for i, d in enumerate(spec.shape))
        feed[spec.name] = np.zeros(shape, dtype=spec.dtype)
    return [feed]


@dataclass
class QuarkReport:
    """What one Quark call produced, for ``bitpress quantize``'s summary."""

    mode: str
    quark_version: str
    seconds: float
    quantized_ops: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(self.quantized_ops.items()))
        return f"Quark {self.quark_version} {self.mode} in {self.seconds:.1f} s: {ops}"


def _scratch(context: PassContext) -> tuple[Path, bool]:
    """A private folder for this call, and whether the host removes it (its work folder)."""
    if context.workdir is not None:
        folder = Path(context.workdir) / f"quark-{uuid.uuid4().hex[:8]}"
        folder.mkdir(parents=True)
        return folder, True
    return Path(tempfile.mkdtemp(prefix="bitpress-quark-")), False


def run_quark(
    model: OnnxModel,
    context: PassContext,
    *,
    pass_name: str,
    mode: str,
    make_config: Callable[[Any, Path, bool], Any],
    feeds: list[dict[str, np.ndarray]] | None,
    quantized_ops: tuple[str, ...],
    post: Callable[[onnx.ModelProto], None] | None = None,
    check_messages: Callable[[QuarkMessages], None] | None = None,
) -> OnnxModel:
    """Run ``ModelQuantizer(make_config(quark_onnx, tmp_dir, external)).quantize_model`` on ``model``.

    ``quantized_ops``: op types of which the output must hold at least one (Quark returns the
    float model, with a warning only, when it finds nothing to quantize). ``post`` edits the
    result's graph before it becomes the new handle.
    """
    folder, host_owned = _scratch(context)
    try:
        src = folder / "input" / "model.onnx"
        # the copy keeps external data only when the model needs it; Quark reads either layout
        files = save_onnx(model, src, SaveOptions(check=False))
        external = len(files) > 1 or sum(tensor_nbytes(t) for t in iter_tensors(model.proto)) >= SINGLE_FILE_LIMIT
        dest = folder / "output" / "model.onnx"
        dest.parent.mkdir()
        t0 = time.perf_counter()
        quark_onnx = import_quark()
        with contained(folder) as messages:
            config = make_config(quark_onnx, folder / "tmp", external)
            reader = FeedReader(feeds) if feeds is not None else None
            try:
                quark_onnx.ModelQuantizer(config).quantize_model(str(src), str(dest), reader)
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise QuantizationError(f"Quark {mode} failed: {first}") from exc
        seconds = time.perf_counter() - t0
        if not dest.exists():
            # Quark logs some failures and returns None instead of raising
            errors = messages.errors()
            reason = errors[-1] if errors else "it wrote no output model"
            raise QuantizationError(f"Quark {mode} failed: {reason}")
        if check_messages is not None:
            check_messages(messages)
        shutil.rmtree(src.parent, ignore_errors=True)
        result = _load_result(model, dest)
        counts = collections.Counter(n.op_type for g in iter_graphs(result.proto.graph) for n in g.node)
        found = {op: counts[op] for op in quantized_ops if counts[op]}
        if not found:
            raise QuantizationError(
                f"Quark {mode} quantized nothing (no {', '.join(quantized_ops)} in its output): the model has "
                "no op Quark quantizes in this mode, or the options exclude them all"
            )
        if post is not None:
            post(result.proto)
        _drop_unused_opsets(result.proto)
        report = QuarkReport(mode, _quark_version(), seconds, found)
        context.extras.setdefault("reports", []).append((pass_name, model.source, report))
        log.info("%s", report.summary())
    except BaseException:
        if not host_owned:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if not host_owned:
        if any(is_external(t) for t in iter_tensors(result.proto)):
            # the new handle reads its tensors from the folder: remove it with the handle
            weakref.finalize(result, shutil.rmtree, folder, True)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    model.close()
    return result


def _quark_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("amd-quark")
    except PackageNotFoundError:
        return "?"


def _load_result(model: OnnxModel, path: Path) -> OnnxModel:
    """Quark's output as the new handle: tensors from Quark's folder, ``source`` still the input.

    Keeping the input's path as ``source`` lets the host's save compare checker results with
    the real input model, not with a scratch file.
    """
    loaded = OnnxModel.load(path)
    result = OnnxModel(loaded.proto, model.source, base_dir=path.parent)
    result.modified = True
    return result


def _drop_unused_opsets(proto: onnx.ModelProto) -> None:
    """Drop opset imports no node uses: Quark declares a dozen (com.amd.quark, training...)."""
    used = {n.domain or "" for g in iter_graphs(proto.graph) for n in g.node}
    for function in proto.functions:
        used.add(function.domain)
        used.update(n.domain or "" for n in function.node)
    keep = [o for o in proto.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    if len(keep) != len(proto.opset_import):
        del proto.opset_import[:]
        proto.opset_import.extend(keep)


def reject_fallback(method: str) -> Callable[[QuarkMessages], None]:
    """Fail when Quark replaced the requested calibration method after an error."""

    def check(messages: QuarkMessages) -> None:
        if messages.matching(_FALLBACK):
            errors = messages.errors()
            why = f" after: {errors[0]}" if errors else ""
            raise QuantizationError(
                f"Quark's {method} calibration failed and Quark fell back to another method{why}; "
                "choose another calibration_method"
            )

    return check
