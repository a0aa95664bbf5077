"""Saving ONNX models that always load: the seed regression and the save/load promises.

Seed (000): after quantization the output referenced external data that was never written
(a ``Constant`` node's tensor), so ``onnx.load`` failed with "should be stored in ... but it
doesn't exist". Here every output is loaded by plain ``onnx``, the checker and ONNX Runtime
from an unrelated working directory, for a rewriting pass and for a pass that changes nothing.
"""

from __future__ import annotations

import builtins
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import bitpress.models.onnx_model as onnx_model_mod
from bitpress import api, hookimpl
from bitpress.errors import ModelLoadError, ValidationError
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.graph import MS_DOMAIN
from bitpress.onnx.save import SaveOptions, save_onnx
from bitpress.onnx.tensors import is_external, iter_tensors
from bitpress.passes import Pass, PassContext
from bitpress.plugins import Registry
from bitpress.synthetic import build_decoder, random_inputs

VOCAB = 512  # the Constant bias below is then 2 KiB: above the 1 KiB inline threshold
CONST_NAME = "/lm_head/Constant_attr::value"


# -- test passes -------------------------------------------------------------------------------------
class NoopPass(Pass):
    name = "noop"
    algorithms = ("noop",)
    summary = "returns the model unchanged"

    def run(self, model: Any, context: PassContext) -> Any:
        return model


class AddMsNodePass(Pass):
    """Inserts a com.microsoft op without declaring the domain: the saver must declare it."""

    name = "add-ms-node"
    algorithms = ("add-ms-node",)

    def run(self, model: Any, context: PassContext) -> Any:
        graph = model.graph
        out = graph.output[0].name
        for node in graph.node:
            node.output[:] = [f"{out}_pre" if o == out else o for o in node.output]
        # FastGelu is com.microsoft only; applied to the logits it keeps the graph runnable
        graph.node.append(helper.make_node("FastGelu", [f"{out}_pre"], [out], domain=MS_DOMAIN))
        return model


class BreakCheckerPass(Pass):
    """Adds an op unknown to the ONNX checker (but known to ORT) to a clean model."""

    name = "break-checker"
    algorithms = ("break-checker",)

    def run(self, model: Any, context: PassContext) -> Any:
        graph = model.graph
        out = graph.output[0].name
        for node in graph.node:
            node.output[:] = [f"{out}_pre" if o == out else o for o in node.output]
        scale = numpy_helper.from_array(np.ones(VOCAB, np.float32), "sln_scale")
        graph.initializer.append(scale)
        graph.node.append(helper.make_node(
            "SimplifiedLayerNormalization", [f"{out}_pre", "sln_scale"], [out], axis=-1, epsilon=1e-5,
        ))
        return model


def _plugin(*classes: type[Pass]) -> SimpleNamespace:
    @hookimpl
    def bitpress_register_passes(register):
        for cls in classes:
            register(cls)

    return SimpleNamespace(bitpress_register_passes=bitpress_register_passes)


@pytest.fixture
def registry(make_registry) -> Registry:
    return make_registry(("io-test", _plugin(NoopPass, AddMsNodePass, BreakCheckerPass)))


# -- models --------------------------------------------------------------------------------------------
def _seed_model(folder: Path) -> Path:
    """A decoder with external weights and a ``Constant`` whose tensor is external data too."""
    path = build_decoder(folder / "model.onnx", hidden=64, layers=2, heads=4, vocab=VOCAB, external_data=True)
    data = folder / "model.onnx.data"
    bias = np.random.default_rng(1).standard_normal(VOCAB).astype(np.float32)
    offset = -(-data.stat().st_size // 64) * 64
    with data.open("r+b") as f:
        f.seek(offset)
        f.write(bias.tobytes())
    proto = onnx.load(str(path), load_external_data=False)
    tensor = TensorProto(name=CONST_NAME, dims=[VOCAB], data_type=TensorProto.FLOAT)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", data.name), ("offset", offset), ("length", bias.nbytes)):
        tensor.external_data.add(key=key, value=str(value))
    graph = proto.graph
    for node in graph.node:
        node.output[:] = ["logits_nobias" if o == "logits" else o for o in node.output]
    graph.node.append(helper.make_node("Constant", [], ["/lm_head/bias"], name="/lm_head/Constant", value=tensor))
    graph.node.append(helper.make_node("Add", ["logits_nobias", "/lm_head/bias"], ["logits"], name="/lm_head/Add"))
    path.write_bytes(proto.SerializeToString())
    return path


def _external_locations(path: Path) -> set[str]:
    proto = onnx.load(str(path), load_external_data=False)
    locations = set()
    for t in iter_tensors(proto):
        if is_external(t):
            locations.add({e.key: e.value for e in t.external_data}["location"])
    return locations


def _constant_tensor(proto: onnx.ModelProto) -> onnx.TensorProto:
    node = next(n for n in proto.graph.node if n.op_type == "Constant" and n.output[0] == "/lm_head/bias")
    return node.attribute[0].t


def _assert_loads_anywhere(path: Path, elsewhere: Path, monkeypatch: pytest.MonkeyPatch) -> onnx.ModelProto:
    """Plain onnx, the checker (with external data) and ORT, all from an unrelated folder."""
    elsewhere.mkdir(exist_ok=True)
    monkeypatch.chdir(elsewhere)
    for location in _external_locations(path):
        assert not Path(location).is_absolute() and ".." not in Path(location).parts, location
        assert (path.parent / location).is_file(), f"{location} referenced but not written"
    proto = onnx.load(str(path))  # reads the external data: fails the seed way if a file is missing
    onnx.checker.check_model(str(path))
    for t in iter_tensors(proto):
        assert not is_external(t), f"{t.name} still external after onnx.load"
    return proto


SAVE_MODES = {
    "default": {},
    "external": {"external_data": True},
    "sharded": {"max_shard_size": 64 << 10},
}


# -- the seed regression -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(SAVE_MODES))
@pytest.mark.parametrize("algorithm", ["noop", "rtn"])
def test_seed_outputs_load_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: Registry, ort_outputs, mode: str, algorithm: str,
) -> None:
    src = _seed_model(tmp_path / "src")
    feeds = random_inputs(src)
    expected = ort_outputs(src, feeds)
    # relative paths, as users type them
    monkeypatch.chdir(tmp_path)
    result = api.quantize(
        Path("src/model.onnx"), Path("dst/quantized.onnx"), algorithm=algorithm,
        precision="int4" if algorithm == "rtn" else None, registry=registry, **SAVE_MODES[mode],
    )
    out = tmp_path / "dst" / "quantized.onnx"
    written = sorted(p.name for p in out.parent.iterdir())
    assert sorted(Path(f).name for f in result.files) == written

    proto = _assert_loads_anywhere(out, tmp_path / "elsewhere", monkeypatch)
    # the Constant's tensor survived with its bytes, whatever storage it had
    np.testing.assert_array_equal(
        numpy_helper.to_array(_constant_tensor(proto)),
        np.random.default_rng(1).standard_normal(VOCAB).astype(np.float32),
    )
    got = ort_outputs(out, feeds)
    if algorithm == "noop":
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a, b)
    else:
        assert any(n.op_type == "MatMulNBits" for n in proto.graph.node)
        assert got[0].shape == expected[0].shape and np.isfinite(got[0]).all()
        corr = np.corrcoef(got[0].ravel(), expected[0].ravel())[0, 1]
        assert corr > 0.9, corr

    if mode in ("default", "external"):  # the seed keeps its weights in external data: so does the output
        assert written == ["quantized.onnx", "quantized.onnx.data"]
        assert _external_locations(out) == {"quantized.onnx.data"}
        assert is_external(_constant_tensor(onnx.load(str(out), load_external_data=False)))
    else:
        assert len(written) > 2, f"expected several shards, got {written}"
        assert _external_locations(out) == set(written) - {"quantized.onnx"}
    # the input is only ever read, and no scratch or temp folder survives
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == ["model.onnx", "model.onnx.data"]
    assert not [p for p in tmp_path.rglob("*") if ".bitpress-" in p.name or p.name.startswith("spill-")]


@pytest.mark.parametrize("mode", ["default", "external"])
def test_spilled_tensors_never_leak_into_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_decoder_external: Path, ort_outputs, mode: str,
) -> None:
    """New tensors written to the run's scratch file must be copied, not referenced."""
    monkeypatch.setattr(onnx_model_mod, "SPILL_THRESHOLD", 0)  # every new tensor goes to scratch
    out = tmp_path / "out" / "q.onnx"
    api.quantize(tiny_decoder_external, out, algorithm="rtn", precision="int4", **SAVE_MODES[mode])
    locations = _external_locations(out)
    assert all(not loc.startswith("spill-") for loc in locations), locations
    _assert_loads_anywhere(out, tmp_path / "elsewhere", monkeypatch)
    feeds = random_inputs(tiny_decoder_external)
    assert np.isfinite(ort_outputs(out, feeds)[0]).all()
    assert not [p for p in tmp_path.rglob("*") if ".bitpress-" in p.name]


@pytest.mark.parametrize("fixture", ["tiny_decoder", "tiny_decoder_external", "tiny_encoder"])
@pytest.mark.parametrize("mode", list(SAVE_MODES))
def test_noop_roundtrip_is_exact(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: Registry,
    ort_outputs, fixture: str, mode: str,
) -> None:
    src: Path = request.getfixturevalue(fixture)
    out = tmp_path / "out.onnx"
    api.quantize(src, out, algorithm="noop", registry=registry, **SAVE_MODES[mode])
    _assert_loads_anywhere(out, tmp_path / "elsewhere", monkeypatch)
    feeds = random_inputs(src)
    for a, b in zip(ort_outputs(out, feeds), ort_outputs(src, feeds), strict=True):
        np.testing.assert_array_equal(a, b)
    # same tensors, same bytes (storage may differ)
    before = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(src)).graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    assert before.keys() == after.keys()
    for name, arr in before.items():
        np.testing.assert_array_equal(after[name], arr, err_msg=name)


def _subgraph_model(folder: Path) -> Path:
    """An ``If`` whose branches read external tensors: a Constant and a subgraph initializer."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal(VOCAB).astype(np.float32) for _ in range(2))
    data = folder / "weights.bin"  # not the <model>.data naming: any relative location is valid
    data.write_bytes(a.tobytes() + b.tobytes())

    def external(name: str, offset: int) -> TensorProto:
        t = TensorProto(name=name, dims=[VOCAB], data_type=TensorProto.FLOAT)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", data.name), ("offset", offset), ("length", VOCAB * 4)):
            t.external_data.add(key=key, value=str(value))
        return t

    def vinfo(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch_size", VOCAB])

    then_g = helper.make_graph(
        [helper.make_node("Constant", [], ["ca"], value=external("then_const", 0)),
         helper.make_node("Add", ["x", "ca"], ["then_y"])], "then", [], [vinfo("then_y")])
    else_g = helper.make_graph(
        [helper.make_node("Mul", ["x", "else_w"], ["else_y"])], "else", [], [vinfo("else_y")],
        initializer=[external("else_w", VOCAB * 4)])
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g)], "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, []), vinfo("x")], [vinfo("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("mode", list(SAVE_MODES))
def test_external_tensors_in_subgraphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: Registry, ort_outputs, mode: str
) -> None:
    src = _subgraph_model(tmp_path / "src")
    out = tmp_path / "dst" / "model.onnx"
    api.quantize(src, out, algorithm="noop", registry=registry, **SAVE_MODES[mode])
    _assert_loads_anywhere(out, tmp_path / "elsewhere", monkeypatch)
    x = np.random.default_rng(3).standard_normal((2, VOCAB)).astype(np.float32)
    for cond in (True, False):
        feeds = {"cond": np.array(cond), "x": x}
        np.testing.assert_array_equal(ort_outputs(out, feeds)[0], ort_outputs(src, feeds)[0])


# -- save options --------------------------------------------------------------------------------------------
def test_external_data_layout(tmp_path: Path, tiny_decoder: Path) -> None:
    """``external_data=True``: ``<name>.onnx.data`` beside the model, relative, in bounds, aligned."""
    model = OnnxModel.load(tiny_decoder)
    before = model.proto.SerializeToString()
    files = save_onnx(model, tmp_path / "m.onnx", SaveOptions(external_data=True))
    assert [f.name for f in files] == ["m.onnx", "m.onnx.data"]
    proto = onnx.load(str(files[0]), load_external_data=False)
    size = files[1].stat().st_size
    n_external = 0
    for t in iter_tensors(proto):
        if is_external(t):
            n_external += 1
            info = {e.key: e.value for e in t.external_data}
            assert info["location"] == "m.onnx.data"
            assert int(info["offset"]) % 64 == 0
            assert int(info["offset"]) + int(info["length"]) <= size
        else:
            assert t.ByteSize() < 2048, f"{t.name} should be external"
    assert n_external >= 10
    # the handle itself is untouched by saving, and still savable elsewhere as one file
    assert model.proto.SerializeToString() == before
    save_onnx(model, tmp_path / "again.onnx")
    assert not (tmp_path / "again.onnx.data").exists()


def test_default_storage_follows_the_input(tmp_path: Path, tiny_decoder: Path, tiny_decoder_external: Path) -> None:
    """By default the output keeps the input's storage: one file stays one file, external data stays external."""
    single = save_onnx(OnnxModel.load(tiny_decoder), tmp_path / "a" / "m.onnx")
    assert [f.name for f in single] == ["m.onnx"]
    external = OnnxModel.load(tiny_decoder_external)
    assert external.external_source and not OnnxModel.load(tiny_decoder).external_source
    assert [f.name for f in save_onnx(external, tmp_path / "b" / "m.onnx")] == ["m.onnx", "m.onnx.data"]
    asked = save_onnx(external, tmp_path / "c" / "m.onnx", SaveOptions(external_data=False))
    assert [f.name for f in asked] == ["m.onnx"]


def test_sharded_files_each_respect_the_limit(tmp_path: Path, tiny_decoder_external: Path) -> None:
    limit = 48 << 10
    files = save_onnx(OnnxModel.load(tiny_decoder_external), tmp_path / "m.onnx", SaveOptions(max_shard_size=limit))
    shards = files[1:]
    assert [f.name for f in shards] == ["m.onnx.data"] + [f"m.onnx.data.{i}" for i in range(1, len(shards))]
    assert len(shards) > 3
    proto = onnx.load(str(files[0]), load_external_data=False)
    biggest = max(t.ByteSize() if not is_external(t) else int(
        {e.key: e.value for e in t.external_data}["length"]) for t in iter_tensors(proto))
    for shard in shards:
        # a tensor larger than the limit gets a shard of its own, nothing else exceeds it
        assert shard.stat().st_size <= max(limit, biggest)
    assert {s.name for s in shards} == _external_locations(files[0])


def test_single_file_refused_over_2gb(tmp_path: Path, tiny_decoder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the protobuf limit a single file is refused with a hint; default switches to external."""
    import bitpress.onnx.save as save_mod
    from bitpress.errors import OutputError

    monkeypatch.setattr(save_mod, "SINGLE_FILE_LIMIT", 100_000)  # pretend the tiny model is huge
    model = OnnxModel.load(tiny_decoder)
    with pytest.raises(OutputError, match="external"):
        save_onnx(model, tmp_path / "one.onnx", SaveOptions(external_data=False))
    files = save_onnx(model, tmp_path / "auto.onnx")
    assert [f.name for f in files] == ["auto.onnx", "auto.onnx.data"]


def test_microsoft_opset_declared(tmp_path: Path, tiny_decoder: Path, registry: Registry, ort_outputs) -> None:
    for algorithm, precision in (("rtn", "int4"), ("add-ms-node", None)):
        out = tmp_path / f"{algorithm}.onnx"
        api.quantize(tiny_decoder, out, algorithm=algorithm, precision=precision, registry=registry)
        proto = onnx.load(str(out))
        domains = {o.domain: o.version for o in proto.opset_import}
        assert domains.get(MS_DOMAIN) == 1, domains
        assert any(n.domain == MS_DOMAIN for n in proto.graph.node)
        ort_outputs(out, random_inputs(tiny_decoder))


# -- lazy loading -------------------------------------------------------------------------------------------
def test_load_checks_external_data_without_reading_it(
    tmp_path: Path, tiny_decoder_external: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(tiny_decoder_external.parent, tmp_path / "m")
    data = tmp_path / "m" / "model.onnx.data"
    size = data.stat().st_size
    data.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())

    opened: list[str] = []
    real_open = builtins.open

    def spy_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy_open)
    model = OnnxModel.load(tmp_path / "m" / "model.onnx")
    monkeypatch.undo()
    assert not [f for f in opened if f.endswith(".data")], "loading read the external data"
    external = [t for t in iter_tensors(model.proto) if is_external(t)]
    assert external, "the tensors must stay external after loading"
    # the garbage is only seen when a pass asks for a tensor (memory-mapped, not copied)
    arr = model.array(external[0])
    assert isinstance(arr, np.memmap)

    # presence and size are checked up front
    data.write_bytes(data.read_bytes()[: size // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        OnnxModel.load(tmp_path / "m" / "model.onnx")
    data.unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        OnnxModel.load(tmp_path / "m" / "model.onnx")


# -- ORT-only ops in the default domain ------------------------------------------------------------------------
def _sln_model(path: Path) -> Path:
    """What ORT GenAI's builder emits: SimplifiedLayerNormalization in the default domain.

    ONNX Runtime runs it, the ONNX checker rejects it ("No Op registered").
    """
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 128)).astype(np.float32) * 0.1
    graph = helper.make_graph(
        [
            helper.make_node("SimplifiedLayerNormalization", ["x", "scale"], ["n"], axis=-1, epsilon=1e-5),
            helper.make_node("MatMul", ["n", "proj.weight"], ["y"], name="/proj/MatMul"),
        ],
        "sln",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", 128])],
        initializer=[numpy_helper.from_array(np.ones(64, np.float32), "scale"),
                     numpy_helper.from_array(w, "proj.weight")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.save(model, str(path))
    return path


def test_ort_only_op_input_is_saved(tmp_path: Path, registry: Registry, ort_outputs) -> None:
    src = _sln_model(tmp_path / "sln.onnx")
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(str(src))
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)}
    for algorithm, precision in (("noop", None), ("rtn", "int4")):
        out = tmp_path / f"{algorithm}.onnx"
        api.quantize(src, out, algorithm=algorithm, precision=precision, options=None, registry=registry)
        got = ort_outputs(out, feeds)[0]
        ref = ort_outputs(src, feeds)[0]
        if algorithm == "noop":
            np.testing.assert_array_equal(got, ref)
        else:
            assert any(n.op_type == "MatMulNBits" for n in onnx.load(str(out)).graph.node)
            assert np.abs(got - ref).max() < 0.25 * np.abs(ref).max()


def test_new_checker_failure_is_an_error(tmp_path: Path, registry: Registry, tiny_decoder: Path) -> None:
    """The tolerance above is only for failures the input shares: a pass may not add one."""
    src = tmp_path / "in" / "model.onnx"
    src.parent.mkdir()
    build_decoder(src, vocab=VOCAB)
    out = tmp_path / "out" / "broken.onnx"
    with pytest.raises(ValidationError, match="checker"):
        api.quantize(src, out, algorithm="break-checker", registry=registry)
    assert not out.exists()
    assert not [p for p in tmp_path.rglob("*") if ".bitpress-" in p.name]


# -- ONNX Runtime GenAI folders ---------------------------------------------------------------------------------
def test_genai_folder_companions_copied_byte_for_byte(
    tmp_path: Path, genai_folder: Path, sha256_tree, ort_outputs, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = sha256_tree(genai_folder)
    out = tmp_path / "quantized"
    api.quantize(genai_folder, out, algorithm="rtn", precision="int4")
    assert sha256_tree(genai_folder) == before, "the input folder changed"
    after = sha256_tree(out)
    assert after.keys() == before.keys()
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"model.onnx"}
    _assert_loads_anywhere(out / "model.onnx", tmp_path / "elsewhere", monkeypatch)
    ort_outputs(out / "model.onnx", random_inputs(genai_folder / "model.onnx"))
