"""``bitpress plugin new NAME``: a working plugin distribution to start from.

The templates under ``templates/`` ship inside the host's wheel; each ``*.tmpl`` file is
rendered by replacing ``{{key}}`` markers (nothing else is special, so the templates stay
readable Python, TOML and Markdown). The result is a distribution ``bitpress-NAME``:
``pyproject.toml`` (hatchling, the entry point in the group ``bitpress``), a weight-only pass
built on the host's block-solver contract in ``src/bitpress_NAME/__init__.py``, a README and a
test that quantizes a tiny synthetic model through the public API. It is written into a
temporary sibling folder and renamed into place, so a failure leaves nothing behind.

May import: errors.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from bitpress.errors import UsageError

TEMPLATES = Path(__file__).resolve().parent / "templates"
#: a plugin name: the entry-point name, the pass and algorithm name, and the module ``bitpress_NAME``
NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_MARKER = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")


@dataclass(frozen=True)
class NewPlugin:
    name: str
    path: Path
    files: list[Path]


def check_plugin_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise UsageError(
            f"{name!r} cannot name a plugin: use a lowercase Python identifier "
            "(a letter, then letters, digits or '_'), e.g. 'mine' or 'my_algo'"
        )
    if name.startswith("bitpress"):
        raise UsageError(f"{name!r}: leave out the 'bitpress' prefix; the distribution is named bitpress-NAME")
    return name


def template_values(name: str) -> dict[str, str]:
    from bitpress import __version__

    major, minor = [*__version__.split("."), "0"][:2]
    return {
        "name": name,
        "module": f"bitpress_{name}",
        "dist": f"bitpress-{name}",
        "klass": "".join(part.capitalize() for part in name.split("_") if part) or name.capitalize(),
        "host_requirement": f"bitpress>={major}.{minor}",
    }


def render(text: str, values: dict[str, str], *, what: str = "template") -> str:
    def one(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in values:
            raise KeyError(f"{what}: unknown marker {{{{{key}}}}}")
        return values[key]

    return _MARKER.sub(one, text)


def _target(template: Path, values: dict[str, str]) -> Path:
    rel = template.relative_to(TEMPLATES)
    parts = [values["module"] if p == "module" else p for p in rel.parts]
    out = Path(*parts)
    return out.with_name(render(out.name.removesuffix(".tmpl"), values, what=str(rel)))


def templates() -> list[Path]:
    return sorted(p for p in TEMPLATES.rglob("*.tmpl") if p.is_file())


def new_plugin(name: str, directory: str | os.PathLike[str] | None = None) -> NewPlugin:
    """Write the plugin ``name`` into ``directory`` (default ``./bitpress-NAME``), which must not
    exist or be an empty folder; returns where and which files."""
    check_plugin_name(name)
    values = template_values(name)
    dest = Path(directory if directory is not None else values["dist"]).expanduser().absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} already exists and is not an empty folder; nothing was written "
                         "(pick another --dir or remove it)")
    if not dest.parent.is_dir():
        raise UsageError(f"the folder {dest.parent} does not exist; create it first")
    tmp = dest.with_name(f".{dest.name}.creating-{uuid.uuid4().hex[:8]}")
    files = []
    try:
        for template in templates():
            target = _target(template, values)
            out = tmp / target
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(render(template.read_text(encoding="utf-8"), values, what=template.name),
                           encoding="utf-8")
            files.append(dest / target)
        if dest.exists():
            dest.rmdir()  # empty, checked above
        os.rename(tmp, dest)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(f"cannot write the plugin to {dest}: {exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return NewPlugin(name, dest, files)


__all__ = ["NAME", "TEMPLATES", "NewPlugin", "check_plugin_name", "new_plugin", "render", "template_values"]
