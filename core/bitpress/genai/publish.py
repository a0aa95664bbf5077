"""``bitpress publish CONFIG``: one Hugging Face model to a tree of GenAI packages, one per dtype x EP
and quantized variant, in the Hub layout users upload as is.

A config (YAML or JSON; paths relative to it)::

    input: SmolLM2-135M                 # a Hugging Face folder
    output: published
    matrix:
      dtypes: [f32, f16]                # float cells: <output>/<dtype>/<ep>/
      eps: [cpu, cuda]
      variants:                         # quantized cells: <output>/<variant>/<ep>/
        int4-rtn: [{type: rtn_hf, bits: 4, group_size: 64, sym: false}]
        int4-gptq:
          passes: [{type: gptq_hf, bits: 4, group_size: 64, sym: false}]
          data: {source: calib.txt, samples: 32}
          eps: [cpu]                    # the variant's own EPs (default: matrix.eps)
        int4-tied:
          passes: [{type: rtn_hf, bits: 4, group_size: 64, lm_head: true, embeds: true}]
          genai: {exporter: mobius}     # the variant's own hf_to_genai options (over matrix.genai)
      folders: {cpu: default}           # EP -> folder name (default: the EP's name)
      genai: {accuracy_level: 4}        # options of hf_to_genai for every cell
      eval: {text: wiki.txt, windows: 16, seq_len: 128}   # figures in each manifest (optional)

Every cell is a complete package (every sub-model, ``genai_config.json``, tokenizer and
processor files) with its ``bitpress-manifest.json``. A variant's passes run once; its checkpoint
is built for each of its EPs. A cell that fails (an exporter's reason, a checkpoint the builder
cannot take) is reported with its reason and leaves nothing; the others complete.
``<output>/bitpress-publish.json`` lists every cell and its outcome.

With ``matrix.eval``, every package this machine can run (``cpu`` / ``default`` EPs) is
evaluated against the reference cell (``eval.reference``, default the first float cell on such
an EP): perplexity on the text's windows, its change, top-1 agreement and the largest logits
difference, recorded in the cell's manifest (``eval``) and in the index.

The top of :mod:`bitpress.genai`: each cell is a whole run (:func:`bitpress.workflow.runner.run`, the
``hf_to_genai`` pass building the package with :mod:`bitpress.genai.export`) and evaluation
(:mod:`bitpress.evaluate`), so nothing below the workflow imports this module.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bitpress import hub
from bitpress.errors import BitpressError, ConfigError, OutputError

log = logging.getLogger(__name__)

INDEX = "bitpress-publish.json"
_CELL_KEYS = {"passes", "data", "eps", "genai"}
_MATRIX_KEYS = {"dtypes", "eps", "variants", "folders", "genai", "eval"}
_EVAL_KEYS = {"text", "windows", "seq_len", "reference", "speed", "speed_runs"}
_RUNNABLE = ("cpu", "default")  # EPs whose packages ONNX Runtime's CPU EP runs


@dataclass
class Cell:
    folder: str  # relative to the output
    dtype: str | None  # float cells
    ep: str
    variant: str | None = None
    status: str = "pending"  # ok | failed
    reason: str = ""
    seconds: float = 0.0
    eval: dict[str, Any] | None = None
    kept: bool = False  # built by an earlier run and kept (``keep``), not built again


@dataclass
class PublishResult:
    output: Path
    cells: list[Cell] = field(default_factory=list)
    #: a Hub id input's repo, revision and commit (:meth:`bitpress.hub.HubModel.record`); None for a local one
    source: dict[str, Any] | None = None

    @property
    def failed(self) -> list[Cell]:
        return [c for c in self.cells if c.status != "ok"]

    def to_json(self) -> dict[str, Any]:
        # ``kept`` is this run's business: an index rewritten over kept cells stays byte for byte what it was
        return {"output": str(self.output), "source": self.source,
                "cells": [{k: v for k, v in c.__dict__.items() if k != "kept"} for c in self.cells]}


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} must be a non-empty list")
    return value


def _check_genai(genai: Any, where: str) -> None:
    if not isinstance(genai, dict) or {"dtype", "ep", "type"} & set(genai):
        raise ConfigError(f"{where} takes hf_to_genai options other than dtype and ep (the matrix sets them)")


def _variants(raw: Any, eps: list[str]) -> dict[str, dict[str, Any]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError("matrix.variants must map variant names to a list of passes (or {passes, data, eps})")
    out = {}
    for name, spec in raw.items():
        if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or name.startswith("."):
            raise ConfigError(f"matrix.variants: {name!r} is not a folder name")
        if isinstance(spec, list):
            spec = {"passes": spec}
        if not isinstance(spec, dict) or set(spec) - _CELL_KEYS or not isinstance(spec.get("passes"), list) \
                or not spec["passes"]:
            raise ConfigError(f"matrix.variants.{name} must be a list of passes, or {{passes, data, eps, genai}}")
        genai = spec.get("genai") or {}
        _check_genai(genai, f"matrix.variants.{name}.genai")
        out[name] = {"passes": spec["passes"], "data": spec.get("data"), "genai": genai,
                     "eps": _list(spec.get("eps"), f"matrix.variants.{name}.eps") or eps}
    return out


def plan_cells(config: dict[str, Any]) -> tuple[list[Cell], dict[str, dict[str, Any]]]:
    matrix = config.get("matrix")
    if not isinstance(matrix, dict):
        raise ConfigError("a publish config needs a matrix: {dtypes, eps, variants}")
    unknown = set(matrix) - _MATRIX_KEYS
    if unknown:
        raise ConfigError(f"matrix: unknown key(s) {', '.join(sorted(unknown))}; "
                          f"known: {', '.join(sorted(_MATRIX_KEYS))}")
    eps = [str(e) for e in _list(matrix.get("eps"), "matrix.eps")] or ["cpu"]
    folders = matrix.get("folders") or {}
    if not isinstance(folders, dict):
        raise ConfigError("matrix.folders must map EP names to folder names")
    variants = _variants(matrix.get("variants"), eps)
    cells = [Cell(f"{d}/{folders.get(e, e)}", str(d), e) for d in _list(matrix.get("dtypes"), "matrix.dtypes")
             for e in eps]
    cells += [Cell(f"{v}/{folders.get(e, e)}", None, e, v) for v, spec in variants.items() for e in spec["eps"]]
    if not cells:
        raise ConfigError("the matrix has no cells: give dtypes and/or variants")
    names = [c.folder for c in cells]
    if len(set(names)) != len(names):
        raise ConfigError(f"two cells write the same folder: {sorted(n for n in names if names.count(n) > 1)[0]}")
    return cells, variants


def _hub_tokenizer(data: Any, source: hub.HubModel | None, where: str) -> Any:
    """A variant's calibration data with a Hub id ``tokenizer`` made the local folder of its tokenizer; without a
    tokenizer, a Hub input whose subfolder has none reads the one at its repo's root (as ``bitpress run`` does)."""
    tokenizer = data.get("tokenizer") if isinstance(data, dict) else None
    if isinstance(tokenizer, str) and hub.hub_id(tokenizer) is not None:
        path, found = hub.resolve(tokenizer, what=f"{where}.tokenizer", kind="tokenizer")
        return {**data, "tokenizer": str(found.tokenizer_dir or path if found is not None else path)}
    if tokenizer is None and source is not None and source.tokenizer_dir not in (None, source.path):
        given = {"source": data} if isinstance(data, str) else data
        if isinstance(given, dict):
            return {**given, "tokenizer": str(source.tokenizer_dir)}
    return data


def publish(config: dict[str, Any], *, overwrite: bool = False, progress: Any = None,
            keep: bool = False) -> PublishResult:
    """Build every cell of ``config`` (see the module's docstring).

    ``input`` may be a Hugging Face Hub id ``org/name[@revision]`` (a string that is not a local path; its
    ``subfolder`` the checkpoint's folder inside the repo), resolved from the Hub cache (offline) or downloaded
    into it before anything is built; every package's manifest (``made.input``) and the index (``source``) say
    which commit it came from. A variant's ``data: {tokenizer: org/name}`` may be one too.
    """
    from bitpress.workflow.runner import run

    for key in ("input", "output"):
        if not isinstance(config.get(key), str | Path):
            raise ConfigError(f"a publish config needs {key}: a path (or, input, a Hugging Face Hub id)")
    known = ("input", "subfolder", "output", "matrix", "jobs")
    unknown = set(config) - set(known)
    if unknown:
        raise ConfigError(f"unknown publish key(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    if config.get("subfolder") is not None and not isinstance(config["subfolder"], str):
        raise ConfigError(f"subfolder: expected a folder name inside the input, got {config['subfolder']!r}")
    cells, variants = plan_cells(config)
    genai = config["matrix"].get("genai") or {}
    _check_genai(genai, "matrix.genai")
    if config["matrix"].get("eval") is not None:
        check_eval(config["matrix"]["eval"])  # before anything is built
    # a Hub id: its snapshot folder (the safetensors checkpoint and tokenizer files only), before anything is built
    src, found = hub.resolve(config["input"], subfolder=config.get("subfolder"), what="input", kind="safetensors")
    origin = None if found is None else found.record()
    if found is not None:
        if not any(f.endswith(".safetensors") for f in found.allow_patterns):
            where = f"the top of {found.subfolder}" if found.subfolder else "its root"
            raise hub.HubError(f"input {config['input']}: the repo holds no safetensors checkpoint at {where} "
                               f"(commit {found.commit}); publish builds from a Hugging Face checkpoint (subfolder: "
                               "names its folder inside the repo)")
        log.info("publish: %s", hub.describe(found))
    for name, spec in variants.items():
        if spec["data"] is not None:
            spec["data"] = _hub_tokenizer(spec["data"], found, f"matrix.variants.{name}.data")
    # what the runs name their folder output: the input's name, or the Hub repo's (not the cache's commit folder)
    made = src.name if origin is None else str(origin["hub"]).rsplit("/", 1)[-1]
    out = Path(config["output"])
    _make_output_folder(out)
    result = PublishResult(out, source=origin)
    before = _build_times(out / INDEX) if keep else {}
    with tempfile.TemporaryDirectory(prefix=".bitpress-publish-", dir=out) as tmp:
        checkpoints: dict[str, Path | BitpressError] = {}

        def _build(cell: Cell) -> None:
            dest = out / cell.folder
            source = src
            if cell.variant is not None:
                got = checkpoints.get(cell.variant)
                if got is None:  # the variant's passes, once
                    spec = variants[cell.variant]
                    wf: dict[str, Any] = {"input": str(src), "output": str(Path(tmp) / "ckpt" / cell.variant),
                                          "passes": spec["passes"]}
                    if spec["data"] is not None:
                        wf["data"] = spec["data"]
                    try:
                        run(wf, progress=progress, origin=origin)
                        got = Path(tmp) / "ckpt" / cell.variant / made
                    except BitpressError as exc:
                        got = exc
                    checkpoints[cell.variant] = got
                if isinstance(got, BitpressError):
                    raise got
                source = got
            own = variants[cell.variant]["genai"] if cell.variant is not None else {}
            step = {"type": "hf_to_genai", **genai, **own, "ep": cell.ep, "dtype": cell.dtype or "auto"}
            built = Path(tmp) / "cells" / cell.folder
            run({"input": str(source), "output": str(built), "passes": [step]}, progress=progress, origin=origin)
            if dest.exists():
                shutil.rmtree(dest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(built / made), str(dest))

        for cell in cells:
            t0 = time.perf_counter()
            dest = out / cell.folder
            try:
                if dest.exists() and not overwrite:
                    if not keep:
                        raise OutputError(f"{dest} exists (use --overwrite to replace it)")
                    _check_kept(dest)  # ``keep``: a package built before is used as it is, if it is whole
                    cell.kept = True
                    log.info("cell %s: kept as built before (it matches its manifest)", cell.folder)
                else:
                    _build(cell)
                cell.status = "ok"
            except BitpressError as exc:
                cell.status, cell.reason = "failed", str(exc)
                log.warning("cell %s failed: %s", cell.folder, exc)
            # a kept cell reports the time it took when it was built (the index stays as it was)
            cell.seconds = before.get(cell.folder, 0.0) if cell.kept else time.perf_counter() - t0
            result.cells.append(cell)
    if config["matrix"].get("eval"):
        evaluate_cells(result, config["matrix"]["eval"], progress=progress)
    (out / INDEX).write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return result


def _build_times(index: Path) -> dict[str, float]:
    """Seconds each cell took, from an earlier run's index (kept cells report them again)."""
    try:
        cells = json.loads(index.read_text())["cells"]
        return {c["folder"]: float(c["seconds"]) for c in cells if c.get("status") == "ok"}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return {}


def _check_kept(dest: Path) -> None:
    """A cell folder an earlier run built, kept only when it matches its manifest (else the cell fails)."""
    from bitpress.genai.manifest import MANIFEST, verify

    if not (dest / MANIFEST).is_file():
        raise OutputError(f"{dest} exists but has no {MANIFEST} (not a package bitpress built): remove it or use "
                          "--overwrite")
    res = verify(dest)
    if not res.ok or res.unlisted:
        extra = [f"{len(res.unlisted)} unlisted: {', '.join(res.unlisted[:3])}"] if res.unlisted else []
        raise OutputError(f"{dest} exists but does not match its {MANIFEST} ({'; '.join(res.problems() + extra)}): "
                          "use --overwrite to build it again")


def _make_output_folder(out: Path) -> None:
    """The publish output: a folder, by the output rule every command shares (docs/security.md); refused
    before anything is built when it is named like a model file, is a file, or cannot be created."""
    from bitpress import output

    output.check_output_name(out, True, "publish writes a tree of packages")
    target = output.final_path(out)
    output.check_existing_kind(target, out, folder=True)
    output.check_parent(target, out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output.write_error(exc, out, creating=True) or exc from None


def check_eval(spec: Any) -> dict[str, Any]:
    """``matrix.eval``, checked: a text file, windows and seq_len > 0, an optional reference folder."""
    if not isinstance(spec, dict) or set(spec) - _EVAL_KEYS or not isinstance(spec.get("text"), str | Path):
        raise ConfigError(f"matrix.eval must be {{text: FILE, windows: N, seq_len: N, reference: FOLDER, speed: "
                          "true|false, speed_runs: N}} "
                          f"(text required), got {spec!r}")
    out = {"text": Path(spec["text"]), "windows": spec.get("windows", 16), "seq_len": spec.get("seq_len", 128),
           "reference": spec.get("reference"), "speed": spec.get("speed", True),
           "speed_runs": spec.get("speed_runs", 3)}
    for key in ("windows", "seq_len", "speed_runs"):
        if not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] <= 0:
            raise ConfigError(f"matrix.eval.{key} must be a positive integer, got {out[key]!r}")
    if not isinstance(out["speed"], bool):
        raise ConfigError(f"matrix.eval.speed must be true or false, got {out['speed']!r}")
    if not out["text"].is_file():
        raise ConfigError(f"matrix.eval.text: {out['text']} is not a file")
    return out


def evaluate_cells(result: PublishResult, spec: dict[str, Any], *, progress: Any = None) -> None:
    """Evaluate every runnable ok cell against the reference cell; figures to its manifest and cell."""
    from bitpress.evaluate.runner import evaluate
    from bitpress.genai.manifest import MANIFEST, add_evaluation

    ev = check_eval(spec)
    ok = [c for c in result.cells if c.status == "ok" and c.ep in _RUNNABLE]
    ref_name = ev["reference"] or next((c.folder for c in ok if c.dtype is not None), None)
    ref = next((c for c in ok if c.folder == ref_name), None)
    if ref is None:
        log.warning("matrix.eval: no reference package (%s) built on cpu/default: nothing evaluated", ref_name)
        return
    for cell in ok:
        if cell.kept:  # built and evaluated by an earlier run: its figures stay (a push then sends no new bytes)
            try:
                kept = json.loads((result.output / cell.folder / MANIFEST).read_text()).get("eval")
            except (OSError, json.JSONDecodeError, AttributeError):
                kept = None
            if isinstance(kept, dict) and kept.get("reference") == ref.folder:
                cell.eval = kept
                continue
        try:
            res = evaluate(result.output / cell.folder, result.output / ref.folder, text=ev["text"],
                           seq_len=ev["seq_len"], max_windows=ev["windows"], weights=False, progress=progress,
                           speed=ev["speed"], speed_runs=ev["speed_runs"])
        except BitpressError as exc:
            log.warning("cell %s: evaluation failed: %s", cell.folder, exc)
            cell.eval = {"error": str(exc)}
            continue
        lg = res.logits()
        ppl = res.perplexity
        cell.eval = {
            "reference": ref.folder, "text": ev["text"].name, "windows": ppl.windows if ppl else None,
            "seq_len": ev["seq_len"], "perplexity": ppl.quantized if ppl else None,
            "reference_perplexity": ppl.reference if ppl else None,
            "perplexity_change": ppl.relative_change if ppl else None,
            "top1_agreement": lg.top1_agreement if lg else None,
            "max_abs_logits_error": lg.max_abs_error if lg else None,
        }
        if res.speed:  # measured alternately with the reference package, on this machine
            sp, q = res.speed, res.speed["quantized"]
            cell.eval["speed"] = {
                "prompt_tokens_per_s": q["prompt_tokens_per_s"], "decode_tokens_per_s": q.get("decode_tokens_per_s"),
                "peak_rss": q["peak_rss"], "load_s": q["load_s"], "ratios_to_reference": sp["ratios"],
                "threads": sp["threads"], "runs": sp["runs"], "prompt_tokens": sp["prompt_tokens"],
                "cpu": sp["machine"]["cpu"], "cpu_flags": sp["machine"]["flags"], "versions": sp["machine"]["versions"],
            }
        add_evaluation(result.output / cell.folder, cell.eval)


def load_publish_config(path: Path) -> dict[str, Any]:
    """A publish config from a file: input, output and the variants' data files relative to its folder; an
    ``input`` or a variant's ``tokenizer`` that is a Hugging Face Hub id (no file or folder of that name there)
    is kept as written, for :func:`publish` to resolve."""
    from bitpress.workflow.config import load_config

    data = load_config(Path(path))
    base = Path(path).parent
    if isinstance(data.get("input"), str):  # load_config joined it to the folder: the Hub id as written
        try:
            written = Path(data["input"]).relative_to(base).as_posix()
        except ValueError:
            written = data["input"]
        if hub.hub_id(written, base) is not None:
            data["input"] = written
    ev = (data.get("matrix") or {}).get("eval") if isinstance(data.get("matrix"), dict) else None
    if isinstance(ev, dict) and isinstance(ev.get("text"), str) and not Path(ev["text"]).is_absolute():
        ev["text"] = str(base / ev["text"])
    variants = (data.get("matrix") or {}).get("variants") if isinstance(data.get("matrix"), dict) else None
    if isinstance(variants, dict):
        for spec in variants.values():
            calib = spec.get("data") if isinstance(spec, dict) else None
            if isinstance(calib, str):
                calib = spec["data"] = {"source": calib}
            if isinstance(calib, dict):
                for key in ("source", "tokenizer"):
                    value = calib.get(key)
                    if isinstance(value, str) and value and value != "random" and not Path(value).is_absolute() \
                            and not (key == "tokenizer" and hub.hub_id(value, base) is not None):
                        calib[key] = str(base / value)
    return data
