"""The host's option checks cannot be bypassed by a plugin's ``validate()``.

``bitpress.options.parse_options`` runs the ``validate()`` of every class in an options class's
MRO, base classes first, so a plugin that extends ``WeightOnlyOptions`` and overrides
``validate()`` without ``super().validate()`` still gets the host's checks; a plugin's own
``ValueError`` / ``TypeError`` is a usage error (``OptionError``, exit 2, one line naming the
pass). Checked through the API, the CLI, a workflow config and the worker of a plugin
environment (a hand-made one whose Python is this interpreter with the plugin on its path).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

import bitpress
import bitpress.plugins
from bitpress import api
from bitpress.envs.protocol import PROTOCOL
from bitpress.errors import OptionError
from bitpress.onnx.kernels import TargetOptions
from bitpress.onnx.weightonly import WeightOnlyOptions
from bitpress.options import parse_options, validators
from bitpress.plugins import Registry

# A plugin as its author might write it: validate() overrides the host's and forgets super().
PLUGIN_SOURCE = textwrap.dedent('''
    from __future__ import annotations

    from dataclasses import dataclass
    from typing import ClassVar

    from bitpress import hookimpl
    from bitpress.onnx.weightonly import WeightOnlyOptions, WeightOnlyPass
    from bitpress.options import option
    from bitpress.quant.solver import QuantizedBlocks


    def solver(w, spec, importance=None):
        raise AssertionError("the solver must never run with options the host refuses")


    @dataclass
    class NoSuperOptions(WeightOnlyOptions):
        search: int = option(3, "a plugin option")
        mode: str = option("a", "a or b")

        def validate(self) -> None:  # no super().validate(): the host's checks must run anyway
            if self.search < 0:
                raise ValueError(f"search must be >= 0, got {self.search}")
            if self.mode not in ("a", "b"):
                raise TypeError(f"mode must be a or b,\\n got {self.mode!r}")


    class NoSuperPass(WeightOnlyPass):
        name = "nosuper"
        algorithms = ("nosuper",)
        precisions = ("int4", "int8")
        summary = "a plugin whose validate() skips super()"
        Options: ClassVar[type] = NoSuperOptions

        def solver(self):
            return solver


    @hookimpl
    def bitpress_register_passes(register):
        register(NoSuperPass)
''')

EXPECTED = {
    "48": "nosuper: block_size must be a power of two from 16 to 256, got 48",
    "7": "nosuper: block_size must be a power of two from 16 to 256, got 7",
}


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder to put on sys.path holding the plugin module and a dist-info with its entry point."""
    site = tmp_path_factory.mktemp("nosuper-site")
    (site / "bitpress_nosuper.py").write_text(PLUGIN_SOURCE)
    info = site / "bitpress_nosuper-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bitpress-nosuper\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[bitpress]\nnosuper = bitpress_nosuper\n")
    return site


@pytest.fixture
def plugin(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(plugin_site))
    import bitpress_nosuper

    return bitpress_nosuper


@pytest.fixture
def registry(plugin: ModuleType) -> Registry:
    reg = Registry(entry_points=False)
    reg.register(plugin, name="nosuper")
    assert reg.plugins["nosuper"].ok, reg.plugins["nosuper"].error
    return reg


def test_host_checks_run_without_super(plugin: ModuleType) -> None:
    cls = plugin.NoSuperOptions
    assert validators(cls) == [TargetOptions.__dict__["validate"], WeightOnlyOptions.__dict__["validate"],
                               cls.__dict__["validate"]]
    for value, message in EXPECTED.items():
        with pytest.raises(OptionError) as exc:
            parse_options(cls, {"block_size": value}, owner="nosuper")
        assert str(exc.value) == message
    # base first: the host's check speaks before the plugin's own
    with pytest.raises(OptionError, match="block_size must be"):
        parse_options(cls, {"block_size": 48, "search": -1}, owner="nosuper")
    with pytest.raises(OptionError, match=r"^nosuper: search must be >= 0, got -1$"):
        parse_options(cls, {"search": -1}, owner="nosuper")
    # a TypeError from a plugin's check is a usage error too, on one line
    with pytest.raises(OptionError, match=r"^nosuper: mode must be a or b, got 'c'$"):
        parse_options(cls, {"mode": "c"}, owner="nosuper")
    assert parse_options(cls, {"block_size": "64", "search": "0"}, owner="nosuper").block_size == 64


def test_each_validate_runs_once_base_first() -> None:
    calls: list[str] = []

    @dataclasses.dataclass
    class Base:
        x: int = 1

        def validate(self) -> None:
            calls.append("base")

    @dataclasses.dataclass
    class Middle(Base):  # defines no validate of its own
        y: int = 2

    @dataclasses.dataclass
    class Leaf(Middle):
        def validate(self) -> None:
            calls.append("leaf")

    parse_options(Leaf, {}, owner="t")
    assert calls == ["base", "leaf"]


@pytest.mark.parametrize("block_size", sorted(EXPECTED))
def test_api_refuses_before_any_work(registry: Registry, tiny_decoder: Path, tmp_path: Path, block_size: str) -> None:
    out = tmp_path / "q.onnx"
    with pytest.raises(OptionError) as exc:
        api.quantize(tiny_decoder, out, algorithm="nosuper", precision="int4",
                     options={"block_size": int(block_size)}, registry=registry)
    assert str(exc.value) == EXPECTED[block_size] and exc.value.exit_code == 2
    config = {"input": str(tiny_decoder), "output": str(out),
              "passes": [{"type": "nosuper", "precision": "int4", "block_size": int(block_size)}]}
    with pytest.raises(OptionError, match=EXPECTED[block_size]):
        api.run(config, registry=registry)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("block_size", sorted(EXPECTED))
def test_cli_is_a_usage_error(run_cli, registry: Registry, tiny_decoder: Path, tmp_path: Path,
                              block_size: str) -> None:
    out = tmp_path / "q.onnx"
    code, _, stderr = run_cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "nosuper",
                              "--precision", "int4", "--option", f"block_size={block_size}", registry=registry)
    assert code == 2, stderr
    assert stderr == f"bitpress: error: {EXPECTED[block_size]}\n"
    assert not out.exists()
    code, _, stderr = run_cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "nosuper",
                              "--option", "mode=c", registry=registry)
    assert code == 2 and stderr == "bitpress: error: nosuper: mode must be a or b, got 'c'\n"


def test_environment_worker_checks_the_same(run_cli, plugin_site: Path, monkeypatch: pytest.MonkeyPatch,
                                            tiny_decoder: Path, tmp_path: Path) -> None:
    """A pass run in a plugin environment: the worker runs the same checks; the host exits 2."""
    envs = tmp_path / "envs"
    env = envs / "nosuper"
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    # this interpreter, with the plugin on its path (the host strips PYTHONPATH from the worker's environment)
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{plugin_site}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (env / "pyvenv.cfg").write_text("home = /nowhere\n")
    (env / "env.json").write_text(json.dumps({
        "plugin": "nosuper", "protocol": PROTOCOL, "host_version": bitpress.__version__,
        "python": {"version": "3.11.0"}, "created": "2026-01-01T00:00:00+00:00", "specs": [], "freeze": [],
    }))
    options = [{"name": f.name, "type": "?", "default": None, "help": ""}
               for f in dataclasses.fields(WeightOnlyOptions)] + [{"name": "search", "type": "int", "default": 3}]
    entry = {"pass": "nosuper", "plugin": "nosuper", "summary": "", "algorithms": ["nosuper"],
             "precisions": ["int4", "int8"], "model_kinds": ["onnx"], "needs_data": False, "available": True,
             "reason": None, "options": options}
    (env / "manifest.json").write_text(json.dumps({"protocol": PROTOCOL, "env": "nosuper", "passes": [entry]}))
    monkeypatch.setenv("BITPRESS_ENVS", str(envs))
    monkeypatch.delenv("BITPRESS_NO_ENVS", raising=False)
    monkeypatch.setattr(bitpress.plugins, "_default", None)
    reg = Registry(entry_points=False)
    from bitpress.envs import add_env_passes, where

    add_env_passes(reg)
    assert where(reg.passes["nosuper"]) == "env:nosuper"

    out = tmp_path / "q.onnx"
    for block_size in sorted(EXPECTED):
        code, _, stderr = run_cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "nosuper",
                                  "--precision", "int4", "--option", f"block_size={block_size}", registry=reg)
        assert code == 2, stderr
        assert stderr == f"bitpress: error: {EXPECTED[block_size]} (in environment 'nosuper')\n"
    code, _, stderr = run_cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "nosuper",
                              "--option", "search=-1", registry=reg)
    assert code == 2 and "nosuper: search must be >= 0, got -1 (in environment 'nosuper')" in stderr
    assert not out.exists()
