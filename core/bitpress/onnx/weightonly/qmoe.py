"""Solving a MoE node's experts and writing its ``QMoE`` node (the layout: :mod:`bitpress.onnx.weightonly.moe`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from onnx import helper

from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx import layout
from bitpress.onnx.graph import MS_DOMAIN
from bitpress.onnx.tensors import np_dtype
from bitpress.onnx.weightonly.moe import BIAS_INPUTS, CARRIED, QMOE_INPUTS, ExpertGroup, attrs_of, input_of
from bitpress.onnx.weightonly.reading import TensorSource
from bitpress.onnx.weightonly.solving import Solved, SolveTask
from bitpress.onnx.weightonly.writing import Writer, scale_dtype_of
from bitpress.quant.solver import BlockSpec


# -- solving ------------------------------------------------------------------------------------------
def task(model: OnnxModel, group: ExpertGroup, role: str, chunk_elements: int | None = None) -> SolveTask:
    """The solve task of one expert tensor: ``E * N`` rows of ``K``, blocks along K, integer zero points."""
    spec = BlockSpec(group.bits, group.block_size, group.symmetric, False)
    e, n, k = group.shape(role)
    src = TensorSource.of(model, group.weights[role])
    flat = replace(src, shape=(e * n, k), values=None if src.values is None else src.values.reshape(e * n, k))
    return SolveTask(flat, True, spec, None, chunk_elements)


def _interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rows ``a0, b0, a1, b1, ...`` of two ``[E, I, ...]`` arrays: ``[E, 2I, ...]``."""
    return np.stack([a, b], axis=2).reshape(a.shape[0], 2 * a.shape[1], *a.shape[2:])


@dataclass
class Expert3D:
    """One QMoE weight input's arrays, ``[E, N, ...]``."""

    packed: np.ndarray  # uint8 [E, N, K * bits / 8]
    scales: np.ndarray  # [E, N, K / block]
    zero_points: np.ndarray | None  # uint8 [E, N, K / block] (unpacked)

    @classmethod
    def of(cls, solved: Solved, e: int, n: int) -> Expert3D:
        zp = None if solved.zero_points is None else solved.zero_points.reshape(e, n, -1)
        return cls(solved.packed.reshape(e, n, -1), solved.scales.reshape(e, n, -1), zp)

    def interleaved(self, other: Expert3D) -> Expert3D:
        zp = None if self.zero_points is None else _interleave(self.zero_points, other.zero_points)
        return Expert3D(_interleave(self.packed, other.packed), _interleave(self.scales, other.scales), zp)

    def halves(self) -> tuple[Expert3D, Expert3D]:
        i = self.packed.shape[1] // 2
        zp = (None, None) if self.zero_points is None else (self.zero_points[:, :i], self.zero_points[:, i:])
        return (Expert3D(self.packed[:, :i], self.scales[:, :i], zp[0]),
                Expert3D(self.packed[:, i:], self.scales[:, i:], zp[1]))


def qmoe_tensors(group: ExpertGroup, solved: dict[str, Solved]) -> dict[str, Expert3D]:
    """The solved tensors in QMoE's layout: ``fc1`` (gate / up interleaved for SwiGLU) and ``fc2``."""
    out = {role: Expert3D.of(s, *group.shape(role)[:2]) for role, s in solved.items()}
    if group.swiglu and group.fusion == 2:
        gate, up = out["fc1"].halves()
        out["fc1"] = gate.interleaved(up)
    elif group.swiglu and group.fusion == 0:
        out["fc1"] = out["fc1"].interleaved(out.pop("fc3"))
    return out


def dequantized(t: Expert3D, bits: int, block_size: int) -> np.ndarray:
    """float32 ``[E, N, K]`` of a QMoE weight input (what ONNX Runtime computes with)."""
    e, n, _ = t.packed.shape
    q = layout.unpack_along_last(t.packed, bits, t.packed.shape[-1] * 8 // bits).astype(np.float32)
    q = q.reshape(e, n, -1, block_size)
    zp = np.float32(2 ** (bits - 1)) if t.zero_points is None else t.zero_points.astype(np.float32)[..., None]
    return ((q - zp) * t.scales.astype(np.float32)[..., None]).reshape(e, n, -1)


def write(writer: Writer, group: ExpertGroup, solved: dict[str, Solved], accuracy_level: int) -> None:
    """Replace ``group``'s MoE node by a QMoE node reading the solved tensors (through ``writer``, a
    :class:`~bitpress.onnx.weightonly.writing.Writer`: its initializers and node swaps)."""
    node = group.node
    inits = writer.model.initializers()
    scale_dtype = scale_dtype_of(np_dtype(inits[group.weights["fc1"]]))
    tensors = qmoe_tensors(group, solved)
    base = group.name.replace("/", "_").strip("_") or "moe"
    names: dict[str, str] = {}
    for role, t in tensors.items():
        w_name, s_name = f"{base}_{role}_Q{group.bits}", f"{base}_{role}_scales"
        writer.add(w_name, np.ascontiguousarray(t.packed))
        writer.add(s_name, np.ascontiguousarray(t.scales.astype(scale_dtype)))
        names[f"{role}_w"], names[f"{role}_scales"] = w_name, s_name
        if t.zero_points is not None:
            z_name = f"{base}_{role}_zero_points"
            writer.add(z_name, layout.pack_along_last(t.zero_points, group.bits))
            names[f"{role}_zp"] = z_name
    for role in ("fc1", "fc2", "fc3"):
        b = input_of(node, BIAS_INPUTS[role])
        if not b:
            continue
        if group.swiglu and group.fusion != 1 and role in ("fc1", "fc3"):
            # the rows were interleaved: the biases follow them (constants, checked by the planner)
            if role == "fc3":
                continue
            b1 = writer.model.array(b)
            if group.fusion == 2:
                i = b1.shape[1] // 2
                fused = _interleave(b1[:, :i], b1[:, i:])
            else:
                fc3_b = input_of(node, BIAS_INPUTS["fc3"])
                b3 = writer.model.array(fc3_b) if fc3_b else np.zeros_like(b1)
                fused = _interleave(b1, b3)
            name = f"{base}_fc1_bias_interleaved"
            writer.add(name, np.ascontiguousarray(fused), count=False)
            names["fc1_bias"] = name
        else:
            names[f"{role}_bias"] = b
    if group.swiglu and group.fusion == 0 and "fc1_bias" not in names and input_of(node, BIAS_INPUTS["fc3"]):
        b3 = writer.model.array(input_of(node, BIAS_INPUTS["fc3"]))
        name = f"{base}_fc1_bias_interleaved"
        writer.add(name, np.ascontiguousarray(_interleave(np.zeros_like(b3), b3)), count=False)
        names["fc1_bias"] = name
    names["input"], names["router_probs"] = node.input[0], node.input[1]
    inputs = [names.get(k, "") for k in QMOE_INPUTS]
    while inputs and not inputs[-1]:
        inputs.pop()
    attrs = {k: v for k, v in attrs_of(node).items() if k in CARRIED}
    if group.swiglu:
        attrs["swiglu_fusion"] = 1
    attrs.update(expert_weight_bits=group.bits, block_size=group.block_size)
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    new = helper.make_node("QMoE", inputs, list(node.output), name=f"{group.name}_Q{group.bits}", domain=MS_DOMAIN,
                           **attrs)
    writer.replace[id(node)] = [new]
