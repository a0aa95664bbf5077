"""The output's safety: no-overwrite holds at the final move, one run per output, signals, setup errors.

The contract (docs/security.md, "The output"):

* without ``--overwrite`` nothing at the output's place is ever deleted or replaced, even what
  appeared while the run worked (the final move is atomic and never replaces); with it the old
  output stays whole until the new one is complete, and is put back if the swap fails;
* two runs on one output: one fails at once (the output's lock), the other writes a valid model;
* SIGINT, SIGTERM and SIGHUP clean up (exit ``128 + signum``, one line, nothing beside the output);
* setup errors come before anything is created; a full disk or a read-only file system is one
  clean ``bitpress: error:`` line.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import onnx
import pytest

import bitpress.output
import bitpress.workflow.config
import bitpress.workflow.runner
from bitpress import hookimpl, synthetic
from bitpress.errors import Interrupted
from bitpress.passes import Pass, PassContext
from bitpress.plugins import Registry
from bitpress.testing import default_signals

BITPRESS = Path(sys.executable).parent / "bitpress"


# -- helpers ------------------------------------------------------------------------------------------------------
@dataclass
class IntruderOptions:
    path: str = ""
    kind: str = "file"  # file | folder | empty-folder


class IntruderPass(Pass):
    """Plays another program: writes something where the output goes, while the run works."""

    name = "intruder"
    algorithms = ("intruder",)
    precisions = ("int4",)
    Options = IntruderOptions

    def run(self, model: Any, context: PassContext) -> Any:
        where = Path(self.options.path)
        if self.options.kind == "file":
            where.write_bytes(b"precious")
        else:
            where.mkdir()
            if self.options.kind == "folder":
                (where / "theirs.txt").write_bytes(b"precious")
        return model


class InterruptedPass(Pass):
    """Raises what the CLI's SIGTERM handler raises, in the middle of the run."""

    name = "sigterm"
    algorithms = ("sigterm",)
    precisions = ("int4",)

    def run(self, model: Any, context: PassContext) -> Any:
        model.set_initializer("scratch", __import__("numpy").ones((1 << 19,), "float32"))  # spills to disk
        raise Interrupted(signal.SIGTERM)


@pytest.fixture
def registry(make_registry) -> Registry:
    @hookimpl
    def bitpress_register_passes(register):
        register(IntruderPass)
        register(InterruptedPass)

    return make_registry(("intruders", SimpleNamespace(bitpress_register_passes=bitpress_register_passes)))


@pytest.fixture
def cli(run_cli, registry: Registry):
    return lambda *argv: run_cli(*argv, registry=registry)


def leftovers(root: Path) -> list[Path]:
    """Temporary folders, locks and spill files of bitpress under ``root``."""
    return [p for p in root.rglob("*") if ".bitpress-" in p.name or p.name.startswith("spill-")]


def one_error_line(err: str, *contains: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert lines[0].startswith("bitpress: error: "), lines[0]
    assert "internal error" not in err and "Traceback" not in err
    for text in contains:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"
    return lines[0]


#: a `bitpress` command line whose registry adds the pass `nap` (sleeps `seconds`, then returns the model)
NAP_SCRIPT = textwrap.dedent("""
    import sys, time
    from dataclasses import dataclass
    from types import SimpleNamespace

    import bitpress.plugins
    import bitpress_rtn
    from bitpress import cli, hookimpl
    from bitpress.passes import Pass
    from bitpress.plugins import Registry

    @dataclass
    class NapOptions:
        seconds: float = 60.0

    class NapPass(Pass):
        name = "nap"
        algorithms = ("nap",)
        precisions = ("int4",)
        Options = NapOptions

        def run(self, model, context):
            model.set_initializer("scratch", __import__("numpy").ones((1 << 19,), "float32"))  # a spill file
            time.sleep(self.options.seconds)
            return model

    @hookimpl
    def bitpress_register_passes(register):
        register(NapPass)

    reg = Registry(entry_points=False)
    reg.register(bitpress_rtn, name="rtn")
    reg.register(SimpleNamespace(bitpress_register_passes=bitpress_register_passes), name="nap")
    bitpress.plugins._default = reg
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.fixture
def nap(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    script = tmp_path_factory.mktemp("nap") / "nap_bitpress.py"
    script.write_text(NAP_SCRIPT)
    return [sys.executable, str(script)]


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("BITPRESS_NO_ENVS",)}


def _wait_for_temp(parent: Path, proc: subprocess.Popen, seconds: float = 60) -> None:
    """Until the run's temporary folder is beside the output (then the run is under way)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if any(p.is_dir() for p in parent.glob(".*.bitpress-*")) if parent.is_dir() else False:
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended (code {proc.returncode}) before it was under way:\n{out}\n{err}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("the run's temporary folder never appeared")


@pytest.fixture(scope="module")
def medium_decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A decoder that takes the RTN pass a second or more with threads (about 100 MB, external data)."""
    path = tmp_path_factory.mktemp("medium") / "model.onnx"
    return synthetic.build_decoder(path, hidden=768, layers=6, heads=8, vocab=4096, external_data=True)


# -- the final move never replaces what appeared --------------------------------------------------------------------
@pytest.mark.parametrize(("output", "kind", "appears"), [
    ("q.onnx", "file", "q.onnx"),
    ("q.onnx", "file", "q.onnx.data"),  # the data file the run writes (--external-data)
    ("q.onnx", "empty-folder", "q.onnx"),
    ("result", "folder", "result"),
    ("result", "file", "result"),
    ("new/result", "folder", "new/result"),  # in a parent folder this run created
])
def test_output_appearing_during_the_run_is_never_replaced(
    output: str, kind: str, appears: str, tmp_path: Path, cli, tiny_decoder: Path, sha256_tree,
) -> None:
    where = tmp_path / appears
    (tmp_path / "new").mkdir()  # kept: the intruder writes into it too
    code, out, err = cli("quantize", "-m", tiny_decoder, "-o", tmp_path / output, "--algorithm", "intruder",
                         "--precision", "int4", "--option", f"path={where}", "--option", f"kind={kind}",
                         "--external-data")
    assert code == 1, err
    assert out == ""
    one_error_line(err, "appeared while this run was working", "--overwrite")
    # what the other program wrote is exactly as it wrote it, and nothing of this run is left
    if kind == "file":
        assert where.read_bytes() == b"precious"
    elif kind == "folder":
        assert [p.name for p in where.iterdir()] == ["theirs.txt"]
        assert (where / "theirs.txt").read_bytes() == b"precious"
    else:
        assert where.is_dir() and not any(where.iterdir())
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == sorted(
        {appears, "new", *([f"{appears}/theirs.txt"] if kind == "folder" else [])})
    assert not leftovers(tmp_path)


def test_empty_folder_appearing_for_a_folder_output_is_filled(tmp_path: Path, cli, tiny_decoder: Path) -> None:
    """An empty folder is a valid place for a folder output (as at the start): the run fills it."""
    out = tmp_path / "result"
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "intruder", "--precision", "int4",
                       "--option", f"path={out}", "--option", "kind=empty-folder")
    assert code == 0, err
    assert [p.name for p in out.iterdir()] == ["model.onnx"]
    assert [p.name for p in tmp_path.iterdir()] == ["result"]


def test_overwrite_replaces_what_appeared(tmp_path: Path, cli, tiny_decoder: Path) -> None:
    out = tmp_path / "q.onnx"
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "intruder", "--precision", "int4",
                       "--option", f"path={out}", "--overwrite")
    assert code == 0, err
    onnx.checker.check_model(str(out))
    assert [p.name for p in tmp_path.iterdir()] == ["q.onnx"]


def test_stale_data_file_is_not_deleted_without_overwrite(tmp_path: Path, cli, tiny_decoder: Path) -> None:
    (tmp_path / "q.onnx.data").write_bytes(b"an earlier run's")
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm", "rtn",
                       "--precision", "int4")
    assert code == 1
    one_error_line(err, "q.onnx.data already exists", "--overwrite")
    assert [p.name for p in tmp_path.iterdir()] == ["q.onnx.data"]
    assert (tmp_path / "q.onnx.data").read_bytes() == b"an earlier run's"


# -- --overwrite keeps the old output until the new one is in --------------------------------------------------------
@pytest.mark.parametrize("output", ["q.onnx", "result"])
def test_overwrite_keeps_old_output_when_the_run_fails(
    output: str, tmp_path: Path, cli, tiny_decoder: Path, sha256_tree,
) -> None:
    out = tmp_path / output
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "rtn", "--precision", "int4",
                       "--external-data")
    assert code == 0, err
    before = sha256_tree(tmp_path)
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "sigterm", "--precision", "int4",
                       "--overwrite")
    assert code == 128 + signal.SIGTERM
    assert sha256_tree(tmp_path) == before
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("output", ["q.onnx", "result"])
def test_overwrite_puts_the_old_output_back_when_the_swap_fails(
    output: str, tmp_path: Path, cli, tiny_decoder: Path, sha256_tree, monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / output
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "rtn", "--precision", "int4",
                       "--external-data")
    assert code == 0, err
    before = sha256_tree(tmp_path)
    real_replace, real_rename = os.replace, os.rename

    def full_disk(move: Any) -> Any:
        def fail(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            if "payload" in str(src) and Path(dst).parent == tmp_path:  # moving the new output in
                raise OSError(errno.ENOSPC, "No space left on device", str(dst))
            return move(src, dst, *args, **kwargs)
        return fail

    monkeypatch.setattr(bitpress.output.os, "replace", full_disk(real_replace))
    monkeypatch.setattr(bitpress.output.os, "rename", full_disk(real_rename))
    monkeypatch.setattr(bitpress.output, "_renameat2_noreplace", lambda src, dst: False)
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "rtn", "--precision", "int8",
                       "--external-data", "--overwrite")
    assert code == 1
    one_error_line(err, f"cannot write the output {out}", "No space left on device", "nothing was written")
    assert sha256_tree(tmp_path) == before
    assert not leftovers(tmp_path)


# -- two runs on one output -------------------------------------------------------------------------------------------
def _two_runs(commands: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen(c, cwd=cwd, env=_environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def _check_one_winner(results: list[subprocess.CompletedProcess], out: Path) -> str:
    codes = sorted(r.returncode for r in results)
    assert codes == [0, 1], [(r.returncode, r.stderr) for r in results]
    loser = next(r for r in results if r.returncode == 1)
    line = one_error_line(loser.stderr)
    # the lock's holder may not have written its pid yet: then the message names no process
    assert any(m in line for m in ("another bitpress run", "already exists", "appeared")), line
    onnx.checker.check_model(str(out))
    assert sorted(p.name for p in out.parent.iterdir()) == sorted({out.name, *[p.name for p in out.parent.glob(
        out.name + ".data*")]})
    return line


def test_concurrent_writers_one_fails_cleanly(tmp_path: Path, tiny_decoder: Path) -> None:
    """Two `bitpress quantize` processes, one output: exactly one writes it, the other fails with one line."""
    model = synthetic.build_decoder(tmp_path / "m" / "model.onnx", hidden=256, layers=4, vocab=1024)
    out = tmp_path / "out" / "q.onnx"
    command = [str(BITPRESS), "quantize", "-m", str(model), "-o", str(out), "--algorithm", "rtn",
               "--precision", "int4", "--jobs", "1"]
    results = _two_runs([command, command], tmp_path)
    _check_one_winner(results, out)


def test_concurrent_writers_while_one_works(tmp_path: Path, nap: list[str], tiny_decoder: Path) -> None:
    """The second run comes while the first holds the output: it fails at once, naming the first."""
    out = tmp_path / "out" / "q.onnx"
    first = subprocess.Popen([*nap, "quantize", "-m", str(tiny_decoder), "-o", str(out), "--algorithm", "nap",
                              "--precision", "int4", "--option", "seconds=3"], env=_environ(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_temp(out.parent, first)
    second = subprocess.run([*nap, "quantize", "-m", str(tiny_decoder), "-o", str(out), "--algorithm", "rtn",
                             "--precision", "int4"], env=_environ(), capture_output=True, text=True, timeout=120)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    assert second.returncode == 1
    one_error_line(second.stderr, f"another bitpress run (process {first.pid}) is writing the output {out}")
    onnx.checker.check_model(str(out))
    assert sorted(p.name for p in out.parent.iterdir()) == ["q.onnx"]


def test_stale_lock_of_a_dead_run_is_taken_over(tmp_path: Path, cli, tiny_decoder: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / ".q.onnx.bitpress-lock"
    lock.write_text(f"{dead.pid}\n")
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm", "rtn",
                       "--precision", "int4")
    assert code == 0, err
    assert f"taking over the lock {lock} left by process {dead.pid}" in err
    assert [p.name for p in tmp_path.iterdir()] == ["q.onnx"]


def test_lock_held_by_another_run_refuses(tmp_path: Path, cli, tiny_decoder: Path) -> None:
    fcntl = pytest.importorskip("fcntl")
    lock = tmp_path / ".q.onnx.bitpress-lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        code, _, err = cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm", "rtn",
                           "--precision", "int4")
    assert code == 1
    one_error_line(err, "another bitpress run (process 4242) is writing the output")
    assert [p.name for p in tmp_path.iterdir()] == [lock.name]  # the other run's lock is its own to remove


def test_lock_without_flock(tmp_path: Path, cli, tiny_decoder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where flock is refused (some network file systems): an O_EXCL lock file, its recorded process checked."""
    fcntl = pytest.importorskip("fcntl")

    def no_flock(fd: Any, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    lock = tmp_path / ".q.onnx.bitpress-lock"
    args = ("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm", "rtn", "--precision", "int4")
    lock.write_text(f"{os.getpid()}\n")  # a live process holds it
    code, _, err = cli(*args)
    assert code == 1
    one_error_line(err, f"another bitpress run (process {os.getpid()}) is writing the output")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(f"{dead.pid}\n")  # a dead one: taken over
    code, _, err = cli(*args)
    assert code == 0, err
    assert f"taking over the stale lock {lock} of process {dead.pid}" in err
    assert [p.name for p in tmp_path.iterdir()] == ["q.onnx"]


def test_lock_path_that_is_a_link_is_refused(tmp_path: Path, cli, tiny_decoder: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    (tmp_path / ".q.onnx.bitpress-lock").symlink_to(victim)
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm", "rtn",
                       "--precision", "int4")
    assert code == 1
    one_error_line(err, "is a symbolic link")
    assert victim.read_bytes() == b"precious"


# -- signals -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
@pytest.mark.parametrize("output", ["new/q.onnx", "new/folder"])
def test_signal_cleans_up(sig: str, output: str, tmp_path: Path, nap: list[str], tiny_decoder: Path) -> None:
    signum = getattr(signal, sig, None)
    if signum is None:
        pytest.skip(f"no {sig} here")
    out = tmp_path / output
    proc = subprocess.Popen([*nap, "quantize", "-m", str(tiny_decoder), "-o", str(out), "--algorithm", "nap",
                             "--precision", "int4"], env=_environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=default_signals)
    _wait_for_temp(out.parent, proc)
    t0 = time.monotonic()
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 20
    assert proc.returncode == 128 + signum, stderr
    assert [line for line in stderr.splitlines() if line.strip()] == [
        f"bitpress: interrupted by {sig}; nothing was written"]
    assert stdout == ""
    assert list(tmp_path.iterdir()) == []  # no output, lock, temporary folder, spill file, nor the folder "new"


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_signal_during_threaded_quantization(sig: str, tmp_path: Path, medium_decoder: Path) -> None:
    """The real `bitpress` on a model that takes a while, solving in 4 threads: nothing stays, the threads stop."""
    signum = getattr(signal, sig, None)
    if signum is None:
        pytest.skip(f"no {sig} here")
    out = tmp_path / "out" / "q.onnx"
    proc = subprocess.Popen([str(BITPRESS), "quantize", "-m", str(medium_decoder), "-o", str(out), "--algorithm",
                             "rtn", "--precision", "int4", "--jobs", "4"], env=_environ(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    _wait_for_temp(out.parent, proc)
    time.sleep(0.3)  # into the quantization
    proc.send_signal(signum)
    _stdout, stderr = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal came (a very fast machine)")
    assert proc.returncode == 128 + signum, stderr
    assert [line for line in stderr.splitlines() if line.strip()] == [
        f"bitpress: interrupted by {sig}; nothing was written"]
    assert list(tmp_path.iterdir()) == []


def test_interrupt_in_process_cleans_up_and_restores_handlers(tmp_path: Path, cli, tiny_decoder: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    code, _out, err = cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "new" / "q.onnx", "--algorithm",
                         "sigterm", "--precision", "int4")
    assert code == 128 + signal.SIGTERM
    assert err.strip() == "bitpress: interrupted by SIGTERM; nothing was written"
    assert list(tmp_path.iterdir()) == []
    assert {s: signal.getsignal(s) for s in before} == before


def test_signal_during_the_final_move_waits_for_it(
    tmp_path: Path, cli, tiny_decoder: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal while the output is moved in: the move completes (whole output), then the run stops, saying so."""
    real = bitpress.output.commit_files

    def signalled(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this (main) thread at once: deferred
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(bitpress.output, "commit_files", signalled)
    out = tmp_path / "q.onnx"
    code, _, err = cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "rtn", "--precision", "int4")
    assert code == 128 + signal.SIGTERM
    assert err.strip() == f"bitpress: interrupted by SIGTERM; {out} had been written completely"
    onnx.checker.check_model(str(out))
    assert [p.name for p in tmp_path.iterdir()] == ["q.onnx"]


# -- setup errors create nothing; writing errors are clean -----------------------------------------------------------
@pytest.mark.parametrize("case", ["parent-file", "grandparent-file", "long-name", "missing-input", "bad-jobs",
                                  "negative-jobs"])
def test_setup_errors_create_no_folder(case: str, tmp_path: Path, cli, tiny_decoder: Path, sha256_tree) -> None:
    (tmp_path / "afile").write_bytes(b"a file")
    model, output, extra = tiny_decoder, tmp_path / "new" / "deeper" / "q.onnx", []
    if case == "parent-file":
        output = tmp_path / "afile" / "q.onnx"
    elif case == "grandparent-file":
        output = tmp_path / "afile" / "sub" / "q.onnx"
    elif case == "long-name":
        output = tmp_path / "new" / ("x" * 240) / "q.onnx"
    elif case == "missing-input":
        model = tmp_path / "missing.onnx"
    elif case == "bad-jobs":
        extra = ["--jobs", "0"]
    elif case == "negative-jobs":
        extra = ["--jobs", "-3"]
    before = sha256_tree(tmp_path)
    code, _out, err = cli("quantize", "-m", model, "-o", output, "--algorithm", "rtn", "--precision", "int4", *extra)
    assert code in (1, 2)
    line = one_error_line(err)
    if case.endswith("file"):
        assert "afile is a file, not a folder" in line
    assert sha256_tree(tmp_path) == before
    assert not (tmp_path / "new").exists()


def test_bad_jobs_in_python_create_no_folder(tmp_path: Path, registry: Registry, tiny_decoder: Path) -> None:
    from bitpress.errors import UsageError

    wf = bitpress.workflow.config.Workflow(input=tiny_decoder, output=tmp_path / "new" / "q.onnx", steps=[],
                                           jobs="many")
    with pytest.raises(UsageError, match="jobs"):
        bitpress.workflow.runner.run_workflow(wf, registry)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("how", ["permissions", "simulated-permissions", "simulated-read-only-fs"])
def test_read_only_parent_is_a_clean_error(how: str, tmp_path: Path, cli, tiny_decoder: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder that cannot be written: one line, before anything is made (root ignores permissions: simulated)."""
    parent = tmp_path / "ro"
    parent.mkdir()
    message = "permission denied on the folder"
    if how == "permissions":
        if not hasattr(os, "geteuid") or os.geteuid() == 0:
            pytest.skip("root writes into read-only folders: permissions cannot be tested as root")
        parent.chmod(0o555)
    elif how == "simulated-permissions":
        monkeypatch.setattr(bitpress.output.os, "access", lambda path, mode, **kw: Path(path) != parent)
    else:
        real = os.statvfs

        def statvfs(path: Any) -> Any:
            st = real(path)
            if Path(path) != parent:
                return st
            return SimpleNamespace(f_flag=st.f_flag | os.ST_RDONLY)

        monkeypatch.setattr(bitpress.output.os, "statvfs", statvfs)
        message = "is on a read-only file system"
    try:
        code, _, err = cli("quantize", "-m", tiny_decoder, "-o", parent / "new" / "q.onnx", "--algorithm", "rtn",
                           "--precision", "int4")
        assert code == 1
        one_error_line(err, message, str(parent))
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)


@pytest.mark.parametrize(("code_name", "reason"), [("ENOSPC", "No space left on device"),
                                                    ("EROFS", "Read-only file system"),
                                                    ("EACCES", "Permission denied")])
@pytest.mark.parametrize("where", ["host", "plugin"])
def test_write_errors_are_clean(code_name: str, reason: str, where: str, tmp_path: Path, make_registry, run_cli,
                                tiny_decoder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk or a read-only file system while saving: one `bitpress: error:` naming the path, nothing left."""
    number = getattr(errno, code_name)
    out = tmp_path / "new" / "q.onnx"

    def fail(destination: Path) -> None:
        Path(destination).parent.mkdir(parents=True, exist_ok=True)
        Path(destination).write_bytes(b"half a model")
        raise OSError(number, reason, str(destination))

    if where == "host":
        monkeypatch.setattr(bitpress.workflow.runner, "_save", lambda registry, model, dest, save: fail(dest))
        reg = make_registry()
    else:
        class FullDisk:
            @hookimpl(tryfirst=True)
            def bitpress_save_model(self, model, destination, options):
                fail(destination)

        reg = make_registry(("fulldisk", FullDisk()))
    code, stdout, err = run_cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "rtn", "--precision",
                                "int4", registry=reg)
    assert code == 1
    line = one_error_line(err, f"cannot write the output {out}", reason, f"({code_name})", "q.onnx",
                          "nothing was written")
    assert ".bitpress-" in line  # the file being written when it failed
    assert stdout == ""
    assert list(tmp_path.iterdir()) == []


# -- the moves themselves --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["native", "fallback"])
def test_moves_never_replace(how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "fallback":  # no renameat2, no hard links: the mkdir / O_EXCL reservations
        monkeypatch.setattr(bitpress.output, "_renameat2_noreplace", lambda src, dst: False)

        def no_link(src: Any, dst: Any, **kwargs: Any) -> None:
            raise OSError(errno.EPERM, "Operation not permitted", str(src), None, str(dst))

        monkeypatch.setattr(bitpress.output.os, "link", no_link)
    src_file, src_dir = tmp_path / "a.bin", tmp_path / "adir"
    src_file.write_bytes(b"new")
    src_dir.mkdir()
    (src_dir / "f").write_bytes(b"new")
    for existing in ("file", "folder", "empty-folder", "link"):
        dst = tmp_path / f"dst-{existing}"
        if existing == "file":
            dst.write_bytes(b"old")
        elif existing == "link":
            dst.symlink_to(tmp_path / "nowhere")
        else:
            dst.mkdir()
            if existing == "folder":
                (dst / "old").write_bytes(b"old")
        with pytest.raises(FileExistsError):
            bitpress.output.place_file(src_file, dst)
        with pytest.raises(FileExistsError):
            bitpress.output.rename_noreplace(src_dir, dst)
        assert src_file.read_bytes() == b"new" and (src_dir / "f").read_bytes() == b"new"
        assert os.path.lexists(dst)
    bitpress.output.place_file(src_file, tmp_path / "placed.bin")
    bitpress.output.rename_noreplace(src_dir, tmp_path / "placed-dir")
    assert (tmp_path / "placed.bin").read_bytes() == b"new" and not src_file.exists()
    assert (tmp_path / "placed-dir" / "f").read_bytes() == b"new" and not src_dir.exists()


# -- which kind of output: one rule for quantize, run, export and publish (issue #27) ---------------------------------
def _hf_folder(root: Path) -> Path:
    """A Hugging Face folder the loader accepts (config and a small safetensors file): `export`'s input."""
    import json
    import struct

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 16,
        "max_position_embeddings": 32}))
    header = json.dumps({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    return root


def _commands(tmp_path: Path, tiny_decoder: Path, genai_folder: Path, out: Path) -> dict[str, list[Any]]:
    """The same output given to every command that writes one (a config for run and publish)."""
    import yaml

    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"input": str(tiny_decoder), "output": str(out),
                                   "passes": [{"type": "rtn", "precision": "int4"}]}))
    pub = tmp_path / "publish.yaml"
    pub.write_text(yaml.safe_dump({"input": str(_hf_folder(tmp_path / "hf")), "output": str(out),
                                   "matrix": {"dtypes": ["f32"]}}))
    return {
        "quantize": ["quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "rtn"],
        "quantize-folder": ["quantize", "-m", genai_folder, "-o", out, "--algorithm", "rtn"],
        "run": ["run", run],
        "export": ["export", tmp_path / "hf", "-o", out, "--runtime", "onnx"],
        "publish": ["publish", pub],
    }


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("existing", ["none", "empty-folder", "folder"])
@pytest.mark.parametrize("command", ["quantize", "quantize-folder", "run", "export", "publish"])
def test_output_named_like_a_file_is_a_file(command: str, existing: str, overwrite: bool, tmp_path: Path, cli,
                                           tiny_decoder: Path, genai_folder: Path, sha256_tree) -> None:
    """`-o out.onnx` is one model file for every command: where it is an existing folder (empty or not) the run
    is refused, --overwrite or not, and nothing is written into or over the folder; a command whose output is
    a folder (a folder input, export, publish) refuses the name itself."""
    out = tmp_path / "out.onnx"
    if existing != "none":
        out.mkdir()
        if existing == "folder":
            (out / "theirs.txt").write_bytes(b"precious")
    argv = _commands(tmp_path, tiny_decoder, genai_folder, out)[command]
    before = sha256_tree(tmp_path)
    code, stdout, err = cli(*argv, *(["--overwrite"] if overwrite else []))
    if command in ("quantize", "run") and existing == "none":
        assert code == 0, err  # a file output, written as one
        assert out.is_file()
        return
    assert code == 1, err
    if command in ("quantize", "run"):
        one_error_line(err, f"the output {out} is an existing folder", "never replaced by a file")
    else:
        one_error_line(err, f"the output {out} ends in .onnx, which names one model file", "give a folder name")
    assert stdout == ""
    assert sha256_tree(tmp_path) == before
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("command", ["quantize", "run", "quantize-folder", "export", "publish"])
def test_folder_output_where_a_file_is_is_refused(command: str, tmp_path: Path, cli, tiny_decoder: Path,
                                                 genai_folder: Path, sha256_tree) -> None:
    """The other half of the rule: a folder output never replaces a file, --overwrite or not."""
    out = tmp_path / "result"
    out.write_bytes(b"precious")
    argv = _commands(tmp_path, tiny_decoder, genai_folder, out)[command]
    before = sha256_tree(tmp_path)
    code, _, err = cli(*argv, "--overwrite")
    assert code == 1, err
    one_error_line(err, f"the output {out} is an existing file", "never replaced by a folder")
    assert sha256_tree(tmp_path) == before


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("output", ["/proc/q.onnx", "/proc/sub/q.onnx", "/proc/bitpress-out"])
@pytest.mark.parametrize("command", ["quantize", "run", "export", "publish"])
def test_output_in_a_folder_that_takes_no_files(command: str, output: str, tmp_path: Path, cli, tiny_decoder: Path,
                                                genai_folder: Path) -> None:
    """/proc exists and looks writable (to root), but creating a file there fails with ENOENT: one clean line
    naming the folder, never an internal error; --plan writes nothing, so it still plans."""
    if command in ("export", "publish") and output.endswith(".onnx"):
        output = output.removesuffix(".onnx")  # their outputs are folders (the name rule is tested above)
    argv = _commands(tmp_path, tiny_decoder, genai_folder, Path(output))[command]
    code, stdout, err = cli(*argv)
    assert code == 1, err
    one_error_line(err, f"cannot write the output {output}", "files cannot be created in the folder /proc",
                   "(ENOENT)", "nothing was written")
    assert stdout == ""
    assert not leftovers(tmp_path)
    if command == "quantize":
        code, stdout, err = cli(*argv, "--plan")
        assert code == 0, err
        assert "nothing was written (--plan)" in stdout
