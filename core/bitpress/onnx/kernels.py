"""Which ONNX Runtime kernel each quantized node will run on, for the target it is written for.

Speed of the output is a quality of the output: a quantized weight that makes ONNX Runtime
dequantize it on every call runs slower than the float model it came from. Measured on ONNX
Runtime 1.32's CPU kernels (``contrib_ops/cpu/quantization/matmul_nbits.cc``, MLAS
``qnbitgemm``; one 2048 x 2048 weight, block 32, one token, one thread; float ``MatMul``
0.21 ms; figures in docs/speed.md):

============================================  ==========================  ========
MatMulNBits                                    kernel                      ms
============================================  ==========================  ========
4 bits, no / uint8 zero points, level 4        packed, int8 compute        0.05
4 bits, no / uint8 zero points, level 0-3      packed, float32 compute     0.19
8 bits, no / uint8 zero points, level 4        packed, int8 compute        0.06
8 bits, level 0-3                              dequantize every call       4.9
4 bits, float zero points (any level)          dequantize every call       5.2
``g_idx`` (act-order) input                    dequantize every call       5.2
8 bits, float zero points                      refused at session creation
============================================  ==========================  ========

``MatMulBnb4`` (nf4 / fp4) dequantizes the whole weight on every call on CPU: it has no fast
form. ``GatherBlockQuantized`` dequantizes only the rows it gathers. A float-zero-point weight
written in the block-sum correction form (:mod:`bitpress.onnx.correction`) runs on the packed
kernels plus two small MatMuls.

``accuracy_level`` 4 (int8 activations, per block) is what the ONNX Runtime GenAI builder
writes for CPU and WebGPU packages, and 0 for the others; :func:`default_accuracy_level`
follows it. ONNX Runtime issue 29853 reports wrong results from the AVX2 (no AVX-512) ``M = 1``
int8 kernel with zero points; through ``MatMulNBits`` (whose constant weights are prepacked with
their block sums) ONNX Runtime 1.32 computes them correctly on an emulated Haswell (``qemu-x86_64
-cpu Haswell``), within the int8-activation tolerance the AVX-512 kernels have
(``tests/onnx/test_fast_forms.py``, docs/speed.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

import onnx

from bitpress.onnx.correction import find_corrections
from bitpress.options import option

#: what bitpress can write for; ``cpu`` is measured here, the others follow the GenAI builder's choices
TARGETS = ("cpu", "cuda", "dml", "webgpu")
Target = Literal["cpu", "cuda", "dml", "webgpu"]

#: kernel kinds, fastest first; ``fallback`` is the slow path, ``refused`` does not load
KernelKind = Literal["int8", "fp32", "gather", "fallback", "refused", "unmeasured"]

LABELS: dict[str, str] = {
    "int8": "packed, int8 compute",
    "fp32": "packed, float32 compute",
    "gather": "gather (dequantizes the gathered rows)",
    "fallback": "dequantize every call",
    "refused": "refused by ONNX Runtime",
    "unmeasured": "not measured for this target",
}


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")


def default_accuracy_level(target: str) -> int:
    """The ``MatMulNBits`` accuracy_level that runs fastest on ``target`` without breaking accuracy.

    4 (int8 compute) on ``cpu`` and ``webgpu``, as the GenAI builder writes; 0 (unset) elsewhere.
    """
    check_target(target)
    return 4 if target in ("cpu", "webgpu") else 0


def resolve_accuracy_level(accuracy_level: int | None, target: str) -> int:
    """The user's ``accuracy_level`` when given, else the target's default."""
    return default_accuracy_level(target) if accuracy_level is None else int(accuracy_level)


@dataclass
class TargetOptions:
    """The options of every pass that writes ``MatMulNBits``: the target, and the accuracy_level it implies."""

    target: Literal["cpu", "cuda", "dml", "webgpu"] = option(
        "cpu", "where the model will run: picks accuracy_level and the forms that run on its fast kernels"
    )
    accuracy_level: int | None = option(
        None, "MatMulNBits accuracy_level: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 compute; "
        "null: what runs fastest on the target (4 on cpu and webgpu, 0 elsewhere)"
    )

    def validate(self) -> None:
        if self.accuracy_level is not None and self.accuracy_level not in range(5):
            raise ValueError("accuracy_level must be 0..4, or null for the target's default")
        check_target(self.target)

    def resolved_accuracy_level(self) -> int:
        """``accuracy_level`` as written: the user's, or the target's default."""
        return resolve_accuracy_level(self.accuracy_level, self.target)


@dataclass(frozen=True)
class KernelPath:
    """The kernel one quantized weight runs on, and what to do about a slow one."""

    kind: str  # a KernelKind
    corrected: bool = False  # float zero points written as a block-sum correction
    reason: str | None = None  # why it is slow (or not measured)
    fix: str | None = None  # the option that avoids it

    @property
    def label(self) -> str:
        text = LABELS.get(self.kind, self.kind)
        return text + " + block-sum correction" if self.corrected else text

    @property
    def slow(self) -> bool:
        return self.kind in ("fallback", "refused")


def matmul_nbits_path(bits: int, accuracy_level: int, zero_points: str, *, target: str = "cpu",
                      g_idx: bool = False, corrected: bool = False) -> KernelPath:
    """The kernel of a ``MatMulNBits`` of ``bits`` with ``zero_points`` ``none`` / ``uint8`` / ``float``."""
    if target != "cpu":
        return KernelPath("unmeasured", corrected, f"only ONNX Runtime's CPU kernels are measured here ({target})")
    if zero_points == "float" and bits == 8:
        return KernelPath("refused", False, "ONNX Runtime's CPU MatMulNBits refuses 8-bit weights with float "
                          "zero points", "float_zero_point_form=correction")
    if zero_points == "float":
        return KernelPath("fallback", False, "float zero points: ONNX Runtime does not prepack the weight and "
                          "dequantizes all of it on every call",
                          "float_zero_point_form=correction (same values, fast kernels), or float_zero_points=false")
    if g_idx:
        return KernelPath("fallback", corrected, "an act-order g_idx input: ONNX Runtime dequantizes the weight on "
                          "every call", "static groups (gptq desc_act with static_groups) write no g_idx")
    if accuracy_level == 4:
        return KernelPath("int8", corrected)
    if bits == 8:
        return KernelPath("fallback", corrected, f"8-bit MatMulNBits at accuracy_level {accuracy_level}: ONNX "
                          "Runtime has no float32-compute kernel for 8 bits and dequantizes on every call",
                          "accuracy_level=4 (the cpu target's default)")
    if bits == 4:
        return KernelPath("fp32", corrected)
    return KernelPath("unmeasured", corrected, f"{bits}-bit MatMulNBits is not measured here")


def qmoe_path(bits: int, accuracy_level: int, *, target: str = "cpu") -> KernelPath:
    """The kernel of a block-wise integer ``QMoE`` (ONNX Runtime 1.32's CPU kernel: the packed MLAS kernels of
    ``MatMulNBits``; 4-bit experts compute in float32 below ``accuracy_level`` 4, 8-bit ones always in int8)."""
    if target != "cpu":
        return KernelPath("unmeasured", reason=f"only ONNX Runtime's CPU kernels are measured here ({target})")
    if bits == 8 or accuracy_level == 4:
        return KernelPath("int8")
    if bits == 4:
        return KernelPath("fp32")
    return KernelPath("unmeasured", reason=f"{bits}-bit QMoE is not measured here")


def bnb4_path(target: str = "cpu") -> KernelPath:
    """``MatMulBnb4`` (nf4 / fp4): no fast form on CPU."""
    if target != "cpu":
        return KernelPath("unmeasured", reason=f"only ONNX Runtime's CPU kernels are measured here ({target})")
    return KernelPath("fallback", reason="MatMulBnb4 (nf4 / fp4): ONNX Runtime dequantizes the whole weight on "
                      "every call; nf4 and fp4 have no fast form on CPU",
                      fix="an int4 pass (rtn, kquant, hqq, gptq, awq) for speed; nf4 only where its size is the point")


def node_path(node: onnx.NodeProto, dtypes: dict[str, int], *, target: str = "cpu",
              corrected: bool = False) -> KernelPath | None:
    """The kernel of a quantized node (``dtypes``: initializer name -> ONNX data type); None for others."""
    if node.domain != "com.microsoft":
        return None
    if node.op_type == "MatMulNBits":
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        zp_name = node.input[3] if len(node.input) > 3 else ""
        zp = "none" if not zp_name else "uint8" if dtypes.get(zp_name) == onnx.TensorProto.UINT8 else "float"
        g_idx = len(node.input) > 4 and bool(node.input[4])
        return matmul_nbits_path(int(attrs.get("bits", 4)), int(attrs.get("accuracy_level", 0)), zp, target=target,
                                 g_idx=g_idx, corrected=corrected)
    if node.op_type == "MatMulBnb4":
        return bnb4_path(target)
    if node.op_type == "QMoE":
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        quant = attrs.get("quant_type", b"int")
        if (quant.decode() if isinstance(quant, bytes) else str(quant)) != "int":
            return KernelPath("unmeasured", reason="a QMoE of floating-point experts (fp4 / fp8)")
        return qmoe_path(int(attrs.get("expert_weight_bits", 4)), int(attrs.get("accuracy_level", 0)), target=target)
    if node.op_type == "GatherBlockQuantized":
        return KernelPath("gather")
    return None


@dataclass
class RuntimePaths:
    """The kernel of every quantized node of a graph."""

    target: str
    paths: dict[str, KernelPath]  # node name -> path

    def counts(self) -> dict[str, int]:
        return dict(Counter(p.label for p in self.paths.values()))

    def slow(self) -> dict[str, KernelPath]:
        return {n: p for n, p in self.paths.items() if p.slow}

    def summary(self) -> str:
        if not self.paths:
            return "no quantized node"
        return ", ".join(f"{n} {label}" for label, n in sorted(self.counts().items(), key=lambda kv: -kv[1]))

    def warning(self, where: str) -> str | None:
        """One line naming the slow nodes, why, and the option that avoids it; None when none is slow."""
        slow = self.slow()
        if not slow:
            return None
        by_reason: dict[tuple[str | None, str | None], list[str]] = {}
        for name, p in slow.items():
            by_reason.setdefault((p.reason, p.fix), []).append(name)
        parts = []
        for (reason, fix), names in by_reason.items():
            first = names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")
            parts.append(f"{len(names)} node(s) ({first}): {reason}" + (f"; to avoid it: {fix}" if fix else ""))
        return (f"{where}: {len(slow)} quantized node(s) will run on ONNX Runtime's slow path on {self.target} "
                f"(slower than the float model): " + "; ".join(parts))

    def to_json(self) -> dict[str, object]:
        return {"target": self.target, "counts": self.counts(),
                "slow": {n: {"kernel": p.label, "reason": p.reason, "fix": p.fix} for n, p in self.slow().items()}}


def graph_paths(graph: onnx.GraphProto, target: str = "cpu") -> RuntimePaths:
    """:class:`RuntimePaths` of ``graph``'s quantized nodes; reads no weight data."""
    dtypes = {t.name: t.data_type for t in graph.initializer}
    corrected = find_corrections(graph)
    paths = {}
    for i, node in enumerate(graph.node):
        p = node_path(node, dtypes, target=target, corrected=node.name in corrected)
        if p is not None:
            paths[node.name or f"{node.op_type}_{i}"] = p
    return RuntimePaths(target, paths)
