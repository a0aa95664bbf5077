"""Per-input-channel scales (AWQ) applied exactly to a PyTorch block: ``w * s`` and ``x / s``.

The linears that read one input get their columns multiplied by ``s``; the ``1 / s`` goes into
what produces that input, when that is exact:

* a norm (RMSNorm / LayerNorm: a leaf module with a 1-D ``weight`` of K, and a bias of K or
  none) whose output only those linears read: ``weight / s`` and ``bias / s``;
* a linear whose output rows become the input's channels after operations that commute with a
  per-channel scale (``up_proj`` for ``down_proj``: ``act(gate) * up``; ``v_proj`` for ``o_proj``
  when their widths match): rows and bias ``/ s``.

Exactness is not assumed from names: each candidate is tried on the block with a random probe
scale and kept only when the block's output on a calibration batch is unchanged (to float32
rounding; half-precision blocks are probed on a float32 copy). The producer (the module whose
output tensor *is* the linears' input) is tried first, then the other candidates that ran
before them, nearest first. When none is exact the input stays unscaled (logged).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_map

from bitpress.hf.layer_inputs import LayerCall, call_layer

log = logging.getLogger(__name__)

#: the block's output may move this much (relative Frobenius norm) under an exact probe fold
PROBE_TOLERANCE = 1e-4
#: candidates tried per input before giving up
MAX_PROBES = 4


def is_norm(mod: nn.Module, k: int) -> bool:
    """A leaf module with a 1-D ``weight`` of ``k`` (and a bias of ``k`` or none): a norm's gain."""
    if isinstance(mod, (nn.Linear, nn.Embedding)) or next(mod.children(), None) is not None:
        return False
    w = mod._parameters.get("weight")
    b = mod._parameters.get("bias")
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.shape[0] != k:
        return False
    return b is None or (b.dim() == 1 and b.shape[0] == k)


@dataclass(frozen=True)
class Fold:
    """Where ``1 / s`` goes: ``name`` (relative to the block), a norm or a linear's output rows."""

    name: str
    kind: str  # norm | linear

    def apply(self, block: nn.Module, inv: torch.Tensor) -> None:
        mod = block.get_submodule(self.name)
        for attr in ("weight", "bias"):
            p = mod._parameters.get(attr)
            if p is None:
                continue
            shape = (-1, 1) if (self.kind == "linear" and attr == "weight") else (-1,)
            _mul_(p, inv.reshape(shape))


def _mul_(p: torch.Tensor, factor: torch.Tensor) -> None:
    with torch.no_grad():
        p.copy_((p.to(torch.float32) * factor.to(torch.float32)).to(p.dtype))


def scale_columns(block: nn.Module, names: list[str], s: torch.Tensor) -> None:
    """Multiply the input columns of the linears ``names`` (relative to ``block``) by ``s``."""
    for n in names:
        _mul_(block.get_submodule(n).weight, s.reshape(1, -1))


class CallLog:
    """Forward hooks on a block's leaf candidates (norms, linears): the order they finish in and
    their outputs, for the first batch only (``active`` is cleared by the caller after it)."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.active = True
        self.finished: list[str] = []
        self.outputs: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> CallLog:
        for name, mod in self.block.named_modules():
            if name and (isinstance(mod, nn.Linear) or _has_gain(mod)):
                self._handles.append(mod.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if self.active and name not in self.outputs and isinstance(out, torch.Tensor):
                self.finished.append(name)
                self.outputs[name] = out
        return hook


def _has_gain(mod: nn.Module) -> bool:
    w = mod._parameters.get("weight")
    return isinstance(w, torch.Tensor) and w.dim() == 1 and next(mod.children(), None) is None


class Prober:
    """Tries candidate folds on one block with a probe scale; the block is restored after each try."""

    def __init__(self, block: nn.Module, call: LayerCall, seed: int = 0) -> None:
        dtype = next((p.dtype for p in block.parameters() if p.is_floating_point()), torch.float32)
        if dtype in (torch.float32, torch.float64):
            self.block, self.call = block, call
        else:  # half precision: probe a float32 copy, where rounding does not hide a wrong fold
            self.block = copy.deepcopy(block).to(torch.float32)
            self.call = _cast(call, torch.float32)
        self.gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.ref = call_layer(self.block, self.call).to(torch.float64)

    def exact(self, group: list[str], fold: Fold, k: int) -> bool:
        s = torch.exp(torch.empty(k).uniform_(-0.7, 0.7, generator=self.gen))
        touched = [self.block.get_submodule(n).weight for n in group]
        target = self.block.get_submodule(fold.name)
        touched += [p for p in (target._parameters.get("weight"), target._parameters.get("bias")) if p is not None]
        saved = [p.detach().clone() for p in touched]
        try:
            scale_columns(self.block, group, s)
            fold.apply(self.block, 1.0 / s)
            with torch.no_grad():
                out = call_layer(self.block, self.call).to(torch.float64)
        finally:
            with torch.no_grad():
                for p, old in zip(touched, saved, strict=True):
                    p.copy_(old)
        den = float(torch.linalg.vector_norm(self.ref))
        rel = float(torch.linalg.vector_norm(out - self.ref)) / den if den else float("inf")
        return rel < PROBE_TOLERANCE


def _cast(call: LayerCall, dtype: torch.dtype) -> LayerCall:
    def f(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return LayerCall(f(call.hidden), tree_map(f, call.args), tree_map(f, call.kwargs), call.key)


def candidates(block: nn.Module, group: list[str], k: int, log_: CallLog,
               first_input: torch.Tensor | None) -> list[Fold]:
    """Where ``1 / s`` could go for the linears ``group`` (relative names) of width ``k``, best first."""
    mods = dict(block.named_modules())
    if not group or group[0] not in log_.finished:
        return []
    before = log_.finished[: log_.finished.index(group[0])]
    out: list[Fold] = []
    for name in reversed(before):
        mod = mods[name]
        if name in group:
            continue
        if isinstance(mod, nn.Linear) and mod.out_features == k:
            fold = Fold(name, "linear")
        elif is_norm(mod, k):
            fold = Fold(name, "norm")
        else:
            continue
        if first_input is not None and log_.outputs.get(name) is first_input:
            out.insert(0, fold)  # the producer itself
        else:
            out.append(fold)
    return out[:MAX_PROBES]


def find_fold(prober: Prober, block: nn.Module, group: list[str], k: int, log_: CallLog,
              first_input: torch.Tensor | None) -> Fold | None:
    """The first candidate fold that leaves the block's output unchanged, else None."""
    for fold in candidates(block, group, k, log_, first_input):
        if prober.exact(group, fold, k):
            return fold
    return None


def as_tensor(s: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32))
