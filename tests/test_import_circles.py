"""Import circles in core/bitpress and plugins/, read from the source (issue 28).

Every import counts, at module level or inside a function (a function-level import that only hides
a circle is still one); imports under ``if TYPE_CHECKING:`` do not run and do not count. Importing
``a.b.c`` also runs the packages ``a`` and ``a.b`` (their ``__init__``): that counts too, except for
the importer's own packages (a package importing its own submodules is how packages work). A name
imported from a module that loads its names lazily from an ``_EXPORTS`` table (the plugin API,
:mod:`bitpress.plugin`) is an import of the module the table names for it.

There are none: a module that needs something of a module importing it takes it from a lower one
(see the README's layout), never by hiding the import in a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def repo_roots() -> list[Path]:
    """The host's package and every in-repo plugin's."""
    return [ROOT / "core" / "bitpress", *sorted(p for p in (ROOT / "plugins").glob("*/bitpress_*") if p.is_dir())]


def source_modules(roots: list[Path]) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package) under the package folders ``roots``."""
    out: dict[str, tuple[Path, bool]] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root.parent).with_suffix("")
            parts = list(rel.parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            out[".".join(parts)] = (path, is_pkg)
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def _known_prefix(name: str, known: dict[str, tuple[Path, bool]]) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in known:
            return ".".join(parts[:i])
    return None


def lazy_exports(known: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, str]]:
    """Modules that load their names on first use (PEP 562) from a literal ``_EXPORTS`` table of name ->
    ``"module"`` or ``"module:attribute"`` (:mod:`bitpress.plugin`): module -> {name: the module it loads}.
    ``from bitpress.plugin import X`` runs X's module when X is used, so it is an edge to that module."""
    out: dict[str, dict[str, str]] = {}
    for name, (path, _) in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in tree.body:
            target = node.target if isinstance(node, ast.AnnAssign) else (
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
            if isinstance(target, ast.Name) and target.id == "_EXPORTS" and node.value is not None:
                table = ast.literal_eval(node.value)
                out[name] = {k: v.partition(":")[0] for k, v in table.items()}
    return out


def import_graph(roots: list[Path]) -> dict[str, set[str]]:
    """Module -> the modules under ``roots`` its execution may run (see the module docstring)."""
    known = source_modules(roots)
    lazy = lazy_exports(known)
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skip = _type_checking_nodes(tree)
        package = name if is_pkg else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets.update(t for a in node.names if (t := _known_prefix(a.name, known)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    t = _known_prefix(f"{base}.{a.name}", known) if a.name != "*" else _known_prefix(base, known)
                    if t:
                        targets.add(t)
                    if base in lazy:  # a lazily exported name: its module runs when the name is used
                        names = lazy[base].values() if a.name == "*" else [lazy[base].get(a.name, "")]
                        targets.update(m for n in names if (m := _known_prefix(n, known)))
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        edges: set[str] = set()
        for t in targets:
            parts = t.split(".")
            edges.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in known)
        graph[name] = edges - own
    return graph


def circles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: set[tuple[str, ...]] = set()
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    members.append(m)
                    if m == node:
                        break
                if len(members) > 1:
                    found.add(tuple(sorted(members)))
    return found


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert circles(graph) == {("a", "b", "c"), ("e", "f")}


def test_function_level_package_and_relative_imports_count(tmp_path: Path) -> None:
    pkg = tmp_path / "pk"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pk import c\n")
    (pkg / "a.py").write_text("def f():\n    from pk.b import g  # hidden in a function: still an edge\n")
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pk import a\n")
    (pkg / "d.py").write_text("import pk.sub.e\n")
    (pkg / "sub" / "e.py").write_text("from ..d import x\n")
    graph = import_graph([pkg])
    assert graph["pk.a"] == {"pk.b"} and graph["pk.b"] == {"pk.a"}
    assert graph["pk.c"] == set()  # TYPE_CHECKING imports do not run
    assert graph["pk.d"] == {"pk.sub", "pk.sub.e"}  # importing pk.sub.e runs pk/sub/__init__ too
    assert graph["pk.sub.e"] == {"pk.d"}
    assert circles(graph) == {("pk.a", "pk.b"), ("pk.d", "pk.sub.e")}


def test_names_of_a_lazy_public_module_are_edges_to_where_they_live(tmp_path: Path) -> None:
    pkg = tmp_path / "pk"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "api.py").write_text('_EXPORTS: dict[str, str] = {"f": "pk.impl", "G": "pk.other:H"}\n')
    (pkg / "impl.py").write_text("def f(): ...\n")
    (pkg / "other.py").write_text("from pk.user import x\n")
    (pkg / "user.py").write_text("from pk.api import G\n")
    graph = import_graph([pkg])
    assert graph["pk.user"] == {"pk.api", "pk.other"}  # not pk.impl: f is not imported
    assert circles(graph) == {("pk.other", "pk.user")}


def test_no_import_circles() -> None:
    found = circles(import_graph(repo_roots()))
    assert not found, "import circle(s): " + "; ".join(" <-> ".join(c) for c in sorted(found))
