"""Where the host looks for plugin environments: BITPRESS_ENVS, the root recorded for the running
Python environment (``<sys.prefix>/bitpress-envs.json``, written by ``bitpress env root PATH``,
which ``make envs`` runs for ``.venv``), else the user cache."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

import bitpress
import bitpress.plugins
from bitpress.envs import EnvError, list_envs, locate_envs_root, record_envs_root, where
from bitpress.envs.protocol import PROTOCOL, ROOT_RECORD, envs_root
from bitpress.plugins import Registry


@pytest.fixture
def prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake venv as the running Python environment; no BITPRESS_ENVS; a private home."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("home = /nowhere\n")
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.delenv("BITPRESS_ENVS", raising=False)
    monkeypatch.delenv("BITPRESS_NO_ENVS", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(bitpress.plugins, "_default", None)
    return venv


def _env(root: Path, name: str = "fake") -> Path:
    """An environment as `env create` leaves it, whose Python is this interpreter."""
    path = root / name
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").symlink_to(sys.executable)
    (path / "env.json").write_text(json.dumps({"plugin": name, "protocol": PROTOCOL,
                                               "host_version": bitpress.__version__, "specs": []}))
    entry = {"pass": "fakeq", "plugin": name, "summary": "", "algorithms": ["fakeq"], "precisions": ["int4"],
             "model_kinds": ["onnx"], "needs_data": False, "available": True, "reason": None, "options": []}
    (path / "manifest.json").write_text(json.dumps({"protocol": PROTOCOL, "env": name, "passes": [entry]}))
    return path


def test_recorded_root_is_found_without_the_variable(prefix: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    default = tmp_path / "home" / ".cache" / "bitpress" / "envs"
    assert locate_envs_root().source == "default" and envs_root() == default

    root = tmp_path / "project" / ".bitpress-envs"
    _env(root)
    record = record_envs_root(root)
    assert record == prefix / ROOT_RECORD and json.loads(record.read_text()) == {"root": str(root)}
    found = locate_envs_root()
    assert (found.path, found.source, found.record) == (root, "recorded", record)
    assert [e.name for e in list_envs()] == ["fake"]
    # the environment's passes reach the registry the host builds
    assert where(Registry().passes["fakeq"]) == "env:fake"

    # BITPRESS_ENVS still wins
    monkeypatch.setenv("BITPRESS_ENVS", str(tmp_path / "elsewhere"))
    assert locate_envs_root().source == "BITPRESS_ENVS" and envs_root() == tmp_path / "elsewhere"
    monkeypatch.delenv("BITPRESS_ENVS")

    record_envs_root(None)
    assert not record.exists() and envs_root() == default
    record_envs_root(None)  # removing what is not there is fine


def test_relative_and_broken_records(prefix: Path, caplog: pytest.LogCaptureFixture) -> None:
    (prefix / ROOT_RECORD).write_text(json.dumps({"root": "../envs"}))
    assert envs_root() == prefix.parent / "envs"
    for bad in ("not json", json.dumps({"path": "/x"}), json.dumps({"root": ""}), json.dumps(["/x"])):
        (prefix / ROOT_RECORD).write_text(bad)
        with caplog.at_level(logging.WARNING, logger="bitpress"):
            caplog.clear()
            assert locate_envs_root().source == "default"
        assert "not a valid record" in caplog.text


def test_record_in_an_unwritable_prefix(tmp_path: Path) -> None:
    with pytest.raises(EnvError, match="cannot record"):
        record_envs_root(tmp_path, prefix=tmp_path / "no-such-venv")


def test_env_root_command(run_cli, prefix: Path, tmp_path: Path) -> None:
    code, out, _ = run_cli("env", "root")
    assert code == 0 and "the default" in out
    root = tmp_path / "envs"
    _env(root)
    code, out, _ = run_cli("env", "root", root)
    assert code == 0 and f"recorded {root} in {prefix / ROOT_RECORD}" in out
    code, out, _ = run_cli("env", "root", "--json")
    assert json.loads(out) == {"root": str(root), "source": "recorded", "record": str(prefix / ROOT_RECORD)}
    code, out, _ = run_cli("env", "list")
    assert out.splitlines()[0] == f"environments in {root} (recorded for this Python environment in " \
                                  f"{prefix / ROOT_RECORD})"
    assert any(x.split()[:2] == ["fake", "fakeq"] for x in out.splitlines())
    code, out, _ = run_cli("passes", "list")
    assert next(x for x in out.splitlines() if x.startswith("fakeq ")).split()[-2:] == ["env:fake", "yes"]
    code, _, err = run_cli("env", "root", root, "--unset")
    assert code == 2 and "not both" in err
    code, out, _ = run_cli("env", "root", "--unset")
    assert code == 0 and not (prefix / ROOT_RECORD).exists() and "the default" in out
