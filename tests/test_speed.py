"""``bitpress bench`` and the speed figures of eval, sweeps and the demo: schema, alternation, errors.

No timing assertion anywhere (machines differ and are shared): the tests check what is measured,
how (every model in a process of its own, rounds alternating, the order rotating), and that every
figure is there, positive and labelled with the machine it came from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import bitpress
from bitpress.cli import main
from bitpress.errors import ModelLoadError, UsageError
from bitpress.speed import bench, compare, lines, runner, summary_line
from bitpress.speed.feeds import speed_feeds
from bitpress.speed.profile import slowest_nodes
from bitpress.synthetic import build_decoder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("speed")
    src = build_decoder(root / "float" / "model.onnx", hidden=128, layers=2, intermediate=352, vocab=512)
    out = {"float": src}
    for algorithm, precision in (("rtn", "int4"), ("hqq", "int4")):
        dest = root / algorithm / "model.onnx"
        bitpress.quantize(src, dest, algorithm=algorithm, precision=precision)
        out[algorithm] = dest
    return out


FIGURES = {"label", "path", "kind", "threads", "bytes", "load_s", "rss_after_load", "peak_rss", "prompt_tokens_per_s",
           "single_ms", "prompt_spread", "token_spread", "runs", "ratios"}


def test_bench_measures_every_model_alternately(models: dict[str, Path]) -> None:
    said: list[str] = []
    report = bench([models["float"], models["rtn"], models["hqq"]], labels=["float", "rtn", "hqq"], threads=[1, 2],
                   runs=3, warmup=1, prompt_tokens=16, progress=said.append)
    data = report.to_json()
    assert data["machine"]["cpu"] and isinstance(data["machine"]["flags"], list) and data["machine"]["versions"]
    assert data["options"]["runs"] == 3 and data["options"]["threads"] == [1, 2]
    assert data["references"] == {"onnx": "float"}
    rows = data["results"]
    assert [(r["label"], r["threads"]) for r in rows] == [(m, t) for t in (1, 2) for m in ("float", "rtn", "hqq")]
    for r in rows:
        assert set(r) >= FIGURES and "single_tokens_per_s" in r
        assert r["kind"] == "onnx" and r["runs"] == 3
        assert r["prompt_tokens_per_s"] > 0 and r["single_tokens_per_s"] > 0 and r["peak_rss"] > 0
        assert r["peak_rss"] >= r["rss_after_load"] > 0 and r["load_s"] > 0 and r["bytes"] > 0
        assert set(r["ratios"]) == {"prompt", "single", "bytes", "peak_rss"}
        if r["label"] == "float":
            assert r["ratios"] == {"prompt": 1.0, "single": 1.0, "bytes": 1.0, "peak_rss": 1.0}
    assert rows[1]["ratios"]["bytes"] < 0.5  # int4 is smaller
    # warm-up then measured rounds, per thread count; every model loaded once per thread count
    assert sum("loading" in s for s in said) == 6 and sum(s.startswith("round") for s in said) == 2 * 4
    text = "\n".join(lines(report))
    assert "2 threads:" in text and "ratio to float (onnx)" in text


def test_rounds_rotate_the_order(models: dict[str, Path]) -> None:
    """Each model runs first in some round: noise that grows or shrinks over the run falls on all of them."""
    subjects = runner.subjects_of([models["float"], models["rtn"], models["hqq"]], ["a", "b", "c"])
    raw = runner.run(subjects, runner.SpeedOptions(runs=3, warmup=0, prompt_tokens=8, single_seconds=0.01))
    orders = {label: r["order"] for label, r in raw[1].items()}
    assert orders == {"a": [0, 2, 1], "b": [1, 0, 2], "c": [2, 1, 0]}
    assert all(len(r["samples"]) == 3 for r in raw[1].values())


def test_profile_names_the_slowest_nodes_and_their_kernels(models: dict[str, Path]) -> None:
    report = bench([models["float"], models["hqq"]], labels=["float", "hqq"], runs=1, warmup=0, prompt_tokens=8,
                   profile_nodes=5)
    prof = report.profile["hqq"]
    assert prof["total_ms"] > 0 and prof["nodes"] and "MatMulNBits" in prof["ops"]
    shares = [n["share"] for n in prof["nodes"]]
    assert shares == sorted(shares, reverse=True) and abs(sum(shares) - 1) < 1e-6
    kernels = {n["kernel"] for n in prof["nodes"] if n["op"] == "MatMulNBits"}
    assert kernels <= {"packed, int8 compute", "packed, int8 compute + block-sum correction"} and kernels
    assert "where the time goes, hqq" in "\n".join(lines(report))


def test_profile_summary_takes_the_median_per_node(tmp_path: Path) -> None:
    events = [{"cat": "Session", "name": "model_loading_uri", "dur": 9_000_000}]
    for dur in (900_000, 100, 110, 120):  # the first call's one-off work does not count
        events.append({"cat": "Node", "name": "a_kernel_time", "dur": dur, "args": {"op_name": "MatMul"}})
        events.append({"cat": "Node", "name": "b_kernel_time", "dur": 300, "args": {"op_name": "Add"}})
        events.append({"cat": "Node", "name": "b_fence_before", "dur": 5, "args": {"op_name": "Add"}})
    path = tmp_path / "p" / "ort.json"
    path.parent.mkdir()
    path.write_text(json.dumps(events))
    out = slowest_nodes(str(path))
    assert [n["node"] for n in out["nodes"]] == ["b", "a"]
    assert out["nodes"][1]["ms"] == pytest.approx(0.115)
    assert out["total_ms"] == pytest.approx(0.415) and not path.exists()


def test_feeds_decode_one_token_after_a_cache() -> None:
    """A KV-cache decoder's one token follows a cache of the prompt's length: the mask covers both."""
    b, s, kv = "batch", "seq", "past"
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [b, s]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [b, "total"]),
              helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, [b, 2, kv, 8]),
              helper.make_tensor_value_info("past_key_values.0.value", TensorProto.FLOAT, [b, 2, kv, 8])]
    table = numpy_helper.from_array(np.zeros((50, 16), np.float32), "embed")
    graph = helper.make_graph([helper.make_node("Gather", ["embed", "input_ids"], ["h"])], "g", inputs,
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, [b, s, 16])], [table])
    feeds = speed_feeds(helper.make_model(graph), None, 12)
    one, prompt = feeds["single"], feeds["prompt"]
    assert one["input_ids"].shape == (1, 1) and one["attention_mask"].shape == (1, 13)
    assert one["past_key_values.0.key"].shape == (1, 2, 12, 8)
    assert prompt["input_ids"].shape == (1, 12) and prompt["past_key_values.0.value"].shape == (1, 2, 0, 8)
    assert int(one["input_ids"].max()) < 50


def test_bench_command_line(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", str(models["float"]), str(models["rtn"]), "--runs", "1", "--warmup", "0", "--prompt-tokens",
            "8", "--jobs", "1"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in data["results"]] == ["float", "rtn"]  # the folders' names
    assert main(argv) == 0
    assert "PROMPT tok/s" in capsys.readouterr().out


def test_bench_refuses_what_it_cannot_measure(models: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ModelLoadError, match="model not found"):
        bench([tmp_path / "missing.onnx"])
    with pytest.raises(UsageError, match="one label per model"):
        bench([models["float"]], labels=["a", "b"])
    with pytest.raises(UsageError, match="threads"):
        bench([models["float"]], threads=[0])
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    assert main(["bench", str(bad), "--runs", "1"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bitpress")]
    assert len(err) == 1 and err[0].startswith("bitpress: error: bench: bad.onnx: load failed")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", str(models["float"]), "--jobs", "x"])
    assert exit_.value.code == 2


def test_eval_reports_speed_and_kernels(models: dict[str, Path], tmp_path: Path) -> None:
    res = bitpress.evaluate(models["hqq"], models["float"], samples=1, seq_len=16, speed_runs=1)
    sp = res.speed
    assert sp is not None and sp["kind"] == "onnx" and sp["runs"] == 1 and sp["threads"] == 1
    assert sp["reference"]["ratios"]["single"] == 1.0 and sp["quantized"]["single_tokens_per_s"] > 0
    assert res.runtime is not None and not res.runtime["slow"]
    data = res.to_json()
    assert data["speed"]["ratios"] == sp["ratios"] and data["runtime"]["target"] == "cpu"
    line = summary_line(sp)
    assert line.startswith("one token") and "1 thread(s)" in line and sp["machine"]["cpu"] in line
    html = res.write_html(tmp_path / "r.html").read_text()
    assert "<h2>Speed</h2>" in html and "QUANTIZED / reference" in html and "block-sum correction" in html
    skipped = bitpress.evaluate(models["hqq"], models["float"], samples=1, seq_len=16, speed=False)
    assert skipped.speed is None
    assert "Not measured (--no-speed)" in skipped.write_html(tmp_path / "s.html").read_text()


def test_compare_falls_back_to_sessions(models: dict[str, Path], tmp_path: Path) -> None:
    """A package onnxruntime_genai cannot load (here: no context_length) is timed through its model in a
    session, and says so; a package against a .onnx file: both through sessions."""
    pkgs = []
    for name in ("float", "hqq"):
        pkg = tmp_path / name
        pkg.mkdir()
        shutil.copyfile(models[name], pkg / "model.onnx")
        (pkg / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "model.onnx"}}}))
        pkgs.append(pkg)
    out = compare(pkgs[1], pkgs[0], runs=1, prompt_tokens=8)
    assert out["kind"] == "onnx" and "onnxruntime_genai could not run the packages" in out["note"]
    assert out["quantized"]["path"].endswith("model.onnx")
    mixed = compare(pkgs[1], models["float"], runs=1, prompt_tokens=8)
    assert mixed["kind"] == "onnx" and "note" not in mixed


def test_sweep_rows_carry_speed(models: dict[str, Path], tmp_path: Path) -> None:
    from bitpress.sweep.report import pareto_rows

    config = {"models": [str(models["float"])], "passes": [{"type": "rtn", "precision": "int4"},
                                                           {"type": "hqq", "precision": "int4"}],
              "eval": {"samples": 1, "seq_len": 16, "speed_runs": 1}, "output": str(tmp_path / "sweep"), "jobs": 1}
    result = bitpress.sweep(config)
    rows = [json.loads(line) for line in (tmp_path / "sweep" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    for r in rows:
        m = r["metrics"]
        assert m["speedup"] > 0 and m["prompt_speedup"] > 0 and m["tokens_per_s"] > 0 and m["speed_machine"]
    front = pareto_rows(rows, "speedup", "relative_error")
    assert front and all(ids for ids in front.values())
    html = (tmp_path / "sweep" / "report.html").read_text()
    assert "Speed / error trade-off" in html and "speed vs the input model" in html
    assert result.rows


def test_sweep_eval_speed_is_checked(models: dict[str, Path], tmp_path: Path) -> None:
    from bitpress.errors import ConfigError

    config = {"models": [str(models["float"])], "passes": [{"type": "rtn", "precision": "int4"}],
              "eval": {"speed": "yes"}, "output": str(tmp_path / "sweep")}
    with pytest.raises(ConfigError, match=r"eval\.speed: expected true or false"):
        bitpress.sweep(config)


def test_speed_options_are_checked() -> None:
    for bad in ({"runs": 0}, {"prompt_tokens": 0}, {"warmup": -1}):
        with pytest.raises(UsageError):
            runner.SpeedOptions(**bad).validate()


def test_onnx_model_of_a_folder(models: dict[str, Path]) -> None:
    subjects = runner.subjects_of([models["rtn"].parent])
    assert subjects[0].kind == "onnx" and subjects[0].model_file == models["rtn"]
    assert subjects[0].label == "rtn"
    g = onnx.load(str(models["rtn"]), load_external_data=False)
    assert g.graph.node


def test_a_package_named_relative_to_the_working_folder(genai_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bitpress bench pkg --profile` run beside the package: its files are found once, not under pkg/pkg/."""
    from bitpress.genai.package import read_genai_config, resolve_model
    from bitpress.models.hf_files import read_json

    monkeypatch.chdir(genai_folder.parent)
    rel = Path(genai_folder.name)
    assert read_genai_config(rel) is not None
    assert resolve_model(rel, "benchmarked").path.resolve() == (genai_folder / "model.onnx").resolve()
    assert runner.subjects_of([rel])[0].model_file.resolve() == (genai_folder / "model.onnx").resolve()
    assert read_json(rel, "genai_config.json")["model"]
