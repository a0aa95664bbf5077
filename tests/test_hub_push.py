"""``bitpress publish CONFIG --push org/name`` and ``bitpress verify org/name[/path]`` against a local Hub (issue 32).

The Hub is tests/hubserver.py: a local HTTP server speaking the calls huggingface_hub makes (create repo,
preupload, LFS batch + basic transfer, commit, tree, info, resolve), with huggingface_hub pointed at it
(``HF_ENDPOINT``) and its LFS protocol (``HF_HUB_DISABLE_XET``). No network. The packages are folders with
a real manifest (bitpress.genai.manifest.write_manifest): what is pushed and verified is their files, whatever
they hold; tests/hf/test_publish_push.py pushes packages the GenAI builder built.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hubserver import FakeHub, point_huggingface_hub_at

from bitpress.cli import main
from bitpress.genai.manifest import MANIFEST, write_manifest
from bitpress.genai.publish import INDEX

hf_constants = pytest.importorskip("huggingface_hub.constants")

REPO = "acme/tiny-onnx"
CELLS = ("f32/default", "int4/default")


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    server = FakeHub().start()
    point_huggingface_hub_at(server, monkeypatch, tmp_path / "hf-home")
    monkeypatch.chdir(tmp_path)
    yield server
    server.stop()


def package(folder: Path, seed: int) -> Path:
    """A package folder: two binary files (LFS on the Hub), two text files (regular git files), its manifest."""
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"\0onnx" + bytes([seed]) * 3000)
    (folder / "model.onnx.data").write_bytes(hashlib.sha256(bytes([seed])).digest() * 4096)
    (folder / "genai_config.json").write_text(json.dumps({"model": {"type": "llama", "seed": seed}}))
    (folder / "tokenizer.json").write_text(json.dumps({"vocab": [f"t{i}" for i in range(50)], "seed": seed}))
    write_manifest(folder, made={"seed": seed})
    return folder


@pytest.fixture
def published(tmp_path: Path) -> Path:
    """A publish config and its output, both cells built (as `bitpress publish` leaves them)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    cfg = {"input": "src", "output": "published",
           "matrix": {"dtypes": ["f32"], "eps": ["cpu"], "folders": {"cpu": "default"},
                      "variants": {"int4": [{"type": "rtn_hf", "bits": 4}]}}}
    (tmp_path / "publish.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "published"
    for i, cell in enumerate(CELLS):
        package(out / cell, i)
    (out / INDEX).write_text(json.dumps({"output": str(out), "cells": [
        {"folder": c, "status": "ok"} for c in CELLS] + [{"folder": "f16/default", "status": "failed"}]}))
    return tmp_path / "publish.yaml"


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def local_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def writes(hub: FakeHub) -> list[tuple[str, str]]:
    return [(m, p) for m, p in hub.requests if m in ("PUT", "POST") and "/lfs-verify/" not in p]


def test_push_uploads_every_package_then_checks_the_hubs_copy(hub: FakeHub, published: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(["publish", str(published), "--push", REPO], capsys)
    assert code == 0, err
    assert "f32/default" in out and "kept" in out  # built before and whole: not rebuilt
    assert f"pushed to {REPO} at commit" in out and "2 package(s) on the Hub" in out
    remote = hub.files(REPO)
    local = local_files(published.parent / "published")
    assert {k: v for k, v in remote.items() if k != ".gitattributes"} == local  # every byte, and nothing else
    # one commit per package, the index last; binaries went through LFS, text files as git blobs
    assert hub.commit_count(REPO) == 1 + 3
    stored = hub.repos[REPO].commits[-1][1]
    assert stored["f32/default/model.onnx.data"].lfs and not stored["f32/default/tokenizer.json"].lfs
    committed = [c[1] for c in hub.repos[REPO].commits]
    assert INDEX not in committed[-2] and INDEX in committed[-1]
    code, out, err = cli(["verify", REPO], capsys)
    assert code == 0, err
    assert "2 package(s) match" in out and "f32/default" in out and "int4/default" in out


def test_pushing_again_sends_nothing(hub: FakeHub, published: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["publish", str(published), "--push", REPO], capsys)[0] == 0
    commits, hub.requests[:] = hub.commit_count(REPO), []
    code, out, err = cli(["publish", str(published), "--push", REPO], capsys)
    assert code == 0, err
    assert hub.commit_count(REPO) == commits and not writes(hub)
    assert out.count("unchanged") == 2


def test_an_interrupted_push_resumes_where_it_stopped(hub: FakeHub, published: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    hub.refuse_commits_under = "int4/"  # the second package's commit is refused once
    code, _, err = cli(["publish", str(published), "--push", REPO], capsys)
    assert code == 1
    [line] = err.strip().splitlines()
    assert line.startswith("bitpress: error: uploading int4/default to acme/tiny-onnx: the token may not do this")
    assert "1 package(s) are on the Hub (f32/default)" in line and "run the same command again to resume" in line
    assert INDEX not in hub.files(REPO)  # the index only once every package is there
    uploaded = {p for m, p in hub.requests if m == "PUT"}
    hub.requests[:] = []
    code, out, err = cli(["publish", str(published), "--push", REPO], capsys)
    assert code == 0, err
    # f32/default is not sent again, and neither are int4's LFS objects that arrived before the refusal
    assert not [p for m, p in hub.requests if m == "PUT"] and uploaded
    assert not any("f32/default" in json.dumps(p) for _, p in writes(hub) if "/commit/" in p)
    assert "unchanged" in out and "pushed" in out
    assert cli(["verify", REPO], capsys)[0] == 0


def test_dry_run_lists_what_would_be_sent_and_sends_nothing(hub: FakeHub, published: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(["publish", str(published), "--push", REPO, "--dry-run"], capsys)
    assert code == 0, err
    assert "would push to acme/tiny-onnx (a new repo)" in out and "nothing was sent" in out
    assert "new      model.onnx.data" in out and REPO not in hub.repos and not writes(hub)
    assert cli(["publish", str(published), "--push", REPO], capsys)[0] == 0
    # one package changed by a rebuild: its changed file and manifest are what a push would send
    pkg = published.parent / "published" / "int4/default"
    (pkg / "tokenizer.json").write_text(json.dumps({"vocab": ["other"], "seed": 9}))
    write_manifest(pkg, made={"seed": 9})
    hub.requests[:] = []
    code, out, err = cli(["publish", str(published), "--push", REPO, "--dry-run", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)["push"]
    sends = {p["folder"]: sorted(f["name"] for f in p["files"] if f["state"] != "same") for p in plan["packages"]}
    assert sends == {"f32/default": [], "int4/default": [MANIFEST, "tokenizer.json"]}
    assert not writes(hub)


def test_dry_run_without_push_lists_the_cells(published: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(["publish", str(published), "--dry-run"], capsys)
    assert code == 0
    assert "f32/default" in out and "built" in out and "0 of 2 cell(s) to build" in out


def test_verify_names_what_the_hub_lost_cut_or_replaced(hub: FakeHub, published: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["publish", str(published), "--push", REPO], capsys)[0] == 0
    good = hub.repos[REPO].commits[-1][0]
    remote = hub.files(REPO)
    data = remote["f32/default/model.onnx.data"]
    tok = remote["f32/default/tokenizer.json"]
    hub.put_files(REPO, {"f32/default/model.onnx.data": data[:-100],  # an upload cut short
                         "f32/default/tokenizer.json": tok.replace(b"t1", b"x1"),  # same size, other bytes
                         "f32/default/extra.bin": b"\0stray"})
    hub.drop_file(REPO, "f32/default/genai_config.json")
    hub.drop_file(REPO, f"int4/default/{MANIFEST}")  # a package the index lists, without its manifest
    code, _, err = cli(["verify", REPO], capsys)
    assert code == 1
    [line] = err.strip().splitlines()
    assert "1 missing: genai_config.json" in line and "1 truncated: model.onnx.data" in line
    assert "1 changed (other bytes): tokenizer.json" in line
    assert f"package(s) listed in {INDEX} but not on the Hub: int4/default" in line
    code, out, _ = cli(["verify", REPO, "--json"], capsys)
    res = json.loads(out)
    assert code == 1 and not res["ok"] and res["missing_packages"] == ["int4/default"]
    [pkg] = res["packages"]
    assert pkg["unlisted"] == ["extra.bin"]
    # the commit before the damage still verifies, by revision and by path
    code, out, err = cli(["verify", f"{REPO}@{good}/int4/default"], capsys)
    assert code == 0, err
    assert "1 package(s) match" in out
    assert cli(["verify", f"{REPO}/f32", "--revision", good], capsys)[0] == 0


def test_the_tree_is_read_page_by_page(hub: FakeHub, published: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["publish", str(published), "--push", REPO], capsys)[0] == 0
    hub.page_size = 3
    hub.requests[:] = []
    code, out, err = cli(["verify", REPO], capsys)
    assert code == 0, err
    assert "2 package(s) match" in out and sum(1 for m, p in hub.requests if "/tree/" in p) > 3


def test_a_package_that_does_not_match_its_manifest_is_not_uploaded(hub: FakeHub, published: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from bitpress.errors import ValidationError
    from bitpress.genai.push import push

    pkg = published.parent / "published" / "int4/default"
    with (pkg / "model.onnx.data").open("r+b") as f:
        f.truncate(100)
    with pytest.raises(ValidationError, match=r"int4/default does not match its bitpress-manifest.json, so it is "
                                              r"not uploaded: 1 truncated: model.onnx.data"):
        push(published.parent / "published", REPO)
    assert not writes(hub)
    # on the command line, publish --push does not keep the damaged cell: it is reported (use --overwrite to
    # build it again) and not pushed, while the other is
    code, _, err = cli(["publish", str(published), "--push", REPO], capsys)
    assert code == 1 and "int4/default" in err and "does not match its bitpress-manifest.json" in err
    assert "f32/default/model.onnx" in hub.files(REPO) and "int4/default/model.onnx" not in hub.files(REPO)


@pytest.mark.parametrize(("case", "message"), [
    ("token", "the Hub refused the credentials (the Hub said: Invalid credentials in Authorization header): log in "
              "with `hf auth login` or set HF_TOKEN"),
    ("offline", "needs the Hub, and HF_HUB_OFFLINE is set"),
    ("unreachable", "could not be reached"),
])
def test_push_failures_are_one_line_saying_what_to_do(hub: FakeHub, published: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], case: str,
                                                      message: str) -> None:
    if case == "token":
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    elif case == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        hub.stop()
    code, _, err = cli(["publish", str(published), "--push", REPO], capsys)
    assert code == 1
    [line] = err.strip().splitlines()
    assert line.startswith("bitpress: error:") and message in line, line
    assert "internal error" not in line


def test_verify_errors(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["verify", "acme/nothing-here"], capsys)
    assert code == 1 and "no such model repo on the Hub" in err
    hub.put_files("acme/plain", {"README.md": b"hello"})
    code, _, err = cli(["verify", "acme/plain"], capsys)
    assert code == 1 and "holds no bitpress-manifest.json" in err
    code, _, err = cli(["verify", "acme/plain@v9"], capsys)
    assert code == 1 and "no such revision" in err
    code, _, err = cli(["verify", "acme/plain@v1", "--revision", "v2"], capsys)
    assert code == 1 and "give one" in err


def test_dry_run_offline_counts_every_file_as_new(published: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = cli(["publish", str(published), "--push", REPO, "--dry-run"], capsys)
    assert code == 0, err
    assert "the Hub not consulted: HF_HUB_OFFLINE" in out and out.count("5 of 5 file(s) to send") == 2


def test_the_command_line_reads_hf_endpoint_from_the_environment(hub: FakeHub, published: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """In a fresh process, huggingface_hub reads HF_ENDPOINT and HF_TOKEN at import, as a user's shell sets them."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": hub.token, "HF_HUB_DISABLE_XET": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    run = subprocess.run([sys.executable, "-m", "bitpress", "publish", str(published), "--push", REPO],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    run = subprocess.run([sys.executable, "-m", "bitpress", "verify", f"{REPO}/int4/default", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["ok"] is True


def test_a_hub_id_is_downloaded_from_the_hub_then_pushed_back(hub: FakeHub, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Online, a Hub id is downloaded by huggingface_hub itself (only the files the run needs, into the cache),
    quantized, and its commit recorded."""
    from bitpress.synthetic import build_decoder

    model = build_decoder(tmp_path / "m" / "model.onnx", hidden=32, layers=1, heads=2, vocab=64)
    commit = hub.put_files("acme/decoder", {"onnx/model.onnx": model.read_bytes(), "README.md": b"# decoder",
                                            "weights.safetensors": b"\0" * 64, "config.json": b"{}"})
    code, out, err = cli(["quantize", "-m", "acme/decoder", "--subfolder", "onnx", "-o", "q", "--algorithm", "rtn",
                          "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["source"]["commit"] == commit
    fetched = {p for m, p in hub.requests if m == "GET" and "/resolve/" in p}
    assert fetched == {f"/acme/decoder/resolve/{commit}/onnx/model.onnx"}  # not the README, not the weights
    snapshot = Path(hf_constants.HF_HUB_CACHE) / "models--acme--decoder" / "snapshots" / commit
    assert (snapshot / "onnx" / "model.onnx").is_file()


def test_a_hub_id_while_the_hub_is_unreachable_says_so(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    hub.stop()
    code, _, err = cli(["quantize", "-m", "acme/decoder", "-o", "q", "--algorithm", "rtn"], capsys)
    assert code == 1
    [line] = err.strip().splitlines()
    assert "the Hub could not be reached" in line and "unset HF_HUB_OFFLINE" not in line
    assert "hf download acme/decoder" in line


def test_a_missing_local_package_is_not_looked_up_on_the_hub(hub: FakeHub, published: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["verify", "published/int8/default"], capsys)  # published/ exists: a local typo
    assert code == 1 and "published/int8/default: No such file or directory" in err and not hub.requests
    code, out, err = cli(["verify", "published/int4/default"], capsys)
    assert code == 0 and "match bitpress-manifest.json" in out and not hub.requests
