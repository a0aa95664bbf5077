"""``bitpress sweep``: models x passes x grid points, run in parallel (threads or Ray), resumable,
with the size / error Pareto front in a self-contained report."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

import bitpress
from bitpress import synthetic
from bitpress.cli import main
from bitpress.errors import ConfigError, OptionError, PassNotFoundError
from bitpress.sweep.config import job_id, load_sweep_config, parse_sweep
from bitpress.sweep.report import pareto_ids
from bitpress.sweep.runner import ResultStore
from bitpress.testing import default_signals

# tiny models: every job quantizes and evaluates in well under a second (a child process adds ~1 s)
MODEL = {"hidden": 64, "layers": 1, "heads": 4, "vocab": 256}
EVAL = {"samples": 2, "seq_len": 16, "speed_runs": 1}
# hqq on numpy: no torch import (seconds) in every job's process
PASSES = ["rtn", {"type": "hqq", "options": {"device": "numpy"}}, "kquant"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with two different tiny decoders: a/model.onnx (one file), b/model.onnx (+ external data)."""
    root = tmp_path_factory.mktemp("sweep_models")
    synthetic.build_decoder(root / "a" / "model.onnx", seed=1, **MODEL)
    synthetic.build_decoder(root / "b" / "model.onnx", seed=2, external_data=True, **MODEL)
    return root


def write_config(folder: Path, **config: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main_config(models: Path, output: str = "out") -> dict[str, Any]:
    """2 models x 3 algorithms x 2 block sizes: 12 jobs."""
    return {"models": [str(models / "a" / "model.onnx"), str(models / "b" / "model.onnx")], "passes": PASSES,
            "grid": {"block_size": [32, 64]}, "eval": EVAL, "threads": 1, "output": output}


def read_rows(out: Path) -> list[dict[str, Any]]:
    lines = (out / "results.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


#: metrics that are timings (the output's speed against its input): they differ from run to run
SPEED_METRICS = {"speedup", "prompt_speedup", "tokens_per_s", "prompt_tokens_per_s", "peak_rss", "speed_machine"}


def without_timings(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for r in rows:
        row = {k: v for k, v in r.items() if k != "seconds"}
        if row.get("metrics"):
            row["metrics"] = {k: v for k, v in row["metrics"].items() if k not in SPEED_METRICS}
        out[r["id"]] = row
    return out


def svg_points(report: Path) -> list[ET.Element]:
    text = report.read_text()
    assert "<script" not in text and "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    svg = re.search(r"<svg.*?</svg>", text, re.S)
    assert svg is not None, "the report has no chart"
    root = ET.fromstring(svg.group(0))
    return [g for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "point"]


def tree(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted((out / "runs").rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def threads_run(models: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("sweep_threads")
    cfg = write_config(folder, **main_config(models))
    result = bitpress.sweep(cfg, jobs=2)
    return folder / "out", result


# -- the sweep itself ------------------------------------------------------------------------------
def test_twelve_jobs_rows_outputs_and_report(threads_run: tuple[Path, Any]) -> None:
    out, result = threads_run
    rows = read_rows(out)
    assert len(rows) == 12 and len({r["id"] for r in rows}) == 12
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    assert result.ran == 12 and result.skipped == 0 and not result.failed
    assert {(r["pass"], r["options"]["block_size"]) for r in rows} == {
        (p, b) for p in ("rtn", "hqq", "kquant") for b in (32, 64)}
    for r in rows:
        assert (out / r["output"]).is_file() and r["output"] == f"runs/{r['id']}/model.onnx"
        assert r["output_bytes"] > 0 and 4 < r["bits_per_weight"] < 8
        assert 0 < r["metrics"]["relative_error"] < 1 and r["metrics"]["sqnr_median_db"] > 10
    assert len([p for p in (out / "runs").iterdir() if not p.name.startswith(".")]) == 12
    # larger blocks: fewer scales, smaller outputs
    by = {(r["model"], r["pass"], r["options"]["block_size"]): r for r in rows}
    assert all(by[(m, p, 64)]["output_bytes"] < by[(m, p, 32)]["output_bytes"] for m, p, _ in by)

    points = svg_points(out / "report.html")
    assert len(points) == 12
    labels = {g.get("data-id"): g.find("{http://www.w3.org/2000/svg}text").text for g in points}
    for r in rows:
        name = "a/model.onnx" if "/a/" in r["model"] else "b/model.onnx"
        assert labels[r["id"]] == f"{r['pass']} block_size={r['options']['block_size']} · {name}"
    # the front: per model, no point on it is dominated, and every point off it is
    for model in {r["model"] for r in rows}:
        pts = [(g.get("data-id"), float(g.get("data-x")), float(g.get("data-y")), g.get("data-pareto") == "true")
               for g in points if g.get("data-model") == model]
        assert len(pts) == 6
        front = {pid for pid, *_, on in pts if on}
        assert front and front == pareto_ids([(pid, x, y) for pid, x, y, _ in pts])
        for pid, x, y, on in pts:
            dominated = any(ox <= x and oy <= y and (ox < x or oy < y) for oid, ox, oy, _ in pts if oid != pid)
            assert dominated != on, pid
        assert {r["id"] for r in result.pareto["a/model.onnx" if "/a/" in model else "b/model.onnx"]} == front
    html = (out / "report.html").read_text()
    size_chart = html.split("<h2>Speed / error trade-off</h2>")[0]
    assert html.count("<tr class=") == 12 and size_chart.count("<polyline") == 2
    # the second chart: speed against the input model, faster is better
    speed_chart = html.split("<h2>Speed / error trade-off</h2>")[1].split("</svg>")[0]
    assert speed_chart.count('class="point"') == 12 and "faster and more accurate" in speed_chart


def test_ray_rows_and_outputs_equal_the_threads_run(threads_run: tuple[Path, Any], models: Path,
                                                    tmp_path: Path) -> None:
    pytest.importorskip("ray")
    pytest.importorskip("bitpress.executors")
    out, _ = threads_run
    cfg = write_config(tmp_path, **main_config(models))
    # through the CLI, in a process of its own: a local Ray runtime started and stopped by the sweep,
    # and a stuck runtime is a failure here, not a hung test session
    try:
        done = subprocess.run([sys.executable, "-m", "bitpress", "sweep", str(cfg), "--executor", "ray", "--jobs", "2"],
                              capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the Ray sweep did not finish in 240 s: {exc.stderr!r}")
    assert done.returncode == 0, done.stderr
    assert "12 job(s): 12 run, 0 skipped (done before), 0 failed" in done.stdout
    assert without_timings(read_rows(tmp_path / "out")) == without_timings(read_rows(out))
    assert tree(tmp_path / "out") == tree(out)  # byte-identical outputs
    assert len(svg_points(tmp_path / "out" / "report.html")) == 12


def test_perplexity_with_a_text(models: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models

    tok = Tokenizer(tok_models.WordLevel({"<unk>": 0, **{f"w{i}": i for i in range(1, 200)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "data").mkdir()
    tok.save(str(tmp_path / "data" / "tokenizer.json"))
    (tmp_path / "data" / "text.txt").write_text(" ".join(f"w{(i * 7) % 199 + 1}" for i in range(400)))
    cfg = write_config(tmp_path, models=[str(models / "a" / "model.onnx")], passes=["rtn"],
                       grid={"block_size": [16, 64]}, output="out",
                       eval={"text": "data/text.txt", "tokenizer": "data/tokenizer.json", "windows": 4, "seq_len": 32})
    result = bitpress.sweep(cfg, jobs=2)
    assert result.metric == "perplexity_change" and not result.failed
    for r in result.rows:
        m = r["metrics"]
        assert m["perplexity"] > 1 and m["reference_perplexity"] > 1
        assert m["perplexity_change"] == pytest.approx(m["perplexity"] / m["reference_perplexity"] - 1)
    assert "perplexity change" in (tmp_path / "out" / "report.html").read_text()


def test_gptq_without_data_calibrates_on_the_models_own_text(tmp_path: Path) -> None:
    """As in a run: gptq in a sweep without data calibrates on the model's own text (each job the same seeded
    windows); a pass that cannot use own text still needs data (test_validation_errors_are_one_line)."""
    from test_calibration_text import build_gqa_decoder, write_tokenizer

    folder = tmp_path / "gqa"
    build_gqa_decoder(folder)
    write_tokenizer(folder)
    cfg = write_config(tmp_path, models=[str(folder)], passes=["gptq"], grid={"block_size": [16, 32]}, output="out")
    result = bitpress.sweep(cfg, jobs=1)
    assert not result.failed and len(result.rows) == 2, result.failed


# -- resume ----------------------------------------------------------------------------------------
def _job_processes(out: Path) -> list[int]:
    """The job processes (python -m bitpress.sweep.job) still running for the sweep in ``out``."""
    proc = Path("/proc")
    found = []
    for entry in proc.iterdir() if proc.is_dir() else []:
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "bitpress.sweep.job" in cmd and str(out) in cmd:
            found.append(int(entry.name))
    return found


def _wait(cond: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_interrupted_sweep_resumes(models: Path, tmp_path: Path, sig: signal.Signals) -> None:
    cfg = write_config(tmp_path, models=[str(models / "a" / "model.onnx")], passes=["rtn", "kquant"],
                       grid={"block_size": [16, 32, 64]}, eval=EVAL, output="out", threads=1)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "bitpress", "sweep", str(cfg), "--jobs", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_signals)
    results = out / "results.jsonl"
    try:
        _wait(lambda: results.is_file() and results.read_bytes().count(b"\n") >= 1, 120, "the first row")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL), err
    if sig == signal.SIGINT:
        assert b"interrupted by SIGINT; the rows of the " in err
    _wait(lambda: not _job_processes(out), 30, "the jobs to stop")  # a killed sweep's jobs see it and stop
    raw = results.read_bytes()
    assert raw.endswith(b"\n")  # whole lines only
    done = [json.loads(line) for line in raw.splitlines()]
    assert 1 <= len(done) < 6 and all(r["status"] == "ok" for r in done)
    # no half-written output: every run folder is a complete output (the workflow moves it into
    # place whole); after SIGINT, only those of the rows. A job of a SIGKILLed sweep may finish
    # before it sees that the sweep is gone: a complete output without a row, which the rerun redoes.
    finished = {p.name for p in (out / "runs").iterdir() if not p.name.startswith(".")}
    for name in finished:
        assert (out / "runs" / name / "model.onnx").is_file()
    if sig == signal.SIGINT:
        assert finished == {r["id"] for r in done}
    for r in done:
        assert (out / r["output"]).is_file()

    again = bitpress.sweep(cfg, jobs=2)
    assert again.skipped == len(done) and again.ran == 6 - len(done) and not again.failed
    rows = read_rows(out)
    assert len(rows) == 6 and len({r["id"] for r in rows}) == 6
    assert not [p for p in (out / "runs").iterdir() if p.name.startswith(".")]
    if sig == signal.SIGINT:  # --fresh reruns everything, and starts a new results.jsonl
        assert main(["sweep", str(cfg), "--fresh", "--jobs", "2"]) == 0
        assert len(read_rows(out)) == 6
        assert main(["sweep", str(cfg)]) == 0  # all done: nothing runs
        assert len(read_rows(out)) == 6


def test_partial_last_line_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"id": "a", "status": "ok"}) + "\n" + '{"id": "b", "sta')
    store = ResultStore(path)
    assert list(store.load()) == ["a"]
    assert path.read_text().endswith("}\n")
    store.append({"id": "b", "status": "failed"})
    store.close()
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "b"]


# -- failures --------------------------------------------------------------------------------------
def test_a_failing_job_is_recorded_and_the_sweep_goes_on(models: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken" / "model.onnx"
    broken.parent.mkdir()
    broken.write_bytes(b"not an onnx model")
    cfg = write_config(tmp_path, models=[str(broken), str(models / "a" / "model.onnx")], passes=["rtn"],
                       eval=EVAL, output="out")
    assert main(["sweep", str(cfg), "--jobs", "2"]) == 1
    captured = capsys.readouterr()
    rows = {Path(r["model"]).parent.name: r for r in read_rows(tmp_path / "out")}
    assert rows["a"]["status"] == "ok"
    assert rows["broken"]["status"] == "failed" and rows["broken"]["output"] is None
    assert rows["broken"]["error"].startswith("quantize: ") and "\n" not in rows["broken"]["error"]
    assert "2 job(s): 2 run, 0 skipped (done before), 1 failed" in captured.out
    assert captured.err.count("bitpress: error:") == 1 and "1 of 2 job(s) failed" in captured.err
    assert not (tmp_path / "out" / "runs" / rows["broken"]["id"]).exists()
    # a rerun retries the failed job only
    again = bitpress.sweep(cfg)
    assert again.skipped == 1 and again.ran == 1 and len(again.failed) == 1


@pytest.mark.parametrize("change, message", [
    ({"modles": ["a/model.onnx"]}, r"unknown key modles \(did you mean models\?\)"),
    ({"passes": ["rtn", "nosuchpass"]}, r"passes\[1\]\.type: unknown pass 'nosuchpass'"),
    ({"grid": {"block_size": 32}}, r"grid\.block_size: expected a list of values"),
    ({"passes": [{"type": "rtn", "grid": {"block_size": "32"}}]}, r"passes\[0\]\.grid\.block_size: expected a list"),
    ({"models": ["a/model.onnx", "missing/model.onnx"]}, r"models\[1\]: .*missing/model\.onnx does not exist"),
    ({"passes": [{"type": "rtn", "grid": {"block_size": [32, 24]}}]},
     r"passes\[0\] grid point block_size=24: rtn: block_size must be a power of two"),
    ({"passes": [{"type": "rtn", "grid": {"blocksize": [32]}}]},
     r"rtn has no option blocksize \(did you mean block_size"),
    ({"passes": [{"type": "rtn", "block_size": 32}]}, r"unknown key 'block_size'.*options: \{block_size: \.\.\.\}"),
    ({"grid": {"nstep": [10]}, "passes": ["rtn"]}, r"grid\.nstep: no pass of the sweep has an option nstep"),
    ({"eval": {"text": "no.txt"}}, r"eval\.text: .*no\.txt does not exist"),
    ({"passes": ["ort_static"]}, r"passes\[0\]: pass ort_static needs calibration data"),
])
def test_validation_errors_are_one_line(models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        change: dict[str, Any], message: str) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model.onnx").write_bytes((models / "a" / "model.onnx").read_bytes())
    config = {"models": ["a/model.onnx"], "passes": ["rtn"], "grid": {"block_size": [32, 64]}, "output": "out",
              **change}
    cfg = write_config(tmp_path, **config)
    assert main(["sweep", str(cfg)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bitpress: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was created


def test_validation_errors_from_python(models: Path) -> None:
    base = {"models": [str(models / "a" / "model.onnx")], "output": "unused"}
    with pytest.raises(PassNotFoundError):
        parse_sweep({**base, "passes": ["nope"]})
    with pytest.raises(OptionError, match="fix the value in the config"):
        parse_sweep({**base, "passes": [{"type": "rtn", "grid": {"bits": [4, 3]}}]})
    with pytest.raises(ConfigError, match="both a fixed option and in the grid"):
        parse_sweep({**base, "passes": [{"type": "rtn", "options": {"bits": 4}, "grid": {"bits": [4, 8]}}]})
    with pytest.raises(ConfigError, match="needs an output folder"):
        bitpress.sweep({**base, "passes": ["rtn"], "output": None})


# -- the plan --------------------------------------------------------------------------------------
def test_grids_and_ids(models: Path, tmp_path: Path) -> None:
    a = str(models / "a" / "model.onnx")
    cfg = parse_sweep({
        "models": [a], "output": "out",
        "passes": ["rtn", {"type": "kquant", "grid": {"nstep": [10, 20]}},
                   {"type": "hqq", "options": {"block_size": 128}}],
        "grid": {"block_size": [32, 64], "precision": ["int4", "int8"]},
    })
    counts: dict[str, int] = {}
    for job in cfg.jobs:
        counts[job.pass_name] = counts.get(job.pass_name, 0) + 1
    # rtn: 2 block sizes x 2 precisions; kquant: x 2 nsteps; hqq: its fixed block size x 2 precisions
    assert counts == {"rtn": 4, "kquant": 8, "hqq": 2}
    assert all(j.options["block_size"] == 128 for j in cfg.jobs if j.pass_name == "hqq")
    int8 = next(j for j in cfg.jobs if j.pass_name == "rtn" and j.precision == "int8")
    assert int8.label() == f"rtn block_size={int8.options['block_size']} precision=int8"
    # stable: the same combination, whichever way it is written, is the same id
    assert int8.id == job_id(a, "rtn", "int8", dict(reversed(list(int8.options.items()))))
    again = parse_sweep({"models": [a], "passes": [{"type": "RTN", "precision": "INT8",
                                                    "options": {"block_size": int8.options["block_size"]}}]})
    assert again.jobs[0].id == int8.id
    # a file config: models relative to its folder
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.onnx").write_bytes(Path(a).read_bytes())
    path = write_config(tmp_path, models=["m/model.onnx"], passes=["rtn"], output="out")
    loaded = parse_sweep(load_sweep_config(path))
    assert loaded.models == [(tmp_path / "m" / "model.onnx").resolve()] and loaded.output == tmp_path / "out"
    with pytest.raises(ConfigError, match="listed twice"):
        parse_sweep({"models": [a, a], "passes": ["rtn"]})


def test_pareto_front() -> None:
    pts = [("a", 4.0, 0.3), ("b", 5.0, 0.2), ("c", 5.0, 0.25), ("d", 6.0, 0.2), ("e", 3.0, 0.5), ("f", 3.0, 0.5)]
    assert pareto_ids(pts) == {"a", "b", "e", "f"}  # c and d are dominated by b; e and f tie


def test_sweep_is_in_the_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    out = capsys.readouterr().out
    assert "--executor" in out and "--fresh" in out and "--address" in out
    assert "docs/sweep.md" in out


# -- the GenAI export matrix (publish:) ------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Hugging Face Llama folder with a real (WordLevel) tokenizer: what the GenAI builder needs."""
    pytest.importorskip("onnxruntime_genai.models.builder")
    pytest.importorskip("transformers")
    from bitpress.hf.tiny import build_tiny

    # weights ~ N(0, 0.1): large enough that rounding differences show in the logits
    return build_tiny("llama", tmp_path_factory.mktemp("sweep_hf") / "llama", seed=3)


MATRIX = {"dtypes": ["f32"], "eps": ["cpu"],
          "variants": {"int4-rtn": [{"type": "rtn_hf", "bits": 4, "group_size": 32, "sym": False}]}}


def test_publish_matrix_cells_are_jobs_evaluated_reported_and_resumed(hf_model: Path, tmp_path: Path) -> None:
    """A 2-cell matrix (f32 and an int4 variant, on cpu): one job, folder and row each, perplexity against the
    f32 cell, in the report; a rerun skips both."""
    import numpy as np

    rng = np.random.default_rng(0)
    (tmp_path / "corpus.txt").write_text(" ".join(f"t{i}" for i in rng.integers(4, 256, 200)))
    cfg = write_config(tmp_path, models=[str(hf_model)], output="out", publish={"matrix": MATRIX},
                       eval={"text": "corpus.txt", "windows": 2, "seq_len": 16})
    parsed = parse_sweep(load_sweep_config(cfg))
    assert [j.label() for j in parsed.jobs] == ["publish f32/cpu", "publish int4-rtn/cpu"]
    assert len({j.id for j in parsed.jobs}) == 2
    result = bitpress.sweep(cfg, jobs=2)
    assert result.ran == 2 and not result.failed, [r["error"] for r in result.rows]
    rows = {r["label"]: r for r in result.rows}
    f32, q4 = rows["publish f32/cpu"], rows["publish int4-rtn/cpu"]
    out = tmp_path / "out"
    for row in (f32, q4):
        assert row["pass"] == "publish" and row["output"] == f"runs/{row['id']}"
        pkg = out / row["output"]
        assert (pkg / "genai_config.json").is_file() and (pkg / "tokenizer.json").is_file()
        assert row["output_bytes"] > row["model_bytes"] > 0
        assert row["metrics"]["reference"] == "f32/cpu" and row["metrics"]["windows"] == 2
    assert f32["point"] == {"dtype": "f32", "ep": "cpu", "variant": None} and f32["bits_per_weight"] == 32.0
    assert f32["metrics"]["perplexity_change"] == 0.0
    assert q4["point"]["variant"] == "int4-rtn" and 4.0 < q4["bits_per_weight"] < 6.0
    assert q4["metrics"]["perplexity_change"] != 0.0 and q4["metrics"]["perplexity"] > 0
    assert q4["model_bytes"] < f32["model_bytes"]
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2
    html = (out / "report.html").read_text()
    assert "publish f32/cpu" in html and "publish int4-rtn/cpu" in html and "variant=int4-rtn" in html
    assert not [p for p in (out / "runs").iterdir() if p.name.startswith(".")]  # no scratch left
    again = bitpress.sweep(cfg, jobs=2)
    assert again.ran == 0 and again.skipped == 2
    assert (out / "results.jsonl").read_text().splitlines() == lines


def test_publish_entry_is_validated_up_front(hf_model: Path, models: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    onnx = str(models / "a" / "model.onnx")
    hf = str(hf_model)
    cases = [
        ({"models": [onnx], "publish": {"matrix": MATRIX}}, "ONNX models"),
        ({"models": [hf], "publish": {"matrix": MATRIX, "extra": 1}}, "publish: unknown key extra"),
        ({"models": [hf], "publish": {"matrix": {**MATRIX, "eval": {"text": "x"}}}}, "publish.matrix.eval"),
        ({"models": [hf], "publish": {"matrix": {**MATRIX, "colour": 1}}}, "publish.matrix: unknown key"),
        ({"models": [hf], "publish": {"matrix": {"eps": ["cpu"]}}}, "the matrix has no cells"),
        ({"models": [hf], "publish": {"matrix": MATRIX, "reference": "f16/cpu"}}, "not a cell of the matrix"),
        ({"models": [hf], "publish": {"matrix": {**MATRIX, "genai": {"dtype": "f16"}}}}, "publish.matrix.genai"),
        ({"models": [hf], "publish": {"matrix": {"variants": {"q": [{"type": "nope_hf"}]}}}},
         "publish.matrix.variants.q"),
        ({"models": [hf], "publish": []}, "publish: expected a mapping"),
    ]
    for config, message in cases:
        with pytest.raises(ConfigError if "nope" not in str(config) else PassNotFoundError, match=message):
            parse_sweep(config)
    path = write_config(tmp_path, models=[onnx], publish={"matrix": MATRIX}, output="out")
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("bitpress: error:") == 1 and "Hugging Face" in err and not (tmp_path / "out").exists()
