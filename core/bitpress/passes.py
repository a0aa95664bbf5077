"""The Pass contract: what every quantization pass declares and implements.

A pass is a class. Its class attributes are the metadata the host uses to list it and to
pick it for ``bitpress quantize --algorithm A --precision P``; ``run`` does the work::

    class MyPass(Pass):
        name = "mypass"
        algorithms = ("myalgo",)
        precisions = ("int4", "int8")
        model_kinds = ("onnx",)
        needs_data = False
        Options = MyOptions          # a dataclass, see bitpress.options

        def run(self, model, context):
            ...                       # modify or replace the model handle
            return model

Native weight-only algorithms do not subclass this directly: they subclass
:class:`bitpress.onnx.weightonly.WeightOnlyPass` and supply a block solver.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from bitpress.errors import OptionError
from bitpress.options import NoOptions, parse_options

if TYPE_CHECKING:
    from bitpress.models.base import ModelHandle

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")
_ALIAS = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")


#: what a sidecar's suffix may be: ``.encodings``, ``.qnn.json``
_SIDECAR_SUFFIX = re.compile(r"^\.[A-Za-z0-9_-]{1,32}(\.[A-Za-z0-9_-]{1,32})?$")


def sidecars(model: Any) -> dict[str, Path]:
    """Files a pass made to go beside its output model, ``{suffix: path}`` (``model.sidecars``).

    A pass sets ``result.sidecars = {".encodings": path}``; the host copies each to
    ``<output stem><suffix>`` when it saves (AIMET's encodings JSON beside the QDQ model), also
    when the pass ran in a plugin environment. A malformed suffix or a missing file is a bug of
    the pass, reported as such.
    """
    found = getattr(model, "sidecars", None) or {}
    if not isinstance(found, dict):
        raise TypeError(f"model.sidecars must be a dict {{suffix: path}}, got {type(found).__name__}")
    out = {}
    for suffix, path in found.items():
        if not isinstance(suffix, str) or not _SIDECAR_SUFFIX.match(suffix) or suffix.lower() in (".onnx", ".data"):
            raise TypeError(f"model.sidecars: bad suffix {suffix!r} (like '.encodings')")
        if not Path(path).is_file():
            raise TypeError(f"model.sidecars: {suffix} file {path} does not exist")
        out[suffix] = Path(path)
    return out


def _no_progress(iterable: Iterable[Any], **_: Any) -> Iterable[Any]:
    return iterable


@dataclass
class PassContext:
    """What the host hands a pass besides the model.

    jobs: worker threads for per-tensor work. progress: wraps an iterable with a progress bar
    (the CLI installs tqdm; the library default shows nothing). workdir: a scratch folder on
    the output's file system, removed after the run. data: calibration data settings, for
    passes that need data. executor: where per-tensor work runs (a
    :class:`bitpress.executors.ExecutorSpec`; None: ``jobs`` threads here).
    """

    jobs: int = field(default_factory=lambda: os.cpu_count() or 1)
    executor: Any = None
    workdir: Path | None = None
    data: dict[str, Any] | None = None
    progress: Callable[..., Iterable[Any]] = _no_progress
    extras: dict[str, Any] = field(default_factory=dict)

    @contextmanager
    def step(self, total: int, desc: str) -> Iterator[Callable[[int], None]]:
        """A progress counter for ``total`` units of work: ``advance(n)`` after each."""
        bar = self.progress(None, total=total, desc=desc)
        update = getattr(bar, "update", None)
        try:
            yield (update if update is not None else (lambda n=1: None))
        finally:
            close = getattr(bar, "close", None)
            if close is not None:
                close()


class Pass(ABC):
    """Base class of every pass. Subclasses set the class attributes and ``run``."""

    name: ClassVar[str]
    #: other names the pass answers to in configs, ``passes show`` and ``--algorithm`` (case-insensitive):
    #: the names of the peer tool's pass it stands in for, e.g. Olive's ``OnnxStaticQuantization``
    aliases: ClassVar[tuple[str, ...]] = ()
    #: a pass that needs data and can calibrate on text the model writes itself: without ``data``, a run gives it
    #: the model's own text (``source: generated``, logged) instead of stopping (gptq, awq and their HF forms)
    own_text_default: ClassVar[bool] = False
    algorithms: ClassVar[tuple[str, ...]] = ()
    precisions: ClassVar[tuple[str, ...]] = ()
    model_kinds: ClassVar[tuple[str, ...]] = ("onnx",)
    #: the kind of model the pass returns when it converts (e.g. an export); None: unchanged
    output_kind: ClassVar[str | None] = None
    needs_data: ClassVar[bool] = False
    #: the pass hands its per-tensor work to ``context.executor`` (Ray tasks with ``--executor ray``)
    distributes: ClassVar[bool] = False
    Options: ClassVar[type] = NoOptions
    summary: ClassVar[str] = ""
    #: importable modules the pass needs at run time (checked without importing them)
    requires: ClassVar[tuple[str, ...]] = ()
    #: what to run to get the requirements, shown when they are missing
    install_hint: ClassVar[str | None] = None
    #: set by the host: the plugin that registered the class
    plugin: ClassVar[str] = "?"
    #: what the pass does with mixture-of-experts weights (``passes list``): None when it leaves them as they are
    experts: ClassVar[str | None] = None

    def __init__(self, options: Any | None = None) -> None:
        self.options = options if options is not None else self.Options()

    @classmethod
    def from_config(cls, values: dict[str, Any] | None, precision: str | None = None, *,
                    strict: bool = False) -> Pass:
        """Validate user options (and a precision) and build the pass; no work is done.

        ``strict``: the values come typed (a workflow config, Python) and must have their options'
        types; otherwise strings (``--option k=v``) are coerced (see :func:`bitpress.options.parse_options`).
        """
        if values is not None and not isinstance(values, dict):
            raise OptionError(f"{cls.name}: options must be a mapping of names to values")
        values = dict(values or {})
        if precision is not None:
            from bitpress.selection import short

            for key, value in cls.precision_options(precision).items():
                if key in values and str(values[key]) != str(value):
                    raise OptionError(
                        f"{cls.name}: option {key}={short(values[key])} contradicts --precision {precision}"
                    )
                values[key] = value
            for key, value in cls.precision_defaults(precision).items():
                values.setdefault(key, value)  # the user's own value wins
        return cls(parse_options(cls.Options, values, owner=cls.name, strict=strict))

    @classmethod
    def precision_defaults(cls, precision: str) -> dict[str, Any]:
        """Defaults a precision brings that the user's options override (``precision_options`` are implied and
        cannot be contradicted). Default: none."""
        return {}

    @classmethod
    def precision_options(cls, precision: str) -> dict[str, Any]:
        """Options implied by a precision name. Default: ``intN``/``uintN`` sets ``bits``."""
        if precision not in cls.precisions:
            raise OptionError(
                f"{cls.name}: precision {precision!r} is not supported; "
                f"choose one of {', '.join(cls.precisions)}"
            )
        names = {f.name for f in fields(cls.Options)}
        m = re.fullmatch(r"u?int(\d+)", precision)
        if m and "bits" in names:
            return {"bits": int(m.group(1))}
        if "precision" in names:
            return {"precision": precision}
        return {}

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """``None`` when the pass can run here, else why not and how to fix it."""
        missing = [m for m in cls.requires if not _importable(m)]
        if not missing:
            return None
        hint = f"; install it with: {cls.install_hint}" if cls.install_hint else ""
        return f"missing Python module(s) {', '.join(missing)}{hint}"

    @abstractmethod
    def run(self, model: ModelHandle, context: PassContext) -> ModelHandle:
        """Transform ``model``. Never write next to the input: the host saves the result."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_pass_class(cls: Any) -> None:
    """Raise TypeError if ``cls`` does not honour the contract (checked at registration)."""
    if not (isinstance(cls, type) and issubclass(cls, Pass)):
        raise TypeError(f"{cls!r} is not a bitpress.passes.Pass subclass")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _NAME.match(name):
        raise TypeError(f"{cls.__name__}.name must be a lowercase identifier, got {name!r}")
    aliases = getattr(cls, "aliases", ())
    if not isinstance(aliases, tuple) or not all(isinstance(a, str) and _ALIAS.match(a) for a in aliases):
        raise TypeError(f"{cls.__name__}.aliases must be a tuple of identifiers (letters, digits, _), got {aliases!r}")
    for attr in ("algorithms", "precisions", "model_kinds"):
        value = getattr(cls, attr)
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise TypeError(f"{cls.__name__}.{attr} must be a tuple of strings")
    try:
        cls.Options()
    except TypeError as exc:
        raise TypeError(f"{cls.__name__}.Options needs defaults for every field: {exc}") from None
