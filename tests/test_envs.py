"""Plugin environments: ``bitpress env create/list/remove`` and passes that run in them.

``tests/data/envplugin`` (distribution ``bitpress-envplugin``) is a plugin whose pass ``envround``
needs the module ``envplugin_dep`` (``tests/data/envplugin_dep``, its "toolkit"). Neither is
installed in the suite's own environment; one session fixture runs
``python -m bitpress env create envplugin --spec ...`` into a temporary ``BITPRESS_ENVS`` (about
15 s with a warm pip cache), and the tests run the suite's host against it: the pass is listed
as running in ``env:envplugin`` and every run goes through the worker there.

The first section needs no real environment: a hand-written environment whose "Python" is this
interpreter covers registration, listing, option checks and removal in milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import psutil
import pytest

import bitpress
import bitpress.plugins
from bitpress.envs import EnvError, add_env_passes, create_env, install_args, list_envs, where
from bitpress.envs import remote as remote_mod
from bitpress.envs.manager import checkout_root
from bitpress.envs.protocol import PROTOCOL, envs_root
from bitpress.plugins import Registry
from bitpress.synthetic import random_inputs
from bitpress.testing import default_signals

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "tests" / "data" / "envplugin"
DEP = ROOT / "tests" / "data" / "envplugin_dep"
NETWORK_TROUBLE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
                   "ConnectTimeoutError", "No route to host")


def _use_envs(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Point the host at ``root`` and make the CLI rebuild its registry (it is built once per process)."""
    monkeypatch.setenv("BITPRESS_ENVS", str(root))
    monkeypatch.delenv("BITPRESS_NO_ENVS", raising=False)
    monkeypatch.delenv("BITPRESS_ENV_TIMEOUT", raising=False)
    monkeypatch.setattr(bitpress.plugins, "_default", None)


def _leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def _metadata(path: Path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


# -- without a real environment ----------------------------------------------------------------------------------
def test_envs_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BITPRESS_ENVS", str(tmp_path / "here"))
    assert envs_root() == tmp_path / "here"
    monkeypatch.delenv("BITPRESS_ENVS")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # no root recorded for this Python (tests/test_envs_root.py)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert envs_root() == tmp_path / ".cache" / "bitpress" / "envs"


def _fake_checkout(root: Path) -> Path:
    (root / "core" / "bitpress").mkdir(parents=True)
    (root / "pyproject.toml").write_text('[project]\nname = "bitpress"\nversion = "0.1.0"\n')
    quark = root / "plugins" / "quark"
    quark.mkdir(parents=True)
    # laid out like the AMD Quark plugin: the vendor pins live in the `toolkit` extra
    quark.joinpath("pyproject.toml").write_text(
        '[project]\nname = "bitpress-quark"\nversion = "0.1.0"\ndependencies = ["bitpress>=0.1"]\n\n'
        '[project.optional-dependencies]\n'
        'toolkit = ["amd-quark", "torch==2.13.0", "onnx<=1.22.0", "onnxruntime"]\n'
    )
    plain = root / "plugins" / "plain"
    plain.mkdir()
    plain.joinpath("pyproject.toml").write_text('[project]\nname = "bitpress-plain"\nversion = "0.1.0"\n')
    return root


def test_install_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_checkout(tmp_path / "repo")
    assert install_args("quark", checkout=root) == ["-e", str(root), "-e", f"{root / 'plugins' / 'quark'}[toolkit]"]
    # no toolkit extra declared: none asked for (pip would warn about a missing extra)
    assert install_args("plain", checkout=root) == ["-e", str(root), "-e", str(root / "plugins" / "plain")]
    # a plugin that the checkout does not hold comes from the index, next to the checkout's host
    assert install_args("modelopt", checkout=root) == ["-e", str(root), "bitpress-modelopt[toolkit]"]
    # no checkout: this host's version and the plugin's distribution from the index
    assert install_args("quark", checkout=None) == [f"bitpress=={bitpress.__version__}", "bitpress-quark[toolkit]"]
    # --spec replaces the plugin's requirement; local folders are recorded absolute
    monkeypatch.chdir(ROOT)
    assert install_args("x", ["tests/data/envplugin[toolkit]", "foo==1.2"], checkout=None) == [
        f"bitpress=={bitpress.__version__}", f"{PLUGIN}[toolkit]", "foo==1.2",
    ]


def test_this_checkout_is_found() -> None:
    if not Path(bitpress.__file__).resolve().is_relative_to(ROOT):
        pytest.skip("the host under test is not installed from this checkout")
    assert checkout_root() == ROOT
    assert install_args("rtn")[:2] == ["-e", str(ROOT)]


def _fake_env(root: Path, name: str = "fake", *, protocol: int = PROTOCOL) -> Path:
    """An environment as `env create` leaves it, whose Python is this interpreter (nothing to install)."""
    path = root / name
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").symlink_to(sys.executable)
    (path / "pyvenv.cfg").write_text("home = /nowhere\n")
    (path / "env.json").write_text(json.dumps({
        "plugin": name, "protocol": protocol, "host_version": bitpress.__version__,
        "python": {"version": "3.11.0"}, "created": "2026-01-01T00:00:00+00:00", "specs": [], "freeze": [],
    }))
    entry = {
        "pass": "fakeq", "plugin": name, "summary": "a pass of another environment", "aliases": ["FakeQuantization"],
        "algorithms": ["fakeq"],
        "precisions": ["int4", "int8"], "model_kinds": ["onnx"], "needs_data": False, "unavailable": None,
        "available": True, "reason": None,
        "options": [{"name": "bits", "type": "int", "default": 4, "help": "bits per weight"},
                    {"name": "groups", "type": "list[str]", "default": ["a"], "help": "groups"}],
    }
    (path / "manifest.json").write_text(json.dumps({"protocol": protocol, "env": name, "passes": [entry]}))
    return path


def test_proxies_from_a_manifest(run_cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    envs = tmp_path / "envs"
    _fake_env(envs)
    _use_envs(monkeypatch, envs)
    reg = Registry()
    cls = reg.passes["fakeq"]
    assert where(cls) == "env:fake" and where(reg.passes["rtn"]) == "here"
    assert cls.unavailable_reason() is None and cls.plugin == "fake"
    assert reg.select("fakeq", "int8", "onnx") is cls
    # its aliases come with it, in configs pinned to the environment too
    assert reg.find_pass("FakeQuantization") is cls and cls.aliases == ("FakeQuantization",)
    from bitpress.envs.remote import pinned_pass
    from bitpress.workflow.config import _resolve_pass

    assert pinned_pass(reg, "fake", "fakequantization", None, _resolve_pass).name == "fakeq"

    code, out, _ = run_cli("passes", "list", "--json", registry=reg)
    rows = {r["pass"]: r for r in json.loads(out)}
    assert code == 0
    assert rows["fakeq"]["where"] == "env:fake" and rows["fakeq"]["available"] is True
    assert rows["rtn"]["where"] == "here"
    code, out, _ = run_cli("passes", "list", registry=reg)
    assert out.splitlines()[0].split() == ["PASS", "PLUGIN", "ALGORITHMS", "PRECISIONS", "MODELS", "DATA",
                                           "EXPERTS", "WHERE", "AVAILABLE"]
    assert next(x for x in out.splitlines() if x.startswith("fakeq ")).split()[-2:] == ["env:fake", "yes"]
    code, out, _ = run_cli("passes", "show", "fakeq", registry=reg)
    assert "runs in: env:fake" in out and "bits per weight" in out
    assert next(x for x in out.splitlines() if x.strip().startswith("bits")).split()[:3] == ["bits", "int", "4"]

    # options are checked by name before anything else; values travel as given (the env types them)
    p = cls.from_config({"bits": "8", "groups": "x,y"})
    assert p.given == {"bits": "8", "groups": "x,y"} and p.precision is None
    assert cls.from_config({}, "int4").precision == "int4"
    with pytest.raises(bitpress.errors.OptionError, match=r"unknown option.*bogus"):
        cls.from_config({"bogus": 1})
    with pytest.raises(bitpress.errors.OptionError, match="contradicts --precision int4"):
        cls.from_config({"bits": 8}, "int4")


def test_stale_manifest_of_a_checkout_env_is_read_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An env built from the checkout runs the checkout's code: a new option must not be refused."""
    from bitpress.envs import manager

    envs, checkout = tmp_path / "envs", tmp_path / "checkout"
    path = _fake_env(envs)
    meta = json.loads((path / "env.json").read_text())
    (path / "env.json").write_text(json.dumps({**meta, "source": "checkout"}))
    src = checkout / "plugins" / "fake" / "bitpress_fake" / "passes.py"
    src.parent.mkdir(parents=True)
    src.write_text("# the plugin's code\n")
    (checkout / "core" / "bitpress").mkdir(parents=True)
    old = time.time() - 100
    os.utime(src, (old, old))
    monkeypatch.setattr(manager, "checkout_root", lambda: checkout)
    calls = []

    def fresh_manifest(py: Path, env_dir: Path, name: str) -> dict:
        calls.append(name)
        data = json.loads((env_dir / "manifest.json").read_text())
        data["passes"][0]["options"].append({"name": "reduce_range", "type": "bool", "default": True, "help": ""})
        return data

    monkeypatch.setattr(manager, "_manifest", fresh_manifest)
    assert "reduce_range" not in str(manager.get_env("fake", envs).manifest) and calls == []  # up to date
    os.utime(src)  # the plugin's code is edited after the build
    info = manager.get_env("fake", envs)
    assert calls == ["fake"] and "reduce_range" in str(info.manifest)
    manager.get_env("fake", envs)
    assert calls == ["fake"]  # written once; fresh since
    (path / "env.json").write_text(json.dumps({**meta, "source": "index"}))
    os.utime(src, (time.time() + 10, time.time() + 10))
    manager.get_env("fake", envs)
    assert calls == ["fake"]  # an env installed from an index has its own copy of the code


def test_proxy_of_a_broken_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    envs = tmp_path / "envs"
    _fake_env(envs)
    _fake_env(envs, "old", protocol=PROTOCOL + 1)
    _use_envs(monkeypatch, envs)
    reg = Registry()
    (envs / "fake" / "bin" / "python").unlink()
    assert "missing" in reg.passes["fakeq"].unavailable_reason()
    info = {e.name: e for e in list_envs()}
    assert "protocol" in info["old"].problem() and "Python" in info["fake"].problem()
    with pytest.raises(bitpress.errors.PassUnavailableError, match="environment 'fake'"):
        reg.get_pass("fakeq")


def test_no_proxies_inside_an_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_env(tmp_path)
    _use_envs(monkeypatch, tmp_path)
    monkeypatch.setenv("BITPRESS_NO_ENVS", "1")
    assert "fakeq" not in Registry().passes
    assert add_env_passes(Registry(entry_points=False)) == []


def test_env_list_and_remove(run_cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _use_envs(monkeypatch, tmp_path)
    code, out, _ = run_cli("env", "list")
    assert code == 0 and "no plugin environments" in out
    _fake_env(tmp_path)
    (tmp_path / ".fake.creating-12345678").mkdir()  # an interrupted build
    code, out, _ = run_cli("env", "list", "--json")
    (row,) = json.loads(out)
    assert row["env"] == "fake" and row["passes"] == ["fakeq"] and row["problem"] is None
    code, out, _ = run_cli("env", "list")
    assert any(x.split()[:2] == ["fake", "fakeq"] and " ok " in x for x in out.splitlines())

    code, out, _ = run_cli("env", "remove", "fake")
    assert code == 0 and "removed environment fake" in out
    assert list(tmp_path.iterdir()) == []
    code, _, err = run_cli("env", "remove", "fake")
    assert code == 2 and "no environment named 'fake'" in err
    (tmp_path / "notanenv").mkdir()  # never deletes a folder that is not an environment
    code, _, err = run_cli("env", "remove", "notanenv")
    assert code == 2 and (tmp_path / "notanenv").is_dir()


def test_create_refuses_before_building(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _use_envs(monkeypatch, tmp_path)
    with pytest.raises(EnvError, match="reserved"):
        create_env("here")
    with pytest.raises(EnvError, match="cannot name"):
        create_env("../escape")
    _fake_env(tmp_path)
    with pytest.raises(bitpress.errors.UsageError, match=r"already exists.*--force"):
        create_env("fake")


def test_failed_creation_leaves_nothing(run_cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _use_envs(monkeypatch, tmp_path / "envs")
    code, _, err = run_cli("env", "create", "broken", "--spec", str(tmp_path / "no-such-project"))
    assert code == 1
    assert "pip could not install" in err and "nothing was kept" in err
    assert list((tmp_path / "envs").iterdir()) == []


# -- with a real environment ---------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """``python -m bitpress env create envplugin`` into a temporary root, once per session."""
    root = tmp_path_factory.mktemp("bitpress-envs")
    env = {k: v for k, v in os.environ.items() if k not in ("BITPRESS_NO_ENVS", "BITPRESS_ENV_TIMEOUT")}
    env["BITPRESS_ENVS"] = str(root)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "bitpress", "env", "create", "envplugin", "--spec", f"{PLUGIN}[toolkit]",
         "--spec", str(DEP)],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )
    seconds = time.perf_counter() - t0
    if proc.returncode and any(m in proc.stdout + proc.stderr for m in NETWORK_TROUBLE):
        pytest.skip("pip cannot reach PyPI or a cache to build the plugin environment")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    print(f"\nbitpress env create envplugin: {seconds:.1f} s")
    return SimpleNamespace(root=root, path=root / "envplugin", proc=proc, seconds=seconds)


@pytest.fixture
def envs(plugin_env: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    _use_envs(monkeypatch, plugin_env.root)
    return plugin_env


def test_env_create(plugin_env: SimpleNamespace) -> None:
    proc, path = plugin_env.proc, plugin_env.path
    # pip's own lines reach the user while it works, and the summary names the passes
    assert "Successfully installed" in proc.stderr and "envplugin-dep" in proc.stderr
    assert proc.stdout.startswith("created environment envplugin at ") and "envplain, envround" in proc.stdout
    meta = json.loads((path / "env.json").read_text())
    assert meta["plugin"] == "envplugin" and meta["host_version"] == bitpress.__version__
    assert meta["protocol"] == PROTOCOL and meta["python"]["version"] and meta["created"]
    assert "envplugin-dep==1.0.0" in meta["freeze"] or any(x.startswith("envplugin-dep @") for x in meta["freeze"])
    assert f"{PLUGIN}[toolkit]" in meta["specs"]
    # the plugin's [tool.bitpress.env] recipe: envplugin-extra installed first, in a pip call of its own,
    # then removed with the reason recorded
    first = f"pip install {ROOT / 'tests' / 'data' / 'envplugin_extra'} (first: {PLUGIN / 'pyproject.toml'})"
    assert first in proc.stderr and "Successfully installed envplugin-extra-1.0.0" in proc.stderr
    assert proc.stderr.index(first) < proc.stderr.index(f"pip install -e {ROOT}")
    assert "pip uninstall envplugin-extra (a stand-in for a CUDA build" in proc.stderr
    assert meta["removed"] == {"envplugin-extra": "a stand-in for a CUDA build a dependency pulls in"}
    assert not any(x.startswith("envplugin-extra") for x in meta["freeze"])
    manifest = json.loads((path / "manifest.json").read_text())
    passes = {p["pass"]: p for p in manifest["passes"]}
    assert set(passes) == {"envround", "envplain"} and passes["envround"]["available"]
    assert [o["name"] for o in passes["envround"]["options"]] == ["mode", "seconds", "pidfile", "tag"]
    # built elsewhere and renamed into place: nothing else in the root; scripts point at the final place
    assert [p.name for p in plugin_env.root.iterdir()] == ["envplugin"]
    shebang = (path / "bin" / "pip").read_text().splitlines()[0]
    assert shebang.startswith(f"#!{path / 'bin' / 'python'}"), shebang
    out = subprocess.run([path / "bin" / "bitpress", "passes", "list", "--json"], capture_output=True, text=True,
                         env={**os.environ, "BITPRESS_NO_ENVS": "1"})
    assert out.returncode == 0 and "envround" in out.stdout
    # the toolkit is there and only there
    check = "import importlib.util as u; print(u.find_spec('envplugin_dep') is not None)"
    assert subprocess.run([path / "bin" / "python", "-c", check], capture_output=True, text=True).stdout == "True\n"
    assert subprocess.run([sys.executable, "-c", check], capture_output=True, text=True).stdout == "False\n"


def test_env_list(run_cli, envs: SimpleNamespace) -> None:
    code, out, _ = run_cli("env", "list", "--json")
    (row,) = json.loads(out)
    assert code == 0 and row["env"] == "envplugin" and sorted(row["passes"]) == ["envplain", "envround"]
    assert row["problem"] is None and row["path"] == str(envs.path) and row["source"] == "checkout"


def test_passes_list_shows_where(run_cli, envs: SimpleNamespace) -> None:
    code, out, _ = run_cli("passes", "list", "--json")
    rows = {r["pass"]: r for r in json.loads(out)}
    assert code == 0
    assert rows["envround"]["where"] == "env:envplugin" and rows["envround"]["available"] is True
    assert rows["envround"]["plugin"] == "envplugin" and rows["rtn"]["where"] == "here"
    code, out, _ = run_cli("passes", "list")
    line = next(x for x in out.splitlines() if x.startswith("envround "))
    assert line.split()[-2:] == ["env:envplugin", "yes"]


def _assert_rounded(path: Path, reference: Path, ort_outputs) -> None:
    """Every float weight is a float16 value, the model checks and runs close to the float one."""
    onnx.checker.check_model(str(path))
    model = onnx.load(str(path))
    floats = [onnx.numpy_helper.to_array(t) for t in model.graph.initializer
              if t.data_type == onnx.TensorProto.FLOAT and t.dims]
    assert floats
    for a in floats:
        np.testing.assert_array_equal(a, a.astype(np.float16).astype(np.float32))
    feeds = random_inputs(reference)
    got, want = ort_outputs(path, feeds)[0], ort_outputs(reference, feeds)[0]
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.9


def test_quantize_runs_in_the_env(run_cli, envs: SimpleNamespace, tiny_decoder: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch, ort_outputs) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out = tmp_path / "out" / "q.onnx"
    code, stdout, err = run_cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "envround",
                                "--precision", "fp16", "--option", "tag=quantize")
    assert code == 0, err
    assert "envround on model.onnx: rounded" in stdout
    # the pass's log record, streamed from the worker to this host's logger
    assert "[env:envplugin] envround rounded" in err
    meta = _metadata(out)
    assert Path(meta["envround.prefix"]).resolve() == envs.path.resolve()
    assert meta["envround.tag"] == "quantize"
    # the worker's working folder was a scratch folder of the run, never the user's
    assert Path(meta["envround.cwd"]).parent.name.startswith("env-envplugin-envround-")
    assert list(cwd.iterdir()) == []
    assert _leftovers(out.parent, set()) == ["q.onnx"]  # a single-file input gives a single file, env or not
    _assert_rounded(out, tiny_decoder, ort_outputs)


def test_two_pass_workflow(run_cli, envs: SimpleNamespace, tiny_decoder_external: Path, tmp_path: Path,
                           ort_outputs) -> None:
    """rtn here, envround in its environment, on a model whose weights are external data."""
    config = tmp_path / "recipe.yaml"
    config.write_text(
        f"input: {tiny_decoder_external}\n"
        "output: out\n"
        "passes:\n"
        "  - type: rtn\n"
        "    env: here\n"
        "    precision: int4\n"
        "    block_size: 32\n"
        "  - type: envround\n"
        "    tag: two-pass\n"
    )
    code, stdout, err = run_cli("-v", "run", config)
    assert code == 0, err
    out = tmp_path / "out" / "model.onnx"
    # with -v the worker's raw output (vendor prints) is shown too, tagged with its environment
    assert "[env:envplugin] envround: vendor-style output on stdout" in err
    assert "rtn on model.onnx: quantized" in stdout and "envround on model.onnx: rounded" in stdout
    model = onnx.load(str(out))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") >= 10 and "GatherBlockQuantized" in ops  # rtn's work survived the trip
    meta = _metadata(out)
    assert Path(meta["envround.prefix"]).resolve() == envs.path.resolve() and meta["envround.tag"] == "two-pass"
    _assert_rounded(out, tiny_decoder_external, ort_outputs)
    assert _leftovers(tmp_path, {"recipe.yaml", "out"}) == []


@pytest.fixture
def local_plugin_registry(envs: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Registry:
    """envplugin installed here too, without its toolkit: envround cannot run here, envplain can."""
    import bitpress_rtn

    monkeypatch.syspath_prepend(str(PLUGIN / "src"))
    import bitpress_envplugin

    reg = Registry(entry_points=False)
    reg.register(bitpress_rtn, name="rtn")
    reg.register(bitpress_envplugin, name="envplugin")
    assert "envplugin_dep" in reg.passes["envround"].unavailable_reason()
    assert add_env_passes(reg) == ["envround"]
    return reg


def test_pinning_in_a_config(run_cli, local_plugin_registry: Registry, envs: SimpleNamespace, tiny_decoder: Path,
                             tmp_path: Path) -> None:
    reg = local_plugin_registry
    assert where(reg.passes["envround"]) == "env:envplugin" and where(reg.passes["envplain"]) == "here"

    def run(name: str, *entries: str) -> tuple[int, str, Path]:
        config = tmp_path / f"{name}.yaml"
        config.write_text(f"input: {tiny_decoder}\noutput: {name}.onnx\npasses:\n" + "".join(entries))
        code, _, err = run_cli("run", config, registry=reg)
        return code, err, tmp_path / f"{name}.onnx"

    code, err, out = run("pinned", "  - type: envplain\n    env: envplugin\n    tag: there\n")
    assert code == 0, err
    assert Path(_metadata(out)["envplain.prefix"]).resolve() == envs.path.resolve()
    code, err, out = run("unpinned", "  - type: envplain\n    tag: here\n")
    assert code == 0, err
    assert _metadata(out)["envplain.prefix"] == sys.prefix
    code, err, out = run("forced", "  - type: envround\n    env: here\n")
    assert code == 1 and "unavailable here" in err and "envplugin_dep" in err and not out.exists()
    code, err, out = run("nowhere", "  - type: envplain\n    env: quark-not-built\n")
    assert code == 2 and "no environment named 'quark-not-built'" in err
    code, err, out = run("missing", "  - type: rtn\n    env: envplugin\n")
    assert code == 2 and "has no pass or algorithm 'rtn'" in err


def _assert_no_output(folder: Path, out: Path, keep: set[str]) -> None:
    assert not out.exists()
    assert _leftovers(folder, keep) == [], "a failed run leaves no output and no temporary folder"


@pytest.mark.parametrize(("mode", "code", "message"), [
    ("fail", 1, "bitpress: error: envround cannot round this model (mode=fail) (in environment 'envplugin')"),
    # an exception in the pass is its plugin's fault, named as in the host (tests/test_plugin_faults.py)
    ("vendor", 1, "bitpress: error: plugin envplugin failed in pass envround: RuntimeError: "
                  "the vendor toolkit exploded (in environment 'envplugin')"),
    ("crash", 1, "the worker exited with code 3 without a result"),
])
def test_worker_failure_is_a_clear_error(run_cli, envs: SimpleNamespace, tiny_decoder: Path, tmp_path: Path,
                                         mode: str, code: int, message: str) -> None:
    out = tmp_path / "out.onnx"
    got, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "envround",
                          "--option", f"mode={mode}")
    assert got == code
    assert message in err and "Traceback" not in err
    if mode == "crash":
        assert "envround: about to crash" in err  # the worker's last output explains the crash
    _assert_no_output(tmp_path, out, set())


def test_worker_checks_option_types(run_cli, envs: SimpleNamespace, tiny_decoder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.onnx"
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "envround",
                           "--option", "seconds=soon")
    assert code == 2
    assert "envround: option seconds='soon' is not a valid float" in err and "(in environment 'envplugin')" in err
    _assert_no_output(tmp_path, out, set())


def test_worker_protocol(envs: SimpleNamespace, tiny_decoder: Path, tmp_path: Path) -> None:
    """The worker alone: options are typed before the model is read; a wrong protocol is refused."""
    def work(job: dict) -> tuple[int, dict]:
        path = tmp_path / "job.json"
        path.write_text(json.dumps({"protocol": PROTOCOL, "result": str(tmp_path / "result.json"), **job}))
        proc = subprocess.run([envs.path / "bin" / "python", "-m", "bitpress.envs.worker", path], cwd=tmp_path,
                              capture_output=True, text=True, env={**os.environ, "BITPRESS_NO_ENVS": "1"})
        return proc.returncode, json.loads((tmp_path / "result.json").read_text())

    rc, result = work({"pass": "envround", "options": {"seconds": "soon"}, "model": str(tmp_path / "none.onnx")})
    assert rc == 1 and result["error"]["type"] == "OptionError"  # not ModelLoadError: the model was not read
    rc, result = work({"protocol": PROTOCOL + 1, "pass": "envround"})
    assert rc == 1 and result["error"]["type"] == "EnvError" and "protocol" in result["error"]["message"]
    rc, result = work({"pass": "envplain", "options": {"tag": "direct"}, "model": str(tiny_decoder),
                       "output": str(tmp_path / "o" / "m.onnx"), "workdir": str(tmp_path / "w"), "jobs": 1})
    assert rc == 0 and result["ok"] and result["files"][0] == str(tmp_path / "o" / "m.onnx")
    assert _metadata(tmp_path / "o" / "m.onnx")["envplain.tag"] == "direct"


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed; only its parent's reaping is left
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("how", ["cli", "config"])
def test_timeout_kills_the_worker(run_cli, envs: SimpleNamespace, tiny_decoder: Path, tmp_path: Path,
                                  how: str) -> None:
    pidfile = tmp_path / "child.pid"
    out = tmp_path / "out.onnx"
    t0 = time.perf_counter()
    if how == "cli":
        code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", out, "--algorithm", "envround",
                               "--option", "mode=sleep", "--option", "seconds=300", "--option", f"pidfile={pidfile}",
                               "--env-timeout", "3")
    else:
        config = tmp_path / "recipe.yaml"
        config.write_text(f"input: {tiny_decoder}\noutput: out.onnx\npasses:\n  - type: envround\n"
                          f"    mode: sleep\n    seconds: 300\n    pidfile: {pidfile}\n    env_timeout: 3\n")
        code, _, err = run_cli("run", config)
    elapsed = time.perf_counter() - t0
    assert code == 1
    assert "did not finish within 3 s" in err and "killed" in err
    assert elapsed < 30
    # the worker's own child process went down with it: the whole process group was killed
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while not _dead(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _dead(pid)
    _assert_no_output(tmp_path, out, {"child.pid", "recipe.yaml"})


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_host_signal_kills_the_worker(envs: SimpleNamespace, tiny_decoder: Path, tmp_path: Path, sig: str) -> None:
    """The host stopped by a signal takes the worker (in a session of its own) and its children down too."""
    import signal

    signum = getattr(signal, sig)
    pidfile = tmp_path / "child.pid"
    out = tmp_path / "out.onnx"
    env = {k: v for k, v in os.environ.items() if k not in ("BITPRESS_NO_ENVS", "BITPRESS_ENV_TIMEOUT")}
    env["BITPRESS_ENVS"] = str(envs.root)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bitpress", "quantize", "-m", str(tiny_decoder), "-o", str(out), "--algorithm",
         "envround", "--option", "mode=sleep", "--option", "seconds=300", "--option", f"pidfile={pidfile}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_signals)
    deadline = time.monotonic() + 120
    while not (pidfile.exists() and pidfile.read_text().strip()) and proc.poll() is None:
        assert time.monotonic() < deadline, "the worker never started its child"
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    assert f"bitpress: interrupted by {sig}; nothing was written" in err.splitlines() and "Traceback" not in err
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while not _dead(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _dead(pid)
    _assert_no_output(tmp_path, out, {"child.pid"})


def test_unknown_options_fail_before_any_work(run_cli, envs: SimpleNamespace, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(remote_mod.subprocess, "Popen", no_worker)
    # the model does not even exist: the option is refused first
    code, _, err = run_cli("quantize", "-m", tmp_path / "missing.onnx", "-o", tmp_path / "o.onnx",
                           "--algorithm", "envround", "--option", "bogus=1")
    assert code == 2
    assert "envround: unknown option(s) bogus; valid options: mode, pidfile, seconds, tag" in err
    config = tmp_path / "recipe.yaml"
    config.write_text("input: missing.onnx\noutput: o.onnx\npasses:\n  - type: rtn\n  - type: envround\n"
                      "    mode: ok\n    colour: blue\n")
    code, _, err = run_cli("run", config)
    assert code == 2 and "unknown option(s) colour" in err
    assert _leftovers(tmp_path, {"recipe.yaml"}) == []


def test_env_remove(run_cli, envs: SimpleNamespace) -> None:
    """Last in this module: it deletes the session's environment."""
    code, out, _ = run_cli("env", "remove", "envplugin")
    assert code == 0 and not envs.path.exists()
    assert list(envs.root.iterdir()) == []
    bitpress.plugins._default = None
    code, out, _ = run_cli("passes", "list", "--json")
    assert "envround" not in {r["pass"] for r in json.loads(out)}


def test_env_recipe(tmp_path: Path) -> None:
    """A plugin's [tool.bitpress.env] table: read, relative paths resolved, bad tables refused by name."""
    from bitpress.envs.manager import env_recipe

    assert env_recipe(None).install_first == () and env_recipe(tmp_path).remove == ()
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    pyproject = plugin / "pyproject.toml"
    pyproject.write_text('[project]\nname = "p"\n[tool.bitpress.env]\ninstall-first = ["torch==2.13.0", "../dep"]\n'
                         'remove = { torchvision = "breaks CPU torch" }\n')
    recipe = env_recipe(plugin)
    assert recipe.install_first == ("torch==2.13.0", str(tmp_path / "dep"))
    assert recipe.remove == (("torchvision", "breaks CPU torch"),) and recipe.source == str(pyproject)
    for table, message in [
        ('install-first = "torch"', "install-first must be a list"),
        ('remove = ["torchvision"]', "remove must map distribution names to the reason"),
        ('remove = { torchvision = "" }', "remove must map distribution names to the reason"),
        ('remove = { "a b" = "x" }', "remove must map distribution names to the reason"),
        ("first = []", "unknown keys first"),
    ]:
        pyproject.write_text(f'[project]\nname = "p"\n[tool.bitpress.env]\n{table}\n')
        with pytest.raises(bitpress.errors.UsageError, match=message):
            env_recipe(plugin)
