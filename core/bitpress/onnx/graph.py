"""Small graph queries shared by the passes and the savers."""

from __future__ import annotations

from collections import defaultdict

import onnx

from bitpress.onnx.tensors import iter_graphs

MS_DOMAIN = "com.microsoft"
#: a node ``metadata_props`` key: the node's weight stays float; the value says why (quantizers skip it)
KEEP_FLOAT = "bitpress.keep_float"


def keeps_float(node: onnx.NodeProto) -> str | None:
    """Why ``node`` must stay float (its :data:`KEEP_FLOAT` metadata), or None."""
    for prop in node.metadata_props:
        if prop.key == KEEP_FLOAT:
            return prop.value or "marked to stay float"
    return None


def used_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name read by a node (any subgraph) or exposed as a graph output."""
    used: set[str] = set()
    for g in iter_graphs(graph):
        for node in g.node:
            used.update(i for i in node.input if i)
        used.update(o.name for o in g.output)
    return used


def consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Value name -> the nodes of this graph (not subgraphs) that read it."""
    out: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            if name:
                out[name].append(node)
    return out


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: node for node in graph.node for o in node.output if o}


def ensure_opsets(model: onnx.ModelProto) -> None:
    """Declare every domain the nodes use (ORT's own k-quant output forgets com.microsoft)."""
    declared = {o.domain for o in model.opset_import}
    needed = {
        node.domain for g in iter_graphs(model.graph) for node in g.node
    } - declared - {"ai.onnx"}
    for domain in sorted(needed):
        if domain == "" and "ai.onnx" in declared:
            continue
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))


def unique_name(graph: onnx.GraphProto, base: str, taken: set[str] | None = None) -> str:
    """``base`` or ``base_N``, unused among nodes, values and initializers."""
    if taken is None:
        taken = {n.name for n in graph.node}
        taken |= {o for n in graph.node for o in n.output}
        taken |= {t.name for t in graph.initializer}
        taken |= {i.name for i in graph.input}
    name, i = base, 1
    while name in taken:
        name = f"{base}_{i}"
        i += 1
    taken.add(name)
    return name
