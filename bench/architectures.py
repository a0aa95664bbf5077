"""Every architecture the pinned exporters claim, through the paths a user takes -> ../docs/architectures.md.

    make -C bench architectures            (about 15 minutes on 2 cores)
    python bench/architectures.py --only gemma3_text,gemma2 --out /tmp/a.md

A tiny random checkpoint of each model type (:mod:`bitpress.hf.tiny`: float32, hidden 64, two
layers) goes through:

* ``float, auto``: ``bitpress export`` with the default exporter choice (``--exporter auto``);
* ``float, builder`` and ``float, mobius``: the same with each exporter named;
* ``rtn_hf, builder`` / ``rtn_hf, mobius``: ``quantize --algorithm rtn_hf`` (group 16), then export;
* ``rtn of the package``: ONNX ``rtn`` (int4, block 32) of the ``float, auto`` package.

Every export is checked by bitpress against transformers (:mod:`bitpress.genai.check`: logits of
two prompts, prefill and decode, on float activations); a cell reads:

* ``passes (d)``: built and checked, ``d`` the largest logit difference against transformers'
  forward (float) or bitpress's quantized PyTorch model (rtn_hf);
* ``refused``: stopped before any exporter ran, with the one line shown under the table;
* ``FAILS``: stopped after the exporter began (the exporter crashed, the package does not run, or
  its logits differ): what the matrix exists to show, and what no cell should read.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import ROOT, WORK, Progress, doc_arguments, doc_meta, markdown_table, provenance, write_report

DOC = ROOT / "docs" / "architectures.md"
CELLS = ("float, auto", "float, builder", "float, mobius", "rtn_hf, builder", "rtn_hf, mobius", "rtn of the package")
#: words of the errors raised after an exporter began (everything else is a refusal before the build)
AFTER_BUILD = ("failed on", "differ from transformers", "cannot generate", "cannot load", "fails the ONNX checker",
               "cannot run the package", "did not finish", "wrote no")


@dataclass
class Row:
    name: str
    model_type: str
    cells: dict[str, dict[str, Any]] = field(default_factory=dict)


def _check_of(folder: Path) -> dict[str, Any]:
    made = json.loads((folder / "bitpress-manifest.json").read_text()).get("made") or {}
    return {"check": made.get("check"), "exporter": made.get("exporter"), "choice": made.get("exporter_choice")}


def _cell(fn: Any) -> dict[str, Any]:
    from bitpress.errors import BitpressError

    t0 = time.perf_counter()
    try:
        extra = fn() or {}
        status, reason = extra.pop("status", "passes"), extra.pop("reason", "")
    except BitpressError as exc:
        reason = str(exc).splitlines()[0]
        before = "refused before the build" in reason or reason.startswith("no exporter builds")
        status = "FAILS" if not before and any(w in reason for w in AFTER_BUILD) else "refused"
        extra = {}
    except Exception as exc:  # an internal error is a failure of bitpress, shown as such
        reason = f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        status, extra = "FAILS", {}
    return {"status": status, "reason": reason, "seconds": time.perf_counter() - t0, **extra}


def run_model(name: str, work: Path, say: Progress) -> Row:
    import bitpress
    from bitpress.hf.tiny import TINY, build_tiny

    model_type = TINY[name][0]
    slug = name.replace(" ", "_").replace("(", "").replace(")", "")
    base = work / slug
    shutil.rmtree(base, ignore_errors=True)
    src = build_tiny(name, base / "hf" / slug)
    row = Row(name, model_type)

    def export(folder: Path, exporter: str, out: Path) -> dict[str, Any]:
        bitpress.run({"input": str(folder), "output": str(out),
                      "passes": [{"type": "hf_to_genai", "exporter": exporter}]}, overwrite=True)
        return _check_of(out / folder.name)

    def rtn_hf(exporter: str) -> dict[str, Any]:
        q = base / "rtn_hf"
        if not (q / slug / "config.json").exists():
            bitpress.run({"input": str(src), "output": str(q),
                          "passes": [{"type": "rtn_hf", "group_size": 16}]}, overwrite=True)
        return export(q / slug, exporter, base / f"rtn_hf-{exporter}")

    def rtn_package() -> dict[str, Any]:
        pkg = base / "float-auto" / slug
        if not pkg.is_dir():
            return {"status": "-", "reason": "no float, auto package to quantize"}
        bitpress.run({"input": str(pkg), "output": str(base / "rtn-package"),
                      "passes": [{"type": "rtn", "bits": 4, "block_size": 32}]}, overwrite=True)
        return {}

    jobs = {
        "float, auto": lambda: export(src, "auto", base / "float-auto"),
        "float, builder": lambda: export(src, "builder", base / "float-builder"),
        "float, mobius": lambda: export(src, "mobius", base / "float-mobius"),
        "rtn_hf, builder": lambda: rtn_hf("builder"),
        "rtn_hf, mobius": lambda: rtn_hf("mobius"),
        "rtn of the package": rtn_package,
    }
    for cell_name, fn in jobs.items():
        row.cells[cell_name] = _cell(fn)
        c = row.cells[cell_name]
        say(f"{name:<16} {cell_name:<20} {c['status']:<8} {c['seconds']:5.1f}s {c['reason'][:150]}")
    return row


def _text(c: dict[str, Any]) -> str:
    if c["status"] != "passes":
        return c["status"]
    chk = c.get("check")
    text = f"passes ({chk['max_abs']:.0e})" if chk else "passes"
    choice = c.get("choice") or ""
    if choice and "(named)" not in choice:  # auto: which exporter it took
        text += f", {choice.split(':')[0]}"
    return text


def _claims() -> dict[str, list[str]]:
    from bitpress.genai.exporters import builder_architectures, mobius_model_types

    return {"builder": sorted(builder_architectures()), "mobius": sorted(mobius_model_types())}


def render(meta: dict[str, Any], rows: list[Row]) -> str:
    lines = [
        "# Architectures: every model type the exporters claim, exported right or refused before the build",
        "",
        provenance(meta),
        "",
        "Tiny random checkpoints (`bitpress.hf.tiny`: float32, hidden 64, two layers, one of each attention type where "
        "the model mixes them, weights ~ N(0, 0.1)) through the paths a user takes. Every export is compared by "
        "bitpress with transformers (`bitpress.genai.check`: two prompts, prefill and three decode steps, float "
        "activations); a cell **passes (d)** with `d` the largest logit difference, is **refused** before any exporter "
        "ran (the line below the table says why and what works), or **FAILS** after the exporter began. "
        "`rtn of the package` is ONNX `rtn` int4 of the `float, auto` package.",
        "",
        markdown_table(["model type", *CELLS], [[r.name, *(_text(r.cells[c]) for c in CELLS)] for r in rows]),
        "",
        "## Why a cell is refused or fails",
        "",
    ]
    for r in rows:
        for c in CELLS:
            cell = r.cells[c]
            if cell["status"] not in ("passes", "-"):
                lines.append(f"- **{r.name}, {c}** ({cell['status']}): {cell['reason']}")
    failing = sum(cell["status"] == "FAILS" for r in rows for cell in r.cells.values())
    lines += ["", f"Cells that fail after the build began: **{failing}**.", ""]
    claims = meta.get("claims") or {}
    if claims:
        lines += [
            "## What the exporters claim",
            "",
            f"The GenAI builder's `create_model` dispatches on {len(claims['builder'])} `architectures` and mobius's "
            f"registry lists {len(claims['mobius'])} `model_type`s (`bitpress.genai.exporters`; most are encoders, "
            "vision, speech or diffusion models, which `hf_to_genai` does not build). The decoder types above are "
            "the ones measured; every other type a user exports goes through the same comparison with transformers, "
            "so a wrong build stops with nothing written instead of passing silently.",
            "",
            f"- builder: {', '.join(claims['builder'])}",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bitpress.hf.tiny import TINY

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    doc_arguments(p, DOC)
    p.add_argument("--only", help="comma-separated names of bitpress.hf.tiny.TINY (default: all)")
    p.add_argument("--render-only", action="store_true", help="the document again from the last run's results.json")
    args = p.parse_args(argv)
    work = WORK / "architectures"
    if args.render_only:
        saved = json.loads((work / "results.json").read_text())
        meta, rows = saved["meta"], [Row(**r) for r in saved["rows"]]
        meta.setdefault("claims", _claims())
        args.out.write_text(render(meta, rows), encoding="utf-8")
        print(f"wrote {args.out}")
        return 0
    names = args.only.split(",") if args.only else list(TINY)
    logging.basicConfig(level=logging.WARNING)
    say = Progress("arch", 6)
    rows = [run_model(n, work, say) for n in names]
    meta = doc_meta("architectures.py", args, argv, say, ROOT / ".venv" / "bin" / "python",
                    ("onnxruntime", "onnxruntime-genai", "mobius-onnx", "transformers", "torch"), claims=_claims())
    write_report(work, args.out, meta, rows, render)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
