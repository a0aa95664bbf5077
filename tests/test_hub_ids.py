"""Hugging Face Hub ids as inputs (issue 32): ``org/name[@revision]`` and ``--subfolder`` read from the Hub cache.

No network: every test points huggingface_hub at a cache in a temporary folder, built by hand in its
own layout (``models--org--name/{blobs/<sha>, refs/main, snapshots/<commit>/...}``), with
``HF_HUB_OFFLINE=1``. Snapshot files are relative symbolic links into ``../../blobs`` (what
huggingface_hub writes) or, in the layout it uses where links are not available, regular files.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from bitpress.cli import main
from bitpress.synthetic import build_decoder

hf_constants = pytest.importorskip("huggingface_hub.constants")

REPO = "acme/tiny-decoder"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def decoder_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = build_decoder(tmp_path_factory.mktemp("decoder") / "model.onnx", hidden=32, layers=1, heads=2, vocab=64)
    return path.read_bytes()


def make_cache(cache: Path, repo: str, files: dict[str, bytes], *, commit: str = COMMIT, symlinks: bool = True,
               ref: str | None = "main") -> Path:
    """A repo in the Hub cache's layout; returns its snapshot folder."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    for rel, data in files.items():
        dst = snapshot / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if symlinks:
            sha = hashlib.sha256(data).hexdigest()
            blob = storage / "blobs" / sha
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            os.symlink(os.path.relpath(blob, dst.parent), dst)
        else:
            dst.write_bytes(data)
    if ref is not None:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hub cache in tmp_path, offline; huggingface_hub reads these at import, so they are patched too."""
    home = tmp_path / "hf"
    hub = home / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HOME", str(home))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    return hub


def bitpress_metadata(path: Path) -> dict:
    model = onnx.load(str(path), load_external_data=False)
    return json.loads(next(p.value for p in model.metadata_props if p.key == "bitpress"))


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict | str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, (json.loads(out) if "--json" in argv and code == 0 else out), err


LAYOUTS = [pytest.param(True, id="symlinks"), pytest.param(False, id="regular-files")]


@pytest.mark.parametrize("symlinks", LAYOUTS)
def test_quantize_a_hub_id_offline_records_the_commit(cache: Path, decoder_bytes: bytes, symlinks: bool,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(cache, REPO, {"model.onnx": decoder_bytes, "config.json": b"{}"}, symlinks=symlinks)
    code, result, _ = run_cli(["quantize", "-m", REPO, "-o", "out", "--algorithm", "rtn", "--json"], capsys)
    assert code == 0
    assert result["source"] == {"hub": REPO, "revision": None, "commit": COMMIT, "subfolder": None, "kind": "onnx"}
    assert any(COMMIT in n and "offline" in n for n in result["notes"])
    written = Path("out/model.onnx")
    assert written.is_file() and Path("out/config.json").is_file()
    assert bitpress_metadata(written)["source"]["commit"] == COMMIT


@pytest.mark.parametrize("symlinks", LAYOUTS)
def test_a_revision_and_a_subfolder(cache: Path, decoder_bytes: bytes, symlinks: bool,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(cache, REPO, {"onnx/model.onnx": decoder_bytes, "config.json": b"{}", "tokenizer.json": b"{}"},
               symlinks=symlinks, commit=OTHER, ref=None)
    code, result, _ = run_cli(["quantize", "-m", f"{REPO}@{OTHER}", "--subfolder", "onnx", "-o", "out",
                               "--algorithm", "rtn", "--json"], capsys)
    assert code == 0
    assert result["source"]["commit"] == OTHER and result["source"]["revision"] == OTHER
    assert result["source"]["subfolder"] == "onnx"
    assert bitpress_metadata(Path("out/model.onnx"))["source"]["subfolder"] == "onnx"


def test_models_in_a_subfolder_are_named_when_the_root_has_none(cache: Path, decoder_bytes: bytes,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(cache, REPO, {"onnx/model.onnx": decoder_bytes, "config.json": b"{}"}, symlinks=False)
    code, _, err = run_cli(["quantize", "-m", REPO, "-o", "out", "--algorithm", "rtn"], capsys)
    assert code != 0
    assert "bitpress: error:" in err and "--subfolder onnx" in err
    assert not Path("out").exists()


def test_a_repo_missing_from_the_cache_offline_is_a_clear_error(cache: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["quantize", "-m", "acme/not-there", "-o", "out", "--algorithm", "rtn"], capsys)
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith("bitpress: error:")
    assert "acme/not-there" in line and "not in the Hugging Face cache" in line
    assert "hf download acme/not-there" in line and "HF_HUB_OFFLINE" in line
    assert "no local file or folder" in line  # what was tried first
    assert not Path("out").exists()


def test_a_revision_missing_from_the_cache_offline(cache: Path, decoder_bytes: bytes,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(cache, REPO, {"model.onnx": decoder_bytes}, symlinks=False)
    code, _, err = run_cli(["quantize", "-m", f"{REPO}@v2", "-o", "out", "--algorithm", "rtn"], capsys)
    assert code == 1
    assert "at revision v2" in err and "--revision v2" in err


def test_a_local_folder_named_like_a_hub_id_wins(cache: Path, decoder_bytes: bytes,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # the cache holds another model under the same name: the local folder is the one quantized
    make_cache(cache, REPO, {"model.onnx": decoder_bytes}, symlinks=False)
    local = Path(REPO)
    local.mkdir(parents=True)
    build_decoder(local / "local.onnx", hidden=32, layers=1, heads=2, vocab=64, seed=3)
    code, result, _ = run_cli(["quantize", "-m", REPO, "-o", "out", "--algorithm", "rtn", "--json"], capsys)
    assert code == 0
    assert result["source"] is None
    assert Path("out/local.onnx").is_file() and not Path("out/model.onnx").exists()
    assert "source" not in bitpress_metadata(Path("out/local.onnx"))


def test_a_mistyped_local_path_is_not_looked_up_on_the_hub(cache: Path, decoder_bytes: bytes,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from bitpress.hub import hub_id

    Path("models").mkdir()
    assert hub_id("models/decoder") is None  # models/ is a local folder: a typo, not a repo
    assert hub_id("acme/decoder.onnx") is None  # a model file's name
    assert hub_id("./acme/decoder") is None and hub_id("/acme/decoder") is None
    assert hub_id(Path("acme/decoder")) is None  # a Path is always local
    assert hub_id("acme/decoder@main").revision == "main"
    assert hub_id("acme/bad--name") is None  # huggingface_hub's validator
    code, _, err = run_cli(["quantize", "-m", "models/decodr", "-o", "out", "--algorithm", "rtn"], capsys)
    assert code != 0 and "models/decodr" in err and "Hugging Face" not in err


def test_python_api_quantize_and_run_config(cache: Path, decoder_bytes: bytes, tmp_path: Path) -> None:
    import bitpress

    make_cache(cache, REPO, {"onnx/model.onnx": decoder_bytes, "tokenizer.json": b"{}"}, symlinks=False)
    result = bitpress.quantize(REPO, "out-api", algorithm="rtn", subfolder="onnx", save_config="saved.yaml")
    assert result.source["commit"] == COMMIT and result.source["subfolder"] == "onnx"
    import yaml

    saved = yaml.safe_load(Path("saved.yaml").read_text())
    assert saved["input"] == f"{REPO}@{COMMIT}" and saved["subfolder"] == "onnx"
    # a config file's input: the Hub id (nothing of that name beside the config), and the saved config repeats
    cfg = tmp_path / "conf" / "run.yaml"
    cfg.parent.mkdir()
    cfg.write_text(f"input: {REPO}\nsubfolder: onnx\noutput: out-run\npasses: [{{type: rtn}}]\n")
    result = bitpress.run(cfg)
    assert result.source["commit"] == COMMIT
    assert (tmp_path / "conf" / "out-run" / "model.onnx").is_file()
    assert bitpress.run("saved.yaml", overwrite=True).source["commit"] == COMMIT


def test_eval_reference_from_the_hub(cache: Path, decoder_bytes: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(cache, REPO, {"model.onnx": decoder_bytes}, symlinks=False)
    assert main(["quantize", "-m", REPO, "-o", "q", "--algorithm", "rtn"]) == 0
    capsys.readouterr()
    code = main(["eval", "q/model.onnx", "--reference", REPO, "--samples", "1", "--seq-len", "8",
                 "--no-speed", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out) and COMMIT in err


def test_without_huggingface_hub_the_error_says_how_to_install(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import builtins

    real_import = builtins.__import__

    def no_hub(name: str, *args: object, **kwargs: object) -> object:
        if name == "huggingface_hub" or name.startswith("huggingface_hub."):
            raise ImportError("No module named 'huggingface_hub'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hub)
    code, _, err = run_cli(["quantize", "-m", REPO, "-o", "out", "--algorithm", "rtn"], capsys)
    assert code == 1
    assert 'pip install "bitpress[hub]"' in err and err.startswith("bitpress: error:")


@pytest.mark.parametrize("symlinks", LAYOUTS)
def test_the_cli_reads_the_environment(tmp_path: Path, decoder_bytes: bytes, symlinks: bool) -> None:
    """In a process of its own: HF_HOME / HF_HUB_OFFLINE as a user sets them, read by huggingface_hub at import."""
    home = tmp_path / "hf"
    make_cache(home / "hub", REPO, {"model.onnx": decoder_bytes}, symlinks=symlinks)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "bitpress", "quantize", "-m", REPO, "-o", "out", "--algorithm",
                           "rtn", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["source"]["commit"] == COMMIT


def test_the_files_taken_follow_the_model_kind() -> None:
    from bitpress.errors import ModelLoadError
    from bitpress.hub import select

    files = ["README.md", "config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin",
             "onnx/model.onnx", "onnx/model.onnx_data", "onnx/model_fp16.onnx", "onnx/config.json", "onnx/x/deep.onnx",
             "cpu-int4/genai_config.json", "cpu-int4/model.onnx", "cpu-int4/model.onnx.data", "cpu-int4/sub/a.bin"]
    kind, allow = select(files, None, None, "repo")
    assert kind == "safetensors"
    assert allow == ["config.json", "model.safetensors", "tokenizer.json"]  # no pickles, no README, no onnx/
    kind, allow = select(files, "onnx", None, "repo")
    assert kind == "onnx"
    assert allow == ["onnx/config.json", "onnx/model.onnx", "onnx/model.onnx_data", "onnx/model_fp16.onnx",
                     "tokenizer.json"]  # the root's tokenizer: the subfolder has none
    kind, allow = select(files, "cpu-int4", None, "repo")
    assert kind == "genai-package" and "cpu-int4/sub/a.bin" in allow and "config.json" not in allow
    assert select(files, None, "tokenizer", "repo") == ("tokenizer", ["config.json", "tokenizer.json"])
    assert select(["a[1].onnx"], None, None, "repo")[1] == ["a[[]1].onnx"]  # exact names, glob characters escaped
    with pytest.raises(ModelLoadError, match="no folder nope"):
        select(files, "nope", None, "repo")


def test_a_safetensors_checkpoint_from_the_hub_exports(cache: Path, capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    saved = tmp_path / "saved"
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(saved)
    files = {p.name: p.read_bytes() for p in saved.iterdir() if p.is_file()}
    make_cache(cache, REPO, files, symlinks=True)
    code, result, err = run_cli(["export", REPO, "-o", "pkg", "--runtime", "onnx", "--json"], capsys)
    assert code == 0, err
    assert result["source"]["kind"] == "safetensors" and result["source"]["commit"] == COMMIT
    out = Path("pkg") / REPO.split("/")[1]  # named after the repo, not the cache's commit folder
    onnx_files = sorted(out.glob("*.onnx"))
    assert onnx_files, sorted(Path("pkg").rglob("*"))


@pytest.fixture
def online(cache: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Online, with the Hub client's two calls replaced by fakes (no network): model_info answers from ``repo``
    and snapshot_download records its arguments and returns the snapshot built in the cache."""
    import types

    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    state: dict = {"calls": [], "error": None}

    def model_info(self: object, repo_id: str, revision: str | None = None, **_: object) -> object:
        if state["error"] is not None:
            raise state["error"]
        return types.SimpleNamespace(sha=COMMIT, siblings=[types.SimpleNamespace(rfilename=f) for f in state["files"]])

    real = huggingface_hub.snapshot_download

    def snapshot_download(repo_id: str, **kwargs: object) -> str:
        if kwargs.get("local_files_only"):  # the cache alone: the real one (it makes no request)
            return real(repo_id, **kwargs)
        state["calls"].append({"repo_id": repo_id, **kwargs})
        return str(state["snapshot"])

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return state


def test_online_only_the_needed_files_are_downloaded(online: dict, cache: Path, decoder_bytes: bytes,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    online["files"] = ["README.md", "config.json", "onnx/model.onnx", "onnx/model_q4.onnx", "onnx/x/other.onnx",
                       "tokenizer.json", "model.safetensors"]
    online["snapshot"] = make_cache(cache, REPO, {"onnx/model.onnx": decoder_bytes, "config.json": b"{}"})
    code, result, err = run_cli(["quantize", "-m", f"{REPO}@main", "--subfolder", "onnx", "-o", "out",
                                 "--algorithm", "rtn", "--json"], capsys)
    assert code == 0, err
    [call] = online["calls"]
    assert call["revision"] == "main" and "local_files_only" not in call
    assert call["allow_patterns"] == ["onnx/model.onnx", "onnx/model_q4.onnx", "tokenizer.json"]
    assert result["source"] == {"hub": REPO, "revision": "main", "commit": COMMIT, "subfolder": "onnx", "kind": "onnx"}
    assert any("via the local cache" in n for n in result["notes"])


@pytest.mark.parametrize(("error", "message"), [
    ("RepositoryNotFoundError", "no such model repo on the Hub"),
    ("RevisionNotFoundError", "the repo has no revision 'v9'"),
    ("GatedRepoError", "the repo is gated"),
])
def test_online_errors_are_one_clear_line(online: dict, capsys: pytest.CaptureFixture[str], error: str,
                                         message: str) -> None:
    import httpx
    from huggingface_hub import errors

    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/acme/x"))
    online["error"] = getattr(errors, error)("404 Client Error", response=response)
    code, _, err = run_cli(["quantize", "-m", f"{REPO}@v9", "-o", "out", "--algorithm", "rtn"], capsys)
    assert code == 1
    [line] = err.strip().splitlines()
    assert line.startswith(f"bitpress: error: model {REPO}@v9: no local file or folder") and message in line
    assert not online["calls"]


def test_online_but_unreachable_falls_back_to_the_cache(online: dict, cache: Path, decoder_bytes: bytes,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import httpx

    make_cache(cache, REPO, {"model.onnx": decoder_bytes}, symlinks=False)
    online["error"] = httpx.ConnectError("no route to host")
    code, result, err = run_cli(["quantize", "-m", REPO, "-o", "out", "--algorithm", "rtn", "--json"], capsys)
    assert code == 0, err
    assert result["source"]["commit"] == COMMIT and not online["calls"]
