"""Calibration data, one option for every pass that needs data.

Sources:

* ``random``: inputs drawn from the model's signature (ids within the vocabulary read off
  the embedding table, masks of ones, floats from a normal). For smoke tests only: a warning
  says so.
* ``.npz`` files (one file, or a folder of them): each file holds arrays named like the
  model's inputs; a leading axis larger than the model's batch is split into samples.
* a text file (``.txt``) with a tokenizer (``tokenizer.json`` in the model's folder or the
  package's root, or ``tokenizer``): windows of ``seq_len`` tokens give ``input_ids`` (and
  ``attention_mask``, ``position_ids`` when the model takes them), each starting with BOS when
  the tokenizer asks for it. Needs the ``tokenizers`` package.

KV-cache exports (ONNX Runtime GenAI builder, Optimum, mobius) work with every source: the
``past_*`` inputs a source does not give are an empty cache, or zeros of a fixed capacity where
the model needs one (a sliding-window or static cache), as ``bitpress eval`` feeds them
(:mod:`bitpress.genai.kvcache`; head counts and window sizes from ``genai_config.json``). Text
becomes windows of tokens in :mod:`bitpress.calibration.text`.

**The model's own text** (``generated``): windows the model being quantized writes itself, sampled
from its full next-token distribution (:mod:`bitpress.calibration.generate`), either all of them
(``source: generated``) or ``generated`` of the ``samples`` beside a text's windows. Unset, a
calibrated pass (GPTQ, AWQ) given a text takes half of its samples from the model
(:meth:`DataConfig.with_own_text`): a text unlike the one the model will see then cannot pull the
solver's error into directions that text never exercises; ``generated: 0`` keeps to the text.

How many samples: ``samples`` when given; else a calibrated pass (GPTQ, AWQ, on ONNX and on
Hugging Face models) takes enough for its widest layer input (:meth:`DataConfig.enough_for`:
twice as many tokens as that input has channels, 8 to 128 samples), and everything else
:data:`DEFAULT_SAMPLES`. Fewer tokens than channels leave the input's statistics (its Hessian)
rank-deficient, and a solver that inverts them fits the calibration text.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx

from bitpress.calibration.text import find_tokenizer, token_windows, tokenize
from bitpress.errors import ConfigError, UsageError
from bitpress.genai.kvcache import CachePlan, cache_plan, is_past, kv_hints, window_feeds
from bitpress.genai.package import find_genai_config
from bitpress.onnx.inputs import InputSpec, input_specs, vocab_size
from bitpress.quant.calibrated import TOKENS_PER_CHANNEL

log = logging.getLogger(__name__)

#: samples taken when ``samples`` is not given and the consumer asks for no more
DEFAULT_SAMPLES = 8
#: the most samples :meth:`DataConfig.enough_for` picks by itself (16384 tokens of 128)
MAX_AUTO_SAMPLES = 128
#: ``source`` for windows the model writes itself, every one of them
GENERATED = "generated"
#: the suffixes read as text
TEXT_SUFFIXES = (".txt", ".cor", ".md", ".text")


def samples_for(width: int, seq_len: int, batch: int = 1) -> int:
    """Samples of ``seq_len`` tokens (``batch`` rows each) giving ``TOKENS_PER_CHANNEL x width`` tokens,
    from :data:`DEFAULT_SAMPLES` to :data:`MAX_AUTO_SAMPLES`."""
    per_sample = max(1, seq_len) * max(1, batch)
    return min(MAX_AUTO_SAMPLES, max(DEFAULT_SAMPLES, -(-TOKENS_PER_CHANNEL * width // per_sample)))


@dataclass
class DataConfig:
    """Where calibration inputs come from; ``source`` is ``random``, a .npz file/folder, a .txt or ``generated``.

    ``samples``: how many; None (not given) is :data:`DEFAULT_SAMPLES`, or what a calibrated pass
    needs (:meth:`enough_for`). ``generated``: how many of them the model writes itself (with a text
    source); None (not given) is 0, or half for a calibrated pass (:meth:`with_own_text`)."""

    source: str = "random"
    samples: int | None = None
    seq_len: int = 128
    batch: int = 1
    tokenizer: str | None = None
    seed: int = 0
    generated: int | None = None
    #: ``generated`` is a pass's default (:meth:`with_own_text`), not the user's: a model that cannot write
    #: text (an encoder, a tokenizer without a start token) is calibrated on the text alone instead of refused.
    #: Not a field: configs (and ``asdict`` copies sent to plugin environments) never carry it.
    fallback: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.generated is None:
            return
        if isinstance(self.generated, bool) or not isinstance(self.generated, int) or self.generated < 0:
            raise ConfigError(f"data: generated must be a whole number of windows >= 0, got {self.generated!r}")
        if self.generated and not self.is_text and self.source != GENERATED:
            raise ConfigError(f"data: generated mixes the model's own text into a text's windows; {self.source!r} is "
                              "not a text (use source: generated for the model's text alone)")
        if self.samples is not None and self.generated > self.samples:
            raise ConfigError(f"data: generated ({self.generated}) is more than samples ({self.samples}): it "
                              "counts the samples the model writes itself")

    @property
    def is_text(self) -> bool:
        return Path(self.source).suffix in TEXT_SUFFIXES

    @property
    def own(self) -> int:
        """How many of the :attr:`count` samples the model writes itself."""
        if self.source == GENERATED:
            return self.count
        return min(self.generated or 0, self.count)

    def with_own_text(self, who: str) -> DataConfig:
        """This config with half of the samples the model's own when ``generated`` was not given and the
        source is a text (a calibrated pass's default, ``who``'s; the windows' writer logs it)."""
        if self.generated is not None or not self.is_text:
            return self
        log.debug("%s: half of the calibration samples from the model's own text", who)
        out = replace(self, generated=self.count // 2)
        out.fallback = True
        return out

    def own_note(self) -> str:
        """What the log says of the windows the model writes: theirs, and whether a pass chose them."""
        if not self.fallback:
            return ""
        return (f"; {self.own} of the {self.count} samples, a calibrated pass's default beside a text (data: generated "
                "sets how many, 0 keeps to the text)")

    @classmethod
    def from_value(cls, value: Any) -> DataConfig:
        if isinstance(value, DataConfig):
            return value
        if isinstance(value, str):
            return cls(source=value)
        if isinstance(value, dict):
            try:
                return cls(**value)
            except TypeError as exc:
                raise ConfigError(
                    f"data: {exc}; valid keys: source, samples, seq_len, batch, tokenizer, seed, generated"
                ) from None
        raise ConfigError(f"data must be a source string or a mapping, got {value!r}")

    @property
    def count(self) -> int:
        """The samples to take: ``samples``, or :data:`DEFAULT_SAMPLES` when it was not given."""
        return self.samples if self.samples is not None else DEFAULT_SAMPLES

    def enough_for(self, width: int, who: str) -> DataConfig:
        """This config with ``samples`` set for layer inputs up to ``width`` channels wide when it was not
        given (:func:`samples_for`); logged, naming ``who`` (the pass)."""
        if self.samples is not None:
            return self
        n = max(samples_for(width, self.seq_len, self.batch), self.generated or 0)
        log.info("%s: calibrating on up to %d samples of %d tokens (%d tokens for layer inputs up to %d wide; "
                 "data: samples sets another number)", who, n, self.seq_len, n * self.seq_len * max(1, self.batch),
                 width)
        return replace(self, samples=n)


def iter_feeds(
    model: onnx.ModelProto, config: DataConfig, model_dir: Path | None = None, *, root: Path | None = None,
    warn: bool = True, handle: Any = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Yield ``config.count`` feeds for ONNX Runtime.

    ``model_dir``: the model's folder (its tokenizer.json and genai_config.json); ``root``: the
    package folder holding it (an ONNX Runtime GenAI folder whose model is in a sub-folder), where
    those files are looked for next. Nothing above ``root`` (or ``model_dir``) is read. ``warn``: say
    that random inputs are for smoke tests (a caller that asked for them on purpose says so itself).
    ``handle``: the :class:`~bitpress.models.onnx_model.OnnxModel` of ``model``, which writes the
    windows ``config.own`` asks for (without it, a config asking for any is refused).
    """
    src = config.source
    specs = input_specs(model)
    plan = CachePlan()
    if any(is_past(s) for s in specs):
        genai = find_genai_config(model_dir, root) if model_dir is not None else None
        plan = cache_plan(model, kv_hints(genai), specs=specs)
    plain = [s for s in specs if not is_past(s)]
    if src == GENERATED:
        yield from _text(None, specs, config, model_dir, root, plan, handle)
        return
    if src == "random":
        (log.warning if warn else log.debug)("calibrating on random inputs: fine for smoke tests, not for real quality")
        for feed in _random(plain, config, vocab_size(model)):
            yield plan.fill(feed)
        return
    path = Path(src)
    if not path.exists():
        raise UsageError(f"calibration data {src!r} not found (use 'random', 'generated', a .npz file/folder or a "
                         ".txt file)")
    if path.is_dir() or path.suffix == ".npz":
        for feed in _npz(path, specs, config, {p.name for p in plan.past}):
            yield plan.fill(feed)
        return
    if path.suffix in TEXT_SUFFIXES:
        yield from _text(path, specs, config, model_dir, root, plan, handle)
        return
    raise UsageError(f"calibration data {src!r}: expected 'random', a .npz file or folder, or a .txt file")


def _concrete(shape: tuple, batch: int, seq: int) -> tuple[int, ...]:
    out = []
    for i, d in enumerate(shape):
        if isinstance(d, int) and d > 0:
            out.append(d)
        else:
            out.append(batch if i == 0 else seq)
    return tuple(out)


def _random(specs: list[InputSpec], config: DataConfig, vocab: int) -> Iterator[dict[str, np.ndarray]]:
    rng = np.random.default_rng(config.seed)
    for _ in range(config.count):
        feed = {}
        for s in specs:
            shape = _concrete(s.shape, config.batch, config.seq_len)
            lname = s.name.lower()
            if np.issubdtype(s.dtype, np.integer):
                if "mask" in lname:
                    feed[s.name] = np.ones(shape, s.dtype)
                elif "position" in lname:
                    feed[s.name] = np.broadcast_to(np.arange(shape[-1], dtype=s.dtype), shape).copy()
                else:
                    feed[s.name] = rng.integers(0, vocab, size=shape).astype(s.dtype)
            elif s.dtype == np.bool_:
                feed[s.name] = np.ones(shape, np.bool_)
            else:
                feed[s.name] = rng.standard_normal(shape).astype(s.dtype)
        yield feed


def _npz(
    path: Path, specs: list[InputSpec], config: DataConfig, optional: frozenset[str] | set[str] = frozenset()
) -> Iterator[dict[str, np.ndarray]]:
    """Samples of the files; ``optional`` inputs (the cache) may be absent: the caller fills them."""
    files = sorted(path.glob("*.npz")) if path.is_dir() else [path]
    if not files:
        raise UsageError(f"no .npz files in {path}")
    names = {s.name for s in specs}
    required = names - set(optional)
    produced = 0
    for f in files:
        with np.load(f, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        missing = required - set(arrays)
        if missing:
            raise UsageError(f"{f.name} lacks inputs {sorted(missing)}; it has {sorted(arrays)}")
        n = len(next(iter(arrays.values())))
        step = max(1, config.batch)
        for i in range(0, n, step):
            yield {k: arrays[k][i : i + step] for k in names if k in arrays}
            produced += 1
            if produced >= config.count:
                return


def _text(
    path: Path | None, specs: list[InputSpec], config: DataConfig, model_dir: Path | None, root: Path | None,
    plan: Any, handle: Any,
) -> Iterator[dict[str, np.ndarray]]:
    """Windows of ``seq_len`` tokens (BOS first when the tokenizer asks), the cache as ``plan`` fills it:
    the text's (``path``; None for none), then ``config.own`` the model writes itself."""
    if model_dir is None and not config.tokenizer:
        raise UsageError("text calibration data needs a tokenizer: pass --tokenizer / data.tokenizer "
                         "(a tokenizer.json or its folder)")
    try:
        tok_path = find_tokenizer(config.tokenizer, [(Path(model_dir), root)] if model_dir is not None else [],
                                  "--tokenizer / data.tokenizer")
    except UsageError as exc:
        if path is not None:
            raise
        # no text given: the run asked the model for its own text, which starts from its tokenizer
        raise UsageError(f"the model's own calibration text needs its tokenizer: {exc}; or give calibration data "
                         "(--data: a text or .npz files)") from None
    own = None
    if config.own:
        try:
            own = own_windows(handle, specs, plan, tok_path, config)
        except UsageError as exc:
            if not config.fallback or path is None:
                raise
            log.info("calibrating on %s alone: %s", path.name, exc)
    rows = config.batch * (config.count - (config.own if own is not None else 0))
    if path is not None and rows:
        windows = token_windows(tokenize(path, tok_path), config.seq_len, rows, shorter="error")
        for _, feed in window_feeds(specs, plan, windows, config.batch, "text calibration"):
            yield feed
    if own is not None:
        for _, feed in window_feeds(specs, plan, own, config.batch, "text calibration"):
            yield feed


def own_windows(handle: Any, specs: list[InputSpec], plan: Any, tokenizer: Path, config: DataConfig) -> np.ndarray:
    """``config.own`` windows (``x batch`` rows) the model of ``handle`` writes itself, from the tokenizer's start."""
    from bitpress.calibration.generate import sample_windows
    from bitpress.calibration.text import load_tokenizer, start_tokens

    if handle is None:
        raise UsageError("cannot run the model to write its own calibration text here (generated / source: "
                         "generated); give a text or .npz files instead")
    tok = load_tokenizer(tokenizer)
    start = start_tokens(tok, tokenizer)
    rows = config.own * config.batch
    log.info("the model writes %d windows of %d tokens of its own calibration text (from token(s) %s, seed %d)%s",
             rows, config.seq_len, list(start), config.seed, config.own_note())
    return sample_windows(handle, specs, plan, start, rows, config.seq_len, config.seed,
                          vocab=int(tok.get_vocab_size(with_added_tokens=True)))


# InputSpec, input_specs and vocab_size (bitpress.onnx.inputs) are offered here too: what the feeds are built from
__all__ = ["GENERATED", "DataConfig", "InputSpec", "input_specs", "iter_feeds", "own_windows", "vocab_size"]
