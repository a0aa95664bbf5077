"""A bounded mutation fuzzer for the host's ONNX readers (docs/security.md, "Fuzzing").

Each case starts from a small model built by :mod:`bitpress.synthetic` (a single ``.onnx`` file,
or one with its weights in ``model.onnx.data``), applies one to three mutations, and runs
``bitpress quantize --algorithm rtn`` on it in-process (:func:`bitpress.cli.main`, stderr
captured). The mutations:

* bytes of the ``.onnx`` file: bit flips, bytes replaced by 0x00 / 0xff / 0x7f / 0x80,
  truncation (anywhere, or at a protobuf field boundary), chunks duplicated or deleted (random
  ones, or whole protobuf fields), length varints at field boundaries replaced by interesting
  values (0, off by one, 2^31, 2^63, over-long encodings, ...);
* structure-aware edits, found by walking the file with ONNX's protobuf descriptors (the
  enclosing lengths are fixed up, so the edit reaches the parser behind the wire format): a
  varint field (``data_type``, ``dims``, ``ir_version``, attribute ints) set to an interesting
  value, a whole field deleted or repeated, a string replaced;
* external data: the ``.data`` file truncated, extended, corrupted, deleted, replaced by a
  folder or by a link out of the folder; the ``location`` string and the ``offset`` / ``length``
  values replaced (``../``, absolute, control characters, invalid UTF-8, over-long, the model
  file itself, signs, spaces, non-ASCII digits, ...).

The contract checked for every case: exit 0 with an output that ``onnx.load`` and ONNX
Runtime load (and that runs once on small inputs without crashing ONNX Runtime), or exit 1 / 2
with exactly one ``bitpress: error:`` line on stderr (no ``internal error``, no traceback, and
nothing that native code printed); the input files unchanged (checksums); nothing left beside
the output (no temporary folder, no output after a failure). Each case runs in a forked child,
so a native crash (a signal) or a hang (``--timeout``) is reported as a failure of that case
instead of ending the run.

Every case is a pure function of its seed: the cases of ``--seed S --cases N`` are the seeds
``S .. S+N-1``, and a failing case prints the command that replays it alone::

    python tests/fuzz/onnx_fuzz.py --seed 1234 --cases 1        # or: make fuzz SEED=1234 N=1

Failing inputs are kept under ``--keep`` (default: a folder in the system's temporary folder).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the small decoder every case starts from (tiny: mutations land in the structure, not only in weights)
MODEL = {"hidden": 32, "layers": 1, "heads": 2, "vocab": 64}
DATA = "model.onnx.data"
INTERESTING_BYTES = (0x00, 0xFF, 0x7F, 0x80)
SECRET = b"fuzz: a file outside the input folder\n"
#: bitpress's own log lines (warnings before an error are allowed; anything else on stderr is not)
LOG_LINE = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) bitpress[.\w]*: ")


# -- the protobuf walk ------------------------------------------------------------------------------------
@dataclass
class Field:
    """One protobuf field of the file: where its tag, length and payload are, and what it is."""

    tag: int  # offset of the key varint
    value: int  # offset of the value (for length-delimited fields: of the length varint)
    payload: int  # offset of the payload (== value for varint / fixed fields)
    end: int
    wire: int
    name: str  # dotted path of field names, e.g. graph.initializer.raw_data
    parents: tuple[int, ...] = ()  # indices (in the walk's list) of the enclosing length-delimited fields
    sibling_key: str | None = None  # for StringStringEntryProto values: the entry's key


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("bad varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def enc_varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def walk(buf: bytes) -> list[Field]:
    """Every field of an ONNX ModelProto's bytes, depth first (stops quietly at the first bad byte)."""
    import onnx

    out: list[Field] = []

    def rec(start: int, end: int, desc: Any, prefix: str, parents: tuple[int, ...], depth: int) -> None:
        pos = start
        while pos < end:
            try:
                key, vpos = _varint(buf, pos)
                number, wire = key >> 3, key & 7
                fd = desc.fields_by_number.get(number) if desc is not None else None
                name = f"{prefix}{fd.name if fd else number}"
                if wire == 0:
                    _, nxt = _varint(buf, vpos)
                    out.append(Field(pos, vpos, vpos, nxt, 0, name, parents))
                elif wire in (1, 5):
                    nxt = vpos + (8 if wire == 1 else 4)
                    out.append(Field(pos, vpos, vpos, nxt, wire, name, parents))
                elif wire == 2:
                    length, ppos = _varint(buf, vpos)
                    nxt = ppos + length
                    if nxt > end:
                        return
                    out.append(Field(pos, vpos, ppos, nxt, 2, name, parents))
                    me = len(out) - 1
                    if fd is not None and fd.message_type is not None and depth < 16:
                        first = len(out)
                        rec(ppos, nxt, fd.message_type, name + ".", (*parents, me), depth + 1)
                        if fd.message_type.name == "StringStringEntryProto":
                            kids = out[first:]
                            keys = [buf[k.payload:k.end] for k in kids if k.name.endswith(".key")]
                            for k in kids:
                                if k.name.endswith(".value") and keys:
                                    k.sibling_key = keys[-1].decode("utf-8", "replace")
                else:
                    return
                if nxt > end:
                    return
                pos = nxt
            except ValueError:
                return

    rec(0, len(buf), onnx.ModelProto.DESCRIPTOR, "", (), 0)
    return out


def replace_fixed(buf: bytes, fields: list[Field], f: Field, start: int, end: int, new: bytes) -> bytes:
    """``buf`` with ``buf[start:end]`` (inside ``f`` or ``f`` itself) replaced by ``new``, and the
    lengths of every enclosing field fixed up, innermost first (so the file stays well formed)."""
    out = bytearray(buf[:start] + new + buf[end:])
    delta = len(new) - (end - start)
    for i in reversed(f.parents):
        p = fields[i]
        old_len, ppos = _varint(bytes(out), p.value)
        new_len = enc_varint(old_len + delta)
        out[p.value:ppos] = new_len
        delta += len(new_len) - (ppos - p.value)
    return bytes(out)


# -- mutations ------------------------------------------------------------------------------------------
@dataclass
class Case:
    seed: int
    storage: str  # single | external
    options: list[str]
    ops: list[str] = field(default_factory=list)


def _interesting_ints(rng: random.Random, current: int) -> int:
    return rng.choice([0, 1, 2, 7, 15, 16, 17, 23, 24, 25, 26, 30, 31, 32, 64, 127, 128, 255, 256, 4096,
                       (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 60) + 1, (1 << 63) - 1, 1 << 63,
                       (1 << 64) - 1, (1 << 64) - 2, current + 1, current - 1, current * 2, current * 1000])


def _position(rng: random.Random, buf: bytes, fields: list[Field]) -> int:
    """A byte to mutate: mostly in the structure (anything but weight payloads), sometimes anywhere."""
    if fields and rng.random() < 0.8:
        f = rng.choice(fields)
        if f.name.endswith("raw_data") and rng.random() < 0.7:
            return rng.choice([f.tag, f.value, f.payload - 1])
        return rng.randrange(f.tag, max(f.tag + 1, f.payload + min(8, f.end - f.payload)))
    return rng.randrange(len(buf))


def mutate_model(rng: random.Random, buf: bytes, ops: list[str]) -> bytes:
    fields = walk(buf)
    kind = rng.choices(
        ["bitflip", "byte", "truncate", "dup_chunk", "del_chunk", "length", "varint", "del_field",
         "dup_field", "string"],
        weights=[3, 3, 1, 1, 1, 3, 4, 2, 2, 2],
    )[0]
    if not buf:
        ops.append("model: empty, appended a byte")
        return bytes([rng.randrange(256)])
    if kind == "bitflip":
        pos, bit = _position(rng, buf, fields), rng.randrange(8)
        ops.append(f"model: flip bit {bit} of byte {pos}")
        return buf[:pos] + bytes([buf[pos] ^ (1 << bit)]) + buf[pos + 1:]
    if kind == "byte":
        pos, val = _position(rng, buf, fields), rng.choice(INTERESTING_BYTES)
        ops.append(f"model: byte {pos} = {val:#x}")
        return buf[:pos] + bytes([val]) + buf[pos + 1:]
    if kind == "truncate":
        if fields and rng.random() < 0.6:
            f = rng.choice(fields)
            pos = rng.choice([f.tag, f.value, f.payload, min(f.payload + 1, f.end), f.end - 1])
        else:
            pos = rng.randrange(len(buf))
        ops.append(f"model: truncated to {pos} bytes")
        return buf[:pos]
    if kind in ("dup_chunk", "del_chunk"):
        if fields and rng.random() < 0.5:
            f = rng.choice(fields)
            start, end = f.tag, f.end
        else:
            start = rng.randrange(len(buf))
            end = min(len(buf), start + rng.choice([1, 2, 3, 4, 8, 16, 64, 512]))
        if kind == "dup_chunk":
            ops.append(f"model: bytes {start}..{end} duplicated (no length fix-up)")
            return buf[:end] + buf[start:end] + buf[end:]
        ops.append(f"model: bytes {start}..{end} deleted (no length fix-up)")
        return buf[:start] + buf[end:]
    if not fields:
        ops.append("model: no protobuf fields; flipped byte 0")
        return bytes([buf[0] ^ 0xFF]) + buf[1:]
    if kind == "length":
        lens = [f for f in fields if f.wire == 2]
        f = rng.choice(lens)
        n = f.end - f.payload
        choice = rng.choice(["value", "overlong", "eleven"])
        if choice == "overlong":  # the same value in more bytes than needed (valid protobuf)
            raw = bytearray(enc_varint(n))
            raw[-1] |= 0x80
            new = bytes(raw) + b"\x80" * rng.randrange(0, 4) + b"\x00"
            what = "the same length over-long encoded"
        elif choice == "eleven":
            new, what = b"\xff" * 10 + b"\x01", "an 11-byte varint"
        else:
            v = rng.choice([0, 1, n - 1, n + 1, n * 2, len(buf) - f.payload, len(buf), 0x7F, 0x80,
                            (1 << 31) - 1, 1 << 31, 1 << 32, 1 << 63, (1 << 64) - 1])
            new, what = enc_varint(max(v, 0)), f"{max(v, 0)}"
        ops.append(f"model: length of {f.name} at byte {f.value} ({n}) -> {what}")
        _, ppos = _varint(buf, f.value)
        return buf[:f.value] + new + buf[ppos:]
    if kind == "varint":
        ints = [f for f in fields if f.wire == 0]
        if not ints:
            return mutate_model(rng, buf, ops)
        f = rng.choice(ints)
        cur, _ = _varint(buf, f.value)
        v = _interesting_ints(rng, cur)
        ops.append(f"model: {f.name} at byte {f.tag} = {v} (was {cur})")
        return replace_fixed(buf, fields, f, f.value, f.end, enc_varint(v))
    if kind == "del_field":
        f = rng.choice(fields)
        ops.append(f"model: field {f.name} at byte {f.tag} deleted")
        return replace_fixed(buf, fields, f, f.tag, f.end, b"")
    if kind == "dup_field":
        f = rng.choice(fields)
        ops.append(f"model: field {f.name} at byte {f.tag} repeated")
        return replace_fixed(buf, fields, f, f.end, f.end, buf[f.tag:f.end])
    # string: a name, an op type, a location, a key... replaced
    strs = [f for f in fields if f.wire == 2 and not f.name.endswith("raw_data")]
    f = rng.choice(strs or fields)
    old = buf[f.payload:f.end]
    new = rng.choice([b"", b"\xff\xfe", b"\xc3\x28", old + b"\x00", old[:1], old * 2, b"a" * 70000,
                      b"../" + old, b"/etc/passwd", old.upper(), b"\xed\xa0\x80", old + b"\xe2\x80\x8b"])
    ops.append(f"model: {f.name} at byte {f.tag} = {new[:24]!r}{'...' if len(new) > 24 else ''} ({len(new)} bytes)")
    return replace_fixed(buf, fields, f, f.value, f.end, enc_varint(len(new)) + new)


def mutate_external_entry(rng: random.Random, buf: bytes, ops: list[str]) -> bytes:
    """Replace a ``location`` / ``offset`` / ``length`` value of one external tensor."""
    fields = walk(buf)
    entries = [f for f in fields if f.sibling_key in ("location", "offset", "length")]
    if not entries:
        return mutate_model(rng, buf, ops)
    f = rng.choice(entries)
    old = buf[f.payload:f.end]
    if f.sibling_key == "location":
        new = rng.choice([
            b"", b".", b"./" + old, b"sub/../" + old, b"../" + old, b"../in/" + old, b"/etc/passwd",
            b"C:\\Windows\\win.ini", b"\\\\server\\share\\x", b"..\\" + old, old + b"/", old + b"\x00x",
            b"a\nb", old.upper(), b"model.onnx", b"missing.data", b"x" * 300, b"d/" * 2100,
            b"\xff\xfe", b"\xc3\x28" + old, old + b"\x7f", b"lnk.data", b"outside.data", b"folder.data",
        ])
    else:
        n = old.decode("ascii", "replace")
        new = rng.choice([
            b"", b"-1", b"-0", b"+" + old, b" " + old, old + b" ", b"\t" + old, old + b"\n", b"0x10",
            b"1e3", b"1_0", old + b"0", b"0" + old, b"\xd9\xa3", b"\xc2\xb2", b"99999999999999999999",
            b"1152921504606846977", b"18446744073709551615", str(int(n) + 1 if n.isdigit() else 1).encode(),
            str(max(int(n) - 1, 0) if n.isdigit() else 0).encode(), b"NaN", b"\xff",
        ])
    ops.append(f"model: external {f.sibling_key} {old[:24]!r} -> {new[:24]!r} ({len(new)} bytes)")
    return replace_fixed(buf, fields, f, f.value, f.end, enc_varint(len(new)) + new)


def mutate_data(rng: random.Random, folder: Path, ops: list[str], outside: Path) -> None:
    """Change the external ``.data`` file (or what stands in its place)."""
    data = folder / DATA
    if not data.is_file() or data.is_symlink():
        ops.append("data: already replaced; left as it is")
        return
    buf = data.read_bytes()
    if len(buf) < 8:
        data.write_bytes(buf + bytes(8))
        ops.append("data: extended to 8 bytes")
        return
    kind = rng.choice(["truncate", "extend", "byte", "dup", "delete", "folder", "link_out", "link_in",
                       "empty", "nan"])
    if kind == "truncate":
        n = rng.choice([0, 1, len(buf) // 2, len(buf) - 1, rng.randrange(len(buf) + 1)])
        data.write_bytes(buf[:n])
        ops.append(f"data: truncated to {n} of {len(buf)} bytes")
    elif kind == "extend":
        data.write_bytes(buf + bytes(rng.randrange(1, 4096)))
        ops.append("data: extended with zeros")
    elif kind == "byte":
        pos = rng.randrange(len(buf))
        data.write_bytes(buf[:pos] + bytes([rng.choice(INTERESTING_BYTES)]) + buf[pos + 1:])
        ops.append(f"data: byte {pos} replaced")
    elif kind == "nan":  # every weight a NaN or an infinity from some offset on
        pos = rng.randrange(0, len(buf), 4)
        pat = rng.choice([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\xff\xff\xff\xff"])
        data.write_bytes(buf[:pos] + pat * ((len(buf) - pos) // 4) + buf[pos + (len(buf) - pos) // 4 * 4:])
        ops.append(f"data: float {pat!r} from byte {pos} on")
    elif kind == "dup":
        start = rng.randrange(len(buf))
        end = min(len(buf), start + rng.choice([1, 64, 4096]))
        data.write_bytes(buf[:end] + buf[start:end] + buf[end:])
        ops.append(f"data: bytes {start}..{end} duplicated")
    elif kind == "delete":
        data.unlink()
        ops.append("data: deleted")
    elif kind == "folder":
        data.unlink()
        data.mkdir()
        ops.append("data: replaced by a folder")
    elif kind == "link_out":
        data.unlink()
        data.symlink_to(outside)
        ops.append("data: a link to a file outside the folder")
    elif kind == "link_in":
        (folder / "real.data").write_bytes(buf)
        data.unlink()
        data.symlink_to("real.data")
        ops.append("data: a link to real.data beside it (allowed)")
    else:
        data.write_bytes(b"")
        ops.append("data: emptied")


def make_case(seed: int, bases: dict[str, Path], folder: Path, outside: Path) -> Case:
    """Write case ``seed``'s input into ``folder`` (which must not exist); returns what was done."""
    rng = random.Random(seed)
    storage = rng.choice(["single", "external"])
    options = rng.choice([[], [], [], ["--single-file"], ["--external-data"], ["--precision", "int8"]])
    case = Case(seed, storage, options)
    shutil.copytree(bases[storage], folder, symlinks=True)
    model = folder / "model.onnx"
    buf = model.read_bytes()
    for _ in range(rng.choices([1, 2, 3], weights=[6, 3, 1])[0]):
        target = rng.random()
        if storage == "external" and target < 0.25:
            buf = mutate_external_entry(rng, buf, case.ops)
        elif storage == "external" and target < 0.45:
            mutate_data(rng, folder, case.ops, outside)
        else:
            buf = mutate_model(rng, buf, case.ops)
    model.write_bytes(buf)
    # names a mutated location may point at: a link out of the folder, a folder, a link inside it
    if storage == "external":
        (folder / "lnk.data").symlink_to(DATA)
        (folder / "outside.data").symlink_to(outside)
        (folder / "folder.data").mkdir()
    return case


# -- running a case ---------------------------------------------------------------------------------------
def tree(root: Path) -> dict[str, str]:
    """Relative path -> sha256 (links as their target, folders as "dir")."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = f"-> {os.readlink(p)}"
        elif p.is_dir():
            out[rel + "/"] = "dir"
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _feeds(session: Any) -> dict[str, Any]:
    """Small inputs for every graph input: token ids below the vocabulary, ones elsewhere."""
    import numpy as np

    types = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
             "tensor(float16)": np.float16, "tensor(bool)": np.bool_}
    feeds = {}
    for inp in session.get_inputs():
        shape = [d if isinstance(d, int) and 0 < d <= 64 else (1 if i == 0 else 4) for i, d in enumerate(inp.shape)]
        dtype = types.get(inp.type, np.float32)
        rng = np.random.default_rng(0)
        feeds[inp.name] = (rng.integers(0, MODEL["vocab"], shape).astype(dtype) if "ids" in inp.name
                           else np.ones(shape, dtype))
    return feeds


def check_output(out_dir: Path, run: bool = False) -> str | None:
    """None when ``out_dir/model.onnx`` (and its data) loads in onnx and ONNX Runtime.

    ``run``: also run it once on small inputs; an exception there is no finding (a mutated graph
    may compute nonsense), only a native crash is (seen by the parent as a signal).
    """
    import onnx
    import onnxruntime as ort

    names = sorted(p.name for p in out_dir.iterdir())
    if names not in (["model.onnx"], ["model.onnx", DATA]):
        return f"unexpected files in the output folder: {names}"
    model = out_dir / "model.onnx"
    cwd = os.getcwd()
    try:
        os.chdir(out_dir.parent.parent)  # onnx.load must work from any working directory
        onnx.load(str(model))
    except Exception as exc:  # any failure is the finding
        return f"onnx.load fails on the output: {type(exc).__name__}: {exc}"[:500]
    finally:
        os.chdir(cwd)
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        opts.intra_op_num_threads = 1
        session = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        return f"ONNX Runtime cannot load the output: {type(exc).__name__}: {exc}"[:500]
    if run:
        with contextlib.suppress(Exception):
            session.run(None, _feeds(session))
    return None


def run_case(case_dir: Path, inp: Path, options: list[str], run: bool = False) -> dict[str, Any]:
    """Quantize ``inp/model.onnx`` in-process; returns the exit code, stderr and any broken promise."""
    from bitpress import cli

    before = tree(inp)
    out_dir = case_dir / "out"
    argv = ["quantize", "-m", str(inp / "model.onnx"), "-o", str(out_dir / "model.onnx"), "--algorithm", "rtn",
            "--jobs", "1", *options]
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # an escaping exception is the finding
            import traceback

            traceback.print_exc()
            code = f"raised {type(exc).__name__}"
    stderr = err.getvalue()
    problems = []
    errors = [line for line in stderr.splitlines() if line.startswith("bitpress: error:")]
    if "Traceback" in stderr:
        problems.append("a traceback on stderr")
    if "internal error" in stderr:
        problems.append("an internal error")
    if code == 0:
        if errors:
            problems.append("exit 0 with an error line")
        if not out_dir.is_dir():
            problems.append("exit 0 without an output")
        else:
            why = check_output(out_dir, run)
            if why:
                problems.append(why)
    elif code in (1, 2):
        if len(errors) != 1:
            problems.append(f"exit {code} with {len(errors)} 'bitpress: error:' lines")
        others = [line for line in stderr.splitlines() if line.strip() and line not in errors
                  and not LOG_LINE.match(line)]
        if others:  # a failure is its one line (bitpress's own warnings aside): no stray output beside it
            problems.append(f"exit {code} with other lines on stderr: {others[:3]!r}")
        if out_dir.exists():
            problems.append("an output was left after a failure")
    else:
        problems.append(f"exit code {code!r}")
    left = sorted(p.name for p in case_dir.iterdir() if p.name not in ("in", "out"))
    left += [p.relative_to(case_dir).as_posix() for p in case_dir.rglob("*")
             if ".bitpress-" in p.name or p.name.startswith("spill-")]
    if left:
        problems.append(f"left beside the output: {left}")
    if tree(inp) != before:
        problems.append("the input was modified")
    return {"code": code, "stderr": stderr[-4000:], "problems": problems}


def _in_child(fn: Callable[[], dict[str, Any]], timeout: float) -> dict[str, Any]:
    """``fn()`` in a forked child: a signal (native crash) or a hang becomes a result, not the end of the run."""
    rfd, wfd = os.pipe()
    native = tempfile.TemporaryFile()  # noqa: SIM115 - the child writes it, the parent closes it after the fork
    pid = os.fork()
    if pid == 0:  # the child
        os.close(rfd)
        os.dup2(native.fileno(), 2)  # what native code (ONNX Runtime) writes to stderr is stderr too
        try:
            res = fn()
        except BaseException as exc:
            res = {"code": "fuzzer error", "stderr": repr(exc), "problems": [f"fuzzer error: {exc!r}"]}
        native.seek(0)
        text = native.read().decode("utf-8", "replace").strip()
        if text:
            res["problems"].append(f"native code wrote to stderr: {text[:300]!r}")
        with os.fdopen(wfd, "w") as f:
            json.dump(res, f)
        os._exit(0)
    os.close(wfd)
    native.close()
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.005)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(rfd)
        return {"code": "timeout", "stderr": "", "problems": [f"no result within {timeout:.0f} s (a hang?)"]}
    with os.fdopen(rfd) as f:
        text = f.read()
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        return {"code": sig, "stderr": "", "problems": [f"the process died of {sig} (a native crash)"]}
    try:
        return json.loads(text)
    except ValueError:
        return {"code": "no result", "stderr": text[-2000:], "problems": ["the child gave no result"]}


def build_bases(root: Path) -> dict[str, Path]:
    from bitpress import synthetic

    single = synthetic.build_decoder(root / "single" / "model.onnx", **MODEL)
    external = synthetic.build_decoder(root / "external" / "model.onnx", external_data=True, **MODEL)
    return {"single": single.parent, "external": external.parent}


def fuzz(seed: int, cases: int, *, seconds: float | None = None, keep: Path | None = None, fork: bool = True,
         timeout: float = 60.0, log: Callable[[str], None] = print, progress: int = 0) -> list[dict[str, Any]]:
    """Run cases ``seed .. seed+cases-1`` (stopping early after ``seconds``); returns the failures."""
    failures: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bitpress-fuzz-") as tmp:
        root = Path(tmp)
        bases = build_bases(root / "bases")
        outside = root / "secret.txt"
        outside.write_bytes(SECRET)
        # plugins and imports warmed once, before any fork: each child then costs milliseconds
        from bitpress import plugins

        plugins.get_registry()
        import onnxruntime  # noqa: F401

        done = 0
        for s in range(seed, seed + cases):
            if seconds is not None and time.monotonic() - t0 > seconds:
                break
            case_dir = root / f"case-{s}"
            case_dir.mkdir()
            case = make_case(s, bases, case_dir / "in", outside)

            def one(case_dir: Path = case_dir, case: Case = case) -> dict[str, Any]:
                return run_case(case_dir, case_dir / "in", case.options, run=fork)  # a crash ends no run

            res = _in_child(one, timeout) if fork else one()
            if SECRET in b"".join(p.read_bytes() for p in case_dir.rglob("*") if p.is_file()
                                  and not p.is_symlink() and "in" not in p.relative_to(case_dir).parts[:1]):
                res["problems"].append("the file outside the input folder was copied into the output")
            done += 1
            if res["problems"]:
                res.update(seed=s, storage=case.storage, options=case.options, ops=case.ops)
                if keep is not None:
                    dest = keep / f"case-{s}"
                    shutil.rmtree(dest, ignore_errors=True)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    case_dir_in = root / f"kept-{s}"
                    make_case(s, bases, case_dir_in, outside)  # the input as it was before the run
                    shutil.copytree(case_dir_in, dest / "in", symlinks=True)
                    (dest / "case.json").write_text(json.dumps(res, indent=2) + "\n")
                    res["kept"] = str(dest)
                failures.append(res)
                log(format_failure(res))
            shutil.rmtree(case_dir, ignore_errors=True)
            if progress and done % progress == 0:
                log(f"fuzz: {done} cases ({s}), {len(failures)} failing, {time.monotonic() - t0:.0f} s")
        log(f"fuzz: {done} cases from seed {seed} in {time.monotonic() - t0:.1f} s, {len(failures)} failing")
    return failures


def format_failure(res: dict[str, Any]) -> str:
    lines = [f"FAIL seed {res['seed']} ({res['storage']}, options {res['options']}): {'; '.join(res['problems'])}",
             *(f"    {op}" for op in res["ops"]),
             f"    exit {res['code']}; stderr: {res['stderr'].strip()[-600:]!r}",
             f"    replay: make fuzz SEED={res['seed']} N=1   "
             f"(or: python tests/fuzz/onnx_fuzz.py --seed {res['seed']} --cases 1)"]
    if "kept" in res:
        lines.append(f"    input kept in {res['kept']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=int(env("FUZZ_SEED") or -1),
                   help="first case seed (default: random, printed); env FUZZ_SEED")
    p.add_argument("--cases", type=int, default=int(env("FUZZ_CASES") or 2000), help="cases to run; env FUZZ_CASES")
    p.add_argument("--seconds", type=float, default=float(env("FUZZ_SECONDS") or 0) or None,
                   help="stop after this many seconds; env FUZZ_SECONDS")
    p.add_argument("--keep", type=Path, default=Path(env("FUZZ_KEEP") or Path(tempfile.gettempdir()) / "bitpress-fuzz"),
                   help="where failing inputs are kept; env FUZZ_KEEP")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take before it counts as a hang")
    p.add_argument("--progress", type=int, default=250, help="a progress line every this many cases (0: none)")
    p.add_argument("--no-fork", action="store_true", help="run cases in this process (a native crash ends the run)")
    args = p.parse_args(argv)
    seed = args.seed if args.seed >= 0 else random.SystemRandom().randrange(1 << 31)
    print(f"fuzz: seed {seed}, {args.cases} cases" + (f", at most {args.seconds:.0f} s" if args.seconds else ""),
          flush=True)
    failures = fuzz(seed, args.cases, seconds=args.seconds, keep=args.keep, fork=not args.no_fork,
                    timeout=args.timeout, log=lambda s: print(s, flush=True), progress=args.progress)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
