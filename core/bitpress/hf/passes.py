"""Pass classes for Hugging Face models: the base of the PyTorch weight quantizers, and the export.

A plugin supplies the block solver (``rtn_solver``, ``kquant_solver``) by subclassing
:class:`HfQuantPass`, exactly as ONNX weight-only passes subclass
:class:`bitpress.onnx.weightonly.WeightOnlyPass`. :class:`HfToOnnxPass` is host code that the
plugins register (the same class from several plugins is one pass).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from bitpress.errors import QuantizationError
from bitpress.genai import GENAI_INSTALL_HINT
from bitpress.hf.model import HfModel
from bitpress.hf.rules import HfQuantOptions
from bitpress.onnx.kernels import TargetOptions
from bitpress.options import option
from bitpress.passes import Pass, PassContext
from bitpress.quant.solver import BlockSolver

log = logging.getLogger(__name__)

HF_REQUIRES = ("torch", "transformers", "safetensors")
HF_INSTALL_HINT = 'pip install "torch==2.13.0" "transformers==5.17.0" safetensors'


class HfQuantPass(Pass):
    """Weight-only quantization of a PyTorch (Hugging Face) model; subclasses provide :meth:`solver`."""

    model_kinds: ClassVar[tuple[str, ...]] = ("hf",)
    precisions: ClassVar[tuple[str, ...]] = ("int2", "int4", "int8")
    Options: ClassVar[type] = HfQuantOptions
    requires: ClassVar[tuple[str, ...]] = HF_REQUIRES
    install_hint: ClassVar[str | None] = HF_INSTALL_HINT
    #: streamed, the per-weight solves go to the executor (Ray tasks read their tensor from the shard)
    distributes: ClassVar[bool] = True
    experts: ClassVar[str | None] = "with moe: true"

    def solver(self) -> BlockSolver:
        raise NotImplementedError

    def float_zero_points(self) -> bool:
        return bool(getattr(self.options, "float_zero_points", False))

    def run(self, model: Any, context: PassContext) -> Any:
        from bitpress.hf import quantize

        if not isinstance(model, HfModel):
            raise QuantizationError(f"{self.name} quantizes Hugging Face models, got {model.kind}")
        opts = self.options
        model.allow(trust_remote_code=opts.trust_remote_code, allow_pickle=opts.allow_pickle)
        rules = opts.rules()
        # how the model was read is not recorded: streaming or not, the checkpoint is the same
        record = {k: v for k, v in asdict(opts).items() if k not in ("trust_remote_code", "allow_pickle", "stream")}
        entry = {"pass": self.name, "options": record}
        if getattr(opts, "stream", False):
            streamed = self._stream(model, context, rules, entry)
            if streamed is not None:
                return streamed
        if getattr(context.executor, "type", "threads") != "threads":
            log.warning("%s: the whole model is loaded, so its weights are quantized on this machine's threads "
                        "(only streaming hands them to the %s executor)", self.name, context.executor.type)
        torch_model = model.torch_model()
        p = quantize.plan(torch_model, rules, float_zero_points=self.float_zero_points())  # raises before any work
        with context.step(len(p.jobs), "quantizing") as advance:
            report = quantize.apply(torch_model, p, self.solver(), jobs=context.jobs, progress=advance)
        model.history.append(entry)
        context.extras.setdefault("reports", []).append((self.name, model.source, report))
        return model

    def _stream(self, model: HfModel, context: PassContext, rules: Any, entry: dict[str, Any]) -> HfModel | None:
        """The quantized checkpoint streamed into the run's scratch folder, or None: load the whole model.

        The result is a handle on that folder (not loaded; the passes after it load it if they need
        torch, and saving it links its files into the output). Without a scratch folder (a pass
        run from Python) a temporary one is used and removed with the handle.
        """
        import shutil
        import tempfile
        import weakref
        from pathlib import Path

        from bitpress.hf.streaming import quantize_streaming

        if context.workdir is not None:
            Path(context.workdir).mkdir(parents=True, exist_ok=True)
        base = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=context.workdir))
        dest = base / model.source.name
        history = [*model.history, entry]
        try:
            report = quantize_streaming(model, rules, self.solver(), dest, float_zero_points=self.float_zero_points(),
                                        history=history, jobs=context.jobs, step=context.step,
                                        executor=context.executor)
        except BaseException:
            shutil.rmtree(base, ignore_errors=True)  # a failed pass leaves nothing behind
            raise
        if report is None:
            shutil.rmtree(base, ignore_errors=True)
            return None
        out = HfModel.written(dest, history=history, like=model)
        if context.workdir is None:
            weakref.finalize(out, shutil.rmtree, str(base), True)
        context.extras.setdefault("reports", []).append((self.name, model.source, report))
        return out


@dataclass
class HfToOnnxOptions(TargetOptions):
    split_embedding: bool = option(
        False, "write embedding.onnx + decoder.onnx (a tied table stored once, shared) instead of model.onnx"
    )
    opset: int = option(17, "ONNX opset of the traced graph")
    trust_remote_code: bool = option(False, "allow the model folder's own Python code (auto_map) to run when loading")
    allow_pickle: bool = option(False, "allow loading .bin/.pt pickled weights (trusted sources only)")

    def validate(self) -> None:
        if not 14 <= self.opset <= 21:
            raise ValueError(f"opset must be from 14 to 21, got {self.opset}")


class HfToOnnxPass(Pass):
    """Export to ONNX: quantized linears as MatMulNBits, quantized embeddings as GatherBlockQuantized."""

    name = "hf_to_onnx"
    algorithms = ("onnx-export",)
    precisions = ()
    model_kinds: ClassVar[tuple[str, ...]] = ("hf",)
    output_kind: ClassVar[str | None] = "onnx"
    summary = "export a Hugging Face model (quantized or not) to ONNX with MatMulNBits / GatherBlockQuantized"
    Options: ClassVar[type] = HfToOnnxOptions
    requires: ClassVar[tuple[str, ...]] = HF_REQUIRES
    install_hint: ClassVar[str | None] = HF_INSTALL_HINT
    aliases: ClassVar[tuple[str, ...]] = ("OnnxConversion",)

    def run(self, model: Any, context: PassContext) -> Any:
        import tempfile
        from pathlib import Path

        from bitpress.hf.export import export

        if not isinstance(model, HfModel):
            raise QuantizationError(f"{self.name} exports Hugging Face models, got {model.kind}")
        o = self.options
        model.allow(trust_remote_code=o.trust_remote_code, allow_pickle=o.allow_pickle)
        workdir = context.workdir if context.workdir is not None else Path(tempfile.mkdtemp(prefix="bitpress-export-"))
        return export(model, Path(workdir) / "export", split_embedding=o.split_embedding, opset=o.opset,
                      accuracy_level=o.resolved_accuracy_level())


@dataclass
class HfToGenaiOptions:
    exporter: str = option("auto", "the exporter: auto (the one that builds this architecture right, "
                           "docs/architectures.md), builder (python -m onnxruntime_genai.models.builder) or mobius "
                           "(mobius build)")
    dtype: str = option("auto", "f32, f16 or bf16 weights and activations (auto: f32); a quantized checkpoint "
                        "keeps its integers (the builder: auto only, its int4 path; mobius: scales cast to dtype)")
    ep: str = option("cpu", "execution provider the package is built for: builder cpu, cuda, dml, webgpu, "
                     "NvTensorRtRtx; mobius default, cpu, cuda, dml, webgpu, trt-rtx, qnn, openvino")
    accuracy_level: int = option(-1, "MatMulNBits accuracy_level (-1: the exporter's default, 4 on cpu: int8 "
                                 "activations; 1: float32 math)")
    builder_options: dict = option({}, "more --extra_options KEY=VALUE for the builder (see its --help)")
    check: bool = option(True, "check the package: ONNX checker, and on cpu an ONNX Runtime session, a generation "
                         "step and its logits against transformers' (prefill and decode, docs/architectures.md)")
    split_embedding: bool = option(False, "embedding and decoder as separate components (embedding.onnx, "
                                   "decoder.onnx: a decoder-pipeline package; a tied table stays stored once)")
    trust_remote_code: bool = option(False, "allow the model folder's own Python code (auto_map) to run when loading")
    allow_pickle: bool = option(False, "allow loading .bin/.pt pickled weights (trusted sources only)")

    def validate(self) -> None:
        from bitpress.genai.export import EPS, FLOAT_PRECISION
        from bitpress.genai.exporters import EXPORTERS
        from bitpress.genai.mobius import MOBIUS_EPS

        if self.exporter not in EXPORTERS:
            raise ValueError(f"exporter must be one of {', '.join(EXPORTERS)}, got {self.exporter!r}")
        if self.dtype != "auto" and self.dtype not in FLOAT_PRECISION:
            raise ValueError(f"dtype must be auto, {', '.join(FLOAT_PRECISION)}, got {self.dtype!r}")
        eps = {"builder": EPS, "mobius": MOBIUS_EPS}.get(self.exporter, (*EPS, *MOBIUS_EPS))
        if self.ep not in eps:
            who = {"builder": "the builder", "mobius": "mobius"}.get(self.exporter, "either exporter")
            raise ValueError(f"ep must be one of {', '.join(eps)} with {who}, got {self.ep!r}")
        if self.builder_options and self.exporter == "mobius":
            raise ValueError("builder_options apply to exporter builder only")
        if self.accuracy_level not in (-1, 0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be -1 or 0..4, got {self.accuracy_level}")
        if not isinstance(self.builder_options, dict) or not all(
            isinstance(k, str) and isinstance(v, str | int | float | bool) for k, v in self.builder_options.items()
        ):
            raise ValueError("builder_options must map option names to plain values")


class HfToGenaiPass(Pass):
    """Build an ONNX Runtime GenAI package (KV cache, genai_config.json, tokenizer) with the real exporters
    (the GenAI builder or mobius); a bitpress-quantized checkpoint keeps its exact integers (olive format)."""

    name = "hf_to_genai"
    algorithms = ("genai-export",)
    precisions = ()
    model_kinds: ClassVar[tuple[str, ...]] = ("hf",)
    output_kind: ClassVar[str | None] = "genai-package"
    summary = "export a Hugging Face model (float or bitpress-quantized) to an ONNX Runtime GenAI package"
    Options: ClassVar[type] = HfToGenaiOptions
    requires: ClassVar[tuple[str, ...]] = (*HF_REQUIRES, "onnxruntime_genai")
    install_hint: ClassVar[str | None] = GENAI_INSTALL_HINT

    def run(self, model: Any, context: PassContext) -> Any:
        import tempfile
        from pathlib import Path

        from bitpress.genai.export import build_genai

        if not isinstance(model, HfModel):
            raise QuantizationError(f"{self.name} exports Hugging Face models, got {model.kind}")
        o = self.options
        model.allow(trust_remote_code=o.trust_remote_code, allow_pickle=o.allow_pickle)
        workdir = context.workdir if context.workdir is not None else Path(tempfile.mkdtemp(prefix="bitpress-genai-"))
        folder = Path(workdir) / "genai"
        folder.mkdir(parents=True, exist_ok=True)
        package = build_genai(model, folder, exporter=o.exporter, dtype=o.dtype, ep=o.ep,
                              accuracy_level=None if o.accuracy_level < 0 else o.accuracy_level,
                              extra={k: str(v).lower() if isinstance(v, bool) else str(v)
                                     for k, v in o.builder_options.items()}, check=o.check,
                              split=o.split_embedding)
        notes = context.extras.setdefault("notes", [])  # in the run report: which exporter, and the check
        notes.append(f"{self.name}: exporter {package.made['exporter_choice']}")
        if package.made.get("check"):
            notes.append(f"{self.name}: {package.made['check']['summary']}")
        return package
