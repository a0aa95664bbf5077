"""Building a workflow from a config: the config read (JSON / YAML, bounded), checked and made into passes.

:func:`load_config` reads a file: every way it can be unreadable (not UTF-8, invalid, too large, too
deep, aliases that expand beyond :data:`MAX_CONFIG_VALUES` values) is one :class:`ConfigError` line.
:func:`build_workflow` checks every key and value as JSON / YAML types them and builds each pass
(:func:`_resolve_pass`: a pass name, an Olive type or an algorithm, chosen for :func:`input_kind`),
before anything reads the model or creates a folder. :class:`Workflow` (its :class:`PassStep` list)
is what it builds; :mod:`bitpress.workflow.runner` runs one and :mod:`bitpress.workflow.plan` plans one.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bitpress.errors import ConfigError, PassNotFoundError, UsageError
from bitpress.onnx.save import SaveOptions
from bitpress.options import olive_single
from bitpress.passes import Pass
from bitpress.plugins import Registry, canonical_precision, get_registry

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
    """A checked workflow: the input, its passes in order, and where and how the output is written."""

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
    #: the tokenizer a pass named (Olive's ``tokenizer_dir``) while no ``data`` was given: the one the model's own
    #: calibration text is read with, when the run gives a pass that text
    tokenizer: str | None = None
    #: where the input came from when it is not a local path (a Hub id: ``{"hub", "revision", "commit",
    #: "subfolder", "kind"}``, see :mod:`bitpress.hub`): kept in the run report and the output's metadata
    origin: dict[str, Any] | None = None


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
    if isinstance(data.get("engine"), dict) and isinstance(data["engine"].get("output_dir"), str):  # Olive's older
        data["engine"] = {**data["engine"], "output_dir": relative(data["engine"]["output_dir"])}
    if isinstance(data.get("input_model"), dict) and "model_path" in data["input_model"]:  # Olive-style
        data["input_model"] = {**data["input_model"], "model_path": relative(data["input_model"]["model_path"])}
    passes = data.get("passes")  # Olive's tokenizer_dir on a pass (or in its options / older config nesting)
    for entry in passes.values() if isinstance(passes, dict) else passes if isinstance(passes, list) else ():
        for where in (entry, entry.get("options"), entry.get("config")) if isinstance(entry, dict) else ():
            if isinstance(where, dict) and isinstance(where.get("tokenizer_dir"), str):
                where["tokenizer_dir"] = relative(where["tokenizer_dir"])
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
             "input_model", "output_dir", "executor", "subfolder"}
#: sections of an Olive workflow file that say where and how Olive runs and evaluates: bitpress runs the passes
#: here and evaluates with ``bitpress eval``, so it reads past them, naming them in a warning
OLIVE_IGNORED = ("engine", "systems", "evaluators", "evaluator", "search_strategy", "host", "target",
                 "evaluate_input_model", "cache_dir", "clean_cache", "clean_run_cache", "log_severity_level",
                 "output_name", "workflow_id", "packaging_config", "azureml_client", "auto_optimizer_config",
                 "workflow_host", "python_environment_path", "verbose")
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
    olive = sorted(k for k in config if k in OLIVE_IGNORED)
    if olive:
        log.warning("Olive workflow sections %s read past: bitpress runs the passes on this machine (bitpress eval "
                    "measures the result)", ", ".join(olive))
    olive_data = _olive_data_configs(config)
    unknown = sorted(set(config) - _TOP_KEYS - set(OLIVE_IGNORED) - {"data_configs"})
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
    if dst is None and isinstance(config.get("engine"), dict) and config["engine"].get("output_dir") is not None:
        dst = _path(config["engine"], "output_dir")  # Olive's older place for it
    if not src or not dst:
        raise ConfigError("the config needs 'input' (a model) and 'output' (where to write it)")
    subfolder = _path(config, "subfolder")  # a folder inside the input (a Hub id's is resolved before, by the API)
    if subfolder is not None:
        parts = Path(subfolder.replace("\\", "/")).parts
        if Path(subfolder).is_absolute() or ".." in parts:
            raise ConfigError(f"subfolder: {subfolder!r} must be a folder inside the input (no .., not absolute)")
        src = str(Path(src) / subfolder)
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
    tokenizers: list[tuple[str, str]] = []  # (label, Olive's tokenizer_dir)
    model_kind: str | None = None
    for label, entry in _pass_entries(raw_passes):
        entry = dict(entry)
        entry.pop("_label", None)
        kind = entry.pop("type")
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"{label}.type: expected a pass name (a string), got {_kind(kind)}")
        if "data_config" in entry:  # Olive's reference to one of its data_configs
            name = entry.pop("data_config")
            if data is None:
                known = f" ({olive_data[name]})" if isinstance(name, str) and name in olive_data else ""
                log.warning("%s: Olive's data_config %s%s is not loaded (bitpress downloads no dataset): without "
                            "'data:' the passes that can calibrate on the model's own text do so", label,
                            name if isinstance(name, str) else _kind(name), known)
        precision = _typed(entry.pop("precision", None), str | None, f"{label}.precision")
        options = entry.pop("options", None)
        if options is None and isinstance(entry.get("config"), dict):  # Olive's older nesting of a pass's options
            options = entry.pop("config")
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
        if "tokenizer_dir" in options and "tokenizer_dir" not in _own_options(cls):
            tokenizers.append((label, _typed(olive_single(options.pop("tokenizer_dir"), str, "tokenizer_dir", label),
                                             str, f"{label}.tokenizer_dir")))
        if "onnx" in cls.model_kinds or cls.output_kind == "onnx":  # an ONNX pass, or one that writes ONNX
            external = _olive_save_options(cls, options, label)
            if external is not None:
                if save is not None and isinstance(save, dict) and save.get("external_data") is not None \
                        and save["external_data"] != external:
                    raise ConfigError(f"{label}.save_as_external_data={str(external).lower()} contradicts "
                                      f"save.external_data={str(save['external_data']).lower()}")
                save_opts.external_data = external
        # a config's values are typed (JSON / YAML): checked as they are, strings are not parsed
        pass_ = cls.from_config(options, precision, strict=True)
        if cls.output_kind is not None:  # later algorithm names are chosen for the converted model
            model_kind = cls.output_kind
        if env_timeout is not None:
            # seconds; only used when the pass runs in a plugin environment
            pass_.env_timeout = env_timeout  # type: ignore[attr-defined]
        steps.append(PassStep(pass_, label, isolate=isolate))
    data, tokenizer = _olive_tokenizer(data, tokenizers)
    return Workflow(
        input=Path(src), output=Path(dst), steps=steps, components=comps,
        jobs=jobs, overwrite=overwrite, save=save_opts, data=data, executor=executor, tokenizer=tokenizer,
    )


def _own_options(cls: type[Pass]) -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(cls.Options)} if dataclasses.is_dataclass(cls.Options) else set()


def _olive_tokenizer(data: Any, tokenizers: list[tuple[str, str]]) -> tuple[Any, str | None]:
    """Olive's per-pass ``tokenizer_dir`` is bitpress's ``--tokenizer`` (``data: tokenizer``): the calibration
    data's tokenizer, one for the run. Returns the data (with it) and, without data, the tokenizer for the
    model's own text."""
    import dataclasses

    if not tokenizers:
        return data, None
    label, tokenizer = tokenizers[0]
    for other_label, other in tokenizers[1:]:
        if other != tokenizer:
            raise ConfigError(f"{other_label}.tokenizer_dir={other} differs from {label}.tokenizer_dir={tokenizer}: "
                              "a run reads its calibration data with one tokenizer (data: tokenizer)")
    if data is None:
        return None, tokenizer
    if data.tokenizer is not None and Path(data.tokenizer) != Path(tokenizer):
        raise ConfigError(f"{label}.tokenizer_dir={tokenizer} contradicts data.tokenizer={data.tokenizer} (or "
                          "--tokenizer): give the calibration data's tokenizer once")
    return dataclasses.replace(data, tokenizer=tokenizer), None


#: Olive's save options of every ONNX pass, with their types: read here, not by the pass
OLIVE_SAVE_OPTIONS: dict[str, Any] = {"save_as_external_data": bool, "all_tensors_to_one_file": bool,
                                      "external_data_name": str | None, "size_threshold": int,
                                      "convert_attribute": bool}


def _olive_data_configs(config: dict[str, Any]) -> dict[str, str]:
    """Olive's ``data_configs``: ``{name: what it would load}`` (for messages); they are not loaded."""
    raw = config.get("data_configs")
    if raw is None:
        return {}
    if not isinstance(raw, list | dict):
        raise ConfigError(f"data_configs: expected Olive's list of data configs, got {_kind(raw)}")
    items = raw if isinstance(raw, list) else [{"name": k, **v} if isinstance(v, dict) else v for k, v in raw.items()]
    out: dict[str, str] = {}
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ConfigError(f"data_configs: each entry is a mapping with a name, got {_kind(item)}")
        load = item.get("load_dataset_config")
        what = load.get("data_name") if isinstance(load, dict) else None
        out[item["name"]] = f"dataset {what}" if isinstance(what, str) else str(item.get("type", "a data config"))
    return out


def _olive_save_options(cls: type[Pass], options: dict[str, Any], label: str) -> bool | None:
    """Take Olive's common save options out of an ONNX pass's ``options`` (unless the pass has options of those
    names itself): ``save_as_external_data`` is returned (the output's ``save.external_data``); the others are
    what bitpress does already, or named in a warning saying what it does instead."""
    from bitpress.onnx.save import INLINE_THRESHOLD

    own = _own_options(cls)
    found = {k: options.pop(k) for k in list(options) if k in OLIVE_SAVE_OPTIONS and k not in own}
    for key, value in found.items():
        found[key] = _typed(olive_single(value, OLIVE_SAVE_OPTIONS[key], key, label), OLIVE_SAVE_OPTIONS[key],
                            f"{label}.{key}")
    if found.get("all_tensors_to_one_file") is False:
        log.warning("%s: all_tensors_to_one_file=false is not followed: bitpress writes the external data to one "
                    "file beside the model (save.max_shard_size splits it into shards)", label)
    if found.get("external_data_name"):
        log.warning("%s: external_data_name=%s is not followed: bitpress names the data file after the model "
                    "(<model>.onnx.data)", label, found["external_data_name"])
    if "size_threshold" in found and found["size_threshold"] != INLINE_THRESHOLD:
        log.warning("%s: size_threshold=%d is not followed: bitpress keeps tensors under %d bytes inside the .onnx "
                    "file", label, found["size_threshold"], INLINE_THRESHOLD)
    if found.get("convert_attribute"):
        log.warning("%s: convert_attribute=true is not followed: bitpress leaves attribute tensors inside the "
                    ".onnx file", label)
    return found.get("save_as_external_data")


def _resolve_pass(registry: Registry, kind: str, precision: str | None, model_kind: str = "onnx") -> type[Pass]:
    """A config's ``type``: a pass name, an Olive pass type a plugin maps, or an algorithm (any case)."""
    from bitpress.plugins import did_you_mean

    if kind in registry.passes:
        return registry.get_pass(kind)
    aliases = {a: cls for cls in registry.passes.values() for a in getattr(cls, "aliases", ())}
    if kind in aliases:
        named = aliases[kind]
        if model_kind not in named.model_kinds:
            # an Olive type names one pass, but Olive runs it on either kind of model (QuaRot, KQuant):
            # the pass of the same algorithm that takes this kind, when there is one
            for algorithm in named.algorithms:
                if any(model_kind in c.model_kinds and algorithm in c.algorithms for c in registry.passes.values()):
                    return registry.select(algorithm, precision, model_kind)
        return registry.get_pass(named.name)
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


def select_pass(registry: Registry, algorithm: str, precision: str | None, path: Path) -> type[Pass]:
    """The pass for ``algorithm`` that accepts the kind of model ``path`` holds (``bitpress quantize``'s choice)."""
    return registry.select(algorithm, precision, input_kind(registry, path))
