"""Plugin faults: whatever a plugin raises, or however its worker dies, is one clean error.

A third-party plugin is installed the way pip would: a ``*.dist-info`` folder with an
``entry_points.txt`` (group ``bitpress``) and the plugin's module, in a temporary folder put on
``sys.path``. The same folder reaches an isolated worker (``--isolate``): it runs this
interpreter with this process's import path, and discovers the plugin by its entry point.

In process (no worker): ``SystemExit(0)``, ``SystemExit(3)``, a custom ``BaseException``,
``GeneratorExit`` and ``RuntimeError`` raised at import, while registering, in the loader hook,
in a pass, in a hook wrapper around the pass and in the saver hook. Each: exit code 1, one
``bitpress: error:`` line naming the plugin, nothing written, and ``passes list`` / ``plugins``
still work. A worker (``--isolate``, ``isolate: true``) that aborts, segfaults, or exits with
or without an exit code and no result: exit code 1, a clean line, nothing left.
"""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

import bitpress.plugins
from bitpress import plugin_probe
from bitpress.models.onnx_model import OnnxModel
from bitpress.passes import Pass

PLUGIN_MODULE = textwrap.dedent('''
    import ctypes
    import json
    import os
    import sys
    import time
    from dataclasses import dataclass

    from bitpress import hookimpl
    from bitpress.passes import Pass

    STAGE = {stage!r}
    FAULT = {fault!r}


    class Doom(BaseException):
        """A custom BaseException: not an Exception, so `except Exception` misses it."""


    def fault():
        if FAULT == "exit0":
            sys.exit(0)
        if FAULT == "exit3":
            sys.exit(3)
        if FAULT == "custom":
            raise Doom("the end of everything")
        if FAULT == "generatorexit":
            raise GeneratorExit("closed from the inside")
        if FAULT == "interrupt":
            raise KeyboardInterrupt
        if FAULT == "abort":  # native crashes: no exception, the process is gone
            os.abort()
        if FAULT == "segv":
            ctypes.string_at(0)
        raise RuntimeError("kaboom")


    if STAGE == "import":
        fault()


    @dataclass
    class FaultyOptions:
        mode: str = "ok"  # ok, sleep, abort, segv, exit0, exit3, sysexit3, probe, none, nohandle, nofile
        probe: str = ""


    class FaultyPass(Pass):
        name = "faulty"
        algorithms = ("faulty",)
        precisions = ("int4",)
        Options = FaultyOptions

        def run(self, model, context):
            if STAGE == "run":
                fault()
            mode = self.options.mode
            if mode == "sleep":
                time.sleep(120)
            if mode == "abort":
                os.abort()
            if mode == "segv":
                ctypes.string_at(0)
            if mode == "exit0":
                os._exit(0)
            if mode == "exit3":
                os._exit(3)
            if mode == "sysexit3":
                sys.exit(3)
            if mode == "probe":
                with open(self.options.probe, "w") as f:
                    json.dump({{"pid": os.getpid(), "executable": sys.executable, "cwd": os.getcwd(),
                               "no_envs": os.environ.get("BITPRESS_NO_ENVS")}}, f)
            if mode == "none":
                return None
            if mode == "nohandle":
                return "a model, promise"
            if mode == "nofile":
                from bitpress.models.onnx_model import OnnxModel
                from bitpress.onnx.save import SaveOptions, save_onnx

                path = context.workdir / "made.onnx"
                save_onnx(model, path, SaveOptions(external_data=True, check=False))
                made = OnnxModel.load(path)
                for f in path.parent.glob("made.onnx.data*"):
                    f.unlink()  # the pass cleans up too early: the handle's weights are gone
                return made
            return model


    @hookimpl
    def bitpress_register_passes(register):
        if STAGE == "register":
            fault()
        register(FaultyPass)


    @hookimpl
    def bitpress_load_model(source, options):
        if STAGE == "load":
            fault()
        return None


    @hookimpl(wrapper=True)
    def bitpress_run_pass(pass_, model, context):
        result = yield
        if STAGE == "wrapper":
            fault()
        return result


    @hookimpl
    def bitpress_save_model(model, destination, options):
        if STAGE == "save":
            fault()
        return None
''')

FAULTS = {
    "exit0": "it raised SystemExit(0) (sys.exit)",
    "exit3": "it raised SystemExit(3) (sys.exit)",
    "custom": "Doom: the end of everything",
    "generatorexit": "GeneratorExit: closed from the inside",
    "runtime": "RuntimeError: kaboom",
}
#: what the error says the plugin was doing, by stage
DOING = {
    "load": "plugin faulty failed while loading ",
    "run": "plugin faulty failed in pass faulty: ",
    "wrapper": "plugin faulty failed in its bitpress_run_pass hook, around pass faulty: ",
    "save": "plugin faulty failed while saving the onnx model (its bitpress_save_model hook): ",
}
BROKEN = {  # how `plugins` reports a plugin that failed to import / register
    "exit0": "SystemExit: sys.exit(0)",
    "exit3": "SystemExit: sys.exit(3)",
    "custom": "Doom: the end of everything",
    "generatorexit": "GeneratorExit: closed from the inside",
    "runtime": "RuntimeError: kaboom",
}


def install_plugin(site: Path, stage: str = "none", fault: str = "runtime") -> None:
    """``bitpress-faulty`` 1.0 with entry point ``faulty = faulty_plugin``, as pip would leave it in ``site``."""
    info = site / "bitpress_faulty-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bitpress-faulty\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[bitpress]\nfaulty = faulty_plugin\n")
    (site / "faulty_plugin.py").write_text(PLUGIN_MODULE.format(stage=stage, fault=fault))
    sys.modules.pop("faulty_plugin", None)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(bitpress.plugins, "_default", None)  # the CLI rebuilds its registry with our plugin
    monkeypatch.delenv("BITPRESS_NO_ENVS", raising=False)
    monkeypatch.delenv("BITPRESS_ENV_TIMEOUT", raising=False)
    yield site
    sys.modules.pop("faulty_plugin", None)


@pytest.fixture
def no_core_dumps():
    """Aborting workers inherit a core size limit of 0: no core dump is written (or waited for)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("bitpress: error:")]


def assert_clean_failure(code: int, out: str, err: str, *needles: str) -> str:
    """Exit code 1, one ``bitpress: error:`` line holding every needle, no traceback; returns the line."""
    assert code == 1, (code, err)
    lines = error_lines(err)
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in err and "internal error" not in err
    assert out == ""
    return lines[0]


def assert_nothing_written(work: Path) -> None:
    """The output's folder was never left behind: no output, no temporary folder, no parent folder."""
    assert not work.exists() or sorted(p.name for p in work.iterdir()) == [], sorted(work.iterdir())


def assert_listing_works(run_cli, broken: str | None = None) -> None:
    code, out, err = run_cli("passes", "list")
    assert code == 0, err
    assert any(x.startswith("rtn ") and x.rstrip().endswith("yes") for x in out.splitlines())
    line = next(x for x in out.splitlines() if " faulty " in f" {x} ")
    if broken:
        assert "no: plugin failed to load" in line and broken in line
    code, out, err = run_cli("plugins", "--json")
    assert code == 0, err
    rows = {r["plugin"]: r for r in json.loads(out)}
    assert rows["rtn"]["ok"] is True
    assert rows["faulty"]["ok"] is (broken is None)
    if broken:
        assert broken in rows["faulty"]["error"]
    code, out, err = run_cli("passes", "list", "--json")
    assert code == 0, err


# -- in process -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("stage", ["import", "register"])
def test_fault_while_loading_the_plugin(stage: str, fault: str, site: Path, run_cli, tiny_decoder: Path,
                                        tmp_path: Path) -> None:
    install_plugin(site, stage, fault)
    work = tmp_path / "work"
    code, out, err = run_cli("quantize", "-m", tiny_decoder, "-o", work / "out.onnx", "--algorithm", "faulty")
    where = "at import" if stage == "import" else "while registering its passes"
    line = assert_clean_failure(code, out, err, "plugin faulty (bitpress-faulty 1.0) failed to load",
                                f"{BROKEN[fault]} ({where})")
    assert line.startswith("bitpress: error: algorithm 'faulty' is unavailable: ")
    assert_nothing_written(work)
    assert_listing_works(run_cli, broken=f"{BROKEN[fault]} ({where})")
    # the healthy plugins still quantize
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", work / "rtn.onnx", "--algorithm", "rtn")
    assert code == 0, err
    # a config naming the broken plugin's pass says the same
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump({"input": str(tiny_decoder), "output": str(work / "c.onnx"),
                                      "passes": [{"type": "faulty"}]}))
    code, out, err = run_cli("run", config)
    assert_clean_failure(code, out, err, "plugin faulty (bitpress-faulty 1.0) failed to load")


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("stage", ["load", "run", "wrapper", "save"])
def test_fault_during_a_run(stage: str, fault: str, site: Path, run_cli, tiny_decoder: Path,
                            tmp_path: Path) -> None:
    install_plugin(site, stage, fault)
    work = tmp_path / "work"
    code, out, err = run_cli("quantize", "-m", tiny_decoder, "-o", work / "out.onnx", "--algorithm", "faulty")
    line = assert_clean_failure(code, out, err, DOING[stage], FAULTS[fault])
    if stage == "load":
        assert f"{tiny_decoder} (its bitpress_load_model hook)" in line
    assert_nothing_written(work)
    assert_listing_works(run_cli)
    # the same from a config
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump({"input": str(tiny_decoder), "output": str(work / "c"),
                                      "passes": [{"type": "faulty"}]}))
    code, out, err = run_cli("run", config)
    assert_clean_failure(code, out, err, DOING[stage], FAULTS[fault])
    assert_nothing_written(work)


def test_fault_from_python_is_a_plugin_error(site: Path, tiny_decoder: Path, tmp_path: Path) -> None:
    from bitpress import api
    from bitpress.errors import PluginError

    install_plugin(site, "run", "exit3")
    with pytest.raises(PluginError, match=r"plugin faulty failed in pass faulty: it raised SystemExit\(3\)") as info:
        api.quantize(tiny_decoder, tmp_path / "out.onnx", algorithm="faulty")
    assert info.value.plugin == "faulty"
    assert isinstance(info.value.__cause__, SystemExit)  # -v shows the plugin's own traceback
    assert not (tmp_path / "out.onnx").exists()


def test_verbose_shows_the_plugins_traceback(site: Path, run_cli, tiny_decoder: Path, tmp_path: Path) -> None:
    install_plugin(site, "run", "custom")
    code, _, err = run_cli("-v", "quantize", "-m", tiny_decoder, "-o", tmp_path / "w" / "o.onnx",
                           "--algorithm", "faulty")
    assert code == 1
    assert "faulty_plugin.py" in err and "Doom: the end of everything" in err and "Traceback" in err


def test_interrupts_pass_through(site: Path, run_cli, tiny_decoder: Path, tmp_path: Path) -> None:
    """Ctrl-C in a plugin is the user's, not a plugin fault: the run stops as interrupted."""
    install_plugin(site, "run", "interrupt")
    work = tmp_path / "work"
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", work / "out.onnx", "--algorithm", "faulty")
    assert code == 130, err
    assert "interrupted" in err and "plugin faulty failed" not in err
    assert_nothing_written(work)


@pytest.mark.parametrize(("mode", "message"), [
    ("none", "pass faulty (plugin faulty) returned no model (None)"),
    ("nohandle", "pass faulty (plugin faulty) returned a str, not a model handle"),
    ("nofile", "pass faulty (plugin faulty) returned a model whose file "),
])
def test_pass_without_output(mode: str, message: str, site: Path, run_cli, tiny_decoder: Path,
                             tmp_path: Path) -> None:
    install_plugin(site)
    work = tmp_path / "work"
    for isolate in ((), ("--isolate",)):
        code, out, err = run_cli("quantize", "-m", tiny_decoder, "-o", work / "out.onnx", "--algorithm", "faulty",
                                 "--option", f"mode={mode}", *isolate)
        line = assert_clean_failure(code, out, err, message)
        if mode == "nofile":
            assert "made.onnx.data" in line and line.endswith("is missing" + (" (in its isolated worker)"
                                                                               if isolate else ""))
        assert_nothing_written(work)


def test_hook_guards_do_not_touch_the_host(make_registry) -> None:
    """Only plugins' hook implementations are guarded; the host's own (builtin, environments) are not."""
    from types import SimpleNamespace

    from bitpress import hookimpl

    @hookimpl
    def bitpress_load_model(source, options):
        return None

    reg = make_registry(("loader", SimpleNamespace(bitpress_load_model=bitpress_load_model)))
    impls = {i.plugin_name: i for i in reg.pm.hook.bitpress_load_model.get_hookimpls()}
    assert set(impls) == {"bitpress.builtin", "loader"}
    assert getattr(impls["loader"].function, "_bitpress_guarded", False)
    assert not getattr(impls["bitpress.builtin"].function, "_bitpress_guarded", False)
    assert not any(getattr(i.function, "_bitpress_guarded", False)
                   for i in reg.pm.hook.bitpress_run_pass.get_hookimpls())  # builtin and environments: the host's


def test_guarded_wrapper_lets_the_inner_failure_through(make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    """A wrapper that lets the pass's own error through is not blamed for it; the pass's plugin is."""
    from types import SimpleNamespace

    from bitpress import api, hookimpl
    from bitpress.errors import PluginError

    class Explodes(Pass):
        name = "explodes"
        algorithms = ("explodes",)
        precisions = ("int4",)

        def run(self, model, context):
            raise ValueError("inner failure")

    @hookimpl
    def bitpress_register_passes(register):
        register(Explodes)

    seen = []

    @hookimpl(wrapper=True)
    def bitpress_run_pass(pass_, model, context):
        try:
            return (yield)
        except BaseException as exc:
            seen.append(exc)
            raise

    reg = make_registry(("explodes", SimpleNamespace(bitpress_register_passes=bitpress_register_passes)),
                        ("timing", SimpleNamespace(bitpress_run_pass=bitpress_run_pass)))
    with pytest.raises(PluginError, match="plugin explodes failed in pass explodes: ValueError: inner failure"):
        api.quantize(tiny_decoder, tmp_path / "o.onnx", algorithm="explodes", registry=reg)
    assert len(seen) == 1 and isinstance(seen[0], PluginError)


# -- isolated: a worker process of this environment -----------------------------------------------------------------
@pytest.mark.parametrize(("mode", "message"), [
    ("abort", "pass faulty (plugin faulty) crashed in its worker (signal SIGABRT); nothing was written"),
    ("segv", "pass faulty (plugin faulty) crashed in its worker (signal SIGSEGV); nothing was written"),
    ("exit3", "pass faulty (plugin faulty): its worker exited with code 3 without a result; nothing was written"),
    ("exit0", "pass faulty (plugin faulty): its worker exited with code 0 without a result; nothing was written"),
    ("sysexit3", "plugin faulty failed in pass faulty: it raised SystemExit(3) (sys.exit)"),
])
def test_isolated_crash_is_a_clean_error(mode: str, message: str, site: Path, run_cli, tiny_decoder: Path,
                                         tmp_path: Path, no_core_dumps) -> None:
    install_plugin(site)
    work = tmp_path / "work"
    code, out, err = run_cli("quantize", "-m", tiny_decoder, "-o", work / "out.onnx", "--algorithm", "faulty",
                             "--option", f"mode={mode}", "--isolate")
    assert_clean_failure(code, out, err, message)
    assert_nothing_written(work)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]
    # and without --isolate, the same abort would take the host down: only the worker died here
    assert_listing_works(run_cli)


def test_isolated_crash_output_with_verbose(site: Path, run_cli, tiny_decoder: Path, tmp_path: Path,
                                            no_core_dumps) -> None:
    """-v shows what the worker printed as it died: Python's stack of the crash (faulthandler)."""
    install_plugin(site)
    code, _, err = run_cli("-v", "quantize", "-m", tiny_decoder, "-o", tmp_path / "w" / "o.onnx",
                           "--algorithm", "faulty", "--option", "mode=abort", "--isolate")
    assert code == 1
    assert "Fatal Python error: Aborted" in err and "faulty_plugin.py" in err
    assert "crashed in its worker (signal SIGABRT)" in err


def test_isolate_in_a_config(site: Path, run_cli, tiny_decoder: Path, tmp_path: Path, no_core_dumps) -> None:
    install_plugin(site)
    work = tmp_path / "work"
    config = tmp_path / "recipe.yaml"

    def run(*passes: dict, flags: tuple[str, ...] = ()) -> tuple[int, str, str]:
        config.write_text(yaml.safe_dump({"input": str(tiny_decoder), "output": "work/out.onnx",
                                          "passes": list(passes)}))
        return run_cli("run", config, *flags)

    code, out, err = run({"type": "rtn", "precision": "int4"}, {"type": "faulty", "mode": "abort", "isolate": True})
    assert_clean_failure(code, out, err, "pass faulty (plugin faulty) crashed in its worker (signal SIGABRT)")
    assert_nothing_written(work)
    # `run --isolate` isolates every pass
    code, out, err = run({"type": "faulty", "mode": "segv"}, flags=("--isolate",))
    assert_clean_failure(code, out, err, "crashed in its worker (signal SIGSEGV)")
    assert_nothing_written(work)
    # a strict boolean, as every config flag
    code, _, err = run({"type": "faulty", "isolate": "yes"})
    assert code == 2 and "isolate" in err
    assert_nothing_written(work)


def test_isolated_worker_environment(site: Path, run_cli, tiny_decoder: Path, tmp_path: Path) -> None:
    """The worker is this interpreter, in a scratch folder, with environment routing off."""
    install_plugin(site)
    probe = tmp_path / "probe.json"
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "out.onnx", "--algorithm", "faulty",
                           "--option", "mode=probe", "--option", f"probe={probe}", "--isolate")
    assert code == 0, err
    seen = json.loads(probe.read_text())
    assert seen["pid"] != os.getpid()
    assert seen["executable"] == sys.executable
    assert seen["no_envs"] == "1"
    assert Path(seen["cwd"]) != Path.cwd() and ".out.onnx.bitpress-" in seen["cwd"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "probe.json", "site"]


@pytest.mark.parametrize("how", ["quantize", "config"])
def test_isolated_run_writes_the_same_bytes(how: str, run_cli, tiny_decoder_external: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bitpress.plugins, "_default", None)
    args = ("--algorithm", "rtn", "--precision", "int4", "--option", "block_size=32")
    code, _, err = run_cli("quantize", "-m", tiny_decoder_external, "-o", tmp_path / "here", *args)
    assert code == 0, err
    saved = tmp_path / "isolated.yaml"
    if how == "quantize":
        code, out, err = run_cli("quantize", "-m", tiny_decoder_external, "-o", tmp_path / "isolated", *args,
                                 "--isolate", "--show-weights", "--save-config", saved)
        assert code == 0, err
        assert "rtn on model.onnx: quantized" in out
        assert yaml.safe_load(saved.read_text())["passes"][0]["isolate"] is True
    else:
        saved.write_text(yaml.safe_dump({"input": str(tiny_decoder_external), "output": "isolated", "passes": [
            {"type": "rtn", "precision": "int4", "block_size": 32, "isolate": True}]}))
        code, out, err = run_cli("run", saved, "--json")
        assert code == 0, err
        report = json.loads(out)["reports"][0]
        assert report["pass"] == "rtn" and report["summary"].startswith("quantized")
    here, isolated = tmp_path / "here", tmp_path / "isolated"
    assert sorted(p.name for p in here.iterdir()) == sorted(p.name for p in isolated.iterdir())
    for f in here.iterdir():
        assert (isolated / f.name).read_bytes() == f.read_bytes(), f.name
    OnnxModel.load(isolated / "model.onnx")


def test_isolated_pass_must_be_installed(run_cli, make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    """A pass registered only in this process (not an entry point) cannot reach a worker: said plainly."""
    from types import SimpleNamespace

    from bitpress import hookimpl

    class Local(Pass):
        name = "localonly"
        algorithms = ("localonly",)
        precisions = ("int4",)

        def run(self, model, context):
            return model

    @hookimpl
    def bitpress_register_passes(register):
        register(Local)

    reg = make_registry(("local", SimpleNamespace(bitpress_register_passes=bitpress_register_passes)))
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "w" / "o.onnx", "--algorithm",
                           "localonly", "--isolate", registry=reg)
    assert code == 2
    (line,) = error_lines(err)
    assert "no pass named 'localonly'" in line and "an isolated pass must come from an installed plugin" in line
    assert not (tmp_path / "w").exists()


def test_worker_timeout_applies_to_isolated_passes(site: Path, run_cli, tiny_decoder: Path, tmp_path: Path) -> None:
    install_plugin(site)
    t0 = time.monotonic()
    code, out, err = run_cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "w" / "o.onnx", "--algorithm",
                             "faulty", "--option", "mode=sleep", "--isolate", "--env-timeout", "2")
    assert_clean_failure(code, out, err, "pass faulty did not finish within 2 s", "nothing was written")
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("fault", ["raise", "exit"])
def test_faulty_availability_check_does_not_stop_passes_list(fault: str, make_registry, run_cli) -> None:
    """A pass whose unavailable_reason() raises (or exits) is listed as unavailable, with the fault."""
    from types import SimpleNamespace

    from bitpress import hookimpl

    class Flaky(Pass):
        name = "flaky"
        algorithms = ("flaky",)
        precisions = ("int4",)

        @classmethod
        def unavailable_reason(cls) -> str | None:
            if fault == "exit":
                sys.exit(3)
            raise RuntimeError("probe exploded")

        def run(self, model, context):  # pragma: no cover - never runs
            return model

    @hookimpl
    def bitpress_register_passes(register):
        register(Flaky)

    reg = make_registry(("flaky", SimpleNamespace(bitpress_register_passes=bitpress_register_passes)))
    code, out, err = run_cli("passes", "list", "--json", registry=reg)
    assert code == 0, err
    rows = {r["pass"]: r for r in json.loads(out)}
    assert rows["flaky"]["available"] is False
    assert rows["flaky"]["reason"].startswith("its availability check failed: ")
    assert rows["rtn"]["available"] is True
    code, _, err = run_cli("quantize", "-m", "x.onnx", "-o", "y.onnx", "--algorithm", "flaky", registry=reg)
    assert code != 0 and "internal error" not in err and "availability check failed" in err


# -- native crashes without --isolate (issue #27) ---------------------------------------------------------------------
SIGNALS = {"abort": "SIGABRT", "segv": "SIGSEGV"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of this test's own for the verdicts of plugin import checks."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(plugin_probe.CACHE_VAR, str(cache))
    return cache


def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next CLI command discovers the plugins again, as a new `bitpress` process would."""
    monkeypatch.setattr(bitpress.plugins, "_default", None)


@pytest.mark.parametrize("fault", list(SIGNALS))
@pytest.mark.parametrize("stage", ["import", "register"])
def test_plugin_whose_import_crashes_is_found_in_a_child(stage: str, fault: str, site: Path, cache: Path, run_cli,
                                                        tiny_decoder: Path, tmp_path: Path, no_core_dumps) -> None:
    """The crash happens in a child process: this process (the CLI, in the test's own process) lists the plugin as
    broken with the reason, the others work, asking for it is "unavailable"; the verdict is kept in the cache."""
    install_plugin(site, stage, fault)
    what = "import" if stage == "import" else "bitpress_register_passes"
    reason = f"its {what} crashes the process ({SIGNALS[fault]})"
    assert_listing_works(run_cli, broken=reason)
    work = tmp_path / "work"
    code, out, err = run_cli("quantize", "-m", tiny_decoder, "-o", work / "out.onnx", "--algorithm", "faulty")
    assert_clean_failure(code, out, err, "algorithm 'faulty' is unavailable", "plugin faulty (bitpress-faulty 1.0)",
                         reason)
    assert_nothing_written(work)
    entries = json.loads((cache / plugin_probe.CACHE_FILE).read_text())["entries"]
    crashed = [e for e in entries.values() if e["crashed"]]
    assert len(crashed) == 1 and reason in crashed[0]["reason"]
    assert "Fatal Python error" in crashed[0]["detail"] and "faulty_plugin.py" in crashed[0]["detail"]
    assert any(not e["crashed"] and "bitpress_rtn" in e["path"] for e in entries.values())


def test_plugin_check_is_remembered_until_the_plugin_changes(site: Path, cache: Path, run_cli, no_core_dumps,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    install_plugin(site, "import", "abort")
    assert_listing_works(run_cli, broken="its import crashes the process (SIGABRT)")
    checked: list[list[str]] = []
    real = plugin_probe._run_child
    monkeypatch.setattr(plugin_probe, "_run_child",
                        lambda eps: checked.append([ep.name for ep in eps]) or real(eps))
    fresh_registry(monkeypatch)
    assert_listing_works(run_cli, broken="its import crashes the process (SIGABRT)")
    assert checked == []  # from the cache: no child at all
    # fixed (its module changed): checked again, alone, and loaded
    install_plugin(site)
    module = site / "faulty_plugin.py"
    os.utime(module, ns=(module.stat().st_atime_ns, module.stat().st_mtime_ns + 10**9))
    fresh_registry(monkeypatch)
    assert_listing_works(run_cli)
    assert checked == [["faulty"]]


def test_plugin_check_without_fork(site: Path, cache: Path, run_cli, no_core_dumps,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Where forking is not safe (threads) the check runs in a new interpreter with this import path."""
    monkeypatch.setattr(plugin_probe, "_can_fork", lambda: False)
    install_plugin(site, "import", "segv")
    assert_listing_works(run_cli, broken="its import crashes the process (SIGSEGV)")


def test_plugin_check_reports_the_crash_despite_the_hosts_own_handlers(site: Path, cache: Path, run_cli,
                                                                     no_core_dumps) -> None:
    """A library of the host process (Ray, a Python handler) replaced faulthandler's SIGABRT handler while
    faulthandler still counts as enabled: the forked check still prints Python's stack of the crash."""
    was_enabled = faulthandler.is_enabled()
    if not was_enabled:
        faulthandler.enable()
    previous = signal.signal(signal.SIGABRT, lambda *_: None)
    try:
        install_plugin(site, "import", "abort")
        assert_listing_works(run_cli, broken="its import crashes the process (SIGABRT)")
    finally:
        signal.signal(signal.SIGABRT, previous)
        if not was_enabled:
            faulthandler.disable()
    entries = json.loads((cache / plugin_probe.CACHE_FILE).read_text())["entries"]
    crashed = [e for e in entries.values() if e["crashed"]]
    assert len(crashed) == 1 and "Fatal Python error: Aborted" in crashed[0]["detail"]


def test_plugin_check_ignores_a_broken_cache(site: Path, cache: Path, run_cli, no_core_dumps) -> None:
    cache.mkdir()
    (cache / plugin_probe.CACHE_FILE).write_text("{not json")
    install_plugin(site, "import", "abort")
    assert_listing_works(run_cli, broken="its import crashes the process (SIGABRT)")
    assert json.loads((cache / plugin_probe.CACHE_FILE).read_text())["entries"]


def bitpress_process(site: Path, cache: Path, *argv: object) -> subprocess.CompletedProcess:
    """The real `bitpress` in a process of its own, finding the plugin of ``site``."""
    env = {**os.environ, "PYTHONPATH": str(site), plugin_probe.CACHE_VAR: str(cache)}
    env.pop("BITPRESS_NO_ENVS", None)
    return subprocess.run([sys.executable, "-m", "bitpress", *map(str, argv)], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("fault", list(SIGNALS))
@pytest.mark.parametrize("how", ["quantize", "config", "loader"])
def test_native_crash_in_process_names_the_plugin(how: str, fault: str, site: Path, cache: Path, tiny_decoder: Path,
                                                  tmp_path: Path, no_core_dumps) -> None:
    """Without --isolate the process dies with the plugin (its signal is the exit status), but Python's stack
    names the plugin's module and line (faulthandler), a last line names the plugin and suggests --isolate,
    and the run's temporary folder, lock and parent folders are removed."""
    install_plugin(site, "load" if how == "loader" else "none", fault)
    work = tmp_path / "work"
    out = work / "new" / "out.onnx"
    if how == "config":
        config = tmp_path / "recipe.yaml"
        config.write_text(yaml.safe_dump({"input": str(tiny_decoder), "output": str(out),
                                          "passes": [{"type": "faulty", "mode": fault}]}))
        argv: tuple[object, ...] = ("run", config)
    else:
        argv = ("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "faulty", "--option", f"mode={fault}")
    proc = bitpress_process(site, cache, *argv)
    assert proc.returncode == -getattr(signal, SIGNALS[fault]), proc.stderr
    assert "Fatal Python error" in proc.stderr and "faulty_plugin.py" in proc.stderr
    assert len(error_lines(proc.stderr)) == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    if how == "loader":
        doing = f"while plugin faulty was running (while loading {tiny_decoder}"
        hint = "fix or uninstall it"
    else:
        doing, hint = "while plugin faulty was running (in pass faulty)", "rerun with --isolate"
    assert last.startswith(f"bitpress: error: the process died of {SIGNALS[fault]} {doing}"), last
    assert hint in last and "nothing was written" in last
    assert proc.stdout == ""
    assert not work.exists(), sorted(work.rglob("*"))  # the temporary folder, the lock, the folders it made


def test_watcher_is_quiet_when_all_goes_well(site: Path, cache: Path, tiny_decoder: Path, tmp_path: Path) -> None:
    """The watcher prints only when the process died: a run that ends (well or with an error) says nothing more."""
    install_plugin(site)
    ok = bitpress_process(site, cache, "quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm",
                          "faulty")
    assert ok.returncode == 0, ok.stderr
    assert "bitpress: error" not in ok.stderr and "Fatal Python error" not in ok.stderr
    failed = bitpress_process(site, cache, "quantize", "-m", tiny_decoder, "-o", tmp_path / "q.onnx", "--algorithm",
                              "faulty")
    assert failed.returncode == 1
    assert len(failed.stderr.strip().splitlines()) == 1 and "already exists" in failed.stderr
