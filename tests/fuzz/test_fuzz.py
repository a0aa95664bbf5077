"""The mutation fuzzer (tests/fuzz/onnx_fuzz.py), a short seed-fixed run in the normal suite.

``make fuzz`` runs it longer (``N=``, ``SEED=``, ``FUZZ_SECONDS=``). The run here is the cases
of seeds 0..149 (``BITPRESS_FUZZ_CASES`` changes the count; about ten seconds): every mutated single-file and
external-data model either quantizes to an output that loads, or fails with one error line,
the input unchanged and nothing left behind. It runs in a process of its own, whose cases run
in forked children, so a native crash on a mutated model fails this test instead of ending the
suite; a failing case prints the command that replays it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import onnx_fuzz  # noqa: E402

CASES = int(os.environ.get("BITPRESS_FUZZ_CASES", "150"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fuzzer forks a child per case")
def test_seed_fixed_fuzz_run_keeps_every_promise(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(HERE / "onnx_fuzz.py"), "--seed", "0", "--cases", str(CASES), "--keep",
         str(tmp_path / "failures"), "--progress", "0", "--timeout", "120"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert f"fuzz: {CASES} cases from seed 0" in proc.stdout, proc.stdout


def test_cases_are_pure_functions_of_their_seed(tmp_path: Path) -> None:
    """Replaying a seed rebuilds the same input (what `make fuzz SEED=... N=1` relies on)."""
    bases = onnx_fuzz.build_bases(tmp_path / "bases")
    outside = tmp_path / "secret"
    outside.write_bytes(onnx_fuzz.SECRET)
    for seed in (3, 11, 12345):
        a = onnx_fuzz.make_case(seed, bases, tmp_path / f"a{seed}", outside)
        b = onnx_fuzz.make_case(seed, bases, tmp_path / f"b{seed}", outside)
        assert a.ops == b.ops and a.ops
        assert onnx_fuzz.tree(tmp_path / f"a{seed}") == onnx_fuzz.tree(tmp_path / f"b{seed}")


def test_structure_aware_edits_keep_the_enclosing_lengths_right(tmp_path: Path) -> None:
    import onnx

    bases = onnx_fuzz.build_bases(tmp_path / "bases")
    buf = (bases["external"] / "model.onnx").read_bytes()
    fields = onnx_fuzz.walk(buf)
    names = {f.name for f in fields}
    assert {"graph.initializer.dims", "graph.initializer.external_data.value", "graph.node.attribute.type"} <= names
    loc = next(f for f in fields if f.sibling_key == "location")
    new = b"elsewhere.data"
    edited = onnx_fuzz.replace_fixed(buf, fields, loc, loc.value, loc.end, onnx_fuzz.enc_varint(len(new)) + new)
    model = onnx.ModelProto()
    model.ParseFromString(edited)  # still well formed: every enclosing length was fixed up
    locations = [e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"]
    assert locations.count("elsewhere.data") == 1


def test_the_contract_catches_a_broken_promise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker of the fuzzer itself: an internal error, or a modified input, is reported."""
    from bitpress import cli

    bases = onnx_fuzz.build_bases(tmp_path / "bases")
    case = tmp_path / "case"
    case.mkdir()
    import shutil

    shutil.copytree(bases["single"], case / "in")

    def broken(argv: list[str]) -> int:
        (case / "in" / "model.onnx").write_bytes(b"changed")
        print("bitpress: internal error: KeyError: 'x' (rerun with --verbose)", file=sys.stderr)
        return 1

    monkeypatch.setattr(cli, "main", broken)
    res = onnx_fuzz.run_case(case, case / "in", [])
    assert "an internal error" in res["problems"] and "the input was modified" in res["problems"]
    assert "exit 1 with 0 'bitpress: error:' lines" in res["problems"]
