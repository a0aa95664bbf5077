"""bitpress-envplugin: the test plugin of tests/test_envs.py.

``envround`` needs ``envplugin_dep`` (its "toolkit"), which only the plugin's environment has,
so the host must run it there. It rounds float initializers to float16 precision, records where
it ran in the model's metadata, writes a file into its working directory as vendor toolkits do,
and can fail, crash or hang on request (option ``mode``). ``envplain`` needs nothing: it runs
wherever it is pinned.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import onnx

from bitpress import Pass, PassContext, hookimpl
from bitpress.errors import QuantizationError
from bitpress.options import option

log = logging.getLogger(__name__)


@dataclass
class EnvRoundOptions:
    mode: Literal["ok", "fail", "vendor", "crash", "sleep"] = option(
        "ok", "ok; fail (a bitpress error); vendor (a RuntimeError); crash (exit without a result); sleep"
    )
    seconds: float = option(0.0, "how long mode=sleep sleeps")
    pidfile: str = option("", "mode=sleep: write the pid of a child process here (it sleeps too)")
    tag: str = option("", "written to the model's metadata")


@dataclass
class Report:
    rounded: int

    def summary(self) -> str:
        return f"rounded {self.rounded} float tensors to float16 precision"


def _mark(model: Any, name: str, tag: str) -> None:
    props = {p.key: p for p in model.proto.metadata_props}
    for key, value in ((f"{name}.prefix", sys.prefix), (f"{name}.cwd", os.getcwd()), (f"{name}.tag", tag)):
        if key in props:
            props[key].value = value
        else:
            entry = model.proto.metadata_props.add()
            entry.key, entry.value = key, value
    model.modified = True


class EnvRoundPass(Pass):
    name = "envround"
    algorithms = ("envround",)
    precisions = ("fp16",)
    summary = "round float weights to float16 precision (needs envplugin_dep)"
    requires = ("envplugin_dep",)
    install_hint = "bitpress env create envplugin"
    Options: ClassVar[type] = EnvRoundOptions

    def run(self, model: Any, context: PassContext) -> Any:
        import envplugin_dep

        opts = self.options
        if opts.mode == "fail":
            raise QuantizationError("envround cannot round this model (mode=fail)")
        if opts.mode == "vendor":
            raise RuntimeError("the vendor toolkit exploded")
        if opts.mode == "crash":
            print("envround: about to crash", flush=True)
            os._exit(3)
        if opts.mode == "sleep":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            if opts.pidfile:
                Path(opts.pidfile).write_text(f"{child.pid}\n")
            time.sleep(opts.seconds)
        # vendor toolkits drop files into their working directory: the host must give them a scratch one
        Path("vendor-scratch.txt").write_text("scratch\n")
        print("envround: vendor-style output on stdout", flush=True)
        rounded = 0
        for tensor in list(model.graph.initializer):
            if tensor.data_type != onnx.TensorProto.FLOAT or not tensor.dims:
                continue
            array = np.asarray(model.array(tensor))
            model.set_initializer(tensor.name, envplugin_dep.round_fp16(array))
            rounded += 1
        _mark(model, "envround", opts.tag or envplugin_dep.MARKER)
        log.warning("envround rounded %d tensors with %s", rounded, envplugin_dep.MARKER)
        context.extras.setdefault("reports", []).append((self.name, model.source, Report(rounded)))
        return model


@dataclass
class EnvPlainOptions:
    tag: str = option("", "written to the model's metadata")


class EnvPlainPass(Pass):
    name = "envplain"
    algorithms = ("envplain",)
    summary = "record where it ran in the model's metadata (needs nothing)"
    Options: ClassVar[type] = EnvPlainOptions

    def run(self, model: Any, context: PassContext) -> Any:
        _mark(model, "envplain", self.options.tag)
        return model


@hookimpl
def bitpress_register_passes(register: Callable[[type], None]) -> None:
    register(EnvRoundPass)
    register(EnvPlainPass)
