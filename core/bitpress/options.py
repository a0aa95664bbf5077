"""Typed pass options: dataclasses whose fields carry defaults and help.

A pass declares ``Options`` as a dataclass; each field's ``metadata["help"]`` explains it.
:func:`parse_options` turns user input into an instance, failing before any work on unknown keys
or values of the wrong type. Two modes: values from a typed source (a JSON / YAML workflow
config, Python calls) are checked ``strict``: only a value of the declared type passes (``8`` for
an int, ``false`` for a bool, ``"auto"`` for a ``Literal["auto", ...]``); strings from the command
line (``--option k=v``, where everything is a string) are coerced (``"8"``, ``"false"``). Cross-field
checks live in ``validate()`` methods; the host runs the one of every class in the options
class's MRO, base first (:func:`validate_options`), so a subclass cannot drop its bases' checks.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

from bitpress.errors import OptionError


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with help text; mutable defaults are copied per instance."""
    if isinstance(default, list | dict | set):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class NoOptions:
    """For passes without options."""


@dataclass(frozen=True)
class OptionInfo:
    name: str
    type: str
    default: Any
    help: str


def describe(options_cls: type) -> list[OptionInfo]:
    hints = typing.get_type_hints(options_cls)
    out = []
    for f in dataclasses.fields(options_cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        out.append(OptionInfo(f.name, _type_name(hints[f.name]), default, f.metadata.get("help", "")))
    return out


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(tp, "__name__", str(tp))


def parse_options(options_cls: type, values: dict[str, Any] | None, *, owner: str, strict: bool = False) -> Any:
    """Build ``options_cls`` from ``values``.

    ``strict=False`` (command-line strings): strings are coerced to the declared types.
    ``strict=True`` (config files, Python): each value must already have its declared type.
    """
    from bitpress.selection import short

    if values is not None and not isinstance(values, dict):
        raise OptionError(f"{owner}: options must be a mapping of names to values, got {short(values)}")
    values = dict(values or {})
    hints = typing.get_type_hints(options_cls)
    known = {f.name for f in dataclasses.fields(options_cls)}
    bad_names = [k for k in values if not isinstance(k, str)]
    if bad_names:
        raise OptionError(f"{owner}: option names are strings, got {short(bad_names[0])}")
    unknown = sorted(set(values) - known)
    if unknown:
        valid = ", ".join(sorted(known)) or "(none)"
        named = ", ".join(_did_you_mean(n, known) for n in unknown[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise OptionError(
            f"{owner}: unknown option(s) {named}; valid options: {valid} (see `bitpress passes show {owner}`)"
        )
    kwargs = {}
    for key, value in values.items():
        value = olive_single(value, hints[key], key, owner)
        try:
            kwargs[key] = coerce(value, hints[key], strict=strict)
        except (TypeError, ValueError, RecursionError) as exc:
            raise OptionError(
                f"{owner}: option {key}={short(value)} is not a valid {_type_name(hints[key])}: "
                f"{_one_line(exc) if not isinstance(exc, RecursionError) else 'nested too deeply'}"
            ) from None
    try:
        instance = options_cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise OptionError(f"{owner}: {exc}") from None
    validate_options(instance, owner=owner)
    return instance


def _scalar_type(tp: Any) -> bool:
    """Whether ``tp`` takes one value (a number, string, bool or choice, optionally None), not a list or mapping."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return all(_scalar_type(a) for a in get_args(tp) if a is not type(None))
    return origin is Literal or tp in (int, float, str, bool)


def olive_single(value: Any, tp: Any, key: str, owner: str) -> Any:
    """A one-element list for an option that takes one value, as Olive writes searchable options
    (``calibration_sampling_size: [8]``), read as that value; several values are refused (Olive searches
    them; bitpress runs one configuration: ``bitpress sweep`` runs several)."""
    if not isinstance(value, list) or not _scalar_type(tp):
        return value
    if len(value) == 1:
        return value[0]
    from bitpress.selection import short

    raise OptionError(f"{owner}: option {key}={short(value)} lists {len(value)} values (Olive's search space); "
                      f"bitpress runs one configuration: give one value, or compare several with `bitpress sweep`")


def validators(options_cls: type) -> list[Any]:
    """The ``validate`` attributes defined along ``options_cls``'s MRO, base classes first, each once."""
    found: list[Any] = []
    for klass in reversed(options_cls.__mro__):
        check = klass.__dict__.get("validate")
        if check is not None and not any(check is seen for seen in found):
            found.append(check)
    return found


def validate_options(instance: Any, *, owner: str) -> None:
    """Run the cross-field checks of ``instance``: the ``validate()`` of every class in its MRO.

    Base classes come first and each runs on its own, so a subclass's ``validate()`` adds checks
    but can never drop those of the classes it extends (the host's ``WeightOnlyOptions`` among
    them), whether or not it calls ``super().validate()`` (calling it only repeats a check).
    A ``ValueError`` or ``TypeError`` raised by a check is the user's mistake: it becomes an
    :class:`OptionError` (exit code 2) naming ``owner``; bitpress errors pass through unchanged.
    """
    cls = type(instance)
    for check in validators(cls):
        bound = check.__get__(instance, cls) if hasattr(check, "__get__") else check
        if not callable(bound):
            continue
        try:
            bound()
        except (TypeError, ValueError) as exc:
            raise OptionError(f"{owner}: {_one_line(exc)}") from None


def _one_line(exc: BaseException, limit: int = 1000) -> str:
    text = " ".join(str(exc).split())
    if len(text) > limit:  # a check that formatted a huge user value: the line stays readable
        text = text[:limit] + "..."
    return text or type(exc).__name__


def _did_you_mean(name: str, known: set[str]) -> str:
    """``name``, followed by ``(did you mean block_size?)`` when a known option is close to it."""
    import difflib

    if len(name) > 80:  # no name of that length is close to an option's; never print it whole
        return f"{name[:40]}... ({len(name)} characters)"
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f"{name} (did you mean {close[0]}?)" if close else name


def coerce(value: Any, tp: Any, *, strict: bool = False) -> Any:
    """Convert ``value`` to type ``tp`` or raise ValueError/TypeError.

    ``strict``: no conversion from strings (nor between bools and numbers); the value must be
    JSON-typed as ``tp`` says: an int for ``int``, an int or float for ``float``, a bool for
    ``bool``, one of the choices (of the same type) for a ``Literal``, lists / mappings of such.
    """
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        is_none = value is None or (
            not strict and isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, strict=strict)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise ValueError("; ".join(dict.fromkeys(errors)) + (" (or null)" if type(None) in args else ""))
    if origin is Literal:
        choices = get_args(tp)
        for choice in choices:
            if type(value) is type(choice) and value == choice:
                return choice
            if not strict and (value == choice or (isinstance(value, str) and str(choice) == value)):
                return choice
        raise ValueError(f"expected one of {', '.join(_json_name(c) for c in choices)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if not strict and isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if not strict and isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        words = ("1", "true", "yes", "on", "0", "false", "no", "off")
        raise ValueError("expected true or false" + _found(value, strict, str(value).lower() in words))
    if tp is int:
        if isinstance(value, bool):
            raise TypeError("expected an integer, got a boolean")
        if isinstance(value, int):
            return value
        if not strict and isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        raise ValueError("expected an integer" + _found(value, strict, str(value).strip().lstrip("-").isdigit()))
    if tp is float:
        if isinstance(value, bool):
            raise TypeError("expected a number, got a boolean")
        if isinstance(value, int | float):
            return float(value)
        if strict or not isinstance(value, str):
            raise ValueError("expected a number" + _found(value, strict, _is_number(value)))
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {_json_type(value)}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = get_args(tp) or (Any,)
        if isinstance(value, str) and not strict:
            value = _parse_json(value) if value.strip().startswith("[") else [
                v for v in (s.strip() for s in value.split(",")) if v
            ]
        if not isinstance(value, list | tuple):
            raise TypeError(f"expected a list, got {_json_type(value)}")
        items = [_item(i, v, item_tp, strict) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        key_tp, val_tp = get_args(tp) or (Any, Any)
        if isinstance(value, str) and not strict:
            value = _parse_json(value)
        if not isinstance(value, dict):
            raise TypeError(f"expected a mapping (JSON object), got {_json_type(value)}")
        return {_item(k, k, key_tp, strict, key=True): _item(k, v, val_tp, strict) for k, v in value.items()}
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise TypeError(f"unsupported option type {tp!r}")


def _item(where: Any, value: Any, tp: Any, strict: bool, *, key: bool = False) -> Any:
    """One item of a list or mapping, its position or key named in the error."""
    from bitpress.selection import short

    try:
        return coerce(value, tp, strict=strict)
    except (TypeError, ValueError) as exc:
        what = f"key {short(where, 40)}" if key else f"[{short(where, 40)}]"
        raise ValueError(f"{what}: {exc}") from None


def _found(value: Any, strict: bool, quoted: bool = False) -> str:
    """What a strict check got instead; ``quoted``: a string that the command line would have parsed."""
    from bitpress.selection import short

    if not strict:
        return ""
    if isinstance(value, str):
        hint = " (write it without quotes: only --option on the command line parses strings)" if quoted else ""
        return f", got the string {short(value, 40)}{hint}"
    return f", got {_json_type(value)}"


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return isinstance(value, str)


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             tuple: "a list", dict: "a mapping", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _json_name(choice: Any) -> str:
    """A Literal choice as a config writes it: ``'auto'``, ``true``, ``4``."""
    if isinstance(choice, bool):
        return "true" if choice else "false"
    return repr(choice)


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None


def as_dict(options: Any) -> dict[str, Any]:
    return dataclasses.asdict(options)
