"""Where independent work runs: a thread pool on this machine (the default), or a Ray cluster.

Per-tensor work (the weight-only solve of every ONNX weight) and the jobs of a sweep go through
one small interface: :meth:`Executor.submit` returns a :class:`concurrent.futures.Future`, so
the code that waits for results, bounds the work in flight and writes the output is the same
for both engines. The caller keeps the writing: results come back to the driver, which writes
them, so an output is never assembled on a worker.

``threads``: a :class:`~concurrent.futures.ThreadPoolExecutor` of ``jobs`` threads (numpy
releases the GIL in the solvers' array work).

``ray``: each submitted call is a Ray task (``ray.remote``, one CPU each) in a worker process of
the cluster. Tasks are given where to read their input (a file, an offset, a length), never the
array; a task whose worker dies (killed, out of memory) is retried ``max_retries`` times by Ray
before the run fails. ``address`` None starts a private local Ray runtime for the run (as many
CPUs as ``jobs``, bound to 127.0.0.1, its temporary folder removed afterwards); ``"auto"``
joins the cluster this machine belongs to (``ray start``); ``ray://HOST:PORT`` a Ray client
server. Files the tasks read must be visible at the same path on every node:
:meth:`Executor.check_shared` asks each node before any work starts.

Ray is imported only when a ``ray`` executor is opened (the ``bitpress[ray]`` extra).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bitpress.errors import BitpressError, UsageError

log = logging.getLogger(__name__)

TYPES = ("threads", "ray")
RAY_HINT = 'pip install "bitpress[ray]"'
_SPEC_KEYS = {"type", "address", "max_retries", "num_cpus"}
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
#: Ray's switch for "this machine only" (read by ray._private.ray_constants and its processes)
_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@dataclass(frozen=True)
class ExecutorSpec:
    """Which engine runs the work, and how (``executor:`` in a config, ``--executor`` on the CLI)."""

    type: str = "threads"
    #: ray only: None starts a local runtime; "auto" joins this machine's cluster; "ray://HOST:PORT"
    address: str | None = None
    #: ray only: how often a task whose worker died is run again before the run fails
    max_retries: int = 3
    #: ray only: CPUs each task reserves
    num_cpus: float = 1.0

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise UsageError(f"executor type must be one of {', '.join(TYPES)}, got {self.type!r}")
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise UsageError(f"executor address must be a non-empty string (auto, ray://HOST:PORT), got "
                             f"{self.address!r}")
        if self.address is not None and self.type != "ray":
            raise UsageError("an executor address applies to type ray only")
        if not isinstance(self.max_retries, int) or isinstance(self.max_retries, bool) or not \
                0 <= self.max_retries <= 100:
            raise UsageError(f"executor max_retries must be an integer from 0 to 100, got {self.max_retries!r}")
        if isinstance(self.num_cpus, bool) or not isinstance(self.num_cpus, int | float) or not \
                0 < self.num_cpus <= 1024:
            raise UsageError(f"executor num_cpus must be a number above 0, got {self.num_cpus!r}")

    @classmethod
    def from_value(cls, value: Any) -> ExecutorSpec:
        """``None`` / ``"threads"`` / ``"ray"`` / ``{"type": "ray", "address": "auto", ...}``."""
        if value is None:
            return cls()
        if isinstance(value, ExecutorSpec):
            return value
        if isinstance(value, str):
            return cls(type=value)
        if isinstance(value, dict):
            unknown = sorted(set(value) - _SPEC_KEYS)
            if unknown:
                raise UsageError(f"unknown executor key(s) {', '.join(map(str, unknown))}; valid: "
                                 f"{', '.join(sorted(_SPEC_KEYS))}")
            return cls(**value)
        raise UsageError(f"executor must be threads, ray or a mapping with a type, got {type(value).__name__}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "ray":
            out.update(address=self.address, max_retries=self.max_retries, num_cpus=self.num_cpus)
        return out


class Executor:
    """Runs submitted calls somewhere; subclasses decide where."""

    name = "executor"
    #: how many submitted calls run at once
    workers = 1

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        raise NotImplementedError

    def check_shared(self, paths: Iterable[Path]) -> None:
        """Raise :class:`UsageError` when a worker cannot read ``paths`` as the driver does."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; ``cancel_futures`` drops what has not started (what
        :func:`bitpress.interrupts.cancel_pending` calls on an error or a signal)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown(wait=True, cancel_futures=exc[0] is not None)


class ThreadExecutor(Executor):
    """A thread pool on this machine."""

    name = "threads"

    def __init__(self, jobs: int) -> None:
        self.workers = max(1, int(jobs))
        self._pool = ThreadPoolExecutor(self.workers)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def _stat_files(paths: list[str]) -> dict[str, int | None]:
    """On a worker: each path's size, or None when it is not there (the shared-storage check)."""
    return {p: (os.path.getsize(p) if os.path.isfile(p) else None) for p in paths}


class RayExecutor(Executor):
    """Ray tasks: a private local runtime, or a cluster (``address``)."""

    name = "ray"

    def __init__(self, spec: ExecutorSpec, jobs: int) -> None:
        try:
            import ray
        except ImportError:
            raise UsageError(f"the ray executor needs Ray, which is not installed: {RAY_HINT}") from None
        self._ray = ray
        self.spec = spec
        self._tmp: str | None = None
        self._owned = False
        self._remotes: dict[Any, Any] = {}
        #: the tasks not finished yet (a finished one's reference is dropped: Ray then frees its result
        #: from the object store once the caller has written it)
        self._refs: set[Any] = set()
        self._lock = threading.Lock()
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "configure_logging": False}
            if spec.address is None:
                # a private runtime for this run: this machine only, on the loopback address, its
                # sockets and logs in a temporary folder removed at the end
                self._tmp = tempfile.mkdtemp(prefix="bitpress-ray-")
                kwargs.update(num_cpus=max(1, int(jobs)), _node_ip_address="127.0.0.1", _temp_dir=self._tmp,
                              object_store_memory=_object_store_bytes())
            else:
                kwargs["address"] = spec.address
            try:
                with _own_signals(), _loopback(spec.address is None):
                    ray.init(**kwargs)
            except Exception as exc:  # ConnectionError, RuntimeError, ValueError: Ray's many kinds
                self._remove_tmp()
                where = f"the Ray cluster at {spec.address}" if spec.address else "a local Ray runtime"
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                raise UsageError(f"cannot start or reach {where}: {first}") from None
            self._owned = True
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        self.workers = max(1, int(cpus // spec.num_cpus))
        log.info("ray executor: %d worker slot(s) on %d node(s)", self.workers, len(self._alive_nodes()))

    def _alive_nodes(self) -> list[dict[str, Any]]:
        return [n for n in self._ray.nodes() if n.get("Alive")]

    def _remote(self, fn: Callable[..., Any]) -> Any:
        remote = self._remotes.get(fn)
        if remote is None:
            remote = self._ray.remote(fn).options(num_cpus=self.spec.num_cpus, max_retries=self.spec.max_retries,
                                                  retry_exceptions=False)
            self._remotes[fn] = remote
        return remote

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        ref = self._remote(fn).remote(*args, **kwargs)
        with self._lock:
            self._refs.add(ref)
        fut: Future[Any] = Future()

        def settle(done: Future[Any]) -> None:
            with self._lock:
                self._refs.discard(ref)
            if fut.cancelled():
                return
            try:
                fut.set_result(done.result())
            except BaseException as exc:  # a task's own error, or Ray's (worker died after its retries)
                fut.set_exception(_task_error(self._ray, exc))

        ref.future().add_done_callback(settle)
        return fut

    def check_shared(self, paths: Iterable[Path]) -> None:
        want = {str(Path(p).resolve()): os.path.getsize(p) for p in paths}
        if not want:
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        stat = self._ray.remote(_stat_files)
        nodes = self._alive_nodes()
        refs = [stat.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(list(want)) for n in nodes]
        seen = {n.get("NodeManagerAddress") or n["NodeID"]: got
                for n, got in zip(nodes, self._ray.get(refs), strict=True)}
        problems = shared_problems(want, seen)
        if problems:
            raise UsageError(
                f"the Ray workers cannot read the model as this machine does: {'; '.join(problems[:5])}"
                f"{f' and {len(problems) - 5} more' if len(problems) > 5 else ''}. Put the model on storage every "
                "node mounts at the same path (NFS, a shared volume), or run with --executor threads"
            )

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        ray = self._ray
        with self._lock:
            refs = list(self._refs)
            self._refs.clear()
        if cancel_futures:
            for ref in refs:
                with contextlib.suppress(Exception):  # finished ones, or a runtime already gone
                    ray.cancel(ref, force=True)
        elif wait and refs:
            with contextlib.suppress(Exception):  # their errors went to the futures already
                ray.wait(refs, num_returns=len(refs))
        self._remotes.clear()
        if self._owned:
            with _own_signals():
                ray.shutdown()
            self._owned = False
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


@contextlib.contextmanager
def _own_signals() -> Iterator[None]:
    """Keep this process's signal handlers across Ray's start and stop: ``ray.init`` installs its own
    SIGTERM handler (``sys.exit``), which would end a run without the cleanup and the one-line
    message of :mod:`bitpress.interrupts`; SIGINT and SIGHUP are kept the same way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                with contextlib.suppress(OSError, ValueError):
                    signal.signal(sig, handler)


@contextlib.contextmanager
def _loopback(private: bool) -> Iterator[None]:
    """A private runtime listens on 127.0.0.1 only. Ray resolves a loopback ``_node_ip_address`` to
    the machine's network address unless it believes it runs without clusters (its macOS / Windows
    default), so it is told so while it starts; its processes inherit the setting."""
    if not private:
        yield
        return
    from ray._private import ray_constants

    old_flag, old_env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(_RAY_CLUSTER_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[_RAY_CLUSTER_ENV] = "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old_env is None:
            os.environ.pop(_RAY_CLUSTER_ENV, None)
        else:
            os.environ[_RAY_CLUSTER_ENV] = old_env


def shared_problems(want: dict[str, int], seen: dict[str, dict[str, int | None]]) -> list[str]:
    """What each node (address -> path -> size or None) does not see as the driver does (path -> size)."""
    problems = []
    for node, got in seen.items():
        for path, size in want.items():
            have = got.get(path)
            if have != size:
                state = "missing" if have is None else f"{have} bytes, not {size}"
                problems.append(f"{path} on node {node} ({state})")
    return problems


def _object_store_bytes() -> int:
    """The local runtime's shared-memory store: it holds results in flight only (the driver writes
    them out as they come), so a tenth of this machine's memory, from 256 MB to 4 GB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return int(min(4 << 30, max(256 << 20, total // 10)))


def _task_error(ray: Any, exc: BaseException) -> BaseException:
    """A task's own exception as it was raised; Ray's wrappers of it unwrapped."""
    from ray.exceptions import RayTaskError, WorkerCrashedError

    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    if isinstance(exc, WorkerCrashedError):
        return BitpressError(f"a Ray worker died running a task, and its retries too: {exc}")
    return exc


def open_executor(spec: ExecutorSpec | Any, *, jobs: int) -> Executor:
    """The executor ``spec`` names (see :class:`ExecutorSpec`), with ``jobs`` threads or local CPUs."""
    spec = ExecutorSpec.from_value(spec)
    if spec.type == "ray":
        return RayExecutor(spec, jobs)
    return ThreadExecutor(jobs)


@contextlib.contextmanager
def executor(spec: ExecutorSpec | Any, *, jobs: int) -> Iterator[Executor]:
    """``with executor(spec, jobs=n) as ex:`` — :func:`open_executor`, shut down at the end."""
    ex = open_executor(spec, jobs=jobs)
    with ex:
        yield ex
