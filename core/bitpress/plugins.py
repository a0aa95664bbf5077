"""Plugin discovery: entry points in the group ``bitpress``, loaded one by one.

A plugin that fails to import, or whose hooks raise while registering, never breaks the host:
it is recorded as broken with the reason and the others load normally.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import logging
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pluggy

from bitpress import hookspecs
from bitpress.errors import PassNotFoundError, PassUnavailableError
from bitpress.passes import Pass, check_pass_class

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "bitpress"


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` (or ``'x' or 'y'``) for the choices close to ``name``, else ``""``.

    Case-insensitive: ``RNT`` suggests ``rtn``; the suggestion is spelled as the choice is.
    """
    by_key: dict[str, str] = {}
    for c in choices:
        by_key.setdefault(str(c).casefold(), str(c))
    close = difflib.get_close_matches(str(name).casefold(), list(by_key), n=3, cutoff=0.6)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(by_key[c]) for c in close) + "?"


def _not_found(message: str, key: str) -> PassNotFoundError:
    """A :class:`PassNotFoundError` that records which setting was wrong (``type``, ``precision``)."""
    exc = PassNotFoundError(message)
    exc.key = key  # type: ignore[attr-defined]  # read by the config loader to name the key
    return exc


@dataclass
class PluginInfo:
    name: str
    distribution: str | None
    version: str | None
    module: str
    error: str | None = None  # set when broken
    detail: str | None = None  # traceback of the failure, for --verbose
    passes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


class Registry:
    """The loaded plugins and the passes they registered."""

    def __init__(self, *, entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager("bitpress")
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.passes: dict[str, type[Pass]] = {}
        from bitpress import builtin
        from bitpress.envs import remote

        self.pm.register(builtin, name="bitpress.builtin")
        # runs proxies and passes pinned to a plugin environment; returns None for all others
        self.pm.register(remote, name="bitpress.envs")
        if entry_points:
            for ep in md.entry_points(group=ENTRY_POINT_GROUP):
                self._load_entry_point(ep)
            # passes that cannot run here but can in a plugin environment (bitpress env create)
            remote.add_env_passes(self)

    # -- loading ---------------------------------------------------------------------------
    def _load_entry_point(self, ep: md.EntryPoint) -> None:
        dist = getattr(ep, "dist", None)
        info = PluginInfo(
            name=ep.name,
            distribution=dist.metadata["Name"] if dist is not None else None,
            version=dist.version if dist is not None else None,
            module=ep.value,
        )
        if ep.name in self.plugins:
            info.error = f"duplicate plugin name {ep.name!r} (also from {self.plugins[ep.name].distribution})"
            self.plugins[f"{ep.name} ({info.distribution})"] = info
            return
        self.plugins[ep.name] = info
        try:
            plugin = ep.load()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._mark_broken(info, exc)
            return
        self.register(plugin, name=ep.name, info=info)

    def register(self, plugin: ModuleType | Any, *, name: str, info: PluginInfo | None = None) -> None:
        """Register a plugin object (used for entry points and, in tests, directly)."""
        if info is None:
            info = PluginInfo(name=name, distribution=None, version=None, module=repr(plugin))
            self.plugins[name] = info
        try:
            self.pm.register(plugin, name=name)
            collected: list[type[Pass]] = []
            # call only this plugin's implementation so one plugin's error stays its own
            for impl in self.pm.hook.bitpress_register_passes.get_hookimpls():
                if impl.plugin is plugin:
                    impl.function(register=collected.append)
            unique: dict[str, type[Pass]] = {}
            for cls in collected:
                check_pass_class(cls)
                # two classes under one name within this plugin would silently shadow each other
                if cls.name in unique and unique[cls.name] is not cls:
                    raise TypeError(f"pass name {cls.name!r} registered twice by this plugin")
                if cls.name in self.passes and self.passes[cls.name] is not cls:
                    raise TypeError(
                        f"pass name {cls.name!r} already registered by plugin "
                        f"{self.passes[cls.name].plugin!r}"
                    )
                unique[cls.name] = cls
            for cls in unique.values():
                cls.plugin = name
                self.passes[cls.name] = cls
                info.passes.append(cls.name)
        except Exception as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            for pname in info.passes:
                self.passes.pop(pname, None)
            info.passes.clear()
            self._mark_broken(info, exc)

    def _mark_broken(self, info: PluginInfo, exc: BaseException) -> None:
        info.error = f"{type(exc).__name__}: {exc}"
        info.detail = "".join(traceback.format_exception(exc))
        log.warning("plugin %s is broken and was skipped: %s", info.name, info.error)
        log.debug("plugin %s failed with:\n%s", info.name, info.detail)  # shown with --verbose

    # -- queries -----------------------------------------------------------------------------
    @property
    def hook(self) -> Any:
        return self.pm.hook

    def broken(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if not p.ok]

    def find_pass(self, name: str) -> type[Pass] | None:
        """The pass class called ``name`` (case-insensitive), usable or not; ``None`` if there is none."""
        cls = self.passes.get(name)
        if cls is None:
            key = str(name).casefold()
            cls = next((c for n, c in self.passes.items() if n.casefold() == key), None)
        return cls

    def pass_named(self, name: str) -> type[Pass]:
        """:meth:`find_pass`, raising "no pass named ...; did you mean ...?" when there is none."""
        cls = self.find_pass(name)
        if cls is None:
            raise _not_found(f"no pass named {name!r}{did_you_mean(name, self.passes)} (see `bitpress passes list`)"
                             f"{self._hint()}", "type")
        return cls

    def get_pass(self, name: str) -> type[Pass]:
        """The pass class called ``name``; raises with the reason when missing or unusable."""
        cls = self.pass_named(name)
        name = cls.name
        reason = cls.unavailable_reason()
        if reason:
            raise PassUnavailableError(f"pass {name!r} (plugin {cls.plugin}) is unavailable: {reason}")
        return cls

    def select(self, algorithm: str, precision: str | None, model_kind: str) -> type[Pass]:
        """Pick the pass for ``quantize --algorithm --precision`` from declared metadata.

        Algorithm and precision names are case-insensitive (``RTN``, ``INT4``); unknown ones
        fail with the close matches ("did you mean ...?").
        """
        algo = str(algorithm).casefold()
        by_algo = [c for c in self.passes.values()
                   if algo in (a.casefold() for a in c.algorithms) or c.name.casefold() == algo]
        if not by_algo:
            known = sorted({a for c in self.passes.values() for a in c.algorithms})
            hint = did_you_mean(algorithm, [*known, *self.passes])
            raise _not_found(
                f"no installed plugin provides algorithm {algorithm!r}{hint}; known: "
                f"{', '.join(known) or '(none)'}{self._hint()}", "type"
            )
        cands = [c for c in by_algo if model_kind in c.model_kinds]
        if not cands:
            kinds = sorted({k for c in by_algo for k in c.model_kinds})
            raise PassNotFoundError(
                f"algorithm {algorithm!r} does not accept {model_kind} models (it takes: {', '.join(kinds)})"
            )
        if precision is not None:
            prec = str(precision).casefold()
            with_prec = [c for c in cands if prec in (p.casefold() for p in c.precisions)]
            if not with_prec:
                precs = sorted({p for c in cands for p in c.precisions})
                raise _not_found(
                    f"algorithm {algorithm!r} does not offer precision {precision!r}; "
                    f"choose one of {', '.join(precs)}{did_you_mean(precision, precs)}", "precision"
                )
            cands = with_prec
        usable = [c for c in cands if c.unavailable_reason() is None]
        if not usable:
            c = cands[0]
            raise PassUnavailableError(
                f"pass {c.name!r} (plugin {c.plugin}) is unavailable: {c.unavailable_reason()}"
            )
        # prefer the pass named after the algorithm, then registration order
        usable.sort(key=lambda c: c.name.casefold() != algo)
        return usable[0]

    def broken_hint(self) -> str:
        """``". Note: plugin X failed to load (...)"`` when plugins are broken, else ``""``."""
        return self._hint()

    def _hint(self) -> str:
        broken = self.broken()
        if not broken:
            return ""
        items = "; ".join(f"plugin {p.name} failed to load ({p.error})" for p in broken)
        return f". Note: {items}"


def canonical_precision(cls: type[Pass], precision: str | None) -> str | None:
    """``precision`` spelled as ``cls`` declares it (``INT4`` -> ``int4``); unknown names unchanged."""
    if precision is None:
        return None
    key = str(precision).casefold()
    return next((p for p in cls.precisions if p.casefold() == key), precision)


_default: Registry | None = None


def get_registry(*, reload: bool = False) -> Registry:
    """The process-wide registry, built on first use."""
    global _default
    if _default is None or reload:
        _default = Registry()
    return _default
