"""Which parameters of a Hugging Face model to quantize, and how: options and resolution order.

Torch-free, so pass options (and their regular expressions) are checked when a workflow is
built, before any model is loaded.

Every quantizable target (a module's weight, or one fused-experts parameter) has a category:
``linear`` (always considered), ``lm_head``, ``embeds`` or ``moe`` (each opted in by its flag).
The first rule that matches a target decides, in this order:

1. ``modules_to_not_convert``: plain entries match as substrings of the module or parameter name
   (Hugging Face's semantics), ``re:`` entries with ``re.fullmatch``: never quantized;
2. the category flags: a target whose category is off is never quantized, whatever the overrides
   say (overrides cannot re-include it);
3. ``overrides``, in insertion order, first match wins (not the most specific one): plain keys
   match the module or parameter name exactly, ``re:`` keys with ``re.fullmatch``;
4. the pass defaults (``bits``, ``group_size``, ``sym``).

``re:`` patterns go through :func:`bitpress.selection.compile_regex` when the options are parsed:
RE2, matching in linear time whatever the pattern; what RE2 cannot express (backreferences,
lookaround) and over-long patterns are refused there.

Mixture of experts is fail-closed, per block (:mod:`bitpress.hf.quantize` finds the blocks):
anything that looks like an expert is category ``moe``, so ``moe: false`` excludes every expert
of every block, whatever each block calls its experts. "Looks like": a module whose own name
contains ``expert``, ``moe`` or ``block_sparse`` (:func:`looks_like_experts`; everything under it
counts), or a list of identical MLPs beside a router (a ``gate`` / ``router`` module whose weight
has one row per list item) or with as many items as the config has experts. A router whose
experts cannot be found beside it stops the run, even with ``moe: false``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from bitpress.options import option
from bitpress.quant.solver import check_block_size
from bitpress.selection import compile_regex

BITS = (2, 4, 8)
CATEGORIES = ("linear", "lm_head", "embeds", "moe")
#: a module whose own name matches (searched, case-insensitive) roots an experts subtree
EXPERT_NAME = re.compile(r"expert|moe|block_sparse", re.IGNORECASE)
#: own names of MoE routers (with a weight of one row per expert); "router" anywhere in the name too
ROUTER_NAMES = frozenset({"gate", "router", "gating", "wg", "switch"})
_OVERRIDE_KEYS = {"bits", "group_size", "symmetric", "sym"}


def looks_like_experts(module_name: str) -> bool:
    """Whether a module's own name (the last dotted part) marks an experts subtree."""
    return bool(EXPERT_NAME.search(module_name.rsplit(".", 1)[-1]))


def looks_like_router(module_name: str) -> bool:
    """Whether a module's own name is a MoE router's (``gate``, ``router``, ``*router*``, ...)."""
    own = module_name.rsplit(".", 1)[-1].lower()
    return own in ROUTER_NAMES or "router" in own


@dataclass(frozen=True)
class Settings:
    bits: int
    group_size: int
    symmetric: bool


@dataclass(frozen=True)
class Decision:
    """What the rules say about one target: ``settings`` None means it stays float (``reason``)."""

    settings: Settings | None
    reason: str


def check_bits_group(bits: int, group_size: int, where: str = "") -> None:
    if bits not in BITS:
        raise ValueError(f"{where}bits must be one of {', '.join(map(str, BITS))}, got {bits}")
    # MatMulNBits / GatherBlockQuantized take powers of two from 16; the host's ONNX writer stops at 256
    check_block_size(group_size, f"{where}group_size")


class _Pattern:
    """One user pattern: ``re:`` (full match) or plain (substring or exact, per rule)."""

    def __init__(self, raw: str, *, substring: bool, what: str) -> None:
        if not isinstance(raw, str) or not raw:
            raise ValueError(f"{what} entries must be non-empty strings, got {raw!r}")
        self.raw = raw
        self.regex: re.Pattern[str] | None = compile_regex(raw[3:], what=what) if raw.startswith("re:") else None
        self.substring = substring

    def matches(self, names: tuple[str, ...]) -> bool:
        for name in names:
            if self.regex is not None:
                if self.regex.fullmatch(name):
                    return True
            elif (self.raw in name) if self.substring else (self.raw == name):
                return True
        return False


def parse_override(key: str, value: Any, defaults: Settings) -> Settings:
    """The settings an ``overrides`` entry gives (unset keys fall back to the pass defaults)."""
    where = f"overrides[{key!r}]: "
    if not isinstance(value, dict):
        raise ValueError(f"{where}must map to a mapping of bits / group_size / symmetric, got {value!r}")
    unknown = sorted(set(value) - _OVERRIDE_KEYS)
    if unknown:
        raise ValueError(f"{where}unknown key(s) {', '.join(unknown)}; valid: bits, group_size, symmetric (or sym)")
    if "sym" in value and "symmetric" in value and bool(value["sym"]) != bool(value["symmetric"]):
        raise ValueError(f"{where}sym and symmetric disagree")
    # JSON values (a config file, or --option's JSON): integers as they are, never parsed from strings
    bits, group = value.get("bits", defaults.bits), value.get("group_size", defaults.group_size)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (bits, group)):
        from bitpress.selection import short

        raise ValueError(f"{where}bits and group_size must be integers, got {short(value)}")
    sym = value.get("symmetric", value.get("sym", defaults.symmetric))
    if not isinstance(sym, bool):
        raise ValueError(f"{where}symmetric must be true or false, got {sym!r}")
    check_bits_group(bits, group, where)
    return Settings(bits, group, sym)


class Rules:
    """The compiled rules of one pass: resolves a target's names and category to a decision."""

    def __init__(self, defaults: Settings, flags: dict[str, bool], modules_to_not_convert: list[str],
                 overrides: dict[str, dict[str, Any]]) -> None:
        check_bits_group(defaults.bits, defaults.group_size)
        self.defaults = defaults
        self.flags = {"linear": True, **flags}
        self.not_convert = [_Pattern(p, substring=True, what="modules_to_not_convert entry")
                            for p in modules_to_not_convert]
        # dicts keep insertion order: the user's order is the precedence
        self.overrides = [
            (_Pattern(k, substring=False, what="overrides key"), parse_override(k, v, defaults))
            for k, v in overrides.items()
        ]

    def resolve(self, names: tuple[str, ...], category: str) -> Decision:
        if category not in self.flags:
            raise ValueError(f"unknown category {category!r}")
        for p in self.not_convert:
            if p.matches(names):
                return Decision(None, f"modules_to_not_convert ({p.raw!r})")
        if not self.flags[category]:
            return Decision(None, f"category {category} is off (set {category}=true to quantize it)")
        for p, settings in self.overrides:
            if p.matches(names):
                return Decision(settings, f"overrides[{p.raw!r}]")
        return Decision(self.defaults, "pass defaults")


@dataclass
class HfQuantOptions:
    """Options shared by the PyTorch (Hugging Face) weight quantizers."""

    bits: int = option(4, "2, 4 or 8 bits per weight (2-bit checkpoints cannot be exported to ONNX)")
    group_size: int = option(128, "weights per block along the input dimension: a power of two from 16 to 256")
    sym: bool = option(True, "symmetric (no zero points); false: a zero point per block")
    lm_head: bool = option(False, "also quantize the language-model head")
    embeds: bool = option(False, "also quantize the input embeddings (nn.Embedding tables)")
    moe: bool = option(False, "also quantize MoE experts (per-expert lists, or fused (E, OUT, K) weights)")
    modules_to_not_convert: list[str] = option(
        [], "never quantize these modules: substrings of module/parameter names, or re:REGEX (full match)"
    )
    overrides: dict[str, dict[str, Any]] = option(
        {}, 'per-module {"bits", "group_size", "symmetric"}; keys: exact names or re:REGEX; first match wins'
    )
    trust_remote_code: bool = option(False, "allow the model folder's own Python code (auto_map) to run when loading")
    allow_pickle: bool = option(
        False, "allow loading .bin/.pt pickled weights (runs arbitrary code from the file: trusted sources only)"
    )
    stream: bool = option(
        True, "read and write the checkpoint tensor by tensor; false: load the whole model (the output is the "
        "same; passes that calibrate always load it)"
    )

    def defaults(self) -> Settings:
        return Settings(self.bits, self.group_size, self.sym)

    def rules(self) -> Rules:
        flags = {"lm_head": self.lm_head, "embeds": self.embeds, "moe": self.moe}
        return Rules(self.defaults(), flags, list(self.modules_to_not_convert), dict(self.overrides))

    def validate(self) -> None:
        check_bits_group(self.bits, self.group_size)
        self.rules()  # compiles every pattern (ReDoS checks) and checks every override
