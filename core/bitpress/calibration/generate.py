"""Calibration text the model writes itself: windows of tokens sampled from the ONNX model being quantized.

A calibrated pass fitted to a text unlike the one its model will see (GPTQ calibrated on code and
evaluated on news) pushes its rounding error into the directions that text never exercises. Text
sampled from the model itself covers what the model does in general; mixed with the user's text it
keeps GPTQ from fitting that text's quirks (``docs/calibrated.md``: SmolLM2, GPTQ on Python's
documentation recovers 41% of RTN's loss alone, 55% with half of the windows the model's own).

Each window starts from the tokens text windows start with (BOS), or from the tokenizer's
document separator, and continues with tokens drawn from the model's full next-token distribution
(temperature 1, no top-k / top-p: the model's distribution, not its most likely text), seeded.

The model runs in one ONNX Runtime session of the graph as it is in memory (earlier passes
included). Exports with a KV cache (GenAI builder, Optimum, mobius) decode one token per call, each
``present.*`` output fed back as its ``past_*`` input; the first batch checks that path against a
full run of the same tokens and, when they disagree (a cache layout this module does not know),
every step reruns the whole prefix instead (slower, logged). Graphs without a cache always rerun it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from bitpress.errors import QuantizationError, UsageError, one_line
from bitpress.genai.kvcache import CachePlan, ids_input, is_past
from bitpress.onnx.inputs import InputSpec

log = logging.getLogger(__name__)

#: sequences decoded at once
BATCH = 8
#: the cached path must match a full run of the same tokens to this share of the logits' range
CACHE_TOLERANCE = 1e-3


@dataclass
class _Decoder:
    session: Any
    specs: list[InputSpec]  # the inputs that are not the cache
    ids_name: str
    logits: str
    past_of: dict[str, str]  # present output -> past input
    plan: CachePlan
    cached: bool

    def _plain_feed(self, ids: np.ndarray, total: int, start: int) -> dict[str, np.ndarray]:
        """Feeds for ``ids`` [b, s] at positions ``start..start+s-1``; the mask covers ``total`` tokens."""
        b, s = ids.shape
        feed: dict[str, np.ndarray] = {}
        for spec in self.specs:
            lname = spec.name.lower()
            if spec.name == self.ids_name:
                feed[spec.name] = ids.astype(spec.dtype)
            elif "mask" in lname:
                feed[spec.name] = np.ones((b, total), spec.dtype)
            elif "position" in lname:
                feed[spec.name] = np.broadcast_to(np.arange(start, start + s, dtype=spec.dtype), (b, s)).copy()
            else:
                raise UsageError(f"the model's own calibration text cannot fill its input {spec.name!r}; give a "
                                 "text or .npz files instead")
        return feed

    def full(self, ids: np.ndarray) -> np.ndarray:
        """The last position's logits after ``ids`` [b, s], from an empty cache in one call."""
        feed = self.plan.fill(self._plain_feed(ids, ids.shape[1], 0))
        out = self.session.run([self.logits], feed)[0]
        return np.asarray(out[:, -1], np.float64)

    def first(self, ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """``full``, and the cache it leaves."""
        feed = self.plan.fill(self._plain_feed(ids, ids.shape[1], 0))
        names = [self.logits, *self.past_of]
        outs = self.session.run(names, feed)
        past = {self.past_of[n]: v for n, v in zip(names[1:], outs[1:], strict=True)}
        return np.asarray(outs[0][:, -1], np.float64), past

    def step(self, token: np.ndarray, length: int, past: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
        """The logits after one more token (``length`` tokens in all), and the grown cache."""
        feed = self._plain_feed(token[:, None], length, length - 1)
        feed.update(past)
        names = [self.logits, *self.past_of]
        outs = self.session.run(names, feed)
        return np.asarray(outs[0][:, -1], np.float64), {self.past_of[n]: v for n, v in zip(names[1:], outs[1:],
                                                                                             strict=True)}


def _logits_output(model: onnx.ModelProto) -> str:
    """The output named ``logits``, else the one ``[batch, sequence, vocabulary]`` wide (the embedding's rows)."""
    from bitpress.onnx.inputs import vocab_size

    names = [o.name for o in model.graph.output]
    for name in names:
        if name == "logits" or name.endswith("/logits"):
            return name
    vocab = vocab_size(model)
    for o in model.graph.output:
        dims = o.type.tensor_type.shape.dim
        if any(w in o.name.lower() for w in ("hidden", "embed", "state")):
            continue  # an encoder's hidden states, however wide
        if len(dims) == 3 and dims[2].HasField("dim_value") and dims[2].dim_value == vocab:
            return o.name
    raise UsageError("the model's own calibration text needs a language model (an output of logits "
                     f"[batch, sequence, vocabulary]); this one gives {', '.join(names)}: give calibration data "
                     "(--data: a text or .npz files)")


def _present_for(past: str, outputs: set[str]) -> str | None:
    for cand in (past.replace("past_key_values", "present"), past.replace("past_key_value", "present"),
                 past.replace("past", "present")):
        if cand != past and cand in outputs:
            return cand
    return None


def decoder(handle: Any, specs: list[InputSpec], plan: CachePlan) -> _Decoder:
    """An ONNX Runtime session of ``handle`` (an :class:`~bitpress.models.onnx_model.OnnxModel`) for sampling."""
    from bitpress.onnx.activations import relocate, session_for

    proto = onnx.ModelProto()
    proto.CopyFrom(handle.proto)
    logits = _logits_output(proto)
    plain = [s for s in specs if not is_past(s)]
    ids_name = ids_input(plain)
    if ids_name is None:
        raise UsageError("the model's own calibration text needs a model taking input_ids; this one takes "
                         + ", ".join(s.name for s in plain))
    outputs = {o.name for o in proto.graph.output}
    pasts = [s.name for s in specs if is_past(s)]
    past_of = {}
    for name in pasts:
        present = _present_for(name, outputs)
        if present is not None:
            past_of[present] = name
    # a cache of fixed capacity (sliding window, static) is filled in place: this module feeds only growing ones
    cached = bool(pasts) and len(past_of) == len(pasts) and not plan.mask_past and not any(p.capacity
                                                                                           for p in plan.past)
    if not cached:
        past_of = {}
    base = relocate(proto, handle)
    session = session_for(proto.SerializeToString(), base)
    return _Decoder(session, plain, ids_name, logits, past_of, plan, cached)


def _sample(logits: np.ndarray, rng: np.random.Generator, vocab: int) -> np.ndarray:
    """One token per row from ``softmax(logits)`` (the Gumbel-max trick), ids below ``vocab`` only."""
    x = logits[:, :vocab] if 0 < vocab < logits.shape[1] else logits
    x = np.where(np.isfinite(x), x, -np.inf)
    return np.argmax(x + rng.gumbel(size=x.shape), axis=1).astype(np.int64)


def sample_windows(handle: Any, specs: list[InputSpec], plan: CachePlan, start: tuple[int, ...], count: int,
                   seq_len: int, seed: int, vocab: int = 0) -> np.ndarray:
    """``count`` windows ``[count, seq_len]`` (int64): ``start`` and then tokens the model samples.

    ``vocab``: the tokenizer's vocabulary (rows of the logits past it, an export's padding, are never
    drawn); 0 for all of them.
    """
    if count <= 0:
        return np.zeros((0, seq_len), np.int64)
    if len(start) >= seq_len:
        raise UsageError(f"a window of {seq_len} tokens leaves no room after the {len(start)} start token(s)")
    dec = decoder(handle, specs, plan)
    rng = np.random.default_rng(seed)
    out = np.zeros((count, seq_len), np.int64)
    t0 = time.perf_counter()
    checked = False
    try:
        for lo in range(0, count, BATCH):
            hi = min(count, lo + BATCH)
            ids = np.empty((hi - lo, seq_len), np.int64)
            ids[:, : len(start)] = np.asarray(start, np.int64)
            if dec.cached:
                logits, past = dec.first(ids[:, : len(start)])
                for t in range(len(start), seq_len):
                    ids[:, t] = _sample(logits, rng, vocab)
                    if t + 1 == seq_len:
                        break
                    logits, past = dec.step(ids[:, t], t + 1, past)
                    if not checked and t + 1 >= min(seq_len - 1, len(start) + 3):
                        checked = True
                        ref = dec.full(ids[:, : t + 1])
                        scale = max(float(np.abs(ref).max()), 1.0)
                        if float(np.abs(ref - logits).max()) > CACHE_TOLERANCE * scale:
                            log.warning("the model's KV cache, fed back one token at a time, disagrees with a "
                                        "full run; its own calibration text is sampled without the cache (slower)")
                            dec.cached = False
                            break
                if not dec.cached:  # start this batch again without the cache
                    rng = np.random.default_rng(seed)
                    return _uncached(dec, out, start, count, seq_len, rng, vocab, t0)
            else:
                _fill_uncached(dec, ids, len(start), rng, vocab)
            out[lo:hi] = ids
            log.info("calibration text written by the model: %d/%d windows of %d tokens (%.0f s)", hi, count,
                     seq_len, time.perf_counter() - t0)
    except (UsageError, QuantizationError):
        raise
    except Exception as exc:  # ORT's own exception types
        raise QuantizationError(f"cannot run the model to write its own calibration text: {one_line(exc)}") from None
    return out


def _fill_uncached(dec: _Decoder, ids: np.ndarray, begin: int, rng: np.random.Generator, vocab: int) -> None:
    for t in range(begin, ids.shape[1]):
        ids[:, t] = _sample(dec.full(ids[:, :t]), rng, vocab)


def _uncached(dec: _Decoder, out: np.ndarray, start: tuple[int, ...], count: int, seq_len: int,
              rng: np.random.Generator, vocab: int, t0: float) -> np.ndarray:
    for lo in range(0, count, BATCH):
        hi = min(count, lo + BATCH)
        ids = np.empty((hi - lo, seq_len), np.int64)
        ids[:, : len(start)] = np.asarray(start, np.int64)
        _fill_uncached(dec, ids, len(start), rng, vocab)
        out[lo:hi] = ids
        log.info("calibration text written by the model: %d/%d windows of %d tokens (%.0f s)", hi, count, seq_len,
                 time.perf_counter() - t0)
    return out


__all__ = ["BATCH", "sample_windows"]
