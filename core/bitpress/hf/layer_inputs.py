"""Calibration inputs of a PyTorch (Hugging Face) model, layer by layer, for calibrated solvers.

* :func:`calibration_batches`: the host's ``--data`` (:class:`~bitpress.calibration.data.DataConfig`) as
  ``input_ids`` / ``attention_mask`` batches: text windows cut with the model folder's
  tokenizer (or ``data.tokenizer``) and those the model writes itself (``generated``: sampled
  from its full next-token distribution, :func:`own_windows`), ``.npz`` files holding
  ``input_ids``, or ``random``.
* :func:`find_layers`: the decoder stack, the ``nn.ModuleList`` of same-class blocks that holds
  the most target linears (``model.model.layers`` for Llama-likes).
* :func:`capture`: what every block receives for every batch (hidden states, attention mask,
  rotary tables, ...), from one forward in which the blocks are stand-ins that pass their
  input through (nothing but the embedding runs); the last stand-in stops the forward.
* :class:`InputRecorder`: forward pre-hooks on linears accumulating the
  :class:`~bitpress.quant.calibrated.LayerStats` of each *distinct* input: linears called one
  after another with the very same tensor (q/k/v, gate/up) share one set of statistics.

Everything runs under ``torch.no_grad`` on the model's device (CPU), padding tokens
(``attention_mask == 0``) excluded from the statistics.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bitpress.calibration.data import GENERATED, TEXT_SUFFIXES, DataConfig, _npz
from bitpress.errors import QuantizationError, UsageError
from bitpress.onnx.calibrated.stats import StatsAccumulator
from bitpress.onnx.inputs import InputSpec
from bitpress.quant.calibrated import LayerStats

log = logging.getLogger(__name__)

#: windows of equal length are stacked into batches of about this many tokens (statistics do not
#: depend on the batching; fewer, larger forwards are faster)
BATCH_TOKENS = 2048


def _rows_per_batch(cfg: DataConfig) -> int:
    return max(1, cfg.batch, BATCH_TOKENS // max(1, cfg.seq_len))


@dataclass
class Batch:
    """One calibration batch: ``input_ids`` int64 ``[batch, seq]``, ``attention_mask`` (or None: all tokens)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor | None:
        """bool ``[batch, seq]``: the tokens that count in the statistics (None: every one)."""
        if self.attention_mask is None or bool(self.attention_mask.all()):
            return None
        return self.attention_mask.bool()

    @property
    def tokens(self) -> int:
        v = self.valid
        return int(self.input_ids.numel()) if v is None else int(v.sum())


# -- calibration data ---------------------------------------------------------------------------------
def calibration_batches(data: Any, model_dir: Path | None, vocab_size: int, model: nn.Module | None = None
                        ) -> list[Batch]:
    """``data`` (a :class:`DataConfig` or what :meth:`DataConfig.from_value` takes) as batches.

    Text needs a ``tokenizer.json``: ``data.tokenizer``, else the model folder's (local files only).
    ``model``: the causal LM that writes the windows ``data.generated`` asks for.
    """
    if data is None:
        raise UsageError("calibrated quantization needs calibration data: give --data (a .txt file, "
                         "a .npz file or folder with input_ids, or random) or 'data:' in the config")
    cfg = DataConfig.from_value(data)
    if cfg.source == GENERATED:
        return _text_batches(None, cfg, model_dir, model)
    if cfg.source == "random":
        log.warning("calibrating on random token ids: fine for smoke tests, not for real quality")
        gen = torch.Generator().manual_seed(cfg.seed)
        ids = torch.randint(0, vocab_size, (cfg.count * max(1, cfg.batch), cfg.seq_len), generator=gen)
        return [Batch(chunk) for chunk in torch.split(ids, _rows_per_batch(cfg))]
    path = Path(cfg.source)
    if not path.exists():
        raise UsageError(f"calibration data {cfg.source!r} not found (use 'random', a .npz file/folder with "
                         "input_ids, or a .txt file)")
    if path.is_dir() or path.suffix == ".npz":
        out = _npz_batches(path, cfg)
    elif path.suffix in TEXT_SUFFIXES:
        out = _text_batches(path, cfg, model_dir, model)
    else:
        raise UsageError(f"calibration data {cfg.source!r}: expected 'random', a .npz file or folder, or a .txt file")
    for b in out:
        top = int(b.input_ids.max()) if b.input_ids.numel() else 0
        if top >= vocab_size or (b.input_ids.numel() and int(b.input_ids.min()) < 0):
            raise UsageError(f"calibration data {cfg.source!r} holds token id {top}, outside the model's "
                             f"vocabulary of {vocab_size}: tokenize it with this model's tokenizer")
    if not out:
        raise UsageError(f"calibration data {cfg.source!r} gave no samples")
    return out


def _npz_batches(path: Path, cfg: DataConfig) -> list[Batch]:
    specs = [InputSpec("input_ids", np.int64, (None, None)), InputSpec("attention_mask", np.int64, (None, None))]
    out = []
    for feed in _npz(path, specs, cfg, optional={"attention_mask"}):
        ids = np.asarray(feed["input_ids"])
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise UsageError(f"{path}: input_ids must be integers [batch, seq], got {ids.dtype} {list(ids.shape)}")
        mask = feed.get("attention_mask")
        m = None
        if mask is not None:
            m = torch.from_numpy(np.asarray(mask).reshape(ids.shape).astype(np.int64))
        out.append(Batch(torch.from_numpy(ids.astype(np.int64)), m))
    return out


def _text_batches(path: Path | None, cfg: DataConfig, model_dir: Path | None, model: nn.Module | None) -> list[Batch]:
    """The text's windows (``path``; None for none), then the ``cfg.own`` windows the model writes."""
    from bitpress.calibration.text import find_tokenizer, token_windows, tokenize

    if model_dir is None and not cfg.tokenizer:
        raise UsageError("text calibration data needs a tokenizer: pass --tokenizer / data.tokenizer "
                         "(a tokenizer.json or its folder)")
    folders = [(Path(model_dir), None)] if model_dir is not None else []
    tok = find_tokenizer(cfg.tokenizer, folders, "--tokenizer / data.tokenizer")
    own = None
    if cfg.own:
        try:
            own = own_windows(model, tok, cfg)
        except UsageError as exc:
            if not cfg.fallback or path is None:
                raise
            log.info("calibrating on %s alone: %s", path.name, exc)
    parts = []
    rows = (cfg.count - (cfg.own if own is not None else 0)) * max(1, cfg.batch)
    if path is not None and rows:
        parts.append(token_windows(tokenize(path, tok), cfg.seq_len, rows, shorter="error"))
    if own is not None:
        parts.append(own)
    windows = np.concatenate(parts) if parts else np.zeros((0, cfg.seq_len), np.int64)
    step = _rows_per_batch(cfg)
    return [Batch(torch.from_numpy(np.ascontiguousarray(windows[i: i + step])))
            for i in range(0, len(windows), step)]


def own_windows(model: nn.Module | None, tokenizer: Path, cfg: DataConfig) -> np.ndarray:
    """``cfg.own x batch`` windows of ``cfg.seq_len`` tokens the causal LM ``model`` samples itself, from
    the tokenizer's start tokens, with its KV cache (the same rule as the ONNX path's
    :func:`bitpress.calibration.generate.sample_windows`: the full distribution, seeded)."""
    import time

    from bitpress.calibration.generate import BATCH
    from bitpress.calibration.text import load_tokenizer, start_tokens

    if model is None or not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise UsageError("the model's own calibration text needs a causal language model (an LM head); "
                         "give a text (data: source) and generated: 0")
    tok = load_tokenizer(tokenizer)
    start = start_tokens(tok, tokenizer)
    rows, seq = cfg.own * max(1, cfg.batch), cfg.seq_len
    if len(start) >= seq:
        raise UsageError(f"a window of {seq} tokens leaves no room after the {len(start)} start token(s)")
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    log.info("the model writes %d windows of %d tokens of its own calibration text (from token(s) %s, seed %d)%s",
             rows, seq, list(start), cfg.seed, cfg.own_note())
    gen = torch.Generator().manual_seed(cfg.seed)
    out = torch.empty((rows, seq), dtype=torch.int64)
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for lo in range(0, rows, BATCH):
                hi = min(rows, lo + BATCH)
                ids = out[lo:hi]
                ids[:, : len(start)] = torch.tensor(start, dtype=torch.int64)
                res = model(input_ids=ids[:, : len(start)].clone(), use_cache=True)
                for t in range(len(start), seq):
                    logits = res.logits[:, -1].double()
                    if 0 < vocab < logits.shape[1]:
                        logits = logits[:, :vocab]
                    u = torch.rand(logits.shape, generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0)
                    ids[:, t] = torch.argmax(logits - torch.log(-torch.log(u)), dim=1)
                    if t + 1 == seq:
                        break
                    res = model(input_ids=ids[:, t : t + 1].clone(), past_key_values=res.past_key_values,
                                use_cache=True)
                log.info("calibration text written by the model: %d/%d windows of %d tokens (%.0f s)", hi, rows, seq,
                         time.perf_counter() - t0)
    finally:
        model.train(was_training)
    return out.numpy()


# -- the decoder stack --------------------------------------------------------------------------------
def find_layers(model: nn.Module, targets: set[int]) -> tuple[str, nn.ModuleList] | None:
    """The ``nn.ModuleList`` of same-class blocks holding the most target modules (``id``s), else None.

    Ties go to the longer list; an experts list inside a block holds fewer targets than the stack.
    """
    best: tuple[int, int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 1:
            continue
        if len({type(m) for m in mod}) != 1:
            continue
        held = sum(1 for m in mod.modules() if id(m) in targets)
        if held and (best is None or (held, len(mod)) > best[:2]):
            best = (held, len(mod), name, mod)
    return None if best is None else (best[2], best[3])


@dataclass
class LayerCall:
    """How a block was called for one batch: the hidden states and everything else it was given."""

    hidden: torch.Tensor
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: str | None  # the hidden states' keyword, None when positional


def call_layer(layer: nn.Module, call: LayerCall, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``layer`` as the model did (``hidden`` replaces the recorded hidden states); its hidden output."""
    h = call.hidden if hidden is None else hidden
    out = layer(*call.args, **{**call.kwargs, call.key: h}) if call.key else layer(h, *call.args, **call.kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


class _Stop(Exception):
    """Raised by the last stand-in block: the rest of the forward is not needed."""


@contextmanager
def stand_ins(layers: nn.ModuleList, make: Callable[[int], Callable[..., Any]]) -> Iterator[None]:
    """Replace each block's ``forward`` by ``make(i)`` for the duration (restored even on errors)."""
    saved = [layer.__dict__.get("forward") for layer in layers]
    try:
        for i, layer in enumerate(layers):
            layer.forward = make(i)  # type: ignore[method-assign]
        yield
    finally:
        for layer, old in zip(layers, saved, strict=True):
            if old is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = old  # type: ignore[method-assign]


def model_kwargs(model: nn.Module, batch: Batch) -> dict[str, Any]:
    """The keyword arguments of a calibration forward: ids, mask, no cache."""
    kw: dict[str, Any] = {"input_ids": batch.input_ids}
    kw["attention_mask"] = batch.attention_mask if batch.attention_mask is not None else torch.ones_like(
        batch.input_ids)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "use_cache" in params:
        kw["use_cache"] = False
    return kw


def capture(model: nn.Module, layers: nn.ModuleList, batches: list[Batch]) -> list[list[LayerCall]]:
    """``calls[i][b]``: how block ``i`` is called for batch ``b`` (block 0's hidden states kept).

    The blocks are stand-ins that return their input, so the calls of block ``i > 0`` keep their
    own keyword arguments (per-layer masks of sliding-window models) with the hidden states of
    block 0 as placeholder; the host replaces them by the previous block's outputs.
    """
    calls: list[list[LayerCall]] = [[] for _ in layers]
    last = len(layers) - 1

    def make(i: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if args:
                hidden, rest, key = args[0], tuple(args[1:]), None
            elif "hidden_states" in kwargs:
                hidden, rest, key = kwargs.pop("hidden_states"), (), "hidden_states"
            else:
                raise QuantizationError(f"block {i} of the decoder stack was called without hidden states "
                                        f"(keywords {sorted(kwargs)}); this architecture is not supported")
            calls[i].append(LayerCall(hidden.detach(), rest, kwargs, key))
            if i == last:
                raise _Stop
            return hidden

        return forward

    with torch.no_grad(), stand_ins(layers, make):
        for batch in batches:
            try:
                model(**model_kwargs(model, batch))
            except _Stop:
                pass
            else:
                raise QuantizationError("the model's forward did not reach its last decoder block; "
                                        "this architecture is not supported by the calibrated passes")
    for i, per_batch in enumerate(calls):
        if len(per_batch) != len(batches):
            raise QuantizationError(f"decoder block {i} was called {len(per_batch)} times for {len(batches)} "
                                    "batches; this architecture is not supported by the calibrated passes")
    return calls


# -- statistics of the linears' inputs ----------------------------------------------------------------
@dataclass
class InputGroup:
    """Linears that read one input tensor; ``names[0]`` (the first called) collects its statistics."""

    names: list[str]
    acc: StatsAccumulator
    first: torch.Tensor | None = None  # the input of the first batch (kept when asked, e.g. for AWQ)
    members: set[str] = field(default_factory=set)


class InputRecorder:
    """Forward pre-hooks on ``modules`` ({name: linear}) collecting statistics per distinct input.

    Grouping: a linear whose input is the very tensor the previously hooked linear got joins that
    linear's group (decided the first time each linear runs). ``valid`` is set per batch by the
    caller (the padding tokens to leave out). ``keep_first``: keep each group's first-batch input.
    """

    def __init__(self, modules: dict[str, nn.Module], needs: frozenset[str], batches: int,
                 keep_first: bool = False) -> None:
        self.modules = modules
        self.needs = needs
        self.batches = batches
        self.keep_first = keep_first
        self.groups: list[InputGroup] = []
        self.group_of: dict[str, InputGroup] = {}
        self.valid: torch.Tensor | None = None
        self.order: list[str] = []  # every hooked linear, in the order of its first call
        self._last: tuple[torch.Tensor, InputGroup] | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> InputRecorder:
        for name, mod in self.modules.items():
            self._handles.append(mod.register_forward_pre_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._last = None

    def new_batch(self, valid: torch.Tensor | None) -> None:
        self.valid = valid
        self._last = None

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else kwargs.get("input")
            if not isinstance(x, torch.Tensor):
                return
            group = self.group_of.get(name)
            if group is None:
                if self._last is not None and self._last[0] is x:
                    group = self._last[1]
                    group.names.append(name)
                else:
                    group = InputGroup([name], StatsAccumulator(self.needs, self.batches))
                    self.groups.append(group)
                group.members.add(name)
                self.group_of[name] = group
                self.order.append(name)
            if group.names[0] == name:
                self._add(group, x)
            self._last = (x, group)

        return hook

    def _add(self, group: InputGroup, x: torch.Tensor) -> None:
        if self.keep_first and group.first is None:
            group.first = x.detach()
        flat = x.detach().reshape(-1, x.shape[-1])
        v = self.valid
        if v is not None and tuple(x.shape[:-1]) == tuple(v.shape):
            flat = flat[v.reshape(-1)]
        group.acc.add(flat.to(torch.float32).numpy())

    def stats(self, group: InputGroup) -> LayerStats | None:
        """The group's statistics, None when no calibration token reached it (an expert never routed to)."""
        return group.acc.result() if group.acc.rows else None


def held_bytes(calls: list[LayerCall]) -> int:
    """Bytes of the hidden states held for every batch (what the layer-wise loop keeps in memory)."""
    return sum(c.hidden.numel() * c.hidden.element_size() for c in calls)
