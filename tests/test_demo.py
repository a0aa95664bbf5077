"""`make demo` runs `bitpress demo`: it must work on a fresh checkout with the native plugins."""

from __future__ import annotations

from bitpress.cli import main


def test_demo_reports_every_native_algorithm(tmp_path, capsys):
    assert main(["demo", "--output", str(tmp_path / "demo"), "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0] + "/" + line.split()[1] for line in out.splitlines()[2:] if line[:1].isalpha()}
    assert {"rtn/int8", "rtn/int4", "nf4/nf4"} <= rows, out
    assert (tmp_path / "demo" / "rtn-int4" / "model.onnx").is_file()
    # the error column is a number, and int8 beats int4; every output is timed against float32 (a ratio)
    errs, speeds = {}, {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] in ("rtn", "float32", "nf4", "hqq", "kquant") and parts[-1].endswith("x"):
            # ... logits rel. error, top-1 agree, 1-token speed, 32-token speed
            speeds[parts[0] + "/" + parts[1]] = (parts[-2], parts[-1])
            if parts[0] == "rtn":
                errs[parts[1]] = float(parts[-4])
    assert errs["int8"] < errs["int4"], out
    assert speeds["float32/-"] == ("1.00x", "1.00x"), out
    assert all(a.endswith("x") and float(a[:-1]) > 0 and float(b[:-1]) > 0 for a, b in speeds.values()), out
    assert "speed: calls per second against float32's" in out
    # nf4 is larger than the int4 rows for a reason the demo states: the tied table stays float
    notes = out.split("rows that differ for a reason:")[-1]
    assert "nf4 nf4: model.embed_tokens.weight stays float" in notes, out
