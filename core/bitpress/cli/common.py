"""What the command groups of the CLI share: exit codes, the parser class, argument types, output formatting."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bitpress.errors import UsageError

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

#: flags of the whole command line, accepted before and after the (sub)command's name
GLOBAL_FLAGS = ("-v", "--verbose", "--json")


# -- argument parsing -----------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """The parser of ``bitpress`` and, through ``add_subparsers``, of every (nested) subcommand.

    Every subcommand accepts ``-v/--verbose`` after its name (``bitpress quantize ... -v``,
    ``bitpress passes list -v``); a subcommand that prints JSON declares ``--json`` itself.
    In subcommands both default to ``argparse.SUPPRESS``, so a flag given before the
    subcommand (``bitpress -v passes list``) is not overwritten by the subcommand's default.
    """

    def __init__(self, *args: Any, root: bool = False, **kwargs: Any) -> None:
        self._root = root  # set first: the base class adds -h through add_argument
        super().__init__(*args, **kwargs)
        self.add_argument("-v", "--verbose", action="store_true", help="debug logs and tracebacks")
        if root:
            self.add_argument("--json", action="store_true",
                              help="print the result as JSON (commands that have a JSON output)")

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        if not self._root and any(a in GLOBAL_FLAGS for a in args):
            kwargs["default"] = argparse.SUPPRESS
            if "--json" in args:
                self.set_defaults(json_output=True)  # checked in main(): `bitpress --json demo` is refused
                kwargs.setdefault("help", "print the result as JSON")
        return super().add_argument(*args, **kwargs)


class Deprecated(argparse.Action):
    """An old option name that still works: stores like its replacement and says so on stderr."""

    def __init__(self, *args: Any, replacement: str, **kwargs: Any) -> None:
        self.replacement = replacement
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"bitpress: warning: {option_string} is deprecated; use {self.replacement}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def size(text: str) -> int:
    """Argument type: a size in bytes, e.g. ``2GB``, ``500MB``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 500MB)")
    unit = (m.group(2) or "").upper().replace("I", "").rstrip("B")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    return int(float(m.group(1)) * scale)


def int_list(text: str) -> list[int]:
    """Argument type: whole numbers separated by commas, e.g. ``1,2``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def parse_kv(items: list[str]) -> dict[str, str]:
    """``--option KEY=VALUE`` strings as a dict."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--option expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


# -- what commands share ----------------------------------------------------------------------------
#: the help of ``--subfolder`` (quantize, eval, export)
SUBFOLDER_HELP = ("with a Hugging Face Hub id (org/name[@revision]) as the model: the folder of the model inside "
                  "the repo, e.g. onnx or a GenAI package's cpu-int4")


def hub_path(value: str, what: str, subfolder: str | None = None, kind: str | None = None) -> Path:
    """A model argument as a local path: itself, or a Hub id's snapshot folder (``subfolder`` applies to Hub
    ids only; a local path always wins), noting on stderr which commit it is (stdout may be JSON)."""
    from bitpress.hub import describe, resolve

    path, found = resolve(value, subfolder=subfolder if _is_hub(value) else None, what=what, kind=kind)
    if found is not None:
        print(f"note: {what}: {describe(found)}", file=sys.stderr)
    return path


def _is_hub(value: str) -> bool:
    from bitpress.hub import hub_id

    return hub_id(value) is not None


def registry():
    """The plugin registry (imported when a command needs it: ``bitpress --help`` stays fast)."""
    from bitpress.plugins import get_registry

    return get_registry()


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    """The library's progress callback: a tqdm bar on stderr, when stderr is a terminal."""
    from tqdm import tqdm

    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, leave=False,
                disable=not sys.stderr.isatty(), **kwargs)


# -- formatting --------------------------------------------------------------------------------
def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def size_change(ratio: float, model_in: int) -> str:
    """How the output's size compares with the input's (``ratio`` = input / output), read the right way round."""
    if not ratio or abs(ratio - 1.0) < 0.005:
        return f"the same size as the input's {mb(model_in)}"
    if ratio > 1:
        return f"the model is {ratio:.2f}x smaller than {mb(model_in)}"
    return f"the model is {1 / ratio:.2f}x larger than {mb(model_in)}"


def print_table(rows: list[list[str]], indent: str = "") -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def report(result: Any, as_json: bool, show_weights: bool = False) -> None:
    """What a run wrote (``quantize``, ``run``, ``export``): sizes, time, the passes' reports, notes."""
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    from bitpress.workflow.plan import weight_table_lines

    total = sum(result.seconds.values())
    # the ratio is over the models (.onnx + external data); tokenizer and config files are counted apart
    model_out = result.output_model_bytes if result.output_model_bytes is not None else result.output_bytes
    model_in = result.input_model_bytes if result.input_model_bytes is not None else result.input_bytes
    extra = f" + {mb(result.companion_bytes)} of companion files" if result.companion_bytes else ""
    print(f"wrote {result.output} ({mb(model_out)} of model{extra}; {size_change(result.ratio, model_in)}) "
          f"in {total:.1f} s")
    for name, src, rep in result.reports:
        summary = rep.summary() if hasattr(rep, "summary") else str(rep)
        print(f"  {name} on {Path(src).name}: {summary}")
        if show_weights:
            for line in weight_table_lines(rep):
                print(f"    {line}")
    for where, paths in getattr(result, "runtime", []):
        print(f"  runs on ({paths.target}, {where}): {paths.summary()}")
    for f in result.files:
        print(f"  {f}")
    for note in result.notes:
        print(f"note: {note}")
    for name, src, rep in result.reports:
        if getattr(rep, "quantized", None) == 0:
            print(f"warning: {name} quantized no weights of {Path(src).name}; its weights are the input's, "
                  "in float (see the patterns above, or --plan)")
