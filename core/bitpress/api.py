"""The Python API, mirroring the CLI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bitpress import hub
from bitpress.calibration.data import DataConfig
from bitpress.errors import OutputError
from bitpress.evaluate import EvalResult  # also makes `bitpress.evaluate(...)` callable after `import bitpress`
from bitpress.evaluate.runner import evaluate
from bitpress.models.base import ModelHandle
from bitpress.onnx.save import SaveOptions
from bitpress.options import as_dict
from bitpress.passes import Pass
from bitpress.plugins import Registry, canonical_precision, get_registry
from bitpress.sweep.runner import SweepResult, sweep  # also makes `bitpress.sweep(...)` callable
from bitpress.workflow.config import (
    PassStep,
    Workflow,
    build_workflow,
    check_jobs,
    input_kind,
    load_config,
    select_pass,
)
from bitpress.workflow.runner import RunResult, run_workflow
from bitpress.workflow.runner import run as run_config


def load_model(path: str | Path, **options: Any) -> ModelHandle:
    """Load a model through the plugins' loaders (ONNX files and folders by default)."""
    return get_registry().hook.bitpress_load_model(source=Path(path), options=options)


def quantize(
    model: str | Path,
    output: str | Path,
    *,
    algorithm: str,
    precision: str | None = None,
    options: dict[str, Any] | None = None,
    components: list[str] | None = None,
    jobs: int | None = None,
    overwrite: bool = False,
    external_data: bool | None = None,
    max_shard_size: int | None = None,
    check: bool = True,
    data: Any = None,
    progress: Any = None,
    registry: Registry | None = None,
    env_timeout: float | None = None,
    save_config: str | Path | None = None,
    strict: bool = True,
    isolate: bool = False,
    executor: Any = None,
    subfolder: str | None = None,
) -> RunResult:
    """Quantize ``model`` with the pass that provides ``algorithm`` at ``precision``.

    ``model``: a local ``.onnx`` file or folder, or (a string only) a Hugging Face Hub id
    ``org/name[@revision]`` that is not a local path: resolved from the Hub cache (offline) or
    downloaded into it (see :mod:`bitpress.hub`); ``subfolder`` (``--subfolder``) is the folder of
    the model inside it (``onnx``, ``cpu-int4``), or inside a local folder. A Hub ``--tokenizer`` too.

    The CLI's ``quantize`` flags, by name: ``jobs`` (``--jobs``), ``overwrite`` (``--overwrite``),
    ``external_data`` (``--external-data`` True / ``--single-file`` False), ``max_shard_size``
    (bytes), ``check=False`` (``--no-check``), ``components``, ``save_config``.
    ``algorithm`` and ``precision`` are case-insensitive.
    ``data``: calibration data for passes that use it (a :class:`bitpress.calibration.data.DataConfig`, a
    source string such as ``"random"`` / ``"calib.npz"`` / ``"text.txt"``, or a mapping).
    ``env_timeout``: seconds after which a pass running in a plugin environment is killed.
    ``save_config``: also write the equivalent workflow config there (YAML, or JSON for a
    ``.json`` name), paths relative to its folder: ``bitpress.run(save_config)`` repeats the run.
    It is written once the run succeeded; an existing file is replaced only with ``overwrite``.
    ``options`` are Python values of the options' types (``{"block_size": 32, "is_symmetric": False}``):
    ``{"block_size": "32"}`` is an :class:`~bitpress.errors.OptionError`, as in a config file.
    ``strict=False`` coerces strings instead, as ``--option k=v`` does (what the CLI passes).
    ``isolate`` (``--isolate``): run the pass in a worker process of this environment, so a
    native crash (abort, segfault) is a clean error; the pass must come from an installed plugin.
    ``executor`` (``--executor``): where per-tensor work runs: ``"threads"`` (default), ``"ray"``
    (a local Ray runtime) or ``{"type": "ray", "address": "auto"}`` (see :mod:`bitpress.executors`).
    """
    from bitpress.executors import ExecutorSpec

    registry = registry or get_registry()
    model_path, source = resolve_input(model, subfolder)
    data = resolve_data(data, source)
    spec = None if executor is None else ExecutorSpec.from_value(executor)
    cls = select_pass(registry, algorithm, precision, model_path)
    precision = canonical_precision(cls, precision)
    step = PassStep(cls.from_config(options or {}, precision, strict=strict), f"{algorithm}/{precision or '-'}")
    if env_timeout is not None:
        from bitpress.envs.remote import parse_timeout

        step.pass_.env_timeout = parse_timeout(env_timeout, "env_timeout")  # type: ignore[attr-defined]
    check_jobs(jobs, "jobs")
    wf = Workflow(
        input=model_path, output=Path(output), steps=[step], components=components, jobs=jobs,
        overwrite=overwrite,
        save=SaveOptions(external_data=external_data, max_shard_size=max_shard_size, check=check),
        data=None if data is None else DataConfig.from_value(data), isolate=bool(isolate), executor=spec,
        origin=None if source is None else source.record(),
    )
    config_path = None if save_config is None else Path(save_config)
    if config_path is not None:
        if config_path.exists() and not overwrite:
            raise OutputError(
                f"the config {config_path} already exists; remove it or pass --overwrite (overwrite=True from Python)"
            )
        if config_path.is_dir():
            raise OutputError(f"--save-config {config_path} is a folder; give a .yaml or .json file name")
    result = run_workflow(wf, registry, progress=progress)
    if source is not None:
        result.notes.append(hub.describe(source))
    if config_path is not None:
        # after the run: a pass in a plugin environment has its options typed by then (a config file's
        # values must be typed; --option strings are not)
        write_config(workflow_config(wf, config_path.parent, [precision], env_timeout=env_timeout), config_path)
    return result


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
    """Run a workflow config (a mapping, or a JSON/YAML file): :func:`bitpress.workflow.runner.run`, with an
    ``input:`` (and ``subfolder:``) or a ``data: tokenizer`` that is a Hugging Face Hub id resolved first
    (:func:`resolve_config`); the run report and the output's metadata say which commit ran.

    The keyword arguments are the CLI's ``run`` flags and override the config's settings when
    given (``None``: as the config says): ``overwrite`` (``--overwrite``), ``jobs``,
    ``external_data`` (True ``--external-data``, False ``--single-file``), ``max_shard_size``
    (bytes), ``check=False`` (``--no-check``), ``data``, ``env_timeout``; ``isolate=True``
    (``--isolate``) runs every pass in a worker process, as ``isolate: true`` does for one pass;
    ``executor`` (``--executor``) replaces the config's ``executor:``.
    """
    config, source = resolve_config(config)
    result = run_config(
        config, overwrite=overwrite, jobs=jobs, external_data=external_data, max_shard_size=max_shard_size,
        check=check, data=resolve_data(data, source), env_timeout=env_timeout, progress=progress, registry=registry,
        isolate=isolate, executor=executor, origin=None if source is None else source.record(),
    )
    if source is not None:
        result.notes.append(hub.describe(source))
    return result


# -- Hugging Face Hub ids ----------------------------------------------------------------------------
def resolve_input(model: str | os.PathLike[str], subfolder: str | None = None,
                  what: str = "model") -> tuple[Path, hub.HubModel | None]:
    """The local path of ``model``: itself (and its ``subfolder``), or a Hub id's snapshot folder and its
    :class:`~bitpress.hub.HubModel` (:func:`bitpress.hub.resolve`; a local path always wins)."""
    return hub.resolve(model, subfolder=subfolder, what=what)


def resolve_data(data: Any, source: hub.HubModel | None = None, base: Path | None = None) -> Any:
    """Calibration data with a Hub id ``tokenizer`` made the local folder of its tokenizer; without a
    tokenizer, a Hub model whose subfolder has none reads the one at its repo's root. Same type as given."""
    import dataclasses

    if data is None:
        return None
    tokenizer = data.tokenizer if isinstance(data, DataConfig) else data.get("tokenizer") \
        if isinstance(data, dict) else None
    if isinstance(tokenizer, str):
        written = _as_written(tokenizer, base)
        path, found = hub.resolve(written, what="tokenizer", base=base, kind="tokenizer")
        new = str(found.tokenizer_dir or path) if found is not None else None
    elif tokenizer is None and source is not None and source.tokenizer_dir not in (None, source.path):
        new = str(source.tokenizer_dir)
    else:
        new = None
    if new is None:
        return data
    if isinstance(data, DataConfig):
        return dataclasses.replace(data, tokenizer=new)
    if isinstance(data, dict):
        return {**data, "tokenizer": new}
    return {"source": data, "tokenizer": new} if isinstance(data, str) else data


def resolve_config(config: dict[str, Any] | str | Path) -> tuple[dict[str, Any], hub.HubModel | None]:
    """A workflow config (mapping or file, read with :func:`load_config`) whose ``input:`` (or, Olive-style,
    ``input_model: {model_path}``) is a Hub id made the snapshot folder it resolves to (its ``subfolder:``
    taken in), ``data: tokenizer`` too; and the input's :class:`~bitpress.hub.HubModel` (None for a local
    input). A file's relative paths are its folder's, and an existing one there always wins over a Hub id of
    the same name."""
    base = None
    if isinstance(config, dict):
        config = dict(config)
    else:
        path = Path(config)
        config = load_config(path)
        base = path.parent
    source = None
    written = _as_written(config.get("input"), base)
    model = config.get("input_model")  # Olive-style: input_model.model_path, read when there is no input:
    olive = config.get("input") is None and isinstance(model, dict) and isinstance(model.get("model_path"), str)
    if olive:
        written = _as_written(model["model_path"], base)
    if isinstance(written, str) and hub.hub_id(written, base) is not None:
        subfolder = config.pop("subfolder", None)
        what = "input_model.model_path" if olive else "input"
        resolved, source = hub.resolve(written, subfolder=subfolder, what=what, base=base)
        if olive:
            config["input_model"] = {**model, "model_path": str(resolved)}
        else:
            config["input"] = str(resolved)
    if isinstance(config.get("data"), dict | str):
        config["data"] = resolve_data(config["data"], source, base)
    _olive_tokenizer_dirs(config, base)
    return config, source


def _olive_tokenizer_dirs(config: dict[str, Any], base: Path | None) -> None:
    """Olive's per-pass ``tokenizer_dir`` that is a Hub id, made the local folder of its tokenizer files."""
    passes = config.get("passes")
    entries = passes.values() if isinstance(passes, dict) else passes if isinstance(passes, list) else ()
    for entry in entries:
        for where in (entry, entry.get("options"), entry.get("config")) if isinstance(entry, dict) else ():
            written = _as_written(where.get("tokenizer_dir"), base) if isinstance(where, dict) else None
            if isinstance(written, str) and hub.hub_id(written, base) is not None:
                path, found = hub.resolve(written, what="tokenizer_dir", base=base, kind="tokenizer")
                where["tokenizer_dir"] = str(found.tokenizer_dir or path) if found is not None else str(path)


def _as_written(value: Any, base: Path | None) -> Any:
    """A config file's path as written in it (``load_config`` joined relative ones to the file's folder)."""
    if base is None or not isinstance(value, str):
        return value
    try:
        return Path(value).relative_to(base).as_posix()
    except ValueError:
        return value


def workflow_config(
    wf: Workflow, folder: str | Path, precisions: list[str | None] | None = None, *, env_timeout: float | None = None,
) -> dict[str, Any]:
    """The workflow config (a mapping) that builds ``wf`` again, for a file in ``folder``.

    Paths are relative to ``folder`` (as :func:`bitpress.workflow.config.load_config` reads them);
    each pass is written by name with its precision and the options that differ from the
    pass's defaults (not those the precision implies).
    """
    folder = Path(folder).resolve()
    precisions = list(precisions or [])
    passes = []
    for i, step in enumerate(wf.steps):
        pass_ = step.pass_
        precision = precisions[i] if i < len(precisions) else None
        entry: dict[str, Any] = {"type": pass_.name}
        if precision is not None:
            entry["precision"] = precision
        entry.update(_changed_options(pass_, precision))
        if wf.isolate or step.isolate:
            entry["isolate"] = True
        passes.append(entry)
    config: dict[str, Any] = {
        "input": _relative(wf.input, folder),
        "output": _relative(wf.output, folder),
        "passes": passes,
    }
    if wf.origin is not None and wf.origin.get("hub"):  # the Hub id at the commit it ran on, not the cache's folder
        config["input"] = f"{wf.origin['hub']}@{wf.origin['commit']}"
        if wf.origin.get("subfolder"):
            config["subfolder"] = wf.origin["subfolder"]
    if wf.components:
        config["components"] = list(wf.components)
    if wf.jobs:
        config["jobs"] = int(wf.jobs)
    if wf.data is not None:
        data = DataConfig.from_value(wf.data)
        defaults = DataConfig()
        entry = {"source": data.source if data.source == "random" else _relative(data.source, folder)}
        for key in ("samples", "seq_len", "batch", "seed"):
            if getattr(data, key) != getattr(defaults, key):
                entry[key] = getattr(data, key)
        if data.tokenizer:
            entry["tokenizer"] = _relative(data.tokenizer, folder)
        config["data"] = entry
    config["save"] = {"external_data": wf.save.external_data, "max_shard_size": wf.save.max_shard_size,
                      "check": wf.save.check}
    if env_timeout is not None:
        config["env_timeout"] = env_timeout
    return config


def write_config(config: dict[str, Any], path: str | Path) -> Path:
    """Write a workflow config: JSON for a ``.json`` name, else YAML; atomically."""
    import json
    import os

    import yaml

    path = Path(path)
    if path.suffix.lower() == ".json":
        text = json.dumps(config, indent=2) + "\n"
    else:
        text = "# written by bitpress quantize --save-config; run it with: bitpress run " + path.name + "\n"
        text += yaml.safe_dump(config, sort_keys=False, default_flow_style=None)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write the config {path}: {exc.strerror or exc}") from None
    return path


def _relative(path: str | Path, folder: Path) -> str:
    import os

    target = Path(path).resolve()
    try:
        return Path(os.path.relpath(target, folder)).as_posix()
    except ValueError:  # another drive (Windows): absolute
        return str(target)


def _changed_options(pass_: Pass, precision: str | None) -> dict[str, Any]:
    """The options of ``pass_`` that differ from its defaults, as plain YAML/JSON values."""
    from bitpress.envs.remote import EnvPass

    if isinstance(pass_, EnvPass):  # option types are known only in the environment: as given
        return {k: _plain(v) for k, v in pass_.given.items()}
    try:
        current, defaults = as_dict(pass_.options), as_dict(type(pass_.options)())
    except TypeError:
        return {}
    implied = type(pass_).precision_options(precision) if precision is not None else {}
    out = {}
    for key, value in current.items():
        if key in implied and implied[key] == value:
            continue
        if key not in defaults or defaults[key] != value:
            out[key] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


#: the Python API (``bitpress.quantize`` and the rest); the functions that live elsewhere are re-exported here
__all__ = [
    "EvalResult",
    "PassStep",
    "RunResult",
    "SweepResult",
    "Workflow",
    "build_workflow",
    "check_jobs",
    "evaluate",
    "input_kind",
    "load_config",
    "load_model",
    "quantize",
    "run",
    "run_workflow",
    "sweep",
    "workflow_config",
    "write_config",
]
