"""The one exception family of bitpress.

Every error a user can cause derives from :class:`BitpressError` and carries a message that
says what was wrong and how to fix it. The CLI prints that message on one line (no
traceback unless ``--verbose``) and exits with the class's ``exit_code``.
"""

from __future__ import annotations

from collections.abc import Iterable


class BitpressError(Exception):
    """Base class: a failure the user can act on."""

    exit_code = 1


class UsageError(BitpressError):
    """The command or config was malformed (unknown option, bad value, missing argument)."""

    exit_code = 2


class OptionError(UsageError):
    """A pass option is unknown or has the wrong type."""


class ConfigError(UsageError):
    """A workflow config file cannot be used as written."""


class PassNotFoundError(UsageError):
    """No installed plugin provides the requested pass / algorithm / precision."""


class PassUnavailableError(BitpressError):
    """The pass exists but cannot run here (missing dependency, broken plugin)."""


class PluginError(BitpressError):
    """A plugin misbehaved (bad registration, exception inside a hook)."""


class ModelLoadError(BitpressError):
    """The input model cannot be read: not ONNX, truncated, missing or unsafe external data."""


class UnsafePathError(ModelLoadError):
    """A file the input names or holds leaves the model's folder (symbolic link, ``../``, absolute path)."""


class UnsafeExternalDataError(UnsafePathError):
    """An external-data location escapes the model's folder (``../``, absolute paths)."""


class OutputError(BitpressError):
    """The output location cannot be used (exists, equals the input, not writable)."""


class ValidationError(BitpressError):
    """A saved model failed a check that its input passed (checker, ONNX Runtime session)."""


class QuantizationError(BitpressError):
    """A pass could not quantize the model as asked."""


class ExportError(BitpressError):
    """A model cannot be exported as asked, or an exporter (the GenAI builder) failed on it."""


def one_line(exc: BaseException | str, limit: int = 600) -> str:
    """Another library's error text (ONNX Runtime's spans several lines) folded into one bounded line."""
    text = " ".join(str(exc).split())
    if not text:
        return type(exc).__name__ if isinstance(exc, BaseException) else ""
    return text if len(text) <= limit else text[:limit] + "..."


def summarize_names(names: Iterable[str], limit: int = 3) -> str:
    """``"a, b, c and 44 more"``: the first ``limit`` names in the order given (repeats dropped)."""
    unique = list(dict.fromkeys(names))
    shown = ", ".join(unique[:limit])
    return f"{shown} and {len(unique) - limit} more" if len(unique) > limit else shown


def summarize_problems(problems: Iterable[tuple[str, str]], noun: str = "tensors", limit: int = 3) -> str:
    """One sentence per distinct reason, not one per name: ``(name, reason)`` pairs become
    ``"name: reason"`` for a reason given once and ``"47 tensors (a, b, c and 44 more): reason"``
    for one shared by many; sentences in the order their reasons first appear, joined by ``"; "``."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in problems:
        by_reason.setdefault(reason, []).append(name)
    out = []
    for reason, names in by_reason.items():
        unique = list(dict.fromkeys(names))
        if len(unique) == 1:
            out.append(f"{unique[0]}: {reason}")
        else:
            out.append(f"{len(unique)} {noun} ({summarize_names(unique, limit)}): {reason}")
    return "; ".join(out)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal (SIGINT, SIGTERM, SIGHUP): raised in the main thread.

    A :class:`KeyboardInterrupt` (so a ``BaseException``, not an ``Exception``): every ``finally``
    and every ``except KeyboardInterrupt`` cleanup runs as for Ctrl-C. The CLI installs the
    handlers that raise it (:mod:`bitpress.interrupts`) and exits with ``128 + signum``.
    ``written``: set when the signal came while the finished output was being moved into place;
    the move completed, so that output is whole and in place.
    """

    def __init__(self, signum: int, written: object = None) -> None:
        self.signum = int(signum)
        self.written = written
        super().__init__(self.signal_name)

    @property
    def signal_name(self) -> str:
        import signal

        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"
