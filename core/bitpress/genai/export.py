"""A Hugging Face model (float or bitpress-quantized) to an ONNX Runtime GenAI package, by a real exporter.

The ONNX Runtime GenAI model builder (``python -m onnxruntime_genai.models.builder``, the
``genai`` extra) or mobius (``mobius build``, :mod:`bitpress.genai.mobius`) writes what
deployment needs: a KV cache, ``GroupQueryAttention``, ``genai_config.json``, the tokenizer
and processor files. bitpress hands the exporter a folder staged in the work folder, never the
input itself (an exporter reads whatever a folder holds):

* a float model: its float weights, config and companion files;
* a quantized model: an olive-format checkpoint (:mod:`bitpress.hf.olive`), whose integers,
  scales and zero points the builder copies into ``MatMulNBits`` unchanged, with the builder
  options that keep it faithful (float LM heads left float, ``fuse_qkv=false`` where q/k/v
  differ);
* a quantized mixture-of-experts model (``moe: true``): a float checkpoint with bitpress's
  dequantized experts, built with QMoE experts; bitpress's integers, scales and zero points are then
  written into the QMoE nodes, each checked against the builder's own (:mod:`bitpress.genai.moe`);
  with mobius, whose float experts are a loop over experts, each loop is fused into a QMoE node
  holding bitpress's integers, checked against mobius's float weights (:mod:`bitpress.genai.moe_loop`).

Which exporter: ``auto`` (the default) takes the one that builds the architecture right
(:mod:`bitpress.genai.exporters`); the builder runs through :mod:`bitpress.genai.builder_run`.

Afterwards: the builder's tied quantized embedding (``GatherBlockQuantized`` reading the LM
head's tensors) is given the 2-D scales and zero points ONNX Runtime requires (the builder
passes the 1-D ones of ``MatMulNBits``; the table stays one), and the package is checked: the
ONNX checker, an ONNX Runtime session, one ``onnxruntime_genai`` generation step and its
logits against transformers', prefill and decode (:mod:`bitpress.genai.check`; the last three
on CPU-runnable packages only: other EPs need their hardware). ``split=True`` then cuts
the package into an embedding and a decoder component (:mod:`bitpress.genai.split`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from bitpress.errors import ExportError, ValidationError
from bitpress.genai import GENAI_INSTALL_HINT
from bitpress.genai.exporters import BUILDER_EPS as EPS
from bitpress.genai.exporters import EXPORTERS
from bitpress.models.base import ModelHandle

if TYPE_CHECKING:
    from bitpress.hf.model import HfModel

log = logging.getLogger(__name__)

#: --dtype -> the builder's precision, for float checkpoints
FLOAT_PRECISION = {"f32": "fp32", "f16": "fp16", "bf16": "bf16"}
BUILD_TIMEOUT_S = 3600


class GenaiPackage(ModelHandle):
    """A built GenAI folder in the work folder; :meth:`save` copies it."""

    kind: ClassVar[str] = "genai-package"

    def __init__(self, source: Path, folder: Path, made: dict[str, Any] | None = None) -> None:
        super().__init__(source)
        self.folder = folder
        self.made = made or {}  # how it was made, for the manifest

    def save(self, dest: Path) -> list[Path]:
        """Copy the package to ``dest`` and write its ``bitpress-manifest.json`` (sizes, sha256)."""
        from bitpress.genai.manifest import write_manifest

        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        files = []
        for f in sorted(self.folder.rglob("*")):
            if f.is_file() and not f.is_symlink():
                target = dest / f.relative_to(self.folder)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, target)
                files.append(target)
        files.append(write_manifest(dest, made=self.made, files=files))
        return files


def builder_missing() -> str | None:
    """Why the builder cannot run here (None when it can)."""
    needed = ("onnxruntime_genai", "onnx_ir", "transformers", "torch")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        return f"the ONNX Runtime GenAI builder needs {', '.join(missing)}: {GENAI_INSTALL_HINT}"
    if importlib.util.find_spec("onnxruntime_genai.models.builder") is None:
        return f"this onnxruntime_genai has no model builder: {GENAI_INSTALL_HINT}"
    return None


def build_genai(
    model: HfModel, workdir: Path, *, exporter: str = "auto", dtype: str = "auto", ep: str = "cpu",
    accuracy_level: int | None = None, extra: dict[str, str] | None = None, check: bool = True,
    split: bool = False, timeout: float = BUILD_TIMEOUT_S,
) -> GenaiPackage:
    """Build ``model`` into a GenAI package in ``workdir`` with ``exporter`` (``auto``, ``builder`` or
    ``mobius``; see the module's docstring)."""
    from bitpress.genai import mobius, moe
    from bitpress.genai.exporters import choose, is_quantized
    from bitpress.hf.olive import write_olive
    from bitpress.models import hf_files

    if exporter not in EXPORTERS:
        raise ExportError(f"unknown exporter {exporter!r}; known: {', '.join(EXPORTERS)}")
    if extra and exporter == "auto":
        exporter = "builder"  # builder_options are the builder's
    choice = choose(exporter, hf_files.read_json(model.source, "config.json"), quantized=is_quantized(model), ep=ep,
                    dtype=dtype)
    exporter = choice.exporter
    log.info("exporter %s", choice.reason)
    reason = builder_missing() if exporter == "builder" else mobius.mobius_missing()
    if reason:
        raise ExportError(reason)
    eps = EPS if exporter == "builder" else mobius.MOBIUS_EPS
    if ep not in eps:
        who = "the GenAI builder" if exporter == "builder" else "mobius"
        raise ExportError(f"unknown execution provider {ep!r} for {who}; known: {', '.join(eps)}")
    if dtype != "auto" and dtype not in FLOAT_PRECISION:
        raise ExportError(f"unknown dtype {dtype!r}; use auto, {', '.join(FLOAT_PRECISION)}")
    if extra and exporter != "builder":
        raise ExportError(f"builder_options ({', '.join(extra)}) apply to --exporter builder only")
    workdir = Path(workdir)
    staged, out, cache = workdir / "checkpoint", workdir / "package", workdir / "builder-cache"
    for d in (staged, out):
        shutil.rmtree(d, ignore_errors=True)
    head_products: dict[str, np.ndarray] = {}
    experts: list[Any] = []  # bitpress's quantized experts, written into the built QMoE nodes
    if not model.loaded and not _ours(model.source):
        ckpt = stage_files(model.source, staged, allow_pickle=model.allow_pickle)  # no torch load, no second copy
    else:
        from bitpress.hf import online

        head_products = online.check_exportable(model.torch_model())
        if moe.quantized_moe(model.torch_model()):
            experts = moe.check_moe(model.torch_model(), exporter)
            cpu_eps = mobius.CPU_RUNNABLE if exporter == "mobius" else ("cpu",)
            if ep not in cpu_eps or dtype not in ("auto", "f32"):
                raise ExportError(f"bitpress writes its quantized experts into float32 CPU QMoE nodes (the layout "
                                  f"checked); export with -e cpu and dtype auto or f32, not {ep} {dtype}")
            ckpt = moe.stage_moe(model.torch_model(), staged, source=model.source)
        else:
            ckpt = write_olive(model.torch_model(), staged, source=model.source, exporter=exporter)
    config = hf_files.read_json(staged, "config.json")
    if exporter == "mobius":  # one dtype for float weights and activations; quantized scales are cast to it
        mobius.check_config(config)
        arguments = mobius.mobius_argv(staged, out, dtype="f32" if dtype == "auto" else dtype, ep=ep)
        extra_args = arguments[arguments.index("--dtype"):]
        name = "mobius"
    else:
        _builder_can_read(config)
        if ckpt.quantized and dtype != "auto":
            raise ExportError(
                f"dtype {dtype} applies to float checkpoints with the builder: a quantized one is built by its "
                "int4 path (activations fp32 on cpu, fp16 on cuda); drop --dtype, export the float model, or "
                "use --exporter mobius"
            )
        # pre-quantized modules keep their own bits; the rest is excluded (kept float)
        precision = "int4" if ckpt.quantized else FLOAT_PRECISION.get(dtype, "fp32")
        options = {**ckpt.builder_options, **(moe.builder_options(experts) if experts else {}), **(extra or {})}
        if accuracy_level is not None:
            options["accuracy_level"] = str(int(accuracy_level))
        extra_args = ["-p", precision, "-e", ep]
        if options:
            extra_args += ["--extra_options", *(f"{k}={v}" for k, v in options.items())]
        # the builder itself, run on a configuration it reads right (bitpress.genai.builder_run)
        arguments = [sys.executable, "-m", "bitpress.genai.builder_run", "-i", str(staged), "-o", str(out),
                     "-c", str(cache), *extra_args]
        name = "the GenAI builder"
    _run_exporter(name, arguments, workdir, out, model.source.name, timeout)
    if exporter == "mobius":
        mobius.finish_mobius(out, config, accuracy_level)
        if experts:
            from bitpress.genai import moe_loop

            try:  # 0 (the QMoE default): float32 activations for 4-bit experts
                moe_loop.fuse_experts(out, experts, int(accuracy_level or 0), workdir)
            except ExportError:
                shutil.rmtree(out, ignore_errors=True)
                raise
    else:
        fixed = fix_tied_gather_scales(out)
        if fixed:
            log.info("tied embedding: %d GatherBlockQuantized inputs reshaped to 2-D (the table stays shared)", fixed)
        if experts:
            try:
                moe.write_experts(out, experts)
            except ExportError:
                shutil.rmtree(out, ignore_errors=True)
                raise
    for module, matrix in head_products.items():  # a rotated model's product before its tied LM head
        from bitpress.hf.online import insert_before_head

        graphs = insert_before_head(out, matrix, name=module)
        if not graphs:
            shutil.rmtree(out, ignore_errors=True)
            raise ExportError(f"the package built from {model.source.name} has no graph with a logits output, so the "
                              f"online product of {module} has nowhere to go")
        log.info("%s: online product (%d x %d) inserted before the LM head of %d graph(s)", module, *matrix.shape,
                 graphs)
    if split:
        from bitpress.genai.split import split_package

        split_package(out)
    made = {"source": model.source.name, "passes": list(getattr(model, "history", []) or []),
            "exporter": "onnxruntime_genai.models.builder" if exporter == "builder" else "mobius build",
            "exporter_arguments": extra_args, "exporter_choice": choice.reason,
            "checkpoint": "olive" if ckpt.quantized else "float, bitpress's experts written into QMoE" if experts
            else "float",
            "components": ["embedding", "decoder"] if split else ["model"]}
    if check:
        runs_here = "cpu" if ep in mobius.CPU_RUNNABLE else ep
        check_package(out, runs_here)
        if runs_here == "cpu":
            from bitpress.genai.check import check_logits

            try:
                made["check"] = check_logits(out, model.torch_model(), dtype="f32" if dtype == "auto" else dtype,
                                             what=model.source.name, model_type=str(config.get("model_type")),
                                             workdir=workdir).to_json()
            except ExportError:
                shutil.rmtree(out, ignore_errors=True)
                raise
    shutil.rmtree(staged, ignore_errors=True)
    return GenaiPackage(model.source, out, made)


def _builder_can_read(config: dict[str, Any]) -> None:
    """Refuse, before the build, configs builder 0.18 is known to fail on (measured)."""
    from bitpress.genai.builder_run import PER_LAYER_TYPE_ROPE

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    rope = text.get("rope_parameters")
    per_type = isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values())
    if per_type and not set(config.get("architectures") or ()) & set(PER_LAYER_TYPE_ROPE):
        raise ExportError(
            f"the GenAI builder 0.18 cannot read rope_parameters per attention type ({', '.join(sorted(rope))}; "
            f"model type {config.get('model_type')!r}; bitpress adapts them for Gemma-3 only): use --exporter mobius"
        )


def _run_exporter(name: str, argv: list[str], workdir: Path, out: Path, what: str, timeout: float) -> None:
    """Run an exporter offline, its output in ``workdir/<exporter>.log``; on failure, no package is left
    and one :class:`ExportError` line carries the exporter's own reason."""
    log.info("%s: %s", name, " ".join(argv[2:]))
    logfile = workdir / "exporter.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    try:
        with logfile.open("w") as fh:
            proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False,
                                  cwd=workdir)
    except subprocess.TimeoutExpired:
        shutil.rmtree(out, ignore_errors=True)
        _log_tail(logfile)
        raise ExportError(f"{name} did not finish in {timeout:.0f} s (-v shows its output)") from None
    if proc.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        _log_tail(logfile)  # the log is in the run's private folder, removed with it
        raise ExportError(f"{name} failed on {what}: {builder_reason(logfile)} (-v shows its output)")
    _log_tail(logfile, lines=10)


def _log_tail(logfile: Path, lines: int = 60) -> None:
    text = logfile.read_text(errors="replace").splitlines() if logfile.exists() else []
    for line in text[-lines:]:
        log.debug("exporter: %s", line)


def _ours(folder: Path) -> bool:
    from bitpress.hf.checkpoint import QUANT_METHOD, read_config

    qc = read_config(folder).get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def stage_files(source: Path, dest: Path, *, allow_pickle: bool = False) -> Any:
    """A float checkpoint staged for the builder by copying its files (config, safetensors shards and
    their index, tokenizer and other companions), each checked to stay inside ``source``: the model is
    never loaded here (the builder loads it once)."""
    from bitpress.hf.checkpoint import companion_files, copy_companion
    from bitpress.hf.olive import OliveCheckpoint
    from bitpress.models import hf_files

    shards = hf_files.check_folder(source)
    qc = hf_files.read_json(source, "config.json").get("quantization_config")
    if qc:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ExportError(
            f"{source} is already quantized by another tool (quant_method {method!r}); hf_to_genai builds float and "
            "bitpress checkpoints (the builder imports some formats itself: python -m "
            "onnxruntime_genai.models.builder -i FOLDER -p int4)"
        )
    _, pickles = hf_files.weight_files(source)
    if not shards and pickles and not allow_pickle:
        raise ExportError(f"{source} holds only pickled weights ({', '.join(p.name for p in pickles)}): loading them "
                          "can run arbitrary code; convert them to safetensors, or opt in with allow_pickle=true")
    dest.mkdir(parents=True, exist_ok=True)
    names = [source / "config.json", *shards, *(pickles if not shards else [])]
    names += [p for p in hf_files.top_files(source) if p.name.endswith(".index.json")]
    for f in names:
        copy_companion(source, f, dest / f.name)
    for f in companion_files(source):
        if not (dest / f.name).exists():
            copy_companion(source, f, dest / f.name)
    return OliveCheckpoint(dest, quantized=False)


def builder_reason(logfile: Path) -> str:
    """The builder's own reason for failing: the last error line of its output."""
    lines = [ln.strip() for ln in logfile.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|Exception)\b|error:", ln) and not ln.startswith("File "):
            return ln[:500]
    return lines[-1][:500] if lines else "no output"


def _decoder_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.onnx") if p.is_file())


def fix_tied_gather_scales(folder: Path) -> int:
    """Reshape the 1-D scales / zero points a ``GatherBlockQuantized`` shares with ``MatMulNBits`` to
    the 2-D ``[rows, blocks]`` / ``[rows, packed]`` it requires; returns the inputs reshaped."""
    import onnx
    from onnx import helper, numpy_helper

    count = 0
    for path in _decoder_files(folder):
        proto = onnx.load(str(path), load_external_data=False)
        g = proto.graph
        inits = {t.name: t for t in g.initializer}
        by_scales = {}
        for n in g.node:
            if n.op_type == "MatMulNBits" and len(n.input) > 2:
                by_scales[n.input[2]] = n
        changed: list[tuple[int, list[onnx.NodeProto]]] = []
        for i, n in enumerate(g.node):
            if n.op_type != "GatherBlockQuantized" or len(n.input) < 3:
                continue
            mm = by_scales.get(n.input[2])
            t = inits.get(n.input[2])
            if mm is None or t is None or len(t.dims) != 1:
                continue
            a = {x.name: helper.get_attribute_value(x) for x in mm.attribute}
            rows, blocks = int(a["N"]), -(-int(a["K"]) // int(a["block_size"]))
            shapes = {2: [rows, blocks], 3: [rows, -(-blocks * int(a["bits"]) // 8)]}
            pre = []
            for idx, shape in shapes.items():
                if len(n.input) <= idx or not n.input[idx]:
                    continue
                src = n.input[idx]
                shape_name = f"{src}/bitpress_2d_shape"
                out_name = f"{src}/bitpress_2d"
                if shape_name not in inits:
                    sh = numpy_helper.from_array(np.array(shape, np.int64), shape_name)
                    g.initializer.append(sh)
                    inits[shape_name] = sh
                pre.append(helper.make_node("Reshape", [src, shape_name], [out_name],
                                            name=f"{n.name}/bitpress_2d_{idx}"))
                n.input[idx] = out_name
                count += 1
            changed.append((i, pre))
        if not changed:
            continue
        nodes = list(g.node)
        for i, pre in reversed(changed):
            nodes[i:i] = pre
        del g.node[:]
        g.node.extend(nodes)
        onnx.save(proto, str(path))  # external data untouched: the tensors still point at their file
    return count


def check_package(folder: Path, ep: str) -> None:
    """The ONNX checker on every graph; on ``cpu``, an ONNX Runtime session and one generation step."""
    from bitpress.genai.package import read_genai_config
    from bitpress.onnx.save import check_with_ort_ops

    if read_genai_config(folder) is None:
        raise ValidationError(f"the builder wrote no genai_config.json in {folder}")
    files = _decoder_files(folder)
    if not files:
        raise ValidationError(f"the builder wrote no .onnx file in {folder}")
    for path in files:
        try:
            check_with_ort_ops(path)
        except Exception as exc:  # onnx raises its own ValidationError and others
            raise ValidationError(f"the built {path.name} fails the ONNX checker: {str(exc).strip()[:300]}") from None
    if ep != "cpu":
        log.info("package for %s: checked with the ONNX checker (a session and a generation need that EP)", ep)
        return
    import onnxruntime as ort

    for path in files:
        try:
            ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own pybind exception types
            raise ValidationError(f"ONNX Runtime cannot load the built {path.name}: "
                                  f"{(str(exc).strip().splitlines() or ['?'])[0][:300]}") from None
    generate_step(folder)


def greedy(folder: Path, prompt: list[int], tokens: int) -> list[int]:
    """Up to ``tokens`` greedy tokens after ``prompt`` from the package ``folder``, by ``onnxruntime_genai``."""
    import onnxruntime_genai as og

    from bitpress.genai.package import read_genai_config, sliding_window

    cfg = read_genai_config(folder)
    window = sliding_window(cfg)  # a sliding-window KV cache must hold it (onnxruntime_genai refuses less)
    context = int(((cfg or {}).get("model") or {}).get("context_length") or 0) or len(prompt) + tokens
    m = og.Model(str(folder))
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=min(max(len(prompt) + tokens, window), context), do_sample=False)
    gen = og.Generator(m, params)
    gen.append_tokens(np.array([prompt], dtype=np.int32))
    out: list[int] = []
    while not gen.is_done() and len(out) < tokens:
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def generate_step(folder: Path, tokens: int = 1) -> list[int]:
    """``onnxruntime_genai`` loads ``folder`` and generates ``tokens`` tokens after a 3-token prompt."""
    try:
        vocab = _vocab_size(folder)
        out = greedy(folder, [i % vocab for i in (1, 2, 3)], tokens)
    except Exception as exc:  # onnxruntime_genai raises plain RuntimeErrors
        raise ValidationError(f"onnxruntime_genai cannot generate with {folder.name}: "
                              f"{(str(exc).strip().splitlines() or ['?'])[0][:300]}") from None
    if not out or not all(0 <= t < vocab for t in out):
        raise ValidationError(f"onnxruntime_genai generated {out} with {folder.name} (vocabulary of {vocab})")
    return out


def _vocab_size(folder: Path) -> int:
    from bitpress.genai.package import read_genai_config

    cfg: dict[str, Any] = read_genai_config(folder) or {}
    return int((cfg.get("model") or {}).get("vocab_size") or 2)
