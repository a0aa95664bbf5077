"""Modules that moved keep their old import paths for one release: the same objects, and a DeprecationWarning
naming the new path (issue 28)."""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = [
    # (old module, new module, names)
    ("bitpress.models.hf_model", "bitpress.hf.model", ("HfModel", "is_hf_folder")),
    ("bitpress_rtn.bnb4", "bitpress.onnx.bnb4",
     ("BNB4_QUANT_TYPES", "NF4_CODEBOOK", "dequantize_bnb4", "quantize_bnb4")),
    # GenAI packages: bitpress.genai; calibration data: bitpress.calibration
    ("bitpress.models.package", "bitpress.genai.package",
     ("GENAI_CONFIG", "ModelFile", "check_genai_config", "read_genai_config", "resolve_model")),
    ("bitpress.models.package", "bitpress.models.onnx_package", ("OnnxPackage",)),
    ("bitpress.kvcache", "bitpress.genai.kvcache",
     ("CachePlan", "KVCacheError", "PastFill", "cache_plan", "decoder_section", "ids_input", "is_past", "kv_hints",
      "window_feeds")),
    ("bitpress.kvcache", "bitpress.genai.package", ("GENAI_CONFIG", "companion", "search_folders")),
    ("bitpress.kvcache", "bitpress.calibration.text",
     ("TOKENIZER", "TOKENIZER_CONFIG", "TextTokens", "bos_tokens", "find_tokenizer", "load_tokenizer", "token_windows",
      "tokenize")),
    ("bitpress.data", "bitpress.calibration.data",
     ("DataConfig", "InputSpec", "_npz", "input_specs", "iter_feeds", "vocab_size")),
    ("bitpress.publish", "bitpress.genai.publish",
     ("INDEX", "Cell", "PublishResult", "_RUNNABLE", "_check_genai", "check_eval", "evaluate_cells",
      "load_publish_config", "plan_cells", "publish")),
    ("bitpress.manifest", "bitpress.genai.manifest",
     ("FORMAT", "MANIFEST", "TOOLKITS", "VerifyResult", "add_evaluation", "check", "sha256_of", "verify", "versions",
      "write_manifest")),
    ("bitpress.hf.genai_export", "bitpress.genai.export",
     ("BUILD_TIMEOUT_S", "EPS", "EXPORTERS", "FLOAT_PRECISION", "GENAI_INSTALL_HINT", "GenaiPackage", "build_genai",
      "builder_missing", "builder_reason", "check_package", "fix_tied_gather_scales", "generate_step", "greedy",
      "stage_files")),
    ("bitpress.hf.mobius_export", "bitpress.genai.mobius",
     ("CPU_RUNNABLE", "MOBIUS_EPS", "finish_mobius", "mobius_argv", "mobius_missing", "set_accuracy_level")),
    ("bitpress.hf.genai_split", "bitpress.genai.split", ("DECODER", "EMBEDDING", "EMBEDS", "split_package")),
    ("bitpress.hf.genai_extra", "bitpress.genai", ("GENAI_INSTALL_HINT",)),
    # configs, plans and runs: bitpress.workflow
    ("bitpress.dry_run", "bitpress.workflow.plan",
     ("PlanResult", "StepPlan", "plan_lines", "plan_quantize", "plan_run", "plan_workflow", "weight_table_lines")),
]


@pytest.mark.parametrize(("old", "new", "names"), MOVED, ids=[m[0] for m in MOVED])
def test_an_old_path_warns_and_gives_the_same_objects(old: str, new: str, names: tuple[str, ...]) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        shim = importlib.import_module(old)
    target = importlib.import_module(new)
    for name in names:
        assert getattr(shim, name) is getattr(target, name)


def test_names_kept_where_they_were() -> None:
    """Names other modules moved out but still offer, without a warning (a plain re-export)."""
    import bitpress.genai
    from bitpress import plugin_faults, plugins
    from bitpress.calibration import data
    from bitpress.genai import export, mobius
    from bitpress.onnx import inputs

    assert plugins.guard is plugin_faults.guard and plugins.passes_through is plugin_faults.passes_through
    assert data.InputSpec is inputs.InputSpec and data.input_specs is inputs.input_specs
    assert data.vocab_size is inputs.vocab_size
    assert export.GENAI_INSTALL_HINT is mobius.GENAI_INSTALL_HINT is bitpress.genai.GENAI_INSTALL_HINT


def test_names_renamed_on_the_way() -> None:
    """bitpress.kvcache.read_genai_config (a model's genai_config.json, searched up to the package's folder)
    is bitpress.genai.package.find_genai_config: that module's read_genai_config reads one folder's."""
    from bitpress.genai import package

    for old in ("bitpress.kvcache", "bitpress.data"):
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=r"bitpress\.(genai|calibration)\."):
            shim = importlib.import_module(old)
        assert shim.read_genai_config is package.find_genai_config
