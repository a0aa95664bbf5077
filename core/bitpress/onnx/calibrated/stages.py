"""Cutting a graph into stages: the nodes to run before each weight input can be observed.

A stage ends at one or more *activations* (the inputs of quantizable MatMuls). Its nodes are
the ancestors of those activations that no earlier stage ran; every node runs in exactly one
stage. Between stages the values still needed later (the *frontier*: the residual stream,
attention masks, rotary tables, the activation itself) are kept per calibration sample.

Order matters for sequential calibration: stages follow the topological position of their
activations' producers, so a MatMul that is an ancestor of stage ``j``'s activation reads an
activation of a stage before ``j``: its weight is already quantized when stage ``j`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from bitpress.onnx.tensors import iter_graphs


@dataclass
class Stage:
    """One stage: the nodes it runs (indexes into ``graph.node``) and the names it exchanges."""

    activations: list[str]
    nodes: list[int] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # frontier values its nodes read
    outputs: list[str] = field(default_factory=list)  # values it computes that later stages (or it) need
    #: frontier values no stage after this one reads: dropped from the store when it is done
    release: list[str] = field(default_factory=list)


@dataclass
class StagePlan:
    stages: list[Stage]
    #: graph inputs some stage reads or observes: the calibration feeds keep only these
    feeds: list[str]
    #: node index -> the stage that runs it
    stage_of_node: dict[int, int]


def node_reads(node: onnx.NodeProto) -> list[str]:
    """Every name ``node`` reads: its inputs and what its subgraphs read from outside."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for sub in subs:
            for g in iter_graphs(sub):
                inner = {o for n in g.node for o in n.output} | {i.name for i in g.input}
                inner |= {t.name for t in g.initializer}
                names += [n for gn in g.node for n in gn.input if n and n not in inner]
    return list(dict.fromkeys(names))


def plan_stages(graph: onnx.GraphProto, groups: list[list[str]]) -> StagePlan:
    """Stages ending at each group of ``groups`` (activation names), in the order given.

    The caller orders the groups (:func:`order_activations`). An activation that is a graph
    input, or that an earlier stage already computed, gives a stage with no nodes.
    """
    inits = {t.name for t in graph.initializer}
    inputs = [i.name for i in graph.input if i.name not in inits]
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for o in node.output:
            if o:
                producer[o] = i
    reads = [node_reads(n) for n in graph.node]
    done: set[int] = set()
    stages: list[Stage] = []
    stage_of: dict[int, int] = {}
    for group in groups:
        mine: set[int] = set()
        stack = [producer[a] for a in group if a in producer]
        while stack:
            i = stack.pop()
            if i in done or i in mine:
                continue
            mine.add(i)
            stack.extend(producer[n] for n in reads[i] if n in producer)
        order = sorted(mine)
        for i in order:
            stage_of[i] = len(stages)
        done |= mine
        stages.append(Stage(list(group), order))
    # what each stage exchanges: read from earlier stages / graph inputs; needed by later ones
    made_in = {name: stage_of[i] for name, i in producer.items() if i in stage_of}
    last_use: dict[str, int] = {}
    for j, st in enumerate(stages):
        needed = {n for i in st.nodes for n in reads[i] if n not in inits}
        st.inputs = sorted(n for n in needed if made_in.get(n, -1) < j)
        for n in [*needed, *st.activations]:
            last_use[n] = max(last_use.get(n, -1), j)
    for j, st in enumerate(stages):
        made = {o for i in st.nodes for o in graph.node[i].output if o}
        st.outputs = sorted(n for n in made if last_use.get(n, -1) > j or n in st.activations)
    for name, j in last_use.items():
        stages[j].release.append(name)
    for st in stages:
        st.release.sort()
    feeds = sorted(n for n in inputs if n in last_use)
    return StagePlan(stages, feeds, stage_of)


def order_activations(graph: onnx.GraphProto, activations: set[str]) -> list[str]:
    """``activations`` by the position of their producers (graph inputs first)."""
    position: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for o in node.output:
            position.setdefault(o, i)
    return sorted(activations, key=lambda a: (position.get(a, -1), a))
