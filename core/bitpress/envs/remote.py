"""Running a pass in another environment: proxy passes, routing, and the worker's supervision.

A proxy is a :class:`Pass` subclass built from an environment's manifest: same name, algorithms,
precisions and options (by name) as the real pass inside the environment. The host registers
one for every pass that cannot run here but can run in an environment (see
:func:`add_env_passes`), and a workflow can pin any pass to an environment
(:func:`pinned_pass`). Either way the pass instance is an :class:`EnvPass`, and
:func:`bitpress_run_pass` (a plain hook implementation, tried before the host's default)
runs it with :func:`run_in_env`:

1. the current model is saved into the run's work folder (external data, no checks);
2. ``job.json`` is written beside it (see :mod:`bitpress.envs.worker` for the fields);
3. ``<env>/bin/python -m bitpress.envs.worker job.json`` runs in a scratch folder of its own
   (vendor toolkits write files into their working directory: never the user's), in its own
   process group, with a timeout; its log records and output are streamed to this host's
   logger as they come;
4. ``result.json`` says what happened: the saved output model, which is loaded and returned,
   or the error, which is raised here as the same :mod:`bitpress.errors` class when there is one.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path
from typing import IO, Any, ClassVar

from bitpress import errors as _errors
from bitpress.envs import protocol
from bitpress.envs.manager import EnvInfo, get_env, list_envs
from bitpress.envs.protocol import (
    HERE,
    NO_ENVS_VAR,
    PROTOCOL,
    TIMEOUT_VAR,
    EnvError,
    WorkerError,
    WorkerTimeoutError,
    child_environ,
    env_python,
)
from bitpress.errors import BitpressError, ConfigError, PassNotFoundError, PassUnavailableError, UsageError
from bitpress.hookspecs import hookimpl
from bitpress.models.base import ModelHandle
from bitpress.passes import Pass, PassContext, check_pass_class

log = logging.getLogger(__name__)

#: seconds a worker gets to exit after SIGTERM before the whole group is killed
_GRACE = 3.0
#: the kinds of model a plugin environment takes and returns: ONNX files, Hugging Face folders
CROSSING_KINDS = ("onnx", "hf")


class EnvPass(Pass):
    """Base of the proxies: a pass that runs in environment ``env`` (set on each subclass)."""

    env: ClassVar[str] = ""
    env_dir: ClassVar[Path] = Path()
    #: the pass as the environment's manifest describes it (``bitpress passes show --json``)
    manifest_entry: ClassVar[dict[str, Any]] = {}
    #: the class of the same name installed here, if any (used by ``env: here``)
    local: ClassVar[type[Pass] | None] = None
    #: why the environment cannot be used, found when the proxy was built
    env_problem: ClassVar[str | None] = None

    def __init__(self, options: Any | None = None) -> None:
        super().__init__(options)
        #: the options exactly as the user gave them: the worker parses them with the real types
        self.given: dict[str, Any] = {}
        #: whether ``given`` came typed (a config, Python: the worker checks the types strictly) or as
        #: command-line strings (the worker coerces them)
        self.strict = False
        self.precision: str | None = None
        self.env_timeout: float | None = None

    @classmethod
    def from_config(cls, values: dict[str, Any] | None, precision: str | None = None, *,
                    strict: bool = False) -> EnvPass:
        # names (and the precision) are checked here, before any work; the option types are
        # known only inside the environment, where the worker checks them before loading the model
        instance = super().from_config(values, precision, strict=strict)
        assert isinstance(instance, EnvPass)
        instance.given = dict(values or {})
        instance.strict = strict
        instance.precision = precision
        if cls.local is not None and cls.needs_data:
            # whether this instance reads data can depend on its options (modelopt's rtn, quark_hf without an
            # algorithm): the plugin installed here without its toolkit says so; the manifest knows the class only
            with contextlib.suppress(BitpressError):  # options this side cannot check: the environment will
                instance.needs_data = bool(cls.local.from_config(values, precision, strict=strict).needs_data)
        return instance

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if cls.env_problem:
            return (f"environment {cls.env!r} is unusable: {cls.env_problem}; "
                    f"rebuild it: bitpress env create {cls.env} --force")
        if not env_python(cls.env_dir).exists():
            return f"environment {cls.env!r} is missing ({cls.env_dir}); create it: bitpress env create {cls.env}"
        return None

    def run(self, model: ModelHandle, context: PassContext) -> ModelHandle:
        return run_in_env(self, model, context)


def where(cls: type[Pass]) -> str:
    """Where a pass class runs: ``here`` or ``env:<name>``."""
    return f"env:{cls.env}" if isinstance(cls, type) and issubclass(cls, EnvPass) else HERE


# -- proxies ----------------------------------------------------------------------------------------------
def make_proxy(info: EnvInfo, entry: dict[str, Any], local: type[Pass] | None = None) -> type[EnvPass]:
    """A proxy class for the manifest ``entry`` of environment ``info``."""
    name = entry["pass"]
    fields = []
    for opt in entry.get("options") or []:
        default = opt.get("default")
        fields.append((
            opt["name"], Any,
            dataclasses.field(default_factory=lambda d=default: deepcopy(d),
                              metadata={"help": opt.get("help", ""), "type": opt.get("type", "?")}),
        ))
    options_cls = dataclasses.make_dataclass(f"{_camel(name)}EnvOptions", fields)
    # models cross as ONNX files or Hugging Face folders
    kinds = tuple(k for k in entry.get("model_kinds") or () if k in CROSSING_KINDS)
    attrs = {
        "name": name,
        "aliases": tuple(a for a in entry.get("aliases") or () if isinstance(a, str)),
        "algorithms": tuple(entry.get("algorithms") or ()),
        "precisions": tuple(entry.get("precisions") or ()),
        "model_kinds": kinds,
        "needs_data": bool(entry.get("needs_data")),
        "own_text_default": bool(entry.get("own_text_default")),
        "summary": entry.get("summary") or "",
        "Options": options_cls,
        "plugin": entry.get("plugin") or info.name,
        "env": info.name,
        "env_dir": info.path,
        "manifest_entry": entry,
        "local": local,
        "env_problem": info.problem(),
        "__module__": __name__,
    }
    cls = type(f"{_camel(name)}In{_camel(info.name)}", (EnvPass,), attrs)
    check_pass_class(cls)
    return cls


def _camel(text: str) -> str:
    return "".join(part.capitalize() for part in text.replace("-", "_").replace(".", "_").split("_"))


def add_env_passes(registry: Any) -> list[str]:
    """Register proxies for the passes that cannot run here but can in an environment.

    A pass installed and usable here always runs here. Otherwise (not installed, or its
    dependencies missing) the first environment offering it wins, preferring the environment
    named after the pass's plugin. Returns the names registered. Does nothing inside an
    environment's own processes (``BITPRESS_NO_ENVS``).
    """
    if os.environ.get(NO_ENVS_VAR):
        return []
    offers: dict[str, list[tuple[EnvInfo, dict[str, Any]]]] = {}
    try:
        envs = list_envs()
    except OSError as exc:
        log.warning("cannot read the plugin environments: %s", exc)
        return []
    for info in envs:
        for entry in info.pass_entries():
            if isinstance(entry.get("pass"), str):
                offers.setdefault(entry["pass"], []).append((info, entry))
    added = []
    for name, candidates in offers.items():
        current = registry.passes.get(name)
        if current is not None and (issubclass(current, EnvPass) or current.unavailable_reason() is None):
            continue
        candidates.sort(key=lambda c: (c[0].name != c[1].get("plugin"), c[0].name))
        info, entry = candidates[0]
        try:
            proxy = make_proxy(info, entry, local=current)
        except (TypeError, KeyError, ValueError) as exc:
            log.warning("environment %s: cannot offer pass %s here: %s", info.name, name, exc)
            continue
        if not proxy.model_kinds:
            log.debug("environment %s: pass %s takes no ONNX model or Hugging Face folder; not offered here",
                      info.name, name)
            continue
        registry.passes[name] = proxy
        for alias in proxy.aliases:
            registry.aliases.setdefault(alias, name)
        added.append(name)
        log.debug("pass %s runs in environment %s", name, info.name)
    return added


def pinned_pass(
    registry: Any, env: str, kind: str, precision: str | None,
    resolve: Callable[[Any, str, str | None], type[Pass]],
) -> type[Pass]:
    """The pass class for a config entry pinned with ``env:`` (``here`` or an environment name)."""
    if env == HERE:
        cls = resolve(registry, kind, precision)
        if isinstance(cls, type) and issubclass(cls, EnvPass):
            local = cls.local
            if local is None:
                raise PassNotFoundError(
                    f"pass {cls.name!r} is not installed in this environment (it runs in env:{cls.env}); "
                    f"drop 'env: {HERE}' or install plugin {cls.plugin} here"
                )
            reason = local.unavailable_reason()
            if reason:
                raise PassUnavailableError(f"pass {local.name!r} (plugin {local.plugin}) is unavailable here: {reason}")
            return local
        return cls
    if not isinstance(env, str) or not env:
        raise ConfigError(f"'env' must be {HERE!r} or the name of an environment, got {env!r}")
    try:
        protocol.check_env_name(env)
    except EnvError as exc:
        raise ConfigError(str(exc)) from None
    info = get_env(env)
    if info is None:
        known = ", ".join(e.name for e in list_envs()) or "none"
        raise ConfigError(f"no environment named {env!r} (existing: {known}); create it: bitpress env create {env}")
    problem = info.problem()
    if problem:
        raise PassUnavailableError(
            f"environment {env!r} is unusable: {problem}; rebuild it: bitpress env create {env} --force"
        )
    entries = info.pass_entries(available_only=False)
    entry = next((e for e in entries if e.get("pass") == kind), None)
    if entry is None:  # an alias (Olive's pass type), exact first, then in any case
        key = str(kind).casefold()
        entry = next((e for e in entries if kind in (e.get("aliases") or [])), None) or next(
            (e for e in entries if key in (str(a).casefold() for a in e.get("aliases") or [])), None)
    if entry is None:
        matches = [e for e in entries if kind in (e.get("algorithms") or [])
                   and (precision is None or precision in (e.get("precisions") or []))]
        matches.sort(key=lambda e: (not e.get("available", True), e.get("pass") != kind))
        entry = matches[0] if matches else None
    if entry is None:
        offered = ", ".join(e["pass"] for e in entries) or "nothing"
        raise PassNotFoundError(f"environment {env!r} has no pass or algorithm {kind!r}; it offers: {offered}")
    if not entry.get("available", True):
        raise PassUnavailableError(
            f"pass {entry['pass']!r} is unavailable in environment {env!r}: {entry.get('reason')}"
        )
    current = registry.passes.get(entry["pass"])
    local = current.local if isinstance(current, type) and issubclass(current, EnvPass) else current
    proxy = make_proxy(info, entry, local=local)
    if not proxy.model_kinds:
        raise UsageError(f"pass {entry['pass']!r} in environment {env!r} takes no ONNX models; it cannot run from here")
    return proxy


# -- execution --------------------------------------------------------------------------------------------
@hookimpl
def bitpress_run_pass(pass_: Pass, model: ModelHandle, context: PassContext) -> ModelHandle | None:
    """Run proxies and pinned passes in their environment; leave every other pass alone."""
    if isinstance(pass_, EnvPass):
        return run_in_env(pass_, model, context)
    return None


@dataclasses.dataclass
class RemoteReport:
    """A pass's report as the worker summarised it (the report object stays in the environment)."""

    text: str
    #: the report's ``to_json()`` as the worker sent it (trials, decisions), when it has one
    data: dict[str, Any] | None = None

    def summary(self) -> str:
        return self.text

    def to_json(self) -> dict[str, Any]:
        return dict(self.data or {})


def _sidecars(result: dict[str, Any], output: Path, who: str) -> dict[str, Path]:
    """The worker's ``sidecars`` ({suffix: path}), each checked to be ``output`` with that suffix."""
    found = result.get("sidecars") or {}
    if not isinstance(found, dict):
        raise WorkerError(f"{who}: its worker reported sidecars that are not a mapping: {found!r}")
    out = {}
    for suffix, path in found.items():
        expected = output.with_suffix(str(suffix)) if isinstance(suffix, str) and suffix.startswith(".") else None
        if expected is None or Path(str(path)).resolve() != expected.resolve() or not expected.is_file():
            raise WorkerError(f"{who}: its worker reported a sidecar file {path!r} that is not beside its output")
        out[suffix] = expected
    return out


def run_in_env(pass_: EnvPass, model: ModelHandle, context: PassContext) -> ModelHandle:
    """Run ``pass_`` in its environment on ``model``; returns the output model (files in the workdir)."""
    from bitpress.models.onnx_model import OnnxModel

    env, name = pass_.env, pass_.name
    hf = _is_hf(model)
    if not isinstance(model, OnnxModel) and not hf:
        raise UsageError(f"pass {name} runs in environment {env!r}, which exchanges ONNX models and Hugging Face "
                         f"folders; got {model.kind}")
    reason = type(pass_).unavailable_reason()
    if reason:
        raise PassUnavailableError(f"pass {name!r} (plugin {pass_.plugin}) is unavailable: {reason}")
    python = env_python(pass_.env_dir)
    job_dir, folders, origin, model_name = _stage_job(model, context, f"env-{env}-{name}", f"environment {env}")
    job = {
        "pass": name,
        "precision": pass_.precision,
        "options": pass_.given,
        "strict": pass_.strict,
        **_job_files(job_dir, folders, origin, model_name, context),
    }
    job_path = job_dir / "job.json"
    job_path.write_text(json.dumps(job, indent=2, default=str))
    timeout = _timeout(pass_)
    try:
        rc, tail = _run_worker(pass_, python, job_path, folders["cwd"], folders["tmp"], timeout)
        result = _read_result(Path(job["result"]))
        if rc != 0 or not result.get("ok"):
            raise _failure(pass_, rc, result, tail)
        output = Path(result.get("output") or job["output"]).resolve()
        if not output.is_relative_to(folders["output"].resolve()) or not (output.is_dir() if hf else output.is_file()):
            raise WorkerError(f"pass {name} in environment {env!r} reported an output outside its folder: {output}")
    finally:
        # only the output stays (until the run ends): the input copy and scratch can be large
        for key in ("input", "cwd", "tmp", "work"):
            if folders[key].is_relative_to(job_dir):  # never a model folder that crossed as it is
                shutil.rmtree(folders[key], ignore_errors=True)
    typed = result.get("options")
    if isinstance(typed, dict) and set(typed) == set(pass_.given):
        pass_.given = typed  # as the worker typed them: a saved config (--save-config) holds those values
    if hf:
        from bitpress.hf.model import HfModel

        # the checkpoint the worker wrote, whole: saved by linking its files, loaded only if a later pass needs torch
        out = HfModel.written(output, history=HfModel.load(output).history, like=model)
    else:
        out = OnnxModel.load(output)
        out.external_source = getattr(model, "external_source", False)  # the files crossed as external data
        out.sidecars = _sidecars(result, output, f"pass {name} in environment {env!r}")  # type: ignore[attr-defined]
    out.bitpress_origin = origin  # type: ignore[attr-defined]  # where the run's data (tokenizer) lives
    for rep in result.get("reports") or []:
        report = RemoteReport(rep["summary"], rep.get("data"))
        context.extras.setdefault("reports", []).append((rep.get("pass", name), origin, report))
    log.info("pass %s ran in environment %s in %.1f s", name, env, result.get("seconds", 0.0))
    return out


# -- isolation: a pass in a worker process of this environment (--isolate) ---------------------------------
#: the name an isolated worker's log records and output are shown under (logger ``bitpress.env.isolated``)
ISOLATED = "isolated"


def isolated_environ(**extra: str) -> dict[str, str]:
    """The environment variables of an isolated worker: this process's, with its import path.

    The worker runs this environment's Python (``sys.executable``), so unlike a plugin
    environment's worker it keeps ``VIRTUAL_ENV`` and ``PYTHONPATH``; ``PYTHONPATH`` is set to
    this process's ``sys.path`` so the worker finds the very plugins the host found, also
    those on a path added at run time. ``BITPRESS_NO_ENVS`` keeps the worker from offering
    passes of plugin environments: it runs the pass it is given, here.
    """
    env = dict(os.environ)
    paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    env[NO_ENVS_VAR] = "1"
    env["PYTHONUNBUFFERED"] = "1"  # log lines must reach the host as they are written
    env["PYTHONIOENCODING"] = "utf-8"
    env.update(extra)
    return env


def signal_name(signum: int) -> str:
    """``SIGABRT`` for 6; the number for a signal Python does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def run_isolated(pass_: Pass, model: ModelHandle, context: PassContext) -> ModelHandle:
    """Run ``pass_`` (a pass of this environment) in a worker process of this environment.

    The model crosses as files, as for a plugin environment (:func:`run_in_env`); the worker is
    ``sys.executable -m bitpress.envs.worker job.json``, with this process's import path. A
    worker that dies by a signal (abort, segfault), exits with a non-zero code, or exits without
    a result is a clean :class:`~bitpress.envs.protocol.WorkerError`; the run then writes nothing.
    """
    import pickle

    from bitpress.models.onnx_model import OnnxModel
    from bitpress.options import as_dict

    name, plugin = pass_.name, getattr(pass_, "plugin", "?")
    if not isinstance(model, OnnxModel):
        raise UsageError(f"pass {name} cannot run isolated: an isolated worker exchanges ONNX models only, "
                         f"and the model is {model.kind}; run it without --isolate / 'isolate: true'")
    if not sys.executable:
        raise WorkerError(f"pass {name} cannot run isolated: this Python does not know its interpreter "
                          "(sys.executable)")
    job_dir, folders, origin, model_name = _stage_job(model, context, f"isolated-{name}", "the isolated worker")
    try:
        options = json.loads(json.dumps(as_dict(pass_.options), default=str))
    except TypeError:  # options that are not a dataclass
        options = {}
    job: dict[str, Any] = {
        "pass": name,
        "precision": None,  # the options below already hold what the precision implied
        "options": options,
        "strict": False,
        "isolated": True,
        **_job_files(job_dir, folders, origin, model_name, context),
        # the same interpreter reads them back: the pass's options exactly, its reports whole
        "options_pickle": str(job_dir / "options.pickle"),
        "reports_pickle": str(job_dir / "reports.pickle"),
    }
    try:
        Path(job["options_pickle"]).write_bytes(pickle.dumps(pass_.options))
    except Exception:  # options of a class the worker could not import: it parses the values above
        log.debug("the options of pass %s cannot be pickled; the worker parses them", name, exc_info=True)
        del job["options_pickle"]
    job_path = job_dir / "job.json"
    job_path.write_text(json.dumps(job, indent=2, default=str))
    timeout = _timeout(pass_)
    log.info("running pass %s isolated, in a worker process", name)
    try:
        rc, _tail = _run_worker(pass_, Path(sys.executable), job_path, folders["cwd"], folders["tmp"], timeout,
                               isolated=True)
        result = _read_result(Path(job["result"]))
        if rc != 0 or not result.get("ok"):
            raise _isolated_failure(name, plugin, rc, result)
        output = Path(result.get("output") or job["output"]).resolve()
        if not output.is_relative_to(folders["output"].resolve()) or not output.is_file():
            raise WorkerError(f"pass {name} (plugin {plugin}): its worker reported an output outside its folder: "
                              f"{output}; nothing was written")
        reports = _isolated_reports(Path(job["reports_pickle"]), result, name)
    finally:
        # only the output stays (until the run ends): the input copy and scratch can be large
        for key in ("input", "cwd", "tmp", "work"):
            if folders[key].is_relative_to(job_dir):  # never a model folder that crossed as it is
                shutil.rmtree(folders[key], ignore_errors=True)
    out = OnnxModel.load(output)
    out.external_source = getattr(model, "external_source", False)  # the files crossed as external data
    out.package_root = getattr(model, "package_root", None)
    out.bitpress_origin = origin  # type: ignore[attr-defined]  # where the run's data (tokenizer) lives
    out.sidecars = _sidecars(result, output, f"pass {name} (plugin {plugin})")  # type: ignore[attr-defined]
    for rep_name, rep in reports:
        context.extras.setdefault("reports", []).append((rep_name, origin, rep))
    log.info("pass %s ran isolated in %.1f s", name, result.get("seconds", 0.0))
    return out


def _isolated_reports(path: Path, result: dict[str, Any], name: str) -> list[tuple[str, Any]]:
    """The pass's reports as the worker pickled them (whole), else as it summarised them."""
    import pickle

    try:
        with open(path, "rb") as f:
            reports = pickle.load(f)  # written by our own worker into this run's folder
        if isinstance(reports, list) and all(isinstance(r, tuple) and len(r) == 2 for r in reports):
            return reports
    except Exception:
        log.debug("the isolated worker's reports cannot be read back; using their summaries", exc_info=True)
    return [(rep.get("pass", name), RemoteReport(rep["summary"])) for rep in result.get("reports") or []
            if isinstance(rep, dict) and "summary" in rep]


def _isolated_failure(name: str, plugin: str, rc: int, result: dict[str, Any]) -> BitpressError:
    """The error for an isolated worker that failed: its own error, or how it died."""
    who = f"pass {name} (plugin {plugin})"
    hint = ("; an isolated pass must come from an installed plugin (an entry point in the 'bitpress' group), "
            "which its worker loads")
    reported = _reported_error(result, f"{who} in its worker", "in its isolated worker", not_found_hint=hint)
    if reported is not None:
        return reported
    if rc < 0:
        return WorkerError(f"{who} crashed in its worker (signal {signal_name(-rc)}); nothing was written "
                           "(-v shows the worker's output)")
    return WorkerError(f"{who}: its worker exited with code {rc} without a result; nothing was written "
                       "(-v shows the worker's output)")


def _stage_job(
    model: Any, context: PassContext, prefix: str, for_whom: str
) -> tuple[Path, dict[str, Path], Path, str]:
    """A worker job's folders in the run's work folder, with the model saved into ``input/``.

    Returns the job folder, its sub-folders (input, output, cwd, tmp, work), where the model
    came from, and the model's file name.
    """
    from bitpress.onnx.save import SaveOptions, save_onnx

    job_dir = _workdir(context) / f"{prefix}-{uuid.uuid4().hex[:8]}"
    folders = {k: job_dir / k for k in ("input", "output", "cwd", "tmp", "work")}
    for folder in folders.values():
        folder.mkdir(parents=True)
    origin = getattr(model, "bitpress_origin", model.source)
    t0 = time.perf_counter()
    if _is_hf(model):
        # a Hugging Face folder crosses as a folder: the one on disk while the model is not loaded (the worker
        # checks and reads it as the host would), else the model as it is in memory, written here
        model_name = "model"
        if model.loaded:
            model.save(folders["input"] / model_name)
        else:
            folders["input"].rmdir()
            folders["input"] = model.source
            model_name = ""
    else:
        model_name = model.source.name if model.source.suffix == ".onnx" else "model.onnx"
        save_onnx(model, folders["input"] / model_name, SaveOptions(external_data=True, check=False))
    log.debug("staged the model for %s in %.1f s", for_whom, time.perf_counter() - t0)
    return job_dir, folders, origin, model_name


def _is_hf(model: Any) -> bool:
    return getattr(model, "kind", None) == "hf"


def _job_files(
    job_dir: Path, folders: dict[str, Path], origin: Path, model_name: str, context: PassContext
) -> dict[str, Any]:
    """The fields of a worker job that every kind of job shares: protocol, files, data, threads, logs."""
    return {
        "protocol": PROTOCOL,
        "model": str(folders["input"] / model_name),
        "source": str(origin),
        "output": str(folders["output"] / (model_name or "model")),
        "result": str(job_dir / "result.json"),
        "workdir": str(folders["work"]),
        "data": _job_data(context.data, Path(origin)),
        "jobs": context.jobs,
        "log_level": logging.getLogger("bitpress").getEffectiveLevel(),
    }


_fallback_dirs: list[str] = []


def _workdir(context: PassContext) -> Path:
    """The run's work folder; API callers without one get a temporary folder removed at exit."""
    if context.workdir is not None:
        return Path(context.workdir)
    if not _fallback_dirs:
        _fallback_dirs.append(tempfile.mkdtemp(prefix="bitpress-env-"))
        atexit.register(shutil.rmtree, _fallback_dirs[0], True)
    return Path(_fallback_dirs[0])


def _job_data(data: Any, origin: Path) -> dict[str, Any] | None:
    """The calibration settings with paths made absolute: the worker runs in another folder."""
    if data is None:
        return None
    from bitpress.calibration.data import DataConfig

    config = dataclasses.asdict(DataConfig.from_value(data))
    source = config.get("source")
    if source and source != "random" and Path(source).exists():
        config["source"] = str(Path(source).resolve())
    tok = config.get("tokenizer")
    if tok:
        config["tokenizer"] = str(Path(tok).resolve()) if Path(tok).exists() else tok
    elif (origin.parent / "tokenizer.json").is_file():
        # the default is the model's folder; inside the worker that is a copy without the tokenizer
        config["tokenizer"] = str((origin.parent / "tokenizer.json").resolve())
    return config


def _timeout(pass_: Pass) -> float | None:
    """``env_timeout`` of the pass (a config's, ``--env-timeout``), else ``BITPRESS_ENV_TIMEOUT``."""
    if getattr(pass_, "env_timeout", None) is not None:
        return parse_timeout(pass_.env_timeout)  # type: ignore[attr-defined]
    value = os.environ.get(TIMEOUT_VAR)
    return parse_timeout(value, TIMEOUT_VAR) if value else None


def parse_timeout(value: Any, what: str = "env timeout") -> float:
    """Seconds from a config value or an environment variable; positive."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: {value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ConfigError(f"{what} must be a positive number of seconds, got {value!r}")
    return seconds


def _run_worker(
    pass_: Pass, python: Path, job_path: Path, cwd: Path, tmp: Path, timeout: float | None, *,
    isolated: bool = False,
) -> tuple[int, list[str]]:
    """Run the worker on ``job_path``; ``isolated``: a worker of this environment (``--isolate``)."""
    env_name = ISOLATED if isolated else pass_.env  # type: ignore[attr-defined]
    tag = "worker" if isolated else f"env:{env_name}"
    cmd = [str(python), "-m", "bitpress.envs.worker", str(job_path)]
    if isolated:
        environ = isolated_environ(TMPDIR=str(tmp), TMP=str(tmp), TEMP=str(tmp))
    else:
        environ = child_environ(pass_.env_dir, TMPDIR=str(tmp), TMP=str(tmp), TEMP=str(tmp))  # type: ignore[attr-defined]
    group: dict[str, Any] = (
        {"start_new_session": True} if os.name == "posix"
        else {"creationflags": getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0)}
    )
    tail: deque[str] = deque(maxlen=40)
    log.debug("%s: %s (cwd %s)", tag, " ".join(cmd), cwd)
    proc = subprocess.Popen(cmd, cwd=cwd, env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace", **group)
    assert proc.stdout is not None and proc.stderr is not None
    pumps = [
        threading.Thread(target=_pump_output, args=(proc.stdout, env_name, tail, tag), daemon=True),
        threading.Thread(target=_pump_records, args=(proc.stderr, env_name, tail, tag), daemon=True),
    ]
    for t in pumps:
        t.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        _join(pumps, 2.0)
        where_ = f"pass {pass_.name}" + ("" if isolated else f" in environment {env_name!r}")
        raise WorkerTimeoutError(
            f"{where_} did not finish within {timeout:g} s; "
            "its worker and every process it started were killed; nothing was written"
        ) from None
    except BaseException:  # Ctrl-C, or anything else here: never leave the worker running
        _kill_group(proc)
        raise
    if not _join(pumps, 5.0):
        # a process the worker started still holds its output open: it must not outlive the pass
        _kill_group(proc)
        _join(pumps, 2.0)
    return rc, list(tail)


def _join(threads: list[threading.Thread], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the worker and everything in its process group: TERM, a grace period, then KILL."""
    if os.name != "posix":
        proc.kill()
        proc.wait()
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        if sig == signal.SIGTERM:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_GRACE)
    proc.wait()


def _pump_output(stream: IO[str], env_name: str, tail: deque[str], tag: str | None = None) -> None:
    """The worker's stdout and stderr (prints of vendor toolkits): logged at INFO, kept for errors."""
    logger = logging.getLogger(f"bitpress.env.{env_name}")
    tag = tag or f"env:{env_name}"
    for line in stream:
        line = line.rstrip()
        if line:
            tail.append(line)
            logger.info("[%s] %s", tag, line)


def _pump_records(stream: IO[str], env_name: str, tail: deque[str], tag: str | None = None) -> None:
    """The worker's log records (JSON lines), re-emitted by this host's loggers at their level."""
    tag = tag or f"env:{env_name}"
    for line in stream:
        line = line.rstrip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if not isinstance(rec, dict) or "msg" not in rec:
            # written before the worker took over its streams (e.g. an interpreter that cannot start)
            tail.append(line)
            logging.getLogger(f"bitpress.env.{env_name}").warning("[%s] %s", tag, line)
            continue
        level = int(rec.get("level", logging.INFO))
        src = str(rec.get("name") or "root")
        target = src if src == "bitpress" or src.startswith("bitpress.") else f"bitpress.env.{env_name}.{src}"
        msg = str(rec["msg"])
        if level >= logging.WARNING:
            tail.append(msg)
        logging.getLogger(target).log(level, "[%s] %s", tag, msg)


def _reported_error(result: dict[str, Any], who: str, where_: str, *, not_found_hint: str = "") -> BitpressError | None:
    """The error a worker reported in its result file, as the host's class when it is a bitpress one."""
    error = result.get("error")
    if not isinstance(error, dict):
        return None
    detail = error.get("traceback")
    if detail:
        log.debug("%s failed with:\n%s", who, detail)
    type_name, message = str(error.get("type", "Error")), str(error.get("message", "")).strip()
    cls = getattr(_errors, type_name, None) or getattr(protocol, type_name, None)
    if isinstance(cls, type) and issubclass(cls, BitpressError):
        if issubclass(cls, PassNotFoundError):
            message += not_found_hint
        return cls(f"{message} ({where_})")
    return WorkerError(f"{who} failed: {type_name}: {message}; nothing was written")


def _read_result(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _failure(pass_: EnvPass, rc: int, result: dict[str, Any], tail: list[str]) -> BitpressError:
    """The error to raise for a failed worker: the worker's own class when it is a bitpress error."""
    where_ = f"pass {pass_.name} in environment {pass_.env!r}"
    reported = _reported_error(result, where_, f"in environment {pass_.env!r}")
    if reported is not None:
        return reported
    died = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
    if rc < 0 and signal_name(-rc) != str(-rc):
        died += f" ({signal_name(-rc)})"
    last = "\n".join(tail[-15:])
    return WorkerError(
        f"{where_}: the worker {died} without a result (a crash inside the environment?)"
        + (f"; its last output:\n{last}" if last else "")
    )


__all__ = [
    "EnvError",
    "EnvPass",
    "RemoteReport",
    "add_env_passes",
    "bitpress_run_pass",
    "make_proxy",
    "pinned_pass",
    "run_in_env",
    "run_isolated",
    "where",
]
