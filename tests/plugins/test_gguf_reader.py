"""GGUF files read safely: a tiny model written with gguf's own writer; malformed ones refused in one line."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("bitpress_gguf")

from bitpress.errors import ModelLoadError  # noqa: E402


def _write(path: Path, *, tied: bool = True) -> Path:
    """A 2-layer llama-shaped GGUF: Q4_0 / Q4_1 / Q8_0 weights (gguf's quantizers), F32 norms."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_context_length(128)
    types = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q5_1"}
    for layer in range(2):
        for name, t in types.items():
            x = rng.normal(0, 0.05, (64, 64)).astype(np.float32)
            q = gguf.quants.quantize(x, getattr(gguf.GGMLQuantizationType, t))
            w.add_tensor(f"blk.{layer}.{name}.weight", q, raw_dtype=getattr(gguf.GGMLQuantizationType, t))
        w.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(64, np.float32))
    table = gguf.quants.quantize(rng.normal(0, 0.05, (256, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", table, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    if not tied:
        w.add_tensor("output.weight", rng.normal(0, 0.05, (256, 64)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_model_loads_and_inspects(tmp_path: Path) -> None:
    from bitpress_gguf.model import GgufModel

    import bitpress

    path = _write(tmp_path / "tiny.gguf")
    before = path.stat().st_mtime_ns, path.read_bytes()
    model = bitpress.load_model(path)
    assert isinstance(model, GgufModel) and model.file.architecture == "llama"
    assert model.file.tensors["blk.0.attn_q.weight"].shape == (64, 64)
    assert model.file.raw("blk.0.attn_q.weight").shape == (64, 2 * 18)  # two Q4_0 blocks per row
    rep = model.inspect()
    assert rep["tied_embedding"] and set(rep["types"]) == {"Q4_0", "Q4_1", "Q5_1", "Q8_0", "F32"}
    assert rep["types"]["Q4_0"]["tensors"] == 2 and rep["types"]["Q4_1"]["exact"] and rep["types"]["Q5_1"]["exact"]
    assert any("GatherBlockQuantized 8-bit block 32" in line for line in rep["lines"])
    assert rep["bits_per_weight"] == pytest.approx(8 * sum(t["bytes"] for k, t in rep["types"].items() if k != "F32")
                                                   / sum(t["elements"] for k, t in rep["types"].items() if k != "F32"))
    np.testing.assert_array_equal(model.file.array("blk.1.attn_norm.weight"), np.ones(64, np.float32))
    assert (path.stat().st_mtime_ns, path.read_bytes()) == before


def test_inspect_cli_prints_what_maps_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bitpress.cli import main

    path = _write(tmp_path / "tiny.gguf", tied=False)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gguf model" in out and "separate (output.weight)" in out
    assert "Q4_1" in out and "MatMulNBits 4-bit block 32, float minimum: uint8 zero points + block-sum correction" \
        in out
    assert "MatMulNBits 8-bit block 32, float minimum: uint8 zero points + block-sum correction" in out  # Q5_1
    assert "not convertible exactly" not in out


def _corrupt(tmp_path: Path, how: str) -> Path:
    data = bytearray(_write(tmp_path / "tiny.gguf").read_bytes())
    if how == "magic":
        data[:4] = b"GGML"
    elif how == "version":
        data[4:8] = struct.pack("<I", 9)
    elif how == "counts":
        data[8:16] = struct.pack("<Q", 1 << 40)
    elif how == "truncated":
        data = data[: len(data) - 1000]
    elif how == "type":  # the first tensor's type field: 4 bytes before its 8-byte offset
        name = b"blk.0.attn_q.weight"
        at = data.index(name) + len(name) + 4 + 2 * 8  # n_dims, two dims
        data[at:at + 4] = struct.pack("<I", 99)
    elif how == "short":
        data = data[:20]
    out = tmp_path / f"bad-{how}.gguf"
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize(("how", "match"), [
    ("magic", r"is not a GGUF file: it starts with b'GGML'"),
    ("version", r"GGUF version 9 is not supported"),
    ("counts", r"announces 1099511627776 tensors .* more than its \d+ bytes can hold"),
    ("truncated", r"tensor data ends before the tensors it lists end \(truncated\?\)"),
    ("type", r"not a readable GGUF file: 99 is not a valid GGMLQuantizationType \(a tensor type this gguf"),
    ("short", r"shorter than a GGUF header"),
])
def test_malformed_files_are_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str,
                                            match: str) -> None:
    import bitpress
    from bitpress.cli import main

    bad = _corrupt(tmp_path, how)
    with pytest.raises(ModelLoadError, match=match):
        bitpress.load_model(bad)
    assert main(["inspect", str(bad)]) != 0
    err = capsys.readouterr().err
    assert err.count("bitpress: error:") == 1 and "internal error" not in err
