"""docs/writing-a-plugin.md stays runnable and accurate.

Every ```python snippet of the guide is executed on its own, as a module, with the example
plugin (``tests/data/thirdparty_plugin/src``) and a plugin made by ``bitpress plugin new mine``
on the path; the ``test_*`` functions a snippet defines are then called. The table of options
every weight-only pass inherits is compared with ``WeightOnlyOptions`` itself.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import types
from pathlib import Path

import pytest

from bitpress.onnx.weightonly import WeightOnlyOptions
from bitpress.options import describe
from bitpress.scaffold import new_plugin

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "writing-a-plugin.md"
EXAMPLE_SRC = ROOT / "tests" / "data" / "thirdparty_plugin" / "src"


def _snippets() -> list[tuple[int, str]]:
    text = GUIDE.read_text()
    found = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        found.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return found


SNIPPETS = _snippets()


@pytest.fixture(scope="module")
def mine_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return new_plugin("mine", tmp_path_factory.mktemp("scaffold") / "bitpress-mine").path / "src"


def test_the_guide_has_snippets() -> None:
    assert len(SNIPPETS) >= 10


@pytest.mark.parametrize(("line", "code"), SNIPPETS, ids=[f"line{line}" for line, _ in SNIPPETS])
def test_snippet_runs(line: int, code: str, mine_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    monkeypatch.syspath_prepend(str(mine_src))
    name = f"writing_a_plugin_line{line}"
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(code, f"{GUIDE.name}:{line}", "exec"), module.__dict__)
    for attr, value in list(vars(module).items()):
        if attr.startswith("test_") and inspect.isfunction(value):
            params = inspect.signature(value).parameters
            value(**({"tmp_path": tmp_path} if "tmp_path" in params else {}))


def test_inherited_options_table_matches_the_code() -> None:
    text = GUIDE.read_text()
    section = text.split("### The options every weight-only pass inherits", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for row in re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, re.MULTILINE):
        rows[row[0]] = json.loads(row[1])
    assert rows == {o.name: o.default for o in describe(WeightOnlyOptions)}
