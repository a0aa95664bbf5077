"""tests/own_process.py: a test whose process dies fails alone, with what it printed; the others still run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_CASES = '''
import os
import pytest

@pytest.mark.own_process
def test_first():
    assert os.environ.get("BITPRESS_TEST_OWN_PROCESS")

@pytest.mark.own_process
def test_dies():
    print("last words")
    os._exit(1)

@pytest.mark.own_process
def test_skips():
    pytest.skip("not here")

@pytest.mark.own_process
def test_fails():
    assert 1 == 2

@pytest.mark.own_process
def test_after():
    assert os.environ.get("BITPRESS_TEST_OWN_PROCESS")

def test_here():
    assert not os.environ.get("BITPRESS_TEST_OWN_PROCESS")
'''


def test_a_dying_test_fails_alone_and_the_rest_run(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from own_process import pytest_configure, pytest_runtest_logreport, pytest_runtest_protocol  # noqa\n")
    (tmp_path / "test_cases.py").write_text(_CASES)
    env_path = str(Path(__file__).parent)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "test_cases.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": env_path})
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "2 failed, 3 passed, 1 skipped" in out, out
    assert "FAILED test_cases.py::test_dies" in out and "FAILED test_cases.py::test_fails" in out, out
    assert "ended with exit status 1 during this test" in out and "last words" in out, out
    assert "assert 1 == 2" in out, out  # a child's own failure keeps its traceback
    for name in ("test_first", "test_after", "test_here"):
        assert f"PASSED test_cases.py::{name}" in out, out
