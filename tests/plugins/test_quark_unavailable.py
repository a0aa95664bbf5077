"""The AMD Quark plugin where Quark is not installed (the host's own environment).

``make venv`` installs ``plugins/quark`` here without its ``toolkit`` extra: its passes must be
listed as unavailable with the exact install commands, and selecting one must fail (exit 1)
with the same message before any work. Skipped where Quark is importable (its environment).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bitpress.errors import OptionError
from bitpress.plugins import Registry
from bitpress.testing import assert_plugin_loaded, run_python, unavailable_registry

if importlib.util.find_spec("quark") is not None:
    pytest.skip("AMD Quark is installed here; see test_quark.py", allow_module_level=True)

QUARK_PASSES = ("quark", "quark_dynamic", "quark_hf", "quark_int4", "quark_static")
HINT = (
    'install it with: bitpress env create quark (an isolated environment, recommended: Quark pins '
    'onnx<=1.22.0) or pip install "bitpress[quark]"'
)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Registry:
    """The installed plugins, with no plugin environment (a `quark` one would run the passes)."""
    return unavailable_registry("quark", monkeypatch, tmp_path)


def test_passes_listed_unavailable_with_install_commands(run_cli, registry: Registry) -> None:
    code, out, err = run_cli("passes", "list", "--json", registry=registry)
    assert code == 0, err
    rows = {r["pass"]: r for r in json.loads(out)}
    for name in QUARK_PASSES:
        row = rows[name]
        assert row["plugin"] == "quark" and row["available"] is False, row
        assert row["reason"].startswith("missing Python module(s) quark") and row["reason"].endswith(HINT), row
    assert rows["quark_static"]["needs_data"] is True and rows["quark_int4"]["precisions"] == ["int4"]
    assert rows["quark_static"]["algorithms"] == ["quark_static", "quark_int8"]
    code, out, _ = run_cli("passes", "list", registry=registry)
    lines = [line for line in out.splitlines() if line.startswith("quark_")]
    assert len(lines) == 4 and all(line.endswith(HINT) for line in lines), lines
    # the plugin is listed, loaded (not broken) although its toolkit is missing
    code, out, _ = run_cli("plugins", registry=registry)
    assert_plugin_loaded(out, "quark")


def test_passes_show_options_without_quark(run_cli, registry: Registry) -> None:
    code, out, _ = run_cli("passes", "show", "quark_static", registry=registry)
    assert code == 0
    assert "unavailable: missing Python module(s) quark" in out and HINT in out
    for option in ("quant_format", "calibration_method", "per_channel", "activation_type", "weight_type",
                   "op_types_to_exclude", "nodes_to_exclude"):
        assert option in out


@pytest.mark.parametrize(("algorithm", "precision"), [("quark_static", "int8"), ("quark_dynamic", None),
                                                       ("quark_int4", "int4")])
def test_quantize_fails_with_the_install_command(
    run_cli, registry: Registry, algorithm: str, precision: str | None, tiny_decoder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.onnx"
    args = ["quantize", "-m", tiny_decoder, "-o", out, "--algorithm", algorithm, "--data", "random"]
    if precision:
        args += ["--precision", precision]
    code, stdout, err = run_cli(*args, registry=registry)
    assert code == 1, (stdout, err)
    assert err.startswith(f"bitpress: error: pass '{algorithm}' (plugin quark) is unavailable: "
                          "missing Python module(s) quark"), err
    assert err.rstrip().endswith(HINT), err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_plugin_import_does_not_import_the_toolkit() -> None:
    # a fresh process: other tests of the session may have imported torch
    code = ("import sys, bitpress_quark; print(sorted(c.name for c in (*bitpress_quark.passes.PASSES, "
            "bitpress_quark.QuarkQuantizationPass, bitpress_quark.QuarkHfPass)), 'torch' in sys.modules)")
    proc = run_python(code, timeout=120)
    assert proc.stdout.split("]")[0] + "]" == str(sorted(QUARK_PASSES)) and proc.stdout.split()[-1] == "False"


def test_options_are_checked_without_quark() -> None:
    from bitpress_quark import QuarkInt4Pass, QuarkStaticPass

    with pytest.raises(OptionError, match="always asymmetric"):
        QuarkInt4Pass.from_config({"algorithm": "hqq", "symmetric": "true"})
    with pytest.raises(OptionError, match="power of two"):
        QuarkInt4Pass.from_config({"block_size": 48})
    with pytest.raises(OptionError, match="calibration_method"):
        QuarkStaticPass.from_config({"calibration_method": "gptq"})
    with pytest.raises(OptionError, match="choose one of int8"):
        QuarkStaticPass.from_config({}, precision="int4")
    p = QuarkStaticPass.from_config({"quant_format": "qoperator", "nodes_to_exclude": "a,b", "per_channel": "yes"})
    assert p.options.quant_format == "qoperator" and p.options.nodes_to_exclude == ["a", "b"]
    assert p.options.per_channel is True


def test_olive_quark_quantization_configs_are_checked_without_quark() -> None:
    """Olive's QuarkQuantization shapes: read as Olive writes them (``MinMax`` or ``CalibMethod.MinMax``,
    ``activation`` for Quark's ``input_tensors``), and what cannot run in plain ONNX Runtime, or is not run, refused
    in one line before any work."""
    from bitpress_quark import QuarkQuantizationPass

    seed = {"activation": {"data_type": "UInt8", "calibration_method": "Percentile"},
            "weight": {"data_type": "Int8", "calibration_method": "CalibMethod.MinMax"}}
    parsed = QuarkQuantizationPass.from_config({"global_config": seed}).options.parsed()
    assert parsed["global"] == {"input_tensors": {"data_type": "UInt8", "calibration_method": "Percentile"},
                                "weight": {"data_type": "Int8", "calibration_method": "MinMax"}}
    assert QuarkQuantizationPass.from_config({"quant_mode": "dynamic"}).needs_data is False
    refused = {
        "BFP16: Quark writes it as its own custom operators": {"global_config": {
            "activation": {"data_type": "BFP16"}, "weight": {"data_type": "BFP16"}}},
        "give both activation and weight": {"global_config": {"weight": {"data_type": "Int8"}}},
        "data_type is required": {"global_config": {"activation": {"symmetric": True},
                                                    "weight": {"data_type": "Int8"}}},
        "calibration_method Best: choose one of MinMax": {"global_config": {
            "activation": {"data_type": "Int8", "calibration_method": "Best"}, "weight": {"data_type": "Int8"}}},
        "give activation .Olive's name. or input_tensors": {"global_config": {
            "activation": {"data_type": "Int8"}, "input_tensors": {"data_type": "Int8"},
            "weight": {"data_type": "Int8"}}},
        "gptq: Quark's ONNX GPTQ solves int4": {"algo_config": [{"name": "gptq"}]},
        "smooth_quant has no option.s. beta": {"algo_config": [{"name": "smooth_quant", "beta": 1}]},
        "TensorsRangeFile not passed to Quark": {"extra_options": {"TensorsRangeFile": "/etc/x"}},
        "a null config .left in float. belongs in exclude": {"specific_layer_config": [[None, ["a"]]]},
        "quant_mode dynamic: ONNX Runtime quantizes activations to UInt8": {"quant_mode": "dynamic", "global_config": {
            "activation": {"data_type": "Int8"}, "weight": {"data_type": "Int8"}}},
        "quant_format QOperator: per-layer configs need QDQ": {"quant_format": "QOperator", "specific_layer_config": [
            [{"activation": {"data_type": "Int16"}, "weight": {"data_type": "Int8"}}, ["n"]]]},
    }
    for message, options in refused.items():
        with pytest.raises(OptionError, match=message):
            QuarkQuantizationPass.from_config(options)


def test_quark_hf_options_are_checked_without_quark() -> None:
    """quark_hf: Olive's scheme names read, and each scheme / algorithm / export it does not run refused in one
    line saying why, before any work."""
    from bitpress_quark import QuarkHfPass

    p = QuarkHfPass.from_config({"quant_scheme": "w_uint4_per_group_asym", "quant_algo": "awq"})
    assert p.options.scheme() == "uint4_wo_128" and p.needs_data
    assert not QuarkHfPass.from_config({"quant_algo": None}).needs_data
    assert not QuarkHfPass.from_config({"quant_algo": "rotation"}).needs_data
    refused = {
        "quant_scheme int8 is W8A8": {"quant_scheme": "int8"},
        "quant_scheme mxfp4: ONNX Runtime has no CPU kernel": {"quant_scheme": "mxfp4"},
        "uint4_wo_per_channel has one scale per row": {"quant_scheme": "uint4_wo_per_channel"},
        "quant_algo smoothquant moves activation outliers": {"quant_algo": "smoothquant"},
        "quant_algo 'best': choose from awq": {"quant_algo": "best"},
        "model_export onnx: Quark's ONNX export of per-group int4 fails": {"model_export": ["onnx"]},
        "quant_config .Quark's JSON algorithm config. is not read": {"quant_config": {"algo": 1}},
    }
    for message, options in refused.items():
        with pytest.raises(OptionError, match=message):
            QuarkHfPass.from_config(options)
