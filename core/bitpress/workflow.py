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

from bitpress import crashwatch, output
from bitpress.errors import ConfigError, OutputError, PassNotFoundError, PluginError, UsageError
from bitpress.interrupts import deferred, note_written
from bitpress.models.base import ModelHandle
from bitpress.models.onnx_model import OnnxModel
from bitpress.models.onnx_package import OnnxPackage
from bitpress.onnx.save import SaveOptions
from bitpress.onnx.tensors import is_external, iter_tensors
from bitpress.passes import Pass, PassContext, sidecars
from bitpress.plugins import Registry, canonical_precision, check_result, get_registry

log = logging.getLogger(__name__)


@dataclass
class PassStep:
    """One configured pass: a pass instance and where it came from in the config."""

    pass_: Pass
    label: str
    #: run the pass in a worker process of this environment (``isolate: true``, ``--isolate``)
    isolate: bool = False


@dataclass
class Workflow:
    input: Path
    output: Path
    steps: list[PassStep]
    components: list[str] | None = None
    jobs: int | None = None
    overwrite: bool = False
    save: SaveOptions = field(default_factory=SaveOptions)
    data: Any = None  # a bitpress.calibration.data.DataConfig for passes that use calibration data
    #: run every pass in a worker process (``--isolate``): a native crash becomes a clean error
    isolate: bool = False
    #: where per-tensor work runs (``executor:``, ``--executor``): a bitpress.executors.ExecutorSpec; None: threads
    executor: Any = None


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
    #: (model or component, bitpress.onnx.kernels.RuntimePaths): the kernel each quantized node runs on
    runtime: list[tuple[str, Any]] = field(default_factory=list)

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
            "runtime": [{"model": where, **paths.to_json()} for where, paths in self.runtime],
            "reports": [
                {"pass": name, "model": str(src), "summary": rep.summary() if hasattr(rep, "summary") else str(rep),
                 **(rep.to_json() if callable(getattr(rep, "to_json", None)) else {})}
                for name, src, rep in self.reports
            ],
        }


# -- building a workflow from a config --------------------------------------------------------
#: a workflow config is small: larger files, deeper nesting or more values (YAML aliases expand)
#: are refused when it is read, before anything formats or walks them
MAX_CONFIG_BYTES = 16 << 20
MAX_CONFIG_DEPTH = 64
MAX_CONFIG_VALUES = 100_000
#: the most worker threads a config or call may ask for
MAX_JOBS = 4096


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing merge keys (``<<: [*a, *a]``) that multiply a mapping's size.

    Aliases of sequences and mappings are shared, not copied, when loading: the values they
    expand to are counted afterwards (:func:`_check_size`). Merges are copied here, so they are
    counted as they happen.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.merged = 0

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        super().flatten_mapping(node)
        self.merged += len(node.value)
        if self.merged > MAX_CONFIG_VALUES:
            raise yaml.constructor.ConstructorError(
                None, None, f"merge keys (<<) expand to more than {MAX_CONFIG_VALUES} values", node.start_mark)


def _yaml_message(exc: yaml.YAMLError) -> str:
    """PyYAML's (multi-line, caret-marked) message on one line: ``line 3, column 5: what``."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = "; ".join(str(p) for p in (exc.context, exc.problem) if p)
        return where + (what or type(exc).__name__)
    return str(exc)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _check_size(data: Any, where: str) -> None:
    """Refuse a config nested deeper than MAX_CONFIG_DEPTH or holding more than MAX_CONFIG_VALUES values.

    Values are counted as they expand: a YAML alias counts as many times as it is used (the
    "billion laughs"), and a structure that contains itself stops at the depth limit.
    """
    stack: list[tuple[Any, int]] = [(data, 1)]
    count = 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ConfigError(f"{where} holds more than {MAX_CONFIG_VALUES} values once its YAML aliases are "
                              "expanded; a workflow config is small")
        if isinstance(value, dict | list | tuple):
            if depth >= MAX_CONFIG_DEPTH:
                raise ConfigError(f"{where} is nested more than {MAX_CONFIG_DEPTH} levels deep")
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            if len(items) > MAX_CONFIG_VALUES:
                raise ConfigError(f"{where} holds more than {MAX_CONFIG_VALUES} values; a workflow config is small")
            stack.extend((item, depth + 1) for item in items)


def load_config(path: Path) -> dict[str, Any]:
    """Read a workflow config (JSON for ``.json``, else YAML); paths in it are made relative to its folder.

    Every way a file can be unreadable is one :class:`ConfigError` line: not UTF-8, not valid
    JSON / YAML (with the line and column), nested too deeply, too large, aliases that expand
    beyond :data:`MAX_CONFIG_VALUES` values, not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {size} bytes is too large for a workflow config (at most {MAX_CONFIG_BYTES})")
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the config {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    is_json = path.suffix.lower() == ".json"
    kind = "JSON" if is_json else "YAML"
    try:
        data = json.loads(text) if is_json else yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader subclass
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_one_line(_yaml_message(exc))}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid {kind}: nested too deeply (at most {MAX_CONFIG_DEPTH} levels)") from None
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. an integer of more than 4300 digits
        raise ConfigError(f"{path}: not valid {kind}: {_one_line(str(exc))}") from None
    _check_size(data, str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping (input, output, passes, ...), got {_kind(data)}")
    base = path.parent

    def relative(value: Any) -> Any:
        if isinstance(value, str) and value and value != "random" and not Path(value).is_absolute():
            return str(base / value)
        return value

    for key in ("input", "output", "output_dir"):
        if key in data and data[key] != "random":
            data[key] = relative(data[key])
    if isinstance(data.get("input_model"), dict) and "model_path" in data["input_model"]:  # Olive-style
        data["input_model"] = {**data["input_model"], "model_path": relative(data["input_model"]["model_path"])}
    # calibration data files too (a source string, or a mapping's source / tokenizer)
    calib = data.get("data")
    if isinstance(calib, str):
        data["data"] = relative(calib)
    elif isinstance(calib, dict):
        calib = data["data"] = dict(calib)
        for key in ("source", "tokenizer"):
            if key in calib:
                calib[key] = relative(calib[key])
    return data


_TOP_KEYS = {"input", "output", "passes", "components", "jobs", "overwrite", "save", "data", "env_timeout",
             "input_model", "output_dir", "executor"}
_SAVE_KEYS = {"external_data": bool | None, "max_shard_size": int | None, "check": bool}
_DATA_KEYS = {"source": str, "samples": int, "seq_len": int, "batch": int, "tokenizer": str | None, "seed": int}


def _kind(value: Any) -> str:
    """A user value for a message: its JSON type and a bounded repr."""
    from bitpress.options import _json_type
    from bitpress.selection import short

    return f"{_json_type(value)} {short(value)}" if value is not None else "null"


def _typed(value: Any, tp: Any, where: str) -> Any:
    """``value`` if it has type ``tp`` as JSON / YAML types it (no strings for numbers or booleans)."""
    from bitpress.options import coerce

    try:
        return coerce(value, tp, strict=True)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {_one_line(str(exc))}") from None


def check_jobs(value: Any, where: str = "jobs") -> int | None:
    """Worker threads: None (all cores) or an integer from 1 to MAX_JOBS (not a string, not a boolean)."""
    if value is None:
        return None
    jobs = _typed(value, int, where)
    if not 1 <= jobs <= MAX_JOBS:
        raise ConfigError(
            f"{where}: {jobs} is not a number of worker threads (1 to {MAX_JOBS}; leave it out for all cores)")
    return jobs


def _path(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, os.PathLike):  # from Python
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a path (a string), got {_kind(value)}")
    if not value:
        raise ConfigError(f"{key}: the path is empty")
    if "\0" in value:
        raise ConfigError(f"{key}: the path holds a NUL character")
    return value


def _mapping(value: Any, keys: dict[str, Any], where: str) -> dict[str, Any]:
    """A mapping whose keys are among ``keys`` and whose values have the types ``keys`` gives them."""
    from bitpress.options import _did_you_mean

    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping ({', '.join(keys)}), got {_kind(value)}")
    bad = [k for k in value if not isinstance(k, str) or k not in keys]
    if bad:
        name = bad[0] if isinstance(bad[0], str) else repr(bad[0])
        raise ConfigError(f"{where}: unknown key {_did_you_mean(name, set(keys))}; valid keys: {', '.join(keys)}")
    return {k: _typed(v, keys[k], f"{where}.{k}") for k, v in value.items()}


def _timeout(value: Any, where: str) -> float | None:
    if value is None:
        return None
    seconds = _typed(value, float, where)
    if not seconds > 0:
        raise ConfigError(f"{where}: expected a positive number of seconds, got {_kind(value)}")
    return seconds


def _executor(value: Any) -> Any:
    """``executor: threads | ray | {type: ray, address: auto, max_retries: 3}`` (None: threads)."""
    from bitpress.executors import ExecutorSpec

    if value is None:
        return None
    try:
        return ExecutorSpec.from_value(value)
    except UsageError as exc:
        raise ConfigError(f"executor: {exc}") from None
    except TypeError:
        raise ConfigError(f"executor: expected threads, ray or a mapping with a type, got {_kind(value)}") from None


def _data(value: Any) -> Any:
    from bitpress.calibration.data import DataConfig

    if value is None or isinstance(value, DataConfig):
        return value
    if isinstance(value, str):
        return DataConfig.from_value(value)
    values = _mapping(value, _DATA_KEYS, "data")
    for key in ("samples", "seq_len", "batch"):
        if key in values and values[key] < 1:
            raise ConfigError(f"data.{key}: expected a positive integer, got {values[key]}")
    return DataConfig.from_value(values)


def _pass_entries(raw: Any) -> list[tuple[str, dict[str, Any]]]:
    """``passes``: a list of mappings, or Olive's mapping of names to mappings; (label, entry) pairs."""
    from bitpress.selection import short

    if isinstance(raw, dict):  # Olive-style {"name": {"type": ..., ...}}: the name is the step's label
        entries = [(k if isinstance(k, str) and len(k) <= 60 else short(k, 60), v) for k, v in raw.items()]
        where = "passes.{}"
    elif isinstance(raw, list):
        entries = [(f"passes[{i}]", v) for i, v in enumerate(raw)]
        where = "{}"
    else:
        raise ConfigError("passes: expected a list of passes (mappings with a 'type'), or Olive's mapping of "
                          f"names to such mappings, got {_kind(raw)}")
    if not entries:
        raise ConfigError("the config needs a non-empty 'passes' list")
    out = []
    for label, entry in entries:
        at = where.format(label)
        if not isinstance(entry, dict) or "type" not in entry:
            hint = f" (write {{type: {entry}}})" if isinstance(entry, str) and len(entry) < 60 else ""
            raise ConfigError(f"{at} must be a mapping with a 'type' (a pass name), got {_kind(entry)}{hint}")
        bad = [k for k in entry if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{at}: option names are strings, got {_kind(bad[0])}")
        out.append((label, entry))
    return out


def build_workflow(config: dict[str, Any], registry: Registry | None = None) -> Workflow:
    """Validate a config (dict) and build every pass; fails before any work is done.

    Values must have their types as JSON / YAML write them: ``overwrite: "false"`` or
    ``jobs: "8"`` are errors (never True, never 8), as are strings for a pass's numbers and
    booleans; only ``--option k=v`` on the command line is parsed from strings. Everything here is
    checked before :func:`run_workflow` reads the model or creates a folder.
    """
    from bitpress.options import _did_you_mean

    registry = registry or get_registry()
    if not isinstance(config, dict):
        raise ConfigError(f"the config must be a mapping (input, output, passes, ...), got {_kind(config)}")
    _check_size(config, "the config")
    bad = [k for k in config if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"config keys are names (strings), got {_kind(bad[0])}")
    unknown = sorted(set(config) - _TOP_KEYS)
    if unknown:
        valid = sorted(_TOP_KEYS - {"input_model", "output_dir"})
        named = ", ".join(_did_you_mean(k, set(valid)) for k in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ConfigError(f"unknown config key(s) {named}{more}; valid: {', '.join(valid)}")
    src = _path(config, "input")
    if src is None and config.get("input_model") is not None:  # Olive-style
        model = config["input_model"]
        if not isinstance(model, dict):
            raise ConfigError(f"input_model: expected a mapping with a model_path, got {_kind(model)}")
        src = _path(model, "model_path")
    dst = _path(config, "output")
    if dst is None:
        dst = _path(config, "output_dir")
    if not src or not dst:
        raise ConfigError("the config needs 'input' (a model) and 'output' (where to write it)")
    jobs = check_jobs(config.get("jobs"))
    executor = _executor(config.get("executor"))
    overwrite = config.get("overwrite")
    overwrite = False if overwrite is None else _typed(overwrite, bool, "overwrite")
    default_timeout = _timeout(config.get("env_timeout"), "env_timeout")
    save = config.get("save")
    save_opts = SaveOptions(**_mapping(save, _SAVE_KEYS, "save")) if save is not None else SaveOptions()
    if save_opts.max_shard_size is not None and save_opts.max_shard_size < 1:
        raise ConfigError(f"save.max_shard_size: expected a positive number of bytes, got {save_opts.max_shard_size}")
    comps = config.get("components")
    if isinstance(comps, str):
        comps = [comps]
    if comps is not None:
        comps = _typed(comps, list[str], "components")
        if not all(comps):
            raise ConfigError("components: the names must not be empty")
    data = _data(config.get("data"))
    raw_passes = config.get("passes")
    if raw_passes is None:
        raise ConfigError("the config needs a non-empty 'passes' list")
    steps = []
    model_kind: str | None = None
    for label, entry in _pass_entries(raw_passes):
        entry = dict(entry)
        entry.pop("_label", None)
        kind = entry.pop("type")
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"{label}.type: expected a pass name (a string), got {_kind(kind)}")
        precision = _typed(entry.pop("precision", None), str | None, f"{label}.precision")
        options = entry.pop("options", None)
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise ConfigError(f"{label}.options: expected a mapping of option names to values, got {_kind(options)}")
        # where the pass runs: `here` or a plugin environment (bitpress env create); default: where it can
        env = _typed(entry.pop("env", None), str | None, f"{label}.env")
        # run the pass in a worker process of this environment (a native crash becomes a clean error)
        isolate = _typed(entry.pop("isolate", None), bool | None, f"{label}.isolate") or False
        env_timeout = _timeout(entry.pop("env_timeout"), f"{label}.env_timeout") if "env_timeout" in entry \
            else default_timeout
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
        # a config's values are typed (JSON / YAML): checked as they are, strings are not parsed
        pass_ = cls.from_config(options, precision, strict=True)
        if cls.output_kind is not None:  # later algorithm names are chosen for the converted model
            model_kind = cls.output_kind
        if env_timeout is not None:
            # seconds; only used when the pass runs in a plugin environment
            pass_.env_timeout = env_timeout  # type: ignore[attr-defined]
        steps.append(PassStep(pass_, label, isolate=isolate))
    return Workflow(
        input=Path(src), output=Path(dst), steps=steps, components=comps,
        jobs=jobs, overwrite=overwrite, save=save_opts, data=data, executor=executor,
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
        registry.check_not_broken(kind)  # the name of a plugin that failed to load: unavailable, not a typo
        from bitpress.selection import short

        hint = did_you_mean(kind, [*registry.passes, *algorithms, *aliases]) if len(kind) <= 100 else ""
        exc = PassNotFoundError(
            f"unknown pass {short(kind)}{hint} (see `bitpress passes list`){registry.broken_hint()}")
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
    # every setup error comes before anything is created on disk (no folder, no lock, no temporary folder)
    jobs = check_jobs(wf.jobs)  # a Workflow built in Python skips build_workflow's checks
    if not src.exists():
        from bitpress.errors import ModelLoadError

        raise ModelLoadError(f"model not found: {src}")
    folder_out, why = _output_is_folder(src, wf)
    output.check_output_name(wf.output, folder_out, why)
    _check_output(src, wf.output, folder_out, wf.overwrite)
    target = output.final_path(wf.output)
    output.check_parent(target, wf.output)

    model = registry.hook.bitpress_load_model(source=src, options={})
    if model is None:
        raise UsageError(f"no plugin can load {src}")
    try:
        _check_output_spares_input(model, wf.output, folder_out)
        from bitpress.hf.calibrated_pass import check_order

        check_order([s.pass_ for s in wf.steps])  # a calibration pass needs a clean float model: refused up front
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
    except BaseException:
        if isinstance(model, OnnxModel):
            model.close()
        raise
    tmp = target.parent / f".{target.name}.bitpress-{uuid.uuid4().hex[:8]}"
    lock = output.OutputLock(target, wf.output)
    context = PassContext(workdir=tmp / "scratch", data=wf.data, executor=wf.executor)
    if jobs:
        context.jobs = jobs
    if progress is not None:
        context.progress = progress
    seconds: dict[str, float] = {}
    committed = False
    created: list[Path] = []
    # what a native crash in a plugin would leave: the CLI's crash watcher removes it (bitpress.crashwatch)
    watched: list[int | None] = []
    try:
        try:
            # folders this run creates for the output, deepest first: removed again if the run fails
            created = output.make_parents(target.parent, wf.output)
            watched += [crashwatch.remove_if_crashed(d, "dir") for d in reversed(created)]
            lock.acquire()  # one run per output; held until the end
            watched.append(crashwatch.remove_if_crashed(lock.path, "lock"))
            _check_output_free(target, wf.output, folder_out, wf.overwrite)  # again, now that no run can write it
            tmp.mkdir()
            watched.append(crashwatch.remove_if_crashed(tmp, "tree"))
            payload = tmp / "payload"
            if isinstance(model, OnnxPackage):
                files = _run_package(model, wf, registry, context, payload, seconds)
                staged = payload
            else:
                model = _run_passes(model, wf, registry, context, seconds)
                name = wf.output.name if not folder_out else src.name
                if folder_out and src.is_file() and getattr(model, "kind", "") == "genai-package":
                    name = src.stem  # a file (a .gguf) become a package folder: not a folder named like a file
                dest = payload / name
                t0 = time.perf_counter()
                files = _save(registry, model, dest, wf.save)
                _note_checker(context, model, dest)
                seconds["save"] = time.perf_counter() - t0
                staged = payload if folder_out else dest
            with deferred():  # a signal now waits until the output is wholly in place, or not at all
                crashwatch.forget(watched.pop())  # the temporary folder may soon hold the previous output
                final_files = _move_into_place(staged, wf.output, folder_out, files, tmp, wf.overwrite)
                committed = True
                note_written(wf.output)  # a signal from now on says the output is complete
        except OSError as exc:  # a full disk, a read-only file system, a permission refused: the user's to fix
            error = output.write_error(exc, wf.output)
            if error is None:
                raise
            raise error from exc
        except PluginError as exc:  # the same, met in a plugin's hook (its save): not the plugin's fault
            cause = exc.__cause__
            error = output.write_error(cause, wf.output) if isinstance(cause, OSError) else None
            if error is None:
                raise
            raise error from exc
    finally:
        with deferred():  # the cleanup is never cut short by a signal
            if isinstance(model, OnnxModel):
                model.close()
            shutil.rmtree(tmp, ignore_errors=True)
            lock.release()
            if not committed:
                output.remove_created(created)
            for key in watched:
                crashwatch.forget(key)
    in_bytes = _size_of(src)
    out_bytes = sum(f.stat().st_size for f in final_files if f.is_file())
    companions = int(context.extras.get("companion_bytes", 0))
    return RunResult(wf.output, final_files, seconds, in_bytes, out_bytes, list(context.extras.get("reports", [])),
                     input_model_bytes=int(context.extras.get("input_model_bytes", in_bytes)),
                     output_model_bytes=out_bytes - companions, notes=list(context.extras.get("notes", [])),
                     runtime=list(context.extras.get("runtime", [])))


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
    from bitpress.envs.remote import EnvPass, run_isolated

    for step in wf.steps:
        if isinstance(model, OnnxModel):
            model.use_workdir(context.workdir)
        t0 = time.perf_counter()
        log.info("running %s (%s)%s", step.pass_.name, step.label, f" on {prefix}" if prefix else "")
        if getattr(context.executor, "type", "threads") != "threads" and not step.pass_.distributes:
            log.warning("%s: pass %s runs on this machine (the %s executor takes the weight-only passes' "
                        "per-tensor work; docs/scaling.md)", step.label, step.pass_.name, context.executor.type)
        if (wf.isolate or step.isolate) and not isinstance(step.pass_, EnvPass):
            # in a worker process of this environment: an abort or a segfault there is a clean error here
            # (passes of plugin environments always run in a worker of their own)
            result = run_isolated(step.pass_, model, context)
        else:
            result = registry.hook.bitpress_run_pass(pass_=step.pass_, model=model, context=context)
        # None, not a model handle, or a handle whose files are gone: the pass failed, whatever it meant
        model = check_result(step.pass_, result, step.label)
        key = f"{prefix}{step.pass_.name}"
        seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0
        record_pass(model, step.pass_)
    _note_runtime(context, model, wf, prefix)
    return model


def _note_runtime(context: PassContext, model: ModelHandle, wf: Workflow, prefix: str) -> None:
    """Which ONNX Runtime kernel each quantized node of the output runs on, whichever pass wrote it; a
    warning (once) when some take the dequantize-every-call path (docs/speed.md)."""
    if not isinstance(model, OnnxModel):
        return
    from bitpress.onnx.kernels import TARGETS, graph_paths

    targets = [getattr(s.pass_.options, "target", None) for s in wf.steps]
    target = next((t for t in reversed(targets) if t in TARGETS), "cpu")
    paths = graph_paths(model.graph, target)
    if not paths.paths:
        return
    where = prefix.rstrip(":") or model.source.name
    context.extras.setdefault("runtime", []).append((where, paths))
    warning = paths.warning(where)
    if warning:
        log.warning("%s", warning)


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
    saved = [Path(f) for f in files]
    for suffix, src in sidecars(model).items():
        saved.append(Path(shutil.copyfile(src, dest.with_suffix(suffix))))
    return saved


#: the longest name (bytes) of one part of the output path: 255 on common file systems, less the
#: suffixes bitpress adds (``.data.NN``, the temporary folder's ``.bitpress-XXXXXXXX``)
MAX_OUTPUT_PART = 230


def _output_is_folder(src: Path, wf: Workflow) -> tuple[bool, str]:
    """Whether the output is a folder, and what makes it one (for messages); the rule of docs/security.md.

    A folder input (ONNX Runtime GenAI package, Hugging Face checkpoint) and a pass that makes a
    package give a folder; otherwise a name ending in ``.onnx`` (or in the input's own suffix, for
    formats plugins add) is a file and any other name a folder.
    """
    if src.is_dir():
        return True, "the input is a folder"
    last = next((s.pass_ for s in reversed(wf.steps) if s.pass_.output_kind is not None), None)
    if last is not None and last.output_kind == "genai-package":
        return True, f"pass {last.name} makes a package"
    if wf.output.suffix.lower() in {output.MODEL_FILE_SUFFIX, src.suffix.lower()} - {""}:
        return False, ""
    return True, f"its name does not end in {output.MODEL_FILE_SUFFIX}"


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
    _check_output_free(output.final_path(out), out, folder_out, overwrite)


def _check_output_free(target: Path, shown: Path, folder_out: bool, overwrite: bool) -> None:
    """Without ``overwrite``, nothing may be where the output goes (a folder output may be an empty folder).

    Checked at the start and again once the run holds the output's lock; the final move checks it
    a last time, atomically (:mod:`bitpress.output`). A folder where a file goes (or a file where a
    folder goes) is refused with ``overwrite`` too.
    """
    output.check_existing_kind(target, shown, folder_out)
    if overwrite:
        return
    if os.path.lexists(target) and not (folder_out and output.is_empty_dir(target)):
        raise OutputError(
            f"the output {shown} already exists; remove it or pass --overwrite (overwrite=True from Python)"
        )
    if not folder_out:
        stale = output.data_files(target)
        if stale:
            raise OutputError(
                f"the output's data file {stale[0].name} already exists beside {shown} (an earlier run's?); "
                "remove it or pass --overwrite (overwrite=True from Python)"
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


def _move_into_place(
    staged: Path, out: Path, folder_out: bool, files: list[Path], tmp: Path, overwrite: bool = False,
) -> list[Path]:
    """Move the finished output in; without ``overwrite`` never over anything that appeared meanwhile.

    With ``overwrite`` the old output (and, for a single file, its data files) moves aside into
    ``tmp`` first and is deleted with it; if the new one cannot be moved in, the old one is put back.
    """
    target = output.final_path(out)
    if folder_out:
        output.commit_folder(staged, target, out, overwrite, tmp / "previous")
        return [out / f.relative_to(staged) for f in files]
    # a single .onnx: its data files first, the model last
    placed = output.commit_files(files, target, out, overwrite, tmp / "previous")
    return [out.with_name(p.name) for p in placed]


def _size_of(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size + sum(p.stat().st_size for p in path.parent.glob(path.name + ".data*"))


def run(
    config: dict[str, Any] | str | Path,
    *,
    overwrite: bool | None = None,
    jobs: int | None = None,
    external_data: bool | None = None,
    max_shard_size: int | None = None,
    check: bool | None = None,
    data: Any = None,
    env_timeout: float | None = None,
    progress: Any = None,
    registry: Registry | None = None,
    isolate: bool = False,
    executor: Any = None,
) -> RunResult:
    """Run a workflow config (a mapping, or a JSON/YAML file).

    The keyword arguments are the CLI's ``run`` flags and override the config's settings when
    given (``None``: as the config says): ``overwrite`` (``--overwrite``), ``jobs``,
    ``external_data`` (True ``--external-data``, False ``--single-file``), ``max_shard_size``
    (bytes), ``check=False`` (``--no-check``), ``data``, ``env_timeout``; ``isolate=True``
    (``--isolate``) runs every pass in a worker process, as ``isolate: true`` does for one pass;
    ``executor`` (``--executor``) replaces the config's ``executor:``.
    """
    config = dict(config) if isinstance(config, dict) else load_config(Path(config))
    if overwrite is not None:
        config["overwrite"] = overwrite
    if jobs:
        config["jobs"] = jobs
    given = {key: value for key, value in (("external_data", external_data), ("max_shard_size", max_shard_size),
                                            ("check", check)) if value is not None}
    save = config.get("save")
    if given and (save is None or isinstance(save, dict)):  # a save of the wrong shape: build_workflow says so
        config["save"] = {**(save or {}), **given}
    if data is not None:
        config["data"] = data
    if env_timeout is not None:
        config["env_timeout"] = env_timeout
    if executor is not None:
        config["executor"] = executor.to_json() if hasattr(executor, "to_json") else executor
    wf = build_workflow(config, registry)
    if isolate:
        wf.isolate = True
    return run_workflow(wf, registry, progress=progress)
