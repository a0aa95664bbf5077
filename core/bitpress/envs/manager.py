"""Create, list and remove one virtual environment per plugin.

Vendor toolkits pin conflicting versions of numpy, onnx and onnxruntime (DESIGN.md section 4),
so a plugin can live in a virtual environment of its own: the host and the plugin with its
``toolkit`` extra, nothing else. The host here then runs that plugin's passes there,
exchanging models as files (see :mod:`bitpress.envs.remote`).

An environment is a folder ``<envs root>/<name>`` holding the venv, ``env.json`` (how it was
built, ``pip freeze``) and ``manifest.json`` (the passes the host inside it offers, read by
running ``python -m bitpress passes list/show --json`` there). It is built in a temporary
sibling folder and renamed into place when complete, so a failed or interrupted build never
leaves a half-made environment under the real name.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bitpress.envs.protocol import (
    ENV_FILE,
    MANIFEST_FILE,
    PROTOCOL,
    EnvError,
    check_env_name,
    child_environ,
    env_python,
    envs_root,
)
from bitpress.errors import UsageError

log = logging.getLogger(__name__)

#: the extra in which a plugin keeps its heavy vendor dependencies
TOOLKIT_EXTRA = "toolkit"
#: the plugin name the host's own passes are listed under
HOST_PLUGIN = "bitpress"


@dataclass
class EnvInfo:
    """One environment as found on disk."""

    name: str
    path: Path
    meta: dict[str, Any]
    manifest: dict[str, Any] | None

    @property
    def python(self) -> Path:
        return env_python(self.path)

    def pass_entries(self, *, available_only: bool = True) -> list[dict[str, Any]]:
        entries = list((self.manifest or {}).get("passes") or [])
        return [e for e in entries if e.get("available", True)] if available_only else entries

    @property
    def passes(self) -> list[str]:
        return [e["pass"] for e in self.pass_entries()]

    def problem(self) -> str | None:
        """Why the environment cannot run passes now, or ``None``."""
        if not self.python.exists():
            return f"its Python {self.python} is missing"
        if self.manifest is None:
            return f"it has no readable {MANIFEST_FILE}"
        if self.meta.get("protocol") != PROTOCOL or self.manifest.get("protocol") != PROTOCOL:
            return (f"it was built by bitpress {self.meta.get('host_version', '?')} (protocol "
                    f"{self.meta.get('protocol')}), this host speaks protocol {PROTOCOL}")
        return None

    def to_json(self) -> dict[str, Any]:
        python = self.meta.get("python") or {}
        return {
            "env": self.name, "path": str(self.path), "plugin": self.meta.get("plugin", self.name),
            "python": str(self.python), "python_version": python.get("version"),
            "host_version": self.meta.get("host_version"), "source": self.meta.get("source"),
            "specs": self.meta.get("specs", []), "created": self.meta.get("created"),
            "passes": self.passes, "problem": self.problem(),
        }


# -- where things come from ---------------------------------------------------------------------------------
def checkout_root() -> Path | None:
    """The repository this host runs from (``<root>/core/bitpress`` with the host's pyproject), or None."""
    import bitpress

    package = Path(bitpress.__file__).resolve().parent
    root = package.parent.parent
    if package.parent.name != "core" or not (root / "plugins").is_dir():
        return None
    return root if _project_name(root / "pyproject.toml") == "bitpress" else None


def _project(pyproject: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(pyproject.read_text()).get("project") or {}
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def _project_name(pyproject: Path) -> str | None:
    return _project(pyproject).get("name")


def declares_toolkit(plugin_dir: Path) -> bool:
    extras = _project(plugin_dir / "pyproject.toml").get("optional-dependencies") or {}
    return TOOLKIT_EXTRA in extras


def install_args(name: str, specs: Sequence[str] | None = None, *, checkout: Path | bool | None = True) -> list[str]:
    """The ``pip install`` arguments for the environment of plugin ``name``.

    From a checkout the host and ``plugins/<name>`` are installed editable (the environment then
    runs the same code as the host here, whatever is edited); the plugin's ``toolkit`` extra
    is added when its pyproject declares one. Otherwise ``bitpress==<this version>`` and
    ``bitpress-<name>[toolkit]`` come from the index. ``specs`` replaces the plugin's
    requirement (third-party plugins, local folders); the host is always installed.
    """
    from bitpress import __version__

    root = checkout_root() if checkout is True else (checkout or None)
    args = ["-e", str(root)] if root is not None else [f"bitpress=={__version__}"]
    if specs:
        return args + [_absolute_spec(s) for s in specs]
    plugin_dir = root / "plugins" / name if root is not None else None
    if plugin_dir is not None and (plugin_dir / "pyproject.toml").is_file():
        extra = f"[{TOOLKIT_EXTRA}]" if declares_toolkit(plugin_dir) else ""
        return [*args, "-e", f"{plugin_dir}{extra}"]
    # an index distribution may not declare the extra: pip then warns and installs the plugin alone
    return [*args, f"bitpress-{name}[{TOOLKIT_EXTRA}]"]


@dataclass(frozen=True)
class EnvRecipe:
    """How a plugin's environment is built beyond ``pip install``: its ``[tool.bitpress.env]`` table.

    ``install-first``: requirements installed in a pip call of their own before the rest (the
    CPU torch wheel: once installed, a later resolution that accepts it keeps it instead of
    pulling a CUDA build). ``remove``: distributions uninstalled after the install, each with
    the reason (a CUDA torchvision that a dependency pulls in and that breaks CPU torch).
    """

    install_first: tuple[str, ...] = ()
    remove: tuple[tuple[str, str], ...] = ()
    source: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"install_first": list(self.install_first), "remove": dict(self.remove), "source": self.source}


def env_recipe(plugin_dir: Path | None) -> EnvRecipe:
    """The ``[tool.bitpress.env]`` table of ``plugin_dir/pyproject.toml`` (empty when there is none)."""
    if plugin_dir is None or not (plugin_dir / "pyproject.toml").is_file():
        return EnvRecipe()
    path = plugin_dir / "pyproject.toml"
    try:
        table = ((tomllib.loads(path.read_text()).get("tool") or {}).get("bitpress") or {}).get("env") or {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{path}: cannot read it: {exc}") from None
    unknown = sorted(set(table) - {"install-first", "remove"})
    if unknown:
        raise UsageError(f"{path}: [tool.bitpress.env] has unknown keys {', '.join(unknown)} "
                         "(known: install-first, remove)")
    first = table.get("install-first", [])
    if not isinstance(first, list) or not all(isinstance(r, str) and r.strip() for r in first):
        raise UsageError(f"{path}: [tool.bitpress.env] install-first must be a list of requirement strings")
    remove = table.get("remove", {})
    if not isinstance(remove, dict) or not all(
        isinstance(k, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", k) and isinstance(v, str) and v.strip()
        for k, v in remove.items()
    ):
        raise UsageError(f"{path}: [tool.bitpress.env] remove must map distribution names to the reason "
                         '(remove = { torchvision = "why" })')
    # a local folder or file is relative to the plugin's folder
    first = [str((plugin_dir / r).resolve()) if r.startswith(("./", "../")) else r for r in first]
    return EnvRecipe(tuple(first), tuple(remove.items()), str(path))


def _recipe_dir(name: str, args: Sequence[str]) -> Path | None:
    """The plugin folder whose recipe applies: the checkout's plugin, or a local folder spec."""
    folders = []
    for arg in args:
        m = re.fullmatch(r"(.+?)(\[[^\]]*\])?", arg)
        candidate = Path(m.group(1) if m else arg)
        if candidate.is_absolute() and (candidate / "pyproject.toml").is_file():
            folders.append(candidate)
    root = checkout_root()
    plugin = [f for f in folders if root is None or f.resolve() != root.resolve()]
    named = [f for f in plugin if _project_name(f / "pyproject.toml") in (f"bitpress-{name}", name)]
    chosen = named or plugin
    return chosen[0] if chosen else None


def _absolute_spec(spec: str) -> str:
    """A local folder or file spec (``./dir[extra]``) made absolute, so env.json records where it was."""
    m = re.fullmatch(r"(.+?)(\[[^\]]*\])?", spec.strip())
    path, extras = (m.group(1), m.group(2) or "") if m else (spec, "")
    candidate = Path(path).expanduser()
    if ("/" in path or os.sep in path or path.startswith(".")) and candidate.exists():
        return f"{candidate.resolve()}{extras}"
    return spec


# -- reading ------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def get_env(name: str, root: Path | None = None) -> EnvInfo | None:
    path = (root or envs_root()) / name
    meta = _read_json(path / ENV_FILE)
    if meta is None:
        return None
    _refresh_stale_manifest(name, path, meta)
    return EnvInfo(name, path, meta, _read_json(path / MANIFEST_FILE))


def _refresh_stale_manifest(name: str, path: Path, meta: dict[str, Any]) -> None:
    """Re-read the passes of an environment built from this checkout when its code changed.

    Such an environment runs the checkout's code (editable installs), so it picks up edits
    at once, but ``manifest.json`` (the pass options the host checks names against) was
    written when it was built: a new option would be refused as unknown until a rebuild.
    """
    manifest = path / MANIFEST_FILE
    checkout = checkout_root()
    if meta.get("source") != "checkout" or checkout is None or not manifest.is_file():
        return
    plugin_dir = checkout / "plugins" / str(meta.get("plugin", name))
    sources = [*plugin_dir.rglob("*.py"), *(checkout / "core" / "bitpress").rglob("*.py")]
    try:
        stamp = manifest.stat().st_mtime
        if not any(src.stat().st_mtime > stamp for src in sources):
            return
    except OSError:
        return
    py = env_python(path)
    if not py.exists():
        return
    log.info("the code of environment %s changed since its manifest was written: reading its passes again", name)
    try:
        fresh = _manifest(py, path, name)
    except (EnvError, UsageError, OSError) as exc:
        log.warning("could not refresh the manifest of environment %s (%s); using the old one", name, exc)
        return
    tmp = manifest.with_name(f".{MANIFEST_FILE}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(fresh, indent=2, default=str) + "\n")
    os.replace(tmp, manifest)


def list_envs(root: Path | None = None) -> list[EnvInfo]:
    """Every environment under the root (folders with an env.json), by name."""
    root = root or envs_root()
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        # dot folders are builds in progress or removals: never environments
        if path.name.startswith(".") or not path.is_dir():
            continue
        info = get_env(path.name, root)
        if info is not None:
            found.append(info)
    return found


def remove_env(name: str, root: Path | None = None) -> Path:
    """Delete an environment (and leftovers of interrupted builds of it); returns its path."""
    check_env_name(name)
    root = root or envs_root()
    path = root / name
    leftovers = list(root.glob(f".{name}.creating-*")) if root.is_dir() else []
    if not (path / ENV_FILE).is_file() and not (path / "pyvenv.cfg").is_file():
        if leftovers:
            for stale in leftovers:
                shutil.rmtree(stale, ignore_errors=True)
            return path
        known = ", ".join(e.name for e in list_envs(root)) or "none"
        raise UsageError(f"no environment named {name!r} in {root} (existing: {known})")
    # rename first: the environment disappears at once for readers, even if deleting takes a while
    trash = root / f".{name}.removing-{uuid.uuid4().hex[:8]}"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
    for stale in leftovers:
        shutil.rmtree(stale, ignore_errors=True)
    return path


# -- creating -----------------------------------------------------------------------------------------------
def create_env(
    name: str,
    specs: Sequence[str] | None = None,
    python: str | Path | None = None,
    *,
    force: bool = False,
    echo: Callable[[str], None] | None = None,
    root: Path | None = None,
) -> EnvInfo:
    """Build the environment of plugin ``name`` (see :func:`install_args`) and return it.

    ``echo`` receives pip's output line by line as it comes (the CLI prints it: installing a
    toolkit takes minutes); by default the lines are logged at INFO.
    """
    from bitpress import __version__

    check_env_name(name)
    echo = echo or (lambda line: log.info("%s", line))
    root = root or envs_root()
    final = root / name
    if final.exists() and not force:
        raise UsageError(
            f"environment {name!r} already exists at {final}; use --force to rebuild it, "
            f"or `bitpress env remove {name}`"
        )
    base_python = _base_python(python)
    args = install_args(name, specs)
    recipe = env_recipe(_recipe_dir(name, args))
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.creating-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    try:
        echo(f"creating a virtual environment for {name} with {base_python}")
        _run([str(base_python), "-m", "venv", str(tmp)], what="create the virtual environment")
        py = env_python(tmp)
        pip = [str(py), "-m", "pip"]
        if recipe.install_first:
            echo(f"pip install {' '.join(recipe.install_first)} (first: {recipe.source})")
            _stream_pip([*pip, "install", "--progress-bar", "off", *recipe.install_first], tmp, echo)
        echo(f"pip install {' '.join(args)}")
        _stream_pip([*pip, "install", "--progress-bar", "off", *args], tmp, echo)
        removed = _remove_listed(pip, tmp, recipe, echo)
        echo("reading the passes the environment offers")
        manifest = _manifest(py, tmp, name)
        about = json.loads(_run(
            [str(py), "-c", "import json, platform, sys; print(json.dumps({'version': platform.python_version(),"
             " 'implementation': platform.python_implementation(),"
             " 'base': getattr(sys, '_base_executable', sys.executable)}))"],
            env_dir=tmp, what="ask the environment's Python its version",
        ))
        freeze = _run([str(py), "-m", "pip", "freeze"], env_dir=tmp, what="run pip freeze").splitlines()
        meta = {
            "plugin": name,
            "protocol": PROTOCOL,
            "host_version": __version__,
            "python": {"executable": str(env_python(final)), **about},
            "source": "checkout" if args[0] == "-e" else "index",
            "specs": args,
            "recipe": recipe.to_json(),
            "removed": removed,
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - start, 1),
            "freeze": freeze,
        }
        (tmp / ENV_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        _relocate(tmp, final)
        _move_into_place(tmp, final, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info = get_env(name, root)
    assert info is not None
    log.info("environment %s ready at %s in %.0f s", name, final, time.perf_counter() - start)
    return info


def _base_python(python: str | Path | None) -> Path:
    if python is None:
        # a venv's interpreter creates venvs from its base interpreter: fine to start from it
        return Path(sys.executable)
    path = Path(python).expanduser()
    found = shutil.which(str(path)) if not path.exists() else str(path)
    if not found:
        raise UsageError(f"--python {python}: no such interpreter")
    return Path(found).absolute()


def _run(cmd: list[str], *, env_dir: Path | None = None, what: str, timeout: float = 600) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_environ(env_dir),
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EnvError(f"could not {what}: {exc}") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise EnvError(f"could not {what} (exit {proc.returncode}):\n{tail}")
    return proc.stdout


#: flags of ours in pip command lines, left out of error messages
_PIP_FLAGS = ("--progress-bar", "off", "--yes")


def _stream_pip(cmd: list[str], env_dir: Path, echo: Callable[[str], None]) -> None:
    tail: deque[str] = deque(maxlen=25)
    # pip runs in the new environment's folder: a relative spec was made absolute already
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                          env=child_environ(env_dir), cwd=env_dir, stdin=subprocess.DEVNULL) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                line = line.rstrip()
                tail.append(line)
                echo(line)
            rc = proc.wait()
        except BaseException:
            proc.kill()
            raise
    if rc != 0:
        raise EnvError(
            f"pip could not {cmd[3]} {' '.join(a for a in cmd[4:] if a not in _PIP_FLAGS)} (exit {rc}); "
            "nothing was kept. Last lines:\n" + "\n".join(tail)
        )


def _remove_listed(pip: list[str], env_dir: Path, recipe: EnvRecipe, echo: Callable[[str], None]) -> dict[str, str]:
    """Uninstall the recipe's ``remove`` distributions that pip installed; returns name -> reason."""
    removed = {}
    for dist, reason in recipe.remove:
        probe = subprocess.run([*pip, "show", "--quiet", dist], capture_output=True, text=True,
                               env=child_environ(env_dir), stdin=subprocess.DEVNULL, timeout=120)
        if probe.returncode != 0:
            echo(f"{dist}: not installed, nothing to remove")
            continue
        echo(f"pip uninstall {dist} ({reason})")
        _stream_pip([*pip, "uninstall", "--yes", dist], env_dir, echo)
        removed[dist] = reason
    return removed


def _manifest(py: Path, env_dir: Path, name: str) -> dict[str, Any]:
    """The passes the host inside the environment offers, in the host's own JSON."""
    def query(*args: str) -> Any:
        out = _run([str(py), "-m", "bitpress", *args, "--json"], env_dir=env_dir,
                   what=f"run `bitpress {' '.join(args)}` in the environment")
        try:
            return json.loads(out)
        except json.JSONDecodeError as exc:
            raise EnvError(f"`bitpress {' '.join(args)} --json` in the environment printed no JSON: {exc}") from None

    passes, broken = [], []
    for row in query("passes", "list"):
        if row.get("plugin") == HOST_PLUGIN:
            continue  # the host's own passes: every host has them, they always run where it is
        if row.get("pass") == "?":  # a plugin that failed to load inside the environment
            broken.append({"plugin": row.get("plugin"), "error": row.get("reason")})
            continue
        entry = query("passes", "show", row["pass"])
        entry.update(available=bool(row.get("available")), reason=row.get("reason"))
        passes.append(entry)
    available = [p for p in passes if p["available"]]
    if not available:
        reasons = [f"{p['pass']}: {p['reason']}" for p in passes]
        reasons += [f"plugin {b['plugin']}: {b['error']}" for b in broken]
        raise EnvError(
            f"the environment for {name} offers no usable pass"
            + (": " + "; ".join(reasons) if reasons else " (is the plugin's distribution right? see --spec)")
        )
    if not any(p.get("plugin") == name for p in available):
        log.warning("no pass of a plugin named %r in the environment; it offers %s",
                    name, ", ".join(f"{p['pass']} ({p['plugin']})" for p in available))
    for p in passes:
        if not p["available"]:
            log.warning("pass %s is unavailable inside the environment too: %s", p["pass"], p["reason"])
    return {"protocol": PROTOCOL, "env": name, "passes": passes, "broken": broken}


def _relocate(tmp: Path, final: Path) -> None:
    """Point the scripts of a venv built at ``tmp`` to ``final``, where it is about to move.

    A venv records its own path in its console scripts' shebangs and activate scripts; the
    interpreter itself finds ``pyvenv.cfg`` relative to where it is and needs no change.
    """
    old, new = str(tmp).encode(), str(final).encode()
    bindir = env_python(tmp).parent
    for path in [*bindir.iterdir(), tmp / "pyvenv.cfg"]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if old in data:
            mode = path.stat().st_mode
            path.write_bytes(data.replace(old, new))
            path.chmod(mode)


def _move_into_place(tmp: Path, final: Path, force: bool) -> None:
    trash = None
    if final.exists():
        if not force:
            raise EnvError(f"{final} appeared while the environment was being built; nothing was replaced")
        trash = final.with_name(f".{final.name}.removing-{uuid.uuid4().hex[:8]}")
        os.replace(final, trash)
    try:
        os.rename(tmp, final)
    except OSError as exc:
        if trash is not None:
            os.replace(trash, final)
        raise EnvError(f"could not move the new environment to {final}: {exc}") from None
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
