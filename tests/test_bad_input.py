"""Bad inputs and bad requests through the CLI: one error line, the right exit code, nothing written.

Each failing run must leave the folder it ran in exactly as it was: no output, no temporary
``.<name>.bitpress-*`` folder, no output folder created, and the input's bytes unchanged.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest

from bitpress import hookimpl
from bitpress.errors import QuantizationError
from bitpress.passes import Pass, PassContext
from bitpress.plugins import Registry

BITPRESS = Path(sys.executable).parent / "bitpress"


# -- fixtures ------------------------------------------------------------------------------------------------
class ExplodingPass(Pass):
    """Writes a large tensor (spilled to the run's scratch folder), then fails."""

    name = "explode"
    algorithms = ("explode",)
    precisions = ("int4",)

    def run(self, model: Any, context: PassContext) -> Any:
        model.set_initializer("big_scratch", np.ones((1 << 19,), np.float32))  # 2 MiB: spills
        spills = list(context.workdir.glob("spill-*")) if context.workdir else []
        assert spills and spills[0].stat().st_size > 0, "the test needs spill data on disk"
        raise RuntimeError("solver exploded half way")


class FailingPass(ExplodingPass):
    name = "fail-cleanly"
    algorithms = ("fail-cleanly",)

    def run(self, model: Any, context: PassContext) -> Any:
        try:
            super().run(model, context)
        except RuntimeError as exc:
            raise QuantizationError(f"could not quantize: {exc}") from None
        return model


@pytest.fixture
def registry(make_registry) -> Registry:
    @hookimpl
    def bitpress_register_passes(register):
        register(ExplodingPass)
        register(FailingPass)

    return make_registry(("failing", SimpleNamespace(bitpress_register_passes=bitpress_register_passes)))


@pytest.fixture
def cli(run_cli, registry: Registry) -> Callable[..., tuple[int, str, str]]:
    """The CLI on a registry with rtn and the failing passes (independent of installed plugins)."""
    return lambda *argv: run_cli(*argv, registry=registry)


def _write_locations(model: Path, location: Callable[[str], str]) -> None:
    proto = onnx.load(str(model), load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location(e.value)
    model.write_bytes(proto.SerializeToString())


def _make_bad(kind: str, root: Path, decoder: Path, decoder_ext: Path, genai: Path | None = None) -> Path:
    """Build one kind of bad input inside ``root`` and return the model path to pass."""
    src = root / "in"
    if kind.startswith("genai-"):
        assert genai is not None
        shutil.copytree(genai, src)
        if kind == "genai-bad-config":
            (src / "genai_config.json").write_text('{"model": {"decoder": ')
        else:  # the decoder's weights live in a data file that was not copied
            shutil.copy(decoder_ext, src / "model.onnx")
        return src
    src.mkdir(parents=True)
    model = src / "model.onnx"
    if kind == "text":
        model.write_text("name: not an onnx model\nlayers: 2\n")
    elif kind == "empty":
        model.write_bytes(b"")
    elif kind == "truncated":
        data = decoder.read_bytes()
        model.write_bytes(data[: len(data) // 2])
    elif kind == "folder-without-models":
        (src / "notes.txt").write_text("nothing here")
        return src
    else:
        shutil.copy(decoder_ext, model)
        data = decoder_ext.with_name("model.onnx.data")
        if kind == "missing-data":
            pass
        elif kind == "truncated-data":
            (src / "model.onnx.data").write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        elif kind == "dotdot":
            # the file really exists one level up: refused for leaving the folder, not for missing
            shutil.copy(data, root / "model.onnx.data")
            _write_locations(model, lambda loc: f"../{loc}")
        elif kind == "absolute":
            outside = root / "elsewhere"
            outside.mkdir()
            shutil.copy(data, outside / "model.onnx.data")
            _write_locations(model, lambda loc: str(outside / loc))
        elif kind == "symlink":
            outside = root / "elsewhere"
            outside.mkdir()
            shutil.copy(data, outside / "model.onnx.data")
            (src / "model.onnx.data").symlink_to(outside / "model.onnx.data")
        else:
            raise AssertionError(kind)
    return model


BAD_INPUTS = {
    "text": "not a valid ONNX model",
    "empty": "empty",
    "truncated": "not a valid ONNX model",
    "folder-without-models": "without any .onnx",
    "missing-data": "missing",
    "truncated-data": "truncated",
    "dotdot": "leaves the model's folder",
    "absolute": "absolute",
    "symlink": "symbolic link",
    "genai-bad-config": "genai_config.json is not valid JSON",
    "genai-missing-data": "missing",
}


def _assert_one_error_line(err: str, contains: str = "") -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got:\n{err}"
    assert lines[0].startswith("bitpress: error: "), lines[0]
    assert "Traceback" not in err
    assert contains in lines[0], f"{contains!r} not in {lines[0]!r}"
    return lines[0]


def _temp_dirs(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".bitpress-" in p.name or p.name.startswith("spill-")]


# -- bad inputs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(BAD_INPUTS))
@pytest.mark.parametrize("output", ["out/q.onnx", "out/folder"])
def test_bad_input_fails_cleanly(
    kind: str, output: str, tmp_path: Path, cli, sha256_tree, tiny_decoder: Path, tiny_decoder_external: Path,
    genai_folder: Path,
) -> None:
    model = _make_bad(kind, tmp_path, tiny_decoder, tiny_decoder_external, genai_folder)
    before = sha256_tree(tmp_path)
    code, out, err = cli("quantize", "-m", model, "-o", tmp_path / output, "--algorithm", "rtn",
                         "--precision", "int4")
    assert code == 1, err
    expected = BAD_INPUTS[kind]
    if model.is_dir() and output.endswith(".onnx"):  # the output rule is checked before the input is read
        expected = "which names one model file, but the input is a folder"
    _assert_one_error_line(err, expected)
    assert out == ""
    # nothing written anywhere (not even the output's parent folder), the input unchanged
    assert sha256_tree(tmp_path) == before


@pytest.mark.parametrize("kind", ["text", "missing-data", "symlink"])
def test_inspect_bad_input(kind: str, tmp_path: Path, cli, tiny_decoder: Path, tiny_decoder_external: Path) -> None:
    model = _make_bad(kind, tmp_path, tiny_decoder, tiny_decoder_external)
    code, _, err = cli("inspect", model)
    assert code == 1
    _assert_one_error_line(err, BAD_INPUTS[kind])


def test_missing_model(tmp_path: Path, cli) -> None:
    code, _, err = cli("quantize", "-m", tmp_path / "nope.onnx", "-o", tmp_path / "o.onnx", "--algorithm", "rtn")
    assert code == 1
    _assert_one_error_line(err, "not found")
    assert list(tmp_path.iterdir()) == []


def test_real_process_prints_no_traceback(tmp_path: Path, tiny_decoder: Path, sha256_tree) -> None:
    """The installed console script, as a user runs it (with the installed plugins)."""
    model = _make_bad("truncated", tmp_path, tiny_decoder, tiny_decoder)
    before = sha256_tree(tmp_path)
    proc = subprocess.run(
        [str(BITPRESS), "quantize", "-m", str(model.relative_to(tmp_path)), "-o", "out/q.onnx", "--algorithm", "rtn",
         "--precision", "int4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    # installed plugins may log warnings, but the last line is the error
    assert proc.stderr.strip().splitlines()[-1].startswith("bitpress: error: in/model.onnx is not a valid ONNX")
    assert proc.stdout == ""
    assert sha256_tree(tmp_path) == before


def test_verbose_shows_traceback(tmp_path: Path, cli, tiny_decoder: Path) -> None:
    model = _make_bad("text", tmp_path, tiny_decoder, tiny_decoder)
    code, _, err = cli("--verbose", "quantize", "-m", model, "-o", tmp_path / "o.onnx", "--algorithm", "rtn")
    assert code == 1
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1].startswith("bitpress: error: ")


# -- outputs -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "same",
    ["identical", "dot-slash", "symlink", "input-folder", "ancestor", "data-file", "optimum-data", "data-of-output"],
)
def test_output_equal_to_input_refused(
    same: str, tmp_path: Path, cli, sha256_tree, tiny_decoder_external: Path,
) -> None:
    """Even with --overwrite, the output may not replace the input, its data, or a folder holding them."""
    shutil.copytree(tiny_decoder_external.parent, tmp_path / "top" / "m")
    model = tmp_path / "top" / "m" / "model.onnx"
    if same in ("optimum-data", "data-of-output"):
        # external data under another name: Optimum's model.onnx_data, or what a q.onnx output would write
        name = "model.onnx_data" if same == "optimum-data" else "q.onnx.data"
        (model.parent / "model.onnx.data").rename(model.parent / name)
        _write_locations(model, lambda loc: name)
    output = {
        "identical": model,
        "dot-slash": model.parent / "." / "model.onnx",
        "symlink": tmp_path / "link.onnx",
        "input-folder": model.parent,  # a folder output would put model.onnx over the input
        "ancestor": tmp_path / "top",  # replacing this folder would delete the input
        "data-file": model.parent / "model.onnx.data",
        "optimum-data": model.parent / "model.onnx_data",
        "data-of-output": model.parent / "q.onnx",
    }[same]
    if same == "symlink":
        output.symlink_to(model)
    before = sha256_tree(tmp_path)
    code, _, err = cli("quantize", "-m", model, "-o", output, "--algorithm", "rtn", "--overwrite")
    assert code in (1, 2)
    line = _assert_one_error_line(err)
    assert "input" in line
    assert sha256_tree(tmp_path) == before


def test_output_of_folder_inside_input_refused(tmp_path: Path, cli, genai_folder: Path, sha256_tree) -> None:
    shutil.copytree(genai_folder, tmp_path / "pkg")
    before = sha256_tree(tmp_path)
    code, _, err = cli("quantize", "-m", tmp_path / "pkg", "-o", tmp_path / "pkg" / "q", "--algorithm", "rtn")
    assert code in (1, 2)
    _assert_one_error_line(err, "overlaps")
    assert sha256_tree(tmp_path) == before


def test_existing_file_output(tmp_path: Path, cli, tiny_decoder: Path) -> None:
    out = tmp_path / "q.onnx"
    out.write_bytes(b"precious")
    args = ("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "rtn", "--precision", "int4")
    code, _, err = cli(*args)
    assert code == 1
    _assert_one_error_line(err, "--overwrite")
    assert out.read_bytes() == b"precious"

    # a stale data file of an earlier external-data run must not survive a replacement
    (tmp_path / "q.onnx.data").write_bytes(b"stale")
    code, stdout, err = cli(*args, "--overwrite")
    assert code == 0, err
    assert "wrote" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx"]
    onnx.checker.check_model(str(out))


def test_existing_folder_output(tmp_path: Path, cli, tiny_decoder: Path) -> None:
    out = tmp_path / "result"
    out.mkdir()
    (out / "old.txt").write_text("old run")
    args = ("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "rtn", "--precision", "int4")
    code, _, err = cli(*args)
    assert code == 1
    _assert_one_error_line(err, "already exists")
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    code, _, err = cli(*args, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx"]
    assert [p.name for p in tmp_path.iterdir()] == ["result"]


# -- bad requests --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--algorithm", "rtn", "--option", "foo=1"], "valid options: accuracy_level, bits, block_size"),
        (["--algorithm", "rtn", "--option", "block_size=abc"], "block_size='abc' is not a valid int"),
        (["--algorithm", "rtn", "--option", "block_size=48"], "power of two"),
        (["--algorithm", "rtn", "--option", "block_size"], "KEY=VALUE"),
        (["--algorithm", "rtn", "--precision", "int3"], "int4"),
        (["--algorithm", "rtn", "--precision", "int4", "--option", "bits=8"], "contradicts"),
        (["--algorithm", "no-such-algo"], "known: "),
    ],
)
def test_bad_request_exit_2(
    extra: list[str], message: str, tmp_path: Path, cli, tiny_decoder: Path, sha256_tree
) -> None:
    before = sha256_tree(tmp_path)
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "out" / "q.onnx", *extra)
    assert code == 2
    _assert_one_error_line(err, message)
    assert sha256_tree(tmp_path) == before


def test_argparse_errors_exit_2(cli, tiny_decoder: Path) -> None:
    code, _, err = cli("quantize", "-m", tiny_decoder)  # no --output, no --algorithm
    assert code == 2
    assert "required" in err
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", "x.onnx", "--algorithm", "rtn", "--max-shard-size", "lots")
    assert code == 2
    assert "not a size" in err


# -- a pass failing mid-run -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("algorithm", "message"), [
    # an exception in a plugin's pass is that plugin's fault, named (tests/test_plugin_faults.py)
    ("explode", "bitpress: error: plugin failing failed in pass explode: RuntimeError: solver exploded half way"),
    ("fail-cleanly", "bitpress: error: could not quantize"),
])
@pytest.mark.parametrize("output", ["new/q.onnx", "new/folder"])
def test_pass_failing_mid_run_leaves_nothing(
    algorithm: str, message: str, output: str, tmp_path: Path, cli, tiny_decoder_external: Path, sha256_tree,
) -> None:
    shutil.copytree(tiny_decoder_external.parent, tmp_path / "m")
    before = sha256_tree(tmp_path)
    code, out, err = cli("quantize", "-m", tmp_path / "m" / "model.onnx", "-o", tmp_path / output,
                         "--algorithm", algorithm, "--precision", "int4")
    assert code == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), err
    assert "Traceback" not in err
    assert out == ""
    assert not _temp_dirs(tmp_path)
    assert sha256_tree(tmp_path) == before  # also: the parent folder "new" was not left behind


def test_pass_failing_with_verbose_shows_the_traceback(tmp_path: Path, cli, tiny_decoder: Path) -> None:
    code, _, err = cli("--verbose", "quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm",
                       "explode", "--precision", "int4")
    assert code == 1
    assert "Traceback" in err and "RuntimeError: solver exploded half way" in err  # the pass's own, chained
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_previous_output(tmp_path: Path, cli, tiny_decoder: Path) -> None:
    """With --overwrite, a failing run must not destroy the earlier result."""
    out = tmp_path / "result"
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "rtn", "--precision", "int4")
    assert code == 0, err
    first = (out / "model.onnx").read_bytes()
    code, _, _ = cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "fail-cleanly", "--precision",
                     "int4", "--overwrite")
    assert code == 1
    assert (out / "model.onnx").read_bytes() == first
    assert not _temp_dirs(tmp_path)
