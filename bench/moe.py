"""A small mixture-of-experts decoder in each of its forms: ONNX Runtime's MoE / QMoE nodes against the per-expert
MatMul loop, float and quantized by bitpress's RTN pass: size, output error and speed, in one run.

Writes ``docs/moe-bench.md`` (``make -C bench moe``; the project's venv runs it, about 3 minutes on 2 cores)::

    .venv/bin/python bench/moe.py                  # build, quantize, measure, write the page
    .venv/bin/python bench/moe.py --threads 1      # one thread count only (faster)

The model (numpy, seeded, float32; issue 31): ``input_ids [1, seq]`` -> Gather embedding (vocab 4096, hidden
512) -> 4 layers of ``x = x + MoE(LayerNorm(x))`` -> LayerNorm -> LM head MatMul ``[512, 4096]`` -> ``logits``.
Each MoE block: a router MatMul ``[512, 8]`` whose logits feed ``com.microsoft.MoE`` (8 experts, top-2, SwiGLU
with ``swiglu_fusion=1``, intermediate 1024, renormalized routing weights), between Reshapes to ``[tokens,
hidden]``. The same weights are also written as the per-expert loop a converter emits without the fused op (the
"dense" form, as mobius 0.1.0 writes it): per expert gate / up / down MatMuls, every expert computed for every
token, weighted by ``ReduceSum(w * Cast(Equal(topk_index, e)))`` of the renormalized top-k and summed.

Rows: each of the two forms float, and quantized by ``bitpress.run`` with ``{"type": "rtn", "bits": 4 / 8}`` (the
MoE form also with ``accuracy_level`` 0 and with ``quantize_router``; the loop form also fused by ``fuse_experts``
first); which op each output holds (``QMoE``, float ``MoE``,
``MatMulNBits``...) is read from the file, not assumed. Output error: relative Frobenius norm of the logits
against the float MoE form on a fixed random prompt; speed: one ``bitpress.speed.bench`` call measuring all
models alternately, each in a process of its own (one token: decode tokens/s = 1 / latency; a prompt-sized
batch: prompt tokens/s), ratios to the float MoE form. Then int4 of one part of the model at a time (experts,
routers, embedding, LM head) says where the error comes from.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import benchkit
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORK = BENCH / ".work" / "moe"
DOC = ROOT / "docs" / "moe-bench.md"
PY = ROOT / ".venv" / "bin" / "python"

VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K, INTER = 4096, 512, 4, 8, 2, 1024
SEED = 0
ROUTER_SCALE = 4.0  # the routers' logits' standard deviation (see make_weights)
EVAL_TOKENS = 64  # the prompt the output error is measured on
PROMPT_TOKENS = 128  # bitpress.speed's prompt-sized batch
OPSET = 21


# -- the model ----------------------------------------------------------------------------------------------
@dataclass
class Weights:
    """Every weight of the model, in ONNX Runtime MoE's layout (fc1 rows interleaved gate0, up0, gate1, ...)."""

    embed: np.ndarray  # [vocab, hidden]
    norms: list[tuple[np.ndarray, np.ndarray]]  # per layer, then the final norm: (scale, bias)
    router: list[np.ndarray]  # [hidden, experts]
    fc1: list[np.ndarray]  # [experts, 2 * inter, hidden]
    fc2: list[np.ndarray]  # [experts, hidden, inter]
    head: np.ndarray  # [hidden, vocab]


def make_weights(seed: int = SEED) -> Weights:
    """Normal weights scaled by 1/sqrt(fan_in), so that activations stay of order one through the layers."""
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    embed = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    norms = [((1.0 + 0.05 * rng.standard_normal(HIDDEN)).astype(np.float32),
              (0.02 * rng.standard_normal(HIDDEN)).astype(np.float32)) for _ in range(LAYERS + 1)]
    # scaled so that the router's logits are as decided as a trained router's (std ~ROUTER_SCALE): random routers
    # of std 1 leave the 2nd and 3rd choices of most tokens a rounding error apart
    router = [normal((HIDDEN, EXPERTS), HIDDEN) * ROUTER_SCALE for _ in range(LAYERS)]
    fc1 = [normal((EXPERTS, 2 * INTER, HIDDEN), HIDDEN) for _ in range(LAYERS)]
    fc2 = [normal((EXPERTS, HIDDEN, INTER), INTER) for _ in range(LAYERS)]
    return Weights(embed, norms, router, fc1, fc2, normal((HIDDEN, VOCAB), HIDDEN))


class _Graph:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = Counter[str]()

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], name: str, outputs: int = 1, domain: str = "",
           **attrs: Any) -> Any:
        outs = [f"{name}/output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, domain=domain or None, **attrs))
        return outs[0] if outputs == 1 else outs


def _moe_fused(g: _Graph, w: Weights, layer: int, h2: str, logits: str, scope: str) -> str:
    fc1 = g.init(f"model.layers.{layer}.moe.fc1_experts_weights", w.fc1[layer])
    fc2 = g.init(f"model.layers.{layer}.moe.fc2_experts_weights", w.fc2[layer])
    return g.op("MoE", [h2, logits, fc1, "", fc2], f"{scope}/MoE", domain="com.microsoft", k=TOP_K,
                activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                normalize_routing_weights=1)


def _moe_loop(g: _Graph, w: Weights, layer: int, h2: str, logits: str, scope: str) -> str:
    """The per-expert loop as mobius 0.1.0 writes it: Softmax -> TopK -> renormalize; every expert's gate / up /
    down MatMuls on every token, weighted by ``ReduceSum(w * Cast(Equal(topk_index, e)))`` and summed."""
    probs = g.op("Softmax", [logits], f"{scope}/router/Softmax", axis=-1)
    top, idx = g.op("TopK", [probs, g.init(f"{scope}/k", np.array([TOP_K], np.int64))], f"{scope}/router/TopK",
                    outputs=2, axis=-1)
    axes = g.init(f"{scope}/axes", np.array([-1], np.int64))
    total = g.op("ReduceSum", [top, axes], f"{scope}/router/ReduceSum", keepdims=1)
    top = g.op("Div", [top, total], f"{scope}/router/Div")
    acc = None
    for e in range(EXPERTS):
        pre, es = f"model.layers.{layer}.moe.experts.{e}", f"{scope}/experts.{e}"
        fc1 = w.fc1[layer][e]
        gate_w = g.init(f"{pre}.gate_proj.weight", fc1[0::2].T)  # [hidden, inter]: as MatMul's B
        up_w = g.init(f"{pre}.up_proj.weight", fc1[1::2].T)
        down_w = g.init(f"{pre}.down_proj.weight", w.fc2[layer][e].T)  # [inter, hidden]
        gate = g.op("MatMul", [h2, gate_w], f"{es}/gate_proj/MatMul")
        up = g.op("MatMul", [h2, up_w], f"{es}/up_proj/MatMul")
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{es}/act/Sigmoid")], f"{es}/act/Mul")
        down = g.op("MatMul", [g.op("Mul", [act, up], f"{es}/Mul"), down_w], f"{es}/down_proj/MatMul")
        hit = g.op("Cast", [g.op("Equal", [idx, g.init(f"{es}/index", np.array(e, np.int64))], f"{es}/Equal")],
                   f"{es}/Cast", to=onnx.TensorProto.FLOAT)
        col = g.op("ReduceSum", [g.op("Mul", [top, hit], f"{es}/mask/Mul"), axes], f"{es}/ReduceSum", keepdims=1)
        y = g.op("Mul", [down, col], f"{es}/weighted/Mul")
        acc = y if acc is None else g.op("Add", [acc, y], f"{es}/Add")
    assert acc is not None
    return acc


def build(path: Path, w: Weights, form: str) -> Path:
    """The model with its MoE blocks as ``form``: "moe" (com.microsoft.MoE) or "loop" (per-expert MatMuls)."""
    g = _Graph()
    embed = g.init("model.embed_tokens.weight", w.embed)
    x = g.op("Gather", [embed, "input_ids"], "/model/embed_tokens/Gather", axis=0)
    shape = g.op("Shape", [x], "/model/Shape")
    flat = g.init("/model/flat_shape", np.array([-1, HIDDEN], np.int64))
    block = _moe_fused if form == "moe" else _moe_loop

    def norm(x: str, i: int, scope: str) -> str:
        scale = g.init(f"{scope.strip('/').replace('/', '.')}.weight", w.norms[i][0])
        bias = g.init(f"{scope.strip('/').replace('/', '.')}.bias", w.norms[i][1])
        return g.op("LayerNormalization", [x, scale, bias], f"{scope}/LayerNormalization", axis=-1, epsilon=1e-5)

    for layer in range(LAYERS):
        scope = f"/model/layers.{layer}/moe"
        h = norm(x, layer, f"/model/layers.{layer}/post_attention_layernorm")
        h2 = g.op("Reshape", [h, flat], f"{scope}/Reshape")
        router = g.init(f"model.layers.{layer}.moe.router.weight", w.router[layer])
        logits = g.op("MatMul", [h2, router], f"{scope}/router/MatMul")
        y2 = block(g, w, layer, h2, logits, scope)
        y = g.op("Reshape", [y2, shape], f"{scope}/Reshape_out")
        x = g.op("Add", [x, y], f"/model/layers.{layer}/residual/Add")
    x = norm(x, LAYERS, "/model/norm")
    head = g.init("lm_head.weight", w.head)
    g.nodes.append(helper.make_node("MatMul", [x, head], ["logits"], name="/lm_head/MatMul"))
    graph = helper.make_graph(
        g.nodes, f"moe-{form}",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", VOCAB])],
        initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                     helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10, producer_name="bench/moe.py")
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def reference_logits(w: Weights, ids: np.ndarray) -> np.ndarray:
    """The model in numpy (float64), by the MoE op's documented semantics: what both graphs must compute."""
    def layer_norm(x: np.ndarray, i: int) -> np.ndarray:
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w.norms[i][0] + w.norms[i][1]

    x = w.embed[ids.reshape(-1)].astype(np.float64)
    for layer in range(LAYERS):
        h = layer_norm(x, layer)
        logits = h @ w.router[layer]
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1)[:, :TOP_K]
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            weights = p[t, top[t]] / p[t, top[t]].sum()
            for e, wt in zip(top[t], weights, strict=True):
                f = w.fc1[layer][e] @ h[t]
                gate, lin = f[0::2], f[1::2]
                out[t] += wt * (w.fc2[layer][e] @ (gate / (1 + np.exp(-gate)) * lin))
        x = x + out
    return (layer_norm(x, LAYERS) @ w.head).reshape(*ids.shape, VOCAB)


# -- the rows ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Form:
    key: str
    label: str
    source: str  # "moe" or "loop"
    rtn: dict[str, Any] | None = None  # the rtn pass's options; None: the float model itself
    fuse: bool = False  # the fuse_experts pass first (loops over experts -> MoE nodes)


ROUTERS = "re:.*/router/MatMul"  # the loop form's routers (the MoE form's stay float by default: quantize_router)

FORMS = [
    Form("moe-f32", "MoE op, float32", "moe"),
    Form("moe-rtn4", "MoE model, bitpress rtn int4 b32", "moe", {"bits": 4, "block_size": 32}),
    Form("moe-rtn4-acc0", "MoE model, bitpress rtn int4 b32, accuracy_level 0", "moe",
         {"bits": 4, "block_size": 32, "accuracy_level": 0}),
    Form("moe-rtn4-router-q", "MoE model, bitpress rtn int4 b32, quantize_router", "moe",
         {"bits": 4, "block_size": 32, "quantize_router": True}),
    Form("moe-rtn8", "MoE model, bitpress rtn int8 b32", "moe", {"bits": 8, "block_size": 32}),
    Form("loop-f32", "per-expert MatMul loop, float32", "loop"),
    Form("loop-rtn4", "per-expert loop, bitpress rtn int4 b32 (MatMulNBits)", "loop",
         {"bits": 4, "block_size": 32, "nodes_to_exclude": [ROUTERS]}),
    Form("loop-fused-rtn4", "per-expert loop, fuse_experts + bitpress rtn int4 b32", "loop",
         {"bits": 4, "block_size": 32}, fuse=True),
    Form("loop-rtn8", "per-expert loop, bitpress rtn int8 b32 (MatMulNBits)", "loop",
         {"bits": 8, "block_size": 32, "nodes_to_exclude": [ROUTERS]}),
]


@dataclass
class Row:
    key: str
    label: str
    path: str
    options: dict[str, Any] | None
    bytes: int
    ops: str  # what the graph holds: the quantized and the MoE ops, with their settings
    moe_op: str  # the MoE blocks' op: "MoE (float)", "QMoE (int4 ...)", "MatMul loop", "MatMulNBits loop (...)"
    quantize_s: float | None
    rel_error: float | None = None
    top1: float | None = None
    max_abs_vs_moe: float | None = None
    #: relative Frobenius distance to the other form's row of the same options (QMoE against the MatMulNBits loop)
    vs_twin: float | None = None
    failed: str | None = None  # why the row has no figures (the pass or ONNX Runtime refused it)
    speed: dict[int, dict[str, float]] = field(default_factory=dict)  # threads -> figures


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def describe(path: Path) -> tuple[str, str]:
    """(every op of interest with its count and settings, the MoE blocks' form), read from the file."""
    graph = onnx.load(str(path), load_external_data=False).graph
    groups: Counter[str] = Counter()
    for n in graph.node:
        a = _attrs(n)
        if n.op_type == "QMoE":
            bits = a.get("expert_weight_bits", "?")
            extra = "".join(f", {k} {a[k]}" for k in ("block_size", "accuracy_level") if k in a)
            groups[f"QMoE (int{bits}{extra})"] += 1
        elif n.op_type == "MoE":
            groups["MoE (float)"] += 1
        elif n.op_type == "MatMulNBits":
            groups[f"MatMulNBits (int{a.get('bits', 4)}, b{a.get('block_size')}, "
                   f"level {a.get('accuracy_level', 0)})"] += 1
        elif n.op_type in ("MatMul", "GatherBlockQuantized", "Gather", "DequantizeLinear", "MatMulInteger",
                           "DynamicQuantizeMatMul", "Gemm"):
            groups[n.op_type] += 1
    ops = ", ".join(f"{c} {k}" for k, c in groups.items())
    moe = [k for k in groups if k.startswith(("QMoE", "MoE"))]
    if moe:
        return ops, " + ".join(moe)
    experts = [n for n in graph.node if "/experts." in n.name]
    kinds = Counter(n.op_type for n in experts if n.op_type in ("MatMul", "MatMulNBits"))
    if kinds.get("MatMulNBits") and not kinds.get("MatMul"):
        a = _attrs(next(n for n in experts if n.op_type == "MatMulNBits"))
        return ops, f"MatMulNBits loop (int{a.get('bits', 4)}, level {a.get('accuracy_level', 0)})"
    return ops, "MatMul loop (float)" if not kinds.get("MatMulNBits") else "mixed MatMul / MatMulNBits loop"


def quantize(src: Path, out_dir: Path, options: dict[str, Any], fuse: bool = False) -> tuple[Path, float]:
    import bitpress

    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    out = out_dir / "model.onnx"
    t0 = time.perf_counter()
    passes = [{"type": "fuse_experts"}] if fuse else []
    bitpress.run({"input": str(src), "output": str(out), "passes": [*passes, {"type": "rtn", **options}]})
    return benchkit.find_onnx(out), time.perf_counter() - t0


#: (what stays quantized, nodes_to_exclude): the int4 error of one part of the model at a time, on the loop form
PARTS = [
    ("the 96 expert MatMuls", ["re:.*/router/.*", "/model/embed_tokens/Gather", "/lm_head/MatMul"]),
    ("the 4 routers", ["re:.*/experts\\..*", "/model/embed_tokens/Gather", "/lm_head/MatMul"]),
    ("the embedding", ["re:.*/router/.*", "re:.*/experts\\..*", "/lm_head/MatMul"]),
    ("the LM head", ["re:.*/router/.*", "re:.*/experts\\..*", "/model/embed_tokens/Gather"]),
]


def error_breakdown(src: Path, feeds: dict[str, np.ndarray], ref: np.ndarray, progress: benchkit.Progress
                    ) -> list[dict[str, Any]]:
    """rtn int4 b32 of one part of the loop form at a time (the rest float): where the error comes from."""
    out = []
    for part, exclude in PARTS:
        try:
            path, _ = quantize(src, WORK / "breakdown", {"bits": 4, "block_size": 32, "nodes_to_exclude": exclude})
            ops = describe(path)[0]
            m = benchkit.logits_metrics(ref, benchkit.run_logits(path, feeds))
            out.append({"part": part, "ops": ops, "rel_error": m["logits_rel_l2"], "top1": m["top1_agreement"]})
        except Exception as exc:  # the row says why
            out.append({"part": part, "ops": f"failed: {_why(exc)}", "rel_error": None, "top1": None})
        progress(f"error of int4 {part} alone: {out[-1]['rel_error']}")
    shutil.rmtree(WORK / "breakdown", ignore_errors=True)
    return out


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def accepts_accuracy_level() -> bool:
    from bitpress.onnx.weightonly.planning import WeightOnlyOptions

    return "accuracy_level" in WeightOnlyOptions.__dataclass_fields__


# -- the run ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchkit.doc_arguments(ap, DOC)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to time (default 1 2)")
    ap.add_argument("--runs", type=int, default=10, help="measured rounds per thread count (median)")
    args = ap.parse_args(argv)
    progress = benchkit.Progress("moe")
    import onnxruntime as ort

    import bitpress.speed

    WORK.mkdir(parents=True, exist_ok=True)
    weights = make_weights()
    sources = {}
    for form in ("moe", "loop"):
        progress(f"building the {form} form")
        sources[form] = build(WORK / f"{form}-f32" / "model.onnx", weights, form)

    rng = np.random.default_rng(SEED + 1)
    ids = rng.integers(0, VOCAB, size=(1, EVAL_TOKENS)).astype(np.int64)
    feeds = {"input_ids": ids}
    numpy_ref = reference_logits(weights, ids)

    forms = [f for f in FORMS if not (f.rtn and "accuracy_level" in f.rtn and not accepts_accuracy_level())]
    rows: list[Row] = []
    for f in forms:
        if f.rtn is None:
            path, secs = sources[f.source], None
        else:
            progress(f"quantizing: {f.label}")
            try:
                path, secs = quantize(sources[f.source], WORK / f.key, f.rtn, f.fuse)
            except Exception as exc:  # the row says why; the others are still measured
                rows.append(Row(f.key, f.label, "", f.rtn, 0, "-", "-", None, failed=_why(exc)))
                progress(f"{f.key}: the rtn pass failed: {rows[-1].failed}")
                continue
        ops, moe_op = describe(path)
        rows.append(Row(f.key, f.label, str(path), f.rtn, benchkit.model_size(path), ops, moe_op, secs))
        progress(f"{f.key}: {benchkit.fmt_bytes(rows[-1].bytes)}; {ops}")

    progress(f"output error on {EVAL_TOKENS} tokens")
    outs = {}
    for r in rows:
        if r.failed:
            continue
        try:
            outs[r.key] = benchkit.run_logits(Path(r.path), feeds)
        except Exception as exc:  # ONNX Runtime refused the file: the row says so
            r.failed = f"ONNX Runtime: {_why(exc)}"
            progress(f"{r.key}: {r.failed}")
    ref = outs["moe-f32"]
    checks = {
        "moe_vs_numpy": float(np.abs(ref - numpy_ref).max()),
        "loop_vs_numpy": float(np.abs(outs["loop-f32"] - numpy_ref).max()),
        "loop_vs_moe": float(np.abs(outs["loop-f32"] - ref).max()),
        "logits_abs_max": float(np.abs(ref).max()),
        "logits_rms": float(np.sqrt(np.mean(ref.astype(np.float64) ** 2))),
    }
    tol = 1e-3 * max(1.0, checks["logits_abs_max"])
    for key in ("moe_vs_numpy", "loop_vs_numpy", "loop_vs_moe"):
        if checks[key] > tol:
            raise SystemExit(f"moe.py: the float forms disagree: {key} max |diff| {checks[key]:.3g} > {tol:.3g}")
    progress("float forms agree: " + ", ".join(f"{k} {v:.3g}" for k, v in checks.items()))
    measured = [r for r in rows if not r.failed]
    for r in measured:
        m = benchkit.logits_metrics(ref, outs[r.key])
        r.rel_error, r.top1 = m["logits_rel_l2"], m["top1_agreement"]
        r.max_abs_vs_moe = float(np.abs(outs[r.key] - ref).max())
        twin = ("loop" + r.key[3:]) if r.key.startswith("moe") else ("moe" + r.key[4:].replace("-fused", ""))
        if twin in outs:
            r.vs_twin = benchkit.logits_metrics(outs[twin], outs[r.key])["logits_rel_l2"]
    breakdown = error_breakdown(sources["loop"], feeds, ref, progress)

    progress(f"speed: {len(measured)} models alternately, threads {args.threads}, {args.runs} rounds")
    report = bitpress.speed.bench([Path(r.path) for r in measured], labels=[r.key for r in measured],
                                  threads=args.threads, runs=args.runs, prompt_tokens=PROMPT_TOKENS, decode_tokens=1,
                                  progress=lambda s: progress(f"  {s}"))
    for line in bitpress.speed.lines(report):
        print(line)
    for r in measured:
        for t in args.threads:
            fig = report.get(r.key, t)
            assert fig is not None
            r.speed[t] = {"decode_tok_s": fig.token_per_s, "prompt_tok_s": fig.prompt_tokens_per_s,
                          "decode_x": fig.ratios["single"], "prompt_x": fig.ratios["prompt"],
                          "single_ms": fig.single_ms, "spread": max(fig.prompt_spread, fig.token_spread),
                          "load_s": fig.load_s, "peak_rss": fig.peak_rss}

    meta = benchkit.doc_meta("moe.py", args, argv, progress, PY, ["onnxruntime", "onnx", "numpy", "bitpress"],
                             speed_machine=report.machine, load_after=report.load_after, checks=checks,
                             breakdown=breakdown, threads=args.threads, runs=args.runs, onnxruntime=ort.__version__)
    if args.command is None:
        meta["command"] = "make -C bench moe"
    (WORK / "results.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2,
                                                  default=str))
    text = render(meta, rows)
    print(text)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


BUSY_LOAD = 0.5  # load average (per core) above which the page warns that the timing shared the machine


def busy(meta: dict[str, Any]) -> bool:
    m = meta["speed_machine"]
    loads = [x for x in (m.get("load"), meta.get("load_after")) if x is not None]
    return any(x > BUSY_LOAD * (m.get("cores") or 1) for x in loads)


def render(meta: dict[str, Any], rows: list[Row]) -> str:
    threads: list[int] = meta["threads"]
    base = rows[0]
    m = meta["speed_machine"]
    head = ["form", "MoE blocks run as", "size", "size x", "rel. error", "top-1"]
    align = "llrrrr"
    for t in threads:
        head += [f"decode tok/s {t}T", "x", f"prompt tok/s {t}T", "x"]
        align += "rrrr"
    body = []
    for r in rows:
        if r.failed:
            body.append([r.label, f"failed: {r.failed}"] + [""] * (len(head) - 2))
            continue
        cells = [r.label, r.moe_op, f"{r.bytes / 1e6:.1f} MB", f"{r.bytes / base.bytes:.2f}x",
                 "0 (reference)" if r is base else f"{r.rel_error:.2e}", f"{r.top1:.1%}"]
        for t in threads:
            s = r.speed[t]
            cells += [f"{s['decode_tok_s']:.1f}", f"{s['decode_x']:.2f}x", f"{s['prompt_tok_s']:.0f}",
                      f"{s['prompt_x']:.2f}x"]
        body.append(cells)
    ops = [[r.label, r.ops, "-" if r.vs_twin is None else f"{r.vs_twin:.1e}",
            "-" if r.quantize_s is None else f"{r.quantize_s:.1f}",
            f"{max(r.speed[t]['spread'] for t in threads):.0%}", benchkit.fmt_bytes(r.speed[threads[0]]["peak_rss"])]
           for r in rows if not r.failed]
    parts = [[b["part"], b["ops"], benchkit.cell(b["rel_error"], ".2e"),
              "-" if b["top1"] is None else f"{b['top1']:.1%}"] for b in meta["breakdown"]]
    c = meta["checks"]
    params = VOCAB * HIDDEN * 2 + LAYERS * (HIDDEN * EXPERTS + EXPERTS * 3 * INTER * HIDDEN)
    lines = [
        "# Mixture of experts: the MoE / QMoE ops against the per-expert MatMul loop",
        "",
        f"Generated by `{meta['command']}` (`bench/moe.py`) on {meta['date']} in {meta['total_s'] / 60:.1f} min; "
        "do not edit by hand. Issue 31.",
        "",
        f"CPU: {m['cpu']}, {m['cores']} cores; the flags that pick ONNX Runtime's kernels: "
        f"{' '.join(m['flags']) or '-'}; ONNX Runtime {meta['onnxruntime']}; load {m['load']} before the timing, "
        f"{meta['load_after']} after. git {meta['git']}.",
        "",
        *([f"**The machine was busy** (load average above {BUSY_LOAD} per core before or after the "
           "timing): other processes shared the cores, so the speed figures are noisy (see the spread column "
           "below); the ratios, measured alternately, suffer least.", ""] if busy(meta) else []),
        "## The model",
        "",
        f"A decoder-like MoE built in numpy (seed {SEED}, float32, {params / 1e6:.1f} M parameters): `input_ids` -> "
        f"Gather embedding ({VOCAB} x {HIDDEN}) -> {LAYERS} layers of `x = x + MoE(LayerNorm(x))` -> LayerNorm -> LM "
        f"head MatMul ({HIDDEN} x {VOCAB}) -> `logits`. Each MoE block: router MatMul ({HIDDEN} x {EXPERTS}) giving "
        f"the router logits; {EXPERTS} experts, top-{TOP_K}, SwiGLU experts of intermediate size {INTER} "
        f"(`fc1` {EXPERTS} x {2 * INTER} x {HIDDEN}, rows interleaved gate / up, `fc2` {EXPERTS} x {HIDDEN} x "
        f"{INTER}), routing weights renormalized over the top {TOP_K}. Weights are normal / sqrt(fan-in), the "
        f"routers' x {ROUTER_SCALE:g} so that their logits are as decided as a trained router's (not trained: with "
        "the routers of std 1, most tokens' 2nd and 3rd choices are a rounding error apart and any quantization "
        "reroutes them).",
        "",
        "Two graphs of the same weights:",
        "",
        "* **MoE op**: `com.microsoft.MoE` (`activation_type=swiglu`, `swiglu_fusion=1`, `activation_alpha=1`, "
        "`activation_beta=0`, `normalize_routing_weights=1`) between Reshapes to `[tokens, hidden]`; it applies the "
        "softmax and top-k itself and runs only the chosen experts of each token.",
        "* **per-expert loop** (what a converter without the fused op emits, as mobius 0.1.0 writes it): Softmax -> "
        "TopK -> renormalize; per expert gate / up / down MatMuls, `gate * sigmoid(gate) * up`, times "
        "`ReduceSum(w * Cast(Equal(topk_index, e)))`, summed over all experts: every expert runs on every token. "
        "The `fuse_experts` pass turns it back into MoE nodes (then QMoE).",
        "",
        f"Both float graphs were checked against a numpy float64 reference of the op's semantics on the "
        f"{EVAL_TOKENS}-token prompt: max |diff| MoE {c['moe_vs_numpy']:.2e}, loop {c['loop_vs_numpy']:.2e}, loop "
        f"vs MoE {c['loop_vs_moe']:.2e} (logits RMS {c['logits_rms']:.2f}, max {c['logits_abs_max']:.1f}).",
        "",
        "The quantized rows are `bitpress.run({\"input\": ..., \"output\": ..., \"passes\": [{\"type\": \"rtn\", "
        "...}]})` on the float graph with the options in the row (the pass's defaults otherwise: asymmetric, "
        "accuracy_level 4 on the cpu target, embedding as GatherBlockQuantized). The column *MoE blocks run as* is "
        "read from each output file, not assumed.",
        "",
        "## Results",
        "",
        benchkit.markdown_table(head, body, align),
        "",
        f"**rel. error**: ||logits - logits(MoE op, float32)|| / ||logits(MoE op, float32)|| (Frobenius) on a fixed "
        f"random prompt of {EVAL_TOKENS} tokens; **top-1**: positions whose argmax agrees with it. **decode tok/s**: "
        f"1 / latency of one call on a `[1, 1]` prompt (the model has no KV cache: one token alone); **prompt tok/s**: "
        f"{PROMPT_TOKENS} / latency of a `[1, {PROMPT_TOKENS}]` call; **x**: ratio to the float32 MoE op row. Speed "
        f"from one `bitpress.speed.bench` call: every model in a process of its own, measured alternately, "
        f"median of {meta['runs']} rounds after one warm-up, at {' and '.join(map(str, threads))} intra-op "
        "thread(s).",
        "",
        "What each file holds, how far its logits are from the other form's of the same options, the rtn pass's "
        "wall time and the timing noise:",
        "",
        benchkit.markdown_table(["form", "ops", "vs other form", "quantize s", "spread", f"peak RSS ({threads[0]}T)"],
                                ops, "llrrrr"),
        "",
        "**vs other form**: relative Frobenius distance between the logits of the MoE-op row and the per-expert loop "
        "row of the same rtn options (the same quantized weights run by QMoE and by MatMulNBits, where the MoE "
        "form holds QMoE). **spread**: the largest interquartile range over median of the speed figures of the row "
        "(other processes on the machine widen it: see the load above).",
        "",
        "## Where the error comes from",
        "",
        "The weights are random, not trained: a change anywhere upstream of a router flips the choice of experts of "
        "the tokens whose choices are close, and the rest of the output follows other experts. "
        "rtn int4 b32 (accuracy_level 4) of one part of the per-expert loop form at a time, the rest float, against "
        "the float MoE op's logits:",
        "",
        benchkit.markdown_table(["quantized", "ops", "rel. error", "top-1"], parts, "llrr"),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
