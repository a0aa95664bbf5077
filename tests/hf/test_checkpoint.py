"""Hugging Face folders as a model kind: loading safely, saving quantized, reloading exactly, the CLI."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import bitpress
from bitpress.errors import ModelLoadError, UsageError
from bitpress.hf import checkpoint
from bitpress.hf.model import HfModel
from bitpress.hf.qtensor import QuantTensor


def out_folder(result: Any, src: Path) -> Path:
    return Path(result.output) / src.name


def state(model: Any) -> dict[str, Any]:
    """name -> plain tensor or (qweight, scales, qzeros, spec) for every parameter and alias."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = (p.qweight, p.scales, p.qzeros, p.spec) if isinstance(p, QuantTensor) else p.detach()
    return out


def assert_same_state(a: Any, b: Any) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        x, y = sa[name], sb[name]
        assert type(x) is type(y), name
        if isinstance(x, tuple):
            assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[3] == y[3], name
            assert (x[2] is None and y[2] is None) or torch.equal(x[2], y[2]), name
        else:
            assert torch.equal(x, y), name


def test_the_load_hook_recognizes_hf_folders(llama_tied_folder: Path, tmp_path: Path, tiny_decoder: Path) -> None:
    handle = bitpress.load_model(llama_tied_folder)
    assert isinstance(handle, HfModel) and handle.kind == "hf" and not handle.loaded  # torch loads lazily
    mixed = tmp_path / "mixed"
    shutil.copytree(llama_tied_folder, mixed)
    shutil.copy(tiny_decoder, mixed / "model.onnx")
    assert bitpress.load_model(mixed).kind == "onnx-folder"  # an .onnx inside: an ONNX folder
    with pytest.raises(UsageError, match="unknown load option"):
        bitpress.load_model(llama_tied_folder, trust_me=True)


@pytest.mark.parametrize("passes", [
    [{"type": "rtn_hf", "group_size": 32, "lm_head": True, "embeds": True, "sym": False}],
    [{"type": "KQuant", "embeds": True}, {"type": "Rtn", "lm_head": True, "embeds": True, "bits": 8,
                                          "group_size": 64}],
])
def test_save_then_reload_restores_the_quantized_tensors_exactly(
    llama_tied_folder: Path, tmp_path: Path, passes: list[dict[str, Any]], hf_run: Callable[..., Any]
) -> None:
    res = hf_run(passes, llama_tied_folder, tmp_path / "out")
    folder = out_folder(res, llama_tied_folder)
    assert {f.name for f in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer_config.json"}
    assert (folder / "tokenizer_config.json").read_bytes() == (llama_tied_folder / "tokenizer_config.json").read_bytes()

    first = HfModel.load(folder)
    model = first.torch_model()
    second = HfModel.load(folder).torch_model()
    assert_same_state(model, second)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, second(input_ids=ids).logits)
    # and saving the reloaded model again writes the same tensors
    files = first.save(tmp_path / "again")
    assert_same_state(second, HfModel.load(files[0].parent).torch_model())

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "bitpress" and qc["format"] == "bitpress-blockwise-v1"
    names = {"rtn_hf": "rtn_hf", "Rtn": "rtn_hf", "KQuant": "kquant_hf"}
    assert [p["pass"] for p in qc["passes"]] == [names[p["type"]] for p in passes]


def test_tied_table_is_stored_once(llama_tied_folder: Path, tmp_path: Path, hf_run: Callable[..., Any]) -> None:
    res = hf_run([{"type": "rtn_hf", "group_size": 32, "lm_head": True, "embeds": True}], llama_tied_folder,
                 tmp_path / "out")
    folder = out_folder(res, llama_tied_folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight_qweight" in keys and not any(k.startswith("lm_head") for k in keys)
    assert "model.embed_tokens.weight" not in keys
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization_config"]["tied"] == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert cfg["tie_word_embeddings"] is True
    model = HfModel.load(folder).torch_model()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.lm_head.weight, QuantTensor)


def test_one_sided_tie_reloads_with_a_float_head(llama_tied_folder: Path, tmp_path: Path,
                                                 hf_run: Callable[..., Any]) -> None:
    res = hf_run([{"type": "rtn_hf", "group_size": 32, "embeds": True}], llama_tied_folder, tmp_path / "out")
    folder = out_folder(res, llama_tied_folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["tied"] == []
    model = HfModel.load(folder).torch_model()
    original = HfModel.load(llama_tied_folder).torch_model().lm_head.weight
    assert isinstance(model.model.embed_tokens.weight, QuantTensor)
    assert not isinstance(model.lm_head.weight, QuantTensor) and torch.equal(model.lm_head.weight, original)
    # plain transformers loads the float head too (it skips the unknown quant_method)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(folder)
    assert torch.equal(plain.lm_head.weight, original)


def test_pickled_weights_are_refused_unless_allowed(llama_untied_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(llama_untied_folder / "config.json", folder / "config.json")
    model = HfModel.load(llama_untied_folder).torch_model()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"pickled weights .*allow_pickle"):
        HfModel.load(folder).torch_model()
    with pytest.raises(ModelLoadError, match="allow_pickle"):
        bitpress.run({"input": str(folder), "output": str(tmp_path / "o1"), "passes": [{"type": "rtn_hf"}]})
    assert not (tmp_path / "o1").exists()
    loaded = bitpress.load_model(folder, allow_pickle=True).torch_model()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    res = bitpress.run({"input": str(folder), "output": str(tmp_path / "o2"),
                        "passes": [{"type": "rtn_hf", "allow_pickle": True, "group_size": 32}]})
    assert (out_folder(res, folder) / "model.safetensors").is_file()  # written back as safetensors


def test_remote_code_does_not_run_unless_trusted(llama_untied_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "custom"
    shutil.copytree(llama_untied_folder, folder)
    marker = tmp_path / "ran.txt"
    (folder / "configuration_custom.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig\n\nclass CustomConfig(LlamaConfig):\n    model_type = 'custom_llama'\n"
    )
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="custom_llama", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="trust_remote_code"):
        HfModel.load(folder).torch_model()
    assert not marker.exists()


def test_other_quantizers_checkpoints_are_refused(llama_untied_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "gptq"
    shutil.copytree(llama_untied_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="already quantized by another tool"):
        HfModel.load(folder).torch_model()


def test_cli_quantize_on_an_hf_folder(llama_tied_folder: Path, tmp_path: Path,
                                      run_cli: Callable[..., tuple[int, str, str]]) -> None:
    code, out, err = run_cli("quantize", "-m", llama_tied_folder, "-o", tmp_path / "cli", "--algorithm", "rtn_hf",
                             "--precision", "int8", "--option", "group_size=32", "--option", "lm_head=true")
    assert code == 0, err
    assert "rtn_hf" in out and "quantized 15 weights" in out
    model = HfModel.load(tmp_path / "cli" / llama_tied_folder.name).torch_model()
    assert model.lm_head.weight.spec.bits == 8
    code, out, err = run_cli("quantize", "-m", llama_tied_folder, "-o", tmp_path / "cli2", "--algorithm",
                             "rtn_hf", "--option", 'overrides={"re:(a)\\\\1": {}}')
    assert code == 2 and "uses a backreference" in err and not (tmp_path / "cli2").exists()


def test_cli_algorithm_rtn_picks_the_hf_pass(llama_tied_folder: Path, tmp_path: Path,
                                             run_cli: Callable[..., tuple[int, str, str]]) -> None:
    code, out, err = run_cli("quantize", "-m", llama_tied_folder, "-o", tmp_path / "cli", "--algorithm", "rtn",
                             "--precision", "int4")
    assert code == 0, err
    assert "rtn_hf" in out


def test_workflow_refuses_onnx_passes_on_hf_models(llama_tied_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not accept hf models"):
        bitpress.run({"input": str(llama_tied_folder), "output": str(tmp_path / "x"), "passes": [{"type": "rtn"}]})
    assert checkpoint.companion_files(llama_tied_folder)[0].name in {"generation_config.json", "tokenizer_config.json"}


def test_the_host_imports_torch_only_on_the_hf_path(llama_tied_folder: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys, bitpress\n"
        "from bitpress.plugins import get_registry\n"
        "reg = get_registry()\n"
        "assert {'rtn_hf', 'kquant_hf', 'hf_to_onnx'} <= set(reg.passes)\n"
        "reg.get_pass('rtn_hf').from_config({'overrides': {'re:.*q_proj': {'bits': 8}}})\n"
        f"handle = bitpress.load_model({str(llama_tied_folder)!r})\n"
        "assert handle.kind == 'hf'\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported eagerly'\n"
        "handle.torch_model()\n"
        "assert 'torch' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_folder_given_by_a_relative_path_loads(llama_untied_folder: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The safetensors files (and a sharded index's shards) of a folder named relative to the working directory
    are found once, not at folder/folder/name."""
    import shutil

    from bitpress.hf.model import HfModel

    shutil.copytree(llama_untied_folder, tmp_path / "out" / "x")
    monkeypatch.chdir(tmp_path)
    handle = HfModel.load(Path("out/x"))
    assert handle.history == []
