"""Hostile or mistyped workflow configs and option patterns (issue #12: options, booleans, config shape).

Every case runs ``bitpress run CONFIG`` through :func:`bitpress.cli.main` and checks: exit code 2
(a usage error), stderr exactly one line starting ``bitpress: error:`` (never an internal
error, never a traceback, never an unbounded value), and the folder it ran in unchanged: no
output, no temporary folder, an existing output file kept byte for byte. The configs are built
here. ``re:`` patterns are matched by RE2 in linear time: adversarial patterns against long names
finish well inside a generous subprocess timeout (no tight timing assertion).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

import bitpress
from bitpress.errors import ConfigError, OptionError
from bitpress.selection import NameMatcher, compile_regex

#: RE2 answers in linear time; this only stops a hang from hanging the suite
WALL_CLOCK = 20


def _one_error_line(code: int, err: str, exit_code: int = 2) -> str:
    lines = err.strip("\n").splitlines()
    assert code == exit_code, err
    assert len(lines) == 1, err
    assert lines[0].startswith("bitpress: error: "), err
    assert "internal error" not in err and "Traceback" not in err
    assert len(lines[0]) < 700, lines[0][:1000]  # no unbounded value formatted into the message
    return lines[0]


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def run_config(run_cli, make_registry, tiny_decoder: Path, tmp_path: Path) -> Callable[..., str]:
    """``run_config(text_or_mapping, name="w.yaml", exit_code=2)``: the one error line of ``bitpress run``.

    The folder the config is written to must be unchanged afterwards (the config file aside), and
    the input model untouched.
    """
    reg = make_registry()

    def run(config: str | bytes | dict[str, Any], name: str = "w.yaml", exit_code: int = 2) -> str:
        work = tmp_path / "work"
        work.mkdir(exist_ok=True)
        path = work / name
        if isinstance(config, dict):
            config = json.dumps(config) if name.endswith(".json") else yaml.safe_dump(config)
        if isinstance(config, str):
            config = config.encode()
        path.write_bytes(config)
        before, model = _tree(work), tiny_decoder.read_bytes()
        code, _, err = run_cli("run", path, registry=reg)
        line = _one_error_line(code, err, exit_code)
        assert _tree(work) == before, "the run left something behind or changed a file"
        assert tiny_decoder.read_bytes() == model
        return line

    return run


def _base(tiny_decoder: Path, **extra: Any) -> dict[str, Any]:
    return {"input": str(tiny_decoder), "output": "out.onnx", "passes": [{"type": "rtn", "precision": "int4"}],
            **extra}


# -- 1. re: patterns: linear time (RE2), constructs RE2 cannot express refused -----------------------------------------
ADVERSARIAL = [r"(.|\w)*!", r"(a|aa)*b", r"(.*a){20}", r"(.*.*){1,100}y", ".*" * 200 + "y", r"(a+)+$",
               r"(\w+\s?)+$", r"(a|a?)+b", r"(x+x+)+y", r"(.*){1,32}[^a]"]
#: full matches of each pattern on "a" * 5000, "a" * 5000 + "!", "a" * 5000 + "b" (as Python's re answers them)
EXPECTED = {
    r"(.|\w)*!": (False, True, False), r"(a|aa)*b": (False, False, True), r"(.*a){20}": (True, False, False),
    r"(.*.*){1,100}y": (False, False, False), ".*" * 200 + "y": (False, False, False), r"(a+)+$": (True, False, False),
    r"(\w+\s?)+$": (True, False, True), r"(a|a?)+b": (False, False, True), r"(x+x+)+y": (False, False, False),
    r"(.*){1,32}[^a]": (False, True, True),
}


def test_adversarial_patterns_match_in_linear_time_onnx_and_hf() -> None:
    """Patterns that take exponential time in a backtracking engine, against 5000-character names."""
    script = textwrap.dedent(f"""
        import json
        from bitpress.selection import NameMatcher
        from bitpress_rtn.hf_passes import RtnHfPass
        names = ["a" * 5000, "a" * 5000 + "!", "a" * 5000 + "b"]
        out = {{}}
        for p in {ADVERSARIAL!r}:
            onnx_side = NameMatcher(["re:" + p], what="nodes_to_exclude")
            values = {{"modules_to_not_convert": ["re:" + p], "overrides": {{"re:" + p: {{"bits": 8}}}}}}
            hf = RtnHfPass.from_config(values, strict=True).options.rules()
            got = [onnx_side.matches(n) for n in names]
            assert got == [hf.resolve((n,), "linear").settings is None for n in names], p
            assert NameMatcher(["re:" + p]).unmatched(names) == ([] if any(got) else ["re:" + p])
            out[p] = got
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WALL_CLOCK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert {p: tuple(v) for p, v in got.items()} == EXPECTED
    assert proc.stderr.strip() == ""  # RE2 logs nothing of its own


def _long_name_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    # weights are matched by name too: these match none of the patterns
    w = numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "1-w")
    v = numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "2-v")
    nodes = [helper.make_node("MatMul", ["x", "1-w"], ["h"], name="a" * 5000),
             helper.make_node("MatMul", ["h", "2-v"], ["y"], name="a" * 4999 + "!")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])], [w, v])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


def test_adversarial_patterns_in_a_real_run(tmp_path: Path) -> None:
    """`bitpress run` with every adversarial pattern against nodes named with 5000 characters."""
    model = _long_name_model(tmp_path / "m.onnx")
    config = tmp_path / "w.yaml"
    config.write_text(yaml.safe_dump({
        "input": "m.onnx", "output": "q.onnx",
        "passes": [{"type": "rtn", "precision": "int4", "block_size": 32,
                    "nodes_to_exclude": ["re:" + p for p in ADVERSARIAL if p not in (r"(.|\w)*!", r"(.*){1,32}[^a]")],
                    "overrides": {r"re:(.|\w)*!": {"bits": 8}}}],
    }))
    proc = subprocess.run([sys.executable, "-m", "bitpress", "run", str(config), "--json"], capture_output=True,
                          text=True, timeout=WALL_CLOCK * 3, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = onnx.load(tmp_path / "q.onnx")
    quantized = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    # 'a' * 5000 is excluded ((.*a){20} matches it); 'a' * 4999 + '!' is 8-bit by the override
    assert len(quantized) == 1 and quantized[0].name.startswith("a" * 4999 + "!")
    assert {a.name: a.i for a in quantized[0].attribute}["bits"] == 8
    assert [n.name for n in out.graph.node if n.op_type == "MatMul"] == ["a" * 5000]
    assert model.exists()


@pytest.mark.parametrize(("pattern", "why"), [
    (r"(a)\1", "backreference"),
    (r"(?P<x>a)(?P=x)", "named backreference"),
    (r"foo(?=bar)", "lookahead"),
    (r"foo(?!bar)", "negative lookahead"),
    (r"(?<=x)foo", "lookbehind"),
    (r"(?<!x)foo", "negative lookbehind"),
    (r"a++", "possessive quantifier"),
    (r"(?>a+)b", "atomic group"),
    (r"a{1,1001}", "at most 1000"),
    (r"(a{100}){100}", "at most 1000"),
    (r"(unclosed", "not a valid regular expression"),
])
@pytest.mark.parametrize("where", ["nodes_to_exclude", "nodes_to_include", "overrides", "hf_not_convert",
                                   "hf_overrides"])
def test_patterns_re2_cannot_express_are_usage_errors(pattern: str, why: str, where: str, run_config,
                                                       tiny_decoder: Path) -> None:
    value: Any
    if where.startswith("hf_"):
        entry: dict[str, Any] = {"type": "rtn_hf"}
        value = ["re:" + pattern] if where == "hf_not_convert" else {"re:" + pattern: {"bits": 8}}
        entry["modules_to_not_convert" if where == "hf_not_convert" else "overrides"] = value
    else:
        value = {"re:" + pattern: {"bits": 8}} if where == "overrides" else ["re:" + pattern]
        entry = {"type": "rtn", "precision": "int4", where: value}
    line = run_config(_base(tiny_decoder, passes=[entry]))
    assert why in line
    assert repr("re:" + pattern)[:40] in line  # names the pattern as written


def test_pattern_errors_from_python_and_the_command_line(tiny_decoder: Path, tmp_path: Path, run_cli,
                                                          make_registry) -> None:
    with pytest.raises(OptionError, match="backreference"):
        compile_regex(r"(a)\1", what="nodes_to_exclude")
    with pytest.raises(OptionError, match="lookahead"):
        bitpress.quantize(tiny_decoder, tmp_path / "q.onnx", algorithm="rtn", precision="int4",
                          options={"nodes_to_exclude": ["re:x(?=y)"]})
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm", "rtn",
                           "--option", r'nodes_to_exclude=["re:(a)\\1"]', registry=make_registry())
    assert "backreference" in _one_error_line(code, err)
    assert not list(tmp_path.iterdir())
    # what RE2 can express keeps the full-match semantics
    m = NameMatcher([r"re:.*/mlp/.*", "*/k_proj/*", "exact"])
    assert m.first("/model/layers.0/mlp/up/MatMul") == r"re:.*/mlp/.*"
    assert m.first("x/mlp/") == r"re:.*/mlp/.*" and m.first("mlp/") is None
    assert m.first("/a/k_proj/MatMul") == "*/k_proj/*" and m.first("exact") == "exact" and m.first("exac") is None


# -- 2. booleans are booleans, numbers are numbers: strict config values -----------------------------------------------
def test_overwrite_false_as_a_string_keeps_the_existing_output(run_config, tiny_decoder: Path,
                                                               tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "out.onnx").write_bytes(b"the user's own file")
    for text in ('"false"', '"no"', "0", "1", '"true"', "[]"):
        line = run_config(f"input: {tiny_decoder}\noutput: out.onnx\noverwrite: {text}\n"
                          "passes: [{type: rtn, precision: int4}]\n")
        assert "overwrite" in line
        assert (work / "out.onnx").read_bytes() == b"the user's own file"
    line = run_config(json.dumps({**_base(tiny_decoder), "overwrite": "false"}), name="w.json")
    assert line.startswith("bitpress: error: overwrite: expected true or false, got the string 'false'")
    assert (work / "out.onnx").read_bytes() == b"the user's own file"
    # a real false is honoured: the output exists, so the run stops (exit 1) and keeps it
    line = run_config(json.dumps({**_base(tiny_decoder), "overwrite": False}), name="w.json", exit_code=1)
    assert "already exists" in line and (work / "out.onnx").read_bytes() == b"the user's own file"


@pytest.mark.parametrize(("extra", "key"), [
    ({"jobs": "8"}, "jobs"),
    ({"jobs": 8.0}, "jobs"),
    ({"env_timeout": "10"}, "env_timeout"),
    ({"env_timeout": True}, "env_timeout"),
    ({"env_timeout": -1}, "env_timeout"),
    ({"save": {"external_data": "false"}}, "save.external_data"),
    ({"save": {"max_shard_size": "2GB"}}, "save.max_shard_size"),
    ({"save": {"max_shard_size": True}}, "save.max_shard_size"),
    ({"save": {"max_shard_size": 0}}, "save.max_shard_size"),
    ({"save": {"check": 0}}, "save.check"),
    ({"components": [1]}, "components"),
    ({"data": {"samples": "8"}}, "data.samples"),
    ({"data": {"seq_len": True}}, "data.seq_len"),
    ({"data": {"samples": 0}}, "data.samples"),
    ({"data": {"source": 5}}, "data.source"),
    ({"data": {"sauce": "random"}}, "data: unknown key sauce"),
])
def test_top_level_values_must_have_their_types(extra: dict[str, Any], key: str, run_config,
                                                tiny_decoder: Path) -> None:
    line = run_config(json.dumps(_base(tiny_decoder, **extra)), name="w.json")
    assert line.startswith(f"bitpress: error: {key}"), line


@pytest.mark.parametrize(("options", "message"), [
    ({"block_size": "32"}, "block_size='32' is not a valid int"),
    ({"block_size": 32.0}, "block_size=32.0 is not a valid int"),
    ({"block_size": True}, "block_size=True is not a valid int"),
    ({"is_symmetric": "false"}, "is_symmetric='false' is not a valid bool"),
    ({"is_symmetric": 0}, "is_symmetric=0 is not a valid bool"),
    ({"accuracy_level": "4"}, "accuracy_level='4' is not a valid int"),
    ({"op_types": "MatMul"}, "op_types='MatMul' is not a valid list[str]"),
    ({"op_types": ["MatMul", 5]}, "[1]: expected a string"),
    ({"nodes_to_exclude": "re:.*"}, "nodes_to_exclude='re:.*' is not a valid list[str]"),
    ({"overrides": '{"x": {"bits": 8}}'}, "is not a valid dict[str, dict[str, Any]]"),
    ({"overrides": {"x": {"bits": "8"}}}, "overrides['x']"),
    ({"overrides": {"x": {"is_symmetric": "false"}}}, "overrides['x']"),
    ({"overrides": {"x": {"bits": 8.5}}}, "overrides['x']"),
])
def test_pass_options_in_a_config_must_have_their_types(options: dict[str, Any], message: str, run_config,
                                                        tiny_decoder: Path) -> None:
    entry = {"type": "rtn", "precision": "int4", **options}
    line = run_config(json.dumps(_base(tiny_decoder, passes=[entry])), name="w.json")
    assert message in line, line
    # the same under `options:` and in YAML
    line = run_config(yaml.safe_dump(_base(tiny_decoder, passes=[{"type": "rtn", "precision": "int4",
                                                                  "options": options}])))
    assert message in line, line


@pytest.mark.parametrize(("options", "message"), [
    ({"sym": "false"}, "sym='false' is not a valid bool"),
    ({"lm_head": "yes"}, "lm_head='yes' is not a valid bool"),
    ({"group_size": "64"}, "group_size='64' is not a valid int"),
    ({"overrides": {"lm_head": {"bits": "8"}}}, "overrides['lm_head']"),
    ({"overrides": {"lm_head": {"group_size": 64.0}}}, "overrides['lm_head']"),
])
def test_hf_pass_options_in_a_config_must_have_their_types(options: dict[str, Any], message: str, run_config,
                                                           tiny_decoder: Path) -> None:
    line = run_config(json.dumps(_base(tiny_decoder, passes=[{"type": "rtn_hf", **options}])), name="w.json")
    assert message in line, line


def test_strings_are_parsed_only_from_the_command_line(tiny_decoder: Path, tmp_path: Path, run_cli,
                                                       make_registry) -> None:
    from bitpress.workflow.plan import plan_quantize

    reg = make_registry()
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm", "rtn",
                           "--precision", "int4", "--plan", "--option", "block_size=32", "--option",
                           "is_symmetric=false", "--option", 'overrides={"re:.*/mlp/.*": {"bits": 8}}', registry=reg)
    assert code == 0, err
    # Python values are typed: strict (as a config file), unless asked to parse strings as the CLI does
    with pytest.raises(OptionError, match="block_size='32' is not a valid int"):
        bitpress.quantize(tiny_decoder, tmp_path / "q.onnx", algorithm="rtn", precision="int4",
                          options={"block_size": "32"}, registry=reg)
    with pytest.raises(OptionError, match="is_symmetric='false' is not a valid bool"):
        plan_quantize(tiny_decoder, algorithm="rtn", precision="int4", options={"is_symmetric": "false"},
                      registry=reg)
    plan = plan_quantize(tiny_decoder, algorithm="rtn", precision="int4", registry=reg, strict=False,
                         options={"block_size": "32", "is_symmetric": "false"})
    rows = [r for r in plan.steps[0].report.rows if r.quantized]
    assert rows and all(r.block_size == 32 and r.symmetric is False for r in rows)
    with pytest.raises(ConfigError, match=r"^overwrite: expected true or false"):
        bitpress.run({**_base(tiny_decoder), "output": str(tmp_path / "q.onnx"), "overwrite": "false"}, registry=reg)
    with pytest.raises(ConfigError, match=r"^jobs: -3 is not a number of worker threads"):
        bitpress.quantize(tiny_decoder, tmp_path / "q.onnx", algorithm="rtn", jobs=-3, registry=reg)
    assert not list(tmp_path.iterdir())


def test_strict_coercion_rules() -> None:
    from typing import Literal

    from bitpress.options import coerce

    assert coerce(3, float, strict=True) == 3.0 and coerce(True, bool, strict=True) is True
    assert coerce("auto", Literal["auto", True, False], strict=True) == "auto"
    assert coerce(False, Literal["auto", True, False], strict=True) is False
    assert coerce(None, int | None, strict=True) is None
    assert coerce({"a": [1, 2]}, dict[str, list[int]], strict=True) == {"a": [1, 2]}
    for value, tp in [("3", float), (1, Literal["auto", True, False]), ("true", Literal["auto", True, False]),
                      ("none", int | None), (1, bool), (True, int), (True, float), ("a,b", list[str]),
                      ({"a": ["1"]}, dict[str, list[int]]), ({1: 2}, dict[str, int])]:
        with pytest.raises((TypeError, ValueError)):
            coerce(value, tp, strict=True)
    # the command line's strings still coerce
    assert coerce("3", float) == 3.0 and coerce("false", bool) is False and coerce("1,2", list[int]) == [1, 2]
    assert coerce("none", int | None) is None and coerce("True", Literal["auto", True, False]) is True


def test_env_worker_applies_the_strictness_the_host_asked_for(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """Options reach a plugin environment as given; the worker types them strictly when they came typed."""
    from bitpress.envs import worker
    from bitpress.envs.protocol import NO_ENVS_VAR, PROTOCOL

    monkeypatch.setenv(NO_ENVS_VAR, "1")
    job = {"protocol": PROTOCOL, "pass": "rtn", "precision": None, "options": {"block_size": "32"},
           "model": str(tmp_path / "missing.onnx"), "output": str(tmp_path / "o.onnx"), "workdir": str(tmp_path)}
    with pytest.raises(OptionError, match="block_size='32' is not a valid int"):
        worker.run_job({**job, "strict": True})
    with pytest.raises(Exception) as info:  # coerced: the options pass, the (missing) model fails next
        worker.run_job({**job, "strict": False})
    assert not isinstance(info.value, OptionError)


def test_env_proxy_records_where_its_values_came_from(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from bitpress.envs.remote import EnvPass, make_proxy

    info = type("Info", (), {"name": "fake", "path": tmp_path, "problem": lambda self: None})()
    cls = make_proxy(info, {"pass": "fakeq", "model_kinds": ["onnx"], "precisions": ["int4"],
                            "options": [{"name": "bits", "default": 4, "type": "int"}]})
    assert issubclass(cls, EnvPass)
    typed = cls.from_config({"bits": 4}, strict=True)
    assert typed.strict is True and typed.given == {"bits": 4}
    cli = cls.from_config({"bits": "4"})
    assert cli.strict is False and cli.given == {"bits": "4"}


# -- 3. config values of the wrong shape: one clean line naming the key ------------------------------------------------
@pytest.mark.parametrize(("text", "key"), [
    ("input: 5\noutput: out.onnx\npasses: [{{type: rtn}}]\n", "input"),
    ("input: {model}\noutput: [1]\npasses: [{{type: rtn}}]\n", "output"),
    ("input: {model}\noutput: out.onnx\npasses: {{q: rtn}}\n", "passes.q"),
    ("input: {model}\noutput: out.onnx\npasses: [rtn]\n", "passes[0]"),
    ("input: {model}\noutput: out.onnx\npasses: rtn\n", "passes"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: 5}}]\n", "passes[0].type"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn, precision: 4}}]\n", "passes[0].precision"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn, options: 5}}]\n", "passes[0].options"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn, env_timeout: soon}}]\n", "passes[0].env_timeout"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn, 1: 2}}]\n", "passes[0]"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn}}]\nsave: [1, 2]\n", "save"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn}}]\nsave: {{check: \"no\"}}\n", "save.check"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn}}]\nsave: {{chek: true}}\n", "save: unknown key chek"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn}}]\njobs: many\n", "jobs"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn}}]\njobs: -3\n", "jobs"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn}}]\njobs: true\n", "jobs"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn}}]\njobs: 0\n", "jobs"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn}}]\ncomponents: 5\n", "components"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn}}]\ndata: 7\n", "data"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn}}]\n1: 2\n", "config keys"),
    ("input_model: model.onnx\noutput_dir: out\npasses: [{{type: rtn}}]\n", "input_model"),
    ("- input: {model}\n", "w.yaml: the config must be a mapping"),
    ("input: {model}\noutput: out.onnx\npasses: [{{type: rtn}}]\njobs: 2001-01-01\n", "jobs"),
])
def test_values_of_the_wrong_type_are_one_line(text: str, key: str, run_config, tiny_decoder: Path) -> None:
    line = run_config(text.format(model=tiny_decoder))
    head = line.removeprefix("bitpress: error: ")
    assert key in head and head.index(key) < 120, line  # named at the start (after the file's name)


def test_olive_mapping_of_passes_is_still_accepted(make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    from bitpress.workflow.config import build_workflow

    wf = build_workflow({"input_model": {"type": "ONNXModel", "model_path": str(tiny_decoder)},
                         "output_dir": str(tmp_path / "out"),
                         "passes": {"q": {"type": "rtn", "block_size": 32}, "r": {"type": "rtn", "bits": 8}}},
                        make_registry())
    assert [s.label for s in wf.steps] == ["q", "r"] and wf.steps[1].pass_.options.bits == 8


def test_olive_types_are_routed_by_the_inputs_kind(make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    """An Olive type names one pass (KQuant, Rtn: the PyTorch ones); on an ONNX input it is the pass of the same
    algorithm that takes ONNX."""
    import bitpress_kquant
    import bitpress_rotate
    from bitpress.workflow.config import build_workflow

    passes = [{"type": "KQuant"}, {"type": "Rtn", "bits": 8}, {"type": "QuaRot"}]
    wf = build_workflow({"input": str(tiny_decoder), "output": str(tmp_path / "out"), "passes": passes},
                        make_registry(("kquant", bitpress_kquant), ("rotate", bitpress_rotate)))
    assert [s.pass_.name for s in wf.steps] == ["kquant", "rtn", "quarot"]


def test_olive_search_values_of_one_element_are_read_as_that_value(make_registry, tiny_decoder: Path,
                                                                    tmp_path: Path) -> None:
    """Olive writes searchable options as lists (``calibration_sampling_size: [8]``): one element is that value;
    several are Olive's search space, refused in one line naming bitpress sweep."""
    from bitpress.errors import OptionError
    from bitpress.workflow.config import build_workflow

    def build(**options: Any) -> Any:
        return build_workflow({"input": str(tiny_decoder), "output": str(tmp_path / "o.onnx"),
                               "passes": [{"type": "rtn", **options}]}, make_registry())

    assert build(block_size=[32], is_symmetric=[False]).steps[0].pass_.options.block_size == 32
    with pytest.raises(OptionError, match=r"block_size=\[32, 64\] lists 2 values .*bitpress sweep"):
        build(block_size=[32, 64])
    with pytest.raises(OptionError, match="not a valid int"):
        build(block_size=["32"])  # the element is checked as the value itself


def test_olive_save_options_of_onnx_passes(make_registry, tiny_decoder: Path, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """Olive's common save options on any ONNX pass: save_as_external_data sets the output's external data, the
    ones bitpress already follows pass silently, the others are named in a warning saying what bitpress does."""
    import logging

    import bitpress
    from bitpress.errors import ConfigError
    from bitpress.workflow.config import build_workflow

    def build(save: dict[str, Any] | None = None, **options: Any) -> Any:
        config = {"input": str(tiny_decoder), "output": str(tmp_path / "o" / "q.onnx"),
                  "passes": [{"type": "rtn", **options}]}
        if save is not None:
            config["save"] = save
        return build_workflow(config, make_registry())

    caplog.set_level(logging.WARNING)
    quiet = build(save_as_external_data=True, all_tensors_to_one_file=True, size_threshold=1024,
                  convert_attribute=False)
    assert quiet.save.external_data is True and not caplog.records
    build(all_tensors_to_one_file=False, external_data_name="w.data", size_threshold=[2048], convert_attribute=True)
    text = caplog.text
    for what in ("all_tensors_to_one_file=false is not followed", "external_data_name=w.data is not followed",
                 "size_threshold=2048 is not followed", "convert_attribute=true is not followed"):
        assert what in text, text
    with pytest.raises(ConfigError, match=r"save_as_external_data=true contradicts save\.external_data=false"):
        build(save={"external_data": False}, save_as_external_data=True)
    with pytest.raises(ConfigError, match="save_as_external_data"):
        build(save_as_external_data="yes")
    bitpress.run({"input": str(tiny_decoder), "output": str(tmp_path / "o" / "q.onnx"),
                  "passes": [{"type": "rtn", "save_as_external_data": True, "all_tensors_to_one_file": True}]})
    assert (tmp_path / "o" / "q.onnx.data").is_file()


def test_syntax_errors_are_folded_into_one_line(run_config, tiny_decoder: Path) -> None:
    line = run_config(f"input: {tiny_decoder}\noutput: out.onnx\npasses: [{{type: rtn}}]\nfoo: bar: baz\n")
    assert "w.yaml: not valid YAML: line 4, column 9: mapping values are not allowed here" in line
    line = run_config("input: x\n  - a\n\t- b\n")
    assert "not valid YAML: line" in line
    line = run_config('{"input": "m.onnx",\n "output": }', name="w.json")
    assert line.endswith("w.json: not valid JSON: line 2, column 12: Expecting value")
    line = run_config(b"input: \xff\xfe\n")
    assert "not UTF-8" in line
    line = run_config('{"jobs": ' + "9" * 5000 + "}", name="w.json")
    assert "not valid JSON" in line


@pytest.mark.parametrize("name", ["w.json", "w.yaml"])
def test_deeply_nested_configs_are_refused(name: str, run_config, tiny_decoder: Path) -> None:
    line = run_config('{"input": ' + "[" * 100_000 + "]" * 100_000 + "}", name=name)
    assert "nested" in line
    # nested deeper than the bound, but not deep enough to hit Python's recursion limit
    line = run_config(json.dumps(_base(tiny_decoder, passes=[{"type": "rtn", "overrides": {
        "x": json.loads("[" * 200 + "]" * 200)}}])), name=name)
    assert "nested more than 64 levels deep" in line


def test_yaml_alias_bombs_are_refused_when_read(run_config) -> None:
    laughs = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i, level in enumerate("bcdefghi"):
        prev = "a" if i == 0 else "bcdefghi"[i - 1]
        laughs.append(f"{level}: &{level} [" + ",".join([f"*{prev}"] * 9) + "]")
    line = run_config("\n".join(laughs) + "\ninput: x.onnx\noutput: out\npasses: [{type: rtn, options: {x: *i}}]\n")
    assert "more than 100000 values once its YAML aliases are expanded" in line
    merges = ["a0: &a0 {" + ", ".join(f"k{j}: {j}" for j in range(10)) + "}"]
    for i in range(1, 9):
        merges.append(f"a{i}: &a{i} {{<<: [" + ", ".join([f"*a{i - 1}"] * 10) + f"], n{i}: {i}}}")
    # PyYAML >= 6.0.2 merges each key once; older versions multiply: refused by the loader there
    line = run_config("\n".join(merges) + "\ninput: x.onnx\n")
    assert "merge keys (<<) expand to more than 100000 values" in line or "unknown config key(s) a0" in line
    line = run_config("input: &x [*x]\n")  # a list that contains itself
    assert "nested more than 64 levels deep" in line


def test_user_values_in_messages_are_bounded(run_config, tiny_decoder: Path) -> None:
    big = ["x" * 1000] * 5000
    for config in (
        _base(tiny_decoder, jobs=big),
        _base(tiny_decoder, overwrite="y" * 100_000),
        _base(tiny_decoder, passes=[{"type": "rtn", "block_size": big}]),
        _base(tiny_decoder, passes=[{"type": "rtn", "z" * 100_000: 1}]),
        _base(tiny_decoder, passes=[{"type": "r" * 100_000}]),
        _base(tiny_decoder, passes=[{"type": "rtn", "nodes_to_exclude": ["re:(" * 100_000]}]),
        {**_base(tiny_decoder), "k" * 100_000: 1},
        {**_base(tiny_decoder), "input": big},
    ):
        run_config(json.dumps(config), name="w.json")  # the line length is checked there


# -- setup errors before anything is created ---------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [{"jobs": -3}, {"save": {"check": "no"}}, {"overwrite": "false"},
                                   {"output": "new/deeper/" + "n" * 300 + ".onnx"}])
def test_setup_errors_create_no_folder(extra: dict[str, Any], run_config, tiny_decoder: Path,
                                       tmp_path: Path) -> None:
    config = {**_base(tiny_decoder), "output": "new/deeper/out.onnx", **extra}
    line = run_config(json.dumps(config), name="w.json", exit_code=1 if "output" in extra else 2)
    assert line
    assert not (tmp_path / "work" / "new").exists()


def test_olive_engine_output_dir_and_save_options_of_an_export(tiny_decoder: Path, tmp_path: Path) -> None:
    """Olive's older engine.output_dir names the output; a pass that writes ONNX from a Hugging Face folder
    (OnnxConversion) takes Olive's common save options like any ONNX pass."""
    from bitpress.workflow.config import build_workflow, load_config

    path = tmp_path / "olive.json"
    path.write_text(json.dumps({"input_model": {"type": "ONNXModel", "model_path": str(tiny_decoder)},
                                "passes": {"q": {"type": "rtn"}}, "engine": {"output_dir": "out"}}))
    assert build_workflow(load_config(path)).output == tmp_path / "out"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    wf = build_workflow({"input": str(hf), "output": str(tmp_path / "o"),
                         "passes": [{"type": "OnnxConversion", "save_as_external_data": True,
                                     "all_tensors_to_one_file": True}]})
    assert wf.steps[0].pass_.name == "hf_to_onnx" and wf.save.external_data is True
