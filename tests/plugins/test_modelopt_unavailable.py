"""The NVIDIA ModelOpt plugin where ModelOpt is not installed (the host's own environment).

``make venv`` installs ``plugins/modelopt`` here without its ``toolkit`` extra: its passes must be
listed as unavailable with the exact install commands, and selecting one must fail (exit 1)
with the same message before any work. Skipped where ModelOpt is importable (its environment).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bitpress.errors import OptionError
from bitpress.plugins import Registry
from bitpress.testing import assert_plugin_loaded, run_python, unavailable_registry

if importlib.util.find_spec("modelopt") is not None:
    pytest.skip("NVIDIA ModelOpt is installed here; see test_modelopt.py", allow_module_level=True)

PASSES = ("modelopt_int4", "modelopt_int8")
HINT = (
    "install it with: bitpress env create modelopt (an isolated environment, recommended: nvidia-modelopt[onnx] "
    'would replace onnxruntime with onnxruntime-gpu) or pip install "bitpress[modelopt]"'
)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Registry:
    """The installed plugins, with no plugin environment (a `modelopt` one would run the passes)."""
    return unavailable_registry("modelopt", monkeypatch, tmp_path)


def test_passes_listed_unavailable_with_install_commands(run_cli, registry: Registry) -> None:
    code, out, err = run_cli("passes", "list", "--json", registry=registry)
    assert code == 0, err
    rows = {r["pass"]: r for r in json.loads(out)}
    for name in PASSES:
        row = rows[name]
        assert row["plugin"] == "modelopt" and row["available"] is False, row
        assert row["reason"].startswith("missing Python module(s) modelopt") and row["reason"].endswith(HINT), row
        assert row["needs_data"] is True
    assert rows["modelopt_int4"]["precisions"] == ["int4"] and rows["modelopt_int8"]["precisions"] == ["int8"]
    code, out, _ = run_cli("passes", "list", registry=registry)
    lines = [line for line in out.splitlines() if line.startswith("modelopt_")]
    assert len(lines) == 2 and all(line.endswith(HINT) for line in lines), lines
    code, out, _ = run_cli("plugins", registry=registry)
    assert_plugin_loaded(out, "modelopt")


def test_passes_show_options_and_alias_without_modelopt(run_cli, registry: Registry) -> None:
    code, out, _ = run_cli("passes", "show", "modelopt_int4", registry=registry)
    assert code == 0
    assert "unavailable: missing Python module(s) modelopt" in out and HINT in out
    assert "NVModelOptQuantization" in out
    for option in ("algorithm", "calibration_method", "block_size", "nodes_to_exclude", "enable_mixed_quant",
                   "layers_8bit", "output_format", "accuracy_level"):
        assert option in out
    code, out, _ = run_cli("passes", "show", "modelopt_int8", registry=registry)
    assert code == 0 and "calibration_method" in out and "'entropy' | 'max'" in out


@pytest.mark.parametrize(("algorithm", "precision"), [("modelopt_int4", "int4"), ("modelopt_int8", "int8")])
def test_quantize_fails_with_the_install_command(
    run_cli, registry: Registry, algorithm: str, precision: str, tiny_decoder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.onnx"
    code, stdout, err = run_cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", algorithm,
                                "--precision", precision, "--data", "random", registry=registry)
    assert code == 1, (stdout, err)
    assert err.startswith(f"bitpress: error: pass '{algorithm}' (plugin modelopt) is unavailable: "
                          "missing Python module(s) modelopt"), err
    assert err.rstrip().endswith(HINT), err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_plugin_import_does_not_import_the_toolkit() -> None:
    # a fresh process: other tests of the session may have imported torch
    code = ("import sys, bitpress_modelopt; print(sorted(c.name for c in bitpress_modelopt.passes.PASSES), "
            "'modelopt' in sys.modules, 'torch' in sys.modules)")
    proc = run_python(code, timeout=120)
    assert proc.stdout.split("]")[0] + "]" == str(sorted(PASSES)), proc.stdout
    assert proc.stdout.split()[-2:] == ["False", "False"], proc.stdout


def test_options_are_checked_without_modelopt() -> None:
    from bitpress_modelopt import ModelOptInt4Pass, ModelOptInt8Pass

    with pytest.raises(OptionError, match="not an rtn method"):
        ModelOptInt4Pass.from_config({"algorithm": "rtn", "calibration_method": "awq_clip"})
    with pytest.raises(OptionError, match="power of two"):
        ModelOptInt4Pass.from_config({"block_size": 48})
    with pytest.raises(OptionError, match="symmetric only"):
        ModelOptInt4Pass.from_config({"calibration_method": "awq_clip", "use_zero_point": True})
    with pytest.raises(OptionError, match="needs output_format matmulnbits"):
        ModelOptInt4Pass.from_config({"output_format": "qdq", "accuracy_level": 4})
    with pytest.raises(OptionError, match="layers_8bit"):
        ModelOptInt4Pass.from_config({"layers_8bit": "model.layers.(0|1)"})
    with pytest.raises(OptionError, match="calibration_method"):
        ModelOptInt8Pass.from_config({"calibration_method": "percentile"})
    with pytest.raises(OptionError, match="choose one of int4"):
        ModelOptInt4Pass.from_config({}, precision="int8")
    with pytest.raises(OptionError, match="lookahead"):
        ModelOptInt8Pass.from_config({"nodes_to_exclude": "re:(?=a)b"})
    # algorithm and calibration method follow each other; only AWQ asks for data
    awq = ModelOptInt4Pass.from_config({})
    assert awq.options.method() == "awq_lite" and awq.needs_data is True
    rtn = ModelOptInt4Pass.from_config({"algorithm": "rtn"})
    assert rtn.options.method() == "rtn_dq" and rtn.needs_data is False
    clip = ModelOptInt4Pass.from_config({"calibration_method": "awq_clip", "layers_8bit": "model.layers.0, lm_head"})
    assert clip.options.method() == "awq_clip" and clip.needs_data is True
