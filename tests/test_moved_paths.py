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
    from bitpress import data, plugin_faults, plugins
    from bitpress.hf import genai_export, genai_extra
    from bitpress.onnx import inputs

    assert plugins.guard is plugin_faults.guard and plugins.passes_through is plugin_faults.passes_through
    assert data.InputSpec is inputs.InputSpec and data.input_specs is inputs.input_specs
    assert data.vocab_size is inputs.vocab_size
    assert genai_export.GENAI_INSTALL_HINT == genai_extra.GENAI_INSTALL_HINT
