"""Mixture-of-experts weights: ``com.microsoft.MoE`` nodes become ``QMoE``, their experts quantized like any weight.

This module plans (what a MoE node holds, the settings its experts get); :mod:`~bitpress.onnx.weightonly.qmoe`
solves and writes them.

A ``MoE`` node holds its experts as 3-D initializers: ``fc1`` ``[E, fusion * inter, hidden]``,
``fc2`` ``[E, hidden, inter]`` and, unfused, ``fc3`` ``[E, inter, hidden]``: one row per output
channel, the reduction axis last, the orientation of a table. Each is solved by the pass's block
solver as ``E * rows`` independent rows (blocks never cross an expert), in bounded chunks, and
written as ``QMoE`` in the layout ONNX Runtime 1.32's CPU kernel reads (checked against its
contrib-op schema and by tests/onnx/test_qmoe.py):

* weights uint8 ``[E, N, K * bits / 8]``: each row's blocks packed as ``MatMulNBits`` packs them
  (lowest index in the lowest bits), concatenated;
* scales ``[E, N, K / block_size]`` in the activation's type; zero points (asymmetric) uint8
  ``[E, N, ceil(K / block_size * bits / 8)]`` packed the same way; integer zero points only, so
  a solver whose optimum is a float offset (k-quant, HQQ) solves the experts in its
  integer-zero-point form;
* ``expert_weight_bits`` and one ``block_size`` for the whole node, dividing both ``hidden`` and
  ``inter`` (the CPU kernel refuses mixed widths); a block that does not divide them is lowered
  to the largest that does, said in the plan;
* SwiGLU with interleaved gate / up rows (``swiglu_fusion=1``), the only layout the CPU kernel
  takes: a concatenated ``fc1`` (``swiglu_fusion=2``) or a separate ``fc3`` (``0``) is quantized
  row by row as it is and its rows (integers, scales, zero points, biases) interleaved after,
  which is exact. Routing and activation attributes (``k``, ``normalize_routing_weights``,
  ``activation_alpha`` / ``beta``, ``swiglu_limit``, ...) are carried over.

``accuracy_level`` follows the pass's (``4`` on the cpu target: int8 activations; 8-bit experts
use int8 activations at every level on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import helper

from bitpress.onnx.graph import MS_DOMAIN

#: the op types whose experts are quantized (``op_types`` names them like MatMul or Gather)
MOE_OPS = ("MoE",)
#: a MoE node's expert weights and biases, by input position
WEIGHT_INPUTS = {"fc1": 2, "fc2": 4, "fc3": 6}
BIAS_INPUTS = {"fc1": 3, "fc2": 5, "fc3": 7}
#: QMoE's inputs, in order (ONNX Runtime 1.32's schema); absent optional ones are empty names
QMOE_INPUTS = ("input", "router_probs", "fc1_w", "fc1_scales", "fc1_bias", "fc2_w", "fc2_scales", "fc2_bias",
               "fc3_w", "fc3_scales", "fc3_bias", "fc1_zp", "fc2_zp", "fc3_zp")
#: MoE attributes QMoE takes as they are
CARRIED = ("k", "activation_type", "normalize_routing_weights", "use_sparse_mixer", "activation_alpha",
           "activation_beta", "swiglu_limit", "swiglu_limit_after_activation")


@dataclass
class ExpertGroup:
    """One ``MoE`` node and how its experts are quantized (every tensor alike: one QMoE node)."""

    node: onnx.NodeProto
    weights: dict[str, str]  # role (fc1 / fc2 / fc3) -> initializer
    experts: int
    hidden: int
    inter: int
    fusion: int  # the source's gate / up layout: 0 separate fc3, 1 interleaved, 2 concatenated
    swiglu: bool
    bits: int = 4
    block_size: int = 32
    symmetric: bool = False
    note: str | None = None

    @property
    def name(self) -> str:
        return self.node.name or self.node.output[0]

    def shape(self, role: str) -> tuple[int, int, int]:
        """``(E, N, K)`` of one expert tensor as stored."""
        e, h, i = self.experts, self.hidden, self.inter
        if role == "fc1":
            return e, (2 * i if self.swiglu and self.fusion else i), h
        return (e, h, i) if role == "fc2" else (e, i, h)

    def numel(self, role: str) -> int:
        e, n, k = self.shape(role)
        return e * n * k

    def stored_bytes(self, role: str, scale_bytes: int) -> int:
        """Bytes QMoE stores for one tensor: integers, scales, packed zero points."""
        e, n, k = self.shape(role)
        nb = k // self.block_size
        zps = 0 if self.symmetric else e * n * -(-nb * self.bits // 8)
        return e * n * k * self.bits // 8 + e * n * nb * scale_bytes + zps


@dataclass
class ExpertPlan:
    """What the planner decided about the graph's MoE nodes."""

    groups: list[ExpertGroup] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # node name -> why its experts stay float
    excluded: dict[str, str] = field(default_factory=dict)  # node name -> the user's selection
    #: every expert tensor of a candidate node (weight -> node), quantized or not: the plan's rows
    tensors: dict[str, onnx.NodeProto] = field(default_factory=dict)


def attrs_of(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def input_of(node: onnx.NodeProto, i: int) -> str:
    return node.input[i] if len(node.input) > i else ""


def candidates(graph: onnx.GraphProto, op_types: list[str]) -> list[onnx.NodeProto]:
    """The graph's ``com.microsoft`` MoE nodes, when ``op_types`` names them."""
    if not set(MOE_OPS) & set(op_types):
        return []
    return [n for n in graph.node if n.domain == MS_DOMAIN and n.op_type in MOE_OPS]


def describe(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto],
             readers: dict[str, int]) -> tuple[ExpertGroup | None, str | None]:
    """The node's experts as an :class:`ExpertGroup` (default settings), or why they stay float.

    ``readers``: how many nodes read each name (a weight read elsewhere stays one float tensor)."""
    attrs = attrs_of(node)
    act = attrs.get("activation_type", b"relu")
    act = act.decode() if isinstance(act, bytes) else str(act)
    swiglu = act == "swiglu"
    fusion = int(attrs.get("swiglu_fusion", 0)) if swiglu else 0
    weights = {r: input_of(node, i) for r, i in WEIGHT_INPUTS.items() if input_of(node, i)}
    if "fc1" not in weights or "fc2" not in weights:
        return None, "a MoE node without fc1 and fc2 expert weights"
    if act not in ("relu", "gelu", "silu", "swiglu", "identity"):
        return None, f"activation {act!r}: ONNX Runtime's CPU QMoE runs relu, gelu, silu, swiglu and identity"
    if "fc3" in weights and not (swiglu and fusion == 0):
        return None, (f"an fc3 expert weight with activation {act!r}"
                      + (f" and swiglu_fusion={fusion}" if swiglu else "") + ": no QMoE layout carries it")
    if swiglu and fusion == 0 and "fc3" not in weights:
        return None, "unfused SwiGLU (swiglu_fusion=0) without fc3 weights"
    if attrs.get("quant_type") is not None:
        return None, "the MoE node has a quant_type attribute"
    if any(node.input[8:]):
        return None, "it has inputs after fc3_experts_bias, which ONNX Runtime 1.32's MoE does not define"
    for role, name in weights.items():
        t = inits.get(name)
        if t is None:
            return None, f"its {role} experts ({name}) are computed, not an initializer"
        if len(t.dims) != 3:
            return None, f"its {role} experts ({name}) are {len(t.dims)}-D, not [experts, rows, K]"
        if t.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            return None, (f"its {role} experts ({name}) are {onnx.TensorProto.DataType.Name(t.data_type)}: "
                          "QMoE scales follow the activations, float32 or float16")
        if readers.get(name, 0) > 1:
            return None, f"its {role} experts ({name}) are also read by another node; kept float as one tensor"
    e, n1, h = (int(d) for d in inits[weights["fc1"]].dims)
    inter = n1 // 2 if swiglu and fusion else n1
    g = ExpertGroup(node, weights, e, h, inter, fusion, swiglu)
    for role, name in weights.items():
        if tuple(int(d) for d in inits[name].dims) != g.shape(role):
            return None, (f"its {role} experts ({name}) have shape {list(inits[name].dims)}, expected "
                          f"{list(g.shape(role))} beside fc1's {[e, n1, h]}")
    if swiglu and fusion and n1 % 2:
        return None, f"fused SwiGLU fc1 with an odd row count {n1}"
    if swiglu and fusion != 1:
        # rows are reordered: fc1 / fc3 biases must be constants to be reordered with them
        for role in ("fc1", "fc3"):
            b = input_of(node, BIAS_INPUTS[role])
            if b and b not in inits:
                return None, f"its {role} bias is computed, and the interleaved layout QMoE needs reorders it"
    return g, None


def fit_block(group: ExpertGroup, block_size: int) -> tuple[int | None, str | None]:
    """The block size QMoE can use (it must divide ``hidden`` and ``inter``), and a note when lowered."""
    if group.hidden % block_size == 0 and group.inter % block_size == 0:
        return block_size, None
    fit = next((b for b in (256, 128, 64, 32, 16) if b < block_size and group.hidden % b == 0
                and group.inter % b == 0), None)
    if fit is None:
        return None, None
    return fit, (f"experts of widths {group.hidden} / {group.inter}: block_size {block_size} -> {fit} "
                 "(QMoE's block divides both)")
