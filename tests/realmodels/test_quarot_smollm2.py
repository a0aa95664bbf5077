"""QuaRot (plugin bitpress-rotate) on SmolLM2-135M as the GenAI builder and mobius export it.

The rotation must leave the model's function unchanged (perplexity, greedy generation), keep the
tied embedding / LM head one table, and, quantized afterwards, run on ONNX Runtime's fast kernels:
every weight a MatMulNBits or GatherBlockQuantized, the one float product the tied head needs marked
to stay float.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest
from test_genai_packages import generate

import bitpress

pytestmark = [pytest.mark.slow, pytest.mark.realmodels]
pytest.importorskip("bitpress_rotate")


@pytest.mark.parametrize("export", ["smollm2_genai_builder", "smollm2_genai_mobius"])
def test_rotation_keeps_smollm2(
    export: str, request: pytest.FixtureRequest, tmp_path: Path, lee_background: Path,
    run_cli: Callable[..., tuple[int, str, str]], smollm2_reference: dict[str, Any],
) -> None:
    src: Path = request.getfixturevalue(export)
    out = tmp_path / "rotated"
    code, _, stderr = run_cli("quantize", "-m", src, "-o", out, "--algorithm", "QuaRot")
    assert code == 0, stderr
    code, stdout, stderr = run_cli("eval", out, "--reference", src, "--text", lee_background,
                                   "--max-windows", "2", "--no-weights", "--no-speed", "--json")
    assert code == 0, stderr
    ppl = json.loads(stdout)["perplexity"]
    assert 5 < ppl["reference"] < 200, ppl
    assert abs(ppl["relative_change"]) < 1e-4, ppl  # measured: 3e-7 (builder and mobius)
    prompt = str(smollm2_reference["prompt"])
    assert generate(out, prompt) == generate(src, prompt)
    model = onnx.load(out / "model.onnx", load_external_data=False)
    gathers = [n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    assert len(gathers) == 1


def test_rotated_then_quantized_smollm2_runs_on_fast_kernels(smollm2_genai_builder: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    config = {"input": str(smollm2_genai_builder), "output": str(out),
              "passes": [{"type": "QuaRot"}, {"type": "rtn", "precision": "int4", "block_size": 32}]}
    bitpress.run(config)
    model = onnx.load(out / "model.onnx", load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 30 * 5 + 1 and ops.count("GatherBlockQuantized") == 1
    floats = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert [n.name for n in floats] == ["/model/layers.30/final_norm_layernorm/SkipLayerNorm/quarot_online"]
    tokens, text = generate(out, "The capital of France is")
    assert tokens and text.strip()
