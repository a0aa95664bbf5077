"""Running a workflow: input model -> ordered passes -> output, written atomically.

The output is assembled in a private temporary folder next to its final place and moved
there only when every pass, save and check has succeeded, so a failed or interrupted run
leaves nothing behind. The input is only ever read. The output's checks (its name, that it
spares the input, that nothing is in its place without ``overwrite``) come before anything is
created; :func:`record_pass` writes the ``bitpress`` metadata ``bitpress eval`` reads back
(:data:`METADATA_KEY`). :func:`run` is a config (mapping or file) built and run.
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

from bitpress import crashwatch, output
from bitpress.errors import OutputError, PluginError, UsageError
from bitpress.interrupts import deferred, note_written
from bitpress.models.base import ModelHandle
from bitpress.models.onnx_model import OnnxModel
from bitpress.models.onnx_package import OnnxPackage
from bitpress.onnx.save import SaveOptions
from bitpress.onnx.tensors import is_external, iter_tensors
from bitpress.passes import Pass, PassContext, sidecars
from bitpress.plugins import Registry, check_result, get_registry
from bitpress.workflow.config import Workflow, build_workflow, check_jobs, load_config

log = logging.getLogger(__name__)


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
    #: where the input came from when not a local path (a Hub id: hub, revision, commit, subfolder, kind)
    source: dict[str, Any] | None = None

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
            "source": self.source,
            "runtime": [{"model": where, **paths.to_json()} for where, paths in self.runtime],
            "reports": [
                {"pass": name, "model": str(src), "summary": rep.summary() if hasattr(rep, "summary") else str(rep),
                 **(rep.to_json() if callable(getattr(rep, "to_json", None)) else {})}
                for name, src, rep in self.reports
            ],
        }


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
    if src.is_dir() and Path(model.source).parent == src.absolute():  # the one model folder a run wrote in src
        src = Path(model.source)
    try:
        _check_output_spares_input(model, wf.output, folder_out)
        from bitpress.hf.calibrated_pass import check_order

        check_order([s.pass_ for s in wf.steps])  # a calibration pass needs a clean float model: refused up front
        own_text = ""
        for step in wf.steps:
            kinds = step.pass_.model_kinds
            target_kind = "onnx" if isinstance(model, OnnxPackage) else model.kind
            if target_kind not in kinds:
                raise UsageError(f"{step.label}: pass {step.pass_.name} does not accept {target_kind} models")
            if step.pass_.needs_data and wf.data is None and all(
                    s.pass_.own_text_default for s in wf.steps if s.pass_.needs_data):
                from bitpress.calibration.data import GENERATED, DataConfig

                wf.data = DataConfig(source=GENERATED, tokenizer=wf.tokenizer)
                own_text = (f"{step.label}: no calibration data given: {step.pass_.name} calibrates on text the model "
                            "writes itself (data: {source: generated}); give --data or 'data:' for a text of your own")
                log.warning("%s", own_text)
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
    if own_text:  # said in the run report too, not only in the log
        context.extras.setdefault("notes", []).append(own_text)
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
                if folder_out and wf.origin and wf.origin.get("hub"):  # a Hub id's repo name, not the cache's commit
                    name = str(wf.origin["hub"]).rsplit("/", 1)[-1]
                if folder_out and src.is_file() and getattr(model, "kind", "") == "genai-package":
                    name = src.stem  # a file (a .gguf) become a package folder: not a folder named like a file
                dest = payload / name
                t0 = time.perf_counter()
                files = _save(registry, model, dest, wf.save)
                _note_checker(context, model, dest)
                _note_source(files, wf.origin, hf_folder=dest if getattr(model, "kind", "") == "hf" else None)
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
                     runtime=list(context.extras.get("runtime", [])), source=wf.origin)


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
        record_pass(model, step.pass_, wf.origin)
    _note_runtime(context, model, wf, prefix)
    return model


#: the package manifest's name (bitpress.genai.manifest.MANIFEST; genai imports this package, not the reverse)
MANIFEST_NAME = "bitpress-manifest.json"


#: the ``quant_method`` of bitpress's own Hugging Face checkpoints (bitpress.hf.checkpoint.QUANT_METHOD; that
#: module imports torch)
HF_QUANT_METHOD = "bitpress"


def _note_source(files: list[Path], source: dict[str, Any] | None, *, hf_folder: Path | None = None) -> None:
    """Where the input came from (a Hub id and its commit) in the written files that say how they were made.

    A package's manifest: its ``made`` record (``"input"``); the manifest does not list itself, so its
    file list and checksums stay true. A Hugging Face checkpoint written to ``hf_folder``: the
    ``quantization_config`` (``"source"``) of its ``config.json`` when bitpress wrote one (``quant_method``
    ``bitpress``: transformers ignores that config, bitpress's readers ignore the key); a float checkpoint's
    config.json stays as it is. ONNX graphs carry it in their ``bitpress`` metadata (:func:`record_pass`).
    """
    if source is None:
        return
    for f in files:
        if f.name == MANIFEST_NAME and f.is_file():
            data = _read_json(f)
            if isinstance(data, dict) and isinstance(data.get("made", {}), dict):
                data["made"] = {**data.get("made", {}), "input": source}
                f.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
        elif hf_folder is not None and f == hf_folder / "config.json" and f.is_file():
            data = _read_json(f)
            qc = data.get("quantization_config") if isinstance(data, dict) else None
            if isinstance(qc, dict) and qc.get("quant_method") == HF_QUANT_METHOD:
                qc["source"] = source
                # a new file, not the old one rewritten: a checkpoint saved by hard links shares its inode
                tmp = f.with_name(f".{f.name}.{uuid.uuid4().hex[:8]}")
                tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
                os.replace(tmp, f)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


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


def record_pass(model: ModelHandle, pass_: Pass, source: dict[str, Any] | None = None) -> None:
    """Append ``pass_`` (name, plugin, options) to the ``bitpress`` metadata of an ONNX model.

    ``bitpress eval`` reads it back to name the algorithm and its options. The record holds
    nothing that varies between equal runs (no paths, times or thread counts), so the same
    pass on the same input still writes the same bytes. ``source``: where the input came from
    (a Hub id's repo, revision and commit: :attr:`Workflow.origin`), kept as ``"source"``.
    An export of a Hugging Face model to ONNX (``hf_to_onnx``) records it in each of its graphs;
    other kinds of models keep it their own way (:func:`_note_source`).
    """
    from bitpress.hf.export import HfOnnxExport

    if isinstance(model, HfOnnxExport):
        for graph in model.models.values():
            record_pass(graph, pass_, source)
        return
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
    previous = record.get("source")
    record = {"version": __version__, "passes": [*record.get("passes", []), {
        "pass": pass_.name, "plugin": getattr(pass_, "plugin", "?"), "options": options,
    }]}
    if source is not None or previous is not None:
        record["source"] = source if source is not None else previous
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
        saved = _save(registry, model, payload / rel, wf.save)
        _note_source(saved, wf.origin)
        files += saved
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
    origin: dict[str, Any] | None = None,
) -> RunResult:
    """Run a workflow config (a mapping, or a JSON/YAML file).

    The keyword arguments are the CLI's ``run`` flags and override the config's settings when
    given (``None``: as the config says): ``overwrite`` (``--overwrite``), ``jobs``,
    ``external_data`` (True ``--external-data``, False ``--single-file``), ``max_shard_size``
    (bytes), ``check=False`` (``--no-check``), ``data``, ``env_timeout``; ``isolate=True``
    (``--isolate``) runs every pass in a worker process, as ``isolate: true`` does for one pass;
    ``executor`` (``--executor``) replaces the config's ``executor:``. ``origin``: where the input came
    from (:attr:`Workflow.origin`; :func:`bitpress.run` gives it for a Hub id).
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
    if origin is not None:
        wf.origin = origin
    return run_workflow(wf, registry, progress=progress)
