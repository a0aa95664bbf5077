"""``python -m bitpress.speed.worker``: one model loaded in a process of its own, timed on request.

Protocol (one JSON object per line): the parent writes a :class:`~bitpress.speed.measure.SubjectSpec`;
the worker loads the model and answers ``{"ok": true, "load_s", "rss_after_load"}``. Then each
``{"cmd": "measure"}`` gets one measurement's timings, ``{"cmd": "profile", "runs": N}`` the
slowest nodes of N profiled runs (plain ONNX models, loaded with ``profile: true``), and
``{"cmd": "exit"}`` the process's peak resident memory before it exits. A failure answers
``{"ok": false, "error": "..."}``. Anything a native library prints goes to stderr: the
protocol has standard output to itself.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, TextIO


def _reply(out: TextIO, payload: dict[str, Any]) -> None:
    out.write(json.dumps(payload) + "\n")
    out.flush()


def _error(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:2000]


def serve(inp: TextIO, out: TextIO) -> int:
    from bitpress.speed.measure import OnnxSubject, SubjectSpec, load, peak_rss_bytes, rss_bytes
    from bitpress.speed.profile import slowest_nodes

    line = inp.readline()
    if not line:
        return 1
    raw = json.loads(line)
    profile = bool(raw.pop("profile", False))
    spec = SubjectSpec(**raw)
    tmp = tempfile.mkdtemp(prefix="bitpress-profile-") if profile else None
    try:
        subject = OnnxSubject(spec, os.path.join(tmp, "ort")) if tmp else load(spec)
    except Exception as exc:  # the model does not load: the parent names it
        _reply(out, {"ok": False, "error": _error(exc)})
        return 1
    _reply(out, {"ok": True, "load_s": subject.load_s, "rss_after_load": rss_bytes()})
    for line in inp:
        cmd = json.loads(line).get("cmd")
        try:
            if cmd == "measure":
                _reply(out, {"ok": True, **subject.measure()})
            elif cmd == "profile" and isinstance(subject, OnnxSubject):
                runs = int(json.loads(line).get("runs", 5)) + 1  # the first call is profiled too
                for _ in range(runs):
                    subject.session.run(None, subject.feeds["single"])
                _reply(out, {"ok": True, **slowest_nodes(subject.end_profiling())})
            elif cmd == "exit":
                _reply(out, {"ok": True, "peak_rss": peak_rss_bytes()})
                return 0
            else:
                _reply(out, {"ok": False, "error": f"unknown command {cmd!r}"})
        except Exception as exc:
            _reply(out, {"ok": False, "error": _error(exc)})
    return 0


def main() -> int:
    # the protocol keeps the real standard output; fd 1 (what native code prints to) becomes stderr
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return serve(sys.stdin, proto)


if __name__ == "__main__":
    raise SystemExit(main())
