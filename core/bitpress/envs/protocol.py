"""What the host and a plugin environment agree on: where environments live, file names, errors.

This module is imported on both sides (the host and the worker inside an environment), so it
stays free of heavy imports.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from bitpress.errors import BitpressError

#: bumped when job.json / result.json / manifest.json change incompatibly
PROTOCOL = 1

ENVS_VAR = "BITPRESS_ENVS"
#: set in every process the host starts inside an environment: the host there must not route
#: passes to environments again (no recursion, no proxies in a manifest)
NO_ENVS_VAR = "BITPRESS_NO_ENVS"
TIMEOUT_VAR = "BITPRESS_ENV_TIMEOUT"

#: a file in a Python environment's prefix (``sys.prefix``, the venv's folder) recording where the
#: plugin environments of that Python environment live: ``{"root": "/abs/path"}``
ROOT_RECORD = "bitpress-envs.json"

ENV_FILE = "env.json"
MANIFEST_FILE = "manifest.json"
#: the pin that forces a pass to run in the host's own environment
HERE = "here"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
#: variables that would make a child Python use the host's packages instead of its own
_LEAKY_VARS = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "__PYVENV_LAUNCHER__", "CONDA_PREFIX")


class EnvError(BitpressError):
    """A plugin environment cannot be created, found or used."""


class WorkerError(EnvError):
    """A pass failed inside its environment with an error that is not a bitpress error."""


class WorkerTimeoutError(WorkerError):
    """A pass ran past its timeout in its environment; the worker was killed."""


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvsRoot:
    """Where the plugin environments live, and what said so."""

    path: Path
    #: ``BITPRESS_ENVS``, ``recorded`` (in ``record``) or ``default`` (the user cache)
    source: str
    record: Path | None = None

    def describe(self) -> str:
        if self.source == "recorded":
            return f"recorded for this Python environment in {self.record}"
        if self.source == ENVS_VAR:
            return f"set by {ENVS_VAR}"
        return f"the default; set {ENVS_VAR} or record one with `bitpress env root PATH`"


def root_record(prefix: Path | None = None) -> Path:
    """The file that records the environments' root for the Python environment at ``prefix``."""
    return Path(sys.prefix if prefix is None else prefix) / ROOT_RECORD


def locate_envs_root() -> EnvsRoot:
    """``$BITPRESS_ENVS`` if set, else the root recorded in ``<sys.prefix>/bitpress-envs.json``
    (``bitpress env root PATH``, which ``make envs`` runs for the checkout's ``.venv``), else
    ``$XDG_CACHE_HOME/bitpress/envs`` (``~/.cache/bitpress/envs``)."""
    configured = os.environ.get(ENVS_VAR)
    if configured:
        return EnvsRoot(Path(configured).expanduser().absolute(), ENVS_VAR)
    record = root_record()
    recorded = _read_root_record(record)
    if recorded is not None:
        return EnvsRoot(recorded, "recorded", record)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return EnvsRoot(Path(cache) / "bitpress" / "envs", "default")


def _read_root_record(record: Path) -> Path | None:
    try:
        text = record.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read %s (%s); using the default plugin environments", record, exc)
        return None
    try:
        data = json.loads(text)
        root = data["root"]
        if not isinstance(root, str) or not root:
            raise TypeError("root is not a path")
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("%s is not a valid record of the plugin environments' root (%s); ignoring it", record, exc)
        return None
    path = Path(root).expanduser()
    # a relative root is relative to the Python environment holding the record
    return path if path.is_absolute() else Path(os.path.normpath(record.parent.absolute() / path))


def record_envs_root(root: Path | str | None, prefix: Path | None = None) -> Path:
    """Record ``root`` as the plugin environments' root of the Python environment at ``prefix``
    (default: the running one); ``None`` removes the record. Returns the record's path."""
    record = root_record(prefix)
    try:
        if root is None:
            record.unlink(missing_ok=True)
        else:
            path = Path(root).expanduser().absolute()
            tmp = record.with_name(record.name + ".tmp")
            tmp.write_text(json.dumps({"root": str(path)}, indent=2) + "\n")
            os.replace(tmp, record)
    except OSError as exc:
        raise EnvError(f"cannot record the plugin environments' root in {record}: {exc}") from None
    return record


def envs_root() -> Path:
    """The folder holding one environment per plugin (see :func:`locate_envs_root`)."""
    return locate_envs_root().path


def check_env_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name == HERE:
        raise EnvError(
            f"{name!r} cannot name an environment: use the plugin's name (letters, digits, '_', '-', '.'); "
            f"{HERE!r} is reserved for the host's own environment"
        )
    return name


def env_python(env_dir: Path) -> Path:
    """The interpreter of a virtual environment (POSIX or Windows layout)."""
    posix = Path(env_dir) / "bin" / "python"
    windows = Path(env_dir) / "Scripts" / "python.exe"
    return windows if os.name == "nt" and not posix.exists() else posix


def child_environ(env_dir: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment variables for a process running an environment's Python.

    The host's own virtualenv and PYTHONPATH are dropped so the child sees only its packages;
    ``NO_ENVS_VAR`` stops the child's host from loading environment proxies itself.
    """
    env = {k: v for k, v in os.environ.items() if k not in _LEAKY_VARS}
    env[NO_ENVS_VAR] = "1"
    env["PYTHONUNBUFFERED"] = "1"  # log lines must reach the host as they are written
    env["PYTHONIOENCODING"] = "utf-8"
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    if env_dir is not None:
        # vendor toolkits that shell out to `python` or their own scripts must find the env's
        env["PATH"] = os.pathsep.join([str(env_python(env_dir).parent), env.get("PATH", "")])
        env["VIRTUAL_ENV"] = str(env_dir)
    env.update(extra)
    return env
