"""Plugin environments: run a plugin's passes in a virtual environment of its own.

Vendor toolkits pin conflicting versions of numpy, onnx and onnxruntime, so one Python
environment cannot hold them all. ``bitpress env create PLUGIN`` builds a virtual environment
with the host and that plugin (:mod:`bitpress.envs.manager`); the host here then offers the
plugin's passes as proxies and runs them there, exchanging models as files: ONNX models, and Hugging Face
folders (:mod:`bitpress.envs.remote`, :mod:`bitpress.envs.worker`). See docs/environments.md.

May import: calibration, errors, hf (a Hugging Face folder's handle), hookspecs, models, onnx, options, passes,
plugins.
"""

from bitpress.envs.manager import EnvInfo, create_env, get_env, install_args, list_envs, remove_env
from bitpress.envs.protocol import (
    HERE,
    EnvError,
    EnvsRoot,
    WorkerError,
    WorkerTimeoutError,
    envs_root,
    locate_envs_root,
    record_envs_root,
)
from bitpress.envs.remote import EnvPass, add_env_passes, pinned_pass, where

__all__ = [
    "HERE",
    "EnvError",
    "EnvInfo",
    "EnvPass",
    "EnvsRoot",
    "WorkerError",
    "WorkerTimeoutError",
    "add_env_passes",
    "create_env",
    "envs_root",
    "get_env",
    "install_args",
    "list_envs",
    "locate_envs_root",
    "pinned_pass",
    "record_envs_root",
    "remove_env",
    "where",
]
