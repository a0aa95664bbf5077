"""The plugin registry: discovery, broken and unavailable plugins, pass metadata, options, selection, hooks."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, Literal, Optional

import numpy as np
import onnx
import pytest

import bitpress.plugins
from bitpress import api, hookimpl
from bitpress.errors import OptionError, PassNotFoundError, PassUnavailableError
from bitpress.models.base import ModelHandle
from bitpress.options import NoOptions, describe, option, parse_options
from bitpress.passes import Pass, PassContext
from bitpress.plugins import Registry
from bitpress.workflow.config import build_workflow


def _plugin(*classes: type[Pass], **hooks: Any) -> SimpleNamespace:
    """A plugin object registering ``classes`` (plus any other hook implementations)."""

    @hookimpl
    def bitpress_register_passes(register):
        for cls in classes:
            register(cls)

    return SimpleNamespace(bitpress_register_passes=bitpress_register_passes, **hooks)


def _pass(name: str, algorithms: tuple[str, ...] = (), precisions: tuple[str, ...] = ("int4",), **attrs: Any):
    """A do-nothing pass class with the given metadata."""

    def run(self: Pass, model: Any, context: PassContext) -> Any:
        return model

    body = {"name": name, "algorithms": algorithms or (name,), "precisions": precisions, "run": run, **attrs}
    return type(f"Pass_{name.replace('-', '_')}", (Pass,), body)


# -- entry points: a real distribution on sys.path --------------------------------------------------------------
def _fake_distribution(site: Path, dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str]):
    """A minimal installed distribution (dist-info with METADATA and entry_points.txt) on ``site``."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[bitpress]\n{lines}\n")
    for module, source in modules.items():
        (site / f"{module}.py").write_text(source)


BROKEN_AT_IMPORT = {
    "raises": ("raise RuntimeError('needs a GPU driver')\n", "RuntimeError: needs a GPU driver"),
    "missing-dep": ("import no_such_dependency_xyz\n", "No module named 'no_such_dependency_xyz'"),
    "syntax": ("def broken(:\n", "SyntaxError"),
    "exits": ("import sys\nsys.exit('plugin gave up')\n", "SystemExit: plugin gave up"),
}


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    # the CLI builds its registry on first use: make it rebuild with our distributions
    monkeypatch.setattr(bitpress.plugins, "_default", None)
    return site


@pytest.mark.parametrize("how", list(BROKEN_AT_IMPORT))
def test_plugin_broken_at_import_is_listed_not_fatal(
    how: str, site: Path, run_cli, tiny_decoder: Path, tmp_path: Path,
) -> None:
    source, reason = BROKEN_AT_IMPORT[how]
    _fake_distribution(site, "bitpress-boom", "1.2.3", {"boom": "boom_plugin"}, {"boom_plugin": source})

    code, out, err = run_cli("plugins", "--json")
    assert code == 0, err
    rows = {r["plugin"]: r for r in json.loads(out)}
    assert rows["boom"]["ok"] is False
    assert rows["boom"]["distribution"] == "bitpress-boom" and rows["boom"]["version"] == "1.2.3"
    assert reason in rows["boom"]["error"]
    assert rows["rtn"]["ok"] is True, "one broken plugin must not affect the others"
    assert "boom" in err and "broken" in err  # logged once as a warning

    code, out, _ = run_cli("plugins")
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("boom"))
    assert "bitpress-boom" in line and "1.2.3" in line and "broken:" in line and reason in line

    code, out, _ = run_cli("passes", "list")
    assert code == 0
    assert any(x.startswith("rtn ") and x.rstrip().endswith("yes") for x in out.splitlines())
    line = next(x for x in out.splitlines() if " boom " in x)
    assert "no: plugin failed to load" in line and reason in line

    # the host still quantizes with the healthy plugins
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm", "rtn",
                           "--precision", "int4")
    assert code == 0, err
    # and the broken plugin's own algorithm is unavailable (exit code 1, not a usage error), saying why
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "b.onnx", "--algorithm", "boom")
    assert code == 1
    assert "algorithm 'boom' is unavailable: plugin boom (bitpress-boom 1.2.3) failed to load" in err
    # an unknown algorithm mentions the broken plugin as a likely cause
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "b.onnx", "--algorithm", "bom")
    assert code == 2
    assert "plugin boom failed to load" in err


def test_verbose_shows_why_a_plugin_is_broken(site: Path, run_cli) -> None:
    _fake_distribution(site, "bitpress-boom", "1.2.3", {"boom": "boom_plugin"},
                       {"boom_plugin": "def helper():\n    raise RuntimeError('deep inside')\nhelper()\n"})
    code, _, err = run_cli("plugins")
    assert code == 0 and "Traceback" not in err
    bitpress.plugins._default = None  # rebuild: the registry is loaded once per process
    code, _, err = run_cli("--verbose", "plugins")
    assert code == 0
    assert "Traceback (most recent call last)" in err and "boom_plugin.py" in err and "in helper" in err


def test_duplicate_plugin_names(site: Path) -> None:
    plugin = "from bitpress import hookimpl\n"
    _fake_distribution(site, "first-dist", "1.0", {"same": "same_a"}, {"same_a": plugin})
    _fake_distribution(site, "second-dist", "2.0", {"same": "same_b"}, {"same_b": plugin})
    reg = Registry()
    same = {k: v for k, v in reg.plugins.items() if v.name == "same"}
    assert len(same) == 2
    ok = [p for p in same.values() if p.ok]
    broken = [p for p in same.values() if not p.ok]
    assert len(ok) == 1 and len(broken) == 1
    assert "duplicate plugin name 'same'" in broken[0].error
    assert ok[0].distribution in broken[0].error


# -- registration errors ----------------------------------------------------------------------------------------
class NoDefaults:
    pass


@dataclass
class NeedsValue:
    level: int  # no default: the pass could not be built without options


def _raising_hook():
    @hookimpl
    def bitpress_register_passes(register):
        register(_pass("good-before-error"))
        raise ValueError("registration went wrong")

    return SimpleNamespace(bitpress_register_passes=bitpress_register_passes)


@pytest.mark.parametrize(
    ("plugin", "reason"),
    [
        (lambda: _raising_hook(), "ValueError: registration went wrong"),
        (lambda: _plugin(_pass("ok-one"), NoDefaults), "is not a bitpress.passes.Pass subclass"),
        (lambda: _plugin(_pass("Bad Name")), "must be a lowercase identifier"),
        (lambda: _plugin(_pass("listy", algorithms=["a"])), "algorithms must be a tuple of strings"),
        (lambda: _plugin(_pass("needs", Options=NeedsValue)), "needs defaults for every field"),
        (lambda: _plugin(_pass("twice", algorithms=("a",)), _pass("twice", algorithms=("b",))),
         "pass name 'twice' registered twice"),
    ],
)
def test_bad_registration_marks_plugin_broken(plugin, reason: str) -> None:
    reg = Registry(entry_points=False)
    reg.register(plugin(), name="bad")
    info = reg.plugins["bad"]
    assert not info.ok
    assert reason in info.error
    assert info.passes == [] and reg.passes == {}, "a broken plugin registers nothing, not half"
    # the host and later plugins keep working
    reg.register(_plugin(_pass("fine")), name="fine")
    assert reg.plugins["fine"].ok and list(reg.passes) == ["fine"]


def test_duplicate_pass_names_across_plugins() -> None:
    first, second = _pass("dup", algorithms=("x",)), _pass("dup", algorithms=("y",))
    reg = Registry(entry_points=False)
    reg.register(_plugin(first), name="first")
    reg.register(_plugin(second, _pass("other")), name="second")
    assert reg.passes == {"dup": first}
    assert first.plugin == "first"
    assert "pass name 'dup' already registered by plugin 'first'" in reg.plugins["second"].error
    assert reg.get_pass("dup") is first
    # the same class registered again (e.g. re-exported by two entry points) is not a conflict
    reg.register(_plugin(first), name="again")
    assert reg.plugins["again"].ok


def test_pass_aliases(run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """Aliases (the peer tool's pass names): found in any case, by --algorithm too; collisions refused."""
    static = _pass("toy_static", algorithms=("toy_int8",), aliases=("OnnxStaticQuantization",))
    reg = Registry(entry_points=False)
    reg.register(_plugin(static, _pass("toy_other")), name="toy")
    assert reg.find_pass("OnnxStaticQuantization") is static and reg.get_pass("onnxstaticquantization") is static
    assert reg.select("OnnxStaticQuantization", None, "onnx") is static
    with pytest.raises(PassNotFoundError, match="did you mean 'OnnxStaticQuantization'"):
        reg.pass_named("OnnxStaticQuantizaton")
    # an alias equal to another pass's name or alias, or badly formed, breaks the plugin that brings it
    reg.register(_plugin(_pass("clash", aliases=("toy_other",))), name="clash")
    assert "alias 'toy_other' of pass 'clash' is already pass 'toy_other'" in reg.plugins["clash"].error
    reg.register(_plugin(_pass("clash2", aliases=("OnnxStaticQuantization",))), name="clash2")
    assert "already an alias of pass 'toy_static'" in reg.plugins["clash2"].error
    reg.register(_plugin(_pass("badalias", aliases=("Onnx Static",))), name="bad")
    assert "aliases must be a tuple of identifiers" in reg.plugins["bad"].error
    assert set(reg.passes) == {"toy_static", "toy_other"} and set(reg.aliases) == {"OnnxStaticQuantization"}
    # passes list / show name them
    monkeypatch.setattr("bitpress.cli.passes.registry", lambda: reg)
    code, out, _ = run_cli("passes", "show", "OnnxStaticQuantization")
    assert code == 0 and out.startswith("toy_static (plugin toy)") and "also called: OnnxStaticQuantization" in out
    code, out, _ = run_cli("passes", "list", "--json")
    rows = {r["pass"]: r for r in json.loads(out)}
    assert rows["toy_static"]["aliases"] == ["OnnxStaticQuantization"] and rows["toy_other"]["aliases"] == []


# -- availability -------------------------------------------------------------------------------------------------
GpuPass = _pass(
    "gpuquant", algorithms=("gpuq",), requires=("no_such_module_xyz", "numpy"),
    install_hint='pip install "bitpress-gpuquant[cuda]"',
)


def test_unavailable_pass_is_listed_with_hint(run_cli, make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    reg = make_registry(("gpu", _plugin(GpuPass)))
    hint = 'missing Python module(s) no_such_module_xyz; install it with: pip install "bitpress-gpuquant[cuda]"'
    assert GpuPass.unavailable_reason() == hint

    code, out, _ = run_cli("passes", "list", "--json", registry=reg)
    rows = {r["pass"]: r for r in json.loads(out)}
    assert code == 0
    assert rows["gpuquant"]["available"] is False and rows["gpuquant"]["reason"] == hint
    assert rows["rtn"]["available"] is True and rows["rtn"]["reason"] is None

    code, out, _ = run_cli("passes", "list", registry=reg)
    assert f"no: {hint}" in next(x for x in out.splitlines() if x.startswith("gpuquant"))
    code, out, _ = run_cli("passes", "show", "gpuquant", registry=reg)
    assert f"unavailable: {hint}" in out

    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm", "gpuq",
                           "--precision", "int4", registry=reg)
    assert code == 1
    assert err.strip() == f"bitpress: error: pass 'gpuquant' (plugin gpu) is unavailable: {hint}"
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    with pytest.raises(PassUnavailableError, match="no_such_module_xyz"):
        reg.get_pass("gpuquant")


def test_requirements_are_checked_without_importing(site: Path) -> None:
    (site / "heavy_side_effect_mod.py").write_text("raise RuntimeError('imported!')\n")
    cls = _pass("heavy", requires=("heavy_side_effect_mod",))
    assert cls.unavailable_reason() is None
    assert "heavy_side_effect_mod" not in sys.modules
    dotted = _pass("dotted", requires=("no_such_pkg_xyz.sub",))
    assert "no_such_pkg_xyz.sub" in dotted.unavailable_reason()


# -- passes show / list ----------------------------------------------------------------------------------------------
def test_passes_show_rtn(run_cli, make_registry) -> None:
    reg = make_registry()
    code, out, _ = run_cli("passes", "show", "rtn", registry=reg)
    assert code == 0
    assert out.startswith("rtn (plugin rtn): round-to-nearest")
    assert "precisions: int4, int8" in out
    rows = {line.split()[0]: line for line in out.splitlines()[5:]}
    assert "128" in rows["block_size"] and "weights per block along K" in rows["block_size"]
    assert "true" in rows["is_symmetric"] and "bool" in rows["is_symmetric"]
    assert '["MatMul", "Gemm", "Gather", "MoE"]' in rows["op_types"]

    code, out, _ = run_cli("passes", "show", "rtn", "--json", registry=reg)
    data = json.loads(out)
    opts = {o["name"]: o for o in data["options"]}
    assert opts["block_size"] == {"name": "block_size", "type": "int", "default": 128,
                                  "help": "weights per block along K: a power of two from 16 to 256"}
    assert opts["overrides"]["type"] == "dict[str, dict[str, Any]]"
    assert data["unavailable"] is None and data["algorithms"] == ["rtn"]

    code, _, err = run_cli("passes", "show", "nope", registry=reg)
    assert code == 2 and "no pass named 'nope'" in err


def test_passes_list_json(run_cli) -> None:
    # the installed plugins, as a user sees them
    code, out, _ = run_cli("passes", "list", "--json")
    assert code == 0
    rows = json.loads(out)
    assert {"pass", "plugin", "algorithms", "precisions", "model_kinds", "needs_data", "available", "reason",
            "summary"} <= set(rows[0])
    rtn = next(r for r in rows if r["pass"] == "rtn")
    assert rtn["algorithms"] == ["rtn"] and rtn["precisions"] == ["int4", "int8"] and rtn["available"]
    code, out, _ = run_cli("plugins", "--json")
    assert code == 0
    plugins = {r["plugin"]: r for r in json.loads(out)}
    assert plugins["rtn"]["distribution"] == "bitpress-rtn" and "rtn" in plugins["rtn"]["passes"]


# -- options -------------------------------------------------------------------------------------------------------
@dataclass
class ToyOptions:
    flag: bool = option(False, "a switch")
    count: int = option(3, "how many")
    ratio: float = option(0.5, "a fraction")
    names: list[str] = option([], "node names")
    sizes: list[int] = option([16], "block sizes")
    table: dict[str, int] = option({}, "name -> bits")
    mode: Literal["fast", "slow"] = option("fast", "speed")
    bits: Literal[4, 8] = option(4, "bits")
    limit: int | None = option(None, "optional cap")
    label: Optional[str] = option(None, "optional label")  # noqa: UP045 - the old spelling must work too

    def validate(self) -> None:
        if self.count < 0:
            raise ValueError("count must be >= 0")


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"flag": "true", "count": "7", "ratio": "1e-3"}, {"flag": True, "count": 7, "ratio": 0.001}),
        ({"flag": "off", "count": "-2".lstrip("-"), "ratio": 2}, {"flag": False, "count": 2, "ratio": 2.0}),
        ({"flag": True, "count": 5}, {"flag": True, "count": 5}),  # JSON/YAML values as they are
        ({"names": "a, b,c"}, {"names": ["a", "b", "c"]}),
        ({"names": '["re:.*proj,x", "b"]'}, {"names": ["re:.*proj,x", "b"]}),
        ({"names": ["x"]}, {"names": ["x"]}),
        ({"sizes": "32,64"}, {"sizes": [32, 64]}),
        ({"table": '{"a": 8, "b": "4"}'}, {"table": {"a": 8, "b": 4}}),
        ({"table": {"a": 8}}, {"table": {"a": 8}}),
        ({"mode": "slow", "bits": "8"}, {"mode": "slow", "bits": 8}),
        ({"limit": "10", "label": "x"}, {"limit": 10, "label": "x"}),
        ({"limit": "none", "label": "null"}, {"limit": None, "label": None}),
        ({"limit": None}, {"limit": None}),
    ],
)
def test_option_coercion(values: dict[str, Any], expected: dict[str, Any]) -> None:
    opts = parse_options(ToyOptions, values, owner="toy")
    for key, value in expected.items():
        got = getattr(opts, key)
        assert got == value and type(got) is type(value), (key, got)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"count": "abc"}, "toy: option count='abc' is not a valid int"),
        ({"count": "1.5"}, "not a valid int"),
        ({"count": True}, "got a boolean"),
        ({"flag": "maybe"}, "expected true or false"),
        ({"ratio": "fast"}, "not a valid float"),
        ({"mode": "medium"}, "expected one of 'fast', 'slow'"),
        ({"bits": "3"}, "expected one of 4, 8"),
        ({"sizes": "[16, x]"}, "not valid JSON"),
        ({"sizes": "16,x"}, "not a valid list[int]"),
        ({"table": '{"a": "b"}'}, "not a valid dict[str, int]"),
        ({"table": "[1]"}, "expected a mapping"),
        ({"limit": "lots"}, "not a valid int | None"),
        ({"count": "-1"}, "toy: count must be >= 0"),
        ({"cout": 1, "zzz": 2},
         "toy: unknown option(s) cout (did you mean count?), zzz; valid options: bits, count, flag, label, limit"),
    ],
)
def test_option_errors(values: dict[str, Any], message: str) -> None:
    with pytest.raises(OptionError) as info:
        parse_options(ToyOptions, values, owner="toy")
    assert message in str(info.value)


def test_option_defaults_and_description() -> None:
    a, b = ToyOptions(), ToyOptions()
    a.names.append("x")
    assert b.names == [], "mutable defaults are copied per instance"
    info = {o.name: o for o in describe(ToyOptions)}
    assert info["sizes"].default == [16] and info["sizes"].type == "list[int]"
    assert info["mode"].type == "'fast' | 'slow'"
    assert info["limit"].type == "int | NoneType" and info["limit"].default is None
    assert info["ratio"].help == "a fraction"
    with pytest.raises(OptionError, match="valid options: \\(none\\)"):
        parse_options(NoOptions, {"x": 1}, owner="plain")


@dataclass
class CodebookOptions:
    precision: str = option("nf4", "codebook")
    block_size: int = option(64, "block")


def test_precision_implies_options() -> None:
    from bitpress.onnx.weightonly import WeightOnlyOptions

    bits = _pass("bitsy", precisions=("int4", "int8"), Options=WeightOnlyOptions)
    assert bits.from_config({}, "int8").options.bits == 8
    assert bits.from_config({"bits": "8"}, "int8").options.bits == 8
    with pytest.raises(OptionError, match="contradicts --precision int8"):
        bits.from_config({"bits": 4}, "int8")
    with pytest.raises(OptionError, match="precision 'nf4' is not supported; choose one of int4, int8"):
        bits.from_config({}, "nf4")
    books = _pass("books", precisions=("nf4", "fp4"), Options=CodebookOptions)
    assert books.from_config({}, "fp4").options.precision == "fp4"


# -- selection ------------------------------------------------------------------------------------------------------
def test_select_by_algorithm_and_precision() -> None:
    generic = _pass("generic4", algorithms=("awq", "gptq"), precisions=("int4",))
    named = _pass("awq", algorithms=("awq",), precisions=("int4", "int8"))
    eight = _pass("eight", algorithms=("awq",), precisions=("int8", "int16"))
    offline = _pass("offline", algorithms=("gptq",), precisions=("int8",), requires=("no_such_module_xyz",))
    toy = _pass("toyonly", algorithms=("toyq",), model_kinds=("toy",))
    reg = Registry(entry_points=False)
    reg.register(_plugin(generic, named, eight, offline, toy), name="p")

    assert reg.select("awq", "int4", "onnx") is named  # the pass named after the algorithm first
    assert reg.select("awq", None, "onnx") is named
    assert reg.select("awq", "int16", "onnx") is eight
    assert reg.select("gptq", "int4", "onnx") is generic
    assert reg.select("generic4", None, "onnx") is generic  # a pass name works as an algorithm
    with pytest.raises(PassNotFoundError, match="does not offer precision 'int2'; choose one of int16, int4, int8"):
        reg.select("awq", "int2", "onnx")
    with pytest.raises(PassUnavailableError, match=r"offline.*no_such_module_xyz"):
        reg.select("gptq", "int8", "onnx")
    with pytest.raises(PassNotFoundError, match="does not accept onnx models \\(it takes: toy\\)"):
        reg.select("toyq", None, "onnx")
    assert reg.select("toyq", None, "toy") is toy
    with pytest.raises(PassNotFoundError, match="known: awq, gptq, toyq"):
        reg.select("nope", None, "onnx")


def test_config_resolves_names_aliases_and_algorithms(make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    reg = make_registry()
    olive_style = {
        "input_model": {"type": "ONNXModel", "model_path": str(tiny_decoder)},
        "output_dir": str(tmp_path / "out"),
        "passes": {"quant": {"type": "OnnxBlockWiseRtnQuantization", "block_size": 32}},
    }
    wf = build_workflow(olive_style, reg)
    assert wf.steps[0].pass_.name == "rtn" and wf.steps[0].pass_.options.block_size == 32
    assert wf.steps[0].label == "quant"
    by_algorithm = {"input": str(tiny_decoder), "output": "x", "passes": [{"type": "rtn", "precision": "int8"}]}
    assert build_workflow(by_algorithm, reg).steps[0].pass_.options.bits == 8
    with pytest.raises(OptionError, match="unknown option\\(s\\) blok_size"):
        build_workflow({**by_algorithm, "passes": [{"type": "rtn", "blok_size": 32}]}, reg)


# -- hooks: wrappers around every pass, replacing execution, new model formats -----------------------------------------
def test_run_pass_wrapper_sees_every_pass(make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    seen: list[tuple[str, str, float]] = []

    @hookimpl(wrapper=True)
    def bitpress_run_pass(pass_, model, context):
        start = time.perf_counter()
        result = yield
        seen.append((pass_.name, type(result).__name__, time.perf_counter() - start))
        return result

    reg = make_registry(("timer", SimpleNamespace(bitpress_run_pass=bitpress_run_pass)))
    api.quantize(tiny_decoder, tmp_path / "q.onnx", algorithm="rtn", precision="int4", registry=reg)
    assert [s[:2] for s in seen] == [("rtn", "OnnxModel")]
    proto = onnx.load(str(tmp_path / "q.onnx"))
    assert any(n.op_type == "MatMulNBits" for n in proto.graph.node)


def test_run_pass_implementation_replaces_execution(make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    @hookimpl
    def bitpress_run_pass(pass_, model, context):
        context.extras["ran_elsewhere"] = pass_.name
        return model  # e.g. the pass ran in another environment; here: skipped

    reg = make_registry(("remote", SimpleNamespace(bitpress_run_pass=bitpress_run_pass)))
    api.quantize(tiny_decoder, tmp_path / "q.onnx", algorithm="rtn", precision="int4", registry=reg)
    proto = onnx.load(str(tmp_path / "q.onnx"))
    assert not any(n.op_type == "MatMulNBits" for n in proto.graph.node), "the builtin run must not happen"


class ToyModel(ModelHandle):
    """A non-ONNX format: a text file of numbers."""

    kind: ClassVar[str] = "toy"

    def __init__(self, source: Path, values: np.ndarray) -> None:
        super().__init__(source)
        self.values = values


class ToyRound(Pass):
    name = "toyround"
    algorithms = ("toyround",)
    precisions = ("int4",)
    model_kinds = ("toy",)

    def run(self, model: Any, context: PassContext) -> Any:
        return ToyModel(model.source, np.round(model.values * 2) / 2)


@hookimpl
def _toy_load(source: Path, options: dict[str, Any]) -> ModelHandle | None:
    if source.suffix != ".toy":
        return None
    return ToyModel(source, np.array([float(x) for x in source.read_text().split()]))


@hookimpl
def _toy_save(model: ModelHandle, destination: Path, options: dict[str, Any]) -> list[Path] | None:
    if not isinstance(model, ToyModel):
        return None
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_text(" ".join(f"{v:g}" for v in model.values))
    return [destination]


def test_format_plugin_load_and_save(make_registry, run_cli, tmp_path: Path) -> None:
    toy = _plugin(ToyRound, bitpress_load_model=_toy_load, bitpress_save_model=_toy_save)
    reg = make_registry(("toy", toy))
    src = tmp_path / "weights.toy"
    src.write_text("0.1 0.74 -1.3")
    code, _, err = run_cli("quantize", "-m", src, "-o", tmp_path / "q.toy", "--algorithm", "toyround",
                           "--precision", "int4", registry=reg)
    assert code == 0, err
    assert (tmp_path / "q.toy").read_text() == "0 0.5 -1.5"
    # and through a config naming the pass
    config = {"input": str(src), "output": str(tmp_path / "c.toy"), "passes": [{"type": "toyround"}]}
    api.run(config, registry=reg)
    assert (tmp_path / "c.toy").read_text() == "0 0.5 -1.5"
    # ONNX models still take the host's loader
    code, _, err = run_cli("quantize", "-m", src, "-o", tmp_path / "r.onnx", "--algorithm", "rtn", registry=reg)
    assert code == 2 and "does not accept toy models" in err
