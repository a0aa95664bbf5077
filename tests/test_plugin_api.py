"""``bitpress.plugin`` is the one module plugins import host code from (issue 28).

* Every in-repo plugin module (``plugins/*/bitpress_*/``, not their tests) and the plugin that
  ``bitpress plugin new`` writes import host code only as ``from bitpress.plugin import ...``
  (read from the source: module-level, function-level and ``TYPE_CHECKING`` imports alike, and
  ``importlib.import_module`` / ``__import__`` of a host module by name).
* Every name of ``bitpress.plugin.__all__`` resolves, the lazy table, ``__all__`` and the
  ``TYPE_CHECKING`` imports (what type checkers see) name the same objects, and nothing else.
* ``import bitpress.plugin`` is cheap: it loads nothing beyond what ``import bitpress`` does.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import bitpress.plugin as plugin_api
from bitpress.scaffold import new_plugin

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_API = ROOT / "core" / "bitpress" / "plugin.py"
PLUGIN_SOURCES = sorted(p for p in ROOT.glob("plugins/*/bitpress_*/**/*.py") if p.is_file())


def _is_host(module: str) -> bool:
    return module == "bitpress" or module.startswith("bitpress.")


def host_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, what)`` for each import of host code in ``path`` other than ``from bitpress.plugin import``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _is_host(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_host(node.module):
            if node.module != "bitpress.plugin":
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = ast.unparse(node.func)
            arg = node.args[0].value
            if name in ("importlib.import_module", "import_module", "__import__") and isinstance(arg, str) \
                    and _is_host(arg) and arg != "bitpress.plugin":
                found.append((node.lineno, f"{name}({arg!r})"))
    return found


def names_imported_from_the_api(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "bitpress.plugin"
            for a in node.names}


def test_the_sources_are_found() -> None:
    assert len(PLUGIN_SOURCES) > 50
    assert {p.parts[-3] for p in PLUGIN_SOURCES} >= {"rtn", "hqq", "kquant", "gptq", "awq", "gguf", "ort", "quark",
                                                     "aimet", "modelopt", "inc"}


def test_the_checker_sees_every_kind_of_host_import(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("import bitpress\nimport bitpress.errors as e\nfrom bitpress import hookimpl\n"
                    "from bitpress.plugin import Pass\nfrom bitpress_rtn.solver import rtn_solver\n"
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bitpress.passes import Pass\n"
                    "def f():\n    from bitpress.onnx import layout\n    import importlib\n"
                    "    importlib.import_module('bitpress.hf.passes')\n    importlib.import_module('bitpress_rtn')\n")
    assert [line for line, _ in host_imports(path)] == [1, 2, 3, 8, 10, 12]


PLUGIN_IDS = [p.relative_to(ROOT / "plugins").as_posix() for p in PLUGIN_SOURCES]


@pytest.mark.parametrize("path", PLUGIN_SOURCES, ids=PLUGIN_IDS)
def test_plugins_import_the_host_only_through_bitpress_plugin(path: Path) -> None:
    found = host_imports(path)
    assert not found, f"{path.relative_to(ROOT)}: host code imported other than from bitpress.plugin: " + \
        "; ".join(f"line {line}: {what}" for line, what in found)
    unknown = names_imported_from_the_api(path) - set(plugin_api.__all__)
    assert not unknown, f"{path.relative_to(ROOT)}: not in bitpress.plugin: {sorted(unknown)}"


def test_the_generated_plugin_imports_only_bitpress_plugin(tmp_path: Path) -> None:
    dest = new_plugin("clip", tmp_path / "bitpress-clip").path
    sources = sorted((dest / "src").rglob("*.py"))
    assert sources
    for path in sources:
        assert not host_imports(path), (path.name, host_imports(path))
        assert names_imported_from_the_api(path), f"{path.name} does not use bitpress.plugin"
        assert names_imported_from_the_api(path) <= set(plugin_api.__all__)


def test_all_is_the_table_and_every_name_resolves() -> None:
    table = plugin_api._EXPORTS
    assert len(plugin_api.__all__) == len(set(plugin_api.__all__))
    assert set(plugin_api.__all__) == set(table)
    for name, where in table.items():
        module, _, attr = where.partition(":")
        expected = getattr(importlib.import_module(module), attr or name)  # a stale entry fails here
        assert getattr(plugin_api, name) is expected, name
    assert set(plugin_api.__all__) <= set(dir(plugin_api))


def test_the_type_checking_imports_match_the_table() -> None:
    tree = ast.parse(PLUGIN_API.read_text(encoding="utf-8"))
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    seen: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module, ast.unparse(node)
        for a in node.names:
            public = a.asname or a.name
            assert public not in seen, f"{public} imported twice"
            seen[public] = node.module if a.asname is None or a.asname == a.name else f"{node.module}:{a.name}"
    assert seen == plugin_api._EXPORTS


def test_no_entry_points_at_a_moved_module() -> None:
    """Every name is served from where it lives now: no module of the table is an old path's warning shim
    (the shims of tests/test_moved_paths.py are for third parties' imports, not for the public module)."""
    modules = sorted({where.partition(":")[0] for where in plugin_api._EXPORTS.values()})
    code = f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
    proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_unknown_names_say_where_to_look() -> None:
    with pytest.raises(AttributeError, match=r"'OnnxGraph'.*not part of the plugin API.*bitpress\.plugin\.__all__"):
        plugin_api.OnnxGraph  # noqa: B018
    with pytest.raises(ImportError, match="OnnxGraph"):
        exec("from bitpress.plugin import OnnxGraph", {})
    assert not hasattr(plugin_api, "plugins")  # a host module is not reachable through it


PROBE = """
import json, sys
import bitpress
before = set(sys.modules)
import bitpress.plugin
from bitpress.plugin import hookimpl
print(json.dumps({"new": sorted(set(sys.modules) - before), "loaded": sorted(sys.modules)}))
"""
HEAVY = ("torch", "transformers", "onnxruntime", "bitpress.hf.passes", "bitpress.hf.calibrated",
         "bitpress.onnx.weightonly", "bitpress.onnx.calibrated", "bitpress.toolkit.workspace",
         "bitpress.toolkit.containment", "bitpress.genai.export")


def test_importing_it_is_cheap() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["new"] == ["bitpress.plugin"]  # nothing beyond what `import bitpress` loads
    assert not set(HEAVY) & set(got["loaded"])
