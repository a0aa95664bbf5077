"""The host's own hook implementations: ONNX and Hugging Face loading, pass execution and saving,
and the host's own passes (``qdq_to_nbits``, ``fuse_experts``, ``hf_to_genai``, ``hf_to_onnx``), listed under
plugin ``bitpress``.

Registered before any plugin and marked ``trylast``, so a plugin's implementation of the same
hook is consulted first and these are the fallback. A pass's ``run`` is plugin code: it runs
inside :class:`bitpress.plugin_faults.guard`, so whatever it raises names its plugin.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from bitpress import paths
from bitpress.errors import ModelLoadError
from bitpress.hf.model import HfModel, is_hf_folder
from bitpress.hookspecs import hookimpl
from bitpress.models.base import ModelHandle
from bitpress.models.onnx_model import OnnxModel
from bitpress.models.onnx_package import OnnxPackage
from bitpress.passes import Pass, PassContext
from bitpress.plugin_faults import guard

log = logging.getLogger(__name__)


@hookimpl
def bitpress_register_passes(register: Any) -> None:
    # collected by the registry itself (Registry._add_host_passes), before any plugin's
    from bitpress.hf.passes import HfToGenaiPass, HfToOnnxPass
    from bitpress.onnx.expert_loops import FuseExpertsPass
    from bitpress.onnx.qdq_nbits import QdqToNbitsPass

    register(QdqToNbitsPass)
    register(FuseExpertsPass)
    register(HfToGenaiPass)
    register(HfToOnnxPass)


@hookimpl(trylast=True)
def bitpress_load_model(source: Path, options: dict[str, Any]) -> ModelHandle | None:
    source = Path(source)
    if not source.exists():
        raise ModelLoadError(f"model not found: {source}")
    if source.is_dir():
        # absolute: the package's checks join names to the folder and read them relative to it
        source = source.absolute()
        inner = paths.run_output_model(source)
        if inner is not None:  # what `quantize -o OUT` wrote: OUT/<name>/
            log.info("reading %s: the one model folder in %s", inner.name, source)
            source = inner
        if is_hf_folder(source):  # config.json and no .onnx: a Hugging Face checkpoint (torch loads it lazily)
            return HfModel.load(source, options)
        return OnnxPackage.load(source)
    return OnnxModel.load(source)


@hookimpl(trylast=True)
def bitpress_run_pass(pass_: Pass, model: ModelHandle, context: PassContext) -> ModelHandle:
    # the pass is its plugin's code: whatever it raises (SystemExit too) is that plugin's fault
    with guard(getattr(pass_, "plugin", "?"), f"in pass {pass_.name}"):
        return pass_.run(model, context)


@hookimpl(trylast=True)
def bitpress_save_model(model: ModelHandle, destination: Path, options: dict[str, Any]) -> list[Path] | None:
    from bitpress.onnx.save import SaveOptions, save_onnx

    if isinstance(model, OnnxModel):
        return save_onnx(model, destination, SaveOptions(**options))
    if isinstance(model, HfModel):
        return model.save(destination)
    from bitpress.hf.export import HfOnnxExport

    if isinstance(model, HfOnnxExport):
        return model.save(destination, **options)
    from bitpress.genai.export import GenaiPackage

    if isinstance(model, GenaiPackage):
        return model.save(destination)
    return None
