"""Architectures beyond Llama through hf_to_genai: every package checked against transformers, or refused
before the build (the small matrix; ``make -C bench architectures`` runs every type -> docs/architectures.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

pytest.importorskip("onnxruntime_genai.models.builder")
pytest.importorskip("mobius")

import bitpress
from bitpress.errors import ExportError
from bitpress.hf.tiny import build_tiny


def _export(src: Path, out: Path, **step: Any) -> Path:
    bitpress.run({"input": str(src), "output": str(out), "passes": [{"type": "hf_to_genai", **step}]})
    (pkg,) = out.iterdir()  # named after the model (the folder one level down when src is what quantize wrote)
    return pkg


def _made(pkg: Path) -> dict[str, Any]:
    return json.loads((pkg / "bitpress-manifest.json").read_text())["made"]


def _within(check: dict[str, Any]) -> bool:
    return check["max_abs"] <= check["tolerance"] * max(check["largest_logit"], 1.0)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma-3: a sliding (window 32) and a full-attention layer with thetas 1e4 / 1e6, and Gemma's
    query_pre_attn_scalar (256) unlike head_dim (16): each shows in the logits when an exporter misses it."""
    return build_tiny("gemma3_text", tmp_path_factory.mktemp("arch") / "gemma3")


@pytest.fixture(scope="module")
def gemma3_packages(gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3-pkg")
    return {e: _export(gemma3, root / e, exporter=e) for e in ("builder", "mobius")}


@pytest.mark.parametrize("exporter", ["builder", "mobius"])
def test_gemma3_packages_equal_transformers_past_the_window(gemma3_packages: dict[str, Path], exporter: str) -> None:
    """The builder (given the rope parameters transformers 5 keeps per layer type) and mobius (its attention
    corrected: each layer type's rope, the window, Gemma's scale) both build Gemma-3 right: logits at float
    rounding on a prompt longer than the sliding window, prefill and decode."""
    check = _made(gemma3_packages[exporter])["check"]
    assert _within(check) and check["max_abs"] < 1e-4
    assert check["sliding_window"] == 32 and max(check["prompts"]) > 32 and check["greedy_equal"]


def _package_copy(pkg: Path, dest: Path, change: Any) -> Path:
    shutil.copytree(pkg, dest)
    proto = onnx.load(str(dest / "model.onnx"))
    change(proto.graph)
    onnx.save(proto, str(dest / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return dest


def _wrong_theta(g: onnx.GraphProto) -> None:
    """Every layer reads the sliding layers' rotary tables: what mobius 0.1.0 built for Gemma-3."""
    for n in g.node:
        if n.op_type == "GroupQueryAttention":
            n.input[7], n.input[8] = "cos_cache_local", "sin_cache_local"


def _swapped(g: onnx.GraphProto) -> None:
    """The two layers' o_proj weights exchanged."""
    t = {x.name: x for x in g.initializer}
    a, b = (next(v for k, v in t.items() if f"layers.{i}." in k and "o_proj" in k) for i in (0, 1))
    wa, wb = numpy_helper.to_array(a), numpy_helper.to_array(b)
    a.CopyFrom(numpy_helper.from_array(wb, a.name))
    b.CopyFrom(numpy_helper.from_array(wa, b.name))


@pytest.mark.parametrize(("change", "where"), [(_wrong_theta, "prompt 2"), (_swapped, "prompt [12] of")])
def test_the_check_refuses_a_wrong_rope_theta_and_a_swapped_weight(gemma3: Path, gemma3_packages: dict[str, Path],
                                                                   tmp_path: Path, change: Any, where: str) -> None:
    from bitpress.genai.check import check_logits
    from bitpress.hf.checkpoint import load_model

    bad = _package_copy(gemma3_packages["builder"], tmp_path / "bad", change)
    reference, _ = load_model(gemma3)
    with pytest.raises(ExportError, match=rf"model_type 'gemma3_text'.*differ from transformers' by up to .*{where}.*"
                                          r"--option check=false"):
        check_logits(bad, reference, dtype="f32", what="gemma3", model_type="gemma3_text", workdir=tmp_path)


def test_an_uncorrected_mobius_gemma3_fails_the_export_and_leaves_nothing(gemma3: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Without bitpress's correction, mobius's Gemma-3 package (greedy tokens still plausible) is caught by the
    check and nothing is written."""
    monkeypatch.setattr("bitpress.genai.mobius.fix_gemma3", lambda folder, config: 0)
    with pytest.raises(ExportError, match=r"differ from transformers'"):
        _export(gemma3, tmp_path / "out", exporter="mobius")
    assert not (tmp_path / "out").exists()


def test_quantized_gemma3_is_built_by_the_builder_and_refused_by_mobius(gemma3: Path, tmp_path: Path) -> None:
    """auto picks the builder for a quantized Gemma-3 (mobius 0.1.0 takes no quantized Gemma-3 linears): the
    package equals bitpress's quantized model on float activations; mobius is refused before the build."""
    bitpress.run({"input": str(gemma3), "output": str(tmp_path / "q"), "passes": [{"type": "rtn_hf"}]})
    pkg = _export(tmp_path / "q", tmp_path / "pkg")  # what quantize wrote: the folder one level down
    made = _made(pkg)
    assert made["exporter"] == "onnxruntime_genai.models.builder" and made["exporter_choice"].startswith("builder")
    assert _within(made["check"]) and made["check"]["package_accuracy_level_max_abs"] is not None
    with pytest.raises(ExportError, match=r"takes no quantized linears.*refused before the build; use --exporter "
                                          r"builder"):
        _export(tmp_path / "q" / "gemma3", tmp_path / "pkg2", exporter="mobius")
    assert not (tmp_path / "pkg2").exists()


@pytest.mark.parametrize("name", ["gemma2", "olmo2", "phi3 (LongRoPE)"])
def test_more_architectures_export_right_with_auto(name: str, tmp_path: Path) -> None:
    """Gemma-2 (sliding window: the generation check takes a KV capacity of the window), OLMo2 (a GenAI model type
    onnxruntime_genai knows), Phi-3 with LongRoPE: each built by the exporter auto chooses, checked."""
    src = build_tiny(name, tmp_path / name.split()[0])
    check = _made(_export(src, tmp_path / "pkg"))["check"]
    assert _within(check) and check["greedy_equal"]


def test_auto_refuses_what_no_exporter_builds_before_any_work() -> None:
    from bitpress.genai.exporters import choose

    with pytest.raises(ExportError, match=r"no exporter builds model_type 'my_lm' right here: the GenAI builder 0.18 "
                                          r"does not build MyLmForCausalLM; mobius 0.1.0 does not build .*--runtime "
                                          r"onnx"):
        choose("auto", {"model_type": "my_lm", "architectures": ["MyLmForCausalLM"]}, quantized=False, ep="cpu")
    gemma3 = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}
    assert choose("auto", gemma3, quantized=False, ep="default").exporter == "mobius"  # an EP only mobius has
    with pytest.raises(ExportError, match=r"builder: no execution provider 'default'; mobius 0.1.0's model for "
                                          r"'gemma3_text'"):
        choose("auto", gemma3, quantized=True, ep="default")
    with pytest.raises(ExportError, match=r"mobius 0.1.0's model for 'gemma3_text' takes no quantized linears"):
        choose("mobius", gemma3, quantized=True, ep="cpu")


def test_group_size_is_lowered_at_quantize_time_and_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """rtn_hf's default group 128 over K = 64: lowered to 64 with a warning when quantizing (not padded and then
    refused at export); eval finds the package inside the folder export wrote."""
    from bitpress.genai.package import resolve_model

    src = build_tiny("llama", tmp_path / "llama")
    with caplog.at_level("WARNING"):
        bitpress.run({"input": str(src), "output": str(tmp_path / "q"), "passes": [{"type": "rtn_hf"}]})
    assert "group_size 128 does not divide the width of" in caplog.text and "lowered to 64" in caplog.text
    qc = json.loads((tmp_path / "q" / "llama" / "config.json").read_text())["quantization_config"]
    groups = {name.split(".")[-2]: m["group_size"] for name, m in qc["modules"].items()}
    assert groups["q_proj"] == groups["gate_proj"] == 64 and groups["down_proj"] == 128  # K 64 / K 128
    pkg = _export(tmp_path / "q", tmp_path / "pkg")
    assert pkg == tmp_path / "pkg" / "llama"
    found = resolve_model(tmp_path / "pkg", "QUANTIZED")
    assert found.path == pkg / "model.onnx" and found.genai is not None
    assert np.isfinite(_made(pkg)["check"]["max_abs"])


def test_bench_times_a_sliding_window_package_with_a_short_prompt(gemma3_packages: dict[str, Path]) -> None:
    """The builder's Gemma-3 package needs a KV capacity of its window (32): `bitpress bench` with a prompt of 8
    tokens measures it (it failed with 'KV cache capacity ... must be at least local_window_size')."""
    from bitpress.speed.measure import GenaiSubject, SubjectSpec

    spec = SubjectSpec(str(gemma3_packages["builder"]), "genai", threads=1, prompt_tokens=8, decode_tokens=4)
    got = GenaiSubject(spec).measure()
    assert all(v > 0 for v in got.values()), got
