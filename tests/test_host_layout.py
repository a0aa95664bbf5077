"""The host's layout says what each folder owns and may import, and the code keeps to it (issue 28).

Every folder (package) under core/bitpress has a module docstring that ends with a ``May import:``
paragraph naming the parts of the host (top-level modules and packages of ``bitpress``) its modules
may import, or ``any host module``, or ``nothing else``. The imports are read from the source as
tests/test_import_circles.py reads them (function-level imports count, TYPE_CHECKING ones do not).
A new dependency between folders is a decision: make it in the docstring, where a reader sees it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from test_import_circles import import_graph, source_modules

ROOT = Path(__file__).resolve().parents[1]
HOST = ROOT / "core" / "bitpress"

MAY_IMPORT = re.compile(r"^May import: (.*?)(?:\n\s*\n|\Z)", re.M | re.S)


def packages() -> list[str]:
    return sorted(name for name, (_, is_pkg) in source_modules([HOST]).items() if is_pkg and name != "bitpress")


def declared(text: str) -> set[str] | None:
    """The units a ``May import:`` paragraph names (None: any); words in parentheses are comments."""
    m = MAY_IMPORT.search(text)
    if m is None:
        raise ValueError("no 'May import:' paragraph")
    body = re.sub(r"\([^)]*\)", "", " ".join(m.group(1).split())).strip().rstrip(".")
    if body.startswith("any host module"):
        return None
    if body.startswith("nothing else"):
        return set()
    return {part.strip() for part in body.split(",") if part.strip()}


def used(package: str, graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level unit of the host -> the modules of ``package`` importing it (its own top level excluded)."""
    own_top = package.split(".")[1]
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        if module != package and not module.startswith(package + "."):
            continue
        for dep in deps:
            parts = dep.split(".")
            if len(parts) < 2 or parts[1] == own_top:
                continue
            out.setdefault(parts[1], set()).add(module)
    return out


def test_every_folder_is_a_documented_package() -> None:
    folders = [p for p in HOST.rglob("*") if p.is_dir() and p.name != "__pycache__"
               and "templates" not in p.relative_to(HOST).parts]
    assert folders
    for folder in folders:
        init = folder / "__init__.py"
        assert init.is_file(), f"{folder.relative_to(ROOT)} has no __init__.py to say what it owns"
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and len(doc.split()) >= 8, f"{init.relative_to(ROOT)}: say what the folder owns"
        declared(doc)  # raises without a May import: paragraph


@pytest.mark.parametrize("package", packages())
def test_a_folder_imports_only_what_it_declares(package: str) -> None:
    graph = import_graph([HOST])
    path = source_modules([HOST])[package][0]
    allowed = declared(ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "")
    if allowed is None:
        return
    units = set(source_modules([HOST])) | {"bitpress"}
    unknown = {u for u in allowed if f"bitpress.{u}" not in units}
    assert not unknown, f"{package}'s May import names what the host does not have: {sorted(unknown)}"
    extra = {u: sorted(m) for u, m in used(package, graph).items() if u not in allowed}
    assert not extra, f"{package} imports parts its docstring does not allow: {extra}"


def test_nothing_in_the_host_imports_the_command_line() -> None:
    graph = import_graph([HOST])
    users = sorted(m for m, deps in graph.items() if not m.startswith(("bitpress.cli", "bitpress.__main__"))
                   and any(d == "bitpress.cli" or d.startswith("bitpress.cli.") for d in deps))
    assert not users


def test_the_check_reads_the_paragraph() -> None:
    assert declared("Owns x.\n\nMay import: errors, onnx (helpers),\npaths.\n") == {"errors", "onnx", "paths"}
    assert declared("May import: nothing else of the host (numpy only).") == set()
    assert declared("May import: any host module.") is None
    with pytest.raises(ValueError):
        declared("Owns x.")
    graph = {"bitpress.a": {"bitpress.b.c", "bitpress.a2"}, "bitpress.a.x": {"bitpress.d"},
             "bitpress.b.c": {"bitpress.a"}}
    assert used("bitpress.a", graph) == {"b": {"bitpress.a"}, "a2": {"bitpress.a"}, "d": {"bitpress.a.x"}}
