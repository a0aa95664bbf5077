"""The Intel Neural Compressor plugin where INC is not installed (the host's own environment).

``make venv`` installs ``plugins/inc`` here without its ``toolkit`` extra (onnx-neural-compressor
declares numpy<2; the host has numpy 2): its passes must be listed as unavailable with the exact
install command, their options must be checked all the same, and selecting one must fail
(exit 1) with the same message before any work. Skipped where INC is importable (its environment).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bitpress.errors import OptionError
from bitpress.plugins import Registry
from bitpress.testing import assert_plugin_loaded, run_python, unavailable_registry

if importlib.util.find_spec("onnx_neural_compressor") is not None:
    pytest.skip("Intel Neural Compressor is installed here; see test_inc.py", allow_module_level=True)

INC_PASSES = ("inc", "inc_dynamic", "inc_static", "inc_woq")
HINT = (
    "install it with: bitpress env create inc (an isolated environment, recommended: onnx-neural-compressor "
    '1.0 declares numpy<2) or pip install "bitpress[inc]"'
)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Registry:
    """The installed plugins, with no plugin environment (an `inc` one would run the passes)."""
    return unavailable_registry("inc", monkeypatch, tmp_path)


def test_passes_listed_unavailable_with_install_command(run_cli, registry: Registry) -> None:
    code, out, err = run_cli("passes", "list", "--json", registry=registry)
    assert code == 0, err
    rows = {r["pass"]: r for r in json.loads(out)}
    for name in INC_PASSES:
        row = rows[name]
        assert row["plugin"] == "inc" and row["available"] is False, row
        assert row["reason"].startswith("missing Python module(s) onnx_neural_compressor"), row
        assert row["reason"].endswith(HINT), row
    assert rows["inc_static"]["needs_data"] is True and rows["inc_dynamic"]["needs_data"] is False
    assert rows["inc_woq"]["precisions"] == ["int4"] and rows["inc"]["precisions"] == ["int8", "int4"]
    code, out, _ = run_cli("passes", "list", registry=registry)
    lines = [line for line in out.splitlines() if line.split(" ", 1)[0] in INC_PASSES]
    assert len(lines) == 4 and all(line.endswith(HINT) for line in lines), lines
    code, out, _ = run_cli("plugins", registry=registry)
    assert_plugin_loaded(out, "inc")


def test_olive_names_resolve_to_the_passes(registry: Registry) -> None:
    assert registry.find_pass("IncStaticQuantization").name == "inc_static"
    assert registry.find_pass("IncDynamicQuantization").name == "inc_dynamic"
    assert registry.find_pass("IncQuantization").name == "inc"


def test_passes_show_options_without_inc(run_cli, registry: Registry) -> None:
    code, out, _ = run_cli("passes", "show", "inc_static", registry=registry)
    assert code == 0
    assert "unavailable: missing Python module(s) onnx_neural_compressor" in out and HINT in out
    for option in ("approach", "quant_format", "calibrate_method", "per_channel", "activation_type", "weight_type",
                   "extra_options", "weight_only_config", "tuning", "op_types_to_exclude", "nodes_to_exclude"):
        assert option in out, option


@pytest.mark.parametrize(("algorithm", "precision"), [("inc_static", "int8"), ("inc_dynamic", None),
                                                       ("inc_woq", "int4"), ("IncQuantization", None)])
def test_quantize_fails_with_the_install_command(
    run_cli, registry: Registry, algorithm: str, precision: str | None, tiny_decoder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.onnx"
    args = ["quantize", "-m", tiny_decoder, "-o", out, "--algorithm", algorithm, "--data", "random"]
    if precision:
        args += ["--precision", precision]
    code, stdout, err = run_cli(*args, registry=registry)
    assert code == 1, (stdout, err)
    assert "(plugin inc) is unavailable: missing Python module(s) onnx_neural_compressor" in err, err
    assert err.rstrip().endswith(HINT), err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_plugin_import_does_not_import_the_toolkit() -> None:
    code = ("import sys, bitpress_inc; print(sorted(c.name for c in bitpress_inc.passes.PASSES), "
            "'onnx_neural_compressor' in sys.modules, 'transformers' in sys.modules)")
    proc = run_python(code, timeout=120)
    assert proc.stdout.split("]")[0] + "]" == str(sorted(INC_PASSES)) and proc.stdout.split()[-2:] == ["False", "False"]


def test_options_are_checked_without_inc() -> None:
    from bitpress_inc import IncPass, IncStaticPass, IncWeightOnlyPass

    with pytest.raises(OptionError, match="GPTQ is refused"):
        IncWeightOnlyPass.from_config({"weight_only_config": {"algorithm": "gptq"}}, strict=True)
    with pytest.raises(OptionError, match="Entropy is refused"):
        IncStaticPass.from_config({"calibrate_method": "Entropy"})
    with pytest.raises(OptionError, match="choose one of int4"):
        IncWeightOnlyPass.from_config({}, precision="int8")
    with pytest.raises(OptionError, match="contradicts --precision int8"):
        IncPass.from_config({"approach": "weight_only"}, precision="int8")
    p = IncStaticPass.from_config({"quant_format": "QDQ", "nodes_to_exclude": "a,b", "per_channel": "yes",
                                   "tuning": '{"max_trials": 3}'})
    assert p.options.quant_format == "QDQ" and p.options.nodes_to_exclude == ["a", "b"] and p.options.per_channel
    job = p.job()
    assert job.approach == "static" and job.tuning is not None and job.tuning.max_trials == 3
    assert job.tuning.tolerance == 0.02 and job.tuning.held_back == 0.25
    assert IncStaticPass.from_config({}, precision="int4").options.approach == "weight_only"
    assert IncPass.from_config({}).job().tuning is not None, "approach auto tunes with the defaults"
    assert IncPass.from_config({"approach": "dynamic"}).job().tuning is None
