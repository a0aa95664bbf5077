"""The Qualcomm AIMET plugin where AIMET is not installed (the host's own environment).

``make venv`` installs ``plugins/aimet`` here without its ``toolkit`` extra: its pass must be
listed as unavailable with the exact install command, and selecting it must fail (exit 1) with
the same message before any work. Its options (the techniques list among them) are checked
without AIMET. Skipped where AIMET is importable (its environment).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bitpress.errors import OptionError
from bitpress.plugins import Registry
from bitpress.testing import assert_plugin_loaded, run_python, unavailable_registry

if importlib.util.find_spec("aimet_onnx") is not None:
    pytest.skip("AIMET is installed here; see test_aimet.py", allow_module_level=True)

HINT = (
    "install it with: bitpress env create aimet (an isolated environment: aimet-onnx needs torch, and its "
    "dependency onnx2torch pulls a torchvision that breaks CPU torch, which the environment removes)"
)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Registry:
    """The installed plugins, with no plugin environment (an `aimet` one would run the pass)."""
    return unavailable_registry("aimet", monkeypatch, tmp_path)


def test_pass_listed_unavailable_with_install_command(run_cli, registry: Registry) -> None:
    code, out, err = run_cli("passes", "list", "--json", registry=registry)
    assert code == 0, err
    row = {r["pass"]: r for r in json.loads(out)}["aimet"]
    assert row["plugin"] == "aimet" and row["available"] is False, row
    assert row["reason"] == f"missing Python module(s) aimet_onnx; {HINT}", row
    assert row["needs_data"] is True and row["precisions"] == ["int4", "int8", "int16"]
    code, out, _ = run_cli("passes", "list", registry=registry)
    lines = [line for line in out.splitlines() if line.startswith("aimet ")]
    assert len(lines) == 1 and lines[0].endswith(HINT), lines
    code, out, _ = run_cli("plugins", registry=registry)
    assert_plugin_loaded(out, "aimet")


def test_pass_show_lists_olive_options(run_cli, registry: Registry) -> None:
    code, out, _ = run_cli("passes", "show", "aimet", registry=registry)
    assert code == 0
    assert "unavailable: missing Python module(s) aimet_onnx" in out and HINT in out
    for option in ("precision", "activation_type", "quant_scheme", "config_file", "op_types_to_exclude",
                   "nodes_to_exclude", "techniques", "export_encodings"):
        assert option in out


@pytest.mark.parametrize("name", ["aimet", "AimetQuantization"])
def test_quantize_fails_with_the_install_command(run_cli, registry: Registry, name: str, tiny_encoder: Path,
                                                 tmp_path: Path) -> None:
    out = tmp_path / "out.onnx"
    if name == "aimet":
        code, stdout, err = run_cli("quantize", "-m", tiny_encoder, "-o", out, "--algorithm", name, "--data",
                                    "random", registry=registry)
    else:  # Olive's pass name, in a workflow config
        config = tmp_path / "olive.json"
        config.write_text(json.dumps({"input": str(tiny_encoder), "output": str(out), "data": "random",
                                      "passes": [{"type": name, "precision": "int4"}]}))
        code, stdout, err = run_cli("run", config, registry=registry)
    assert code == 1, (stdout, err)
    assert "pass 'aimet' (plugin aimet) is unavailable: missing Python module(s) aimet_onnx" in err, err
    assert err.rstrip().endswith(HINT), err
    assert not out.exists()


def test_plugin_import_does_not_import_the_toolkit() -> None:
    # a fresh process: other tests of the session may have imported torch
    code = ("import sys, bitpress_aimet, bitpress_aimet.options; "
            "print([c.name for c in bitpress_aimet.passes.PASSES], 'torch' in sys.modules, "
            "'aimet_onnx' in sys.modules)")
    proc = run_python(code, timeout=120)
    assert proc.stdout.split() == ["['aimet']", "False", "False"], proc.stdout


def test_options_are_checked_without_aimet() -> None:
    from bitpress_aimet import AimetPass

    p = AimetPass.from_config({"techniques": [{"name": "LPBQ", "block_size": 32}, {"name": "seqmse"},
                                              {"name": "adaround", "num_iterations": 100}]}, precision="int4")
    assert p.options.precision == "int4"
    names = [(t.name, t.options) for t in p.options.checked_techniques()]
    assert [n for n, _ in names] == ["lpbq", "seqmse", "adaround"]
    lpbq, seqmse, adaround = (o for _, o in names)
    assert (lpbq.block_size, lpbq.bitwidth, lpbq.decompressed_bw) == (32, 4, 8)
    assert lpbq.op_types == ["Gemm", "MatMul", "Conv"]
    assert seqmse.num_candidates == 20 and adaround.num_iterations == 100 and adaround.nodes_to_exclude == []
    defaults = AimetPass.from_config({}).options
    assert (defaults.precision, defaults.activation_type, defaults.quant_scheme, defaults.config_file,
            defaults.techniques, defaults.export_encodings) == ("int8", "uint8", "min_max", None, [], False)
    with pytest.raises(OptionError, match=r"techniques\[1\]: unknown technique 'awq'; valid names: lpbq, seqmse"):
        AimetPass.from_config({"techniques": [{"name": "lpbq"}, {"name": "awq"}]})
    with pytest.raises(OptionError, match="valid options for adaround: nodes_to_exclude, num_iterations"):
        AimetPass.from_config({"techniques": [{"name": "adaround", "iterations": 5}]})
    with pytest.raises(OptionError, match="choose one of int4, int8, int16"):
        AimetPass.from_config({}, precision="nf4")
    # --option on the command line: the techniques list as JSON
    p = AimetPass.from_config({"techniques": '[{"name": "seqmse", "num_candidates": 5}]', "export_encodings": "true"})
    assert p.options.checked_techniques()[0].options.num_candidates == 5 and p.options.export_encodings is True
