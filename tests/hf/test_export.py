"""Export to ONNX: MatMulNBits / GatherBlockQuantized with the checkpoint's exact integers, ties kept."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

import bitpress
from bitpress.errors import QuantizationError
from bitpress.hf import hf_to_onnx
from bitpress.hf.model import HfModel
from bitpress.hf.qtensor import QuantTensor
from bitpress.onnx.kernels import graph_paths

#: measured: ~2e-7 (float32 dequantization on both sides); the bound leaves room for kernel order
ATOL = 1e-4


def feeds(batch: int = 2, seq: int = 13, seed: int = 3) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, 256, (batch, seq), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def torch_logits(model: Any, f: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(f["input_ids"]),
                     attention_mask=torch.from_numpy(f["attention_mask"])).logits.float().numpy()


def ort_run(path: Path, f: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in f.items() if k in names})


def ms_ops(path: Path) -> Counter[str]:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node
                   if n.domain == "com.microsoft")


def quantized_folder(src: Path, tmp: Path, hf_run: Callable[..., Any], **options: Any) -> Path:
    res = hf_run([{"type": options.pop("type", "rtn_hf"), **options}], src, tmp / "q")
    return Path(res.output) / src.name


def test_tied_table_is_one_quantized_tensor_read_by_both_ends(llama_tied_folder: Path, tmp_path: Path,
                                                              hf_run: Callable[..., Any]) -> None:
    q = quantized_folder(llama_tied_folder, tmp_path, hf_run, group_size=32, lm_head=True, embeds=True)
    handle = HfModel.load(q)
    model = handle.torch_model()
    files = hf_to_onnx(handle, tmp_path / "onnx", accuracy_level=0)  # float32 compute: compared with torch below
    path = tmp_path / "onnx" / "model.onnx"
    assert path in files and (tmp_path / "onnx" / "tokenizer_config.json").is_file()
    assert ms_ops(path) == {"MatMulNBits": 15, "GatherBlockQuantized": 1}

    proto = onnx.load(str(path))
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    assert "model.embed_tokens.weight" not in inits and "lm_head.weight" not in inits  # no float table left
    gather = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith("model.embed_tokens"))
    reshape = next(n for n in graph.node if gather.input[0] in n.output)
    assert reshape.op_type == "Reshape" and reshape.input[0] == head.input[1]  # the same B bytes
    assert gather.input[2] == head.input[2]  # one scales tensor
    table = model.lm_head.weight
    assert isinstance(table, QuantTensor)
    b = numpy_helper.to_array(inits[head.input[1]])
    assert np.array_equal(b, table.qweight.numpy())  # the checkpoint's integers, not re-quantized
    assert np.array_equal(numpy_helper.to_array(inits[head.input[2]]), table.scales.numpy())

    f = feeds()
    got = ort_run(path, f)[0]
    want = torch_logits(model, f)
    assert got.shape == want.shape == (2, 13, 256)
    assert np.abs(got - want).max() < ATOL


@pytest.mark.parametrize("options", [
    {"type": "rtn_hf", "bits": 8, "sym": False, "group_size": 16, "lm_head": True},
    {"type": "kquant_hf", "lm_head": True, "embeds": True},  # float zero points on the 4-bit linears
    {"type": "kquant_hf", "bits": 8, "lm_head": True, "embeds": True, "group_size": 64},
])
def test_exported_logits_match_the_quantized_pytorch_model(llama_tied_folder: Path, tmp_path: Path,
                                                           hf_run: Callable[..., Any], options: dict[str, Any]) -> None:
    q = quantized_folder(llama_tied_folder, tmp_path, hf_run, **dict(options))
    handle = HfModel.load(q)
    hf_to_onnx(handle, tmp_path / "onnx", accuracy_level=0)  # float32 compute: the checkpoint's values exactly
    f = feeds(batch=1, seq=17)
    got = ort_run(tmp_path / "onnx" / "model.onnx", f)[0]
    want = torch_logits(handle.torch_model(), f)
    assert np.abs(got - want).max() < ATOL
    assert ms_ops(tmp_path / "onnx" / "model.onnx")["MatMulNBits"] == 15
    # the default, for the CPU: int8 compute on ONNX Runtime's packed kernels (float zero points as a
    # block-sum correction), within the int8 activations' error
    hf_to_onnx(handle, tmp_path / "fast")
    fast = tmp_path / "fast" / "model.onnx"
    assert not graph_paths(onnx.load(str(fast), load_external_data=False).graph).slow()
    got4 = ort_run(fast, f)[0]
    assert np.linalg.norm(got4 - want) / np.linalg.norm(want) < 0.02


def test_one_sided_embedding_exports_a_float_head(llama_tied_folder: Path, tmp_path: Path,
                                                  hf_run: Callable[..., Any]) -> None:
    q = quantized_folder(llama_tied_folder, tmp_path, hf_run, group_size=32, embeds=True,
                         modules_to_not_convert=["layers"])
    hf_to_onnx(q, tmp_path / "onnx")
    path = tmp_path / "onnx" / "model.onnx"
    assert ms_ops(path) == {"GatherBlockQuantized": 1}
    inits = {t.name for t in onnx.load(str(path)).graph.initializer}
    assert "lm_head.weight" in inits and "model.embed_tokens.weight" not in inits
    f = feeds()
    assert np.abs(ort_run(path, f)[0] - torch_logits(HfModel.load(q).torch_model(), f)).max() < ATOL


def test_float_folders_export_too(llama_untied_folder: Path, tmp_path: Path) -> None:
    hf_to_onnx(llama_untied_folder, tmp_path / "onnx")
    f = feeds()
    want = torch_logits(HfModel.load(llama_untied_folder).torch_model(), f)
    assert not ms_ops(tmp_path / "onnx" / "model.onnx")
    assert np.abs(ort_run(tmp_path / "onnx" / "model.onnx", f)[0] - want).max() < ATOL


def test_two_bit_checkpoints_are_refused_at_export(llama_tied_folder: Path, tmp_path: Path,
                                                   hf_run: Callable[..., Any]) -> None:
    q = quantized_folder(llama_tied_folder, tmp_path, hf_run, bits=2, group_size=32)
    with pytest.raises(QuantizationError) as info:
        hf_to_onnx(q, tmp_path / "onnx")
    # one sentence with a count and a few names, not one sentence per tensor
    message = str(info.value)
    assert message.startswith("14 tensors are 2-bit (model.layers.0.self_attn.q_proj.weight, "), message
    assert " and 11 more): ONNX export needs 4 or 8 bits" in message and "checkpoints stay PyTorch-only" in message
    assert message.count("2-bit (") == 1 and message.count("PyTorch-only") == 1 and "k_proj" in message
    assert not (tmp_path / "onnx").exists()
    with pytest.raises(QuantizationError, match="2-bit"):
        hf_run([{"type": "rtn_hf", "precision": "int2"}, {"type": "hf_to_onnx"}], llama_tied_folder, tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_split_components_share_the_tied_table_bytes(llama_tied_folder: Path, tmp_path: Path,
                                                     hf_run: Callable[..., Any]) -> None:
    q = quantized_folder(llama_tied_folder, tmp_path, hf_run, group_size=32, lm_head=True, embeds=True)
    hf_to_onnx(q, tmp_path / "full")
    hf_to_onnx(q, tmp_path / "split", split_embedding=True)
    emb_path, dec_path = tmp_path / "split" / "embedding.onnx", tmp_path / "split" / "decoder.onnx"
    assert ms_ops(emb_path) == {"GatherBlockQuantized": 1}
    assert ms_ops(dec_path) == {"MatMulNBits": 15}

    def refs(path: Path) -> dict[str, tuple[str, ...]]:
        model = onnx.load(str(path), load_external_data=False)
        return {t.name: tuple(f"{e.key}={e.value}" for e in t.external_data) for t in model.graph.initializer
                if t.name.startswith("model.embed_tokens.weight")}

    emb, dec = refs(emb_path), refs(dec_path)
    assert set(emb) == set(dec) == {"model.embed_tokens.weight_Q4", "model.embed_tokens.weight_scales"}
    for name in emb:
        assert emb[name] == dec[name] and "location=shared.onnx.data" in emb[name]  # the same bytes on disk
    f = feeds()
    (embeds,) = ort_run(emb_path, f)
    (split_logits,) = ort_run(dec_path, {"inputs_embeds": embeds, "attention_mask": f["attention_mask"]})
    (full_logits,) = ort_run(tmp_path / "full" / "model.onnx", f)
    assert np.abs(split_logits - full_logits).max() < ATOL


def test_workflow_export_and_eval_against_the_float_export(llama_tied_folder: Path, tmp_path: Path,
                                                           hf_run: Callable[..., Any]) -> None:
    res = hf_run([{"type": "Rtn", "group_size": 32, "lm_head": True, "embeds": True},
                  {"type": "hf_to_onnx"}], llama_tied_folder, tmp_path / "wf")
    out = Path(res.output) / llama_tied_folder.name
    assert (out / "model.onnx").is_file() and "hf_to_onnx" in res.seconds
    hf_to_onnx(llama_tied_folder, tmp_path / "float")
    result = bitpress.evaluate(out, tmp_path / "float", samples=2, seq_len=16)
    data = result.to_json()
    # every quantized tensor is matched with its float weight by name: the exports name them alike
    assert data["sqnr_summary"]["tensors"] == 15 and data["sqnr_summary"]["min_db"] > 15
    table = next(t for t in data["tensors"] if t["weight"] == "model.embed_tokens.weight")
    assert len(table["nodes"]) == 2  # one tied table, read by the Gather and the LM head
    assert data["outputs"][0]["top1_agreement"] > 0.5


def test_bfloat16_checkpoints_round_trip_and_export_in_float32(llama: Any, tmp_path: Path, save_hf: Any,
                                                              hf_run: Callable[..., Any]) -> None:
    src = save_hf(llama(tied=True).to(torch.bfloat16), tmp_path / "bf16")
    q = quantized_folder(src, tmp_path, hf_run, group_size=32, lm_head=True, embeds=True)
    model = HfModel.load(q).torch_model()
    table = model.lm_head.weight
    assert isinstance(table, QuantTensor) and table.dtype == torch.bfloat16 and table.scales.dtype == torch.float32
    assert model.model.norm.weight.dtype == torch.bfloat16
    hf_to_onnx(q, tmp_path / "onnx")
    assert model.model.norm.weight.dtype == torch.bfloat16 and model.lm_head.weight is table  # restored after tracing
    f = feeds()
    got = ort_run(tmp_path / "onnx" / "model.onnx", f)[0]
    assert got.dtype == np.float32
    # the bf16 PyTorch model rounds activations to 8 bits of mantissa: only a loose agreement is expected
    want = torch_logits(model, f)
    assert np.abs(got - want).max() < 0.1 and (got.argmax(-1) == want.argmax(-1)).mean() > 0.9
