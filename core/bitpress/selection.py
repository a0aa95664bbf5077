"""Name patterns for choosing nodes and modules: exact names, globs and ``re:`` expressions.

User-supplied regular expressions run against every node name of a model, so they are
checked first: overly long patterns and shapes prone to catastrophic backtracking (a
repetition inside a repetition, like ``(a+)+``) are refused with a clear error.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

try:  # Python 3.11+ keeps the parser here
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_parse  # type: ignore[no-redef]

from bitpress.errors import OptionError

MAX_PATTERN_LENGTH = 512
_REPEATS = {sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, getattr(sre_parse, "POSSESSIVE_REPEAT", None)}


def _has_nested_unbounded(items: Iterable, inside_repeat: bool) -> bool:
    for op, arg in items:
        if op in _REPEATS:
            _lo, hi, body = arg
            unbounded = hi == sre_parse.MAXREPEAT or hi > 100
            if unbounded and inside_repeat:
                return True
            if _has_nested_unbounded(body, inside_repeat or unbounded):
                return True
        elif op is sre_parse.SUBPATTERN:
            if _has_nested_unbounded(arg[-1], inside_repeat):
                return True
        elif op is sre_parse.BRANCH:
            if any(_has_nested_unbounded(b, inside_repeat) for b in arg[1]):
                return True
        elif op in (sre_parse.ASSERT, sre_parse.ASSERT_NOT) and _has_nested_unbounded(arg[1], inside_repeat):
            return True
    return False


def compile_regex(pattern: str, *, what: str = "pattern") -> re.Pattern[str]:
    """Compile a user regular expression after the safety checks above."""
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise OptionError(f"{what} {pattern[:40]!r}... is longer than {MAX_PATTERN_LENGTH} characters")
    try:
        parsed = sre_parse.parse(pattern)
        compiled = re.compile(pattern)
    except re.error as exc:
        raise OptionError(f"{what} {pattern!r} is not a valid regular expression: {exc}") from None
    if _has_nested_unbounded(parsed, False):
        raise OptionError(
            f"{what} {pattern!r} nests a repetition inside a repetition (like (a+)+), which can take "
            "exponential time; rewrite it without the nested quantifier"
        )
    return compiled


class NameMatcher:
    """Matches names against a list of patterns: ``re:REGEX`` (full match), globs, exact names."""

    def __init__(self, patterns: Iterable[str], *, what: str = "pattern") -> None:
        self.patterns = list(patterns)
        self._compiled: list[tuple[str, object]] = []
        for p in self.patterns:
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
                if not name:
                    continue
                if (
                    (kind == "exact" and name == pat)
                    or (kind == "glob" and fnmatch.fnmatchcase(name, pat))  # type: ignore[arg-type]
                    or (kind == "re" and pat.fullmatch(name))  # type: ignore[union-attr]
                ):
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
