"""The ``bitpress`` command line: :func:`main` (the console script ``bitpress``, and ``python -m bitpress``).

This package owns the command line only: parsing arguments, printing results, exit codes. Library
code logs and raises; only the CLI prints. It may import anything in the host; nothing in the host
imports ``bitpress.cli``. Imports that are slow (the API, ONNX Runtime, tqdm, ...) stay inside the
commands, so that ``bitpress --help`` and ``bitpress passes list`` start fast.

Here: the top-level parser assembled from the command groups, the global flags, logging, and the one
``bitpress: error: ...`` line (or ``interrupted by ...``) for a failure. One module per command group:

- :mod:`~bitpress.cli.passes`: ``passes list``, ``passes show``
- :mod:`~bitpress.cli.env`: ``env create|list|remove|root``
- :mod:`~bitpress.cli.plugins`: ``plugins``, ``plugin new``
- :mod:`~bitpress.cli.quantize`: ``quantize``, ``run`` (and their ``--plan``)
- :mod:`~bitpress.cli.export`: ``export``, ``publish``, ``verify``
- :mod:`~bitpress.cli.sweep`: ``sweep``
- :mod:`~bitpress.cli.inspect`: ``inspect``
- :mod:`~bitpress.cli.evaluate`: ``eval``, ``bench``
- :mod:`~bitpress.cli.demo`: ``demo``
- :mod:`~bitpress.cli.common`: what they share (exit codes, the parser class, argument types, output formatting)

May import: any host module (and no host module imports this package).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

from bitpress import __version__, crashwatch
from bitpress.cli import demo, env, evaluate, export, inspect, passes, plugins, quantize, sweep
from bitpress.cli.common import EXIT_FAIL, EXIT_USAGE, Parser
from bitpress.errors import BitpressError, Interrupted
from bitpress.interrupts import Caught, handle_signals

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    if args.json and not getattr(args, "json_output", False):
        command = " ".join(str(getattr(args, k)) for k in vars(args) if k.endswith("command") and getattr(args, k))
        print(f"bitpress: error: `bitpress {command}` has no JSON output (--json)", file=sys.stderr)
        return EXIT_USAGE
    caught = Caught()  # the first signal; an interrupt can surface as another error (see Caught)
    # plugins run in this process: a native crash in one prints Python's stack and a line naming it
    crashwatch.enable()
    try:
        with handle_signals(caught):  # SIGINT, SIGTERM, SIGHUP raise Interrupted: the library's cleanup runs
            return int(args.func(args) or 0)
    except BitpressError as exc:
        if caught.signum is not None:
            return _interrupted(Interrupted(caught.signum), args.verbose, exc)
        if args.verbose:
            logging.getLogger("bitpress").exception("failed")
        print(f"bitpress: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        return _interrupted(exc, args.verbose)
    except Exception as exc:
        if caught.signum is not None:
            return _interrupted(Interrupted(caught.signum), args.verbose, exc)
        if args.verbose:
            raise
        print(f"bitpress: internal error: {type(exc).__name__}: {exc} (rerun with --verbose)", file=sys.stderr)
        return EXIT_FAIL
    finally:
        crashwatch.disable()


def _interrupted(exc: KeyboardInterrupt, verbose: bool, surfaced: BaseException | None = None) -> int:
    """One line for a run stopped by a signal; exit code 128 + the signal's number."""
    if surfaced is not None and verbose:  # the interrupt came out of library code as this error
        logging.getLogger("bitpress").debug("interrupted; it surfaced as:", exc_info=surfaced)
    signum = exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT)
    name = exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"
    written = getattr(exc, "written", None)
    done = f"{written} had been written completely" if written is not None else "nothing was written"
    print(f"bitpress: interrupted by {name}; {done}", file=sys.stderr)
    return 128 + signum


def _parser() -> argparse.ArgumentParser:
    """The whole command line; the commands in the order ``bitpress --help`` lists them."""
    p = Parser(prog="bitpress", description="Quantize models with pluggable backends.", root=True)
    p.add_argument("--version", action="version", version=f"bitpress {__version__}")
    sub = p.add_subparsers(dest="command")
    passes.add_passes(sub)
    env.add_env(sub)
    plugins.add_plugins(sub)
    plugins.add_plugin(sub)
    quantize.add_quantize(sub)
    export.add_export(sub)
    export.add_publish(sub)
    sweep.add_sweep(sub)
    export.add_verify(sub)
    quantize.add_run(sub)
    inspect.add_inspect(sub)
    evaluate.add_eval(sub)
    evaluate.add_bench(sub)
    demo.add_demo(sub)
    return p


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("bitpress")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)
    root.propagate = False
