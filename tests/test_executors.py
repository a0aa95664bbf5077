"""The executor interface: threads and Ray give the same bytes; Ray retries a lost task; nothing is left behind.

The Ray tests run a real local Ray runtime (2 CPUs, 127.0.0.1): one for the module (the
executor joins it, as it joins a cluster), and one the executor starts and stops itself.
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import bitpress
from bitpress.errors import BitpressError, ConfigError, UsageError
from bitpress.executors import ExecutorSpec, open_executor, shared_problems
from bitpress.quant.solver import BlockSpec, QuantizedBlocks

ALGORITHMS = [("rtn", {"block_size": 32, "is_symmetric": False}), ("hqq", {"block_size": 32}),
              ("kquant", {"block_size": 32})]


# -- the spec ------------------------------------------------------------------------------------------
def test_spec_from_values() -> None:
    assert ExecutorSpec.from_value(None).type == "threads"
    assert ExecutorSpec.from_value("ray") == ExecutorSpec(type="ray")
    spec = ExecutorSpec.from_value({"type": "ray", "address": "auto", "max_retries": 1})
    assert (spec.address, spec.max_retries) == ("auto", 1)
    assert ExecutorSpec.from_value(spec.to_json()) == spec


@pytest.mark.parametrize(("value", "words"), [
    ("dask", "must be one of threads, ray"),
    ({"type": "ray", "adress": "auto"}, "unknown executor key(s) adress"),
    ({"type": "threads", "address": "auto"}, "applies to type ray only"),
    ({"type": "ray", "max_retries": "3"}, "max_retries must be an integer"),
    ({"type": "ray", "num_cpus": 0}, "num_cpus must be a number above 0"),
    (3, "executor must be threads, ray or a mapping"),
])
def test_spec_refuses_bad_values(value: Any, words: str) -> None:
    with pytest.raises(UsageError, match="executor") as info:
        ExecutorSpec.from_value(value)
    assert words in str(info.value)


def test_config_executor_errors_name_the_key(tiny_decoder: Path, tmp_path: Path) -> None:
    cfg = {"input": str(tiny_decoder), "output": str(tmp_path / "out"), "passes": [{"type": "rtn"}],
           "executor": {"type": "ray", "addres": "auto"}}
    with pytest.raises(ConfigError, match=r"^executor: unknown executor key\(s\) addres"):
        bitpress.run(cfg)
    assert not (tmp_path / "out").exists()


def test_shared_problems_name_the_node_and_the_file() -> None:
    want = {"/m/model.onnx.data": 100}
    seen = {"10.0.0.2": {"/m/model.onnx.data": 100}, "10.0.0.3": {"/m/model.onnx.data": None},
            "10.0.0.4": {"/m/model.onnx.data": 7}}
    problems = shared_problems(want, seen)
    assert problems == ["/m/model.onnx.data on node 10.0.0.3 (missing)",
                        "/m/model.onnx.data on node 10.0.0.4 (7 bytes, not 100)"]


def test_cli_address_needs_ray(run_cli: Any, tiny_decoder: Path, tmp_path: Path) -> None:
    code, _, err = run_cli("quantize", "-m", tiny_decoder, "-o", tmp_path / "o.onnx", "--algorithm", "rtn",
                           "--address", "auto")
    assert code != 0 and "--address needs --executor ray" in err


def test_threads_executor_runs_and_drops_queued_work() -> None:
    with open_executor("threads", jobs=2) as ex:
        assert ex.workers == 2
        assert [f.result() for f in [ex.submit(pow, 2, i) for i in range(4)]] == [1, 2, 4, 8]
        ex.check_shared([Path(__file__)])  # threads read what the driver reads


# -- Ray ---------------------------------------------------------------------------------------------------
ray = pytest.importorskip("ray")
# Ray's driver ends its process (exit status 1, not a word) when it loses its runtime: each test that
# starts or joins one runs in a process of its own, which a failure then names (tests/own_process.py)
own_process = pytest.mark.own_process


@pytest.fixture(scope="module")
def ray_runtime() -> Any:
    """A local Ray runtime for the module (2 CPUs, loopback only, its files in a temporary folder)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers run this module's solvers
    from own_process import scratch

    # in the test's own process (below): the scratch folder, whose logs a failure shows
    tmp = tempfile.mkdtemp(prefix="bp-ray-", dir=scratch())
    from bitpress.executors import _loopback

    with _loopback(True):  # as the executor starts its own: this machine only
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _node_ip_address="127.0.0.1", _temp_dir=tmp, object_store_memory=128 << 20)
    yield tmp
    ray.shutdown()
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


def _square(x: int) -> int:
    return x * x


def _quantize(src: Path, out: Path, algorithm: str, options: dict[str, Any], executor: Any = None) -> Path:
    bitpress.quantize(src, out, algorithm=algorithm, options=options, jobs=2, executor=executor)
    return out


@pytest.mark.parametrize(("algorithm", "options"), ALGORITHMS, ids=[a for a, _ in ALGORITHMS])
@pytest.mark.parametrize("fixture", ["tiny_decoder_external", "tiny_decoder"])
@own_process
def test_ray_output_is_byte_identical_to_threads(ray_runtime: Any, request: pytest.FixtureRequest, fixture: str,
                                                 algorithm: str, options: dict[str, Any], tmp_path: Path,
                                                 sha256_tree: Any) -> None:
    """External data (tasks read their file range) and weights inside the .onnx (tasks get the values)."""
    src = request.getfixturevalue(fixture)
    threads = _quantize(src, tmp_path / "threads", algorithm, options)
    on_ray = _quantize(src, tmp_path / "ray", algorithm, options, executor="ray")
    assert sha256_tree(on_ray) == sha256_tree(threads)


@own_process
def test_ray_tasks_read_the_weight_themselves(ray_runtime: Any, tiny_decoder_external: Path) -> None:
    """A task carries a file range, not the array: its arguments are a few hundred bytes."""
    import pickle

    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.weightonly import WeightOnlyOptions, plan
    from bitpress.onnx.weightonly.solving import task_of

    model = OnnxModel.load(tiny_decoder_external)
    try:
        p = plan(model, WeightOnlyOptions(block_size=32))
        tasks = [task_of(model, g, False) for g in p.groups]
    finally:
        model.close()
    assert tasks and all(t.source.path is not None and t.source.values is None for t in tasks)
    assert max(len(pickle.dumps(t)) for t in tasks) < 1000


class _DieOnce:
    """A solver whose worker process dies (``os._exit``) the first time it runs anywhere: the marker
    file says it did. Ray must run the task again on a new worker."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self, w: np.ndarray, spec: BlockSpec, importance: np.ndarray | None = None) -> QuantizedBlocks:
        from bitpress_rtn.solver import rtn_solver

        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return rtn_solver(w, spec, importance)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        os._exit(1)


def _run_with_solver(src: Path, out: Path, solver: Any, executor: Any) -> None:
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.save import SaveOptions, save_onnx
    from bitpress.onnx.weightonly import WeightOnlyOptions, quantize_weights
    from bitpress.passes import PassContext

    model = OnnxModel.load(src)
    try:
        quantize_weights(model, WeightOnlyOptions(block_size=32), solver, PassContext(jobs=2, executor=executor))
        out.parent.mkdir(parents=True, exist_ok=True)
        save_onnx(model, out, SaveOptions(external_data=True))
    finally:
        model.close()


@own_process
def test_a_killed_worker_is_retried(ray_runtime: Any, tiny_decoder_external: Path, tmp_path: Path,
                                    sha256_tree: Any) -> None:
    from bitpress_rtn.solver import rtn_solver

    marker = tmp_path / "died"
    _run_with_solver(tiny_decoder_external, tmp_path / "ray" / "model.onnx", _DieOnce(str(marker)),
                     ExecutorSpec(type="ray", max_retries=2))
    assert marker.exists()  # a worker really died
    _run_with_solver(tiny_decoder_external, tmp_path / "threads" / "model.onnx", rtn_solver, None)
    assert sha256_tree(tmp_path / "ray") == sha256_tree(tmp_path / "threads")


@own_process
def test_a_task_lost_for_good_fails_the_run_cleanly(ray_runtime: Any, tiny_decoder_external: Path,
                                                    tmp_path: Path) -> None:
    """No retries left: one bitpress error, and the workflow leaves no output."""
    marker = tmp_path / "died"
    with pytest.raises(BitpressError, match="a Ray worker died"):
        _run_with_solver(tiny_decoder_external, tmp_path / "out" / "model.onnx", _DieOnce(str(marker)),
                         ExecutorSpec(type="ray", max_retries=0))
    assert not (tmp_path / "out" / "model.onnx").exists()


@own_process
def test_a_task_error_is_the_error_the_solver_raised(ray_runtime: Any, tiny_decoder_external: Path,
                                                     tmp_path: Path) -> None:
    import onnx
    from onnx import numpy_helper

    bad = tmp_path / "nan" / "model.onnx"
    m = onnx.load(str(tiny_decoder_external))
    init = next(t for t in m.graph.initializer if len(t.dims) == 2 and t.dims[0] >= 64 and t.dims[1] >= 64)
    arr = numpy_helper.to_array(init).copy()
    arr[0, 0] = np.nan
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    bad.parent.mkdir()
    onnx.save(m, str(bad), save_as_external_data=True, location="model.onnx.data")
    with pytest.raises(bitpress.errors.QuantizationError, match="NaN"):
        bitpress.quantize(bad, tmp_path / "out", algorithm="rtn", options={"block_size": 32}, executor="ray")
    assert not (tmp_path / "out").exists()


@own_process
def test_check_shared_passes_on_one_machine(ray_runtime: Any, tiny_decoder_external: Path) -> None:
    with open_executor("ray", jobs=2) as ex:
        assert ex.workers == 2
        ex.check_shared([tiny_decoder_external, tiny_decoder_external.with_suffix(".onnx.data")])


@own_process
def test_cli_quantize_on_a_private_ray_runtime_leaves_nothing(tiny_decoder_external: Path, tmp_path: Path,
                                                              run_cli: Any, sha256_tree: Any) -> None:
    """Without a runtime, the executor starts one for the run (127.0.0.1) and removes its folder after."""
    if ray.is_initialized():  # the module's runtime, from the tests above: this one starts its own
        ray.shutdown()
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "bitpress-ray-*")))
    with open_executor("ray", jobs=2) as ex:  # the private runtime listens on the loopback address only
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        assert ex.submit(_square, 7).result() == 49
    assert not ray.is_initialized()
    code, _, err = run_cli("quantize", "-m", tiny_decoder_external, "-o", tmp_path / "ray", "--algorithm", "rtn",
                           "--option", "block_size=32", "--executor", "ray", "--jobs", "2")
    assert code == 0, err
    assert not ray.is_initialized()
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "bitpress-ray-*"))) == before
    code, _, err = run_cli("quantize", "-m", tiny_decoder_external, "-o", tmp_path / "threads", "--algorithm", "rtn",
                           "--option", "block_size=32")
    assert code == 0, err
    assert sha256_tree(tmp_path / "ray") == sha256_tree(tmp_path / "threads")
    assert not list(tmp_path.glob(".*bitpress-*"))  # no run folder left beside the outputs


_SLOW_RUN = """
import os, sys, time
from pathlib import Path
from bitpress.errors import Interrupted
from bitpress.interrupts import handle_signals
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.weightonly import WeightOnlyOptions, quantize_weights
from bitpress.passes import PassContext
from bitpress_rtn.solver import rtn_solver

started = sys.argv[2]

def slow(w, spec, importance=None):
    Path(started).touch()
    time.sleep(30)
    return rtn_solver(w, spec, importance)

model = OnnxModel.load(Path(sys.argv[1]))
try:
    with handle_signals():
        quantize_weights(model, WeightOnlyOptions(block_size=32), slow, PassContext(jobs=2, executor="ray"))
except Interrupted:
    print("interrupted")
    sys.exit(130)
"""


def test_sigterm_stops_a_ray_run_and_its_runtime(tiny_decoder_external: Path, tmp_path: Path) -> None:
    """Ray installs its own SIGTERM / SIGINT handlers; the executor keeps bitpress's, so a signal stops
    the run with its cleanup: the tasks cancelled, the private runtime and its folder gone."""
    import signal
    import subprocess
    import time

    started = tmp_path / "started"
    script = tmp_path / "slow.py"
    script.write_text(_SLOW_RUN)
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "bitpress-ray-*")))
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_decoder_external), str(started)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert started.exists(), proc.communicate(timeout=30)[0]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in out, out
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "bitpress-ray-*"))) == before


def test_a_pass_that_does_not_distribute_says_so(tiny_decoder: Path, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """bnb4 has its own writer on this machine's threads: with --executor ray the run says so and goes on
    (no Ray runtime is started for it)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="bitpress"):
        bitpress.quantize(tiny_decoder, tmp_path / "out.onnx", algorithm="nf4", executor="ray")
    assert "pass bnb4 runs on this machine" in caplog.text
    assert (tmp_path / "out.onnx").exists() and not ray.is_initialized()
