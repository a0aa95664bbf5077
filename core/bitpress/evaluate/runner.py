"""Run QUANTIZED and its float reference on the same inputs and measure what quantization cost."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bitpress import hub
from bitpress.calibration.data import DataConfig
from bitpress.errors import BitpressError, ModelLoadError, UsageError
from bitpress.evaluate.feeds import (
    check_same_signature,
    data_feeds,
    find_tokenizer,
    is_past,
    output_names,
    resolve_model,
    text_feeds,
    token_windows,
    tokenize,
    vocab_size,
)
from bitpress.evaluate.metrics import OutputAccumulator, looks_like_logits, next_token_nll
from bitpress.evaluate.result import EvalError, EvalResult, ModelMismatchError, PerplexityResult
from bitpress.evaluate.weights import tensor_errors
from bitpress.genai.kvcache import kv_hints
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.inputs import input_specs
from bitpress.onnx.kernels import graph_paths

log = logging.getLogger(__name__)

Progress = Callable[..., Any]


def evaluate(
    quantized: str | Path,
    reference: str | Path,
    *,
    data: Any = None,
    samples: int = 8,
    seq_len: int = 128,
    batch: int = 1,
    seed: int = 0,
    text: str | Path | None = None,
    tokenizer: str | Path | None = None,
    max_windows: int | None = None,
    jobs: int | None = None,
    weights: bool = True,
    progress: Any = None,
    threads: int | None = None,
    speed: bool = True,
    speed_runs: int = 3,
    subfolder: str | None = None,
) -> EvalResult:
    """Compare ``quantized`` with its float ``reference`` (.onnx files or GenAI folders) in ONNX Runtime.

    ``quantized``, ``reference`` and ``tokenizer`` may be Hugging Face Hub ids ``org/name[@revision]``
    (strings that are not local paths; see :mod:`bitpress.hub`), resolved from the Hub cache (offline) or
    downloaded into it; ``subfolder`` (``--subfolder``) is the model's folder inside each Hub id given.
    The commits compared are in ``EvalResult.sources`` and its notes.

    ``data``: the inputs of the output comparison (``None``: random; a .npz file/folder; a .txt
    with a tokenizer; a :class:`bitpress.calibration.data.DataConfig` or mapping), ``samples`` runs of
    ``batch`` x ``seq_len``. ``text``: a text file for the perplexity of both models (windows of
    ``seq_len`` tokens, at most ``max_windows``; tokenizer.json beside a model or ``tokenizer``);
    without ``data`` the outputs are compared on those windows too. ``weights``: also the SQNR of
    every quantized weight against the reference's. ``jobs``: ONNX Runtime intra-op threads
    (default 1; ``threads`` is its old name, still accepted). ``speed``: also time both models
    alternately (``speed_runs`` rounds after a warm-up; GenAI packages by ``onnxruntime_genai``: prompt
    and decode tokens/s; .onnx files by a session: one token and a prompt-sized batch), see
    :func:`bitpress.speed.compare`. ``EvalResult.to_json()`` / ``write_html(path)`` give the reports.
    """
    if jobs is not None and threads is not None and jobs != threads:
        raise UsageError(f"give jobs= or its old name threads=, not both (jobs={jobs}, threads={threads})")
    threads = jobs if jobs is not None else (threads if threads is not None else 1)
    start = time.perf_counter()
    for name, value, low in (("samples", samples, 1), ("seq_len", seq_len, 1), ("batch", batch, 1),
                             ("threads", threads, 1), ("max_windows", max_windows, 1), ("speed_runs", speed_runs, 1)):
        if value is not None and (not isinstance(value, int) or value < low):
            raise UsageError(f"{name} must be an integer >= {low}, got {value!r}")
    quantized, reference, tokenizer, sources = resolve_inputs(quantized, reference, tokenizer, subfolder)
    # absolute (not resolved): names inside a folder are joined to it once, whatever the cwd
    qf = resolve_model(Path(quantized).absolute(), "QUANTIZED")
    rf = resolve_model(Path(reference).absolute(), "reference")
    qm, rm = OnnxModel.load(qf.path), OnnxModel.load(rf.path)
    try:
        check_same_signature(qm.proto, rm.proto)
        hints = {**kv_hints(rf.genai), **kv_hints(qf.genai)}
        past = [s.name for s in input_specs(rm.proto) if is_past(s)]
        names = output_names(rm.proto)
        vocab, q_vocab = vocab_size(rm.proto), vocab_size(qm.proto)
        if vocab and q_vocab and vocab != q_vocab:
            raise ModelMismatchError(
                f"the models have different vocabularies: QUANTIZED embeds {q_vocab} tokens, the reference {vocab}"
            )
        vocab = vocab or q_vocab
        q_sess = _session(qf.path, threads, "QUANTIZED")
        r_sess = _session(rf.path, threads, "reference")
        result = EvalResult(qf.path, rf.path, "", 0, batch, seq_len, threads)
        result.sources = {key: model.record() for key, model in sources.items()}
        result.notes += [f"{key}: {hub.describe(model)}" for key, model in sources.items()]
        result.quantized_bytes, result.reference_bytes = model_bytes(qm), model_bytes(rm)
        result.bits_per_weight = bits_per_weight(qm)
        result.quantization = recorded_passes(qm)
        result.runtime = graph_paths(qm.graph).to_json()
        if past:
            from bitpress.evaluate.feeds import cache_note

            result.notes.append(cache_note(rm.proto, hints) or "")
        accs = [OutputAccumulator(n, False) for n in names]
        ppl_windows: np.ndarray | None = None
        text_path = Path(text) if text is not None else None
        if text_path is not None:
            tok = find_tokenizer(tokenizer, [qf.root, qf.path.parent, rf.root, rf.path.parent])
            ppl_windows = token_windows(tokenize(text_path, tok), seq_len, max_windows)
            if vocab is not None and int(ppl_windows.max()) >= vocab:
                raise UsageError(
                    f"{tok} gives token ids up to {int(ppl_windows.max())} but the model's vocabulary has {vocab} "
                    "rows; pass the model's own tokenizer"
                )
        if data is None and ppl_windows is not None:
            # real text beats random inputs: compare the outputs on the perplexity windows, in the same runs
            result.data = f"{ppl_windows.shape[0]} window(s) of {ppl_windows.shape[1]} tokens of {text_path}"
            result.perplexity = _text_pass(
                rm, q_sess, r_sess, names, accs, ppl_windows, batch, hints, vocab, progress, str(text_path)
            )
            result.samples = -(-ppl_windows.shape[0] // batch)
        else:
            config = _data_config(data, samples, seq_len, batch, tokenizer, seed)
            if config.source == "random":
                result.data = f"random inputs (seed {config.seed}, {config.seq_len} tokens)"
                result.notes.append(
                    "random inputs show how far the outputs move, not how quality changes: pass --text (perplexity) "
                    "or --data with real inputs"
                )
            else:
                result.data = str(config.source)
            model_dir = next((f for f in (qf.root, rf.root) if (f / "tokenizer.json").is_file()), rf.root)
            feeds = data_feeds(rm.proto, config, model_dir, hints)
            result.samples = len(feeds)
            first = True
            with _step(progress, len(feeds), "comparing outputs") as advance:
                for feed in feeds:
                    ref = _run(r_sess, names, feed, "reference")
                    qnt = _run(q_sess, names, feed, "QUANTIZED")
                    _accumulate(accs, ref, qnt, vocab, first)
                    first = False
                    advance(1)
            if ppl_windows is not None:
                result.perplexity = _text_pass(
                    rm, q_sess, r_sess, names, None, ppl_windows, batch, hints, vocab, progress, str(text_path)
                )
        result.outputs = [a.result() for a in accs]
        result.weights_compared = weights
        if weights:
            n_nodes = sum(1 for n in qm.graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized",
                                                                  "MatMulBnb4"))
            with _step(progress, n_nodes, "weight error") as advance:
                result.tensors = tensor_errors(qm, rm, advance)
        if speed:
            del q_sess, r_sess  # the speed workers load the models in processes of their own
            try:
                result.speed = _speed(quantized, reference, threads, speed_runs, seq_len, progress)
            except BitpressError as exc:  # the comparison stands without it
                result.notes.append(f"speed not measured: {exc}")
            else:
                if result.speed.get("note"):
                    result.notes.append(result.speed["note"])
        result.seconds = time.perf_counter() - start
        _log_summary(result)
        return result
    finally:
        qm.close()
        rm.close()


def resolve_inputs(
    quantized: str | Path, reference: str | Path, tokenizer: str | Path | None = None, subfolder: str | None = None,
) -> tuple[str | Path, str | Path, str | Path | None, dict[str, hub.HubModel]]:
    """The models and tokenizer :func:`evaluate` reads, Hub ids made the local folders they resolve to
    (a local path always wins; ``subfolder`` applies to the models' Hub ids), and the Hub ones by role
    (``quantized``, ``reference``, ``tokenizer``). Without a tokenizer, a Hub model whose subfolder has none
    reads the one at its repo's root."""
    sources: dict[str, hub.HubModel] = {}
    out: list[str | Path | None] = []
    for key, value, kind in (("quantized", quantized, None), ("reference", reference, None),
                             ("tokenizer", tokenizer, "tokenizer")):
        if value is None or hub.hub_id(value) is None:
            out.append(value)
            continue
        path, found = hub.resolve(value, subfolder=subfolder if kind is None else None, what=key, kind=kind)
        assert found is not None
        sources[key] = found
        out.append(found.tokenizer_dir or path if kind == "tokenizer" else path)
    q, r, tok = out
    if tok is None:
        tok = next((m.tokenizer_dir for m in sources.values() if m.tokenizer_dir not in (None, m.path)), None)
    assert q is not None and r is not None
    return q, r, tok, sources


def _speed(quantized: str | Path, reference: str | Path, threads: int, runs: int, seq_len: int,
           progress: Progress | None) -> dict[str, Any]:
    """Both models timed alternately: GenAI packages by ``onnxruntime_genai``, .onnx files by a session."""
    from bitpress.speed import compare

    with _step(progress, 2 * (runs + 1), "speed") as advance:
        def say(text: str) -> None:
            if text.startswith("round"):
                advance(2)

        return compare(quantized, reference, threads=threads, runs=runs, prompt_tokens=min(seq_len, 128),
                       progress=say)


def model_bytes(model: OnnxModel) -> int:
    """Bytes on disk of ``model``: its .onnx file and every external data file it reads (once)."""
    from bitpress.onnx.tensors import is_external, iter_tensors

    files = {model.source.resolve()}
    for t in iter_tensors(model.proto):
        if is_external(t):
            try:
                files.add(model.resolver.path(t)[0].resolve())
            except (ModelLoadError, OSError, ValueError):
                continue
    return sum(f.stat().st_size for f in files if f.is_file())


_QUANTIZED_INPUTS = {"MatMulNBits": (1, 2, 3), "MatMulBnb4": (1, 2), "GatherBlockQuantized": (0, 2, 3)}


def bits_per_weight(model: OnnxModel) -> float | None:
    """8 x bytes of the quantized weights (integers, scales, zero points) / weights they hold.

    Weights are counted from the nodes' attributes (``K`` x ``N``; a ``GatherBlockQuantized``
    table from its data's shape and ``bits``); a tensor read by several nodes (a tied table)
    counts once. ``None`` without quantized nodes.
    """
    from onnx import helper

    from bitpress.onnx.tensors import tensor_nbytes

    inits = {t.name: t for t in model.graph.initializer}
    counted: set[str] = set()
    weights = stored = 0
    for node in model.graph.node:
        slots = _QUANTIZED_INPUTS.get(node.op_type)
        if slots is None or node.domain != "com.microsoft":
            continue
        data = node.input[slots[0]] if len(node.input) > slots[0] else ""
        if data in counted or data not in inits:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "GatherBlockQuantized":
            dims = list(inits[data].dims)
            bits = int(attrs.get("bits", 4))
            per_byte = 8 // bits if inits[data].data_type == onnx.TensorProto.UINT8 else 1
            n = math.prod(dims) * per_byte if dims else 0
        else:
            n = int(attrs.get("K", 0)) * int(attrs.get("N", 0))
        if not n:
            continue
        weights += n
        for i in slots:
            name = node.input[i] if len(node.input) > i else ""
            if name and name in inits and name not in counted:
                counted.add(name)
                stored += tensor_nbytes(inits[name])
    return 8 * stored / weights if weights else None


def recorded_passes(model: OnnxModel) -> list[dict[str, Any]] | None:
    """The passes recorded in the model's ``bitpress`` metadata (see :func:`bitpress.workflow.runner.record_pass`)."""
    import json

    from bitpress.workflow.runner import METADATA_KEY

    for prop in model.proto.metadata_props:
        if prop.key == METADATA_KEY:
            try:
                passes = json.loads(prop.value).get("passes")
            except (ValueError, AttributeError):
                return None
            return [p for p in passes if isinstance(p, dict)] if isinstance(passes, list) else None
    return None


def _data_config(
    data: Any, samples: int, seq_len: int, batch: int, tokenizer: str | Path | None, seed: int
) -> DataConfig:
    defaults = {"samples": samples, "seq_len": seq_len, "batch": batch,
                "tokenizer": str(tokenizer) if tokenizer else None, "seed": seed}
    if data is None:
        return DataConfig.from_value({**defaults, "source": "random"})
    if isinstance(data, str | Path):
        return DataConfig.from_value({**defaults, "source": str(data)})
    if isinstance(data, dict):
        return DataConfig.from_value({**defaults, **data})
    return DataConfig.from_value(data)


def _text_pass(
    rm: OnnxModel, q_sess: Any, r_sess: Any, names: list[str], accs: list[OutputAccumulator] | None,
    windows: np.ndarray, batch: int, hints: dict[str, int], vocab: int | None, progress: Progress | None,
    text: str,
) -> PerplexityResult:
    """Perplexity of both models on ``windows``; with ``accs``, the outputs are compared too."""
    logits_idx = _logits_index(names, vocab)
    nll_r = nll_q = 0.0
    count = 0
    first = True
    with _step(progress, -(-len(windows) // batch), "perplexity") as advance:
        for ids, feed in text_feeds(rm.proto, windows, batch, hints):
            ref = _run(r_sess, names, feed, "reference")
            qnt = _run(q_sess, names, feed, "QUANTIZED")
            if accs is not None:
                _accumulate(accs, ref, qnt, vocab, first)
                first = False
            a, n = next_token_nll(ref[logits_idx], ids)
            b, _ = next_token_nll(qnt[logits_idx], ids)
            nll_r, nll_q, count = nll_r + a, nll_q + b, count + n
            advance(1)
    return PerplexityResult(text, len(windows), int(windows.shape[1]), count,
                            _exp(nll_r / count), _exp(nll_q / count))


def _accumulate(
    accs: list[OutputAccumulator], ref: list[np.ndarray], qnt: list[np.ndarray], vocab: int | None, first: bool
) -> None:
    """Add one batch of both models' outputs; the first batch tells which output holds logits."""
    if first:
        for acc, arr in zip(accs, ref, strict=True):
            acc.is_logits = looks_like_logits(acc.name, arr.shape, vocab)
    for acc, r, q in zip(accs, ref, qnt, strict=True):
        acc.add(r, q)


def _exp(x: float) -> float:
    return math.exp(x) if x < 709 else math.inf  # exp overflows float64 past ~709


def _logits_index(names: list[str], vocab: int | None) -> int:
    for i, n in enumerate(names):
        if n == "logits":
            return i
    for i, n in enumerate(names):
        if "logits" in n.lower():
            return i
    non_cache = [i for i, n in enumerate(names) if not n.lower().startswith("present")]
    if len(non_cache) == 1:
        return non_cache[0]
    raise UsageError(f"perplexity needs a 'logits' output; the model gives {', '.join(names)}")


def _session(path: Path, threads: int, what: str) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 4  # failures become one-line errors; ORT's own log would repeat them
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own pybind exception types
        raise ModelLoadError(f"ONNX Runtime cannot load the {what} model {path}: {_first_line(exc)}") from None


def _run(sess: Any, names: list[str], feed: dict[str, np.ndarray], what: str) -> list[np.ndarray]:
    try:
        return sess.run(names, feed)
    except Exception as exc:  # ORT raises its own pybind exception types
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in feed.items())
        raise EvalError(f"ONNX Runtime failed to run the {what} model on inputs {shapes}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


@contextmanager
def _step(progress: Progress | None, total: int, desc: str) -> Iterator[Callable[[int], Any]]:
    """A progress counter like PassContext.step: ``advance(n)``; nothing shown without ``progress``."""
    bar = progress(None, total=total, desc=desc) if progress is not None and total else None
    try:
        yield getattr(bar, "update", None) or (lambda n=1: None)
    finally:
        close = getattr(bar, "close", None)
        if close is not None:
            close()


def _log_summary(result: EvalResult) -> None:
    logits = result.logits()
    if logits is not None:
        log.info("logits: rel L2 %.4g, cosine %.6f, top-1 %s", logits.relative_l2, logits.cosine,
                 logits.top1_agreement)
    if result.perplexity is not None:
        p = result.perplexity
        log.info("perplexity: reference %.4f, quantized %.4f (%+.2f%%)", p.reference, p.quantized,
                 100 * p.relative_change)
    summary = result.sqnr_summary()
    if summary:
        log.info("weights: %d tensors, lowest SQNR %.1f dB (%s)", summary["tensors"], summary["min_db"],
                 summary["worst"])


run_evaluation = evaluate  # its former name

__all__ = ["evaluate", "run_evaluation"]
