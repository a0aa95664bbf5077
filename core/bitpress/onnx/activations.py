"""Per-input-channel activation statistics, for algorithms that weight their error by them.

llama.cpp's imatrix idea: the mean of ``x**2`` for every input channel of a MatMul tells which
columns of its weight matter. Collected by running the model once per calibration sample in
ONNX Runtime, on a copy of the graph that gives only the statistics.

Memory stays about one copy of the weights plus one run's activations:

* **weights are not copied.** The graph copy is handed to ONNX Runtime as bytes, its
  initializers still external-data references to the model's own files (a single-file model's
  weights by their byte ranges inside the ``.onnx``), resolved against the model's folder
  (``session.model_external_initializers_file_folder_path``); ONNX Runtime maps them. Tensors
  a previous pass left in scratch files outside the folder travel inside the bytes. Weight
  pre-packing (a second, packed copy of every MatMul weight) is off for this session, and a
  tied embedding read as ``Gather(Transpose(W))`` (the GenAI builder's fp32 layout) gathers
  columns of ``W`` instead of having ONNX Runtime fold a transposed copy of the table.
* **statistics come out reduced.** Every activation goes through ``Flatten`` (to ``[rows,
  channels]``) and ``ReduceSumSquare`` over the rows in the graph, so a run returns one
  ``[channels]`` vector (and the row count) per activation instead of full ``[batch, seq,
  hidden]`` tensors for every layer at once.
* **only what the statistics need runs.** The graph's own outputs (``logits`` of ``[seq,
  vocab]``, ``present.*``) are dropped, and nodes and initializers that no statistic depends
  on (an untied LM head) with them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from bitpress.errors import QuantizationError, one_line
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.tensors import is_external, iter_graphs, iter_tensors

log = logging.getLogger(__name__)

_PREFIX = "bitpress_stats"


def channel_importance(
    model: OnnxModel, readers: dict[str, list[str]], feeds: Iterable[dict[str, np.ndarray]], workdir: Path,
) -> dict[str, np.ndarray]:
    """``{weight: mean(x**2) per input channel}`` for ``readers`` = ``{weight: [activation names]}``.

    ``workdir`` is kept for callers; nothing is written there.
    """
    wanted = sorted({a for acts in readers.values() for a in acts})
    if not wanted:
        return {}
    graph, outputs, base = stats_model(model, wanted)
    session = session_for(graph, base)
    del graph
    names = [n for pair in outputs.values() for n in pair if n]
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    n = 0
    for feed in feeds:
        try:
            outs = dict(zip(names, session.run(names, feed), strict=True))
        except Exception as exc:  # ORT raises its own pybind exception types
            shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in feed.items())
            raise QuantizationError(
                f"cannot run the model on the calibration data (inputs {shapes}): {one_line(exc)}"
            ) from None
        for act, (sq_name, shape_name) in outputs.items():
            if shape_name is None:  # not reduced in the graph (opset < 11): the activation itself
                x = np.asarray(outs[sq_name], dtype=np.float32)
                x2, rows = (x.reshape(-1, x.shape[-1]).astype(np.float64) ** 2).sum(axis=0), x.size // x.shape[-1]
            else:
                x2, rows = np.asarray(outs[sq_name], dtype=np.float64), int(outs[shape_name][0])
            sums[act] = sums[act] + x2 if act in sums else x2
            counts[act] = counts.get(act, 0) + rows
        del outs
        n += 1
    if n == 0:
        raise QuantizationError("the calibration data yielded no samples")
    del session
    result = {}
    for weight, acts in readers.items():
        total = sum(sums[a] for a in acts)
        count = sum(counts[a] for a in acts)
        result[weight] = (total / max(count, 1)).astype(np.float32)
    log.info("collected activation statistics for %d weights from %d samples", len(result), n)
    return result


def stats_model(model: OnnxModel, wanted: list[str]) -> tuple[bytes, dict[str, tuple[str, str | None]], Path]:
    """The serialized statistics graph, ``{activation: (sum of squares output, shape output)}`` and the
    folder its external-data locations are relative to."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)  # the graph: weights are external references, not data
    graph = proto.graph
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    reduced = opset >= 11  # Flatten with a negative axis
    outputs: dict[str, tuple[str, str | None]] = {}
    new_outputs: list[str] = []
    if reduced and opset >= 18:
        graph.initializer.append(helper.make_tensor(f"{_PREFIX}/axes0", TensorProto.INT64, [1], [0]))
    for i, act in enumerate(wanted):
        scope = f"{_PREFIX}/{i}"
        if not reduced:
            outputs[act] = (act, None)
            new_outputs.append(act)
            continue
        x32, flat, sq, shape = f"{scope}/x32", f"{scope}/flat", f"{scope}/sumsq", f"{scope}/shape"
        graph.node.append(helper.make_node("Cast", [act], [x32], name=f"{scope}/Cast", to=TensorProto.FLOAT))
        graph.node.append(helper.make_node("Flatten", [x32], [flat], name=f"{scope}/Flatten", axis=-1))
        if opset >= 18:
            graph.node.append(helper.make_node("ReduceSumSquare", [flat, f"{_PREFIX}/axes0"], [sq],
                                               name=f"{scope}/ReduceSumSquare", keepdims=0))
        else:
            graph.node.append(helper.make_node("ReduceSumSquare", [flat], [sq], name=f"{scope}/ReduceSumSquare",
                                               axes=[0], keepdims=0))
        graph.node.append(helper.make_node("Shape", [flat], [shape], name=f"{scope}/Shape"))
        outputs[act] = (sq, shape)
        new_outputs += [sq, shape]
    del graph.output[:]
    graph.output.extend(onnx.ValueInfoProto(name=name) for name in new_outputs)
    prune(graph)
    gather_without_transpose(graph)
    base = relocate(proto, model)
    return proto.SerializeToString(), outputs, base


def _subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Every name the node's subgraphs (If / Loop / Scan bodies) read: they may come from outside."""
    names: set[str] = set()
    for attr in node.attribute:
        subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for sub in subs:
            for g in iter_graphs(sub):
                for n in g.node:
                    names.update(n.input)
    return names


def prune(graph: onnx.GraphProto) -> None:
    """Drop the nodes and initializers no graph output depends on (the LM head, the cache outputs)."""
    needed = {o.name for o in graph.output}
    keep: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(node.input)
            needed |= _subgraph_inputs(node)
    if len(keep) == len(graph.node):
        return
    kept = list(reversed(keep))
    dropped = len(graph.node) - len(kept)
    del graph.node[:]
    graph.node.extend(kept)
    inits = [t for t in graph.initializer if t.name in needed]
    if len(inits) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(inits)
    log.debug("calibration graph: %d nodes no statistic needs dropped", dropped)


def gather_without_transpose(graph: onnx.GraphProto, tables: Collection[str] = ()) -> None:
    """``Gather(Transpose(W), ids)`` -> ``Transpose(Gather(W, ids, axis=1))``.

    The ONNX Runtime GenAI builder's fp32 exports read a tied embedding as ``Gather`` of the
    transposed LM-head weight; ONNX Runtime folds that ``Transpose`` into a second copy of the
    table (a vocabulary of 262k x 640 floats is 670 MB). Gathering columns of ``W`` and
    transposing the few rows gathered gives the same values without it. Only where the ids'
    rank is known (a graph input). ``tables``: graph inputs that are fed constant 2-D tables
    (qualifying like 2-D initializers).
    """
    two_d = {t.name for t in graph.initializer if len(t.dims) == 2} | set(tables)
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in graph.input
             if vi.type.tensor_type.HasField("shape")}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    rewritten: dict[int, list[onnx.NodeProto]] = {}
    dropped: set[int] = set()
    for node in graph.node:
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or node.input[0] not in two_d:
            continue
        if list(_ints(node, "perm") or [1, 0]) != [1, 0]:
            continue
        readers = consumers.get(node.output[0], [])
        if not readers or any(
            r.op_type != "Gather" or r.domain not in ("", "ai.onnx") or r.input[0] != node.output[0]
            or len(r.input) < 2 or r.input[1] == node.output[0] or (_ints(r, "axis") or 0) != 0
            or r.input[1] not in ranks for r in readers
        ):
            continue
        for r in readers:
            k = ranks[r.input[1]]
            cols = f"{r.output[0]}/{_PREFIX}_columns"
            rewritten[id(r)] = [
                helper.make_node("Gather", [node.input[0], r.input[1]], [cols], name=f"{r.name}/{_PREFIX}_columns",
                                 axis=1),
                helper.make_node("Transpose", [cols], [r.output[0]], name=f"{r.name}/{_PREFIX}_rows",
                                 perm=[*range(1, k + 1), 0]),
            ]
        dropped.add(id(node))
    if not rewritten:
        return
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if id(node) in dropped:
            continue
        nodes.extend(rewritten.get(id(node), [node]))
    del graph.node[:]
    graph.node.extend(nodes)
    log.debug("calibration graph: %d Gather(Transpose(table)) read without the transposed copy", len(dropped))


def _ints(node: onnx.NodeProto, name: str) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def relocate(proto: onnx.ModelProto, model: OnnxModel) -> Path:
    """Point every external tensor at its file relative to the model's folder (resolved).

    Locations are the resolver's (checked to stay in the folder when the model was loaded); a
    single-file model's weights are byte ranges of the ``.onnx`` itself. Tensors in files
    outside the folder (scratch files of earlier passes) are read into the graph.
    """
    base = model.resolver.base_dir.resolve()
    inlined = sum(relocate_tensor(t, model, base) for t in iter_tensors(proto) if is_external(t))
    if inlined:
        log.debug("calibration graph: %.1f MB of tensors outside the model's folder carried inline", inlined / 1e6)
    return base


def relocate_tensor(tensor: onnx.TensorProto, model: OnnxModel, base: Path) -> int:
    """Make the external ``tensor`` (a copy, edited in place) readable by a session whose external
    folder is ``base`` (the model's folder, resolved); returns the bytes carried inline instead."""
    path, ref = model.resolver.path(tensor)
    real = Path(path).resolve()
    if real.is_relative_to(base):
        entries = {"location": real.relative_to(base).as_posix(), "offset": str(ref.offset)}
        if ref.length is not None:
            entries["length"] = str(ref.length)
        del tensor.external_data[:]
        for key, value in entries.items():
            tensor.external_data.add(key=key, value=value)
        return 0
    data = model.resolver.read_bytes(tensor)
    del tensor.external_data[:]
    tensor.data_location = TensorProto.DEFAULT
    tensor.raw_data = data
    return len(data)


def session_for(graph: bytes, base: Path) -> Any:  # an onnxruntime.InferenceSession
    import onnxruntime as ort

    opts = ort.SessionOptions()
    # fatal only: a failure is raised below, as one line; ORT's own log line of it would be a second line
    opts.log_severity_level = 4
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(base))
    # pre-packing keeps a packed copy of every MatMul weight: twice the weights for a few runs
    opts.add_session_config_entry("session.disable_prepacking", "1")
    opts.enable_mem_pattern = False  # a pattern block preallocated on top of the arena: ~10% more for nothing
    # numpy's BLAS works between runs (statistics, solves): ONNX Runtime's threads must not spin meanwhile
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own pybind exception types
        raise QuantizationError(f"cannot run the model for calibration: {one_line(exc)}") from None

