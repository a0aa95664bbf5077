"""What the host and a plugin environment agree on: where environments live, file names, errors.

This module is imported on both sides (the host and the worker inside an environment), so it
stays free of heavy imports.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from bitpress.errors import BitpressError

#: bumped when job.json / result.json / manifest.json change incompatibly
PROTOCOL = 1

ENVS_VAR = "BITPRESS_ENVS"
#: set in every process the host starts inside an environment: the host there must not route
#: passes to environments again (no recursion, no proxies in a manifest)
NO_ENVS_VAR = "BITPRESS_NO_ENVS"
TIMEOUT_VAR = "BITPRESS_ENV_TIMEOUT"

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


def envs_root() -> Path:
    """The folder holding one environment per plugin: ``$BITPRESS_ENVS``, else the user cache."""
    configured = os.environ.get(ENVS_VAR)
    if configured:
        return Path(configured).expanduser().absolute()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "bitpress" / "envs"


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
