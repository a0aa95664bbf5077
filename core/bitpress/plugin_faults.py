"""What plugin code raises, turned into one :class:`~bitpress.errors.PluginError` naming the plugin.

:class:`guard` wraps every call into a plugin (its hooks, its passes: :mod:`bitpress.plugins`
and :mod:`bitpress.builtin` both use it): interrupts and the host's own errors pass through
(:func:`passes_through`), anything else (``SystemExit`` included) becomes a ``PluginError``
saying which plugin failed doing what; a native crash in the block is named by
:mod:`bitpress.crashwatch`. Imports only the errors and the crash watcher.
"""

from __future__ import annotations

from typing import Any

from bitpress import crashwatch
from bitpress.errors import PluginError


def passes_through(exc: BaseException) -> bool:
    """Whether a guard lets ``exc`` through unchanged instead of turning it into a plugin fault.

    Interrupts do (``KeyboardInterrupt``: Ctrl-C, and ``bitpress.errors.Interrupted``, raised
    for the signals the CLI handles), and so do the host's own errors (any class of
    :mod:`bitpress.errors` along its MRO: a :class:`BitpressError` a plugin raises on purpose,
    such as ``ModelLoadError``, is already a clean error). Everything else, ``SystemExit``,
    ``GeneratorExit`` and custom ``BaseException`` subclasses included, is a plugin fault.
    """
    if isinstance(exc, KeyboardInterrupt):
        return True
    return any(klass.__module__ == "bitpress.errors" for klass in type(exc).__mro__)


def describe_fault(exc: BaseException) -> str:
    """What a plugin did, in words: ``it raised SystemExit(3) (sys.exit)``, ``RuntimeError: boom``."""
    if isinstance(exc, SystemExit):
        return f"it raised SystemExit({exc.code!r}) (sys.exit); a plugin must not end the program"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def plugin_fault(plugin: str, action: str, exc: BaseException) -> PluginError:
    """The :class:`PluginError` for ``exc``, raised by plugin ``plugin`` while doing ``action``."""
    error = PluginError(f"plugin {plugin} failed {action}: {describe_fault(exc)}")
    error.plugin = plugin  # type: ignore[attr-defined]
    error.action = action  # type: ignore[attr-defined]
    return error


class guard:  # lower case: used like a function, ``with guard(plugin, "in pass x"):``
    """Turn whatever plugin code raises in the block into a :class:`PluginError` (see :func:`passes_through`)."""

    def __init__(self, plugin: str, action: str) -> None:
        self.plugin, self.action = plugin, action
        self._watch = crashwatch.plugin_code(plugin, action)  # a native crash in the block names the plugin

    def __enter__(self) -> guard:
        self._watch.__enter__()
        return self

    def __exit__(self, tp: Any, exc: BaseException | None, tb: Any) -> bool:
        self._watch.__exit__(None, None, None)
        if exc is None or passes_through(exc):
            return False
        raise plugin_fault(self.plugin, self.action, exc) from exc


__all__ = ["describe_fault", "guard", "passes_through", "plugin_fault"]
