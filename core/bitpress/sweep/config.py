"""A sweep config, read and validated in full before any job runs.

::

    models: [llama/model.onnx, qwen/model.onnx]     # paths relative to the config's folder, or Hub ids
    passes:
      - rtn                                          # a pass name: its defaults, one job per model
      - {type: hqq, options: {device: numpy}, grid: {block_size: [32, 64]}}
      - {type: kquant, precision: int4}
    grid: {block_size: [32, 128]}                    # every pass that has the option (pass grids win)
    eval: {text: wiki.txt, windows: 16, seq_len: 128}   # perplexity; without text: output error
    output: sweep-out
    publish:                                         # the GenAI export matrix of each Hugging Face model
      matrix: {dtypes: [f32, f16], eps: [cpu], variants: {int4-rtn: [{type: rtn_hf, bits: 4}]}}
      reference: f32/cpu                             # the cell the cpu packages are compared with

A model may be a Hugging Face Hub id (``org/name[@revision]``, or ``{model: org/name, subfolder: onnx}``)
when no local file or folder of that name exists: resolved once, before any job, to its snapshot folder in the
Hub cache (:mod:`bitpress.hub`); the commit is each of its rows' ``source`` and its outputs' metadata.

Each combination (model x pass x grid point) is one :class:`Job`, whose id is a short hash of
the canonical JSON of its model path, pass, precision and options. With ``publish:``, every cell
of the matrix (dtype x EP x variant, as ``bitpress publish`` plans it) is one job too, for each
Hugging Face model (pass ``publish``, its options the cell's dtype, EP, variant passes and
``hf_to_genai`` options).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bitpress import hub
from bitpress.errors import BitpressError, ConfigError, PassNotFoundError
from bitpress.plugins import Registry, canonical_precision, get_registry

log = logging.getLogger(__name__)

TOP_KEYS = ("models", "passes", "grid", "eval", "output", "executor", "jobs", "threads", "data", "save",
            "publish")
PUBLISH_KEYS = ("matrix", "reference")
#: the pass name of a publish cell's job
PUBLISH = "publish"
PASS_KEYS = ("type", "precision", "options", "grid")
EVAL_KEYS = ("text", "tokenizer", "windows", "seq_len", "samples", "batch", "seed", "data", "weights", "speed",
             "speed_runs")
#: the most combinations one sweep may hold
MAX_JOBS = 10_000
#: hex digits of a job's id
ID_LENGTH = 12


@dataclass(frozen=True)
class EvalSpec:
    """How each job's output is compared with its input model (see :func:`bitpress.evaluate`)."""

    text: str | None = None  # a text file: perplexity of both models on it
    tokenizer: str | None = None  # tokenizer.json or its folder (default: the model's folder)
    windows: int | None = None  # perplexity windows at most (default: all)
    seq_len: int = 128
    samples: int = 8  # output comparison runs without a text (random inputs) or with data
    batch: int = 1
    seed: int = 0
    data: str | None = None  # inputs of the output comparison (default: random, or the text's windows)
    weights: bool = True  # also the SQNR of every quantized weight
    speed: bool = True  # also the output's speed against the input's, measured alternately in the job
    speed_runs: int = 3

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`bitpress.evaluate`."""
        return {"text": self.text, "tokenizer": self.tokenizer, "max_windows": self.windows, "seq_len": self.seq_len,
                "samples": self.samples, "batch": self.batch, "seed": self.seed, "data": self.data,
                "weights": self.weights, "jobs": 1, "speed": self.speed, "speed_runs": self.speed_runs}

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Job:
    """One combination: a model, a pass, its precision and options."""

    id: str
    model: str  # absolute path
    pass_name: str
    precision: str | None
    options: dict[str, Any]
    #: the grid values of this combination (what varies), for labels
    point: dict[str, Any] = field(default_factory=dict)
    #: where it comes from in the config, for messages
    where: str = ""
    #: a publish cell (pass ``publish``): folder, dtype, ep, variant, the single-cell matrix that builds
    #: it, and the id of the job of its reference cell (None: not compared)
    cell: dict[str, Any] | None = None

    def label(self) -> str:
        """``hqq block_size=32``: the pass and the values its grid point chose; ``publish f32/cpu``
        (dtype or variant / EP folder) for a cell of the export matrix."""
        if self.cell is not None:
            return f"{PUBLISH} {self.cell['folder']}"
        parts = [self.pass_name]
        if self.precision is not None and "precision" not in self.point:
            parts.append(self.precision)
        parts += [f"{k}={_short(v)}" for k, v in self.point.items()]
        return " ".join(parts)

    def workflow(self, output: Path, *, threads: int | None, data: Any, save: Any) -> dict[str, Any] | None:
        """The workflow config this job runs (``bitpress run`` would run the same); None for a publish cell."""
        if self.cell is not None:
            return None
        step: dict[str, Any] = {"type": self.pass_name, "options": dict(self.options)}
        if self.precision is not None:
            step["precision"] = self.precision
        config: dict[str, Any] = {"input": self.model, "output": str(output), "passes": [step], "overwrite": True}
        if threads:
            config["jobs"] = threads
        if data is not None:
            config["data"] = data
        if save is not None:
            config["save"] = save
        return config


@dataclass
class SweepConfig:
    """A validated sweep: its jobs and how they run and are evaluated."""

    models: list[Path]
    jobs: list[Job]
    output: Path | None
    eval: EvalSpec | None
    executor: Any = None  # an ExecutorSpec value (None: threads)
    parallel: int | None = None  # jobs at once (``jobs:``)
    threads: int | None = None  # worker threads of each job's workflow
    data: Any = None  # calibration data of passes that use it (as in a workflow config)
    save: dict[str, Any] | None = None  # save options of each output (as in a workflow config)
    duplicates: int = 0  # combinations given twice (run once)
    publish: dict[str, Any] | None = None  # the publish entry as given (None: no export matrix)
    #: a Hub id model's path (as in ``models``, a string) -> its repo, revision and commit (HubModel.record())
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def metric(self) -> str:
        """The error the report plots: ``perplexity_change`` with a text, else ``relative_error``."""
        return "perplexity_change" if self.eval is not None and self.eval.text else "relative_error"


def job_id(model: str, pass_name: str, precision: str | None, options: dict[str, Any]) -> str:
    """A short hash of the canonical JSON of a combination: equal combinations, equal ids."""
    canonical = json.dumps({"model": model, "pass": pass_name, "precision": precision, "options": options},
                           sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:ID_LENGTH]


# -- reading --------------------------------------------------------------------------------------
def load_sweep_config(path: str | Path) -> dict[str, Any]:
    """A sweep config from a YAML / JSON file (the workflow configs' safe loader), paths made
    relative to its folder: models, output, data, eval.text, eval.tokenizer and eval.data."""
    from bitpress.workflow.config import load_config

    path = Path(path)
    data = load_config(path)  # output and data are relative to the config already
    base = path.parent

    def relative(value: Any) -> Any:
        if isinstance(value, str) and value and value != "random" and not Path(value).is_absolute():
            return str(base / value)
        return value

    def model(value: Any) -> Any:  # a Hub id (no file or folder of that name beside the config) as written
        if isinstance(value, dict) and "model" in value:
            return {**value, "model": model(value["model"])}
        return value if hub.hub_id(value, base) is not None else relative(value)

    if isinstance(data.get("models"), list):
        data["models"] = [model(m) for m in data["models"]]
    matrix = data["publish"].get("matrix") if isinstance(data.get("publish"), dict) else None
    variants = matrix.get("variants") if isinstance(matrix, dict) else None
    if isinstance(variants, dict):  # calibration files of the variants, as load_publish_config does
        for spec in variants.values():
            calib = spec.get("data") if isinstance(spec, dict) else None
            if isinstance(calib, str):
                calib = spec["data"] = {"source": calib}
            if isinstance(calib, dict):
                calib.update({k: relative(calib[k]) for k in ("source", "tokenizer") if k in calib
                              and not (k == "tokenizer" and hub.hub_id(calib[k], base) is not None)})
    elif isinstance(data.get("models"), str | dict):
        data["models"] = model(data["models"])
    ev = data.get("eval")
    if isinstance(ev, dict):
        data["eval"] = {k: relative(v) if k in ("text", "tokenizer", "data") and not (
            k == "tokenizer" and hub.hub_id(v, base) is not None) else v for k, v in ev.items()}
    return data


# -- validating -----------------------------------------------------------------------------------
def parse_sweep(config: dict[str, Any], registry: Registry | None = None) -> SweepConfig:
    """Validate a sweep config (a mapping, paths relative to the working folder) and list its jobs.

    Every error is found here, before anything runs: unknown keys, unknown passes, options
    the pass's Options class refuses (each grid point is checked as a workflow config's pass
    would be), grids that are not lists, models that do not exist.
    """
    from bitpress.workflow.config import _check_size, _kind

    registry = registry or get_registry()
    if not isinstance(config, dict):
        raise ConfigError(f"a sweep config must be a mapping (models, passes, grid, eval, output), got {_kind(config)}")
    _check_size(config, "the sweep config")
    _check_keys(config, TOP_KEYS, "the sweep config")
    models, sources = _models(config.get("models"))
    has_publish = config.get("publish") is not None
    entries = [] if has_publish and config.get("passes") is None else _passes(config.get("passes"))
    top_grid = _grid(config.get("grid"), "grid")
    output = _path_value(config.get("output"), "output")
    ev = _eval(config.get("eval"))
    parallel = _count(config.get("jobs"), "jobs", "jobs at once")
    threads = _count(config.get("threads"), "threads", "worker threads of each job")
    data, save = _workflow_parts(config.get("data"), config.get("save"))
    if ev is not None and ev.text is not None:
        _check_tokenizer(ev, models)

    jobs: list[Job] = []
    seen: set[str] = set()
    duplicates = 0

    def add(job: Job) -> bool:
        """Keep ``job`` unless a combination with its id is there already (written twice: it runs once)."""
        if job.id in seen:
            return False
        seen.add(job.id)
        jobs.append(job)
        return True
    used_top: set[str] = set()
    kinds = {m: _model_kind(registry, m) for m in models}
    for where, entry in entries:
        for model in models:
            cls = _resolve(registry, entry, kinds[model], where)
            names = option_names(cls)
            fixed: dict[str, Any] = entry["options"]
            grid = dict(entry["grid"])
            for key, values in top_grid.items():  # the top-level grid, where the pass has the option
                if key in grid or key in fixed or (key == "precision" and entry["precision"] is not None):
                    continue
                if (key == "precision" and cls.precisions) or (names is not None and key in names):
                    grid[key] = values
                    used_top.add(key)
            if "precision" in grid and entry["precision"] is not None:
                raise ConfigError(f"{where}: precision is both fixed ({entry['precision']}) and in the grid; "
                                  "keep one of them")
            if names is not None:
                for key in [*fixed, *grid]:
                    if key != "precision" and key not in names:
                        from bitpress.options import _did_you_mean

                        what = "options" if key in fixed else "grid"
                        raise ConfigError(
                            f"{where}.{what}: {cls.name} has no option {_did_you_mean(key, names)}; valid options: "
                            f"{', '.join(sorted(names))} (see `bitpress passes show {cls.name}`)")
            both = sorted(set(fixed) & set(grid))
            if both:
                raise ConfigError(f"{where}: {both[0]} is both a fixed option and in the grid; keep one of them")
            # gptq / awq without data calibrate on the model's own text in each run (the same seeded windows)
            if cls.needs_data and data is None and not cls.own_text_default:
                raise ConfigError(f"{where}: pass {cls.name} needs calibration data: give 'data:' in the sweep config "
                                  "(random, a .npz file or folder, or a .txt file with a tokenizer)")
            keys = list(grid)
            for values in itertools.product(*(grid[k] for k in keys)):
                point = dict(zip(keys, values, strict=True))
                duplicates += not add(_job(cls, model, entry, fixed, point, where))
                if len(jobs) > MAX_JOBS:
                    raise ConfigError(f"the sweep has more than {MAX_JOBS} combinations; split it into smaller "
                                      "sweeps or shorten the grids")
    if has_publish:
        for job in _publish_jobs(config["publish"], models, kinds, ev, registry):
            duplicates += not add(job)
        if len(jobs) > MAX_JOBS:
            raise ConfigError(f"the sweep has more than {MAX_JOBS} combinations; split it into smaller sweeps or "
                              "shorten the grids and the matrix")
    unused = sorted(set(top_grid) - used_top)
    if unused:
        raise ConfigError(f"grid.{unused[0]}: no pass of the sweep has an option {unused[0]}; move it into the "
                          "grid of the passes that have it, or remove it")
    if duplicates:
        log.warning("%d combination(s) of the sweep are given twice; each runs once", duplicates)
    executor = config.get("executor")
    if executor is not None:
        _executor_spec(executor)
    return SweepConfig(models=models, jobs=jobs, output=None if output is None else Path(output), eval=ev,
                       executor=executor, parallel=parallel, threads=threads, data=data, save=save,
                       duplicates=duplicates, publish=config.get("publish"), sources=sources)


def option_names(cls: type) -> set[str] | None:
    """The option names of a pass (its Options dataclass); None when they cannot be known here."""
    import dataclasses

    opts = getattr(cls, "Options", None)
    if opts is not None and dataclasses.is_dataclass(opts):
        return {f.name for f in dataclasses.fields(opts)}
    entry = getattr(cls, "manifest_entry", None)  # a pass of a plugin environment, as it described itself
    if isinstance(entry, dict) and isinstance(entry.get("options"), list):
        return {o["name"] for o in entry["options"] if isinstance(o, dict) and "name" in o}
    return None


def _short(value: Any, limit: int = 40) -> str:
    """A value as a config writes it (``true``, ``null``, ``[1, 2]``), cut to about ``limit`` characters."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, sort_keys=True, default=str)
        except (ValueError, RecursionError):  # a structure that holds itself (YAML aliases)
            text = repr(type(value).__name__)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_keys(mapping: dict[Any, Any], keys: tuple[str, ...], where: str) -> None:
    from bitpress.options import _did_you_mean
    from bitpress.workflow.config import _kind

    for key in mapping:
        if not isinstance(key, str):
            raise ConfigError(f"{where}: keys are names (strings), got {_kind(key)}")
    unknown = [k for k in mapping if k not in keys]
    if unknown:
        raise ConfigError(f"{where}: unknown key {_did_you_mean(unknown[0], set(keys))}; valid keys: {', '.join(keys)}")


def _models(raw: Any) -> tuple[list[Path], dict[str, dict[str, Any]]]:
    """The models (absolute paths), and the Hub ids' records by the path they resolved to."""
    from bitpress.workflow.config import _kind

    if isinstance(raw, str | os.PathLike | dict):
        raw = [raw]
    if raw is None:
        raise ConfigError("the sweep config needs 'models': a list of model paths (relative to the config's folder)")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"models: expected a non-empty list of model paths, got {_kind(raw)}")
    out: list[Path] = []
    sources: dict[str, dict[str, Any]] = {}
    for i, item in enumerate(raw):
        subfolder = None
        if isinstance(item, dict):  # {model: PATH or org/name, subfolder: FOLDER}
            _check_keys(item, ("model", "subfolder"), f"models[{i}]")
            subfolder = _path_value(item.get("subfolder"), f"models[{i}].subfolder")
            item = item.get("model")
        path = _path_value(item, f"models[{i}]")
        if path is None:
            raise ConfigError(f"models[{i}]: expected a model path or Hub id (model: in a mapping), got none")
        found = None
        if hub.hub_id(path) is not None:  # resolved once, here: every job reads the cache's snapshot folder
            p, found = hub.resolve(path, subfolder=subfolder, what=f"models[{i}]")
        else:
            p = Path(path) / subfolder if subfolder else Path(path)
        if not p.exists():
            raise ConfigError(f"models[{i}]: {p} does not exist (paths in a config file are relative to its folder); "
                              "fix the path or remove the model")
        resolved = p.resolve()
        if resolved in out:
            raise ConfigError(f"models[{i}]: {p} is listed twice; remove one")
        out.append(resolved)
        if found is not None:
            sources[str(resolved)] = found.record()
    return out, sources


def _path_value(value: Any, where: str) -> str | None:
    from bitpress.workflow.config import _kind

    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value or "\0" in value:
        raise ConfigError(f"{where}: expected a path (a non-empty string), got {_kind(value)}")
    return value


def _passes(raw: Any) -> list[tuple[str, dict[str, Any]]]:
    """``passes``: each entry a name or ``{type, precision, options, grid}``; (where, entry) pairs."""
    from bitpress.workflow.config import _kind

    if raw is None:
        raise ConfigError("the sweep config needs 'passes': a list of pass names or {type, options, grid} mappings "
                          "(or 'publish:', the GenAI export matrix of its Hugging Face models)")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"passes: expected a non-empty list of pass names or {{type, options, grid}} mappings, "
                          f"got {_kind(raw)}")
    out = []
    for i, item in enumerate(raw):
        where = f"passes[{i}]"
        if isinstance(item, str):
            item = {"type": item}
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: expected a pass name or a mapping {{type, options, grid}}, got {_kind(item)}")
        bad = [k for k in item if k not in PASS_KEYS]
        if bad:
            if not isinstance(bad[0], str):
                raise ConfigError(f"{where}: keys are names (strings), got {_kind(bad[0])}")
            raise ConfigError(
                f"{where}: unknown key {bad[0]!r}; valid keys: {', '.join(PASS_KEYS)} (a pass option goes under "
                f"options: {{{bad[0]}: ...}}, values to sweep under grid: {{{bad[0]}: [...]}})")
        kind = item.get("type")
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"{where}.type: expected a pass name (see `bitpress passes list`), got {_kind(kind)}")
        precision = item.get("precision")
        if precision is not None and (not isinstance(precision, str) or not precision):
            raise ConfigError(f"{where}.precision: expected a precision name such as int4, got {_kind(precision)}")
        options = item.get("options")
        options = {} if options is None else options
        if not isinstance(options, dict):
            raise ConfigError(f"{where}.options: expected a mapping of option names to values, got {_kind(options)}")
        named = [k for k in options if not isinstance(k, str)]
        if named:
            raise ConfigError(f"{where}.options: option names are strings, got {_kind(named[0])}")
        out.append((where, {"type": kind, "precision": precision, "options": dict(options),
                            "grid": _grid(item.get("grid"), f"{where}.grid")}))
    return out


def _grid(raw: Any, where: str) -> dict[str, list[Any]]:
    """A grid: option names to non-empty lists of values (the cartesian product is swept)."""
    from bitpress.workflow.config import _kind

    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of option names to lists of values, e.g. "
                          f"{{block_size: [32, 64]}}, got {_kind(raw)}")
    out: dict[str, list[Any]] = {}
    for key, values in raw.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{where}: option names are strings, got {_kind(key)}")
        if not isinstance(values, list):
            raise ConfigError(f"{where}.{key}: expected a list of values, e.g. [{_short(values)}], got "
                              f"{_kind(values)}; a single fixed value goes under the pass's options")
        if not values:
            raise ConfigError(f"{where}.{key}: the list of values is empty; give at least one value")
        unique: list[Any] = []
        for v in values:
            if v not in unique:
                unique.append(v)
        out[key] = unique
    return out


def _count(value: Any, where: str, what: str) -> int | None:
    from bitpress.workflow.config import MAX_JOBS as MAX_THREADS
    from bitpress.workflow.config import _kind

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise ConfigError(f"{where}: expected the number of {what} (an integer from 1 to {MAX_THREADS}), "
                          f"got {_kind(value)}; leave it out for the default")
    return value


def _eval(raw: Any) -> EvalSpec | None:
    from bitpress.workflow.config import _kind

    if raw is False:
        return None
    if raw is None or raw is True:
        return EvalSpec()
    if not isinstance(raw, dict):
        raise ConfigError(f"eval: expected a mapping ({', '.join(EVAL_KEYS)}) or false, got {_kind(raw)}")
    _check_keys(raw, EVAL_KEYS, "eval")
    values: dict[str, Any] = {}
    for key in ("text", "tokenizer", "data"):
        path = _path_value(raw.get(key), f"eval.{key}")
        if path is None:
            continue
        if key == "tokenizer" and hub.hub_id(path) is not None:  # org/name[@rev]: its tokenizer files, resolved once
            local, found = hub.resolve(path, what="eval.tokenizer", kind="tokenizer")
            values[key] = str(found.tokenizer_dir or local) if found is not None else str(local)
            continue
        if not (key == "data" and path == "random") and not Path(path).exists():
            raise ConfigError(f"eval.{key}: {path} does not exist (paths in a config file are relative to its folder)")
        if key == "text" and not Path(path).is_file():
            raise ConfigError(f"eval.text: {path} is not a file; give a text file")
        values[key] = path
    for key in ("windows", "seq_len", "samples", "batch", "speed_runs"):
        if raw.get(key) is not None:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"eval.{key}: expected a positive integer, got {_kind(value)}")
            values[key] = value
    if raw.get("seed") is not None:
        if isinstance(raw["seed"], bool) or not isinstance(raw["seed"], int):
            raise ConfigError(f"eval.seed: expected an integer, got {_kind(raw['seed'])}")
        values["seed"] = raw["seed"]
    for key in ("weights", "speed"):
        if raw.get(key) is not None:
            if not isinstance(raw[key], bool):
                raise ConfigError(f"eval.{key}: expected true or false, got {_kind(raw[key])}")
            values[key] = raw[key]
    if "tokenizer" in values and "text" not in values and "data" not in values:
        raise ConfigError("eval.tokenizer applies to a text (eval.text) or text data (eval.data); give one or "
                          "remove the tokenizer")
    return EvalSpec(**values)


def _check_tokenizer(ev: EvalSpec, models: list[Path]) -> None:
    """A text needs a tokenizer: the one given, or tokenizer.json beside each model."""
    from bitpress.evaluate.feeds import find_tokenizer

    for model in models:
        folder = model if model.is_dir() else model.parent
        try:
            find_tokenizer(ev.tokenizer, [folder])
        except BitpressError as exc:
            if ev.tokenizer is not None:
                raise ConfigError(f"eval.tokenizer: {exc}") from None
            raise ConfigError(f"eval.text needs a tokenizer: there is no tokenizer.json in {folder} (beside "
                              f"{model.name}); give eval.tokenizer (a tokenizer.json or its folder)") from None


def _workflow_parts(data: Any, save: Any) -> tuple[Any, dict[str, Any] | None]:
    """``data`` and ``save``, checked as a workflow config's are; kept as given for each job."""
    from bitpress.workflow.config import _SAVE_KEYS, _data, _mapping

    if data is not None:
        _data(data)
    if save is not None:
        _mapping(save, _SAVE_KEYS, "save")
    return data, save


def _executor_spec(value: Any) -> Any:
    from bitpress.executors import ExecutorSpec

    try:
        return ExecutorSpec.from_value(value)
    except BitpressError as exc:
        raise ConfigError(f"executor: {exc}") from None


def _model_kind(registry: Registry, model: Path) -> str:
    from bitpress.workflow.config import input_kind

    return input_kind(registry, model)


def _resolve(registry: Registry, entry: dict[str, Any], kind: str, where: str) -> type:
    from bitpress.workflow.config import _resolve_pass

    try:
        return _resolve_pass(registry, entry["type"], entry["precision"], kind)
    except PassNotFoundError as exc:
        key = getattr(exc, "key", None)
        raise PassNotFoundError(f"{where}.{key or 'type'}: {exc}") from None


def _job(cls: type, model: Path, entry: dict[str, Any], fixed: dict[str, Any], point: dict[str, Any],
         where: str) -> Job:
    """One combination, its options checked by the pass's Options class as a workflow config's are."""
    options = {**fixed, **{k: v for k, v in point.items() if k != "precision"}}
    precision = point.get("precision", entry["precision"])
    at = where + (" grid point " + ", ".join(f"{k}={_short(v)}" for k, v in point.items()) if point else "")
    if precision is not None and not isinstance(precision, str):
        raise ConfigError(f"{at}: precision must be a name such as int4, got {precision!r}")
    try:
        canonical = canonical_precision(cls, precision)
        cls.from_config(options, canonical, strict=True)  # type: ignore[attr-defined]
    except BitpressError as exc:
        raise type(exc)(f"{at}: {exc}; fix the value in the config") from None
    return Job(id=job_id(str(model), cls.name, canonical, options), model=str(model),  # type: ignore[attr-defined]
               pass_name=cls.name, precision=canonical, options=options, point=point,  # type: ignore[attr-defined]
               where=at)


# -- the export matrix (bitpress publish) -----------------------------------------------------------
def _publish_jobs(raw: Any, models: list[Path], kinds: dict[Path, str], ev: EvalSpec | None,
                  registry: Registry) -> list[Job]:
    """``publish: {matrix, reference}``: every cell of the matrix (planned and checked by
    :mod:`bitpress.genai.publish`) for every Hugging Face model, one job each."""
    from bitpress.genai.publish import _RUNNABLE, _check_genai, plan_cells
    from bitpress.workflow.config import _kind

    if not isinstance(raw, dict):
        raise ConfigError(f"publish: expected a mapping {{matrix: {{dtypes, eps, variants, folders, genai}}, "
                          f"reference: CELL}}, got {_kind(raw)}")
    _check_keys(raw, PUBLISH_KEYS, "publish")
    matrix = raw.get("matrix")
    if not isinstance(matrix, dict):
        raise ConfigError(f"publish.matrix: expected a mapping {{dtypes, eps, variants, folders, genai}} (the "
                          f"matrix of a publish config, see docs/publishing.md), got {_kind(matrix)}")
    if "eval" in matrix:
        raise ConfigError("publish.matrix.eval: the sweep's 'eval:' measures the cells (its text, windows and "
                          "seq_len); remove matrix.eval, and name the reference cell with publish.reference")
    try:
        cells, variants = plan_cells({"matrix": matrix})
        genai = matrix.get("genai") or {}
        _check_genai(genai, "matrix.genai")
    except ConfigError as exc:
        text = str(exc)
        raise ConfigError(f"publish{'.' if text.startswith('matrix') else ': '}{text}; fix the matrix in the sweep "
                          "config") from None
    hf = [m for m in models if kinds[m] == "hf"]
    if not hf:
        onnx = ", ".join(m.name for m in models)
        raise ConfigError(f"publish: the export matrix builds GenAI packages from a Hugging Face model folder, and "
                          f"the sweep's models are ONNX models ({onnx}); add a Hugging Face folder to models, or "
                          "remove publish")
    others = [m for m in models if kinds[m] != "hf"]
    if others:
        log.info("publish: the matrix is built for the Hugging Face models only, not for %s",
                 ", ".join(str(m) for m in others))
    for name, spec in variants.items():  # each variant's passes checked as a workflow's, for each model
        for model in hf:
            _check_variant(registry, name, spec, model)
    runnable = [c for c in cells if c.ep in _RUNNABLE]
    reference = raw.get("reference")
    if reference is not None:
        if not isinstance(reference, str) or reference not in {c.folder for c in cells}:
            raise ConfigError(f"publish.reference: {reference!r} is not a cell of the matrix; give one of "
                              f"{', '.join(c.folder for c in runnable) or '(none on cpu/default)'}")
        if reference not in {c.folder for c in runnable}:
            raise ConfigError(f"publish.reference: {reference} is built for another EP than cpu/default, which "
                              f"this machine cannot run; give one of {', '.join(c.folder for c in runnable)}")
    else:  # as publish's matrix.eval: the first float cell on a runnable EP
        reference = next((c.folder for c in runnable if c.dtype is not None), None)
    compare = ev is not None and ev.text is not None
    if compare and reference is None:
        log.warning("publish: no float cell on cpu/default to compare the packages with: the cells are not "
                    "evaluated (add a float dtype on cpu, or give publish.reference)")
    jobs: list[Job] = []
    for model in hf:
        ids: dict[str, str] = {}
        made = []
        for cell in cells:
            own: dict[str, Any] = {"folders": {cell.ep: cell.folder.rsplit("/", 1)[1]}, "eps": [cell.ep],
                                   "genai": genai}
            if cell.variant is None:
                own["dtypes"] = [cell.dtype]
                variant = None
            else:
                variant = variants[cell.variant]
                own["variants"] = {cell.variant: {"passes": variant["passes"], "data": variant["data"],
                                                  "genai": variant["genai"], "eps": [cell.ep]}}
            options = {"dtype": cell.dtype, "ep": cell.ep, "variant": cell.variant,
                       "passes": None if variant is None else variant["passes"],
                       "data": None if variant is None else variant["data"],
                       "genai": {**genai, **(variant["genai"] if variant is not None else {})}}
            jid = job_id(str(model), PUBLISH, None, options)
            ids[cell.folder] = jid
            point = {"dtype": cell.dtype, "ep": cell.ep, "variant": cell.variant}
            made.append((cell, jid, options, point, own))
        ref_id = ids.get(reference) if compare and reference is not None else None
        for cell, jid, options, point, own in made:
            info = {"folder": cell.folder, "dtype": cell.dtype, "ep": cell.ep, "variant": cell.variant,
                    "matrix": own, "reference": ref_id if cell.ep in _RUNNABLE else None,
                    "reference_folder": reference if ref_id is not None and cell.ep in _RUNNABLE else None}
            jobs.append(Job(id=jid, model=str(model), pass_name=PUBLISH, precision=None, options=options,
                            point=point, where=f"publish.matrix cell {cell.folder}", cell=info))
    return jobs


def _check_variant(registry: Registry, name: str, spec: dict[str, Any], model: Path) -> None:
    """A variant's passes (and data), checked as the workflow publish runs for it would check them."""
    from bitpress.workflow.config import build_workflow

    wf: dict[str, Any] = {"input": str(model), "output": str(model.parent / f".{model.name}-publish-check"),
                          "passes": spec["passes"]}
    if spec["data"] is not None:
        wf["data"] = spec["data"]
    try:
        build_workflow(wf, registry)
    except BitpressError as exc:
        raise type(exc)(f"publish.matrix.variants.{name}: {exc}") from None
