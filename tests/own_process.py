"""``@pytest.mark.own_process``: tests whose libraries may end the process run in a fresh interpreter.

Ray's driver, for one, ends its process with ``_exit(1)`` when it loses its runtime (no traceback,
no pytest summary): in the test session's own process that ended the whole suite without a word.
Marked tests of a module run together in one child ``python -m pytest`` (so a module-scoped
fixture, such as a Ray runtime, is still started once); each child report comes back to this
session as if the test had run here. When the child dies, the test it was running fails with the
exit status, the child's last output and the tails of the logs it left in its scratch folder
(``$BITPRESS_TEST_OWN_PROCESS``: a fixture may put a runtime's files there), and the module's
tests it had not reached run in a new child.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _pytest.reports import TestReport

#: set in the child: the scratch folder its fixtures may leave logs in; marked tests run as usual there
CHILD = "BITPRESS_TEST_OWN_PROCESS"
_REPORTS = "BITPRESS_TEST_OWN_PROCESS_REPORTS"
_TIMEOUT_S = 1200
_TAIL = 4000

_done: dict[str, list[TestReport]] = {}


def in_child() -> bool:
    return bool(os.environ.get(CHILD))


def scratch() -> str | None:
    """The child's scratch folder (None outside a child): leave logs worth reading after a crash here."""
    return os.environ.get(CHILD) or None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "own_process: runs in a fresh interpreter with the module's other such tests (tests/own_process.py)")


def pytest_runtest_logreport(report: TestReport) -> None:
    path = os.environ.get(_REPORTS)
    if path and in_child():  # the child: every report goes back to the parent, one JSON line each
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(report._to_json()) + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    if item.get_closest_marker("own_process") is None or in_child():
        return None
    if item.nodeid not in _done:
        _run_module(item)
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in _done.pop(item.nodeid):
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _run_module(item: pytest.Item) -> None:
    """Run ``item`` and the module's marked tests not run yet in one child; record every report."""
    module = item.nodeid.split("::")[0]
    todo = [i for i in item.session.items
            if i.nodeid.split("::")[0] == module and i.get_closest_marker("own_process") is not None
            and i.nodeid not in _done]
    todo = todo[todo.index(item):]
    root = Path(str(item.config.rootpath))
    folder = Path(tempfile.mkdtemp(prefix="bp-own-"))
    try:
        reports_file = folder / "reports.jsonl"
        # tee-sys: what the test prints reaches the child's output too (unbuffered), where a crash's last
        # words can be read; what native code writes to the descriptors goes there anyway
        env = {**os.environ, CHILD: str(folder), _REPORTS: str(reports_file), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=tee-sys",
               *[i.nodeid for i in todo]]
        try:
            done = subprocess.run(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  errors="replace", timeout=_TIMEOUT_S)
            code, out = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            code, out = None, f"{exc.stdout or ''}{exc.stderr or ''}"
        got: dict[str, list[TestReport]] = {}
        if reports_file.exists():
            for line in reports_file.read_text(encoding="utf-8").splitlines():
                report = TestReport._from_json(json.loads(line))
                if isinstance(report.longrepr, list):  # a skip's (path, line, reason), a list in JSON
                    report.longrepr = tuple(report.longrepr)
                got.setdefault(report.nodeid, []).append(report)
        for i in todo:
            reports = got.get(i.nodeid, [])
            if any(r.when == "teardown" for r in reports):
                _done[i.nodeid] = reports
                continue
            # the first test without its teardown is the one the child died in; the tests after it run
            # in a new child when their turn comes
            what = "timed out" if code is None else f"ended with exit status {code}"
            text = (f"the test's own process (tests/own_process.py) {what} during this test\n"
                    f"--- its output (tail) ---\n{out[-_TAIL:]}\n{_log_tails(folder)}")
            _done[i.nodeid] = [TestReport(i.nodeid, i.location, {}, "failed", text, "call")]
            break
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _log_tails(folder: Path) -> str:
    """The ends of the logs a fixture left in the scratch folder (Ray: raylet.out, gcs_server.out, ...)."""
    parts = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in (".out", ".err", ".log") and path.stat().st_size:
            text = path.read_text(encoding="utf-8", errors="replace")[-1500:]
            parts.append(f"--- {path.relative_to(folder)} (tail) ---\n{text}")
    return "\n".join(parts[-8:])
