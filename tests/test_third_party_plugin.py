"""A real third-party plugin, built and installed the way users get one.

``tests/data/thirdparty_plugin`` is a complete distribution (``bitpress-pow2``): its own
pyproject with an entry point in the group ``bitpress``, and a WeightOnlyPass whose block
solver rounds to power-of-two scales. It is built into a wheel and installed with the host
from this checkout into a fresh virtual environment; everything after that runs the
environment's own ``bitpress`` console script.

Needs PyPI or a pip cache holding the host's dependencies and hatchling (the test is skipped,
not failed, when pip cannot reach either).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from bitpress.synthetic import random_inputs

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SRC = ROOT / "tests" / "data" / "thirdparty_plugin"
NETWORK_TROUBLE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
                   "ConnectTimeoutError", "No route to host")


@dataclass
class Venv:
    root: Path
    env: dict[str, str]
    seconds: dict[str, float]

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def run(self, *args: str | Path, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], cwd=cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def bitpress(self, *args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
        proc = self.run(self.bin / "bitpress", *args, cwd=cwd)
        assert proc.returncode == 0, f"bitpress {args} failed:\n{proc.stdout}\n{proc.stderr}"
        assert "Traceback" not in proc.stderr
        return proc

    def pip_install(self, *requirements: str | Path) -> None:
        proc = self.run(self.bin / "python", "-m", "pip", "install", *requirements, timeout=900)
        if proc.returncode and any(m in proc.stdout + proc.stderr for m in NETWORK_TROUBLE):
            pytest.skip(f"pip cannot reach PyPI or a cache: {proc.stderr.strip().splitlines()[-1]}")
        assert proc.returncode == 0, f"pip install {requirements} failed:\n{proc.stdout[-3000:]}\n{proc.stderr}"

    def distributions(self) -> dict[str, str]:
        proc = self.run(self.bin / "python", "-m", "pip", "list", "--format", "json")
        assert proc.returncode == 0, proc.stderr
        return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(proc.stdout)}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh venv with the host (from this checkout) and the plugin wheel, and nothing else of ours."""
    base = tmp_path_factory.mktemp("thirdparty")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PATH"] = f"{base / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    v = Venv(base / "venv", env, {})

    t0 = time.perf_counter()
    proc = v.run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", base / "dist", PLUGIN_SRC, timeout=600)
    if proc.returncode and any(m in proc.stdout + proc.stderr for m in NETWORK_TROUBLE):
        pytest.skip("pip cannot fetch hatchling to build the plugin wheel")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (base / "dist").glob("bitpress_pow2-0.3.1-*.whl")
    v.seconds["build wheel"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    proc = v.run(sys.executable, "-m", "venv", v.root, timeout=300)
    assert proc.returncode == 0, proc.stderr
    v.seconds["create venv"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    v.pip_install(ROOT, wheel)
    v.seconds["install host + wheel"] = time.perf_counter() - t0
    return v


def test_installed_plugin_is_listed(venv: Venv) -> None:
    dists = venv.distributions()
    assert dists["bitpress"] == "0.1.0" and dists["bitpress-pow2"] == "0.3.1"
    assert not {"bitpress-rtn", "bitpress-hqq", "bitpress-kquant"} & set(dists), "the bare host installs no backend"

    plugins = {p["plugin"]: p for p in json.loads(venv.bitpress("plugins", "--json").stdout)}
    assert set(plugins) == {"pow2"}
    assert plugins["pow2"] | {"module": None} == {
        "plugin": "pow2", "distribution": "bitpress-pow2", "version": "0.3.1", "module": None, "ok": True,
        "error": None, "passes": ["pow2"],
    }
    table = venv.bitpress("plugins").stdout
    assert any(line.split()[:4] == ["pow2", "bitpress-pow2", "0.3.1", "pow2"] for line in table.splitlines())

    listing = venv.bitpress("passes", "list").stdout.splitlines()
    row = next(line for line in listing if line.startswith("pow2 "))
    # a third party's block solver quantizes MoE experts too (the host writes QMoE)
    assert row.split() == ["pow2", "pow2", "pow2", "int4", "onnx", "no", "QMoE", "here", "yes"]
    shown = venv.bitpress("passes", "show", "pow2").stdout
    assert "symmetric blocks (no zero points stored)" in shown and "block_size" in shown


def _assert_pow2_model(path: Path, reference: Path, ort_outputs, block_size: int) -> None:
    """MatMulNBits with power-of-two scales (this solver ran), runnable and close to the float model."""
    proto = onnx.load(str(path))
    inits = {t.name: t for t in proto.graph.initializer}
    nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) >= 10
    for node in nodes:
        assert {a.name: a.i for a in node.attribute}["block_size"] == block_size
        scales = numpy_helper.to_array(inits[node.input[2]]).astype(np.float64)
        exponents = np.log2(np.abs(scales))
        np.testing.assert_array_equal(exponents, np.round(exponents), err_msg=node.name)
    feeds = random_inputs(reference)
    got, want = ort_outputs(path, feeds)[0], ort_outputs(reference, feeds)[0]
    assert got.shape == want.shape
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.9


def test_quantize_with_the_plugin(venv: Venv, tiny_decoder: Path, tmp_path: Path, ort_outputs) -> None:
    out = tmp_path / "q.onnx"
    proc = venv.bitpress("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "pow2", "--precision", "int4")
    assert "wrote" in proc.stdout
    _assert_pow2_model(out, tiny_decoder, ort_outputs, block_size=32)


def test_run_config_with_the_plugin(venv: Venv, tiny_decoder: Path, tmp_path: Path, ort_outputs) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "model.onnx").write_bytes(tiny_decoder.read_bytes())
    config = tmp_path / "recipe.yaml"
    # relative paths are resolved against the config's folder, not the working directory
    config.write_text(
        "input: in/model.onnx\n"
        "output: out\n"
        "passes:\n"
        "  - type: pow2\n"
        "    precision: int4\n"
        "    options:\n"
        "      block_size: 64\n"
        "      nodes_to_exclude: ['/lm_head/MatMul']\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    venv.bitpress("run", config, cwd=elsewhere)
    out = tmp_path / "out" / "model.onnx"
    _assert_pow2_model(out, tiny_decoder, ort_outputs, block_size=64)
    assert not any(elsewhere.iterdir())


def test_extras_install_exactly_the_named_backends(venv: Venv, tmp_path: Path) -> None:
    """Last in this module: it adds backends to the shared environment."""
    t0 = time.perf_counter()
    venv.pip_install(f"{ROOT}[rtn,hqq]")
    venv.seconds["install [rtn,hqq]"] = time.perf_counter() - t0
    dists = venv.distributions()
    ours = {name for name in dists if name.startswith("bitpress")}
    assert ours == {"bitpress", "bitpress-rtn", "bitpress-hqq", "bitpress-pow2"}
    plugins = {p["plugin"]: p for p in json.loads(venv.bitpress("plugins", "--json").stdout)}
    assert set(plugins) == {"pow2", "rtn", "hqq"}
    assert plugins["rtn"]["distribution"] == "bitpress-rtn" and plugins["rtn"]["ok"]
    print("fresh-venv timings (s):", {k: round(v, 1) for k, v in venv.seconds.items()})
