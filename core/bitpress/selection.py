"""Name patterns for choosing nodes and modules: exact names, globs and ``re:`` expressions.

User-supplied regular expressions run against every node name of a model, so they never
backtrack: ``re:`` patterns are compiled with RE2 (the ``google-re2`` package), whose matching
time is linear in the length of the name whatever the pattern (``(a+)+``, ``(.*a){20}`` and
friends included). Full-match semantics, as :func:`re.fullmatch`.

What RE2 cannot express is refused with a usage error that names the pattern and says why:
backreferences (``\\1``, ``(?P=name)``), lookahead and lookbehind (``(?=``, ``(?!``, ``(?<=``,
``(?<!``), atomic groups and possessive quantifiers (``(?>...)``, ``a++``), repetition counts over
1000 (``{1,1001}``), conditionals and comments. ``\\w``, ``\\d``, ``\\s`` and ``\\b`` are ASCII in RE2
(``\\pL`` is any letter); ``\\Z`` is spelt ``\\z``.
"""

from __future__ import annotations

import fnmatch
import re
import reprlib
from collections.abc import Iterable
from typing import Any, Protocol

from bitpress.errors import OptionError

MAX_PATTERN_LENGTH = 512
#: RE2's limit on one counted repetition ``{n,m}``
MAX_REPEAT = 1000


class Regex(Protocol):
    """A compiled pattern: what :func:`compile_regex` returns (an RE2 regular expression)."""

    def fullmatch(self, text: str) -> Any: ...


def _re2() -> Any:
    try:
        import re2  # google-re2: linear-time matching, no backtracking
    except ImportError:  # pragma: no cover - a declared dependency of the host
        raise OptionError(
            "re: patterns need the google-re2 package (linear-time regular expressions): pip install google-re2"
        ) from None
    return re2


_OPTIONS: Any = None
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 8, 8, 8, 8
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 40


def _options() -> Any:
    global _OPTIONS
    if _OPTIONS is None:
        re2 = _re2()
        opts = re2.Options()
        opts.log_errors = False  # RE2 would print its parse errors to stderr: ours are the messages
        opts.never_capture = True  # only match / no match is needed: the DFA alone can answer
        _OPTIONS = opts
    return _OPTIONS


#: RE2's ``invalid perl operator`` messages, by the group they name
_OPERATORS = {
    "(?=": "a lookahead ((?=...))", "(?!": "a negative lookahead ((?!...))",
    "(?<=": "a lookbehind ((?<=...))", "(?<!": "a negative lookbehind ((?<!...))",
    "(?>": "an atomic group ((?>...))", "(?(": "a conditional ((?(1)...|...))", "(?#": "a comment ((?#...))",
}
_BACKTRACKING = (", which RE2 cannot express: bitpress matches re: patterns in linear time, without backtracking; "
                 "rewrite the pattern without it")


def _why(pattern: str, message: str) -> str:
    """Why RE2 refused ``pattern``, in words a user can act on (``message``: RE2's own)."""
    head, _, detail = message.partition(": ")
    if head == "invalid escape sequence" and re.fullmatch(r"\\[1-9]", detail):
        return f"uses a backreference ({detail}){_BACKTRACKING}"
    if head == "invalid escape sequence" and detail in ("\\k", "\\g"):
        return f"uses a named backreference ({detail}<name>){_BACKTRACKING}"
    if head == "invalid escape sequence" and detail == "\\Z":
        return "uses \\Z: RE2 spells the end of the text \\z (full matches need neither)"
    if head == "invalid perl operator":
        if detail == "(?P" and "(?P=" in pattern:
            return f"uses a named backreference ((?P=name)){_BACKTRACKING}"
        if detail in _OPERATORS:
            return f"uses {_OPERATORS[detail]}{_BACKTRACKING}"
        return f"is not a valid regular expression for RE2: {message} (RE2 takes the flags (?i), (?m), (?s), (?U))"
    if head == "bad repetition operator" and detail.endswith("+") and len(detail) > 1:
        return f"uses a possessive quantifier ({detail}){_BACKTRACKING}"
    if head == "invalid repetition size":
        return (f"repeats more than RE2 allows ({detail}): a count is at most {MAX_REPEAT}, nested counts "
                "multiplied included")
    if "too large" in message or "too big" in message:
        return "is too large once compiled (nested counted repetitions?); simplify it"
    return f"is not a valid regular expression: {message}"


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to about ``limit`` characters: user values in messages stay bounded.

    Containers are shown a few items and levels deep (:mod:`reprlib`), so neither a huge list nor a
    structure that shares itself (YAML aliases) is ever walked whole.
    """
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value)} characters)"
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def compile_regex(pattern: str, *, what: str = "pattern") -> Regex:
    """Compile a user regular expression with RE2 (linear-time full matches), or refuse it clearly."""
    if not isinstance(pattern, str):
        raise OptionError(f"{what} must be a string, got {short(pattern)}")
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise OptionError(f"{what} {short(pattern, 40)} is longer than {MAX_PATTERN_LENGTH} characters")
    re2 = _re2()
    try:
        return re2.compile(pattern, _options())
    except re2.error as exc:
        raw = exc.args[0] if exc.args else ""
        message = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        message = " ".join(message.split())
        raise OptionError(f"{what} {short('re:' + pattern)} {_why(pattern, message)}") from None


class NameMatcher:
    """Matches names against a list of patterns: ``re:REGEX`` (full match), globs, exact names."""

    def __init__(self, patterns: Iterable[str], *, what: str = "pattern") -> None:
        self.patterns = list(patterns)
        self._compiled: list[tuple[str, object]] = []
        for p in self.patterns:
            if not isinstance(p, str):
                raise OptionError(f"{what} entries must be strings, got {short(p)}")
            if p.startswith("re:"):
                self._compiled.append(("re", compile_regex(p[3:], what=what)))
            elif any(ch in p for ch in "*?["):
                self._compiled.append(("glob", p))
            else:
                self._compiled.append(("exact", p))

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def first(self, *names: str) -> str | None:
        """The first pattern (in the user's order) that matches any of ``names``."""
        for raw, (kind, pat) in zip(self.patterns, self._compiled, strict=True):
            for name in names:
                if name and _hit(kind, pat, name):
                    return raw
        return None

    def matches(self, *names: str) -> bool:
        return self.first(*names) is not None

    def unmatched(self, names: Iterable[str]) -> list[str]:
        """The patterns (in the user's order) that match none of ``names``: typos, usually."""
        names = [n for n in names if n]
        return [
            raw for raw, (kind, pat) in zip(self.patterns, self._compiled, strict=True)
            if not any(_hit(kind, pat, n) for n in names)
        ]


def _hit(kind: str, pat: object, name: str) -> bool:
    return bool(
        (kind == "exact" and name == pat)
        or (kind == "glob" and fnmatch.fnmatchcase(name, pat))  # type: ignore[arg-type]
        or (kind == "re" and pat.fullmatch(name))  # type: ignore[union-attr]
    )
