"""What to quantize, and how, before any weight is read: options, uses, groups and the plan.

:func:`plan` finds the weights of ``MatMul``, ``Gemm`` and ``Gather`` nodes, groups the nodes
that read the same table (tied embedding / LM head, weights shared by several MatMuls), applies
the user's selection and overrides, and records why every other weight stays float. The real
run and ``--plan`` (a dry run) both call it, so they cannot disagree.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import onnx
from onnx import helper

from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx import kernels, layout
from bitpress.onnx.graph import consumers, keeps_float, producers, used_names
from bitpress.onnx.weightonly import moe
from bitpress.onnx.weightonly.moe import ExpertPlan
from bitpress.options import option
from bitpress.quant.solver import check_block_size
from bitpress.selection import NameMatcher, short

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


# -- options -----------------------------------------------------------------------------------
@dataclass
class WeightOnlyOptions(kernels.TargetOptions):
    """Options every weight-only pass shares; the names follow Olive's passes."""

    bits: int = option(4, "bits per weight: 4 or 8 (set by --precision int4/int8)")
    block_size: int = option(32, "weights per block along K: a power of two from 16 to 256")
    is_symmetric: bool = option(False, "symmetric quantization (no zero points stored)")
    float_zero_point_form: Literal["correction", "native"] = option(
        "correction", "how float zero points are written: correction (symmetric MatMulNBits + an exact "
        "per-block correction from the input's block sums: fast kernels) or native (MatMulNBits float zero "
        "points: ONNX Runtime dequantizes the whole weight on every call)"
    )
    op_types: list[str] = option(
        ["MatMul", "Gemm", "Gather", "MoE"], "op types whose weights are quantized (MoE: a com.microsoft MoE node's "
        "experts, written as QMoE)"
    )
    nodes_to_include: list[str] = option(
        [], "only these nodes (names, globs or re:REGEX; node or weight names); empty: all"
    )
    nodes_to_exclude: list[str] = option([], "nodes left in float (names, globs or re:REGEX)")
    overrides: dict[str, dict[str, Any]] = option(
        {}, 'per-node settings, first match wins: {"re:.*down_proj.*": {"bits": 8}}'
    )
    quantize_router: bool = option(
        False, "quantize the router of a MoE node (the MatMul giving its router logits) too; default: kept float (a "
        "few KB, and a rounded router sends tokens to other experts)"
    )
    gather_min_rows: int = option(
        64, "Gather tables with fewer rows stay float (token-type tables: no size gain, error on every token)"
    )
    bpw: float | None = option(
        None, "a bits-per-weight budget (--bpw): each weight gets the bits (4/8) and block size (128/64/32) that "
        "lose least within it, scales and zero points counted, a tied table once; overrides stay as given"
    )
    bpw_samples: int = option(
        2, "samples of the calibration data on which bpw measures each weight's sensitivity (one run per weight "
        "and sample)"
    )

    def validate(self) -> None:
        check_bits_block(self.bits, self.block_size, "")
        if self.bpw is not None and not (isinstance(self.bpw, int | float) and 2.0 < float(self.bpw) <= 16.0):
            raise ValueError(f"bpw must be a number of bits per weight above 2 and at most 16, got {short(self.bpw)}")
        if not isinstance(self.bpw_samples, int) or isinstance(self.bpw_samples, bool) or self.bpw_samples < 1:
            raise ValueError(f"bpw_samples must be a positive integer, got {short(self.bpw_samples)}")
        bad = sorted(set(self.op_types) - {"MatMul", "Gemm", "Gather", "MoE"})
        if bad:
            raise ValueError(f"op_types {bad} are not supported; use MatMul, Gemm, Gather, MoE")
        for pattern, settings in self.overrides.items():
            where = f"overrides[{short(pattern, 60)}]"
            if not isinstance(settings, dict) or set(settings) - {"bits", "block_size", "is_symmetric"}:
                raise ValueError(f"{where} must map to bits / block_size / is_symmetric, got {short(settings)}")
            # JSON values, from a config file or --option alike: typed as they are, never parsed from strings
            for key, tp in (("bits", int), ("block_size", int), ("is_symmetric", bool)):
                value = settings.get(key)
                if value is not None and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
                    kind = "an integer" if tp is int else "true or false"
                    raise ValueError(f"{where}: {key} must be {kind}, got {short(value)}")
            check_bits_block(settings.get("bits", self.bits), settings.get("block_size", self.block_size),
                             f"{where}: ")
        # compile the patterns now: a pattern RE2 cannot express is refused before any model is read
        NameMatcher(self.nodes_to_include, what="nodes_to_include")
        NameMatcher(self.nodes_to_exclude, what="nodes_to_exclude")
        NameMatcher(list(self.overrides), what="overrides key")


def check_bits_block(bits: int, block_size: int, where: str) -> None:
    if bits not in (4, 8):
        raise ValueError(f"{where}bits must be 4 or 8, got {bits}")
    check_block_size(block_size, f"{where}block_size")


# -- what to quantize ------------------------------------------------------------------------------
@dataclass
class Use:
    """One node reading a weight, and how (which orientation it needs)."""

    node: onnx.NodeProto
    # "matmul" (B [K,N]), "matmul_t" (B = Transpose(T [N,K])), "gemm", "gemm_t" (transB=1),
    # "gather" (table T), "gather_t" (table = Transpose(W [K,N]): the ORT GenAI builder's tie)
    kind: str
    transpose: onnx.NodeProto | None = None

    @property
    def rows_are_table_rows(self) -> bool:
        # True: quantization blocks run along the stored tensor's last axis (its rows are the N rows)
        return self.kind in ("matmul_t", "gemm_t", "gather")

    @property
    def is_gather(self) -> bool:
        return self.kind in ("gather", "gather_t")


@dataclass
class Group:
    """One weight initializer and every node that will read its quantized form."""

    weight: str
    uses: list[Use] = field(default_factory=list)
    bits: int = 4
    block_size: int = 32
    symmetric: bool = False


@dataclass
class Plan:
    groups: list[Group]
    skipped: dict[str, str]  # weight or node -> reason
    notes: dict[str, str] = field(default_factory=dict)  # weight -> a setting the planner adjusted
    #: every candidate weight (graph order) and the nodes reading it, quantized or not
    uses: dict[str, list[Use]] = field(default_factory=dict)
    #: weight -> why the user's selection (nodes_to_include / nodes_to_exclude) leaves it float
    excluded: dict[str, str] = field(default_factory=dict)
    #: warnings: ``nodes_to_include`` / ``nodes_to_exclude`` / ``overrides`` patterns that match nothing
    unmatched: list[str] = field(default_factory=list)
    #: the experts of ``com.microsoft`` MoE nodes (:mod:`bitpress.onnx.weightonly.moe`)
    experts: ExpertPlan = field(default_factory=lambda: ExpertPlan())
    #: advice about the graph as a whole (loops over experts that a pass before this one would fuse)
    advice: list[str] = field(default_factory=list)


def zero_point_kind(group: Group, float_zero_points: bool) -> str:
    """What a group's zero points are written as: ``none`` (symmetric), ``uint8`` or ``float``.

    Float offsets exist only for 4-bit MatMulNBits: not for Gather, nor for 8 bits on CPU.
    """
    if group.symmetric:
        return "none"
    if float_zero_points and group.bits == 4 and not any(u.is_gather for u in group.uses):
        return "float"
    return "uint8"


def plan(model: OnnxModel, opts: WeightOnlyOptions) -> Plan:
    """Decide which weights to quantize and how, before reading any of them."""
    graph = model.graph
    inits = model.initializers()
    cons = consumers(graph)
    prods = producers(graph)
    include = NameMatcher(opts.nodes_to_include, what="nodes_to_include")
    exclude = NameMatcher(opts.nodes_to_exclude, what="nodes_to_exclude")
    overrides = NameMatcher(list(opts.overrides), what="overrides key")
    subgraph_reads = subgraph_reads_of(graph)
    graph_outputs = {o.name for o in graph.output}
    graph_inputs = {i.name for i in graph.input} - set(inits)
    skipped: dict[str, str] = {}
    notes: dict[str, str] = {}
    uses: dict[str, list[Use]] = defaultdict(list)

    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in opts.op_types:
            continue
        kept = keeps_float(node)
        if kept:
            skipped[node.name or node.output[0]] = kept
            continue
        use, weight, why = _classify(node, inits, prods, cons)
        if use is None:
            if why:
                skipped[node.name or node.output[0]] = why
            continue
        if use.kind in ("gather", "gather_t") and not include.matches(node.name, weight):
            not_tokens = _not_token_ids(node.input[1], prods, graph_inputs)
            if not_tokens:
                skipped[weight] = (f"{not_tokens}: kept in float (only token embeddings are quantized; "
                                   "nodes_to_include naming the node quantizes it)")
                continue
        uses[weight].append(use)
    experts = _plan_experts(model, opts, include, exclude, overrides)
    unmatched = _unmatched(graph, opts, uses, [(include, "nodes_to_include"), (exclude, "nodes_to_exclude"),
                                              (overrides, "overrides")], set(experts.tensors))

    groups = []
    excluded: dict[str, str] = {}
    routers = set() if opts.quantize_router else router_weights(graph, inits, prods, opts.op_types)
    for weight, wuses in uses.items():
        tensor = inits[weight]
        if weight in routers:
            skipped[weight] = ("the router of a MoE node: kept float (a few KB; a rounded router sends tokens to other "
                               "experts); quantize_router=true quantizes it")
            continue
        # every reader of the weight (directly or via the Transpose) must be a planned use
        nodes = {id(n): n for n in cons.get(weight, [])}
        planned = {id(u.node) for u in wuses} | {id(u.transpose) for u in wuses if u.transpose is not None}
        elsewhere = weight in graph_outputs or weight in subgraph_reads
        for u in wuses:
            if u.transpose is not None:
                t_out = u.transpose.output[0]
                nodes.update((id(n), n) for n in cons.get(t_out, []))
                elsewhere |= t_out in graph_outputs or t_out in subgraph_reads
        others = [n for key, n in nodes.items() if key not in planned]
        if others or elsewhere:
            named = sorted(f"{n.op_type} {n.name or n.output[0]}" for n in others)[:3]
            what = ", ".join(named) if named else "a graph output or subgraph"
            if len(others) > 3:
                what += f" and {len(others) - 3} more"
            skipped[weight] = (f"also read by {what}, which this pass does not quantize (op_types: "
                               f"{', '.join(opts.op_types)}); kept in float so the weight stays one tensor")
            continue
        names = [n for u in wuses for n in (u.node.name, weight)]
        if include and not any(include.matches(u.node.name, weight) for u in wuses):
            excluded[weight] = "not matched by nodes_to_include"
            continue
        out = [u.node.name for u in wuses if exclude.matches(u.node.name, weight)]
        if include:
            out += [u.node.name for u in wuses if not include.matches(u.node.name, weight)]
        if out:
            if len(wuses) > 1:
                skipped[weight] = (
                    f"shared by {len(wuses)} nodes and {', '.join(sorted(set(out)))} excluded: "
                    "all of them stay float so the weight stays one tensor"
                )
            else:
                key = exclude.first(wuses[0].node.name, weight)
                excluded[weight] = f"excluded by nodes_to_exclude {key!r}" if key else "not matched by nodes_to_include"
            continue
        orientations = {u.rows_are_table_rows for u in wuses}
        if len(orientations) > 1:
            skipped[weight] = "read in two orientations (e.g. MatMul and Gather without Transpose); kept in float"
            continue
        settings = []
        for u in wuses:
            key = overrides.first(u.node.name, weight)
            settings.append(dict(opts.overrides[key]) if key is not None else {})
        bits = {int(s.get("bits", opts.bits)) for s in settings}
        blocks = {int(s.get("block_size", opts.block_size)) for s in settings}
        sym = {bool(s.get("is_symmetric", opts.is_symmetric)) for s in settings}
        if len(bits) > 1 or len(blocks) > 1 or len(sym) > 1:
            skipped[weight] = (
                "tied/shared weight with conflicting overrides for its nodes "
                f"({', '.join(sorted(set(names)))}); kept in float"
            )
            continue
        group = Group(weight, wuses, bits.pop(), blocks.pop(), sym.pop())
        a, b = (int(d) for d in tensor.dims)
        n_rows, k = (a, b) if wuses[0].rows_are_table_rows else (b, a)
        gathers = [u for u in wuses if u.is_gather]
        if gathers and n_rows < opts.gather_min_rows:
            skipped[weight] = (
                f"Gather table with {n_rows} rows (< gather_min_rows={opts.gather_min_rows}): tiny tables such as "
                "token-type embeddings save nothing and their error reaches every token; kept in float"
            )
            continue
        if gathers and len(gathers) < len(wuses) and k % group.block_size:
            # a tied table is shared only when blocks tile its rows exactly: use the largest block that does
            fit = next((bs for bs in (256, 128, 64, 32, 16) if bs < group.block_size and k % bs == 0), None)
            if fit is not None:
                notes[weight] = f"tied table of width {k}: block_size {group.block_size} -> {fit} so both ends share it"
                group.block_size = fit
        reason = _layout_problem(group, tensor)
        if reason:
            skipped[weight] = reason
            continue
        groups.append(group)
    advice = _loop_advice(model) if set(moe.MOE_OPS) & set(opts.op_types) else []
    return Plan(groups, skipped, notes, dict(uses), excluded, unmatched, experts, advice)


def _loop_advice(model: OnnxModel) -> list[str]:
    """A note when the graph runs its experts as a loop of MatMuls (mobius's form): fused first, they become QMoE."""
    from bitpress.onnx.expert_loops import find_loops

    loops, _ = find_loops(model)
    if not loops:
        return []
    return [f"{len(loops)} loop(s) over experts ({loops[0].name}{' ...' if len(loops) > 1 else ''}: every expert "
            "runs on every token as plain MatMuls): here each expert's MatMuls are quantized as MatMulNBits; run the "
            "fuse_experts pass first (passes: [{type: fuse_experts}, ...]) to get one QMoE per layer, which runs only "
            "the routed experts (docs/moe.md)"]


#: ops a router's logits may pass through between its MatMul and the MoE node
_ROUTER_PATH = ("Add", "Cast", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten")


def router_weights(graph: onnx.GraphProto, inits: dict[str, onnx.TensorProto],
                   prods: dict[str, onnx.NodeProto], op_types: list[str]) -> set[str]:
    """The weights of the MatMuls / Gemms that give the MoE / QMoE nodes their router logits (a QMoE's too: a
    package whose experts are already QMoE keeps its routers float when its dense weights are quantized)."""
    out: set[str] = set()
    if not set(moe.MOE_OPS) & set(op_types):
        return out
    for node in (n for n in graph.node if n.domain == "com.microsoft" and n.op_type in ("MoE", "QMoE")):
        name = node.input[1] if len(node.input) > 1 else ""
        for _ in range(8):
            src = prods.get(name)
            if src is None:
                break
            if src.op_type in ("MatMul", "Gemm") and len(src.input) > 1:
                w = src.input[1]
                if w not in inits and w in prods and prods[w].op_type == "Transpose":
                    w = prods[w].input[0]
                if w in inits:
                    out.add(w)
                break
            if src.op_type not in _ROUTER_PATH:
                break
            # follow the activation input (an Add's other input is a bias constant)
            name = next((i for i in src.input if i and i not in inits), "")
    return out


def _plan_experts(model: OnnxModel, opts: WeightOnlyOptions, include: NameMatcher, exclude: NameMatcher,
                  overrides: NameMatcher) -> ExpertPlan:
    """Which MoE nodes' experts become QMoE, with what settings (one for all the tensors of a node)."""
    graph = model.graph
    inits = model.initializers()
    readers = Counter(name for n in graph.node for name in n.input)
    outside = {o.name for o in graph.output} | subgraph_reads_of(graph)
    ep = ExpertPlan()
    for node in moe.candidates(graph, opts.op_types):
        name = node.name or node.output[0]
        group, why = moe.describe(node, inits, readers)
        if group is None:
            ep.skipped[name] = f"experts kept float: {why}"
            continue
        weights = list(group.weights.values())
        for w in weights:
            ep.tensors[w] = node
        if any(w in outside for w in weights):
            ep.skipped[name] = "experts kept float: an expert weight is also a graph output or read by a subgraph"
            continue
        if include and not any(include.matches(name, w) for w in weights):
            ep.excluded[name] = "not matched by nodes_to_include"
            continue
        key = next((k for w in weights if (k := exclude.first(name, w)) is not None), None)
        if key is not None:
            ep.excluded[name] = f"excluded by nodes_to_exclude {key!r}"
            continue
        settings = []
        for w in weights:
            k = overrides.first(name, w)
            settings.append(dict(opts.overrides[k]) if k is not None else {})
        bits = {int(s.get("bits", opts.bits)) for s in settings}
        blocks = {int(s.get("block_size", opts.block_size)) for s in settings}
        sym = {bool(s.get("is_symmetric", opts.is_symmetric)) for s in settings}
        if len(bits) > 1 or len(blocks) > 1 or len(sym) > 1:
            ep.skipped[name] = ("experts kept float: overrides give its expert tensors different settings; one QMoE "
                                "node has one width, block size and zero-point choice (ONNX Runtime's CPU kernel "
                                "runs no mixed widths): give the node one override")
            continue
        group.bits, group.symmetric = bits.pop(), sym.pop()
        block, note = moe.fit_block(group, blocks.pop())
        if block is None:
            ep.skipped[name] = (f"experts kept float: no block size from 16 up divides both expert widths "
                                f"{group.hidden} and {group.inter} (QMoE needs one that does)")
            continue
        group.block_size, group.note = block, note
        ep.groups.append(group)
    return ep


def _unmatched(
    graph: onnx.GraphProto, opts: WeightOnlyOptions, uses: dict[str, list[Use]],
    matchers: list[tuple[NameMatcher, str]], extra: set[str] | None = None,
) -> list[str]:
    """A warning for each selection pattern that matches no candidate node or weight name.

    Candidates: every node of ``op_types`` (weights or not) and every weight they read, so a
    pattern that names a real MatMul is not reported even when that MatMul has no weight.
    """
    names = {n.name for n in graph.node if n.op_type in opts.op_types and n.name}
    names |= set(uses) | (extra or set())
    out = []
    for matcher, what in matchers:
        for pattern in matcher.unmatched(names):
            out.append(
                f"{what} pattern {pattern!r} matches no {'/'.join(opts.op_types)} node or weight name; it has no effect"
            )
    return out


def subgraph_reads_of(graph: onnx.GraphProto) -> set[str]:
    reads: set[str] = set()
    for node in graph.node:
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for g in subs:
                reads |= used_names(g)
    return reads


#: ops that pass token ids on unchanged in value (casts and reshapes)
_ID_PASSTHROUGH = ("Cast", "Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten")


def _not_token_ids(indices: str, prods: dict[str, onnx.NodeProto], graph_inputs: set[str]) -> str | None:
    """Why a Gather reading ``indices`` does not look up token ids (None when it does): its indices must be a
    graph input (through casts and reshapes) not named as positions. Rotary caches, position tables and other
    tables read at computed indices are not token embeddings."""
    name, hops = indices, 0
    while name in prods and prods[name].op_type in _ID_PASSTHROUGH and hops < 16:
        name, hops = prods[name].input[0], hops + 1
    if name in graph_inputs:
        return f"a table read at {name!r} (positions, not token ids)" if "position" in name.lower() else None
    producer = prods.get(name)
    what = f"{producer.op_type} {producer.name or name}" if producer is not None else name
    return f"a table read at computed indices ({what}: a rotary, position or cache table, not a token embedding)"


def _classify(
    node: onnx.NodeProto,
    inits: dict[str, onnx.TensorProto],
    prods: dict[str, onnx.NodeProto],
    cons: dict[str, list[onnx.NodeProto]],
) -> tuple[Use | None, str, str | None]:
    """How ``node`` reads a constant weight, or why it cannot be quantized."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Gather":
        name = node.input[0]
        t = inits.get(name)
        kind, tr = "gather", None
        if t is None and name in prods and prods[name].op_type == "Transpose":
            tr = prods[name]
            perm = [int(p) for p in attrs_of(tr).get("perm", [1, 0])]
            src = inits.get(tr.input[0])
            if src is not None and len(src.dims) == 2 and perm == [1, 0]:
                t, name, kind = src, tr.input[0], "gather_t"
        if t is None:
            return None, "", None  # a Gather on activations
        if len(t.dims) != 2 or t.data_type not in FLOAT_TYPES:
            return None, "", "Gather table is not a 2-D float initializer"
        if attrs.get("axis", 0) != 0:
            return None, "", "Gather axis is not 0 (GatherBlockQuantized needs gather_axis 0)"
        return Use(node, kind, tr if kind == "gather_t" else None), name, None
    if len(node.input) < 2:
        return None, "", None
    b = node.input[1]
    transpose = None
    t = inits.get(b)
    if t is None and node.op_type == "MatMul" and b in prods and prods[b].op_type == "Transpose":
        tr = prods[b]
        perm = [int(p) for p in attrs_of(tr).get("perm", [1, 0])]
        src = inits.get(tr.input[0])
        if src is not None and len(src.dims) == 2 and perm == [1, 0]:
            t, transpose, b = src, tr, tr.input[0]
    if t is None:
        return None, "", None  # activations x activations (attention scores): nothing to do
    if len(t.dims) != 2:
        # valid ONNX (a matrix-vector or a batched MatMul), but not one [K, N] matrix for MatMulNBits
        kind = {0: "a scalar", 1: "1-D, a matrix-vector product"}.get(len(t.dims), f"{len(t.dims)}-D, a batched MatMul")
        return None, "", f"weight {b} is {kind}; only 2-D weights are quantized, it stays float"
    if t.data_type not in FLOAT_TYPES:
        return None, "", f"weight {b} is {_type_name(t.data_type)}, not float; it stays as it is"
    if node.op_type == "MatMul":
        return Use(node, "matmul_t" if transpose is not None else "matmul", transpose), b, None
    # Gemm: Y = alpha * A' B' + beta * C
    if attrs.get("transA", 0):
        return None, "", "Gemm with transA=1 is skipped (MatMulNBits has no transposed A)"
    if float(attrs.get("alpha", 1.0)) != 1.0:
        return None, "", "Gemm with alpha != 1 is skipped (no exact rewrite)"
    if len(node.input) > 2 and node.input[2] and float(attrs.get("beta", 1.0)) != 1.0:
        return None, "", "Gemm with beta != 1 is skipped (no exact rewrite)"
    return Use(node, "gemm_t" if attrs.get("transB", 0) else "gemm"), b, None


def _type_name(data_type: int) -> str:
    try:
        return onnx.TensorProto.DataType.Name(data_type)
    except ValueError:
        return f"data type {data_type}"


def attrs_of(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _layout_problem(group: Group, tensor: onnx.TensorProto) -> str | None:
    a, b = (int(d) for d in tensor.dims)
    rows, cols = (a, b) if group.uses[0].rows_are_table_rows else (b, a)
    has_gather = any(u.is_gather for u in group.uses)
    has_matmul = any(not u.is_gather for u in group.uses)
    if has_gather:
        hidden = cols
        if hidden * group.bits % 8:
            return f"Gather table width {hidden} does not fill whole bytes at {group.bits} bits; kept in float"
        if tensor.data_type == onnx.TensorProto.BFLOAT16:
            return "bfloat16 tables are not supported by GatherBlockQuantized on CPU; kept in float"
    if has_gather and has_matmul:
        share = layout.tied_table_sharing(
            rows, cols, group.bits, group.block_size, "none" if group.symmetric else "uint8", flat=False
        )
        if not share.shareable:
            return (
                f"tied table read by Gather and MatMul cannot share one quantized layout ({share.reason}); "
                "both stay float so the tie is kept"
            )
    return None
