"""Every example configuration of the seed document on Olive's quantization passes, run as written.

The examples are the seed's text (tests/data/olive_seed_examples.txt, checked against the seed when it is beside
the checkout), parsed as Olive users paste them: JSON with ``//`` comments, a bare pass, a list of passes, or a
``"name": {...}`` entry of Olive's ``passes`` mapping. Each becomes the passes of a bitpress workflow as it
stands; the only changes are the ones Olive users make for a local run: Olive's ``data_config`` names stand
for the workflow's ``data:`` (random token ids here), and Hub ids (``tokenizer_dir``) name local folders.
ONNX passes run on a small decoder built here, PyTorch passes on a tiny Llama (the MoE composition on a tiny
Mixtral too); toolkit passes run in their plugin environments (BITPRESS_TEST_ENVS, as `make test` sets it) and
skip, saying so, where one is missing. Each runs, or (INC's GPTQ, which does not do what it claims) is refused
in one line that names the reason and what to write instead: none is "unknown pass" or "unknown option".
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import build_llama, build_mixtral
from test_genai_export import _tokenized_folder

import bitpress
from bitpress import synthetic
from bitpress.errors import BitpressError
from bitpress.plugins import Registry

HERE = Path(__file__).resolve()
FIXTURE = HERE.parents[1] / "data" / "olive_seed_examples.txt"
SEED = HERE.parents[3] / "shared" / "seeds" / "002_a363c1b8066dc684.txt"
ENVS = os.environ.get("BITPRESS_TEST_ENVS")
#: Olive's PyTorch (Hugging Face) passes; the others take ONNX models (QuarkQuantization: both, by its options)
HF_TYPES = {"GptqQuantizer", "AutoAWQQuantizer", "QuaRot", "SpinQuant", "Rtn", "Gptq", "KQuant"}
#: the plugin environment each toolkit's pass runs in
ENV_OF = {"QuarkQuantization": "quark", "IncStaticQuantization": "inc", "NVModelOptQuantization": "modelopt",
          "AimetQuantization": "aimet"}
DATA = {"source": "random", "samples": 4, "seq_len": 32}
#: examples refused by design, with the reason their one-line error must give (and what to write instead)
REFUSED = {
    # INC 1.0's GPTQ rounds to nearest whatever the data (tests/plugins/test_inc.py shows it)
    15: ("algorithm GPTQ is refused: INC 1.0's GPTQ propagates no rounding error", "use algorithm RTN or AWQ"),
}


def blocks(text: str) -> list[str]:
    """The example blocks of the seed's text: from a line ``{``, ``[`` or ``"name": {`` to its closing line."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line in ("{", "[") or re.fullmatch(r'"\w+": \{', line):
            close = "]" if line == "[" else "}"
            j = lines.index(close, i)
            out.append("\n".join(lines[i:j + 1]))
            i = j + 1
        else:
            i += 1
    return out


def parse(block: str) -> list[dict[str, Any]] | dict[str, dict[str, Any]]:
    """A block as an Olive user's file holds it: ``//`` comments dropped, a ``"name": {...}`` entry is one pass
    of Olive's mapping of passes."""
    text = "\n".join(line for line in block.splitlines() if not line.strip().startswith("//"))
    if text.startswith('"'):
        return json.loads("{" + text + "}")
    value = json.loads(text)
    return value if isinstance(value, list) else [value]


EXAMPLES = blocks(FIXTURE.read_text())


def test_the_fixture_is_the_seeds_examples() -> None:
    assert len(EXAMPLES) == 23
    if not SEED.is_file():
        pytest.skip(f"the seed document is not beside this checkout ({SEED})")
    assert blocks(SEED.read_text()) == EXAMPLES


def _entries(passes: Any) -> list[dict[str, Any]]:
    return list(passes.values()) if isinstance(passes, dict) else passes


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("olive-seed")
    onnx_dir = root / "onnx"
    synthetic.build_decoder(onnx_dir / "model.onnx", hidden=64, layers=2, heads=4, vocab=256, tied=False)
    synthetic.write_tokenizer(onnx_dir, vocab=256)  # the decoder writes its own calibration text with it
    synthetic.write_tokenizer(root / "tokenizer", vocab=256)  # what a Hub id in tokenizer_dir stands for here
    return {"onnx": onnx_dir / "model.onnx", "tokenizer": root / "tokenizer",
            "hf": _tokenized_folder(build_llama(False, seed=3), root / "llama"),
            # 128 wide: the seed's Quark example splits inputs in groups of 128
            "hf128": _tokenized_folder(build_llama(False, seed=3, hidden_size=128, intermediate_size=256),
                                       root / "llama128"),
            "mixtral": _tokenized_folder(build_mixtral(seed=4), root / "mixtral")}


def _localized(passes: Any, tokenizer: Path) -> Any:
    """Hub ids in tokenizer_dir -> the local tokenizer folder (an Olive user without network does the same)."""
    for entry in _entries(passes):
        if "tokenizer_dir" in entry:
            entry["tokenizer_dir"] = str(tokenizer)
    return passes


def _cases() -> list[Any]:
    cases = []
    for i, block in enumerate(EXAMPLES):
        passes = parse(block)
        types = [e["type"] for e in _entries(passes)]
        hf = all(t in HF_TYPES or (t == "QuarkQuantization" and "quant_scheme" in e)
                 for t, e in zip(types, _entries(passes), strict=True))
        label = f"{i:02d}-{'+'.join(types)}"
        model = ("hf128" if "QuarkQuantization" in types else "hf") if hf else "onnx"
        cases.append(pytest.param(i, model, id=label))
        if types == ["Gptq", "Rtn"]:  # the composition with moe: true, on a model with experts as well
            cases.append(pytest.param(i, "mixtral", id=f"{label}-mixtral"))
    return cases


@pytest.mark.parametrize(("index", "model"), _cases())
def test_the_seeds_example_runs_as_written(index: int, model: str, models: dict[str, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    passes = _localized(parse(EXAMPLES[index]), models["tokenizer"])
    entries = _entries(passes)
    needed = {ENV_OF[e["type"]] for e in entries if e["type"] in ENV_OF}
    for env in needed:
        if not ENVS or not (Path(ENVS) / env / "env.json").is_file():
            pytest.skip(f"needs the {env} environment: `make envs` and BITPRESS_TEST_ENVS (as `make test` sets)")
    if needed:
        monkeypatch.setenv("BITPRESS_ENVS", str(ENVS))
    src = models[model]
    config: dict[str, Any] = {"input": str(src), "output": str(tmp_path / "out"), "passes": passes}
    if any("data_config" in e for e in entries):
        config["data"] = DATA  # Olive's data_config name, as the workflow's data
    if index in REFUSED:
        with pytest.raises(BitpressError) as caught:
            bitpress.run(config, registry=Registry())
        message = str(caught.value)
        assert len(message.splitlines()) == 1 and all(part in message for part in REFUSED[index]), message
        assert "unknown pass" not in message and "unknown option" not in message
        assert not (tmp_path / "out").exists()
        return
    result = bitpress.run(config, registry=Registry())
    assert result.files, result
    written = tmp_path / "out" / src.name
    assert written.exists(), sorted(p.name for p in (tmp_path / "out").iterdir())
    shutil.rmtree(tmp_path / "out")
