"""Typed pass options: dataclasses whose fields carry defaults and help.

A pass declares ``Options`` as a dataclass; each field's ``metadata["help"]`` explains it.
:func:`parse_options` turns user input (JSON values, or strings from ``--option k=v``) into an
instance, failing before any work on unknown keys or values of the wrong type. Cross-field
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


def parse_options(options_cls: type, values: dict[str, Any] | None, *, owner: str) -> Any:
    """Build ``options_cls`` from ``values``; strings are coerced to the declared types."""
    values = dict(values or {})
    hints = typing.get_type_hints(options_cls)
    known = {f.name for f in dataclasses.fields(options_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        valid = ", ".join(sorted(known)) or "(none)"
        raise OptionError(
            f"{owner}: unknown option(s) {', '.join(_did_you_mean(n, known) for n in unknown)}; valid options: {valid}"
            f" (see `bitpress passes show {owner}`)"
        )
    kwargs = {}
    for key, value in values.items():
        try:
            kwargs[key] = coerce(value, hints[key])
        except (TypeError, ValueError) as exc:
            raise OptionError(
                f"{owner}: option {key}={value!r} is not a valid {_type_name(hints[key])}: {exc}"
            ) from None
    try:
        instance = options_cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise OptionError(f"{owner}: {exc}") from None
    validate_options(instance, owner=owner)
    return instance


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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _did_you_mean(name: str, known: set[str]) -> str:
    """``name``, followed by ``(did you mean block_size?)`` when a known option is close to it."""
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f"{name} (did you mean {close[0]}?)" if close else name


def coerce(value: Any, tp: Any) -> Any:
    """Convert ``value`` to type ``tp`` or raise ValueError/TypeError."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise ValueError("; ".join(errors))
    if origin is Literal:
        choices = get_args(tp)
        for choice in choices:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise ValueError(f"expected one of {', '.join(repr(c) for c in choices)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise TypeError("expected an integer, got a boolean")
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        raise ValueError("expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise TypeError("expected a number, got a boolean")
        if isinstance(value, int | float):
            return float(value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {type(value).__name__}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = get_args(tp) or (Any,)
        if isinstance(value, str):
            value = _parse_json(value) if value.strip().startswith("[") else [
                v for v in (s.strip() for s in value.split(",")) if v
            ]
        if not isinstance(value, list | tuple):
            raise TypeError("expected a list")
        items = [coerce(v, item_tp) for v in value]
        return items if origin is list else tuple(items)
    if origin is dict:
        key_tp, val_tp = get_args(tp) or (Any, Any)
        if isinstance(value, str):
            value = _parse_json(value)
        if not isinstance(value, dict):
            raise TypeError("expected a mapping (JSON object)")
        return {coerce(k, key_tp): coerce(v, val_tp) for k, v in value.items()}
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise TypeError(f"unsupported option type {tp!r}")


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None


def as_dict(options: Any) -> dict[str, Any]:
    return dataclasses.asdict(options)
