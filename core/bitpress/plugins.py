"""Plugin discovery: entry points in the group ``bitpress``, loaded one by one.

A plugin that fails to import, or whose hooks raise while registering, never breaks the host:
it is recorded as broken with the reason and the others load normally. Whatever a plugin
raises later (loading or saving a model, in a pass, in a hook wrapper: any ``Exception``, but
also ``SystemExit``, ``GeneratorExit`` or a custom ``BaseException``) becomes a
:class:`bitpress.errors.PluginError` naming the plugin and what it was doing, so a plugin can
never end the host with an exit code of its own (see :func:`guard` and :func:`check_result`).
Only interrupts (``KeyboardInterrupt``, and with it :class:`bitpress.errors.Interrupted`) and
the host's own errors pass through unchanged.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.metadata as md
import inspect
import logging
import traceback
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from bitpress import crashwatch, hookspecs, plugin_probe
from bitpress.errors import PassNotFoundError, PassUnavailableError, PluginError
from bitpress.models.base import ModelHandle
from bitpress.passes import Pass, check_pass_class
from bitpress.plugin_faults import describe_fault, guard, passes_through, plugin_fault  # noqa: F401 (names kept here too)

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "bitpress"
#: the plugin name of the host's own passes (``bitpress passes list`` shows it)
HOST_PLUGIN = "bitpress"


def _guard_availability(cls: type[Pass]) -> None:
    """Make a plugin's ``unavailable_reason()`` that raises report the fault as the reason.

    ``passes list`` asks every pass; a plugin's faulty check must not stop the listing.
    """
    func = cls.unavailable_reason.__func__  # type: ignore[attr-defined]
    if getattr(func, "_bitpress_guarded", False):
        return

    def guarded(c: type[Pass]) -> str | None:
        try:
            return func(c)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit and custom BaseExceptions too
            return f"its availability check failed: {type(exc).__name__}: {exc}"

    guarded._bitpress_guarded = True  # type: ignore[attr-defined]
    cls.unavailable_reason = classmethod(guarded)  # type: ignore[method-assign,assignment]


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


# -- plugin faults -------------------------------------------------------------------------------
def _hook_action(hook: str, argnames: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    values = {**dict(zip(argnames, args, strict=False)), **kwargs}
    if hook == "bitpress_load_model":
        return f"while loading {values.get('source')} (its bitpress_load_model hook)"
    if hook == "bitpress_save_model":
        model = values.get("model")
        return f"while saving the {getattr(model, 'kind', '?')} model (its bitpress_save_model hook)"
    if hook == "bitpress_run_pass":
        return f"in its bitpress_run_pass hook, around pass {getattr(values.get('pass_'), 'name', '?')}"
    return f"in its {hook} hook"


def _guarded(function: Callable[..., Any], plugin: str, hook: str, argnames: tuple[str, ...]) -> Callable[..., Any]:
    """``function`` (a plugin's hook implementation) with its faults turned into :class:`PluginError`."""
    if inspect.isgeneratorfunction(function):  # a hook wrapper (wrapper=True or hookwrapper=True)
        return _guarded_wrapper(function, plugin, hook, argnames)

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            with crashwatch.plugin_code(plugin, _hook_action(hook, argnames, args, kwargs)):
                return function(*args, **kwargs)
        except BaseException as exc:
            if passes_through(exc):
                raise
            raise plugin_fault(plugin, _hook_action(hook, argnames, args, kwargs), exc) from exc

    return call


def _guarded_wrapper(
    function: Callable[..., Generator[Any, Any, Any]], plugin: str, hook: str, argnames: tuple[str, ...],
) -> Callable[..., Generator[Any, Any, Any]]:
    """A generator driving the plugin's wrapper: what the wrapper raises itself is its fault; what
    the call it wraps raised (thrown into it by pluggy) and the wrapper lets through is not."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        action = _hook_action(hook, argnames, args, kwargs)

        def fault(exc: BaseException) -> PluginError:
            return plugin_fault(plugin, action, exc)

        def watched() -> contextlib.AbstractContextManager[None]:
            return crashwatch.plugin_code(plugin, action)  # the wrapper's own code, not the call it wraps

        try:
            with watched():
                inner = function(*args, **kwargs)
                value = next(inner)
        except StopIteration:
            raise fault(RuntimeError("the hook wrapper did not yield")) from None
        except BaseException as exc:
            if passes_through(exc):
                raise
            raise fault(exc) from exc
        while True:
            try:
                sent = yield value
            except GeneratorExit:  # closed by pluggy: close the plugin's generator too
                inner.close()
                raise
            except BaseException as thrown:  # the wrapped call failed: the wrapper may handle it
                try:
                    with watched():
                        value = inner.throw(thrown)
                except StopIteration as stop:
                    return stop.value
                except BaseException as exc:
                    if exc is thrown or passes_through(exc):
                        raise
                    raise fault(exc) from exc
            else:
                try:
                    with watched():
                        value = inner.send(sent)
                except StopIteration as stop:
                    return stop.value
                except BaseException as exc:
                    if passes_through(exc):
                        raise
                    raise fault(exc) from exc

    return call


def _missing_file(model: ModelHandle) -> str | None:
    """A file ``model`` still reads from that is gone (external data, the lazily read .onnx), or None."""
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.tensors import external_ref, is_external, iter_tensors

    if isinstance(model, OnnxModel):
        seen: set[str] = set()
        for tensor in iter_tensors(model.proto):
            if not is_external(tensor):
                continue
            location = external_ref(tensor).location
            if location in seen:
                continue
            seen.add(location)
            path = model.resolver.path(tensor)[0]
            if not path.is_file():
                return str(path)
        return None
    source = getattr(model, "source", None)
    if source is not None and not Path(source).exists():
        return str(source)
    return None


def check_result(pass_: Pass, result: Any, label: str | None = None) -> ModelHandle:
    """``result`` if it is a usable model handle for what ``pass_`` returned, else a :class:`PluginError`.

    A pass that returns ``None``, something that is not a model handle, or a handle whose
    files are gone (a scratch file it deleted) has failed, whatever it meant to do.
    """
    where = f"{label}: " if label else ""
    who = f"{where}pass {pass_.name} (plugin {getattr(pass_, 'plugin', '?')})"
    if result is None:
        raise PluginError(f"{who} returned no model (None); it must return the model it made")
    if not isinstance(result, ModelHandle):
        raise PluginError(f"{who} returned a {type(result).__name__}, not a model handle (bitpress.models.ModelHandle)")
    missing = _missing_file(result)
    if missing:
        raise PluginError(f"{who} returned a model whose file {missing} is missing")
    return result


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
        #: alias -> pass name
        self.aliases: dict[str, str] = {}
        from bitpress import builtin
        from bitpress.envs import remote

        self.pm.register(builtin, name="bitpress.builtin")
        # runs proxies and passes pinned to a plugin environment; returns None for all others
        self.pm.register(remote, name="bitpress.envs")
        if entry_points:
            self._add_host_passes(builtin)  # first: a plugin cannot take their names
            eps = list(md.entry_points(group=ENTRY_POINT_GROUP))
            # plugins whose import crashes the process (abort, segfault) are known from a child: never imported here
            crashed = plugin_probe.crashed_plugins(eps)
            for i, ep in enumerate(eps):
                self._load_entry_point(ep, crashed.get(i))
            # passes that cannot run here but can in a plugin environment (bitpress env create)
            remote.add_env_passes(self)

    # -- loading ---------------------------------------------------------------------------
    def _add_host_passes(self, module: ModuleType) -> None:
        """The host's own passes (``bitpress.builtin``'s ``bitpress_register_passes``), listed as plugin ``bitpress``.

        Host code: not fault-guarded, and not in :attr:`plugins` (``bitpress plugins`` lists installed plugins).
        """
        collected: list[type[Pass]] = []
        module.bitpress_register_passes(register=collected.append)
        for cls in collected:
            check_pass_class(cls)
            cls.plugin = HOST_PLUGIN
            self.passes[cls.name] = cls

    def _load_entry_point(self, ep: md.EntryPoint, crash: plugin_probe.Crash | None = None) -> None:
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
        if crash is not None:
            info.error, info.detail = crash.reason, crash.detail or None
            log.warning("plugin %s is broken and was skipped: %s", info.name, info.error)
            log.debug("plugin %s, as its check process died:\n%s", info.name, info.detail)  # shown with --verbose
            return
        try:
            with crashwatch.plugin_code(ep.name, "while it was imported"):
                plugin = ep.load()
        except BaseException as exc:  # SystemExit, GeneratorExit and custom BaseExceptions too
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._mark_broken(info, exc, "at import")
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
                    with crashwatch.plugin_code(name, "while registering its passes"):
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
            aliases = self._check_aliases(unique.values())
            for cls in unique.values():
                cls.plugin = name
                _guard_availability(cls)
                self.passes[cls.name] = cls
                info.passes.append(cls.name)
            self.aliases.update(aliases)
            self._guard_hooks(plugin, name)
        except BaseException as exc:  # SystemExit, GeneratorExit and custom BaseExceptions too
            if isinstance(exc, KeyboardInterrupt):
                raise
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            for pname in info.passes:
                self.passes.pop(pname, None)
            self.aliases = {a: n for a, n in self.aliases.items() if n not in info.passes}
            info.passes.clear()
            self._mark_broken(info, exc, "while registering its passes")

    def _check_aliases(self, classes: Iterable[type[Pass]]) -> dict[str, str]:
        """alias -> pass name for ``classes``; TypeError when one equals a known pass name or alias.

        Names are compared exactly (Olive's ``Rtn`` may alias another pass than ``rtn``); lookups
        try exact names and aliases before case-insensitive ones.
        """
        taken = {n: f"pass {n!r}" for n in self.passes}
        taken.update({a: f"an alias of pass {n!r}" for a, n in self.aliases.items()})
        new: dict[str, str] = {}
        for cls in classes:
            taken.setdefault(cls.name, f"pass {cls.name!r}")
        for cls in classes:
            for alias in cls.aliases:
                key = alias
                other = new.get(key)
                if other is not None and other != cls.name:
                    raise TypeError(f"alias {alias!r} of pass {cls.name!r} is also an alias of pass {other!r}")
                if key in taken and taken[key] not in (f"pass {cls.name!r}", f"an alias of pass {cls.name!r}"):
                    raise TypeError(f"alias {alias!r} of pass {cls.name!r} is already {taken[key]}")
                new[key] = cls.name
        return new

    def _guard_hooks(self, plugin: Any, name: str) -> None:
        """Wrap the plugin's hook implementations (loading, saving, pass wrappers) in fault guards.

        ``bitpress_register_passes`` has been called already, inside :meth:`register`'s own guard.
        """
        for caller in self.pm.get_hookcallers(plugin) or []:
            if caller.name == "bitpress_register_passes":
                continue
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin and not getattr(impl.function, "_bitpress_guarded", False):
                    guarded = _guarded(impl.function, name, caller.name, tuple(impl.argnames))
                    guarded._bitpress_guarded = True  # type: ignore[attr-defined]
                    impl.function = guarded  # type: ignore[misc]  # pluggy calls impl.function

    def _mark_broken(self, info: PluginInfo, exc: BaseException, stage: str = "") -> None:
        text = " ".join(str(exc).split())
        if isinstance(exc, SystemExit):
            text = f"sys.exit({exc.code!r})" if not isinstance(exc.code, str) else text
        info.error = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        if stage:
            info.error += f" ({stage})"
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
        if cls is None and name in self.aliases:
            cls = self.passes.get(self.aliases[name])
        if cls is None:
            key = str(name).casefold()
            cls = next((c for n, c in self.passes.items() if n.casefold() == key), None)
            if cls is None:
                alias = next((a for a in self.aliases if a.casefold() == key), None)
                cls = self.passes.get(self.aliases[alias]) if alias is not None else None
        return cls

    def check_not_broken(self, name: str, what: str = "pass") -> None:
        """Raise :class:`PassUnavailableError` when ``name`` is unknown but names a broken plugin.

        A plugin's passes are usually named after it; when it failed to import or register, the
        user asked for something that exists but cannot run (exit code 1), not for a typo.
        """
        key = str(name).casefold()
        info = next((p for p in self.broken() if p.name.casefold() == key), None)
        if info is None:
            return
        dist = f" ({info.distribution} {info.version})" if info.distribution else ""
        raise PassUnavailableError(
            f"{what} {name!r} is unavailable: plugin {info.name}{dist} failed to load ({info.error}); "
            "fix or uninstall it (see `bitpress plugins`)"
        )

    def pass_named(self, name: str) -> type[Pass]:
        """:meth:`find_pass`, raising "no pass named ...; did you mean ...?" when there is none."""
        cls = self.find_pass(name)
        if cls is None:
            self.check_not_broken(name)
            raise _not_found(f"no pass named {name!r}{did_you_mean(name, [*self.passes, *self._alias_names()])} "
                             "(see `bitpress passes list`)"
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
                   if algo in (a.casefold() for a in c.algorithms) or c.name.casefold() == algo
                   or algo in (a.casefold() for a in c.aliases)]
        if not by_algo:
            self.check_not_broken(algorithm, "algorithm")
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
                choose = (f"choose one of {', '.join(precs)}{did_you_mean(precision, precs)}" if precs
                          else "it takes no precision (leave --precision out)")
                raise _not_found(
                    f"algorithm {algorithm!r} does not offer precision {precision!r}; {choose}", "precision"
                )
            cands = with_prec
        usable = [c for c in cands if c.unavailable_reason() is None]
        if not usable:
            c = cands[0]
            raise PassUnavailableError(
                f"pass {c.name!r} (plugin {c.plugin}) is unavailable: {c.unavailable_reason()}"
            )
        # prefer the pass named after the algorithm (or aliased so), then registration order
        usable.sort(key=lambda c: (c.name.casefold() != algo, algo not in (a.casefold() for a in c.aliases)))
        return usable[0]

    def _alias_names(self) -> list[str]:
        return [a for c in self.passes.values() for a in c.aliases]

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
