"""Shared fixtures: tiny synthetic models (built once per session) and small helpers.

The model fixtures are shared by every test of the session: treat them as read-only and copy
them (``shutil.copytree``) before changing anything.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# @pytest.mark.own_process (tests whose libraries may end the process: Ray's driver)
from own_process import pytest_configure, pytest_runtest_logreport, pytest_runtest_protocol  # noqa: F401

from bitpress import synthetic, testing
from bitpress.plugins import Registry

# Plugin environments a developer created (~/.cache/bitpress/envs) must not leak into the tests:
# the session sees an empty folder. Tests of real environments read BITPRESS_TEST_ENVS, which
# `make test` points at the project's .bitpress-envs (built by `make envs`).
TEST_ENVS = os.environ.get("BITPRESS_TEST_ENVS")
os.environ["BITPRESS_ENVS"] = tempfile.mkdtemp(prefix="bitpress-test-envs-")
atexit.register(shutil.rmtree, os.environ["BITPRESS_ENVS"], ignore_errors=True)


# Small enough that each builds in milliseconds, large enough that every weight is >= 1 KiB
# (so external-data paths are really exercised) and block sizes up to 64 divide K.
TINY = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256}


@pytest.fixture(scope="session")
def tiny_decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A single-file fp32 Llama-like decoder with a tied embedding / LM head (``model.onnx``)."""
    return synthetic.build_decoder(tmp_path_factory.mktemp("tiny_decoder") / "model.onnx", **TINY)


@pytest.fixture(scope="session")
def tiny_decoder_external(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same decoder with its weights in ``model.onnx.data`` beside it."""
    folder = tmp_path_factory.mktemp("tiny_decoder_external")
    return synthetic.build_decoder(folder / "model.onnx", external_data=True, **TINY)


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BERT-like encoder (MatMul and Gemm linears, LayerNorm, Erf GELU)."""
    return synthetic.build_encoder(tmp_path_factory.mktemp("tiny_encoder") / "model.onnx", hidden=64, layers=2)


@pytest.fixture(scope="session")
def genai_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ONNX Runtime GenAI-style folder: model.onnx, genai_config.json, tokenizer files."""
    return synthetic.build_genai_folder(tmp_path_factory.mktemp("genai") / "package", hidden=64, layers=2)


def _sha256_tree(path: Path) -> dict[str, str]:
    path = Path(path)
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    out = {}
    for p in sorted(path.rglob("*")):
        # symlinks are recorded as their target so a changed link shows up too
        if p.is_symlink():
            out[p.relative_to(path).as_posix()] = f"-> {p.readlink()}"
        elif p.is_file():
            out[p.relative_to(path).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[p.relative_to(path).as_posix() + "/"] = "dir"
    return out


@pytest.fixture(scope="session")
def sha256_tree() -> Callable[[Path], dict[str, str]]:
    """``sha256_tree(folder)``: relative path -> sha256 of every file (folders and links too)."""
    return _sha256_tree


@pytest.fixture(scope="session")
def ort_outputs() -> Callable[[Path, dict[str, np.ndarray]], list[np.ndarray]]:
    """``ort_outputs(model_path, feeds)``: every output of a CPU ONNX Runtime session."""
    return testing.ort_outputs


@pytest.fixture
def make_registry() -> Callable[..., Registry]:
    """``make_registry(*plugins, rtn=True)``: a registry without entry points.

    Each plugin is a module or object with hook implementations, or a ``(name, plugin)`` pair;
    the RTN plugin (``bitpress_rtn``) is added first unless ``rtn=False``, with the host's
    ``hf_to_onnx`` (registered by the host since it stopped coming with every HF plugin).
    """

    def make(*plugins: Any, rtn: bool = True) -> Registry:
        reg = Registry(entry_points=False)
        items: list[Any] = list(plugins)
        if rtn:
            import bitpress_rtn
            from bitpress.hf.passes import HfToOnnxPass

            items.insert(0, ("rtn", bitpress_rtn))
            reg.passes[HfToOnnxPass.name] = HfToOnnxPass
        for i, item in enumerate(items):
            name, plugin = item if isinstance(item, tuple) else (f"test-plugin-{i}", item)
            reg.register(plugin, name=name)
        return reg

    return make


@pytest.fixture
def run_cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., tuple[int, str, str]]:
    """``run_cli(*argv, registry=None)`` -> ``(exit code, stdout, stderr)`` of ``bitpress.cli.main``.

    With ``registry`` the CLI uses it instead of the installed entry points. Argparse errors
    (``SystemExit``) are returned as exit codes too.
    """
    import bitpress.plugins
    from bitpress import cli

    def run(*argv: str | Path, registry: Registry | None = None) -> tuple[int, str, str]:
        if registry is not None:
            monkeypatch.setattr(bitpress.plugins, "_default", registry)
        capsys.readouterr()  # drop anything printed before
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err

    return run

