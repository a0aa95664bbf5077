"""Quantize a PyTorch (Hugging Face) model's weights in place with a block solver.

:func:`plan` decides everything (targets, categories, settings, ties, MoE layouts) and raises
before any parameter is touched; :func:`apply` then solves each parameter with the same
:class:`~bitpress.quant.solver.BlockSolver` the ONNX passes use and swaps its storage for a
:class:`~bitpress.hf.qtensor.QuantTensor`. Modules are not replaced.

Targets: ``nn.Linear`` weights (category ``linear``, or ``lm_head`` for the output embeddings),
``nn.Embedding`` tables (``embeds``), and under an experts subtree (:func:`find_experts`: a module
named like ``experts`` / ``moe`` / ``block_sparse``, or a list of identical MLPs beside a router)
either ``nn.Linear`` weights of per-expert lists or the 3-D parameters of a fused experts module
(``moe``). Routers stay float. A MoE block whose router has no experts found beside it stops
the run before anything is touched, whatever ``moe`` says (fail-closed, per block). Weights are
quantized along their input axis in blocks of ``group_size``: the last axis for ``[OUT, K]`` linears,
``[vocab, hidden]`` tables and fused ``(E, OUT, K)`` experts; the middle axis for the fused experts
of the known transposed layouts (:data:`TRANSPOSED_EXPERTS`, gpt-oss's ``(E, K, OUT)``), whose
integers are those of each expert's ``[OUT, K]`` transpose (``QuantSpec.transposed``). Any other
transposed or unreported layout is refused.

Tied parameters (one ``nn.Parameter`` reached from several modules, e.g. the input embedding
and the LM head) are resolved per module: all quantized with one layout (one quantized tensor
shared by every module), or some left float (the tie is split, the float side keeps the
original parameter), and conflicting settings are refused before any work.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from bitpress.errors import QuantizationError, summarize_names, summarize_problems
from bitpress.hf.qtensor import QuantSpec, QuantTensor
from bitpress.hf.rules import Decision, Rules, Settings, looks_like_experts, looks_like_router
from bitpress.interrupts import cancel_pending
from bitpress.onnx.weightonly import Report
from bitpress.quant.solver import BlockSolver, BlockSpec, QuantizedBlocks

log = logging.getLogger(__name__)

#: float32 elements handed to a solver at once (bounds the scratch memory per parameter)
CHUNK_ELEMENTS = 1 << 20
#: embedding tables with fewer rows stay float, as in the ONNX passes (gather_min_rows): token-type
#: tables save nothing and their error reaches every token
MIN_TABLE_ROWS = 64
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
#: fused experts stored transposed, ``(E, K, OUT)`` multiplied as ``x @ w[e]``, whose layout is known:
#: class -> parameter -> (K, OUT) as (attribute of the module, multiple); every shape is checked against the
#: module's own sizes before anything is quantized. gpt-oss (transformers 5.17 ``GptOssExperts``,
#: ``is_transposed=True``, ``is_concatenated=False``): ``gate_up_proj`` ``[E, hidden, 2 * inter]`` (gate / up
#: interleaved on the last axis), ``down_proj`` ``[E, inter, hidden]``
TRANSPOSED_EXPERTS: dict[str, dict[str, tuple[tuple[str, int], tuple[str, int]]]] = {
    "GptOssExperts": {"gate_up_proj": (("hidden_size", 1), ("intermediate_size", 2)),
                      "down_proj": (("intermediate_size", 1), ("hidden_size", 1))},
}


@dataclass
class Endpoint:
    """One module attribute holding a quantizable parameter."""

    module_name: str
    attr: str
    module: nn.Module
    category: str  # linear | lm_head | embeds | moe
    kind: str  # linear | embedding | experts
    decision: Decision | None = None

    @property
    def param_name(self) -> str:
        return f"{self.module_name}.{self.attr}" if self.module_name else self.attr

    @property
    def names(self) -> tuple[str, ...]:
        return (self.module_name, self.param_name)


@dataclass
class Job:
    """One parameter to quantize, and which of its endpoints read the quantized form."""

    param: nn.Parameter
    quantized: list[Endpoint]
    kept_float: list[Endpoint]
    settings: Settings
    zero_points: str  # none | uint8 | float
    transposed: bool = False  # fused (E, K, OUT) experts: quantize each expert's [OUT, K] transpose

    @property
    def name(self) -> str:
        return self.quantized[0].param_name


@dataclass
class Plan:
    jobs: list[Job]
    skipped: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    #: weights whose width the asked group size does not divide: name -> (asked, used; 0 = padded)
    regrouped: dict[str, tuple[int, int]] = field(default_factory=dict)

    def log_notes(self) -> None:
        """What the plan decided, in the log: group sizes changed as a warning (the user asked for another)."""
        for what, why in self.skipped.items():
            log.info("not quantized: %s: %s", what, why)
        for what, why in self.notes.items():
            log.info("%s: %s", what, why)
        by: dict[tuple[int, int], list[str]] = {}
        for name, change in self.regrouped.items():
            by.setdefault(change, []).append(name)
        for (asked, used), names in sorted(by.items()):
            what = f"group_size {asked} does not divide the width of {summarize_names(names)}"
            log.warning("%s: %s", what, f"lowered to {used} for them" if used else
                        "their blocks are padded (hf_to_onnx exports them; hf_to_genai refuses padding)")


# -- discovery ----------------------------------------------------------------------------------------
def expert_counts(config: Any) -> set[int]:
    """The expert counts (> 1) a transformers config gives (``num_local_experts``, ``num_experts``, ...)."""
    out: set[int] = set()
    for cfg in _configs(config):
        for key in _MOE_KEYS:
            value = getattr(cfg, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                out.add(value)
    return out


def config_is_moe(config: Any) -> bool:
    """Whether a transformers config describes a mixture-of-experts model."""
    return bool(expert_counts(config))


def _hidden_size(config: Any) -> int | None:
    for cfg in _configs(config):
        value = getattr(cfg, "hidden_size", None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _weight_rows(mod: nn.Module) -> int | None:
    """Rows of a module's own 2-D ``weight`` (a router has one per expert), else None."""
    w = mod._parameters.get("weight")
    return int(w.shape[0]) if w is not None and w.dim() == 2 else None


def _is_mlp(mod: nn.Module) -> bool:
    """Holds parameters, all of them ``nn.Linear``'s (an MLP, or a Linear itself)."""
    linear = {id(p) for m in mod.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    params = list(mod.parameters())
    return bool(params) and all(id(p) in linear for p in params)


def _identical_mlps(container: nn.Module) -> int:
    """How many items a ModuleList / ModuleDict of at least two identical MLPs has, else 0."""
    items = list(container.children())
    if len(items) < 2 or not all(_is_mlp(m) for m in items):
        return 0

    def signature(m: nn.Module) -> tuple[Any, ...]:
        return type(m), tuple((n, tuple(p.shape)) for n, p in m.named_parameters())

    first = signature(items[0])
    return len(items) if all(signature(m) == first for m in items[1:]) else 0


@dataclass
class Experts:
    """Where a model keeps its experts: the roots of its experts subtrees (and why each counts),
    its routers (router module -> its MoE block) and the blocks whose experts were not found."""

    roots: dict[str, str]
    routers: dict[str, str]
    unresolved: dict[str, str]

    def root_of(self, name: str) -> str | None:
        return next((r for r in self.roots if name == r or name.startswith(r + ".")), None)


def find_experts(model: nn.Module) -> Experts:
    """Every experts subtree of ``model``, fail-closed: anything that looks like an expert counts.

    A root is a module whose own name contains ``expert``, ``moe`` or ``block_sparse``, or a
    ModuleList / ModuleDict of identical MLPs beside a router (a module whose 2-D weight has one row
    per item) or with as many items as the config has experts. A router (named ``gate`` /
    ``router`` / ..., weight ``(E, hidden)`` with E the config's expert count, or the one beside a
    list) must have an experts root beside it: a block whose router has none is ``unresolved``.
    """
    config = getattr(model, "config", None)
    counts = expert_counts(config)
    hidden = _hidden_size(config)
    mods = dict(model.named_modules())
    found: dict[str, str] = {}
    routers: dict[str, str] = {}
    for name in mods:
        if name and looks_like_experts(name):
            found[name] = f"named {name.rsplit('.', 1)[-1]!r}"
    for name, mod in mods.items():
        kids = dict(mod.named_children())
        for key, child in kids.items():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and (n := _identical_mlps(child)):
                beside = [k for k, c in kids.items() if k != key and _weight_rows(c) == n]
                if beside:
                    found.setdefault(_join(name, key), f"{n} identical MLPs beside the router {_join(name, beside[0])}")
                    routers.update((_join(name, k), name) for k in beside)
                elif n in counts:
                    found.setdefault(_join(name, key), f"{n} identical MLPs, one per expert of the config")
            rows = _weight_rows(child)
            if counts and rows in counts and looks_like_router(key) and (
                    hidden is None or child._parameters["weight"].shape[1] == hidden):
                routers.setdefault(_join(name, key), name)
    roots = {n: why for n, why in found.items() if not any(n.startswith(o + ".") for o in found)}
    # a "router" inside one expert (an expert MLP's own gate) is no router
    routers = {r: block for r, block in routers.items() if not any(block.startswith(o + ".") for o in roots)}
    unresolved = {}
    for router, block in routers.items():
        if not any(r == block or r.startswith(block + ".") or block.startswith(r + ".") for r in roots):
            kids = ", ".join(k for k, _ in mods[block].named_children()) if block in mods else ""
            unresolved[block] = f"router {router}, modules: {kids}"
    return Experts(roots, routers, unresolved)


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The roots of the experts subtrees (:func:`find_experts`)."""
    mods = dict(model.named_modules())
    return {name: mods[name] for name in find_experts(model).roots}


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):
        return None


def endpoints(model: nn.Module, experts: Experts | None = None) -> list[Endpoint]:
    """Every quantizable module attribute, in module order (a tied parameter appears once per module).

    Under an experts root: ``nn.Linear`` weights and the 3-D parameters of fused experts modules
    (category ``moe``). Routers that are ``nn.Linear`` are listed with category ``router`` (kept float).
    """
    experts = experts if experts is not None else find_experts(model)
    head = _output_embeddings(model)
    found: list[Endpoint] = []
    for name, mod in model.named_modules(remove_duplicate=False):
        root = experts.root_of(name)
        if name in experts.routers and isinstance(mod, nn.Linear):
            found.append(Endpoint(name, "weight", mod, "router", "linear"))
        elif root is not None:
            if not isinstance(mod, (nn.ModuleList, nn.ModuleDict, nn.Linear)):
                for attr, p in mod.named_parameters(recurse=False):
                    if p.dim() == 3:  # fused (E, ., .) weights; 2-D biases stay float
                        found.append(Endpoint(name, attr, mod, "moe", "experts"))
            if isinstance(mod, nn.Linear):
                found.append(Endpoint(name, "weight", mod, "moe", "linear"))
        elif isinstance(mod, nn.Embedding):
            found.append(Endpoint(name, "weight", mod, "embeds", "embedding"))
        elif isinstance(mod, nn.Linear):
            is_head = mod is head or (head is None and name.rsplit(".", 1)[-1] in ("lm_head", "output"))
            found.append(Endpoint(name, "weight", mod, "lm_head" if is_head else "linear", "linear"))
    return found


# -- planning -----------------------------------------------------------------------------------------
def _describe(s: Settings) -> str:
    return f"{s.bits} bits, group_size {s.group_size}, {'symmetric' if s.symmetric else 'asymmetric'}"


def transposed_layout_problem(module: nn.Module, attr: str) -> str | None:
    """Why ``module.attr`` is not a fused experts tensor of a known transposed layout
    (:data:`TRANSPOSED_EXPERTS`), or None when it is one."""
    cls = type(module).__name__
    known = TRANSPOSED_EXPERTS.get(cls)
    if known is None:
        return (f"{cls} stores fused experts transposed as (E, K, OUT) (is_transposed=True); bitpress quantizes "
                f"that layout only for {', '.join(TRANSPOSED_EXPERTS)} (gpt-oss), whose shapes it checks")
    if attr not in known:
        return f"{cls}.{attr} is not one of its known transposed expert tensors ({', '.join(known)})"
    if getattr(module, "is_concatenated", None) is not False:
        return f"{cls} does not report gate / up interleaved (is_concatenated=False), the layout bitpress knows"
    (k_attr, k_mul), (n_attr, n_mul) = known[attr]
    sizes = [getattr(module, a, None) for a in ("num_experts", k_attr, n_attr)]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
        return f"{cls} does not give num_experts / {k_attr} / {n_attr}, so the shape of {attr} cannot be checked"
    e, k, n = sizes
    want = (e, k * k_mul, n * n_mul)  # type: ignore[operator]
    got = tuple(getattr(module, attr).shape)
    if got != want:
        return (f"{cls}.{attr} is {list(got)}, not the (E, K, OUT) {list(want)} its num_experts / {k_attr} / "
                f"{n_attr} give")
    return None


def _experts_layout(ep: Endpoint) -> tuple[bool, str | None]:
    """Whether a fused experts parameter is stored transposed, and why it cannot be quantized (None: it can)."""
    flag = getattr(ep.module, "is_transposed", None)
    cls = type(ep.module).__name__
    if flag is False:
        return False, None
    if flag is True:
        return True, transposed_layout_problem(ep.module, ep.attr)
    return False, (f"{cls} does not report is_transposed, so the layout of its fused expert weights "
                   "cannot be verified; refusing rather than quantizing along the wrong dimension")


def check_experts(model: nn.Module, experts: Experts) -> None:
    """Fail closed on MoE models whose experts are not all found (raised even with ``moe: false``)."""
    config = getattr(model, "config", None)
    if config is not None and config_is_moe(config) and not experts.roots:
        raise QuantizationError(
            f"{type(model).__name__} is a mixture-of-experts model but its experts subtree (a module named like "
            "'experts', 'moe' or 'block_sparse', or a list of identical MLPs beside a router) was not found; "
            "refusing to quantize rather than treating experts as plain linears"
        )
    if experts.unresolved:
        blocks = list(experts.unresolved)
        first = blocks[0]
        what = f"{len(blocks)} MoE blocks ({summarize_names(blocks)}) have" if len(blocks) > 1 else f"{first} has"
        raise QuantizationError(
            f"{what} a router but no experts found beside it ({first}: {experts.unresolved[first]}); an expert "
            "container must be named like 'experts', 'moe' or 'block_sparse', or be a list of identical MLPs. "
            "Refusing to quantize (even with moe=false) rather than treating experts as plain linears"
        )


def plan(model: nn.Module, rules: Rules, *, float_zero_points: bool = False) -> Plan:
    """Decide what to quantize; raises :class:`QuantizationError` (before any work) on any problem."""
    experts = find_experts(model)
    check_experts(model, experts)
    eps = endpoints(model, experts)
    groups: dict[int, list[Endpoint]] = {}
    for ep in eps:
        groups.setdefault(id(getattr(ep.module, ep.attr)), []).append(ep)

    out = Plan([])
    errors: list[str] = []
    layout_errors: list[tuple[str, str]] = []  # one sentence per reason, not per tensor
    for group in groups.values():
        param = getattr(group[0].module, group[0].attr)
        name = group[0].param_name
        if isinstance(param, QuantTensor):
            out.skipped[name] = "already quantized (left as it is)"
            continue
        if not param.dtype.is_floating_point:
            out.skipped[name] = f"not a float parameter ({param.dtype})"
            continue
        for ep in group:
            ep.decision = (Decision(None, "MoE router (routers stay float)") if ep.category == "router"
                           else rules.resolve(ep.names, ep.category))
        quantized = [ep for ep in group if ep.decision and ep.decision.settings is not None]
        kept = [ep for ep in group if ep not in quantized]
        if not quantized:
            out.skipped[name] = group[0].decision.reason if group[0].decision else "not selected"
            continue
        settings = {ep.decision.settings for ep in quantized}  # type: ignore[union-attr]
        if len(settings) > 1:
            ends = "; ".join(f"{ep.module_name} ({_describe(ep.decision.settings)}, from {ep.decision.reason})"  # type: ignore[union-attr,arg-type]
                             for ep in quantized)
            errors.append(
                f"tied weight {name} is shared by modules that ask for different layouts: {ends}. A tied table is "
                "quantized once, with one layout, for every module that uses it: give them the same settings, or "
                "exclude one side (it then keeps a float copy)"
            )
            continue
        s = settings.pop()
        kinds = {ep.kind for ep in quantized}
        if kinds == {"embedding"} and param.shape[0] < MIN_TABLE_ROWS:
            out.skipped[name] = f"embedding table with {param.shape[0]} rows (< {MIN_TABLE_ROWS}): kept in float"
            continue
        transposed = set()
        for ep in quantized:
            if ep.kind == "experts":
                flag, problem = _experts_layout(ep)
                transposed.add(flag)
                if problem:
                    layout_errors.append((ep.param_name, problem))
        if len(transposed) > 1:
            errors.append(f"{name} is reached as a transposed and as a plain fused experts tensor: its layout is "
                          "ambiguous; refusing rather than quantizing along the wrong dimension")
            continue
        k = int(param.shape[-1])
        if k % s.group_size:
            # blocks that tile the rows exactly: one table read by a Gather and a MatMul shares its bytes only then,
            # and a GenAI package's checkpoint format has no padding (hf_to_genai would refuse it at export)
            fit = next((g for g in (256, 128, 64, 32, 16) if g < s.group_size and k % g == 0), None)
            tied = "embedding" in kinds and "linear" in kinds
            if fit is None and tied:
                errors.append(f"tied table {name} of width {k} has no group size from 16 up that divides it")
                continue
            out.regrouped[name] = (s.group_size, fit or 0)
            if fit is not None:
                if tied:
                    out.notes[name] = (f"tied table of width {k}: group_size {s.group_size} -> {fit} so both ends "
                                       "share it")
                s = Settings(s.bits, fit, s.symmetric)
        if s.symmetric:
            zp = "none"
        elif float_zero_points and s.bits == 4 and "embedding" not in kinds:
            zp = "float"  # MatMulNBits takes float offsets at 4 bits; GatherBlockQuantized never does
        else:
            zp = "uint8"
        if kept:
            why = kept[0].decision.reason if kept[0].decision else ""
            split = (f"tie split: quantized for {', '.join(ep.module_name for ep in quantized)}, "
                     f"float for {', '.join(ep.module_name for ep in kept)} ({why})")
            out.notes[name] = f"{out.notes[name]}; {split}" if name in out.notes else split
        out.jobs.append(Job(param, quantized, kept, s, zp, transposed=transposed == {True}))
    if layout_errors:
        errors.append(summarize_problems(layout_errors, noun="fused expert tensors"))
    if errors:
        raise QuantizationError("; ".join(errors))
    return out


# -- solving ------------------------------------------------------------------------------------------
@dataclass
class _Solved:
    job: Job
    tensor: QuantTensor
    error: float


def solve_rows(read: Callable[[int, int], np.ndarray], rows: int, k: int, s: Settings, zero_points: str,
               name: str, solver: BlockSolver) -> tuple[QuantizedBlocks, float]:
    """Quantize a weight of ``rows`` rows of ``k`` values, read ``read(r0, r1)`` rows at a time (float32).

    The one solve of both paths: the in-memory one reads rows of the parameter, the streaming one
    (:mod:`bitpress.hf.streaming`) reads them from the checkpoint file. Rows are handed to the
    solver in chunks of about :data:`CHUNK_ELEMENTS` values; returns the unpacked blocks
    (``q`` ``[rows, n_blocks, group_size]``) and the relative weight error.
    """
    bs = s.group_size
    n_blocks = -(-k // bs)
    spec = BlockSpec(s.bits, bs, s.symmetric, zero_points == "float")
    q = np.empty((rows, n_blocks, bs), np.uint8)
    scales = np.empty((rows, n_blocks), np.float32)
    zps = None if s.symmetric else np.empty((rows, n_blocks), np.float32 if zero_points == "float" else np.uint8)
    num = den = 0.0
    step = max(1, CHUNK_ELEMENTS // (n_blocks * bs))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = read(r0, r1)
        chunk = np.zeros((r1 - r0, n_blocks * bs), np.float32)
        chunk[:, :k] = w
        if not np.isfinite(chunk).all():
            raise QuantizationError(f"{name} holds NaN or infinite values; cannot quantize it")
        w3 = chunk.reshape(r1 - r0, n_blocks, bs)
        res = solver(w3, spec, None)
        if res.q.shape != w3.shape or res.q.dtype != np.uint8 or (res.q.size and int(res.q.max()) >= 2**s.bits):
            raise QuantizationError(f"the block solver returned malformed integers for {name}")
        q[r0:r1], scales[r0:r1] = res.q, res.scales
        if zps is not None:
            if res.zero_points is None:
                raise QuantizationError(f"the block solver returned no zero points for asymmetric {name}")
            zps[r0:r1] = res.zero_points
        deq = (res.q.astype(np.float32) - res.implied_zero_points(s.bits)[..., None]) * res.scales[..., None]
        with np.errstate(over="ignore", invalid="ignore"):  # huge finite weights: no warning, sums in float64
            diff = (deq - w3).reshape(r1 - r0, -1)[:, :k]
            num += float(np.einsum("ij,ij->", diff, diff, dtype=np.float64))
            den += float(np.einsum("ij,ij->", w, w, dtype=np.float64))
    return QuantizedBlocks(q, scales, zps), (num / den) ** 0.5 if den else 0.0


def _solve(job: Job, solver: BlockSolver) -> _Solved:
    t = job.param.detach().to(torch.float32)
    if job.transposed:  # (E, K, OUT) -> each expert's [OUT, K] rows, blocked along K
        t = t.transpose(-1, -2)
    w = t.reshape(-1, t.shape[-1]).numpy()
    s = job.settings
    blocks, error = solve_rows(lambda r0, r1: w[r0:r1], w.shape[0], w.shape[1], s, job.zero_points, job.name, solver)
    qspec = QuantSpec(s.bits, s.group_size, s.symmetric, tuple(job.param.shape), job.param.dtype, job.zero_points,
                      transposed=job.transposed)
    return _Solved(job, QuantTensor.from_blocks(blocks, qspec), error)


def apply(model: nn.Module, p: Plan, solver: BlockSolver, *, jobs: int = 1,
          progress: Callable[[int], None] | None = None) -> Report:
    """Quantize every job of ``p`` and swap the parameters; returns what was done."""
    report = Report(skipped=dict(p.skipped))
    p.log_notes()
    order = sorted(p.jobs, key=lambda j: -j.param.numel())
    # pool.map queues every job: an error or a signal must drop them, not wait for them all
    with ThreadPoolExecutor(max(1, jobs)) as pool, cancel_pending(pool):
        for solved in pool.map(lambda j: _solve(j, solver), order):
            job = solved.job
            new = nn.Parameter(solved.tensor, requires_grad=False)
            for ep in job.quantized:
                setattr(ep.module, ep.attr, new)  # every quantized endpoint shares one tensor
            report.quantized += 1
            report.weights += job.param.numel()
            t = solved.tensor
            report.stored_bytes += t.qweight.numel() + t.scales.numel() * 4 + (
                0 if t.qzeros is None else t.qzeros.numel() * t.qzeros.element_size())
            report.errors[job.name] = solved.error
            if progress is not None:
                progress(1)
    if any(job.kept_float for job in p.jobs):
        _untie_config(model, p)
    if not p.jobs:
        log.warning("no weights to quantize")
    return report


def _untie_config(model: nn.Module, p: Plan) -> None:
    """A split tie must not be re-tied on reload: the float side is saved as its own weight."""
    split = {ep.module_name for job in p.jobs for ep in job.quantized + job.kept_float if job.kept_float}
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    head = _output_embeddings(model)
    names = {n for n, m in model.named_modules() if m is emb or m is head}
    if split & names:
        config = getattr(model, "config", None)
        for cfg in {id(c): c for c in _configs(config)}.values():
            if getattr(cfg, "tie_word_embeddings", None):
                cfg.tie_word_embeddings = False


def _configs(config: Any) -> list[Any]:
    if config is None:
        return []
    out = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        text = get_text()
        if text is not None:
            out.append(text)
    return out
