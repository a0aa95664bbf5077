"""Human-readable forms of an :class:`EvalResult`: text lines (the CLI prints them) and HTML.

The HTML report is one self-contained file: inline CSS and an inline SVG chart, no scripts,
no fonts or styles fetched from anywhere, so it opens offline and can be attached to a ticket.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the result's classes, for hints only: result.write_html imports this module
    from bitpress.evaluate.result import EvalResult, OutputMetrics, TensorError


# -- text -------------------------------------------------------------------------------------------


def _g(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    return f"{x:.{digits}g}"


def _db(x: float | None) -> str:
    if x is None:
        return "n/a"
    if math.isinf(x):
        return "exact" if x > 0 else "-inf dB"
    return f"{x:.1f} dB"


def _is_cache(o: OutputMetrics) -> bool:
    return o.name.lower().startswith("present")


def cache_summary(caches: list[OutputMetrics]) -> OutputMetrics:
    """The worst of many KV-cache outputs in one row: largest errors, lowest cosine."""
    elements = sum(o.elements for o in caches)
    mean = sum(o.mean_abs_error * o.elements for o in caches) / elements if elements else 0.0
    return type(caches[0])(  # OutputMetrics (its class from the rows: see the imports)
        f"present.* ({len(caches)}, worst)", caches[0].shape, elements, max(o.max_abs_error for o in caches), mean,
        max(o.relative_l2 for o in caches), min(o.cosine for o in caches),
    )


def output_rows(result: EvalResult) -> list[list[str]]:
    """Header + one row per output; many KV-cache outputs (one per layer) fold into one row."""
    rows = [["OUTPUT", "SHAPE", "MAX ABS", "MEAN ABS", "REL L2", "COSINE", "TOP-1"]]
    caches = [o for o in result.outputs if _is_cache(o)]
    shown = result.outputs if len(caches) <= 2 else [o for o in result.outputs if not _is_cache(o)]
    if len(caches) > 2:
        shown = [*shown, cache_summary(caches)]
    for o in shown:
        rows.append([o.name, "x".join(map(str, o.shape)), _g(o.max_abs_error), _g(o.mean_abs_error),
                     _g(o.relative_l2), f"{o.cosine:.6f}", "-" if o.top1_agreement is None else
                     f"{o.top1_agreement:.2%}"])
    return rows


def text_lines(result: EvalResult, worst: int = 5) -> list[str]:
    """A summary for a terminal; tables are lists of equal-width columns."""
    bpw = "" if result.bits_per_weight is None else f", {result.bits_per_weight:.2f} bits per weight"
    lines = [f"QUANTIZED {result.quantized} ({_size(result.quantized_bytes)}{bpw})",
             f"reference {result.reference} ({_size(result.reference_bytes)})",
             f"algorithm {algorithm_text(result)}",
             f"compared on {result.data}: {result.samples} run(s), batch {result.batch}", ""]
    lines += _columns(output_rows(result))
    p = result.perplexity
    if p is not None:
        lines += ["", f"perplexity on {p.text} ({p.windows} window(s) of {p.seq_len} tokens, {p.tokens} predicted):",
                  f"  reference {p.reference:.4f}  quantized {p.quantized:.4f}  change {p.relative_change:+.2%}"]
    summary = result.sqnr_summary()
    if summary:
        lines += ["", f"weights: {summary['tensors']} quantized tensor(s), SQNR min {_db(summary['min_db'])}, "
                      f"median {_db(summary['median_db'])}, max {_db(summary['max_db'])}"]
        ranked = sorted((t for t in result.tensors if t.sqnr_db is not None), key=lambda t: t.sqnr_db)  # type: ignore[arg-type, return-value]
        table = [["  LOWEST SQNR", "WEIGHT", "NODE", "BITS"]]
        table += [[f"  {_db(t.sqnr_db)}", t.weight or "?", t.node, str(t.bits or "-")] for t in ranked[:worst]]
        lines += _columns(table)
    unmatched = [t for t in result.tensors if t.sqnr_db is None]
    if unmatched:
        lines.append(f"weights not compared: {len(unmatched)} (first: {unmatched[0].node}: {unmatched[0].note})")
    elif not result.weights_compared:
        lines += ["", "weights: not compared (--no-weights)"]
    elif not result.tensors:
        lines += ["", "weights: QUANTIZED has no MatMulNBits / GatherBlockQuantized / MatMulBnb4 node"]
    lines += runtime_lines(result)
    lines += [f"note: {n}" for n in result.notes]
    lines.append(f"done in {result.seconds:.1f} s")
    return lines


def runtime_lines(result: EvalResult) -> list[str]:
    """The kernels QUANTIZED runs on, and its speed against the reference."""
    from bitpress.speed import summary_line

    out = []
    rt = result.runtime
    if rt and rt.get("counts"):
        out += ["", f"runs on ({rt['target']}): " + ", ".join(f"{n} {k}" for k, n in rt["counts"].items())]
        if rt.get("slow"):
            name, why = next(iter(rt["slow"].items()))
            out.append(f"  slow path: {len(rt['slow'])} node(s), e.g. {name}: {why['reason']}"
                       + (f"; to avoid it: {why['fix']}" if why.get("fix") else ""))
    if result.speed:
        out += ["", "speed: " + summary_line(result.speed)]
    return out


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


# -- HTML -------------------------------------------------------------------------------------------
# Tables never overflow the page (a 1280 px window included): a fixed layout at 100 % of the
# body's width, and long tensor / node names wrap anywhere (the full name is also the cell's title).
_CSS = """
*,*::before,*::after{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;
color:#1b1f24;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:1.8em;border-bottom:1px solid #d0d7de}
.meta{color:#57606a}code{font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
table{border-collapse:collapse;margin:.5em 0;font-size:13px;width:100%;max-width:100%;table-layout:fixed}
th,td{border:1px solid #d0d7de;padding:3px 6px;text-align:right}th{background:#f6f8fa}
td.l,th.l{text-align:left;overflow-wrap:anywhere}td code{overflow-wrap:anywhere}
tr.worst td{background:#ffebe9}tr.low td{background:#fff8c5}
table.kv th{width:11em;text-align:left}table.kv td{text-align:left}
.cards{display:flex;gap:1em;flex-wrap:wrap}.card{border:1px solid #d0d7de;border-radius:6px;padding:.6em 1em}
.card b{display:block;font-size:1.4em}.note{color:#9a6700}svg text{font:11px ui-monospace,Menlo,Consolas,monospace}
"""

_BAR, _LOW, _WORST = "#3b82c4", "#e3a008", "#cf222e"


def render_html(result: EvalResult) -> str:
    e = html.escape
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>bitpress eval: {e(result.quantized.name)}</title><style>{_CSS}</style></head><body>",
        "<h1>Quantization report</h1>",
        _models_table(result),
        f'<p class="meta">compared on {e(result.data)}: {result.samples} run(s), '
        f"batch {result.batch}, {result.threads} thread(s), {result.seconds:.1f} s; "
        f"{_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}</p>",
        _cards(result),
    ]
    parts += [f'<p class="note">note: {e(n)}</p>' for n in result.notes]
    parts.append("<h2>Outputs</h2>")
    caches = [o for o in result.outputs if _is_cache(o)]
    if len(caches) > 2:
        # one KV-cache output per layer and per key / value: folded away so the logits stay in view
        parts.append(_outputs_table([o for o in result.outputs if not _is_cache(o)] + [cache_summary(caches)]))
        parts.append(f"<details><summary>all {len(caches)} KV-cache outputs</summary>{_outputs_table(caches)}"
                     "</details>")
    else:
        parts.append(_outputs_table(result.outputs))
    parts.append(
        '<p class="meta">max / mean abs: of |quantized - reference| over every element of every run; rel L2: '
        "||q - r|| / ||r||; cosine: &lt;q, r&gt; / (||q|| ||r||); top-1: share of positions whose highest logit is "
        "the same token.</p>"
    )
    if result.perplexity is not None:
        p = result.perplexity
        parts.append("<h2>Perplexity</h2>")
        parts.append(
            f"<p>On <code>{e(p.text)}</code>: {p.windows} window(s) of {p.seq_len} tokens, {p.tokens} predicted "
            "tokens.</p><table><tr><th class=l>model</th><th>perplexity</th></tr>"
            f"<tr><td class=l>reference</td><td>{p.reference:.4f}</td></tr>"
            f"<tr><td class=l>QUANTIZED</td><td>{p.quantized:.4f}</td></tr>"
            f"<tr><td class=l>change</td><td>{p.relative_change:+.2%}</td></tr></table>"
        )
    parts.append(_speed_section(result))
    parts.append("<h2>Quantization error per tensor</h2>")
    if not result.weights_compared:
        parts.append("<p>Not compared (--no-weights).</p>")
    elif result.tensors:
        parts.append(
            '<p class="meta">SQNR = 10 log10(||W||² / ||W − W<sub>deq</sub>||²) of each quantized weight against '
            "its float original, in node order; higher is better (each bit adds about 6 dB). "
            f'<span style="color:{_WORST}">■</span> lowest, <span style="color:{_LOW}">■</span> lowest tenth.</p>'
        )
        parts.append(svg_chart(result.tensors))
        parts.append(_tensor_table(result.tensors))
    else:
        parts.append("<p>QUANTIZED has no MatMulNBits / GatherBlockQuantized / MatMulBnb4 node.</p>")
    parts.append('<p class="meta">Generated by bitpress eval.</p></body></html>')
    return "\n".join(parts) + "\n"


def _speed_section(result: EvalResult) -> str:
    """Both models' measured speed and the kernels QUANTIZED runs on."""
    e = html.escape
    parts = ["<h2>Speed</h2>"]
    sp = result.speed
    if sp:
        token = ("decode tokens/s", "decode_tokens_per_s", "decode") if sp["kind"] == "genai" else \
            ("one-token calls/s", "single_tokens_per_s", "single")
        rows = [("prompt tokens/s", "prompt_tokens_per_s", "prompt", "{:.1f}"), (*token, "{:.1f}"),
                ("load", "load_s", None, "{:.2f} s"), ("peak memory", "peak_rss", "peak_rss", None)]
        body = ""
        for label, key, ratio, fmt in rows:
            q, r = sp["quantized"][key], sp["reference"][key]
            cell = (lambda v: _size(int(v))) if fmt is None else (lambda v, f=fmt: f.format(v))
            x = f"{sp['ratios'][ratio]:.2f}x" if ratio else "-"
            body += f"<tr><td class=l>{label}</td><td>{cell(r)}</td><td>{cell(q)}</td><td>{x}</td></tr>"
        m = sp["machine"]
        parts.append(
            "<table><tr><th class=l></th><th>reference</th><th>QUANTIZED</th><th>QUANTIZED / reference</th></tr>"
            f"{body}</table>"
            f'<p class="meta">{sp["threads"]} thread(s); median of {sp["runs"]} rounds after a warm-up, the two '
            f"models alternating; prompt {sp['prompt_tokens']} tokens"
            + (f", {sp['decode_tokens']} decoded" if sp["kind"] == "genai" else "")
            + f"; {e(m['cpu'])} ({e(' '.join(m['flags']))}), load {m['load']}; "
            + e(", ".join(f"{k} {v}" for k, v in m["versions"].items())) + "</p>")
    else:
        parts.append("<p>Not measured (--no-speed).</p>")
    rt = result.runtime
    if rt and rt.get("counts"):
        counts = ", ".join(f"{n} {e(k)}" for k, n in rt["counts"].items())
        parts.append(f"<p>QUANTIZED's quantized nodes run on ({e(rt['target'])}): {counts}.</p>")
        for name, why in list(rt.get("slow", {}).items())[:5]:
            parts.append(f'<p class="note">slow path: <code>{e(name)}</code>: {e(why["reason"] or "")}'
                         + (f"; to avoid it: {e(why['fix'])}" if why.get("fix") else "") + "</p>")
    return "\n".join(parts)


def _size(n: int) -> str:
    if not n:
        return "?"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def algorithm_text(result: EvalResult) -> str:
    """``rtn (plugin rtn)``, several passes joined with ``then``; ``unknown`` without a record."""
    if not result.quantization:
        return "unknown"
    return " then ".join(f"{p.get('pass', '?')} (plugin {p.get('plugin', '?')})" for p in result.quantization)


def _options_text(options: dict) -> str:
    import json

    return ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in sorted(options.items())) or "(none)"


def _models_table(result: EvalResult) -> str:
    """Both models (paths, sizes), bits per weight, and the algorithm with its options."""
    e = html.escape
    ratio = (f" ({result.reference_bytes / result.quantized_bytes:.2f}x smaller)"
             if result.quantized_bytes and result.reference_bytes else "")
    bpw = "-" if result.bits_per_weight is None else f"{result.bits_per_weight:.2f}"
    rows = [
        ("QUANTIZED", f"<code>{e(str(result.quantized))}</code>"),
        ("reference", f"<code>{e(str(result.reference))}</code>"),
        ("size", f"{_size(result.quantized_bytes)} quantized, {_size(result.reference_bytes)} reference{ratio}"),
        ("bits per weight", f"{bpw} <span class=meta>(quantized weights: integers, scales and zero points)</span>"),
    ]
    if result.quantization:
        for i, p in enumerate(result.quantization):
            label = "algorithm" if len(result.quantization) == 1 else f"pass {i + 1}"
            rows.append((label, f"{e(str(p.get('pass', '?')))} <span class=meta>(plugin "
                                f"{e(str(p.get('plugin', '?')))})</span>"))
            rows.append(("options", f"<code>{e(_options_text(p.get('options') or {}))}</code>"))
    else:
        rows.append(("algorithm", "unknown <span class=meta>(QUANTIZED records no bitpress metadata)</span>"))
        rows.append(("options", "unknown"))
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _cards(result: EvalResult) -> str:
    cards = []
    logits = result.logits()
    if logits is not None:
        if logits.top1_agreement is not None:
            cards.append(("top-1 agreement", f"{logits.top1_agreement:.2%}"))
        cards.append(("logits cosine", f"{logits.cosine:.5f}"))
        cards.append(("logits rel. L2", _g(logits.relative_l2)))
    if result.perplexity is not None:
        p = result.perplexity
        cards.append(("perplexity", f"{p.reference:.3f} → {p.quantized:.3f} ({p.relative_change:+.2%})"))
    if result.speed:
        ratio = result.speed["ratios"]
        key = "decode" if result.speed["kind"] == "genai" else "single"
        cards.append((f"{'decode' if key == 'decode' else 'one-token'} speed vs reference", f"{ratio[key]:.2f}x"))
    s = result.sqnr_summary()
    if s:
        cards.append(("lowest SQNR", f"{_db(s['min_db'])}"))
        cards.append(("median SQNR", f"{_db(s['median_db'])}"))
    body = "".join(f'<div class="card">{html.escape(k)}<b>{html.escape(v)}</b></div>' for k, v in cards)
    return f'<div class="cards">{body}</div>'


def _outputs_table(outputs: list[OutputMetrics]) -> str:
    cols = '<colgroup><col style="width:28%"><col style="width:14%"><col span="5"></colgroup>'
    head = f"<table>{cols}<tr>" + "".join(
        f"<th{' class=l' if i < 2 else ''}>{h}</th>"
        for i, h in enumerate(["output", "shape", "max abs", "mean abs", "rel L2", "cosine", "top-1"])
    ) + "</tr>"
    body = []
    for o in outputs:
        top1 = "-" if o.top1_agreement is None else f"{o.top1_agreement:.2%}"
        body.append(
            f"<tr><td class=l title=\"{html.escape(o.name)}\">{html.escape(o.name)}</td>"
            f"<td class=l>{'×'.join(map(str, o.shape))}</td>"
            f"<td>{_g(o.max_abs_error)}</td><td>{_g(o.mean_abs_error)}</td><td>{_g(o.relative_l2)}</td>"
            f"<td>{o.cosine:.6f}</td><td>{top1}</td></tr>"
        )
    return head + "".join(body) + "</table>"


def _ranks(tensors: list[TensorError]) -> tuple[int | None, set[int]]:
    """Index of the lowest SQNR and the indices in the lowest tenth (from 10 tensors on)."""
    scored = [(t.sqnr_db, i) for i, t in enumerate(tensors) if t.sqnr_db is not None]
    if not scored:
        return None, set()
    scored.sort()
    worst = scored[0][1]
    low = {i for _, i in scored[: len(scored) // 10]} if len(scored) >= 10 else set()
    return worst, low - {worst}


def _tensor_table(tensors: list[TensorError]) -> str:
    worst, low = _ranks(tensors)
    # widths in % of the page: the names get the room, and wrap within it
    widths = (3, 21, 18, 10, 7, 4, 5, 7, 7, 8, 10)
    cols = "".join(f'<col style="width:{w}%">' for w in widths)
    rows = [f"<table><colgroup>{cols}</colgroup><tr><th>#</th><th class=l>weight</th><th class=l>node(s)</th>"
            "<th class=l>op</th><th>shape</th><th>bits</th><th>block</th><th>SQNR</th><th>rel. error</th>"
            "<th>max abs</th><th class=l>note</th></tr>"]
    for i, t in enumerate(tensors):
        cls = ' class="worst"' if i == worst else (' class="low"' if i in low else "")
        weight, nodes = html.escape(t.weight or "?"), html.escape(", ".join(t.nodes))
        rows.append(
            f'<tr{cls}><td>{i + 1}</td><td class=l title="{weight}"><code>{weight}</code></td>'
            f'<td class=l title="{nodes}"><code>{nodes}</code></td><td class=l>{t.op_type}</td>'
            f"<td>{'×'.join(map(str, t.shape)) or '-'}</td><td>{t.bits or '-'}</td><td>{t.block_size or '-'}</td>"
            f"<td>{_db(t.sqnr_db)}</td><td>{_g(t.relative_error)}</td><td>{_g(t.max_abs_error)}</td>"
            f"<td class=l>{html.escape(t.note)}</td></tr>"
        )
    return "".join(rows) + "</table>"


def svg_chart(tensors: list[TensorError], width: int = 1060) -> str:
    """A horizontal bar per tensor (node order, top to bottom), bar length = SQNR in dB."""
    row_h, top, label_w, value_w = 16, 24, 420, 70
    plot_w = width - label_w - value_w
    finite = [t.sqnr_db for t in tensors if t.sqnr_db is not None and math.isfinite(t.sqnr_db)]
    hi = max([*finite, 10.0])
    axis_max = math.ceil(hi / 10) * 10
    height = top + row_h * len(tensors) + 8
    worst, low = _ranks(tensors)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" style="max-width:100%;height:auto" role="img" '
           'aria-label="SQNR per quantized tensor">']
    for tick in range(0, axis_max + 1, 10 if axis_max <= 100 else 20):
        x = label_w + plot_w * tick / axis_max
        out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{height - 8}" stroke="#d0d7de"/>'
                   f'<text x="{x:.1f}" y="{top - 8}" text-anchor="middle" fill="#57606a">{tick} dB</text>')
    if finite:
        # bars start at 0 dB (lengths stay honest); the median line shows which ones fall behind the rest
        mid = sorted(finite)[len(finite) // 2]
        x = label_w + plot_w * min(max(mid, 0.0), axis_max) / axis_max
        out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{height - 8}" stroke="#1b1f24" '
                   f'stroke-dasharray="3,3"><title>median {mid:.1f} dB</title></line>')
    for i, t in enumerate(tensors):
        y = top + i * row_h
        name = t.weight or t.node
        label = name if len(name) <= 58 else "…" + name[-57:]
        tip = html.escape(f"{name} ({', '.join(t.nodes)}): {_db(t.sqnr_db)}{'; ' + t.note if t.note else ''}")
        out.append(f"<g><title>{tip}</title>")
        out.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end">{html.escape(label)}</text>')
        if t.sqnr_db is None:
            out.append(f'<text x="{label_w + 4}" y="{y + 12}" fill="#8c959f">n/a</text></g>')
            continue
        value = axis_max if math.isinf(t.sqnr_db) and t.sqnr_db > 0 else max(0.0, t.sqnr_db)
        color = _WORST if i == worst else (_LOW if i in low else _BAR)
        w = plot_w * min(value, axis_max) / axis_max
        out.append(f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row_h - 4}" fill="{color}"/>')
        out.append(f'<text x="{label_w + w + 4:.1f}" y="{y + 12}">{_db(t.sqnr_db)}</text></g>')
    out.append("</svg>")
    return "\n".join(out)
