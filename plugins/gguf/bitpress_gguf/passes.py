"""``gguf_to_genai``: a GGUF model to an ONNX Runtime GenAI package holding its own blocks."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bitpress.plugin import Pass, PassContext, option

EPS = ("cpu", "default", "cuda", "dml", "webgpu")


@dataclass
class GgufToGenaiOptions:
    ep: str = option("cpu", "execution provider the package is built for: cpu, default, cuda, dml, webgpu")
    check: bool = option(True, "check the package: ONNX checker, and on cpu an ONNX Runtime session and one "
                         "onnxruntime_genai generation step")
    requantize: dict = option({}, 'GGUF tensors quantized again from their dequantized values instead of kept: '
                              '{"tensors": ["token_embd.weight"], "pass": "kquant", "options": {"bits": 4}} '
                              "(names or globs; any ONNX weight-only pass)")
    # ep already names the target (default = cpu): a separate ``target`` option (kernels.TargetOptions) could
    # disagree with the graph mobius builds for ep, so only the accuracy_level half is taken
    accuracy_level: int | None = option(
        None, "MatMulNBits accuracy_level: 0 unset (float32 compute: the float graph's logits), 4 int8 compute; "
        "null: what runs fastest on the ep's target (4 on cpu, default and webgpu, 0 on cuda and dml)"
    )

    def validate(self) -> None:
        if self.ep not in EPS:
            raise ValueError(f"ep must be one of {', '.join(EPS)}, got {self.ep!r}")
        if self.accuracy_level is not None and self.accuracy_level not in range(5):
            raise ValueError("accuracy_level must be 0..4, or null for the target's default")
        r = self.requantize
        if r:
            if not isinstance(r, dict) or set(r) - {"tensors", "pass", "options"}:
                raise ValueError("requantize takes tensors, pass and options")
            tensors = r.get("tensors")
            if not isinstance(tensors, list) or not tensors or not all(isinstance(t, str) and t for t in tensors):
                raise ValueError("requantize.tensors must be a non-empty list of GGUF tensor names or globs")
            if not isinstance(r.get("pass"), str) or not isinstance(r.get("options", {}), dict):
                raise ValueError("requantize.pass must name a pass and requantize.options be a mapping")


class GgufToGenaiPass(Pass):
    """The GGUF's blocks as MatMulNBits / GatherBlockQuantized in a GenAI package (graph by mobius)."""

    name = "gguf_to_genai"
    algorithms = ("gguf-import",)
    precisions = ()
    model_kinds: ClassVar[tuple[str, ...]] = ("gguf",)
    output_kind: ClassVar[str | None] = "genai-package"
    summary = "a GGUF model to an ONNX Runtime GenAI package keeping llama.cpp's quantized blocks exactly"
    Options: ClassVar[type] = GgufToGenaiOptions
    requires: ClassVar[tuple[str, ...]] = ("gguf", "mobius", "transformers", "torch", "onnxruntime_genai")
    install_hint: ClassVar[str | None] = 'pip install "torch==2.13.0" "bitpress[gguf,genai]"'

    def run(self, model: Any, context: PassContext) -> Any:
        from bitpress.plugin import QuantizationError
        from bitpress_gguf.convert import convert
        from bitpress_gguf.model import GgufModel

        if not isinstance(model, GgufModel):
            raise QuantizationError(f"{self.name} converts GGUF models, got {model.kind}")
        workdir = context.workdir if context.workdir is not None else Path(tempfile.mkdtemp(prefix="bitpress-gguf-"))
        folder = Path(workdir) / "gguf"
        folder.mkdir(parents=True, exist_ok=True)
        return convert(model, folder, ep=self.options.ep, check=self.options.check,
                       requantize=self.options.requantize or None, accuracy_level=self.options.accuracy_level)
