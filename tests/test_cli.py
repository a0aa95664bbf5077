"""The command line's argument handling: global flags anywhere, "did you mean", --save-config,
--jobs everywhere, the eval HTML report's header; and the Python API's equivalents of the flags."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import onnx
import pytest
import yaml

import bitpress
from bitpress import cli
from bitpress.errors import OptionError, OutputError, PassNotFoundError

# -- global flags -----------------------------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every (nested) subcommand parser with its path of names."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _subparsers(sub, (*path, name))


def test_every_subcommand_takes_the_global_flags_after_its_name() -> None:
    parser = cli._parser()
    found = list(_subparsers(parser))
    assert {("quantize",), ("run",), ("passes", "list"), ("env", "list"), ("eval",)} <= {p for p, _ in found}
    for path, sub in found:
        assert "-v" in sub._option_string_actions and "--verbose" in sub._option_string_actions, path
        if "--json" in sub._option_string_actions:  # never overwrites `bitpress --json ...`
            assert sub._option_string_actions["--json"].default is argparse.SUPPRESS, path


@pytest.mark.parametrize(
    ("argv", "verbose", "as_json"),
    [
        (["passes", "list"], False, False),
        (["-v", "passes", "list"], True, False),
        (["passes", "list", "-v"], True, False),
        (["passes", "-v", "list", "--json"], True, True),
        (["--json", "-v", "passes", "list"], True, True),
        (["passes", "list", "--json", "-v"], True, True),
        (["env", "list", "-v"], True, False),
        (["env", "--json"], False, True),
        (["quantize", "-m", "a.onnx", "-o", "b", "--algorithm", "rtn", "--verbose", "--json"], True, True),
        (["run", "w.yaml", "-v"], True, False),
        (["eval", "q.onnx", "--reference", "r.onnx", "--json", "-v"], True, True),
        (["inspect", "q.onnx", "-v"], True, False),
    ],
)
def test_global_flags_before_or_after_the_subcommand(argv: list[str], verbose: bool, as_json: bool) -> None:
    args = cli._parser().parse_args(argv)
    assert args.verbose is verbose and args.json is as_json


def test_global_flags_take_effect(run_cli, tiny_decoder: Path, tmp_path: Path) -> None:
    code, out, err = run_cli("passes", "list", "--json", "-v")
    assert code == 0 and json.loads(out)
    assert logging.getLogger("bitpress").level == logging.DEBUG
    code, out, _ = run_cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm", "rtn",
                           "--precision", "int4", "--json", "-v")
    assert code == 0 and json.loads(out)["output"] == str(tmp_path / "q.onnx")
    code, out, _ = run_cli("env", "list", "-v", "--json")
    assert code == 0 and isinstance(json.loads(out), list)
    code, _, err = run_cli("--json", "demo", "--preset", "tiny", "--output", tmp_path / "demo")
    assert code == 2 and "`bitpress demo` has no JSON output" in err
    assert not (tmp_path / "demo").exists()


# -- did you mean ------------------------------------------------------------------------------------------------------
def test_unknown_names_suggest_close_ones(run_cli, make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    reg = make_registry()
    q = ("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx")
    code, _, err = run_cli(*q, "--algorithm", "rnt", "--precision", "int4", registry=reg)
    assert code == 2
    assert err.startswith("bitpress: error: no installed plugin provides algorithm 'rnt'; did you mean 'rtn'?")
    assert len(err.strip().splitlines()) == 1
    code, _, err = run_cli(*q, "--algorithm", "rtn", "--precision", "in4", registry=reg)
    assert code == 2 and "does not offer precision 'in4'" in err and "did you mean 'int4'" in err
    code, _, err = run_cli(*q, "--algorithm", "rtn", "--option", "block_sise=32", registry=reg)
    assert code == 2 and "unknown option(s) block_sise (did you mean block_size?)" in err
    code, _, err = run_cli("passes", "show", "rnt", registry=reg)
    assert code == 2 and "no pass named 'rnt'; did you mean 'rtn'?" in err
    assert not (tmp_path / "q.onnx").exists()


def test_algorithm_and_precision_names_are_case_insensitive(run_cli, make_registry, tiny_decoder: Path,
                                                            tmp_path: Path) -> None:
    reg = make_registry()
    code, out, err = run_cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm", "RTN",
                             "--precision", "INT8", "--json", registry=reg)
    assert code == 0, err
    ops = {n.op_type: n for n in onnx.load(tmp_path / "q.onnx").graph.node}
    assert {a.name: a.i for a in ops["MatMulNBits"].attribute}["bits"] == 8
    code, out, _ = run_cli("passes", "show", "RTN", registry=reg)
    assert code == 0 and out.startswith("rtn (plugin rtn)")
    assert reg.select("Rtn", "Int4", "onnx").name == "rtn"


def test_config_errors_name_the_key(make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    reg = make_registry()
    base = {"input": str(tiny_decoder), "output": str(tmp_path / "out")}
    with pytest.raises(PassNotFoundError) as info:
        bitpress.api.build_workflow({**base, "passes": [{"type": "rnt"}]}, reg)
    assert str(info.value).startswith("passes[0].type: unknown pass 'rnt'; did you mean 'rtn'?")
    with pytest.raises(OptionError, match=r"^rtn: precision 'int3' is not supported; choose one of int4, int8"):
        bitpress.api.build_workflow({**base, "passes": [{"type": "rtn", "precision": "int3"}]}, reg)
    wf = bitpress.api.build_workflow({**base, "passes": [{"type": "RTN", "precision": "INT8"}]}, reg)
    assert wf.steps[0].pass_.name == "rtn" and wf.steps[0].pass_.options.bits == 8


def test_config_type_error_through_the_cli(run_cli, make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    config = tmp_path / "w.yaml"
    config.write_text(f"input: {tiny_decoder}\noutput: out/\npasses:\n  - type: rnt\n")
    code, _, err = run_cli("run", config, registry=make_registry())
    assert code == 2
    assert err.strip().startswith("bitpress: error: passes[0].type: unknown pass 'rnt'; did you mean 'rtn'?")


# -- --save-config -----------------------------------------------------------------------------------------------------
def _graph_and_weights(path: Path) -> tuple[bytes, dict[str, bytes]]:
    m = onnx.load(path)
    inits = {t.name: t.SerializeToString() for t in m.graph.initializer}
    del m.graph.initializer[:]
    return m.SerializeToString(), inits


@pytest.mark.parametrize("name", ["cfg/workflow.yaml", "cfg/workflow.json"])
def test_save_config_reproduces_the_run(run_cli, make_registry, tiny_decoder: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    reg = make_registry()
    monkeypatch.chdir(tmp_path)
    out = Path("first") / "q.onnx"
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "rtn", "--precision", "int4",
                           "--option", "block_size=32", "--option", "is_symmetric=false",
                           "--option", "nodes_to_exclude=/lm_head/MatMul", "--jobs", "1", "--data", "random",
                           "--samples", "2", "--save-config", name, registry=reg)
    assert code == 0, err
    path = tmp_path / name
    text = path.read_text()
    config = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    # paths relative to the config's folder, the pass by name, only the options that are not defaults
    assert not Path(config["input"]).is_absolute()
    assert (path.parent / config["input"]).resolve() == tiny_decoder.resolve()
    assert config["output"] == "../first/q.onnx"
    assert config["passes"] == [{"type": "rtn", "precision": "int4", "block_size": 32, "is_symmetric": False,
                                 "nodes_to_exclude": ["/lm_head/MatMul"]}]
    assert config["jobs"] == 1
    assert config["data"] == {"source": "random", "samples": 2}
    assert config["save"] == {"external_data": None, "max_shard_size": None, "check": True}

    # the config, run from another folder to another output, writes the same model
    config["output"] = "../second/q.onnx"
    path.write_text(json.dumps(config) if name.endswith(".json") else yaml.safe_dump(config))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, _, err = run_cli("run", path, registry=reg)
    assert code == 0, err
    first, second = tmp_path / "first" / "q.onnx", tmp_path / "second" / "q.onnx"
    assert _graph_and_weights(first) == _graph_and_weights(second)
    assert first.read_bytes() == second.read_bytes()  # the writer's output is reproducible, byte for byte


def test_save_config_keeps_an_existing_file(run_cli, make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    config = tmp_path / "w.yaml"
    config.write_text("keep me\n")
    args = ("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm", "rtn", "--save-config", config)
    code, _, err = run_cli(*args, registry=make_registry())
    assert code == 1 and "already exists" in err and "--overwrite" in err
    assert config.read_text() == "keep me\n" and not (tmp_path / "q.onnx").exists()
    code, _, err = run_cli(*args, "--overwrite", registry=make_registry())
    assert code == 0, err
    assert yaml.safe_load(config.read_text())["passes"] == [{"type": "rtn"}]


def test_config_data_paths_are_relative_to_the_config(tmp_path: Path) -> None:
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "a.yaml").write_text("input: m.onnx\noutput: out\npasses: [{type: rtn}]\n"
                                   "data: {source: calib.npz, tokenizer: tok/tokenizer.json}\n")
    (folder / "b.yaml").write_text("input: m.onnx\noutput: out\npasses: [{type: rtn}]\ndata: random\n")
    a = bitpress.api.load_config(folder / "a.yaml")
    assert a["data"] == {"source": str(folder / "calib.npz"), "tokenizer": str(folder / "tok/tokenizer.json")}
    assert bitpress.api.load_config(folder / "b.yaml")["data"] == "random"


# -- --jobs ------------------------------------------------------------------------------------------------------------
def test_eval_takes_jobs_and_the_old_threads(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli._parser()
    assert parser.parse_args(["eval", "q.onnx", "--reference", "r.onnx"]).jobs == 1
    assert parser.parse_args(["eval", "q.onnx", "--reference", "r.onnx", "--jobs", "3"]).jobs == 3
    capsys.readouterr()
    assert parser.parse_args(["eval", "q.onnx", "--reference", "r.onnx", "--threads", "2"]).jobs == 2
    assert "--threads is deprecated; use --jobs" in capsys.readouterr().err
    eval_parser = dict(_subparsers(parser))[("eval",)]
    assert "--threads" not in eval_parser.format_help() and "--jobs" in eval_parser.format_help()
    for path, sub in _subparsers(parser):
        assert "--threads" not in sub.format_help(), path


# -- eval --html ------------------------------------------------------------------------------------------------------
def test_eval_html_names_models_sizes_bits_and_algorithm(run_cli, make_registry, tiny_decoder: Path,
                                                          tmp_path: Path) -> None:
    reg = make_registry()
    q = tmp_path / "q.onnx"
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", q, "--algorithm", "rtn", "--precision", "int4",
                           "--option", "block_size=32", registry=reg)
    assert code == 0, err
    record = json.loads(next(p.value for p in onnx.load(q).metadata_props if p.key == "bitpress"))
    assert record["passes"][0]["pass"] == "rtn" and record["passes"][0]["options"]["block_size"] == 32

    report = tmp_path / "report.html"
    code, out, err = run_cli("eval", q, "--reference", tiny_decoder, "--samples", "1", "--seq-len", "8",
                             "--jobs", "2", "--html", report, registry=reg)
    assert code == 0, err
    assert "algorithm rtn (plugin rtn)" in out
    page = report.read_text()
    assert str(q) in page and str(tiny_decoder) in page
    size_q, size_r = q.stat().st_size, tiny_decoder.stat().st_size
    assert f"{size_q / 1e3:.1f} kB quantized, {size_r / 1e6:.1f} MB reference" in page
    assert "bits per weight</th><td>5.00" in page  # int4, block 32, fp32 scales: 4 + 32/32
    assert "<th>algorithm</th><td>rtn" in page and "block_size=32" in page and "bits=4" in page
    assert "2 thread(s)" in page
    # the tables stay within the page: fixed layout at the page's width, long names wrap
    assert "table-layout:fixed" in page and "width:100%" in page and "max-width:100%" in page
    assert "overflow-wrap:anywhere" in page
    assert 'title="model.layers.0.self_attn.q_proj.weight"' in page

    result = bitpress.evaluate(q, tiny_decoder, samples=1, seq_len=8, weights=False)
    assert result.quantization[0]["pass"] == "rtn" and result.bits_per_weight == pytest.approx(5.0)
    assert result.quantized_bytes == size_q and result.reference_bytes == size_r
    data = result.to_json()
    assert data["quantization"][0]["options"]["block_size"] == 32 and data["bits_per_weight"] == pytest.approx(5.0)


def test_eval_html_without_metadata_says_unknown(make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    q = tmp_path / "q.onnx"
    bitpress.quantize(tiny_decoder, q, algorithm="rtn", precision="int8", options={"block_size": 32},
                      registry=make_registry())
    model = onnx.load(q)
    kept = [p for p in model.metadata_props if p.key != "bitpress"]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    onnx.save(model, q)
    result = bitpress.evaluate(q, tiny_decoder, samples=1, seq_len=8, weights=False)
    assert result.quantization is None
    page = result.write_html(tmp_path / "r.html").read_text()
    assert "<th>algorithm</th><td>unknown" in page and "<th>options</th><td>unknown" in page
    assert "bits per weight</th><td>9.00" in page  # int8, block 32, fp32 scales


# -- the Python API ---------------------------------------------------------------------------------------------------
def test_api_overwrite_and_run_flags(make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    reg = make_registry()
    out = tmp_path / "q.onnx"
    bitpress.quantize(tiny_decoder, out, algorithm="rtn", precision="int4", registry=reg)
    with pytest.raises(OutputError, match=r"pass --overwrite \(overwrite=True from Python\)"):
        bitpress.quantize(tiny_decoder, out, algorithm="rtn", precision="int4", registry=reg)
    bitpress.quantize(tiny_decoder, out, algorithm="rtn", precision="int8", overwrite=True, registry=reg)

    config = {"input": str(tiny_decoder), "output": str(out), "passes": [{"type": "rtn"}]}
    with pytest.raises(OutputError, match=r"overwrite=True from Python"):
        bitpress.run(config, registry=reg)
    result = bitpress.run(config, overwrite=True, jobs=2, external_data=True, check=False, registry=reg)
    assert sorted(f.name for f in result.files) == ["q.onnx", "q.onnx.data"]
    result = bitpress.run(config, overwrite=True, external_data=False, registry=reg)
    assert [f.name for f in result.files] == ["q.onnx"] and not (tmp_path / "q.onnx.data").exists()
    assert config == {"input": str(tiny_decoder), "output": str(out), "passes": [{"type": "rtn"}]}  # not changed

    r = bitpress.evaluate(out, tiny_decoder, samples=1, seq_len=8, weights=False, jobs=2)
    assert r.threads == 2
    assert bitpress.evaluate(out, tiny_decoder, samples=1, seq_len=8, weights=False, threads=3).threads == 3


def test_a_package_folder_given_by_a_relative_path(run_cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``-m pkg/`` from the folder above it: names in genai_config.json are read inside pkg/, once."""
    from bitpress import synthetic

    synthetic.build_genai_folder(tmp_path / "pkg")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli("quantize", "-m", "pkg/", "-o", "out/", "--algorithm", "rtn")
    assert code == 0, err
    assert (tmp_path / "out" / "genai_config.json").is_file() and (tmp_path / "out" / "model.onnx").is_file()
