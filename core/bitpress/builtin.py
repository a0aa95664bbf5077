"""The host's own hook implementations: ONNX loading, pass execution and saving.

Registered before any plugin and marked ``trylast``, so a plugin's implementation of the same
hook is consulted first and these are the fallback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bitpress.errors import ModelLoadError
from bitpress.hookspecs import hookimpl
from bitpress.models.base import ModelHandle
from bitpress.models.onnx_model import OnnxModel
from bitpress.models.package import OnnxPackage
from bitpress.passes import Pass, PassContext


@hookimpl(trylast=True)
def bitpress_load_model(source: Path, options: dict[str, Any]) -> ModelHandle | None:
    source = Path(source)
    if not source.exists():
        raise ModelLoadError(f"model not found: {source}")
    if source.is_dir():
        return OnnxPackage.load(source)
    return OnnxModel.load(source)


@hookimpl(trylast=True)
def bitpress_run_pass(pass_: Pass, model: ModelHandle, context: PassContext) -> ModelHandle:
    return pass_.run(model, context)


@hookimpl(trylast=True)
def bitpress_save_model(model: ModelHandle, destination: Path, options: dict[str, Any]) -> list[Path] | None:
    from bitpress.onnx.save import SaveOptions, save_onnx

    if isinstance(model, OnnxModel):
        return save_onnx(model, destination, SaveOptions(**options))
    return None
