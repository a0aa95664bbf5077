"""The k-quant passes: ``kquant`` (int4/int8) and ``q4_k_m`` (llama.cpp's mixture)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from bitpress.plugin import BlockSolver, NameMatcher, Plan, WeightOnlyOptions, WeightOnlyPass, option, plan
from bitpress_kquant.recipe import HIGH_BITS, is_head, q4_k_m_overrides
from bitpress_kquant.solver import kquant_solver


@dataclass
class KQuantOptions(WeightOnlyOptions):
    block_size: int = option(32, "weights per block along K: a power of two from 16 to 256")
    is_symmetric: bool = option(False, "symmetric search (no min); default: scale and min per block")
    float_zero_points: bool = option(
        True, "store the block minimum as a float zero point (4-bit MatMulNBits); false: uint8 zero points"
    )
    nstep: int = option(20, "candidate scales tried per block (llama.cpp make_qkx2_quants)")
    rmin: float = option(-1.0, "first candidate offset of the scale sweep")
    rdelta: float = option(0.1, "step between candidate offsets")


class KQuantPass(WeightOnlyPass):
    """llama.cpp's k-quant search (weighted least squares over candidate scales) per block."""

    name = "kquant"
    algorithms = ("kquant",)
    precisions = ("int4", "int8")
    summary = "llama.cpp k-quant search per block, float zero points, to MatMulNBits / GatherBlockQuantized"
    Options: ClassVar[type] = KQuantOptions
    aliases: ClassVar[tuple[str, ...]] = ("OnnxKQuantQuantization",)
    uses_importance = True  # llama.cpp's imatrix: activation statistics when --data is given

    def solver(self) -> BlockSolver:
        o = self.options
        return functools.partial(kquant_solver, nstep=o.nstep, rmin=o.rmin, rdelta=o.rdelta)


@dataclass
class Q4KMOptions(KQuantOptions):
    high_bits_layers: int | None = option(
        None, "number of decoder layers for llama.cpp's use_more_bits rule (default: inferred from names)"
    )

    def validate(self) -> None:
        super().validate()
        if self.bpw is not None:
            raise ValueError("q4_k_m is llama.cpp's fixed recipe and takes no bpw budget; use kquant with bpw")


class Q4KMPass(KQuantPass):
    """Q4_K_M: int4 k-quant, with int8 for the tensors llama.cpp's recipe protects.

    The output head and the attention-value / FFN-down projections of the layers picked by
    ``use_more_bits`` get 8 bits. The user's own ``overrides`` come first and win.
    """

    name = "q4_k_m"
    algorithms = ("q4_k_m",)
    precisions = ("int4",)
    summary = "llama.cpp's Q4_K_M mixture: k-quant int4, int8 for the head, attn-v and ffn-down of chosen layers"
    Options: ClassVar[type] = Q4KMOptions
    aliases: ClassVar[tuple[str, ...]] = ()

    def weight_plan(self, model: Any, data: Any = None) -> Plan:
        """The plan with the recipe's widths: the real run and ``--plan`` both use it.

        llama.cpp gives the output head Q6_K (Q8_0 when its rows are not a multiple of 256
        wide) and, when the embedding is tied (no head tensor), the token embedding the head's
        type: here both become 8 bits, so a model whose tied table dominates costs close to
        8 bits per weight, as llama.cpp's own Q4_K_M of it costs 6.5-8.5.
        """
        opts = self.options
        groups = plan(model, opts).groups
        names = sorted({n for g in groups for n in [g.weight, *(u.node.name for u in g.uses)] if n})
        high = q4_k_m_overrides(names, opts.high_bits_layers)
        overrides = dict(opts.overrides)
        widened = {}
        for g in groups:
            # a tied / shared weight is one tensor: widen the whole group by its weight name
            hits = [n for n in [g.weight, *(u.node.name for u in g.uses)] if n in high]
            if hits and g.weight not in overrides:
                overrides[g.weight] = {"bits": HIGH_BITS}
                widened[g.weight] = _why(hits[0], g)
        p = plan(model, replace(opts, overrides=overrides))
        user = NameMatcher(list(opts.overrides), what="overrides key")  # the user's patterns come first and win
        for g in p.groups:
            if g.weight in widened and not any(user.matches(u.node.name, g.weight) for u in g.uses):
                p.notes.setdefault(g.weight, widened[g.weight])
        return p


def _why(name: str, group: Any) -> str:
    tied = any(u.is_gather for u in group.uses) and any(not u.is_gather for u in group.uses)
    if tied:
        return (f"q4_k_m: {HIGH_BITS} bits: a tied embedding is llama.cpp's output tensor "
                "(Q6_K there, Q8_0 when its rows are not a multiple of 256)")
    if is_head(name):
        return f"q4_k_m: {HIGH_BITS} bits for the output head (llama.cpp: Q6_K)"
    return f"q4_k_m: {HIGH_BITS} bits for attn_v / ffn_down of a layer use_more_bits picks (llama.cpp: Q6_K)"
