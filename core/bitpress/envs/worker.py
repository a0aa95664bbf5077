"""Run one pass inside a plugin environment: ``<env>/bin/python -m bitpress.envs.worker job.json``.

The host writes ``job.json`` (protocol :data:`bitpress.envs.protocol.PROTOCOL`)::

    {"protocol": 1, "pass": "quark_int8", "precision": "int8" | null,
     "options": {...as the user gave them...},
     "model": "<workdir>/env-.../input/model.onnx",     the model to read (external data beside it)
     "source": "/path/of/the/run's/input.onnx",         informational
     "output": "<workdir>/env-.../output/model.onnx",   where to save the result
     "result": "<workdir>/env-.../result.json",         where to say how it went
     "workdir": "<workdir>/env-.../work",               scratch for the pass
     "data": {DataConfig fields} | null, "jobs": 2, "log_level": 30}

and the worker writes ``result.json``: ``{"ok": true, "output": ..., "files": [...],
"reports": [{"pass", "summary"}], "seconds": ...}`` or ``{"ok": false, "error": {"type",
"module", "message", "traceback"}}``. Log records go to the original stderr as JSON lines
(``{"level", "name", "msg"}``); everything else written to stdout or stderr (vendor toolkits
print a lot, C libraries write to the file descriptors) is sent to stdout, so the host can tell
the two apart. Options are parsed with their real types first, before the model is read.

An isolated job (``bitpress quantize --isolate``: this worker runs the host's own interpreter)
adds ``"isolated": true``, ``"options_pickle"`` (the host's options object, used as it is) and
``"reports_pickle"`` (where the pass's reports are written back whole). ``faulthandler`` is on:
a native crash prints Python's stack to the output the host keeps.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any

from bitpress.envs.protocol import NO_ENVS_VAR, PROTOCOL, EnvError

log = logging.getLogger("bitpress.envs.worker")


class _JsonLines(logging.Handler):
    def __init__(self, stream: IO[str]) -> None:
        super().__init__()
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            if record.exc_info:
                msg += "\n" + logging.Formatter().formatException(record.exc_info)
            self.stream.write(json.dumps({"level": record.levelno, "name": record.name, "msg": msg}) + "\n")
            self.stream.flush()
        except Exception:
            self.handleError(record)


def _take_streams() -> IO[str]:
    """Keep the original stderr for log records; send all other stderr output to stdout."""
    sys.stdout.flush()
    sys.stderr.flush()
    records_fd = os.dup(2)
    os.dup2(1, 2)
    return os.fdopen(records_fd, "w", encoding="utf-8", buffering=1)


def _setup_logging(stream: IO[str], level: Any) -> None:
    try:
        level = int(level)
    except (TypeError, ValueError):
        level = logging.WARNING
    root = logging.getLogger()
    root.handlers[:] = [_JsonLines(stream)]
    root.setLevel(level)
    # warnings.warn from vendor code becomes a record the host shows at WARNING
    logging.captureWarnings(True)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    if job.get("protocol") != PROTOCOL:
        raise EnvError(
            f"the host sent job protocol {job.get('protocol')}, the bitpress in this environment speaks {PROTOCOL}; "
            "rebuild the environment: bitpress env create NAME --force"
        )
    os.environ[NO_ENVS_VAR] = "1"  # this host runs every pass itself
    from bitpress.calibration.data import DataConfig
    from bitpress.errors import UsageError
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.passes import PassContext, sidecars
    from bitpress.plugins import check_result, get_registry

    isolated = bool(job.get("isolated"))
    plugins_log = logging.getLogger("bitpress.plugins")
    level = plugins_log.level
    if isolated:  # a worker of the host's own environment: the host reported its broken plugins already
        plugins_log.setLevel(logging.ERROR)
    try:
        registry = get_registry()
    finally:
        plugins_log.setLevel(level)
    cls = registry.get_pass(str(job["pass"]))
    # first thing: the options with their real types, before any model is read; values from a
    # config file or Python must have them already (strict), command-line strings are coerced
    given = job.get("options") or {}
    options = _pickled_options(job, cls) if isolated else None
    if options is not None:  # the host's own options object (same interpreter), checked there already
        pass_ = cls(options)
    else:
        pass_ = cls.from_config(given, job.get("precision"), strict=bool(job.get("strict", False)))
    log.debug("pass %s with options %s", cls.name, pass_.options)
    model = registry.hook.bitpress_load_model(source=Path(job["model"]), options={})
    if model is None:
        raise UsageError(f"no plugin in this environment can load {job['model']}")
    data = DataConfig.from_value(job["data"]) if job.get("data") else None
    if pass_.needs_data and data is None:
        raise UsageError(f"pass {cls.name} needs calibration data: give --data or 'data:' in the config")
    context = PassContext(jobs=max(1, int(job.get("jobs") or os.cpu_count() or 1)),
                          workdir=Path(job["workdir"]), data=data)
    if isinstance(model, OnnxModel):
        model.use_workdir(context.workdir)
    t0 = time.perf_counter()
    result = registry.hook.bitpress_run_pass(pass_=pass_, model=model, context=context)
    # None, not a model handle, or a handle whose files are gone: the pass failed (named, with its plugin)
    result = check_result(pass_, result)
    seconds = time.perf_counter() - t0
    output = Path(job["output"])
    # external data always: the host reads the result from here, and models may exceed 2 GB
    files = registry.hook.bitpress_save_model(
        model=result, destination=output, options={"external_data": True, "max_shard_size": None, "check": False}
    )
    if files is None:
        raise UsageError(f"no plugin in this environment can save a {result.kind} model")
    # files the pass made to go beside the model cross with it; the host attaches them to its handle
    beside = {}
    for suffix, src in sidecars(result).items():
        beside[suffix] = str(shutil.copyfile(src, output.with_suffix(suffix)))
    for handle in {id(model): model, id(result): result}.values():
        if isinstance(handle, OnnxModel):
            handle.close()
    reports = [
        {"pass": name, "summary": rep.summary() if hasattr(rep, "summary") else str(rep),
         "data": _report_json(rep)}
        for name, _src, rep in context.extras.get("reports", [])
    ]
    if isolated and job.get("reports_pickle"):
        _pickle_reports(Path(job["reports_pickle"]), context.extras.get("reports", []))
    return {"output": str(output), "files": [str(f) for f in files], "sidecars": beside, "reports": reports,
            "seconds": seconds,
            "prefix": sys.prefix, "options": _typed_options(pass_, given)}


def _pickled_options(job: dict[str, Any], cls: Any) -> Any:
    """The options object an isolated job's host pickled (it runs this interpreter), or None."""
    import pickle

    path = job.get("options_pickle")
    if not path or not Path(path).is_file():
        return None
    try:
        with open(path, "rb") as f:
            options = pickle.load(f)  # written by the host that started this worker, in its run folder
    except Exception:
        log.debug("cannot read the pickled options; parsing them", exc_info=True)
        return None
    return options if isinstance(options, cls.Options) else None


def _report_json(rep: Any) -> dict[str, Any] | None:
    """A report's ``to_json()`` when it has one that JSON can carry, else None."""
    to_json = getattr(rep, "to_json", None)
    if not callable(to_json):
        return None
    try:
        data = to_json()
        json.dumps(data)
    except Exception:
        log.debug("report %r has no JSON form", rep, exc_info=True)
        return None
    return data if isinstance(data, dict) else None


def _pickle_reports(path: Path, reports: list[Any]) -> None:
    """The pass's reports, whole, for the host of an isolated job (which runs this interpreter)."""
    import pickle

    try:
        data = pickle.dumps([(name, rep) for name, _src, rep in reports])
    except Exception:
        log.debug("the reports cannot be pickled; the host gets their summaries", exc_info=True)
        return
    path.write_bytes(data)


def _typed_options(pass_: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The options the host gave, with the types the pass gave them (JSON values)."""
    from bitpress.options import as_dict

    try:
        values = as_dict(pass_.options)
    except TypeError:
        return {}
    typed = {key: values[key] for key in given if key in values}
    return json.loads(json.dumps(typed, default=str))


def _write_result(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, path)  # the host never reads half a result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1:
        print("usage: python -m bitpress.envs.worker JOB.json", file=sys.stderr)
        return 2
    job_path = Path(args[0])
    records = _take_streams()
    # a native crash (abort, segfault) prints the Python stack to the worker's output: the host
    # shows it with -v and in its log, and reports the signal the worker died of
    faulthandler.enable(file=sys.stderr, all_threads=False)
    _setup_logging(records, logging.WARNING)
    result_path = job_path.with_name("result.json")
    try:
        job = json.loads(job_path.read_text())
        result_path = Path(job.get("result") or result_path)
        _setup_logging(records, job.get("log_level"))
        result = run_job(job)
    except BaseException as exc:
        log.debug("the pass failed", exc_info=True)
        _write_result(result_path, {"ok": False, "error": {
            "type": type(exc).__name__, "module": type(exc).__module__, "message": str(exc),
            "traceback": traceback.format_exc(),
        }})
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    _write_result(result_path, {"ok": True, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
