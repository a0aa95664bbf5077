"""The one exception family of bitpress.

Every error a user can cause derives from :class:`BitpressError` and carries a message that
says what was wrong and how to fix it. The CLI prints that message on one line (no
traceback unless ``--verbose``) and exits with the class's ``exit_code``.
"""

from __future__ import annotations


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
