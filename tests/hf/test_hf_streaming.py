"""Streaming quantization of Hugging Face checkpoints (bitpress.hf.streaming): the in-memory path's bytes.

Every case runs a workflow twice, streaming (the default) and ``stream: false`` (the whole model
loaded), and compares every file of the two outputs byte for byte. Streaming must really stream
(``checkpoint.load_model`` is never called on the input) and fall back, with one log line, where
it cannot reproduce the in-memory result.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import bitpress
from bitpress.errors import OutputError, QuantizationError
from bitpress.hf import checkpoint, safetensors_writer, stream_checkpoint, streaming
from bitpress.hf.model import HfModel
from bitpress.hf.safetensors_writer import Entry, SafetensorsWriter, plan_shards
from bitpress.passes import PassContext


def _conftest() -> Any:
    """tests/hf/conftest.py's builders (a conftest is no importable module: loaded under its own name)."""
    import importlib.util
    import sys

    name = "bitpress_tests_hf_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("conftest.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


build_llama, build_mixtral, save_folder = _conftest().build_llama, _conftest().build_mixtral, _conftest().save_folder

FALLBACK = "loading the whole model instead of streaming it"


# -- fixtures -------------------------------------------------------------------------------------
def _resave(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the folder's weights by one model.safetensors holding ``tensors``."""
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, llama_tied_folder: Path, llama_untied_folder: Path) -> dict:
    root = tmp_path_factory.mktemp("streaming")
    out: dict[str, Path] = {"tied": llama_tied_folder, "untied": llama_untied_folder}
    # transformers 5 saves Mixtral's experts per expert and fuses them when loading (streaming falls back);
    # a checkpoint of the fused tensors themselves loads as it is stored
    mix = build_mixtral()
    out["moe_per_expert"] = save_folder(mix, root / "moe_per_expert")
    out["moe"] = save_folder(mix, root / "moe")
    _resave(out["moe"], mix.state_dict())
    # bfloat16 stored and loaded
    out["bf16"] = save_folder(build_llama(False, seed=2).to(torch.bfloat16), root / "bf16")
    # float32 stored, bfloat16 in config.json: loading casts every tensor
    cast = save_folder(build_llama(True, seed=3), root / "cast")
    cfg = json.loads((cast / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (cast / "config.json").write_text(json.dumps(cfg))
    out["cast"] = cast
    # several shards and an index
    sharded = root / "sharded"
    build_llama(False, seed=1).save_pretrained(sharded, max_shard_size="60KB")
    (sharded / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    out["sharded"] = sharded
    return out


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders ``checkpoint.load_model`` is asked to load (the in-memory path's one way in)."""
    seen: list[Path] = []
    real = checkpoint.load_model

    def spy(folder: Path, **kwargs: Any) -> Any:
        seen.append(Path(folder))
        return real(folder, **kwargs)

    monkeypatch.setattr(checkpoint, "load_model", spy)
    return seen


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def run_both(src: Path, tmp_path: Path, passes: list[dict[str, Any]], loads: list[Path],
             streamed: bool = True) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Both outputs' files; ``streamed``: the first run never loads the input whole."""
    a = bitpress.run({"input": str(src), "output": str(tmp_path / "stream"), "passes": passes})
    assert (src.resolve() not in [p.resolve() for p in loads]) == streamed, loads
    off = [{**p, "stream": False} if p["type"] in ("rtn_hf", "kquant_hf") else p for p in passes]
    b = bitpress.run({"input": str(src), "output": str(tmp_path / "memory"), "passes": off})
    assert [r[2].errors for r in a.reports] == [r[2].errors for r in b.reports]  # the same maths, exactly
    return files_of(tmp_path / "stream" / src.name), files_of(tmp_path / "memory" / src.name)


def assert_same_files(a: dict[str, bytes], b: dict[str, bytes]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], name


# -- the same bytes as the in-memory path -----------------------------------------------------------
CASES = [
    ("rtn_hf", "tied", {}),
    ("rtn_hf", "tied", {"lm_head": True, "embeds": True}),  # one table; group 128 -> 64 so both ends share it
    ("rtn_hf", "tied", {"lm_head": True, "embeds": True, "group_size": 32, "sym": False}),
    ("rtn_hf", "tied", {"embeds": True}),  # split tie: the table quantized, the head float
    ("rtn_hf", "tied", {"lm_head": True, "embeds": True, "modules_to_not_convert": ["embed_tokens"]}),
    ("kquant_hf", "tied", {"lm_head": True, "embeds": True}),
    ("rtn_hf", "untied", {"lm_head": True, "embeds": True, "sym": False, "bits": 8,
                          "overrides": {"re:.*down_proj": {"bits": 4, "group_size": 64}},
                          "modules_to_not_convert": ["layers.1.self_attn.q_proj"]}),
    ("kquant_hf", "untied", {"embeds": True, "float_zero_points": False}),
    ("kquant_hf", "untied", {"bits": 2, "group_size": 16, "lm_head": True}),
    ("rtn_hf", "moe", {}),
    ("rtn_hf", "moe", {"moe": True, "sym": False, "lm_head": True}),
    ("kquant_hf", "moe", {"moe": True, "overrides": {"re:.*experts\\.down_proj": {"bits": 8}}}),
    ("rtn_hf", "bf16", {"lm_head": True, "embeds": True, "sym": False}),
    ("kquant_hf", "cast", {"lm_head": True, "embeds": True}),
    ("rtn_hf", "sharded", {"embeds": True, "group_size": 32}),
]


@pytest.mark.parametrize(("pass_name", "model", "options"), CASES,
                         ids=[f"{p}-{m}-{i}" for i, (p, m, _) in enumerate(CASES)])
def test_streaming_writes_the_in_memory_bytes(pass_name: str, model: str, options: dict[str, Any], folders: dict,
                                              tmp_path: Path, loads: list[Path],
                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="bitpress.hf.streaming"):
        a, b = run_both(folders[model], tmp_path, [{"type": pass_name, **options}], loads)
    assert FALLBACK not in caplog.text
    assert_same_files(a, b)
    assert "model.safetensors" in a and "tokenizer_config.json" in a
    qc = json.loads(a["config.json"]).get("quantization_config")
    if qc:  # how the model was read is not part of the record
        assert "stream" not in qc["passes"][0]["options"]


def test_a_split_tie_unties_the_config(folders: dict, tmp_path: Path, loads: list[Path]) -> None:
    a, b = run_both(folders["tied"], tmp_path, [{"type": "rtn_hf", "embeds": True}], loads)
    assert_same_files(a, b)
    cfg = json.loads(a["config.json"])
    assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["tied"] == []


def test_a_sharded_input_gives_what_the_single_file_gives(folders: dict, tmp_path: Path, loads: list[Path]) -> None:
    assert len(list(folders["sharded"].glob("model-*.safetensors"))) > 2
    passes = [{"type": "rtn_hf", "lm_head": True, "sym": False}]
    a, _ = run_both(folders["sharded"], tmp_path / "s", passes, loads)
    b, _ = run_both(folders["untied"], tmp_path / "u", passes, loads)  # the same weights, one file
    assert_same_files(a, b)


def test_a_sharded_output_holds_the_same_tensors(folders: dict, tmp_path: Path, loads: list[Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    passes = [{"type": "rtn_hf", "lm_head": True, "embeds": True, "sym": False, "group_size": 32}]
    one = tmp_path / "one"
    bitpress.run({"input": str(folders["untied"]), "output": str(one), "passes": passes})
    limit = 12_000
    monkeypatch.setattr(safetensors_writer, "MAX_SHARD_BYTES", limit)
    many = tmp_path / "many"
    bitpress.run({"input": str(folders["untied"]), "output": str(many), "passes": passes})
    one, many = one / "llama_untied", many / "llama_untied"
    shards = sorted(many.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (many / "model.safetensors").exists()
    index = json.loads((many / "model.safetensors.index.json").read_text())
    tensors: dict[str, bytes] = {}
    for shard in shards:
        names = [k for k, v in index["weight_map"].items() if v == shard.name]
        sizes = {}
        with safe_open(str(shard), framework="pt") as sf:
            assert sorted(sf.keys()) == sorted(names)
            for k in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = sf.get_tensor(k)
                tensors[k] = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
                sizes[k] = t.numel() * t.element_size()
        # a shard over the limit holds one weight (its qweight, scales, qzeros) only
        assert sum(sizes.values()) <= limit or len({k.rsplit("_q", 1)[0].rsplit("_scales", 1)[0] for k in sizes}) == 1
        # and each shard is what save_file writes for its tensors
        with safe_open(str(shard), framework="pt") as sf:
            again = {k: sf.get_tensor(k) for k in sf.keys()}  # noqa: SIM118
        save_file(again, str(tmp_path / "again.safetensors"), metadata={"format": "pt"})
        assert (tmp_path / "again.safetensors").read_bytes() == shard.read_bytes()
    with safe_open(str(one / "model.safetensors"), framework="pt") as sf:
        single = {k: sf.get_tensor(k).view(torch.uint8).numpy().tobytes() for k in sf.keys()}  # noqa: SIM118
    assert tensors == single
    assert index["metadata"]["total_size"] == sum(len(v) for v in single.values())
    assert (many / "config.json").read_bytes() == (one / "config.json").read_bytes()
    # bitpress reloads it exactly, and transformers reads it as a sharded folder
    a, b = HfModel.load(many).torch_model(), HfModel.load(one).torch_model()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_chunked_reads_give_the_same_bytes(folders: dict, tmp_path: Path, loads: list[Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory is bounded by the chunks: with tiny ones, every read is tiny and the output unchanged."""
    from bitpress.hf import quantize

    passes = [{"type": "rtn_hf", "lm_head": True, "embeds": True, "group_size": 32}]
    ref = tmp_path / "ref"
    bitpress.run({"input": str(folders["untied"]), "output": str(ref), "passes": passes})
    biggest = []
    real = stream_checkpoint.CheckpointFiles.read_bytes

    def spy(self: Any, name: str, start: int, count: int) -> Any:
        biggest.append(count)
        return real(self, name, start, count)

    monkeypatch.setattr(stream_checkpoint.CheckpointFiles, "read_bytes", spy)
    monkeypatch.setattr(quantize, "CHUNK_ELEMENTS", 1000)
    monkeypatch.setattr(streaming, "COPY_BYTES", 4096)
    out = tmp_path / "chunked"
    bitpress.run({"input": str(folders["untied"]), "output": str(out), "passes": passes})
    assert biggest and max(biggest) <= 4096
    assert_same_files(files_of(out / "llama_untied"), files_of(ref / "llama_untied"))


def test_streaming_never_builds_real_weights(folders: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the streaming path loaded the model")

    monkeypatch.setattr(HfModel, "torch_model", refuse)
    monkeypatch.setattr(checkpoint, "load_model", refuse)
    built: list[Any] = []
    real = streaming.prepare

    def spy(*args: Any, **kwargs: Any) -> Any:
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(streaming, "prepare", spy)
    res = bitpress.run({"input": str(folders["moe"]), "output": str(tmp_path / "o"),
                        "passes": [{"type": "rtn_hf", "moe": True, "lm_head": True, "embeds": True}]})
    assert res.reports[0][2].quantized > 0
    model = built[0].model
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.is_meta and t.data_ptr() == 0 for t in tensors)  # no memory behind any of them


# -- falling back to the in-memory path ---------------------------------------------------------------
def test_per_expert_moe_checkpoints_fall_back(folders: dict, tmp_path: Path, loads: list[Path],
                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="bitpress.hf.streaming"):
        a, b = run_both(folders["moe_per_expert"], tmp_path, [{"type": "rtn_hf", "moe": True}], loads,
                        streamed=False)
    lines = [r.getMessage() for r in caplog.records if FALLBACK in r.getMessage()]
    assert len(lines) == 1 and "converts the checkpoint's tensors" in lines[0]
    assert_same_files(a, b)
    # and the fused checkpoint of the same model, streamed, is the same output
    c, _ = run_both(folders["moe"], tmp_path / "fused", [{"type": "rtn_hf", "moe": True}], loads)
    assert_same_files(a, c)


def test_a_quantized_input_falls_back(folders: dict, tmp_path: Path, loads: list[Path],
                                      caplog: pytest.LogCaptureFixture) -> None:
    passes = [{"type": "rtn_hf"}, {"type": "kquant_hf", "lm_head": True, "embeds": True}]
    with caplog.at_level(logging.INFO, logger="bitpress.hf.streaming"):
        a, b = run_both(folders["tied"], tmp_path, passes, loads)
    assert "already quantized" in caplog.text
    assert_same_files(a, b)
    assert [p["pass"] for p in json.loads(a["config.json"])["quantization_config"]["passes"]] == \
        ["rtn_hf", "kquant_hf"]


def test_pickled_weights_fall_back(folders: dict, tmp_path: Path, loads: list[Path],
                                   caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "pickled"
    shutil.copytree(folders["untied"], src)
    with safe_open(str(src / "model.safetensors"), framework="pt") as sf:
        state = {k: sf.get_tensor(k) for k in sf.keys()}  # noqa: SIM118
    (src / "model.safetensors").unlink()
    torch.save(state, src / "pytorch_model.bin")
    with caplog.at_level(logging.INFO, logger="bitpress.hf.streaming"):
        a, b = run_both(src, tmp_path, [{"type": "rtn_hf", "allow_pickle": True}], loads, streamed=False)
    assert "pickled" in caplog.text
    assert_same_files(a, b)


def test_both_sides_of_a_tie_stored_falls_back(folders: dict, tmp_path: Path, loads: list[Path],
                                               caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "both"
    shutil.copytree(folders["untied"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (src / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.INFO, logger="bitpress.hf.streaming"):
        a, b = run_both(src, tmp_path, [{"type": "rtn_hf", "lm_head": True}], loads, streamed=False)
    assert "both sides of the tie" in caplog.text
    assert_same_files(a, b)


def test_model_code_in_the_folder_falls_back(folders: dict, tmp_path: Path, loads: list[Path],
                                             caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "remote"
    shutil.copytree(folders["untied"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.X"}  # not run without trust_remote_code
    (src / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.INFO, logger="bitpress.hf.streaming"):
        a, b = run_both(src, tmp_path, [{"type": "rtn_hf"}], loads, streamed=False)
    assert "auto_map" in caplog.text
    assert_same_files(a, b)


def test_a_model_in_memory_falls_back(folders: dict, caplog: pytest.LogCaptureFixture) -> None:
    from bitpress_rtn.hf_passes import RtnHfPass

    handle = bitpress.load_model(folders["untied"])
    torch_model = handle.torch_model()
    with caplog.at_level(logging.INFO, logger="bitpress.hf.streaming"):
        out = RtnHfPass.from_config({}).run(handle, PassContext(jobs=1))
    assert out is handle and "already in memory" in caplog.text
    assert type(torch_model.model.layers[0].mlp.up_proj.weight).__name__ == "QuantTensor"


# -- the workflow around it -----------------------------------------------------------------------------
def test_a_streamed_model_exports_to_onnx(folders: dict, tmp_path: Path, loads: list[Path]) -> None:
    pytest.importorskip("onnx")
    import onnx

    passes = [{"type": "rtn_hf", "lm_head": True, "embeds": True, "sym": False}, {"type": "hf_to_onnx"}]
    bitpress.run({"input": str(folders["tied"]), "output": str(tmp_path / "a"), "passes": passes})
    assert folders["tied"].resolve() not in [p.resolve() for p in loads]  # loaded from the streamed folder
    assert len(loads) == 1
    off = [{**passes[0], "stream": False}, passes[1]]
    bitpress.run({"input": str(folders["tied"]), "output": str(tmp_path / "b"), "passes": off})
    a, b = (onnx.load(str(tmp_path / x / "llama_tied" / "model.onnx")) for x in "ab")
    ops = {n.op_type for n in a.graph.node}
    assert {"MatMulNBits", "GatherBlockQuantized"} <= ops
    inits = lambda m: {t.name: t.SerializeToString() for t in m.graph.initializer}  # noqa: E731
    assert inits(a) == inits(b)


def test_a_streamed_model_saved_from_python_links_its_files(folders: dict, tmp_path: Path) -> None:
    from bitpress_rtn.hf_passes import RtnHfPass

    handle = bitpress.load_model(folders["untied"])
    out = RtnHfPass.from_config({"lm_head": True}).run(handle, PassContext(jobs=2, workdir=tmp_path / "scratch"))
    assert isinstance(out, HfModel) and not out.loaded and out.source.is_relative_to(tmp_path / "scratch")
    assert out.source.name == "llama_untied" and out.history[0]["pass"] == "rtn_hf"
    files = out.save(tmp_path / "saved")
    assert {f.name for f in files} == {p.name for p in out.source.iterdir()}
    assert os.stat(files[0]).st_ino == os.stat(out.source / files[0].name).st_ino  # hard-linked, not rewritten
    # saving a model a later pass changed in memory writes it anew
    out.torch_model()
    again = out.save(tmp_path / "again")
    assert (tmp_path / "again" / "config.json").read_bytes() == (tmp_path / "saved" / "config.json").read_bytes()
    assert os.stat(again[0]).st_ino != os.stat(files[0]).st_ino


def test_without_a_scratch_folder_the_temporary_one_goes_with_the_handle(
        folders: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import tempfile

    from bitpress_rtn.hf_passes import RtnHfPass

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = RtnHfPass.from_config({}).run(bitpress.load_model(folders["untied"]), PassContext(jobs=1))
    folder = out.source.parent
    assert folder.parent == tmp_path and out.source.is_dir()
    del out
    gc.collect()
    assert not folder.exists()


@pytest.fixture
def nan_folder(folders: dict, tmp_path: Path) -> Iterator[Path]:
    src = tmp_path / "nan_model"
    shutil.copytree(folders["untied"], src)
    with safe_open(str(src / "model.safetensors"), framework="pt") as sf:
        state = {k: sf.get_tensor(k) for k in sf.keys()}  # noqa: SIM118
    state["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    _resave(src, state)
    yield src


def test_a_failing_run_leaves_no_output_and_no_scratch(nan_folder: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    before = files_of(nan_folder)
    out = tmp_path / "out"
    with pytest.raises(QuantizationError, match="NaN"):
        bitpress.run({"input": str(nan_folder), "output": str(out), "passes": [{"type": "rtn_hf"}], "jobs": 2})
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan_model"]  # no temporary folder beside the output
    assert files_of(nan_folder) == before  # the input untouched
    # run from Python without a scratch folder: its temporary folder is removed too
    from bitpress_rtn.hf_passes import RtnHfPass

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with pytest.raises(QuantizationError, match="NaN"):
        RtnHfPass.from_config({}).run(bitpress.load_model(nan_folder), PassContext(jobs=1))
    assert list(tmp.iterdir()) == []


def test_the_stream_option_is_checked_and_listed() -> None:
    from bitpress.hf.rules import HfQuantOptions
    from bitpress.options import describe

    assert {o.name: o.default for o in describe(HfQuantOptions)}["stream"] is True
    with pytest.raises(Exception, match="stream"):
        bitpress.run({"input": "x", "output": "y", "passes": [{"type": "rtn_hf", "stream": "yes"}]})


# -- the writer -------------------------------------------------------------------------------------
def _random_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    dtypes = [torch.uint8, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool,
              torch.float64, torch.int32]
    out = {}
    for i in range(24):
        dt = rng.choice(dtypes)
        shape = tuple(rng.randint(0, 5) if rng.random() < 0.1 else rng.randint(1, 7) for _ in range(rng.randint(0, 3)))
        t = torch.randn(shape, generator=g) * 50
        name = rng.choice(["model.", "lm_head.", "a", "Z_", "layers.10.", "layers.9."]) + f"{i}.weight"
        out[name] = t.to(dt)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_writer_writes_what_save_file_writes(seed: int, tmp_path: Path) -> None:
    tensors = _random_tensors(seed)
    tensors["model.embed_tokens.weight_qweight"] = torch.randint(0, 255, (64, 2, 16), dtype=torch.uint8)
    tensors["model.embed_tokens.weight_scales"] = torch.rand(64, 2)
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    tensors["model.half"] = torch.ones(3, 5, dtype=torch.float16)
    ref = tmp_path / "ref.safetensors"
    save_file(tensors, str(ref), metadata={"format": "pt"})
    entries = [Entry(k, stream_checkpoint.SAFETENSORS_CODES[v.dtype], tuple(v.shape)) for k, v in tensors.items()]
    random.Random(seed).shuffle(entries)
    path = tmp_path / "ours.safetensors"
    with SafetensorsWriter(path, entries, {"format": "pt"}) as w:
        for name in random.Random(seed + 1).sample(list(tensors), len(tensors)):  # in any order, in pieces
            raw = tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy()
            cut = len(raw) // 3
            w.write(name, raw[cut:], cut)
            w.write(name, raw[:cut])
    assert path.read_bytes() == ref.read_bytes()
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert n % 8 == 0


def test_the_writer_refuses_a_tensor_not_written_whole(tmp_path: Path) -> None:
    entries = [Entry("a", "F32", (2, 2)), Entry("b", "U8", (3,))]
    with pytest.raises(OutputError, match="tensor a got 8 of its 16 bytes"), \
            SafetensorsWriter(tmp_path / "x.safetensors", entries) as w:
        w.write("a", b"\0" * 8)
        w.write("b", b"abc")
    with pytest.raises(ValueError, match="do not fit"), SafetensorsWriter(tmp_path / "y.safetensors", entries) as w:
        w.write("b", b"abcd")
    with pytest.raises(FileExistsError):  # never over an existing file
        SafetensorsWriter(tmp_path / "y.safetensors", entries)


def test_shards_keep_groups_together() -> None:
    groups = [[Entry("a", "U8", (10,))], [Entry("b_qweight", "U8", (30,)), Entry("b_scales", "F32", (2,))],
              [Entry("c", "U8", (5,))], [Entry("d", "U8", (100,))], [Entry("e", "U8", (1,))]]
    shards = plan_shards(groups, 40)
    assert [[e.name for e in s] for s in shards] == [["a"], ["b_qweight", "b_scales"], ["c"], ["d"], ["e"]]
    assert [[e.name for e in s] for s in plan_shards(groups, 1000)] == [["a", "b_qweight", "b_scales", "c", "d",
                                                                        "e"]]
    assert safetensors_writer.shard_names(3) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_checkpoint_reads_stay_in_the_folder(folders: dict, tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    shutil.copy(folders["untied"] / "model.safetensors", outside)
    src = tmp_path / "linked"
    shutil.copytree(folders["untied"], src)
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").symlink_to(outside)
    from bitpress.errors import UnsafePathError

    with pytest.raises(UnsafePathError):
        stream_checkpoint.CheckpointFiles(src)
    with pytest.raises(UnsafePathError):
        bitpress.run({"input": str(src), "output": str(tmp_path / "o"), "passes": [{"type": "rtn_hf"}]})


def test_calibrated_passes_refuse_stream() -> None:
    """gptq_hf runs the model forward: it always loads it, and says so rather than ignore the option."""
    from bitpress.errors import OptionError
    from bitpress.plugins import get_registry

    pytest.importorskip("bitpress_gptq")
    cls = get_registry().get_pass("gptq_hf")
    assert cls.from_config({}, None).options.stream is False
    with pytest.raises(OptionError, match="a calibrated pass runs the model"):
        cls.from_config({"stream": True}, None)


def test_streaming_on_ray_gives_the_threads_bytes(folders: dict, tmp_path: Path) -> None:
    """With a Ray executor each weight's solve is a task that reads its rows from the shard itself
    (file, offset, dtype, shape); the folder written is the thread pool's, byte for byte."""
    ray = pytest.importorskip("ray")
    import tempfile

    from bitpress.executors import _loopback

    tmp = tempfile.mkdtemp(prefix="bp-ray-")
    with _loopback(True):
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _node_ip_address="127.0.0.1", _temp_dir=tmp, object_store_memory=128 << 20)
    try:
        for key, passes in (("tied", [{"type": "rtn_hf", "lm_head": True, "embeds": True, "sym": False}]),
                            ("sharded", [{"type": "kquant_hf", "embeds": True}])):
            src = folders[key]
            bitpress.run({"input": str(src), "output": str(tmp_path / key / "threads"), "passes": passes})
            bitpress.run({"input": str(src), "output": str(tmp_path / key / "ray"), "passes": passes,
                          "executor": "ray"})
            assert_same_files(files_of(tmp_path / key / "ray" / src.name),
                              files_of(tmp_path / key / "threads" / src.name))
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def test_remote_solve_is_small_and_reads_its_rows(folders: dict) -> None:
    """A task carries where the tensor is, not the tensor; solved in this process it gives the threads' arrays."""
    import pickle

    from bitpress.hf.rules import HfQuantOptions
    from bitpress_rtn.solver import rtn_solver

    ckpt = stream_checkpoint.CheckpointFiles(folders["untied"])
    try:
        prepared = streaming.prepare(folders["untied"], ckpt, HfQuantOptions(lm_head=True).rules(),
                                     float_zero_points=False)
        units = [u for u in prepared.units if u.job is not None]
        for unit in units[:3]:
            task = streaming.remote_task(ckpt, unit)
            assert len(pickle.dumps(task)) < 1000
            arrays, error = streaming.solve_remote(task, rtn_solver)
            local = streaming._solve(ckpt, unit, rtn_solver)
            assert error == local.error and all((a == b).all() for a, b in zip(arrays, local.arrays, strict=True))
    finally:
        ckpt.close()
