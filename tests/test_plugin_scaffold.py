"""``bitpress plugin new NAME``: the package it writes works as written.

The fast tests generate a plugin into a temporary folder and run the generated test suite with
this host (the generated ``pyproject.toml`` puts ``src`` on pytest's path). The slow one does what
a plugin author does: installs the host (from this checkout, not editable: the templates must
ship in the wheel) and the generated plugin into a fresh virtual environment, runs the
generated tests and ``bitpress passes list`` there (as ``tests/test_third_party_plugin.py``
does for its example; skipped when pip cannot reach an index or cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bitpress import __version__
from bitpress.scaffold import TEMPLATES, new_plugin, templates

ROOT = Path(__file__).resolve().parents[1]
NETWORK_TROUBLE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
                   "ConnectTimeoutError", "No route to host")
FILES = ["README.md", "pyproject.toml", "src/bitpress_clip/__init__.py", "tests/test_clip.py"]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_templates_live_in_the_package() -> None:
    assert TEMPLATES.is_relative_to(Path(__import__("bitpress").__file__).parent)
    assert len(templates()) == 4


def test_new_writes_a_plugin_package(run_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "work" / "bitpress-clip"
    dest.parent.mkdir()
    code, out, err = run_cli("plugin", "new", "clip", "--dir", dest)
    assert code == 0, err
    assert f"created plugin clip (distribution bitpress-clip) in {dest}" in out
    assert _files(dest) == FILES
    for path in dest.rglob("*"):
        if path.is_file():
            assert "{{" not in path.read_text(), path  # every marker rendered
    project = tomllib.loads((dest / "pyproject.toml").read_text())
    assert project["build-system"]["build-backend"] == "hatchling.build"
    assert project["project"]["name"] == "bitpress-clip"
    major, minor = __version__.split(".")[:2]
    assert f"bitpress>={major}.{minor}" in project["project"]["dependencies"]
    assert project["project"]["entry-points"]["bitpress"] == {"clip": "bitpress_clip"}
    assert project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["src/bitpress_clip"]
    for name in ("src/bitpress_clip/__init__.py", "tests/test_clip.py"):
        compile((dest / name).read_text(), name, "exec")

    # the default folder is ./bitpress-NAME
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli("plugin", "new", "other")
    assert code == 0 and (tmp_path / "bitpress-other" / "src" / "bitpress_other" / "__init__.py").is_file()
    # an existing empty folder is fine
    (tmp_path / "empty").mkdir()
    assert new_plugin("third", tmp_path / "empty").path == tmp_path / "empty"
    assert "src/bitpress_third/__init__.py" in _files(tmp_path / "empty")


@pytest.mark.parametrize("name", ["Clip", "my-algo", "1st", "clip.v2", "", "bitpress_x"])
def test_bad_names_are_refused(run_cli, tmp_path: Path, name: str) -> None:
    code, out, err = run_cli("plugin", "new", name, "--dir", tmp_path / "p")
    assert code == 2 and out == ""
    assert err.startswith("bitpress: error: ") and err.count("\n") == 1
    assert not (tmp_path / "p").exists()


def test_never_overwrites(run_cli, tmp_path: Path) -> None:
    dest = tmp_path / "p"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    code, _, err = run_cli("plugin", "new", "clip", "--dir", dest)
    assert code == 2 and err == f"bitpress: error: {dest} already exists and is not an empty folder; nothing was " \
                                "written (pick another --dir or remove it)\n"
    assert _files(dest) == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli("plugin", "new", "clip", "--dir", tmp_path / "file")
    assert code == 2 and "already exists" in err
    code, _, err = run_cli("plugin", "new", "clip", "--dir", tmp_path / "no" / "such" / "p")
    assert code == 2 and "does not exist" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "p"]  # no temporary folder left


def test_a_name_taken_by_an_installed_plugin_is_a_warning(run_cli, make_registry, tmp_path: Path) -> None:
    code, _, err = run_cli("plugin", "new", "rtn", "--dir", tmp_path / "p", registry=make_registry())
    assert code == 0
    assert "bitpress: warning: 'rtn' already names an installed plugin and pass" in err
    assert (tmp_path / "p" / "src" / "bitpress_rtn" / "__init__.py").is_file()


def test_the_generated_tests_pass(tmp_path: Path) -> None:
    dest = new_plugin("clip", tmp_path / "bitpress-clip").path
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=dest,
                          env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout and "skipped" not in proc.stdout


@pytest.mark.slow
def test_generated_plugin_installs_and_passes_its_tests(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    env = _clean_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                     BITPRESS_ENVS=str(tmp_path / "no-envs"))

    def run(*args: str | Path, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)

    proc = run(sys.executable, "-m", "venv", venv)
    assert proc.returncode == 0, proc.stderr
    # the plugin comes from the installed host's own templates
    work = tmp_path / "work"
    work.mkdir()
    proc = run(venv / "bin" / "python", "-m", "pip", "install", ROOT, timeout=900)
    if proc.returncode and any(m in proc.stdout + proc.stderr for m in NETWORK_TROUBLE):
        pytest.skip(f"pip cannot reach PyPI or a cache: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    proc = run(venv / "bin" / "bitpress", "plugin", "new", "clip", cwd=work)
    assert proc.returncode == 0, proc.stderr
    dest = work / "bitpress-clip"
    proc = run(venv / "bin" / "python", "-c", "import bitpress; print(bitpress.__file__)")
    assert Path(proc.stdout.strip()).is_relative_to(venv), "the host must come from the wheel, not this checkout"

    proc = run(venv / "bin" / "python", "-m", "pip", "install", f"{dest}[test]", timeout=900)
    if proc.returncode and any(m in proc.stdout + proc.stderr for m in NETWORK_TROUBLE):
        pytest.skip(f"pip cannot fetch hatchling or pytest: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr

    proc = run(venv / "bin" / "bitpress", "plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert row | {"module": None} == {"plugin": "clip", "distribution": "bitpress-clip", "version": "0.1.0",
                                      "module": None, "ok": True, "error": None, "passes": ["clip"]}
    proc = run(venv / "bin" / "bitpress", "passes", "list")
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("clip "))
    # a generated block-solver plugin quantizes MoE experts too (the host writes QMoE)
    assert row.split() == ["clip", "clip", "clip", "int4,int8", "onnx", "no", "QMoE", "here", "yes"]

    proc = run(venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=dest, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
