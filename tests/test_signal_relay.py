"""A signal that reaches a thread other than the main one still stops the run at once (bitpress.interrupts).

The kernel gives a process-directed signal to any thread that does not block it; when that is not
the main thread (a native worker thread, or any thread while the main one blocks signals around a
``vfork``), Python runs the handler only once the main thread next runs Python code: a main
thread asleep would sleep on. Each test sends the signal straight to another thread
(``pthread_kill``) while the main thread sleeps for a minute.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from bitpress.testing import default_signals

pytestmark = pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX threads' signals only")

SCRIPT = textwrap.dedent("""
    import signal, sys, threading, time
    from bitpress.errors import Interrupted
    from bitpress.interrupts import _State, handle_signals

    SIG = getattr(signal, sys.argv[1])

    def other():  # the thread the kernel handed the signal to, once the main thread sleeps
        time.sleep(0.5)
        signal.pthread_kill(threading.get_ident(), SIG)
        time.sleep(120)

    t0 = time.monotonic()
    try:
        with handle_signals():
            threading.Thread(target=other, daemon=True).start()
            time.sleep(60)
        print("slept on")
    except Interrupted as exc:
        print(f"interrupted by {exc.signal_name} after {time.monotonic() - t0:.1f} s; handler ran {_State.calls} times")
    # the handlers and the wakeup descriptor are as they were
    assert signal.getsignal(SIG) in (signal.SIG_DFL, signal.default_int_handler), signal.getsignal(SIG)
    assert signal.set_wakeup_fd(-1) == -1
    assert not [t for t in threading.enumerate() if t.name == "bitpress-signal-relay"]
""")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_signal_taken_by_another_thread_wakes_the_main_thread(sig: str) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, sig], capture_output=True, text=True, timeout=120,
                          preexec_fn=default_signals)
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    assert words[:3] == ["interrupted", "by", sig], done.stdout
    assert float(words[4]) < 30, done.stdout  # woken, not at the end of the minute's sleep
    assert int(words[-2]) in (1, 2), done.stdout  # the signal, and perhaps its relayed copy (ignored)


FORK_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from bitpress.interrupts import _State, handle_signals

    with handle_signals():
        pid = os.fork()
        if pid == 0:  # a forked worker (multiprocessing's fork): its own signal is not its parent's
            signal.signal(signal.SIGTERM, lambda *a: None)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.5)
        print("parent calls", _State.calls)
""")


def test_forked_child_signal_stays_in_the_child() -> None:
    done = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["parent", "calls", "0"]
