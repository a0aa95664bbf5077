"""``--plan`` (dry run), per-weight run reports, no-match warnings and the run report's figures."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import bitpress
from bitpress import cli
from bitpress.passes import Pass
from bitpress.synthetic import build_decoder
from bitpress.workflow.config import PassStep, Workflow
from bitpress.workflow.plan import plan_quantize, plan_workflow

EMBED = "model.embed_tokens.weight"
UP = "/model/layers.0/mlp/up_proj/MatMul"


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_decoder(tmp_path_factory.mktemp("tied") / "model.onnx", hidden=64, layers=1, vocab=256, tied=True)


def cli_run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def test_plan_shows_the_tie_as_one_entry_and_skips_and_writes_nothing(tied, tmp_path, capsys):
    before = listing(tied.parent)
    out = tmp_path / "out"
    code, stdout, stderr = cli_run(capsys, "quantize", "-m", tied, "-o", out, "--algorithm", "rtn", "--precision",
                                   "int4", "--option", "block_size=32", "--option", f'nodes_to_exclude=["{UP}"]',
                                   "--plan", "--json")
    assert code == 0, stderr
    (entry,) = json.loads(stdout)
    assert entry["has_plan"] and entry["planned"] and entry["pass"] == "rtn"
    rows = {r["weight"]: r for r in entry["weights"]}
    tie = rows[EMBED]
    assert tie["tied"] and tie["quantized"] and tie["bits"] == 4 and tie["block_size"] == 32
    assert sorted(op.split()[0] for op in tie["ops"]) == ["Gather", "MatMul"]  # both uses, one entry
    assert [r["weight"] for r in entry["weights"]].count(EMBED) == 1
    up = rows["model.layers.0.mlp.up_proj.weight"]
    assert not up["quantized"] and "nodes_to_exclude" in up["reason"] and up["bits"] is None
    assert entry["quantized"] == 7 and entry["expected_bits_per_weight"] == pytest.approx(5.0)  # 4 + fp32 scale / 32
    assert not out.exists() and not tmp_path.joinpath("out").exists() and listing(tmp_path) == set()
    assert listing(tied.parent) == before

    code, text, _ = cli_run(capsys, "quantize", "-m", tied, "-o", out, "--algorithm", "rtn", "--precision", "int4",
                            "--option", f'nodes_to_exclude=["{UP}"]', "--plan")
    assert code == 0 and "would quantize 7 weights" in text and "nothing was written" in text
    line = next(x for x in text.splitlines() if x.strip().startswith(EMBED))
    assert "(tied)" in line and "Gather /model/embed_tokens/Gather + MatMul /lm_head/MatMul" in line
    assert "excluded by nodes_to_exclude" in next(x for x in text.splitlines() if "up_proj" in x)
    assert not out.exists()


@pytest.mark.parametrize(("algorithm", "precision"),
                         [("rtn", "int4"), ("rtn", "int8"), ("hqq", "int4"), ("kquant", "int4"), ("q4_k_m", "int4"),
                          ("nf4", "nf4")])
def test_the_plan_is_what_the_run_does(tied, tmp_path, algorithm, precision):
    planned = plan_quantize(tied, algorithm=algorithm, precision=precision).steps[0].report
    result = bitpress.quantize(tied, tmp_path / "q.onnx", algorithm=algorithm, precision=precision)
    done = result.reports[0][2]
    key = [(r.weight, r.quantized, r.bits, r.block_size, r.symmetric, r.zero_points) for r in planned.rows]
    assert key == [(r.weight, r.quantized, r.bits, r.block_size, r.symmetric, r.zero_points) for r in done.rows]
    assert planned.planned_groups == done.quantized > 0
    # the plan's cost is exactly what the writers stored
    assert planned.planned_bytes == done.stored_bytes
    assert done.bits_per_weight == pytest.approx(planned.expected_bits_per_weight)
    assert all(r.error is not None for r in done.rows if r.quantized)
    payload = result.to_json()["reports"][0]
    assert payload["bits_per_weight"] > 0 and len(payload["weights"]) == len(done.rows)
    assert {w["weight"] for w in payload["weights"] if w["quantized"]} == set(done.errors)


def test_bnb4_reports_its_bits_per_weight(tied, tmp_path):
    result = bitpress.quantize(tied, tmp_path / "b.onnx", algorithm="nf4", precision="nf4",
                               options={"block_size": 64})
    rep = result.reports[0][2]
    assert rep.quantized == 7
    assert rep.bits_per_weight == pytest.approx(4 + 32 / 64)  # 4-bit codes + a float32 absmax per 64
    assert "4.50 bits per weight" in rep.summary()
    assert 0 < max(rep.errors.values()) < 0.2
    # the reason names the reader that keeps the tied table float (MatMulBnb4 has no Gather form)
    assert rep.skipped[EMBED].startswith("also read by Gather ")
    assert "which this pass does not quantize (op_types: MatMul)" in rep.skipped[EMBED]


def test_q4_k_m_plan_says_why_the_tied_table_gets_8_bits(tied):
    rep = plan_quantize(tied, algorithm="q4_k_m", precision="int4").steps[0].report
    rows = {r.weight: r for r in rep.rows}
    assert rows[EMBED].bits == 8 and rows[EMBED].tied and "llama.cpp's output tensor" in rows[EMBED].note
    assert rows["model.layers.0.self_attn.q_proj.weight"].bits == 4
    # the cost is stated before the run: above the int4 label because of the widened tensors
    assert rep.expected_bits_per_weight > 6.5 and "bits per weight" in rep.summary()


class _NotWeightOnly(Pass):
    name = "opaque"
    precisions = ("int8",)

    def run(self, model, context):  # pragma: no cover - never run by --plan
        raise AssertionError("--plan must not run a pass")


def test_a_pass_without_a_plan_says_so(tied, tmp_path):
    wf = Workflow(input=tied, output=tmp_path / "o.onnx", steps=[PassStep(_NotWeightOnly(), "passes[0]")])
    (step,) = plan_workflow(wf).steps
    assert step.report is None and "opaque has no plan" in step.reason
    assert step.to_json()["has_plan"] is False
    assert not (tmp_path / "o.onnx").exists()


def test_run_plan_with_a_config(tied, tmp_path, capsys):
    config = tmp_path / "wf.json"
    config.write_text(json.dumps({"input": str(tied), "output": str(tmp_path / "out"),
                                  "passes": [{"type": "kquant", "precision": "int4"}, {"type": "rtn", "bits": 8}]}))
    code, stdout, stderr = cli_run(capsys, "run", config, "--plan", "--json")
    assert code == 0, stderr
    first, second = json.loads(stdout)
    assert first["pass"] == "kquant" and second["pass"] == "rtn" and second["notes"]
    assert not (tmp_path / "out").exists()


# -- patterns that match nothing, passes that quantize nothing -------------------------------------------
def test_patterns_matching_nothing_are_warnings(tied, tmp_path, caplog):
    options = {"nodes_to_exclude": ["/lm_head/Matmul"], "overrides": {"re:.*down_prj.*": {"bits": 8}}}
    with caplog.at_level(logging.WARNING, logger="bitpress"):
        result = bitpress.quantize(tied, tmp_path / "q.onnx", algorithm="rtn", precision="int4", options=options)
    text = caplog.text
    assert "nodes_to_exclude pattern '/lm_head/Matmul' matches no" in text
    assert "overrides pattern 're:.*down_prj.*' matches no" in text
    rep = result.reports[0][2]
    assert rep.quantized == 8 and len(rep.unmatched) == 2 and "matched nothing" in rep.summary()


def test_a_pass_that_quantizes_nothing_says_so(tied, tmp_path, capsys):
    code, stdout, stderr = cli_run(capsys, "quantize", "-m", tied, "-o", tmp_path / "q.onnx", "--algorithm", "rtn",
                                   "--precision", "int4", "--option", 'nodes_to_include=["/model/nope/*"]')
    assert code == 0, stderr
    assert "nodes_to_include pattern '/model/nope/*' matches no" in stderr
    assert "quantized no weights" in stdout
    assert stdout.strip().splitlines()[-1].startswith("warning: rtn quantized no weights of model.onnx")


def test_show_weights_prints_the_measured_table(tied, tmp_path, capsys):
    code, stdout, _ = cli_run(capsys, "quantize", "-m", tied, "-o", tmp_path / "q.onnx", "--algorithm", "rtn",
                              "--precision", "int4", "--show-weights")
    assert code == 0
    header = next(x for x in stdout.splitlines() if "WEIGHT" in x)
    assert "ERROR" in header and "BITS/W" in header
    assert EMBED in stdout and "(tied)" in stdout


# -- sizes and the checker -------------------------------------------------------------------------------
def test_folder_outputs_report_model_bytes_apart_from_companion_files(genai_folder, tmp_path, capsys):
    result = bitpress.quantize(genai_folder, tmp_path / "out", algorithm="rtn", precision="int4")
    companions = sum(f.stat().st_size for f in (tmp_path / "out").iterdir() if not f.name.startswith("model.onnx"))
    assert result.companion_bytes == companions > 0
    assert result.output_model_bytes + result.companion_bytes == result.output_bytes
    model_in = sum(f.stat().st_size for f in genai_folder.iterdir() if f.name.startswith("model.onnx"))
    assert result.input_model_bytes == model_in
    assert result.ratio == pytest.approx(model_in / result.output_model_bytes)
    assert result.ratio > result.input_bytes / result.output_bytes
    js = result.to_json()
    assert js["companion_bytes"] == companions and js["output_model_bytes"] == result.output_model_bytes
    code, stdout, _ = cli_run(capsys, "quantize", "-m", genai_folder, "-o", tmp_path / "again", "--algorithm", "rtn",
                              "--precision", "int4")
    assert code == 0 and "of companion files" in stdout and f"{result.ratio:.2f}x smaller" in stdout


def _ort_only_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")
    scale = numpy_helper.from_array(np.ones(64, np.float32), "scale")
    nodes = [
        helper.make_node("SimplifiedLayerNormalization", ["x", "scale"], ["n"], name="norm", axis=-1, epsilon=1e-5),
        helper.make_node("MatMul", ["n", "w"], ["y"], name="/proj/MatMul"),
    ]
    g = helper.make_graph(nodes, "ort_only", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w, scale])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_checker_failure_shared_with_the_input_is_in_the_report(tmp_path, capsys):
    src = _ort_only_model(tmp_path / "m.onnx")
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(str(src))
    result = bitpress.quantize(src, tmp_path / "q.onnx", algorithm="rtn", precision="int4",
                               options={"block_size": 32})
    (note,) = result.notes
    assert "onnx.checker.check_model fails" in note and "ONNX Runtime loads it" in note
    assert result.to_json()["notes"] == [note]
    code, stdout, _ = cli_run(capsys, "quantize", "-m", src, "-o", tmp_path / "q2.onnx", "--algorithm", "rtn",
                              "--precision", "int4", "--option", "block_size=32")
    assert code == 0 and "note: q2.onnx: onnx.checker.check_model fails" in stdout
    clean = bitpress.quantize(build_decoder(tmp_path / "d.onnx", hidden=64, layers=1, vocab=256), tmp_path / "d4.onnx",
                              algorithm="rtn", precision="int4")
    assert clean.notes == []
