"""``OUT/report.html``: the size / error and speed / error trade-offs of a sweep, self-contained.

Inline SVG charts (drawn here: no scripts, fonts or styles from elsewhere) of every finished
job: y is the error (the perplexity change with a text, else the relative error of the main
output); x is the bits per weight (or the output's size when a job does not report it) in the
first chart, and in the second the output's speed against its input model (decode tokens/s of a
GenAI package, one-token calls/s of an ONNX model, measured alternately with the input by
:func:`bitpress.speed.compare`). Each model's Pareto-optimal jobs (no other job of that model is
at least as small, or as fast, and as accurate, and better in one) are filled and joined by a
line. Below them, the table of every job.
"""

from __future__ import annotations

import html
import math
import os
from pathlib import Path
from typing import Any

from bitpress.sweep.config import SweepConfig

#: colours of the models, in order (colour-blind friendly, Okabe-Ito)
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")
METRIC_TITLES = {
    "perplexity_change": "perplexity change (relative)",
    "relative_error": "relative output error (L2)",
}
X_TITLES = {"bits_per_weight": "bits per weight", "model_bytes": "output size (MB)",
            "speedup": "speed vs the input model (x, higher is faster)"}
#: x keys read from a row's metrics (the others are the row's own fields), and whether a larger x is better
METRIC_X = {"speedup"}
HIGHER_IS_BETTER = {"speedup"}


# -- figures ---------------------------------------------------------------------------------------
def number(value: Any) -> float | None:
    """A finite float, or None (missing, "nan", "inf" as JSON writes them)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def y_value(row: dict[str, Any], metric: str) -> float | None:
    return number((row.get("metrics") or {}).get(metric)) if row.get("status") == "ok" else None


def x_metric(rows: list[dict[str, Any]], metric: str) -> str:
    """``bits_per_weight`` when every plotted job reports it, else ``model_bytes``."""
    plotted = [r for r in rows if y_value(r, metric) is not None]
    if plotted and all(number(r.get("bits_per_weight")) is not None for r in plotted):
        return "bits_per_weight"
    return "model_bytes"


def x_value(row: dict[str, Any], key: str) -> float | None:
    return number((row.get("metrics") or {}).get(key) if key in METRIC_X else row.get(key))


def points(rows: list[dict[str, Any]], xkey: str, metric: str) -> list[tuple[dict[str, Any], float, float]]:
    out = []
    for r in rows:
        x, y = x_value(r, xkey), y_value(r, metric)
        if x is not None and y is not None:
            out.append((r, x, y))
    return out


def pareto_ids(pts: list[tuple[str, float, float]]) -> set[str]:
    """The ids of the points no other point dominates (as small or smaller in x and y, smaller in one)."""
    front = set()
    for pid, x, y in pts:
        dominated = any(ox <= x and oy <= y and (ox < x or oy < y) for oid, ox, oy in pts if oid != pid)
        if not dominated:
            front.add(pid)
    return front


def pareto_rows(rows: list[dict[str, Any]], xkey: str, metric: str) -> dict[str, set[str]]:
    """Model path -> ids of its Pareto-optimal jobs (per model: models are not compared)."""
    sign = -1.0 if xkey in HIGHER_IS_BETTER else 1.0  # faster is better: the front of -speed
    by_model: dict[str, list[tuple[str, float, float]]] = {}
    for r, x, y in points(rows, xkey, metric):
        by_model.setdefault(r["model"], []).append((r["id"], sign * x, y))
    return {m: pareto_ids(pts) for m, pts in by_model.items()}


def model_names(models: list[str], sources: dict[str, dict[str, Any]] | None = None) -> dict[str, str]:
    """The shortest trailing part of each path that tells the models apart (``llama/model.onnx``); a Hub id
    model (``sources``: path -> its record) is named by its repo (``org/name@revision/subfolder``)."""
    parts = {m: Path(m).parts for m in models}
    names: dict[str, str] = {}
    for m, src in (sources or {}).items():
        if m in parts:
            names[m] = str(src["hub"]) + (f"@{src['revision']}" if src.get("revision") else "") + \
                (f"/{src['subfolder']}" if src.get("subfolder") else "")
    for m in models:
        if m in names:
            continue
        for n in range(1, len(parts[m]) + 1):
            tail = parts[m][-n:]
            if all(other == m or parts[other][-n:] != tail for other in models):
                names[m] = "/".join(tail)
                break
        else:
            names[m] = m
    return names


def point_label(row: dict[str, Any], names: dict[str, str]) -> str:
    return f"{row.get('label') or row['pass']} · {names.get(row['model'], Path(row['model']).name)}"


# -- the chart -------------------------------------------------------------------------------------
def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    out = []
    v = first
    while v <= hi + step * 1e-9:
        out.append(round(v, 12))
        v += step
    return out


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.2g}"
    return f"{v:.3g}"


def svg_chart(rows: list[dict[str, Any]], metric: str, names: dict[str, str], width: int = 960,
              height: int = 560, xkey: str | None = None) -> str:
    """The size (or, with ``xkey="speedup"``, speed) / error chart of ``rows``; every point a
    ``<g class="point">`` with its label."""
    xkey = xkey or x_metric(rows, metric)
    pts = points(rows, xkey, metric)
    if not pts:
        if xkey == "speedup":
            return ('<p class="empty">No finished job with a speed figure yet (eval.speed: false measures '
                    "none).</p>")
        return ('<p class="empty">No finished job with an error figure yet: the chart appears once a job has '
                "been evaluated.</p>")
    scale = 1e-6 if xkey == "model_bytes" else 1.0
    fronts = pareto_rows(rows, xkey, metric)
    models = list(dict.fromkeys(r["model"] for r, _, _ in pts))
    colour = {m: COLOURS[i % len(COLOURS)] for i, m in enumerate(models)}
    left, right, top, bottom = 80, 250, 30, 60
    pw, ph = width - left - right, height - top - bottom
    xs = [x * scale for _, x, _ in pts]
    ys = [y for _, _, y in pts]
    ylog = min(ys) > 0 and max(ys) / min(ys) > 30
    def ty(v: float) -> float:
        return math.log10(v) if ylog else v
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ty(y) for y in ys), max(ty(y) for y in ys)
    padx = (x1 - x0) * 0.08 or max(abs(x0) * 0.1, 0.5)
    pady = (y1 - y0) * 0.08 or max(abs(y0) * 0.1, 0.05 if ylog else 1e-3)
    x0, x1, y0, y1 = x0 - padx, x1 + padx, y0 - pady, y1 + pady

    def px(x: float) -> float:
        return left + (x * scale - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return top + ph - (ty(y) - y0) / (y1 - y0) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="pareto" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>']
    for t in _ticks(x0, x1):
        xp = left + (t - x0) / (x1 - x0) * pw
        out.append(f'<line x1="{xp:.1f}" y1="{top}" x2="{xp:.1f}" y2="{top + ph}" stroke="#eee"/>'
                   f'<text x="{xp:.1f}" y="{top + ph + 16}" text-anchor="middle">{_fmt(t)}</text>')
    yticks = [t for t in range(math.floor(y0), math.ceil(y1) + 1)] if ylog else _ticks(y0, y1)
    for t in yticks:
        if not y0 <= t <= y1:
            continue
        yp = top + ph - (t - y0) / (y1 - y0) * ph
        text = _fmt(10 ** t) if ylog else _fmt(t)
        out.append(f'<line x1="{left}" y1="{yp:.1f}" x2="{left + pw}" y2="{yp:.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{yp + 4:.1f}" text-anchor="end">{text}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 18}" text-anchor="middle" font-size="13">'
               f'{html.escape(X_TITLES[xkey])}</text>')
    ytitle = METRIC_TITLES.get(metric, metric) + (" (log scale)" if ylog else "")
    out.append(f'<text transform="translate(18 {top + ph / 2}) rotate(-90)" text-anchor="middle" font-size="13">'
               f"{html.escape(ytitle)}</text>")
    # each model's front: its Pareto-optimal points joined in order of size
    for m in models:
        front = sorted(((x, y) for r, x, y in pts if r["model"] == m and r["id"] in fronts.get(m, set())))
        if len(front) > 1:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in front)
            out.append(f'<polyline class="front" data-model="{html.escape(m)}" points="{path}" fill="none" '
                       f'stroke="{colour[m]}" stroke-width="2" stroke-opacity="0.7"/>')
    # the legend's place first: labels keep out of it
    legend_top, legend_h = top + 10, 18 * len(models) + 44
    placed: list[tuple[float, float, float, float]] = [(left + pw + 10, legend_top - 8, width, legend_top + legend_h)]
    for r, x, y in sorted(pts, key=lambda p: (p[1], p[2])):
        m = r["model"]
        on_front = r["id"] in fronts.get(m, set())
        cx, cy = px(x), py(y)
        label = point_label(r, names)
        lx, ly = _place(cx, cy, len(label) * 5.6, placed, left, top, pw, ph)
        fill = colour[m] if on_front else "#fff"
        weight = ' font-weight="bold"' if on_front else ""
        title = (f"{label}\n{X_TITLES[xkey]}: {_fmt(x * scale)}\n{METRIC_TITLES.get(metric, metric)}: {y:.4g}"
                 f"\nid {r['id']}" + ("\nPareto-optimal" if on_front else ""))
        out.append(
            f'<g class="point" data-id="{r["id"]}" data-model="{html.escape(m)}" data-x="{x!r}" data-y="{y!r}" '
            f'data-pareto="{"true" if on_front else "false"}"><title>{html.escape(title)}</title>'
            f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{5 if on_front else 4}" fill="{fill}" stroke="{colour[m]}" '
            f'stroke-width="2"/>'
            f'<text x="{lx:.1f}" y="{ly:.1f}" fill="{colour[m]}"{weight}>{html.escape(label)}</text></g>')
    ly = legend_top
    for m in models:
        out.append(f'<circle cx="{left + pw + 20}" cy="{ly}" r="5" fill="{colour[m]}"/>'
                   f'<text x="{left + pw + 30}" y="{ly + 4}">{html.escape(names.get(m, m))}</text>')
        ly += 18
    out.append(f'<text x="{left + pw + 14}" y="{ly + 10}" fill="#555">filled, joined: Pareto-optimal</text>')
    out.append(f'<text x="{left + pw + 14}" y="{ly + 24}" fill="#555">hollow: another job of the model is</text>')
    better = "faster" if xkey in HIGHER_IS_BETTER else "smaller"
    out.append(f'<text x="{left + pw + 14}" y="{ly + 38}" fill="#555">{better} and more accurate</text>')
    out.append("</svg>")
    return "\n".join(out)


def _place(cx: float, cy: float, w: float, placed: list[tuple[float, float, float, float]], left: float,
           top: float, pw: float, ph: float) -> tuple[float, float]:
    """Where a label of width ``w`` next to the point (cx, cy) overlaps no label placed before."""
    h = 12.0
    candidates = [(cx + 8, cy + 4), (cx + 8, cy - 8), (cx + 8, cy + 16), (cx - 8 - w, cy + 4), (cx + 8, cy - 20),
                  (cx - 8 - w, cy - 8), (cx - 8 - w, cy + 16), (cx + 8, cy + 28), (cx + 8, cy - 32)]
    best = candidates[0]
    for x, y in candidates:
        box = (x, y - h + 2, x + w, y + 2)
        inside = box[0] >= left - 60 and box[2] <= left + pw + 240 and box[1] >= top - 20 and box[3] <= top + ph + 10
        if inside and not any(_overlap(box, b) for b in placed):
            best = (x, y)
            break
    placed.append((best[0], best[1] - h + 2, best[0] + w, best[1] + 2))
    return best


def _overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


# -- the page --------------------------------------------------------------------------------------
_CSS = """
body { font-family: -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; font-size: 12px; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.pareto td { background: #eef6ee; } tr.failed td { color: #a00; } tr.pending td { color: #888; }
p.meta { color: #555; font-size: 13px; }
"""


def _cell(value: Any, digits: int = 4) -> str:
    v = number(value)
    if v is None:
        return '<td class="num">-</td>'
    return f'<td class="num">{v:.{digits}g}</td>'


def render_html(rows: list[dict[str, Any]], cfg: SweepConfig) -> str:
    """The report's HTML: the chart, each model's Pareto-optimal jobs, and the table of every job."""
    metric = cfg.metric
    names = model_names([str(m) for m in cfg.models], cfg.sources)
    xkey = x_metric(rows, metric)
    fronts = pareto_rows(rows, xkey, metric)
    ok = sum(r["status"] == "ok" for r in rows)
    failed = sum(r["status"] == "failed" for r in rows)
    pending = len(rows) - ok - failed
    ev = cfg.eval
    if ev is None:
        how = "not evaluated (eval: false): sizes only"
    elif ev.text:
        how = f"perplexity on {html.escape(Path(ev.text).name)} (windows of {ev.seq_len} tokens)"
    else:
        how = f"outputs compared on {html.escape(ev.data or 'random inputs')} ({ev.samples} samples)"
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        "<title>bitpress sweep</title>", f"<style>{_CSS}</style></head><body>",
        "<h1>bitpress sweep</h1>",
        f'<p class="meta">{len(rows)} job(s): {ok} ok, {failed} failed, {pending} pending; '
        f"{len(cfg.models)} model(s); error: {html.escape(METRIC_TITLES.get(metric, metric))}, {how}.</p>",
        "<h2>Size / error trade-off</h2>",
        svg_chart(rows, metric, names) if ev is not None else
        '<p class="empty">Not evaluated (eval: false): no error figures, the sizes are in the table.</p>',
        "<h2>Speed / error trade-off</h2>",
        svg_chart(rows, metric, names, xkey="speedup") if ev is not None and ev.speed else
        '<p class="empty">Speed not measured (eval: false, or eval.speed: false).</p>',
        '<p class="meta">speed: the output against its input model, measured alternately in the job (decode '
        "tokens/s of a GenAI package, one-token calls/s of an ONNX model); absolute figures in the table, "
        "labelled with the CPU in results.jsonl.</p>",
        "<h2>Pareto-optimal jobs</h2>",
    ]
    front_lines = []
    for m in (str(p) for p in cfg.models):
        ids = fronts.get(m, set())
        chosen = sorted((r for r in rows if r["id"] in ids), key=lambda r: number(r.get(xkey)) or 0.0)
        text = ", ".join(html.escape(r.get("label") or r["pass"]) for r in chosen) or "none yet"
        front_lines.append(f"<li><b>{html.escape(names.get(m, m))}</b>: {text}</li>")
    parts.append("<ul>" + "".join(front_lines) + "</ul>")
    parts.append("<h2>Every job</h2>")
    head = ["id", "model", "pass", "options", "status", "size (bytes)", "bits / weight", "rel. error", "cosine",
            "top-1", "perplexity", "ppl change", "SQNR median (dB)", "speed (x)", "tokens / s", "prompt (x)",
            "seconds", "output / error"]
    parts.append("<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>")
    order = sorted(rows, key=lambda r: (names.get(r["model"], r["model"]), r["pass"], r.get("label") or ""))
    for r in order:
        met = r.get("metrics") or {}
        on_front = r["id"] in fronts.get(r["model"], set())
        cls = "pareto" if on_front else ("failed" if r["status"] == "failed" else
                                         "pending" if r["status"] != "ok" else "")
        if r["pass"] == "publish":  # a cell of the export matrix: its dtype, EP and variant
            options = ", ".join(f"{k}={v}" for k, v in (r.get("point") or {}).items() if v is not None)
        else:
            options = ", ".join(f"{k}={v}" for k, v in sorted((r.get("options") or {}).items()))
        if r.get("precision"):
            options = f"precision={r['precision']}" + (", " + options if options else "")
        last = r.get("error") if r["status"] == "failed" else r.get("output")
        size = r.get("model_bytes") if r.get("model_bytes") is not None else r.get("output_bytes")
        parts.append(
            f'<tr class="{cls}"><td><code>{r["id"]}</code></td><td>{html.escape(names.get(r["model"], r["model"]))}'
            f'</td><td>{html.escape(r["pass"])}</td><td>{html.escape(options)}</td>'
            f'<td>{html.escape(r["status"])}{" ★" if on_front else ""}</td>'
            f'<td class="num">{size if size is not None else "-"}</td>'
            + _cell(r.get("bits_per_weight")) + _cell(met.get("relative_error")) + _cell(met.get("cosine"), 6)
            + _cell(met.get("top1_agreement")) + _cell(met.get("perplexity"))
            + _cell(met.get("perplexity_change")) + _cell(met.get("sqnr_median_db"))
            + _cell(met.get("speedup"), 3) + _cell(met.get("tokens_per_s"), 4) + _cell(met.get("prompt_speedup"), 3)
            + _cell((r.get("seconds") or {}).get("total"), 3)
            + f"<td>{html.escape(str(last or ''))}</td></tr>")
    parts.append("</tbody></table>")
    parts.append('<p class="meta">★ Pareto-optimal for its model. Rows: results.jsonl beside this file; '
                 "outputs: runs/&lt;id&gt;/.</p></body></html>")
    return "\n".join(parts) + "\n"


def write_report(path: Path, rows: list[dict[str, Any]], cfg: SweepConfig) -> Path:
    """Write the report atomically (a reader never sees half a page)."""
    from bitpress.errors import OutputError

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(render_html(rows, cfg), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write the report {path}: {exc.strerror or exc}") from None
    return path
