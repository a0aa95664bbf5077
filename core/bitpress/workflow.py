"""Run a workflow: input model -> ordered passes -> output, written atomically.

The output is assembled in a private temporary folder next to its final place and moved
there only when every pass, save and check has succeeded, so a failed or interrupted run
leaves nothing behind. The input is only ever read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bitpress.errors import ConfigError, OutputError, PassNotFoundError, UsageError
from bitpress.models.base import ModelHandle
from bitpress.models.onnx_model import OnnxModel
from bitpress.models.package import OnnxPackage
from bitpress.onnx.save import SaveOptions
from bitpress.onnx.tensors import is_external, iter_tensors
from bitpress.passes import Pass, PassContext
from bitpress.plugins import Registry, canonical_precision, get_registry

log = logging.getLogger(__name__)


@dataclass
class PassStep:
    """One configured pass: a pass instance and where it came from in the config."""

    pass_: Pass
    label: str


@dataclass
class Workflow:
    input: Path
    output: Path
    steps: list[PassStep]
    components: list[str] | None = None
    jobs: int | None = None
    overwrite: bool = False
    save: SaveOptions = field(default_factory=SaveOptions)
    data: Any = None  # a bitpress.data.DataConfig for passes that use calibration data


@dataclass
class RunResult:
    output: Path
    files: list[Path]
    seconds: dict[str, float]
    input_bytes: int
    output_bytes: int
    #: (pass name, model source, report) for passes that report (weight-only passes do)
    reports: list[tuple[str, Path, Any]] = field(default_factory=list)
    #: the models' own bytes (.onnx + external data) of what the passes ran on, in and out; the
    #: rest of ``input_bytes`` / ``output_bytes`` is companion files copied as they are (tokenizer, config)
    input_model_bytes: int | None = None
    output_model_bytes: int | None = None
    #: what the user should know about the output (e.g. the ONNX checker rejects it, as it does the input)
    notes: list[str] = field(default_factory=list)

    @property
    def companion_bytes(self) -> int:
        return 0 if self.output_model_bytes is None else self.output_bytes - self.output_model_bytes

    @property
    def ratio(self) -> float:
        """How many times smaller the models got (companion files left out)."""
        inp = self.input_model_bytes if self.input_model_bytes is not None else self.input_bytes
        out = self.output_model_bytes if self.output_model_bytes is not None else self.output_bytes
        return inp / out if out else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "files": [str(f) for f in self.files],
            "seconds": self.seconds,
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
            "input_model_bytes": self.input_model_bytes,
            "output_model_bytes": self.output_model_bytes,
            "companion_bytes": self.companion_bytes,
            "ratio": round(self.ratio, 4),
            "notes": list(self.notes),
            "reports": [
                {"pass": name, "model": str(src), "summary": rep.summary() if hasattr(rep, "summary") else str(rep),
                 **(rep.to_json() if callable(getattr(rep, "to_json", None)) else {})}
                for name, src, rep in self.reports
            ],
        }


# -- building a workflow from a config --------------------------------------------------------
def load_config(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON/YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping")
    base = path.parent
    for key in ("input", "output"):
        if isinstance(data.get(key), str) and not Path(data[key]).is_absolute():
            data[key] = str(base / data[key])
    # calibration data files too (a source string, or a mapping's source / tokenizer)
    calib = data.get("data")
    if isinstance(calib, str) and calib != "random" and not Path(calib).is_absolute():
        data["data"] = str(base / calib)
    elif isinstance(calib, dict):
        calib = data["data"] = dict(calib)
        for key in ("source", "tokenizer"):
            value = calib.get(key)
            if isinstance(value, str) and value != "random" and not Path(value).is_absolute():
                calib[key] = str(base / value)
    return data


_TOP_KEYS = {"input", "output", "passes", "components", "jobs", "overwrite", "save", "data", "env_timeout",
             "input_model", "output_dir"}


def build_workflow(config: dict[str, Any], registry: Registry | None = None) -> Workflow:
    """Validate a config (dict) and build every pass; fails before any work is done."""
    registry = registry or get_registry()
    unknown = sorted(set(config) - _TOP_KEYS)
    if unknown:
        valid = ", ".join(sorted(_TOP_KEYS - {"input_model", "output_dir"}))
        raise ConfigError(f"unknown config key(s) {', '.join(unknown)}; valid: {valid}")
    src = config.get("input")
    if src is None and isinstance(config.get("input_model"), dict):  # Olive-style
        src = config["input_model"].get("model_path")
    dst = config.get("output", config.get("output_dir"))
    if not src or not dst:
        raise ConfigError("the config needs 'input' (a model) and 'output' (where to write it)")
    raw_passes = config.get("passes") or []
    if isinstance(raw_passes, dict):  # Olive-style {"name": {"type": ..., ...}}
        raw_passes = [dict(v, _label=k) for k, v in raw_passes.items()]
    if not isinstance(raw_passes, list) or not raw_passes:
        raise ConfigError("the config needs a non-empty 'passes' list")
    steps = []
    model_kind: str | None = None
    for i, entry in enumerate(raw_passes):
        if not isinstance(entry, dict) or "type" not in entry:
            raise ConfigError(f"passes[{i}] must be a mapping with a 'type' (a pass name)")
        entry = dict(entry)
        label = str(entry.pop("_label", f"passes[{i}]"))
        kind = str(entry.pop("type"))
        precision = entry.pop("precision", None)
        options = entry.pop("options", {}) or {}
        if not isinstance(options, dict):
            raise ConfigError(f"{label}: 'options' must be a mapping")
        # where the pass runs: `here` or a plugin environment (bitpress env create); default: where it can
        env = entry.pop("env", None)
        env_timeout = entry.pop("env_timeout", config.get("env_timeout"))
        options = {**entry, **options}
        try:
            if env is None:
                if model_kind is None:
                    model_kind = input_kind(registry, Path(src))
                cls = _resolve_pass(registry, kind, precision, model_kind)
            else:
                from bitpress.envs import pinned_pass

                cls = pinned_pass(registry, env, kind, precision, _resolve_pass)
        except PassNotFoundError as exc:
            where = getattr(exc, "key", None)  # the setting that was wrong: name it as the user wrote it
            if where is None:
                raise
            raise PassNotFoundError(f"{label}.{where}: {exc}") from None
        precision = canonical_precision(cls, precision)  # INT4 -> int4, as the pass declares it
        pass_ = cls.from_config(options, precision)
        if cls.output_kind is not None:  # later algorithm names are chosen for the converted model
            model_kind = cls.output_kind
        if env_timeout is not None:
            from bitpress.envs.remote import parse_timeout

            # seconds; only used when the pass runs in a plugin environment
            pass_.env_timeout = parse_timeout(env_timeout, f"{label}: env_timeout")  # type: ignore[attr-defined]
        steps.append(PassStep(pass_, label))
    save = config.get("save") or {}
    try:
        save_opts = SaveOptions(**save)
    except TypeError as exc:
        raise ConfigError(f"save: {exc}; valid keys: external_data, max_shard_size, check") from None
    comps = config.get("components")
    if isinstance(comps, str):
        comps = [comps]
    data = None
    if config.get("data") is not None:
        from bitpress.data import DataConfig

        data = DataConfig.from_value(config["data"])
    return Workflow(
        input=Path(src), output=Path(dst), steps=steps, components=comps,
        jobs=config.get("jobs"), overwrite=bool(config.get("overwrite", False)), save=save_opts, data=data,
    )


def _resolve_pass(registry: Registry, kind: str, precision: str | None, model_kind: str = "onnx") -> type[Pass]:
    """A config's ``type``: a pass name, an Olive pass type a plugin maps, or an algorithm (any case)."""
    from bitpress.plugins import did_you_mean

    if kind in registry.passes:
        return registry.get_pass(kind)
    aliases = {a: cls for cls in registry.passes.values() for a in getattr(cls, "aliases", ())}
    if kind in aliases:
        return registry.get_pass(aliases[kind].name)
    key = str(kind).casefold()
    algorithms = {a for cls in registry.passes.values() for a in cls.algorithms}
    if key not in {a.casefold() for a in algorithms}:
        # a pass name or alias in another case (``RTN_HF``); an algorithm name (any case) picks
        # the pass by the model's kind below
        found = registry.find_pass(kind) or next(
            (cls for alias, cls in aliases.items() if alias.casefold() == key), None)
        if found is not None:
            return registry.get_pass(found.name)
        hint = did_you_mean(kind, [*registry.passes, *algorithms, *aliases])
        exc = PassNotFoundError(f"unknown pass {kind!r}{hint} (see `bitpress passes list`){registry.broken_hint()}")
        exc.key = "type"  # type: ignore[attr-defined]
        raise exc
    return registry.select(kind, precision, model_kind)


def input_kind(registry: Registry, path: Path) -> str:
    """The model kind passes are chosen for: what the loaders make of ``path``.

    Loading reads the graph or config only (weights stay on disk); a path that cannot be
    loaded counts as ONNX so that selection errors come first and the run reports the input's.
    """
    from bitpress.errors import BitpressError

    if Path(path).suffix.lower() == ".onnx":
        return "onnx"
    try:
        handle = registry.hook.bitpress_load_model(source=Path(path), options={})
    except BitpressError:
        return "onnx"
    kind = getattr(handle, "kind", "onnx")
    return "onnx" if kind == "onnx-folder" else kind


# -- running ------------------------------------------------------------------------------------
def run_workflow(
    wf: Workflow, registry: Registry | None = None, *, progress: Any = None
) -> RunResult:
    registry = registry or get_registry()
    src = wf.input
    if not src.exists():
        from bitpress.errors import ModelLoadError

        raise ModelLoadError(f"model not found: {src}")
    # a file output for `.onnx` or the input's own suffix (formats added by plugins), else a folder
    folder_out = src.is_dir() or wf.output.suffix.lower() not in {".onnx", src.suffix.lower()} - {""}
    _check_output(src, wf.output, folder_out, wf.overwrite)

    model = registry.hook.bitpress_load_model(source=src, options={})
    if model is None:
        raise UsageError(f"no plugin can load {src}")
    _check_output_spares_input(model, wf.output, folder_out)
    for step in wf.steps:
        kinds = step.pass_.model_kinds
        target_kind = "onnx" if isinstance(model, OnnxPackage) else model.kind
        if target_kind not in kinds:
            raise UsageError(f"{step.label}: pass {step.pass_.name} does not accept {target_kind} models")
        if step.pass_.needs_data and wf.data is None:
            raise UsageError(
                f"{step.label}: pass {step.pass_.name} needs calibration data: give --data "
                "(random, a .npz file or folder, or a .txt file with a tokenizer) or 'data:' in the config"
            )

    parent = wf.output.resolve().parent
    # folders this run creates for the output, deepest first: removed again if the run fails
    created = [d for d in (parent, *parent.parents) if not d.exists()]
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{wf.output.name}.bitpress-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    context = PassContext(workdir=tmp / "scratch", data=wf.data)
    if wf.jobs:
        context.jobs = max(1, int(wf.jobs))
    if progress is not None:
        context.progress = progress
    seconds: dict[str, float] = {}
    try:
        payload = tmp / "payload"
        if isinstance(model, OnnxPackage):
            files = _run_package(model, wf, registry, context, payload, seconds)
            staged = payload
        else:
            name = wf.output.name if not folder_out else src.name
            dest = payload / name
            model = _run_passes(model, wf, registry, context, seconds)
            t0 = time.perf_counter()
            files = _save(registry, model, dest, wf.save)
            _note_checker(context, model, dest)
            seconds["save"] = time.perf_counter() - t0
            staged = payload if folder_out else dest
        final_files = _move_into_place(staged, wf.output, folder_out, files, tmp)
        created = []
    finally:
        if isinstance(model, OnnxModel):
            model.close()
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:
            try:
                d.rmdir()
            except OSError:
                break
    in_bytes = _size_of(src)
    out_bytes = sum(f.stat().st_size for f in final_files if f.is_file())
    companions = int(context.extras.get("companion_bytes", 0))
    return RunResult(wf.output, final_files, seconds, in_bytes, out_bytes, list(context.extras.get("reports", [])),
                     input_model_bytes=int(context.extras.get("input_model_bytes", in_bytes)),
                     output_model_bytes=out_bytes - companions, notes=list(context.extras.get("notes", [])))


def _note_checker(context: PassContext, model: ModelHandle, dest: Path) -> None:
    """The saver's note that ``onnx.checker`` rejects the output as it does the input (ORT-only ops)."""
    note = getattr(model, "checker_note", None)
    if note:
        context.extras.setdefault("notes", []).append(
            f"{dest.name}: onnx.checker.check_model fails on it as on its input ({note}); ONNX Runtime loads it "
            "(ONNX Runtime GenAI builder exports use ORT-only ops in the default domain)"
        )


def _run_passes(
    model: ModelHandle, wf: Workflow, registry: Registry, context: PassContext, seconds: dict[str, float],
    prefix: str = "",
) -> ModelHandle:
    for step in wf.steps:
        if isinstance(model, OnnxModel):
            model.use_workdir(context.workdir)
        t0 = time.perf_counter()
        log.info("running %s (%s)%s", step.pass_.name, step.label, f" on {prefix}" if prefix else "")
        result = registry.hook.bitpress_run_pass(pass_=step.pass_, model=model, context=context)
        if result is None:
            raise UsageError(f"{step.label}: no plugin ran pass {step.pass_.name}")
        model = result
        key = f"{prefix}{step.pass_.name}"
        seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0
        record_pass(model, step.pass_)
    return model


#: the ONNX metadata_props key under which bitpress records the passes that made a model
METADATA_KEY = "bitpress"


def record_pass(model: ModelHandle, pass_: Pass) -> None:
    """Append ``pass_`` (name, plugin, options) to the ``bitpress`` metadata of an ONNX model.

    ``bitpress eval`` reads it back to name the algorithm and its options. The record holds
    nothing that varies between equal runs (no paths, times or thread counts), so the same
    pass on the same input still writes the same bytes.
    """
    if not isinstance(model, OnnxModel):
        return
    from bitpress import __version__
    from bitpress.options import as_dict

    props = model.proto.metadata_props
    index = next((i for i, p in enumerate(props) if p.key == METADATA_KEY), None)
    record: dict[str, Any] = {}
    if index is not None:
        try:
            record = json.loads(props[index].value)
        except ValueError:
            record = {}
        if not isinstance(record, dict) or not isinstance(record.get("passes"), list):
            record = {}
    try:
        options = as_dict(pass_.options)
    except TypeError:  # options that are not a dataclass
        options = {}
    record = {"version": __version__, "passes": [*record.get("passes", []), {
        "pass": pass_.name, "plugin": getattr(pass_, "plugin", "?"), "options": options,
    }]}
    value = json.dumps(record, sort_keys=True, default=str)
    if index is None:
        entry = props.add()
        entry.key = METADATA_KEY
    else:
        entry = props[index]
    entry.value = value


def _run_package(
    package: OnnxPackage, wf: Workflow, registry: Registry, context: PassContext, payload: Path,
    seconds: dict[str, float],
) -> list[Path]:
    chosen = package.select(wf.components)
    files: list[Path] = []
    # the ratio is over the models the passes run on; every other file is carried over as it is
    context.extras["input_model_bytes"] = sum(f.stat().st_size for rel in chosen for f in package.files_of(rel))
    for rel in chosen:
        model = package.component(rel)
        model = _run_passes(model, wf, registry, context, seconds, prefix=f"{rel}:")
        t0 = time.perf_counter()
        files += _save(registry, model, payload / rel, wf.save)
        _note_checker(context, model, payload / rel)
        seconds[f"{rel}:save"] = time.perf_counter() - t0
        if isinstance(model, OnnxModel):
            model.close()
    written = {f.resolve() for f in files}
    for src in package.companion_files(chosen):
        dst = payload / src.relative_to(package.root)
        if dst.resolve() in written:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        package.copy_file(src, dst)  # checked to stay inside the input folder right before it is read
        files.append(dst)
        context.extras["companion_bytes"] = context.extras.get("companion_bytes", 0) + dst.stat().st_size
    return files


def _save(registry: Registry, model: ModelHandle, dest: Path, save: SaveOptions) -> list[Path]:
    opts = {"external_data": save.external_data, "max_shard_size": save.max_shard_size, "check": save.check}
    files = registry.hook.bitpress_save_model(model=model, destination=dest, options=opts)
    if files is None:
        raise UsageError(f"no plugin can save a {model.kind} model")
    return [Path(f) for f in files]


#: the longest name (bytes) of one part of the output path: 255 on common file systems, less the
#: suffixes bitpress adds (``.data.NN``, the temporary folder's ``.bitpress-XXXXXXXX``)
MAX_OUTPUT_PART = 230


def _check_output(src: Path, out: Path, folder_out: bool, overwrite: bool) -> None:
    for part in out.parts:
        if len(os.fsencode(part)) > MAX_OUTPUT_PART:
            raise OutputError(
                f"the output name {part[:40]}... is {len(os.fsencode(part))} bytes long; at most {MAX_OUTPUT_PART} "
                "(file systems allow 255, and bitpress adds suffixes such as .data)"
            )
    if len(os.fsencode(str(out.absolute()))) > 3800:
        raise OutputError(f"the output path {str(out)[:60]}... is too long for the file system")
    src_r, out_r = src.resolve(), out.resolve()
    if src_r == out_r:
        raise OutputError(f"the output {out} is the input; choose another output path")
    if src.is_dir():
        if out_r.is_relative_to(src_r) or src_r.is_relative_to(out_r):
            raise OutputError(f"the output {out} overlaps the input folder {src}; choose a separate folder")
    else:
        target = out_r / src.name if folder_out else out_r
        inputs = {src_r} | {p.resolve() for p in src.parent.glob(src.name + ".data*")}
        data_out = {target} | {target.with_name(target.name + ".data")}
        if inputs & data_out or (folder_out and out_r == src_r.parent):
            raise OutputError(
                f"the output {out} would overwrite the input model or its data; choose another path"
            )
    if out.exists() and not overwrite:
        if out.is_dir() and not any(out.iterdir()):
            return
        raise OutputError(
            f"the output {out} already exists; remove it or pass --overwrite (overwrite=True from Python)"
        )


def _check_output_spares_input(model: ModelHandle, out: Path, folder_out: bool) -> None:
    """Refuse an output that would replace or contain a file the input reads (its data too).

    Moving the output into place replaces ``out`` (a whole folder, with --overwrite) and, for a
    single file, ``<out>.data*``: none of that may be the input's model or external data.
    """
    files = {model.source.resolve()}
    if isinstance(model, OnnxModel):
        files |= {model.resolver.path(t)[0].resolve() for t in iter_tensors(model.proto) if is_external(t)}
    out_r = out.resolve()
    for f in files:
        stale = not folder_out and f.parent == out_r.parent and f.name.startswith(out_r.name + ".data")
        if f.is_relative_to(out_r) or stale:
            raise OutputError(f"the output {out} would overwrite the input's file {f}; choose another path")


def _move_into_place(staged: Path, out: Path, folder_out: bool, files: list[Path], tmp: Path) -> list[Path]:
    if folder_out:
        if out.exists():
            old = tmp / "previous"
            os.replace(out, old)  # the old output stays whole until the new one is in place
        os.replace(staged, out)
        return [out / f.relative_to(staged) for f in files]
    # a single .onnx: move its data files first, the model last
    final = []
    for stale in out.parent.glob(out.name + ".data*"):
        stale.unlink()
    for f in sorted(files, key=lambda p: p.suffix == ".onnx"):
        dst = out.with_name(f.name)
        os.replace(f, dst)
        final.append(dst)
    return final


def _size_of(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size + sum(p.stat().st_size for p in path.parent.glob(path.name + ".data*"))
