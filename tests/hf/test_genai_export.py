"""hf_to_genai: tiny Llamas through the real ONNX Runtime GenAI builder; quantized ones keep their integers."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

pytest.importorskip("onnxruntime_genai.models.builder")
pytest.importorskip("onnx_ir")

from bitpress.errors import ExportError
from bitpress.hf.olive import pack_zero_points


def _tokenized_folder(model: Any, folder: Path) -> Path:
    """save_pretrained plus a real (WordLevel) tokenizer and a generation config: what the builder needs."""
    from bitpress.hf.tiny import save_with_tokenizer

    return save_with_tokenizer(model, folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = {}
    root = tmp_path_factory.mktemp("genai")
    for tied in (False, True):
        torch.manual_seed(3 + tied)
        m = LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)).eval()
        with torch.no_grad():  # weights large enough that rounding differences show in the logits
            for p in m.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.1)
        out["tied" if tied else "untied"] = _tokenized_folder(m, root / ("tied" if tied else "untied"))
    return out


def _run(passes: list[dict[str, Any]], src: Path, out: Path) -> Path:
    import bitpress

    bitpress.run({"input": str(src), "output": str(out), "passes": passes})
    return out / src.name  # a folder output mirrors the input's name


def _initializer(graph: onnx.GraphProto, name: str) -> tuple[str, onnx.TensorProto]:
    """The initializer behind ``name``, through the Reshape a tied head reads its table by."""
    inits = {t.name: t for t in graph.initializer}
    while name not in inits:
        node = next(n for n in graph.node if name in n.output)
        assert node.op_type == "Reshape", node
        name = node.input[0]
    return name, inits[name]


def _matmuls(folder: Path) -> dict[str, dict[str, Any]]:
    m = onnx.load(str(folder / "model.onnx"))
    out = {}
    for n in m.graph.node:
        if n.op_type == "MatMulNBits":
            got: dict[str, Any] = {}
            for k, i in zip(("b", "scales", "zp"), n.input[1:4], strict=False):
                if i:
                    got[f"{k}_name"], t = _initializer(m.graph, i)
                    got[k] = numpy_helper.to_array(t, base_dir=str(folder))
            out[n.name] = got
    return out


def _modules(node: str) -> list[str]:
    """The checkpoint's modules behind a node name: the builder's (q/k/v fused into one) or mobius's."""
    if node.startswith(("/lm_head/", "lm_head/")):
        return ["lm_head"]
    if not node.startswith("/"):  # mobius: model/layers.0/self_attn/q_proj/MatMulNBits_node_11
        return [node.rsplit("/", 1)[0].replace("/", ".")]
    layer, block, proj = re.match(r"/model/layers\.(\d+)/(attn|mlp)/(\w+)/MatMulNBits", node).groups()  # type: ignore[union-attr]
    prefix = f"model.layers.{layer}." + ("self_attn" if block == "attn" else "mlp")
    if proj == "qkv_proj":
        return [f"{prefix}.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    return [f"{prefix}.{proj}"]


def _checkpoint(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    return qc, load_file(str(folder / "model.safetensors"))


def _expected(qc: dict[str, Any], t: dict[str, np.ndarray], name: str) -> tuple[np.ndarray, ...]:
    """The checkpoint's integers ``[rows, blocks, blob]``, scales ``[rows, blocks]`` and packed zero points."""
    spec = qc["modules"][name]
    rows = int(np.prod(spec["shape"][:-1]))
    nb = -(-spec["shape"][-1] // spec["group_size"])
    zp = t.get(f"{name}_qzeros")
    zp = np.full((rows, nb), 2 ** (spec["bits"] - 1), np.uint8) if zp is None else zp.reshape(rows, nb)
    return (t[f"{name}_qweight"].reshape(rows, nb, -1), t[f"{name}_scales"].reshape(rows, nb),
            pack_zero_points(zp, spec["bits"]))


def _assert_same_integers(ckpt: Path, package: Path) -> int:
    """Every MatMulNBits holds the checkpoint's integers, scales and zero points (a missing zero-point input:
    the implied 2**(bits-1), which symmetric weights have)."""
    qc, t = _checkpoint(ckpt)
    tied = {g[1]: g[0] for g in qc.get("tied", []) if len(g) > 1}
    checked = 0
    for node, got in _matmuls(package).items():
        parts = [_expected(qc, t, tied.get(f"{mod}.weight", f"{mod}.weight")) for mod in _modules(node)]
        b, s, z = (np.concatenate(x) for x in zip(*parts, strict=True))
        np.testing.assert_array_equal(got["b"].reshape(b.shape), b, err_msg=node)
        np.testing.assert_array_equal(got["scales"].reshape(s.shape), s, err_msg=node)
        if "zp" in got:
            np.testing.assert_array_equal(got["zp"].reshape(z.shape), z, err_msg=node)
        else:
            assert all(f"{tied.get(f'{m}.weight', f'{m}.weight')}_qzeros" not in t for m in _modules(node)), node
        checked += 1
    return checked


def _logits_og(package: Path, prompt: list[int]) -> np.ndarray:
    import onnxruntime_genai as og

    m = og.Model(str(package))
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=len(prompt) + 1)
    gen = og.Generator(m, params)
    gen.append_tokens(np.array([prompt], dtype=np.int32))
    return np.asarray(gen.get_output("logits"))[0, -1]


def _logits_torch(folder: Path, prompt: list[int]) -> np.ndarray:
    import torch

    from bitpress.hf.checkpoint import load_model

    model, _ = load_model(folder)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].numpy()


@pytest.mark.parametrize("exporter", ["builder", "mobius"])
@pytest.mark.parametrize(("which", "sym", "lm_head"), [("untied", False, False), ("untied", True, True),
                                                        ("tied", False, True), ("tied", True, False)])
def test_quantized_checkpoint_keeps_its_integers(tiny: dict[str, Path], tmp_path: Path, which: str, sym: bool,
                                                 lm_head: bool, exporter: str) -> None:
    """rtn_hf int4 -> checkpoint -> hf_to_genai: every MatMulNBits holds the checkpoint's integers, scales and
    zero points; the package generates, and its logits are the quantized PyTorch model's (float32 math)."""
    rtn = {"type": "rtn_hf", "bits": 4, "group_size": 32, "sym": sym, "lm_head": lm_head,
           "embeds": lm_head and which == "tied"}  # the tied table, quantized once for both
    ckpt = _run([rtn], tiny[which], tmp_path / "ckpt")
    package = _run([{"type": "hf_to_genai", "exporter": exporter, "accuracy_level": 1}], ckpt, tmp_path / "pkg")
    assert (package / "genai_config.json").exists() and (package / "tokenizer.json").exists()
    n = _assert_same_integers(ckpt, package)
    assert n == 2 * (5 if exporter == "builder" else 7) + lm_head  # the builder fuses q/k/v (+ the head)
    graph = onnx.load(str(package / "model.onnx"), load_external_data=False).graph
    ops = {nd.op_type: nd for nd in graph.node}
    float_tables = [t.name for t in graph.initializer if sorted(t.dims) == [64, 256]]
    if which == "tied" and lm_head:  # one table, read by GatherBlockQuantized and by the head (reshaped)
        assert not float_tables, float_tables
        table, _ = _initializer(graph, ops["GatherBlockQuantized"].input[0])
        head = _matmuls(package)[next(k for k in _matmuls(package) if "lm_head" in k)]
        assert head["b_name"] == table
        assert head["scales_name"] == _initializer(graph, ops["GatherBlockQuantized"].input[2])[0]
        assert sum(1 for t in graph.initializer if t.name.endswith(("qweight", ".weight")) and 256 in t.dims) == 1
    elif which == "tied":  # one float table, read by the Gather and the head's MatMul
        assert len(float_tables) == 1 and "GatherBlockQuantized" not in ops
    else:  # a float head stays float (the builder would round it itself)
        assert len(float_tables) == 2 - lm_head
    prompt = [5, 17, 42, 9]
    np.testing.assert_allclose(_logits_og(package, prompt), _logits_torch(ckpt, prompt), atol=2e-4, rtol=1e-4)


def test_mixed_bits_in_qkv_unfuse_them(tiny: dict[str, Path], tmp_path: Path) -> None:
    """Layer 0's k_proj at 8 bits beside 4-bit q/v: the builder's fused q/k/v would write a broken graph
    (layer 1 reading layer 0's keys), so the checkpoint asks for fuse_qkv=false; 8-bit weights and other
    group sizes keep their integers too (olive overrides)."""
    rtn = {"type": "rtn_hf", "bits": 4, "group_size": 32, "sym": False,
           "overrides": {"re:model\\.layers\\.0\\.self_attn\\.k_proj": {"bits": 8},
                         "re:.*\\.down_proj": {"bits": 8, "group_size": 64}}}
    ckpt = _run([rtn], tiny["untied"], tmp_path / "ckpt")
    package = _run([{"type": "hf_to_genai", "accuracy_level": 1}], ckpt, tmp_path / "pkg")
    assert _assert_same_integers(ckpt, package) == 2 * 7
    bits = {n.name: int(a.i) for n in onnx.load(str(package / "model.onnx"), load_external_data=False).graph.node
            if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert {n for n, b in bits.items() if b == 8} == {"/model/layers.0/attn/k_proj/MatMulNBits",
                                                      "/model/layers.0/mlp/down_proj/MatMulNBits",
                                                      "/model/layers.1/mlp/down_proj/MatMulNBits"}
    prompt = [7, 3, 99]
    np.testing.assert_allclose(_logits_og(package, prompt), _logits_torch(ckpt, prompt), atol=2e-4, rtol=1e-4)


def test_float_checkpoint_builds_at_each_dtype(tiny: dict[str, Path], tmp_path: Path) -> None:
    """f16 for cpu: the builder's package fails at its first decode step after a prefill (measured), so auto takes
    mobius, whose package passes the check against transformers at f16's tolerance; the builder is refused."""
    pkg = _run([{"type": "hf_to_genai", "dtype": "f16"}], tiny["tied"], tmp_path / "pkg")
    g = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    assert not any(n.op_type == "MatMulNBits" for n in g.graph.node)
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in g.graph.initializer)
    made = json.loads((pkg / "bitpress-manifest.json").read_text())["made"]
    assert made["exporter"] == "mobius build" and made["check"]["tolerance"] == 0.02
    with pytest.raises(ExportError, match=r"builder 0.18's f16 packages for cpu fail .*use --exporter mobius"):
        _run([{"type": "hf_to_genai", "dtype": "f16", "exporter": "builder"}], tiny["tied"], tmp_path / "pkg2")


@pytest.mark.parametrize(("rtn", "match"), [
    ({"type": "kquant_hf", "bits": 4, "group_size": 32}, "float zero points"),
    ({"type": "rtn_hf", "bits": 4, "group_size": 32, "modules_to_not_convert": ["down_proj"]}, "every decoder linear"),
])
def test_unfaithful_checkpoints_are_refused_before_the_build(tiny: dict[str, Path], tmp_path: Path,
                                                            rtn: dict[str, Any], match: str) -> None:
    ckpt = _run([rtn], tiny["untied"], tmp_path / "ckpt")
    with pytest.raises(ExportError, match=match):
        _run([{"type": "hf_to_genai"}], ckpt, tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists() or not any((tmp_path / "pkg").iterdir())


def test_builder_failure_is_one_line_with_its_reason(tiny: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"the GenAI builder failed on untied: ValueError: shared_embeddings=true"):
        _run([{"type": "hf_to_genai", "builder_options": {"shared_embeddings": True}}], tiny["untied"],
             tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists() or not any((tmp_path / "pkg").iterdir())


def test_manifest_and_verify_catch_a_deleted_shard_and_a_truncated_file(tiny: dict[str, Path], tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    from bitpress.cli import main
    from bitpress.genai.manifest import MANIFEST, verify

    pkg = _run([{"type": "rtn_hf", "bits": 4, "group_size": 32}, {"type": "hf_to_genai"}], tiny["untied"],
               tmp_path / "pkg")
    manifest = json.loads((pkg / MANIFEST).read_text())
    names = {e["path"] for e in manifest["files"]}
    assert {"model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json"} <= names
    assert manifest["made"]["checkpoint"] == "olive" and manifest["made"]["passes"][0]["pass"] == "rtn_hf"
    assert "onnxruntime-genai" in manifest["versions"]
    assert main(["verify", str(pkg)]) == 0
    assert "match" in capsys.readouterr().out
    copy = tmp_path / "downloaded"
    shutil.copytree(pkg, copy)
    (copy / "model.onnx.data").unlink()  # a shard that never arrived
    data = (copy / "tokenizer.json").read_bytes()
    (copy / "tokenizer.json").write_bytes(data[: len(data) // 2])  # an upload cut short
    cfg = bytearray((copy / "genai_config.json").read_bytes())
    cfg[len(cfg) // 2] ^= 1
    (copy / "genai_config.json").write_bytes(bytes(cfg))  # same size, other bytes
    (copy / "notes.txt").write_text("mine")
    res = verify(copy)
    assert not res.ok
    assert res.missing == ["model.onnx.data"] and res.truncated == ["tokenizer.json"]
    assert res.changed == ["genai_config.json"] and res.unlisted == ["notes.txt"]
    assert main(["verify", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "1 missing: model.onnx.data" in err and "truncated" in err and err.count("bitpress: error:") == 1


def test_verify_refuses_names_leaving_the_folder(tmp_path: Path) -> None:
    from bitpress.errors import UnsafePathError
    from bitpress.genai.manifest import MANIFEST, verify, write_manifest

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.txt").write_text("a")
    write_manifest(tmp_path / "pkg")
    m = json.loads((tmp_path / "pkg" / MANIFEST).read_text())
    assert verify(tmp_path / "pkg").ok
    (tmp_path / "secret").write_text("s")
    m["files"].append({"path": "../secret", "size": 1, "sha256": "0" * 64})
    (tmp_path / "pkg" / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(UnsafePathError, match="leaves the model's folder"):
        verify(tmp_path / "pkg")
    m["files"][-1]["path"] = "b.txt"
    (tmp_path / "pkg" / MANIFEST).write_text(json.dumps(m))
    (tmp_path / "pkg" / "b.txt").symlink_to(tmp_path / "secret")
    with pytest.raises(UnsafePathError, match="outside the model's folder"):
        verify(tmp_path / "pkg")


def test_publish_matrix_builds_every_cell_and_reports_failures(tiny: dict[str, Path], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """2 dtypes x 2 EPs + 2 quantized variants (and one the builder cannot take): the Hub tree, a manifest per
    package, cpu packages generate; the failing variant is reported with its reason while the rest complete."""
    import yaml

    from bitpress.cli import main
    from bitpress.genai.manifest import MANIFEST, verify
    from bitpress.genai.publish import INDEX

    cfg = {
        "input": str(tiny["tied"]), "output": "published",
        "matrix": {
            "dtypes": ["f32", "f16"], "eps": ["cpu", "cuda"], "folders": {"cpu": "default"},
            "variants": {
                "int4-rtn": [{"type": "rtn_hf", "bits": 4, "group_size": 32, "sym": False, "lm_head": True,
                              "embeds": True}],
                "int8-rtn": {"passes": [{"type": "rtn_hf", "bits": 8, "group_size": 64}], "eps": ["cpu"]},
                "Q4_K": {"passes": [{"type": "kquant_hf", "bits": 4, "group_size": 32}], "eps": ["cpu"]},
                "int4-mobius": {"passes": [{"type": "rtn_hf", "bits": 4, "group_size": 32, "sym": False,
                                            "lm_head": True, "embeds": True}],
                                "eps": ["cpu"], "genai": {"exporter": "mobius"}},
            },
            "genai": {"accuracy_level": 1},
            "eval": {"text": "corpus.txt", "windows": 2, "seq_len": 16},
        },
    }
    rng = np.random.default_rng(0)
    (tmp_path / "corpus.txt").write_text(" ".join(f"t{i}" for i in rng.integers(4, 256, 200)))
    (tmp_path / "publish.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["publish", str(tmp_path / "publish.yaml")]) == 1
    captured = capsys.readouterr()
    out = tmp_path / "published"
    index = json.loads((out / INDEX).read_text())
    status = {c["folder"]: c["status"] for c in index["cells"]}
    # builder 0.18's fp32 CUDA decoder leaves its KV-cache outputs unconnected: the package check says so
    assert status == {"f32/default": "ok", "f32/cuda": "failed", "f16/default": "ok", "f16/cuda": "ok",
                      "int4-rtn/default": "ok", "int4-rtn/cuda": "ok", "int8-rtn/default": "ok",
                      "Q4_K/default": "failed", "int4-mobius/default": "ok"}
    reasons = {c["folder"]: c["reason"] for c in index["cells"]}
    assert "float zero points" in reasons["Q4_K/default"]
    assert "ONNX checker" in reasons["f32/cuda"] and "present.0.key" in reasons["f32/cuda"]
    assert "2 cell(s) failed: f32/cuda, Q4_K/default" in captured.err and captured.err.count("bitpress: error:") == 1
    assert not (out / "f32" / "cuda").exists()
    assert not (out / "Q4_K").exists()
    for folder in (f for f, s in status.items() if s == "ok"):
        pkg = out / folder
        assert (pkg / "genai_config.json").exists() and (pkg / "tokenizer.json").exists()
        assert (pkg / MANIFEST).exists() and verify(pkg).ok
    made = json.loads((out / "int4-mobius/default" / MANIFEST).read_text())["made"]
    assert made["exporter"] == "mobius build" and made["checkpoint"] == "olive"
    # eval figures: every cpu package against the f32 one, in its manifest (which still verifies) and the index
    figures = {c["folder"]: c["eval"] for c in index["cells"] if c["eval"]}
    assert set(figures) == {f for f, s in status.items() if s == "ok" and f.endswith("/default")}
    assert figures["f32/default"]["perplexity_change"] == 0.0
    rtn = json.loads((out / "int4-rtn/default" / MANIFEST).read_text())["eval"]
    assert rtn == figures["int4-rtn/default"] and rtn["reference"] == "f32/default" and rtn["windows"] == 2
    assert rtn["perplexity_change"] != 0.0 and 0.0 < rtn["top1_agreement"] <= 1.0
    assert "perplexity" in captured.out
    ep = json.loads((out / "f16/cuda/genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert "cuda" in json.dumps(ep).lower()
    assert not [p for p in out.iterdir() if p.name.startswith(".bitpress-publish-")]  # no scratch left


def test_float_source_is_staged_by_copy_and_links_out_are_refused(tiny: dict[str, Path], tmp_path: Path) -> None:
    """A float folder reaches the builder as a copy made in the run's folder (never loaded by bitpress, never
    handed to the builder itself); a file linking out of the folder stops the export before any build."""
    import shutil

    from bitpress.errors import UnsafePathError

    src = tmp_path / "src"
    shutil.copytree(tiny["untied"], src)
    (tmp_path / "secret.txt").write_text("not yours")
    (src / "chat_template.jinja").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(UnsafePathError, match="outside the model's folder"):
        _run([{"type": "hf_to_genai"}], src, tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists() or not any((tmp_path / "pkg").iterdir())
    (src / "chat_template.jinja").unlink()
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    with pytest.raises(ExportError, match=r"already quantized by another tool \(quant_method 'gptq'\)"):
        _run([{"type": "hf_to_genai"}], src, tmp_path / "pkg")
    (src / "config.json").write_text(json.dumps(cfg))
    before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
    pkg = _run([{"type": "hf_to_genai"}], src, tmp_path / "pkg")
    assert (pkg / "genai_config.json").exists()
    assert {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before  # the input untouched


def test_mobius_takes_an_untied_quantized_table_and_keeps_the_zero_points(tiny: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """mobius reads asymmetric olive weights as symmetric unless told (it drops the zero points: measured), and
    gathers a quantized embedding table the builder cannot import: both arrive exact, and the logits are the
    PyTorch model's; its genai_config's context (4096 whatever the model) is the model's."""
    rtn = {"type": "rtn_hf", "bits": 4, "group_size": 32, "sym": False, "lm_head": True, "embeds": True}
    ckpt = _run([rtn], tiny["untied"], tmp_path / "ckpt")
    with pytest.raises(ExportError, match=r"not tied to the LM head.*--exporter mobius"):
        _run([{"type": "hf_to_genai"}], ckpt, tmp_path / "refused")
    package = _run([{"type": "hf_to_genai", "exporter": "mobius", "accuracy_level": 1}], ckpt, tmp_path / "pkg")
    assert _assert_same_integers(ckpt, package) == 2 * 7 + 1
    graph = onnx.load(str(package / "model.onnx")).graph
    gather = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    qc, t = _checkpoint(ckpt)
    b, s, z = _expected(qc, t, "model.embed_tokens.weight")
    got = [numpy_helper.to_array(_initializer(graph, i)[1], base_dir=str(package)) for i in
           (gather.input[0], gather.input[2], gather.input[3])]
    np.testing.assert_array_equal(got[0].reshape(b.shape), b)
    np.testing.assert_array_equal(got[1].reshape(s.shape), s)
    np.testing.assert_array_equal(got[2].reshape(z.shape), z)
    assert not [i for i in graph.initializer if sorted(i.dims) == [64, 256]]  # no float table left
    cfg = json.loads((package / "genai_config.json").read_text())
    assert cfg["model"]["context_length"] == 128 and cfg["search"]["max_length"] == 128
    prompt = [5, 17, 42, 9]
    np.testing.assert_allclose(_logits_og(package, prompt), _logits_torch(ckpt, prompt), atol=2e-4, rtol=1e-4)


def test_mobius_refusals_and_failures_are_one_line(tiny: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    mixed = {"type": "rtn_hf", "bits": 4, "group_size": 32, "overrides": {"re:.*\\.down_proj": {"bits": 8}}}
    ckpt = _run([mixed], tiny["untied"], tmp_path / "ckpt")
    with pytest.raises(ExportError, match="mix 4-bit group 32, 8-bit group 32: mobius reads one bits"):
        _run([{"type": "hf_to_genai", "exporter": "mobius"}], ckpt, tmp_path / "pkg")
    with pytest.raises(ExportError, match="bf16 packages for cpu do not load"):
        _run([{"type": "hf_to_genai", "exporter": "mobius", "dtype": "bf16"}], tiny["tied"], tmp_path / "pkg")
    weird = tmp_path / "weird"
    shutil.copytree(tiny["tied"], weird)
    cfg = json.loads((weird / "config.json").read_text())
    (weird / "config.json").write_text(json.dumps({**cfg, "model_type": "bitpress_toy"}))
    with pytest.raises(ExportError, match=r"^mobius 0.1.0 does not build model_type 'bitpress_toy': .* refused before "
                                          r"the build; use --exporter builder"):
        _run([{"type": "hf_to_genai", "exporter": "mobius"}], weird, tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists() or not any((tmp_path / "pkg").iterdir())
    biased = tmp_path / "biased"  # mobius 0.1.0 builds it, silently without its MLP biases (measured)
    shutil.copytree(tiny["untied"], biased)
    (biased / "config.json").write_text(json.dumps({**cfg, "mlp_bias": True}))
    with pytest.raises(ExportError, match=r"mobius 0.1.0 drops the MLP biases .*use --exporter builder"):
        _run([{"type": "hf_to_genai", "exporter": "mobius"}], biased, tmp_path / "pkg")
    from bitpress.errors import OptionError

    with pytest.raises(OptionError, match="builder_options apply to exporter builder only"):
        _run([{"type": "hf_to_genai", "exporter": "mobius", "builder_options": {"x": 1}}], weird, tmp_path / "pkg")


def test_mobius_float_packages_at_two_dtypes_keep_the_tied_table_one(tiny: dict[str, Path], tmp_path: Path) -> None:
    for dtype, ep in (("f16", "default"), ("f32", "cpu")):
        pkg = _run([{"type": "hf_to_genai", "exporter": "mobius", "dtype": dtype, "ep": ep}], tiny["tied"],
                   tmp_path / f"pkg-{dtype}")
        g = onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph
        tables = [t for t in g.initializer if sorted(t.dims) == [64, 256]]
        assert len(tables) == 1
        want = onnx.TensorProto.FLOAT16 if dtype == "f16" else onnx.TensorProto.FLOAT
        assert tables[0].data_type == want
        manifest = json.loads((pkg / "bitpress-manifest.json").read_text())
        assert manifest["made"]["exporter"] == "mobius build" and dtype in manifest["made"]["exporter_arguments"]


@pytest.mark.parametrize(("exporter", "module"), [("builder", "onnx_ir"), ("mobius", "mobius")])
def test_a_missing_exporter_names_the_extra(tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           exporter: str, module: str) -> None:
    """The builder needs onnx_ir (it fails deep in its import without it); mobius is its own package: either
    missing is one error naming what to install, before anything is staged."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(ExportError, match=rf"needs {module}: pip install .*bitpress\[genai\]"):
        _run([{"type": "hf_to_genai", "exporter": exporter}], tiny["tied"], tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists() or not any((tmp_path / "pkg").iterdir())


def _steps_og(package: Path, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the logits that chose each (read after each step: the model runs inside it)."""
    import onnxruntime_genai as og

    m = og.Model(str(package))
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=len(prompt) + steps, do_sample=False)
    gen = og.Generator(m, params)
    gen.append_tokens(np.array([prompt], dtype=np.int32))
    tokens, logits = [], []
    while not gen.is_done() and len(tokens) < steps:
        gen.generate_next_token()
        tokens.append(int(gen.get_next_tokens()[0]))
        logits.append(np.asarray(gen.get_output("logits"))[0, -1])
    return tokens, np.stack(logits)


@pytest.mark.parametrize(("exporter", "which", "rtn"), [
    ("builder", "tied", {"lm_head": True, "embeds": True}),  # one quantized table: GatherBlockQuantized + head
    ("builder", "tied", None),  # one float table
    ("builder", "untied", {}),  # quantized linears, float table and head
    ("mobius", "tied", {"lm_head": True, "embeds": True}),
])
def test_split_embedding_keeps_one_table_and_generates_the_same(tiny: dict[str, Path], tmp_path: Path,
                                                                exporter: str, which: str,
                                                                rtn: dict[str, Any] | None) -> None:
    """split_embedding: embedding.onnx + decoder.onnx in a decoder-pipeline package, both reading one data file
    (the tied table stored once: the data file is the unsplit package's); generation is the unsplit package's."""
    src = tiny[which]
    if rtn is not None:
        src = _run([{"type": "rtn_hf", "bits": 4, "group_size": 32, "sym": False, **rtn}], src, tmp_path / "ckpt")
    step = {"type": "hf_to_genai", "exporter": exporter, "accuracy_level": 1}
    whole = _run([step], src, tmp_path / "whole")
    split = _run([{**step, "split_embedding": True}], src, tmp_path / "split")
    assert not (split / "model.onnx").exists()
    cfg = json.loads((split / "genai_config.json").read_text())
    assert cfg["model"]["type"] == "decoder-pipeline"
    stages = [next(iter(s)) for s in cfg["model"]["decoder"]["pipeline"]]
    assert stages == ["embedding", "decoder"]
    data = {p.name: p.stat().st_size for p in split.glob("*.data")}
    assert data == {p.name: p.stat().st_size for p in whole.glob("*.data")}  # nothing written twice
    emb = onnx.load(str(split / "embedding.onnx"), load_external_data=False).graph
    dec = onnx.load(str(split / "decoder.onnx"), load_external_data=False).graph
    assert [i.name for i in emb.input] == ["input_ids"] and [o.name for o in emb.output] == ["inputs_embeds"]
    assert "inputs_embeds" in [i.name for i in dec.input] and "input_ids" not in [i.name for i in dec.input]
    shared = {t.name for t in emb.initializer} & {t.name for t in dec.initializer}
    if which == "tied":  # the table both read: the same bytes of the same file
        pairs = [(next(t for t in emb.initializer if t.name == n), next(t for t in dec.initializer if t.name == n))
                 for n in shared]
        assert all(list(e.external_data) == list(d.external_data) for e, d in pairs)
        assert any(e.external_data and 256 in e.dims for e, _ in pairs)  # the table itself, not a shape constant
    else:
        assert not shared
    prompt = [5, 17, 42, 9]
    tokens, logits = _steps_og(split, prompt, 6)
    want_tokens, want_logits = _steps_og(whole, prompt, 6)
    assert tokens == want_tokens
    np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=1e-5)
    made = json.loads((split / "bitpress-manifest.json").read_text())["made"]
    assert made["components"] == ["embedding", "decoder"]
    if exporter == "mobius":  # bitpress eval runs one-model packages, and says so
        import bitpress
        from bitpress.errors import UsageError

        with pytest.raises(UsageError, match=r"decoder-pipeline package .embedding, decoder.*without split_embedding"):
            bitpress.evaluate(split, whole, weights=False)


def test_publish_push_uploads_built_packages_and_they_download_whole(tiny: dict[str, Path], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`publish --push` to a local Hub (tests/hubserver.py): the packages the builder made arrive byte for byte,
    `verify org/name` checks them there, a download of one by its Hub id verifies and generates, and running the
    command again keeps every cell and sends nothing."""
    import yaml
    from hubserver import FakeHub, point_huggingface_hub_at

    from bitpress.cli import main
    from bitpress.genai.manifest import verify

    hub = FakeHub().start()
    try:
        point_huggingface_hub_at(hub, monkeypatch, tmp_path / "hf-home")
        monkeypatch.chdir(tmp_path)
        cfg = {"input": str(tiny["tied"]), "output": "published",
               "matrix": {"dtypes": ["f32"], "eps": ["cpu"], "folders": {"cpu": "default"},
                          "variants": {"int4-rtn": [{"type": "rtn_hf", "bits": 4, "group_size": 32}]}}}
        (tmp_path / "publish.yaml").write_text(yaml.safe_dump(cfg))
        assert main(["publish", "publish.yaml", "--push", "acme/tiny-genai"]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "pushed to acme/tiny-genai at commit" in out
        local = {p.relative_to(tmp_path / "published").as_posix(): p.read_bytes()
                 for p in (tmp_path / "published").rglob("*") if p.is_file()}
        remote = hub.files("acme/tiny-genai")
        assert {k: v for k, v in remote.items() if k != ".gitattributes"} == local
        assert main(["verify", "acme/tiny-genai"]) == 0
        assert "2 package(s) match" in capsys.readouterr().out
        # a user downloads one package by its Hub id: whole, and it runs
        assert main(["verify", "acme/tiny-genai/int4-rtn/default"]) == 0
        capsys.readouterr()
        from bitpress.hub import resolve

        folder, found = resolve("acme/tiny-genai", subfolder="int4-rtn/default")
        assert found is not None and verify(folder).ok
        import onnxruntime_genai as og

        model = og.Model(str(folder))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=8)
        gen = og.Generator(model, params)
        gen.append_tokens([[1, 5, 9]])
        while not gen.is_done():
            gen.generate_next_token()
        commits = hub.commit_count("acme/tiny-genai")
        assert main(["publish", "publish.yaml", "--push", "acme/tiny-genai"]) == 0
        assert capsys.readouterr().out.count("kept") == 2 and hub.commit_count("acme/tiny-genai") == commits
    finally:
        hub.stop()
