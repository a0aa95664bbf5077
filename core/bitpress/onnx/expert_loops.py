"""Loops over experts (mobius's dense form of a mixture of experts) fused into ``com.microsoft.MoE`` nodes.

mobius 0.1.0 (and any exporter without the fused op) writes a mixture-of-experts layer as plain ONNX ops: every
expert runs on every token and the results are weighted by the router:

* router: ``L = MatMul(x, Wr) [+ br]``, then one of ``TopK(Softmax(L))`` with ``Div(v, ReduceSum(v))`` (Mixtral;
  Qwen3-MoE ``norm_topk_prob``), ``TopK(Softmax(L))`` as is (Qwen3-MoE without it) or ``Softmax(TopK(L))``
  (gpt-oss);
* expert ``i``: ``gate = MatMul(x, Wg) [+ bg]``, ``up = MatMul(x, Wu) [+ bu]``,
  ``h = gate * Sigmoid(alpha * gate) * (up + beta)`` (gpt-oss clamps first: ``Min(gate, limit)``,
  ``Clip(up, -limit, limit)``), ``y_i = MatMul(h, Wd) [+ bd]``;
* ``out = sum_i y_i * ReduceSum(w * Cast(Equal(topk_index, i)))``.

That is exactly ``com.microsoft.MoE``'s math (``activation_type=swiglu`` with ``alpha``, ``beta``,
``swiglu_limit``; ``normalize_routing_weights`` 1 for the renormalized or top-k-softmaxed routings). The third
routing (the full softmax's values at the top ``k``, not renormalized) needs QMoE's ``router_weights`` input: a
float ``MoE`` has none. :func:`find_loops` matches the pattern op by op (whatever differs is reported, never
guessed); :func:`fuse` replaces a loop by one ``MoE`` node whose experts are stacked from the loop's
initializers (``fc1`` gate / up rows interleaved, ``swiglu_fusion=1``, the layout ONNX Runtime's CPU kernels
take) after Reshapes that make the router's logits 2-D. The ``fuse_experts`` pass does it to a float model, so
that the weight-only passes then write ``QMoE`` (docs/moe.md); the GenAI export does it to mobius's packages
(:mod:`bitpress.genai.moe_loop`).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx import helper, numpy_helper

from bitpress.errors import QuantizationError, UsageError
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.graph import used_names
from bitpress.options import option
from bitpress.passes import Pass, PassContext
from bitpress.selection import NameMatcher

log = logging.getLogger(__name__)

_NODE_LAYER = re.compile(r"(?:^|/)layers\.(\d+)/")

class NoMatch(Exception):
    """The subgraph is not the expected op (the message says what was found)."""


@dataclass
class Expert:
    gate: str  # initializers: weight^T [K, N] as MatMul's B, bias [N] or ""
    up: str
    down: str
    gate_bias: str = ""
    up_bias: str = ""
    down_bias: str = ""


@dataclass
class ExpertLoop:
    """One decoder layer's loop over experts, as matched (see the module's docstring)."""

    name: str  # the loop's scope, e.g. model/layers.0/mlp
    layer: int | None
    x: str  # the experts' and router's input
    logits: str  # the router's logits (QMoE's router_probs)
    router_weights: str  # the full softmax, aggregated unnormalized (normalize 0); "" otherwise
    normalize: bool
    top_k: int
    output: str  # the sum's output, the layer's MoE output
    experts: list[Expert] = field(default_factory=list)
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None
    last: onnx.NodeProto | None = None  # the final Add (the MoE node takes its place)


class _Graph:
    def __init__(self, model: OnnxModel) -> None:
        self.model = model
        self.inits = model.initializers()
        self.prod: dict[str, onnx.NodeProto] = {}
        self.cons: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in model.graph.node:
            for o in n.output:
                self.prod[o] = n
            for i in n.input:
                if i:
                    self.cons[i].append(n)

    def node(self, name: str, *ops: str) -> onnx.NodeProto:
        n = self.prod.get(name)
        if n is None or n.op_type not in ops or n.domain not in ("", "ai.onnx"):
            found = "a graph input or initializer" if n is None else f"{n.op_type} {n.name}"
            raise NoMatch(f"{name} comes from {found}, not {' / '.join(ops)}")
        return n

    def const(self, name: str) -> np.ndarray | None:
        if name in self.inits:
            return np.asarray(self.model.array(self.inits[name]))
        n = self.prod.get(name)
        if n is None or n.op_type != "Constant":
            return None
        a = n.attribute[0]
        v = helper.get_attribute_value(a)
        return numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v)

    def scalar(self, name: str) -> float | None:
        v = self.const(name)
        return float(v.reshape(-1)[0]) if v is not None and v.size == 1 else None

    def attrs(self, n: onnx.NodeProto) -> dict[str, object]:
        return {a.name: helper.get_attribute_value(a) for a in n.attribute}


def _other(n: onnx.NodeProto, name: str) -> str:
    """The other input of a binary node ``n`` that reads ``name``."""
    a, b = n.input[0], n.input[1]
    return b if a == name else a


def _linear(g: _Graph, name: str) -> tuple[str, str, str]:
    """``name = MatMul(x, W) [+ b]`` with initializer ``W`` [K, N] (and ``b`` [N]): (x, W, b or "")."""
    n = g.node(name, "MatMul", "Add")
    bias = ""
    if n.op_type == "Add":
        b = next((i for i in n.input if i in g.inits), None)
        if b is None or len(g.inits[b].dims) != 1:
            raise NoMatch(f"{n.name} adds no 1-D bias initializer")
        bias = b
        n = g.node(_other(n, b), "MatMul")
    x, w = n.input[0], n.input[1]
    if w not in g.inits or len(g.inits[w].dims) != 2:
        raise NoMatch(f"{n.name} multiplies by {w}, not a 2-D weight initializer")
    if bias and int(g.inits[bias].dims[0]) != int(g.inits[w].dims[1]):
        raise NoMatch(f"{bias} does not fit {w}")
    return x, w, bias


def _swiglu(g: _Graph, name: str) -> tuple[str, str, float, float, float | None]:
    """``name = gate * Sigmoid(alpha * gate) * (up + beta)`` (gate, up clamped by ``limit`` first):
    (gate, up, alpha, beta, limit)."""
    h = g.node(name, "Mul")
    errors = []
    for act, up in ((h.input[0], h.input[1]), (h.input[1], h.input[0])):
        try:
            m = g.node(act, "Mul")
            sig_side = next((i for i in m.input if g.prod.get(i) is not None and g.prod[i].op_type == "Sigmoid"), None)
            if sig_side is None:
                raise NoMatch(f"{m.name} multiplies no Sigmoid")
            gc = _other(m, sig_side)
            z = g.node(sig_side, "Sigmoid").input[0]
            alpha = 1.0
            if z != gc:
                s = g.node(z, "Mul")
                alpha_v = g.scalar(_other(s, gc)) if gc in s.input else None
                if alpha_v is None:
                    raise NoMatch(f"{s.name} is not alpha * gate")
                alpha = alpha_v
            limit = None
            gate = gc
            gn = g.prod.get(gc)
            if gn is not None and gn.op_type == "Min":
                lim = next((g.scalar(i) for i in gn.input if g.scalar(i) is not None), None)
                if lim is None:
                    raise NoMatch(f"{gn.name} clamps by no constant")
                limit = lim
                gate = next(i for i in gn.input if g.scalar(i) is None)
            beta, u = 0.0, up
            un = g.prod.get(u)
            if un is not None and un.op_type == "Add" and any(g.scalar(i) is not None for i in un.input):
                bi = next(i for i in un.input if g.scalar(i) is not None)
                beta, u = float(g.scalar(bi)), _other(un, bi)  # type: ignore[arg-type]
                un = g.prod.get(u)
            if un is not None and un.op_type == "Clip":
                lo, hi = (g.scalar(i) if i else None for i in [*un.input, "", ""][1:3])
                if limit is None or lo != -limit or hi != limit:
                    raise NoMatch(f"{un.name} clamps up to [{lo}, {hi}], not to the gate's limit {limit}")
                u = un.input[0]
            elif limit is not None:
                raise NoMatch(f"the gate is clamped to {limit} but up is not clamped to [-{limit}, {limit}]")
            return gate, u, alpha, beta, limit
        except NoMatch as exc:
            errors.append(str(exc))
    raise NoMatch(f"{h.name} is not SwiGLU: {'; '.join(errors)}")


def _routing(g: _Graph, w: str, topk: onnx.NodeProto) -> tuple[str, str, bool]:
    """The router's (logits, router_weights or "", normalize) from the expert weights ``w`` of ``topk``."""
    src = topk.input[0]
    sn = g.prod.get(src)
    if sn is not None and sn.op_type == "Softmax":  # softmax over all experts, then top-k
        if int(g.attrs(sn).get("axis", -1)) != -1:
            raise NoMatch(f"{sn.name} is not over the last axis")
        logits = sn.input[0]
        if w == topk.output[0]:
            return logits, src, False  # unnormalized: QMoE aggregates the full softmax at the selected experts
        d = g.node(w, "Div")
        r = g.node(d.input[1], "ReduceSum")
        if d.input[0] != topk.output[0] or r.input[0] != topk.output[0] or not _last_axis_keep(g, r):
            raise NoMatch(f"{d.name} is not the top-k weights over their sum")
        return logits, "", True
    s = g.node(w, "Softmax")  # top-k of the logits, softmax over the selected ones: renormalized softmax
    if s.input[0] != topk.output[0] or int(g.attrs(s).get("axis", -1)) != -1:
        raise NoMatch(f"{s.name} is not a softmax of {topk.name}'s values")
    return src, "", True


def _last_axis_keep(g: _Graph, r: onnx.NodeProto) -> bool:
    axes = g.const(r.input[1]) if len(r.input) > 1 and r.input[1] else None
    return axes is not None and axes.reshape(-1).tolist() == [-1] and int(g.attrs(r).get("keepdims", 1)) == 1


def _loop(g: _Graph, topk: onnx.NodeProto) -> ExpertLoop | None:
    """The loop over experts reading ``topk``'s indices, or None when no Equal reads them."""
    equals = [n for n in g.cons.get(topk.output[1], []) if n.op_type == "Equal"]
    if not equals:
        return None
    a = g.attrs(topk)
    k = g.const(topk.input[1])
    if int(a.get("axis", -1)) != -1 or int(a.get("largest", 1)) != 1 or k is None or k.size != 1:
        raise NoMatch(f"{topk.name} is not a top-k over the last axis with a constant k")
    by_index: dict[int, tuple[str, str]] = {}  # expert index -> (its output, its weighted contribution)
    weights = set()
    for eq in equals:
        i = g.scalar(_other(eq, topk.output[1]))
        casts = g.cons.get(eq.output[0], [])
        if i is None or len(casts) != 1 or casts[0].op_type != "Cast":
            raise NoMatch(f"{eq.name} is not Cast(Equal(topk index, constant))")
        mul = g.cons.get(casts[0].output[0], [])
        if len(mul) != 1 or mul[0].op_type != "Mul":
            raise NoMatch(f"{casts[0].name} does not mask the routing weights")
        w = _other(mul[0], casts[0].output[0])
        red = g.cons.get(mul[0].output[0], [])
        if len(red) != 1 or red[0].op_type != "ReduceSum" or not _last_axis_keep(g, red[0]):
            raise NoMatch(f"{mul[0].name} is not summed over the top-k axis")
        contrib = [n for n in g.cons.get(red[0].output[0], []) if n.op_type == "Mul"]
        if len(contrib) != 1:
            raise NoMatch(f"{red[0].name} weights no single expert output")
        if int(i) in by_index:
            raise NoMatch(f"expert {int(i)} is selected twice")
        by_index[int(i)] = (_other(contrib[0], red[0].output[0]), contrib[0].output[0])
        weights.add(w)
    e = len(by_index)
    if sorted(by_index) != list(range(e)) or len(weights) != 1:
        raise NoMatch(f"experts {sorted(by_index)} are not 0..{e - 1} weighted by one routing tensor")
    logits, router_weights, normalize = _routing(g, weights.pop(), topk)
    x_router = _linear(g, logits)[0]  # the router is a linear layer of the experts' input
    loop = ExpertLoop(name="", layer=None, x=x_router, logits=logits, router_weights=router_weights,
                      normalize=normalize, top_k=int(k.reshape(-1)[0]), output="")
    acts = set()
    for i in range(e):
        y, _ = by_index[i]
        h, down, down_b = _linear(g, y)
        gate, up, alpha, beta, limit = _swiglu(g, h)
        xg, wg, bg = _linear(g, gate)
        xu, wu, bu = _linear(g, up)
        if xg != x_router or xu != x_router:
            raise NoMatch(f"expert {i} reads {xg} / {xu}, not the router's input {x_router}")
        loop.experts.append(Expert(wg, wu, down, bg, bu, down_b))
        acts.add((alpha, beta, limit))
    if len(acts) != 1:
        raise NoMatch(f"the experts' activations differ: {sorted(acts, key=str)}")
    loop.alpha, loop.beta, loop.limit = acts.pop()
    # the sum: Add(...Add(Add(c0, c1), c2)..., c_{E-1}), in any order of the contributions
    todo = {by_index[i][1] for i in range(e)}
    acc = by_index[0][1]
    todo.discard(acc)
    last = None
    while todo:
        adds = [n for n in g.cons.get(acc, []) if n.op_type == "Add"]
        if len(adds) != 1 or _other(adds[0], acc) not in todo:
            raise NoMatch(f"the expert outputs are not summed by one chain of Adds (at {acc})")
        last = adds[0]
        todo.discard(_other(last, acc))
        acc = last.output[0]
    if last is None:
        raise NoMatch("a loop over a single expert")
    loop.output, loop.last = acc, last
    loop.name = last.name.rsplit("/", 1)[0] if "/" in last.name else last.name
    m = _NODE_LAYER.search(last.name)
    loop.layer = int(m.group(1)) if m else None
    return loop



def find_loops(model: OnnxModel) -> tuple[list[ExpertLoop], dict[str, str]]:
    """Every loop over experts in ``model``'s main graph, and for each ``TopK`` that starts something else
    reading its indices through ``Equal`` (a loop that is not exactly MoE's), why it did not match."""
    g = _Graph(model)
    loops: list[ExpertLoop] = []
    other: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type != "TopK":
            continue
        try:
            loop = _loop(g, n)
        except NoMatch as exc:
            other[n.name or n.output[0]] = str(exc)
            continue
        if loop is not None:
            loops.append(loop)
    return loops, other


# -- the rewrite ----------------------------------------------------------------------------------
def interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.stack([a, b], axis=2).reshape(a.shape[0], 2 * a.shape[1], *a.shape[2:])


def stack(model: OnnxModel, names: list[str]) -> np.ndarray:
    return np.stack([np.asarray(model.array(n), dtype=np.float32) for n in names])


def rows_2d(model: OnnxModel, name: str, experts: int, base: str) -> tuple[str, onnx.NodeProto]:
    """``name`` reshaped to ``[tokens, experts]``: QMoE's router inputs are 2-D (mobius's logits are 3-D)."""
    shape = f"{base}_router_shape"
    if shape not in {t.name for t in model.graph.initializer}:
        model.graph.initializer.append(numpy_helper.from_array(np.array([-1, experts], np.int64), shape))
    out = f"{name}/bitpress_2d"
    return out, helper.make_node("Reshape", [name, shape], [out], name=f"{name}/bitpress_2d_Reshape")


def moe_node(model: OnnxModel, loop: ExpertLoop) -> list[onnx.NodeProto]:
    """The float ``MoE`` node equal to ``loop`` (fc1 gate / up interleaved), its experts added as
    initializers, after the Reshapes that make the router's logits (and weights) 2-D."""
    base = loop.name.replace("/", "_").strip("_") or "moe"
    ex = loop.experts
    logits, pre = rows_2d(model, loop.logits, len(ex), base)
    nodes = [pre]
    if loop.router_weights:
        loop.router_weights, pre = rows_2d(model, loop.router_weights, len(ex), base)
        nodes.append(pre)
    gate = stack(model, [x.gate for x in ex]).transpose(0, 2, 1)  # [E, I, H]
    up = stack(model, [x.up for x in ex]).transpose(0, 2, 1)
    down = stack(model, [x.down for x in ex]).transpose(0, 2, 1)  # [E, H, I]
    arrays = {f"{base}_fc1": interleave(gate, up), f"{base}_fc2": down}
    inputs = [loop.x, logits, f"{base}_fc1", "", f"{base}_fc2", ""]
    if any(x.gate_bias or x.up_bias for x in ex):
        def bias(names: list[str], n: int) -> np.ndarray:
            return np.stack([np.asarray(model.array(b), np.float32) if b else np.zeros(n, np.float32) for b in names])

        inter = gate.shape[1]
        arrays[f"{base}_fc1_bias"] = interleave(bias([x.gate_bias for x in ex], inter),
                                                 bias([x.up_bias for x in ex], inter))
        inputs[3] = f"{base}_fc1_bias"
    if any(x.down_bias for x in ex):
        arrays[f"{base}_fc2_bias"] = np.stack(
            [np.asarray(model.array(x.down_bias), np.float32) if x.down_bias else np.zeros(down.shape[1], np.float32)
             for x in ex])
        inputs[5] = f"{base}_fc2_bias"
    for name, a in arrays.items():
        model.graph.initializer.append(model.make_tensor(name, np.ascontiguousarray(a.astype(np.float32))))
    while not inputs[-1]:
        inputs.pop()
    attrs: dict[str, object] = {"k": loop.top_k, "activation_type": "swiglu", "swiglu_fusion": 1,
                                "normalize_routing_weights": int(loop.normalize),
                                "activation_alpha": float(loop.alpha), "activation_beta": float(loop.beta)}
    if loop.limit is not None:
        attrs["swiglu_limit"] = float(loop.limit)
    return [*nodes, helper.make_node("MoE", inputs, [loop.output], name=f"{loop.name}/MoE", domain="com.microsoft",
                                     **attrs)]


def drop_dead(model: OnnxModel) -> int:
    """Remove nodes nothing reads (the loops' leftovers), repeatedly."""
    g, dropped = model.graph, 0
    while True:
        used = used_names(g)
        keep = [n for n in g.node if any(o in used for o in n.output)]
        if len(keep) == len(g.node):
            return dropped
        dropped += len(g.node) - len(keep)
        new = [onnx.NodeProto() for _ in keep]
        for dst, src in zip(new, keep, strict=True):
            dst.CopyFrom(src)
        del g.node[:]
        g.node.extend(new)



def fuse(model: OnnxModel, loops: list[ExpertLoop]) -> list[onnx.NodeProto]:
    """Replace each of ``loops`` in ``model``'s graph by its float ``MoE`` node (in the loop's last Add's place);
    returns the new MoE nodes. Call :func:`drop_dead` after, to remove what the loops leave behind."""
    out = []
    for loop in loops:
        *pre, new = moe_node(model, loop)
        idx = next(i for i, n in enumerate(model.graph.node) if n is loop.last)
        model.graph.node[idx].CopyFrom(new)
        for j, n in enumerate(pre):
            model.graph.node.insert(idx + j, n)
        out.append(new)
    return out


# -- the pass -------------------------------------------------------------------------------------------------
@dataclass
class FuseExpertsOptions:
    """Options of the ``fuse_experts`` pass."""

    nodes_to_exclude: list[str] = option(
        [], "loops left as they are, by their scope (e.g. /model/layers.0/mlp; names, globs or re:REGEX)"
    )

    def validate(self) -> None:
        NameMatcher(self.nodes_to_exclude, what="nodes_to_exclude")


class FuseExpertsPass(Pass):
    """Fuses loops over experts (mobius's dense mixture of experts) into ``com.microsoft.MoE`` nodes, exactly."""

    name = "fuse_experts"
    algorithms = ("fuse_experts",)
    precisions = ()
    model_kinds = ("onnx",)
    needs_data = False
    summary = ("loops over experts (every expert on every token, mobius's form) into com.microsoft MoE nodes: "
               "the weight-only passes then write QMoE")
    experts: ClassVar[str | None] = "loops -> MoE"
    Options: ClassVar[type] = FuseExpertsOptions

    def run(self, model: Any, context: PassContext) -> Any:
        if not isinstance(model, OnnxModel):
            raise QuantizationError(f"{self.name} rewrites ONNX models, got {model.kind}")
        loops, other = find_loops(model)
        exclude = NameMatcher(self.options.nodes_to_exclude, what="nodes_to_exclude")
        for pattern in exclude.unmatched(loop.name for loop in loops):
            log.warning("%s: nodes_to_exclude pattern %r matches no loop over experts", model.source.name, pattern)
        kept: dict[str, str] = {}
        todo = []
        for loop in loops:
            if exclude.matches(loop.name):
                kept[loop.name] = "excluded by nodes_to_exclude"
            elif loop.router_weights:
                kept[loop.name] = ("its routing weights are the full softmax at the top k, not renormalized (Qwen3-MoE "
                                   "without norm_topk_prob): a float MoE node cannot aggregate them (only QMoE's "
                                   "router_weights input can); left as it is")
            else:
                todo.append(loop)
        for name, why in {**kept, **{k: f"not an exact loop over experts: {v}" for k, v in other.items()}}.items():
            log.warning("%s: %s not fused: %s", model.source.name, name, why)
        if not todo:
            found = f"{len(loops)} loop(s) over experts, none fused" if loops else "no loop over experts"
            detail = "; ".join(f"{k}: {v}" for k, v in list({**kept, **other}.items())[:2])
            raise UsageError(f"{self.name}: {model.source.name} has {found}" + (f" ({detail})" if detail else "")
                             + "; it takes graphs whose mixture-of-experts layers run every expert on every token "
                             "(mobius's form): a graph with MoE nodes needs no fusing")
        fuse(model, todo)
        dropped = drop_dead(model)
        model.remove_unused_initializers()
        model.modified = True
        for loop in todo:
            log.info("%s: %d experts (top %d) -> MoE", loop.name, len(loop.experts), loop.top_k)
        log.info("%s: %d loop(s) over experts fused into MoE nodes (%d nodes dropped)%s", self.name, len(todo),
                 dropped, f"; {len(kept) + len(other)} left as they are (see the log)" if kept or other else "")
        context.extras.setdefault("notes", []).append(
            f"{self.name}: {len(todo)} loop(s) over experts fused into MoE nodes"
            + (f"; {len(kept) + len(other)} left as they are: " + "; ".join(f"{k}: {v}" for k, v in
                                                                          list({**kept, **other}.items())[:3])
               if kept or other else ""))
        return model
