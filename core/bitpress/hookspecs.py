"""The whole plugin contract of bitpress, documented where it is declared.

A plugin is a module (or object) listed under the entry-point group ``bitpress`` in its
distribution's metadata::

    [project.entry-points.bitpress]
    myplugin = "my_package.plugin"

Inside it, functions decorated with ``hookimpl`` and named like the specs below are called by
the host. All hooks are optional; most plugins implement only :func:`bitpress_register_passes`.
Model handles are ``ModelHandle`` subclasses; passes are ``Pass`` subclasses. A plugin imports
all of these, and everything else of the host it uses, from the public module
:mod:`bitpress.plugin` (docs/writing-a-plugin.md); the rest of ``bitpress`` is internal.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Callable

    from bitpress.models.base import ModelHandle
    from bitpress.passes import Pass, PassContext

hookspec = pluggy.HookspecMarker("bitpress")
hookimpl = pluggy.HookimplMarker("bitpress")


@hookspec
def bitpress_register_passes(register: Callable[[type[Pass]], None]) -> None:
    """Register the plugin's pass classes: call ``register(PassClass)`` once per class.

    Registration must be cheap: do not import heavy dependencies here. A pass whose
    dependencies are missing is still registered and reports why through
    :meth:`bitpress.passes.Pass.unavailable_reason`, so users see it listed as unavailable
    with the install command instead of not seeing it at all.
    """


@hookspec(firstresult=True)
def bitpress_load_model(source: Path, options: dict[str, Any]) -> ModelHandle | None:
    """Turn ``source`` (a file or folder) into a model handle, or return ``None``.

    The first plugin that returns a handle wins; the host's own implementation, tried last,
    reads ``.onnx`` files and ONNX folders (ONNX Runtime GenAI packages). Implement it to add
    a format (GGUF, a framework checkpoint) without touching the host. Raise a
    :class:`bitpress.errors.ModelLoadError` for a source you recognise but cannot read.
    """


@hookspec(firstresult=True)
def bitpress_run_pass(pass_: Pass, model: ModelHandle, context: PassContext) -> ModelHandle | None:
    """Run one pass on one model and return the resulting handle.

    The host's implementation (tried last) calls ``pass_.run(model, context)``. Plugins add
    cross-cutting behaviour around every pass with a wrapper::

        @hookimpl(wrapper=True)
        def bitpress_run_pass(pass_, model, context):
            start = time.perf_counter()
            result = yield          # the pass runs here
            log.info("%s took %.1fs", pass_.name, time.perf_counter() - start)
            return result

    A non-wrapper implementation that returns a handle replaces the execution (for example
    to run the pass in another environment); return ``None`` to let others handle it.
    """


@hookspec(firstresult=True)
def bitpress_save_model(
    model: ModelHandle, destination: Path, options: dict[str, Any]
) -> list[Path] | None:
    """Write ``model`` to ``destination`` and return the files written, or ``None``.

    ``destination`` is inside a private temporary folder that the host moves into place
    once every save and check has succeeded, so an implementation never needs to clean up
    after a failure. The host's implementation (tried last) writes ONNX models and folders.
    """
