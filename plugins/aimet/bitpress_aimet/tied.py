"""Tied weights (an embedding table that is also the LM head) through AIMET, kept as one tensor.

AIMET 2.42 refuses a weight that a ``Gather`` and a linear op (``MatMul``, ``Gemm``, ``Conv``)
both read, directly or through ``Transpose`` / ``Identity`` ("shared parameter(s) with
conflicting consumer types"), and its own remedy, ``duplicate_shared_initializers``, leaves two
diverging copies: the embedding quantized per tensor with the activation type, the head per
channel with the weight type. bitpress never ships two copies of a tied weight, so:

* :func:`untie` gives each consumer of such a weight but the first a copy of its own (AIMET
  quantizes each copy as it likes);
* :func:`retie`, on AIMET's QDQ output, points every consumer at the value the linear consumer
  reads (the head's dequantized int weights, or the float table when the head stays float), so
  the embedding and the head use one quantized tensor, and drops the other copies.

Nothing here imports AIMET.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import onnx

from bitpress_aimet.options import LINEAR_OPS

log = logging.getLogger(__name__)

#: consumers AIMET looks through when it decides whether a shared weight conflicts
_PASS_THROUGH = ("Transpose", "Identity")


@dataclass
class TiedWeight:
    """One weight read by a Gather and a linear op; ``uses``: (node name, input index, tensor name)."""

    name: str
    dims: tuple[int, ...]
    uses: list[tuple[str, int, str]] = field(default_factory=list)
    #: the tensor names, among those of ``uses``, whose leaf consumers are linear ops
    linear: set[str] = field(default_factory=set)


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    out: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name:
                out[name].append((node, i))
    return out


def _leaf_types(name: str, consumers: dict[str, list[tuple[onnx.NodeProto, int]]]) -> set[str]:
    """Op types that read ``name``, looking through Transpose / Identity (Shape reads no values)."""
    found: set[str] = set()
    stack, seen = [name], set()
    while stack:
        tensor = stack.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        for node, _ in consumers.get(tensor, []):
            if node.op_type == "Shape":
                continue
            if node.op_type in _PASS_THROUGH:
                stack.extend(node.output)
            else:
                found.add(node.op_type)
    return found


def name_nodes(graph: onnx.GraphProto) -> None:
    """Give unnamed nodes a unique name (AIMET names them too; ours must be known before it runs)."""
    taken = {n.name for n in graph.node if n.name}
    for i, node in enumerate(graph.node):
        if not node.name:
            candidate = f"/bitpress/{node.op_type}_{i}"
            while candidate in taken:
                candidate += "_"
            node.name = candidate
            taken.add(candidate)


def untie(model: onnx.ModelProto) -> list[TiedWeight]:
    """Split every weight AIMET would refuse into one copy per consumer; returns what was split."""
    graph = model.graph
    consumers = _consumers(graph)
    inits = {t.name: t for t in graph.initializer}
    taken = set(inits) | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    tied: list[TiedWeight] = []
    for name, tensor in list(inits.items()):
        if len(tensor.dims) < 2:
            continue
        direct = [(node, i) for node, i in consumers.get(name, []) if node.op_type != "Shape"]
        if len(direct) < 2:
            continue
        types = _leaf_types(name, consumers)
        if len(types) < 2 or not types & set(LINEAR_OPS):
            continue
        group = TiedWeight(name, tuple(tensor.dims))
        for k, (node, index) in enumerate(direct):
            use = name
            if k > 0:
                use = f"{name}.bitpress_tied{k}"
                while use in taken:
                    use += "_"
                taken.add(use)
                copy = onnx.TensorProto()
                copy.CopyFrom(tensor)
                copy.name = use
                graph.initializer.append(copy)
                node.input[index] = use
            group.uses.append((node.name, index, use))
        fresh = _consumers(graph)
        group.linear = {use for _, _, use in group.uses if _leaf_types(use, fresh) & set(LINEAR_OPS)}
        tied.append(group)
        log.debug("tied weight %s split for AIMET into %s", name, [u for _, _, u in group.uses])
    return tied


def _init_dims(graph: onnx.GraphProto, name: str) -> tuple[int, ...] | None:
    for t in graph.initializer:
        if t.name == name:
            return tuple(t.dims)
    return None


def _value_dims(graph: onnx.GraphProto, tensor: str) -> tuple[int, ...] | None:
    """Dims of ``tensor``: an initializer, or a DequantizeLinear of one (AIMET's prequantized weights)."""
    dims = _init_dims(graph, tensor)
    if dims is not None:
        return dims
    for node in graph.node:
        if tensor in node.output and node.op_type == "DequantizeLinear":
            return _init_dims(graph, node.input[0])
    return None


def retie(model: onnx.ModelProto, tied: list[TiedWeight]) -> list[str]:
    """Make every consumer of each tied weight read one value again; returns a line per weight."""
    graph = model.graph
    nodes = {n.name: n for n in graph.node}
    notes = []
    for group in tied:
        reads: list[tuple[onnx.NodeProto, int, str, str]] = []
        for node_name, index, use in group.uses:
            node = nodes.get(node_name)
            if node is None or index >= len(node.input):
                raise RuntimeError(f"tied weight {group.name}: node {node_name} is missing from AIMET's output")
            reads.append((node, index, use, node.input[index]))
        linear = [r for r in reads if r[2] in group.linear]
        keep = next((tensor for *_, tensor in linear if _value_dims(graph, tensor) == group.dims), None)
        if keep is None:
            raise RuntimeError(f"tied weight {group.name}: AIMET's output has no value of shape {list(group.dims)} "
                               "that its linear consumer reads")
        for node, index, _, tensor in reads:
            if tensor != keep:
                node.input[index] = keep
        quantized = _init_dims(graph, keep) is None
        notes.append(f"tied weight {group.name}: one tensor for {len(reads)} consumers "
                     f"({'quantized as the linear op' if quantized else 'float'})")
    if tied:
        prune(graph)
        toposort(graph)
        for group in tied:
            for use in sorted(group.linear):
                _rename_prefix(graph, use, group.name)
    return notes


def _rename_prefix(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Tensors named ``old...`` (the kept copy and what AIMET derived from it) renamed ``new...``.

    Only when none of the new names is taken: the retied model then shows the weight's own name.
    """
    names = ({t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
             | {i for n in graph.node for i in n.input} | {v.name for v in graph.value_info})
    mapping = {n: new + n[len(old):] for n in names if n.startswith(old)}
    if not mapping or set(mapping.values()) & (names - set(mapping)):
        return
    for t in graph.initializer:
        t.name = mapping.get(t.name, t.name)
    for v in graph.value_info:
        v.name = mapping.get(v.name, v.name)
    for node in graph.node:
        node.input[:] = [mapping.get(i, i) for i in node.input]
        node.output[:] = [mapping.get(o, o) for o in node.output]


def toposort(graph: onnx.GraphProto) -> None:
    """Order the nodes so each comes after the producers of its inputs, keeping the given order otherwise.

    Retying points a Gather near the graph's start at the head's DequantizeLinear near its end:
    that node (and what feeds it) has to move up.
    """
    nodes = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    done: set[int] = set()
    order: list[int] = []
    for start in range(len(nodes)):
        stack = [(start, False)]
        while stack:
            i, expanded = stack.pop()
            if i in done:
                continue
            if expanded:
                done.add(i)
                order.append(i)
                continue
            stack.append((i, True))
            deps = {producer[x] for x in nodes[i].input if x in producer} - done
            for attr in nodes[i].attribute:
                for sub in _subgraphs(attr):
                    deps |= {producer[x] for x in _outer_reads(sub) if x in producer} - done
            stack.extend((d, False) for d in sorted(deps, reverse=True))
    if order != list(range(len(nodes))):
        del graph.node[:]
        graph.node.extend(nodes[i] for i in order)


def prune(graph: onnx.GraphProto) -> None:
    """Remove nodes whose outputs nobody reads and initializers no node reads (graph outputs kept)."""
    needed = {o.name for o in graph.output}
    kept: list[onnx.NodeProto] = []
    for node in reversed(list(graph.node)):
        if any(o in needed for o in node.output) or _has_subgraph_or_effect(node):
            kept.append(node)
            needed.update(i for i in node.input if i)
            for attr in node.attribute:
                for sub in _subgraphs(attr):
                    needed.update(_outer_reads(sub))
    kept.reverse()
    if len(kept) != len(graph.node):
        del graph.node[:]
        graph.node.extend(kept)
    unused = [t for t in graph.initializer if t.name not in needed]
    for t in unused:
        graph.initializer.remove(t)


def _has_subgraph_or_effect(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def _subgraphs(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    if attr.type == onnx.AttributeProto.GRAPH:
        return [attr.g]
    if attr.type == onnx.AttributeProto.GRAPHS:
        return list(attr.graphs)
    return []


def _outer_reads(graph: onnx.GraphProto) -> set[str]:
    names = {i for n in graph.node for i in n.input if i}
    for n in graph.node:
        for attr in n.attribute:
            for sub in _subgraphs(attr):
                names |= _outer_reads(sub)
    return names


def retie_encodings(encodings: dict, tied: list[TiedWeight]) -> None:
    """AIMET's encodings JSON for the retied model: the kept copy's entry under the weight's name."""
    for group in tied:
        copies = {use for _, _, use in group.uses} - {group.name}
        keep = sorted(group.linear)[0] if group.linear else group.name
        for key, entries in list(encodings.items()):
            if isinstance(entries, list):
                out = []
                for e in entries:
                    name = e.get("name") if isinstance(e, dict) else None
                    if name == keep:
                        e = {**e, "name": group.name}
                    elif name in copies or (name == group.name and keep != group.name):
                        continue
                    out.append(e)
                encodings[key] = out
            elif isinstance(entries, dict):  # encoding format 0.6.1: {tensor name: encoding}
                if keep in entries:
                    entries[group.name] = entries.pop(keep)
                for c in copies - {keep}:
                    entries.pop(c, None)


__all__ = ["TiedWeight", "name_nodes", "prune", "retie", "retie_encodings", "toposort", "untie"]
