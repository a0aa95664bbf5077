"""Test utilities for plugin authors, shipped with the host (as :mod:`numpy.testing` is with numpy).

Not the plugin API: these are the small checks the plugins' own tests share (bitpress's
``tests/plugins`` use them), importable wherever ``bitpress`` is installed, in the host's
environment and in every plugin environment (``bitpress env create <name>``), where the
project's ``tests/`` folder is not importable. Only the host's dependencies (numpy, onnx,
ONNX Runtime) are imported, and ONNX Runtime only when a session is made: never torch, a
vendor toolkit or pytest at import.

Models
    :func:`load_proto`, :func:`op_counts`, :func:`initializers`, :func:`initializer_protos`,
    :func:`attrs`, :func:`matmul_nbits_nodes`, :func:`int8_weights`,
    :func:`max_abs_int8_weight`, :func:`activation_scales`, :func:`zero_point_types`,
    :func:`weight_scales`, :func:`assert_plain_onnx`. Each takes a saved model's path or an
    ``onnx.ModelProto``.
ONNX Runtime
    :func:`session`, :func:`ort_outputs`, :func:`random_feeds`, :func:`relative_error`,
    :func:`output_error` (``||y_q - y|| / ||y||`` of a quantized model against its float model).
Processes
    :func:`run_python`, :func:`restored_logger`, :func:`process_state`.
A toolkit that is not installed
    :func:`unavailable_registry`, :func:`assert_plugin_loaded`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import numpy_helper

if TYPE_CHECKING:
    import onnxruntime as ort

    from bitpress.plugins import Registry

ModelLike = str | os.PathLike[str] | onnx.ModelProto

#: the op domains an ONNX Runtime build without custom-op libraries runs
STANDARD_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft"})
#: the seeds of :func:`output_error`'s two random batches
ERROR_SEEDS = (123, 124)

__all__ = [
    "ERROR_SEEDS",
    "STANDARD_DOMAINS",
    "activation_scales",
    "assert_plain_onnx",
    "assert_plugin_loaded",
    "attrs",
    "default_signals",
    "initializer_protos",
    "initializers",
    "int8_weights",
    "load_proto",
    "matmul_nbits_nodes",
    "max_abs_int8_weight",
    "op_counts",
    "ort_outputs",
    "output_error",
    "process_state",
    "random_feeds",
    "relative_error",
    "restored_logger",
    "run_python",
    "session",
    "unavailable_registry",
    "weight_scales",
    "zero_point_types",
]


# -- models ------------------------------------------------------------------------------------------------
def load_proto(model: ModelLike) -> onnx.ModelProto:
    """The model at ``model`` (a path; external data loaded), or ``model`` itself if it is a proto already."""
    return model if isinstance(model, onnx.ModelProto) else onnx.load(os.fspath(model))


def op_counts(model: ModelLike) -> collections.Counter[str]:
    """How many nodes of each op type the main graph has."""
    return collections.Counter(n.op_type for n in load_proto(model).graph.node)


def initializers(model: ModelLike) -> dict[str, np.ndarray]:
    """Every initializer as a numpy array, by name."""
    return {t.name: numpy_helper.to_array(t) for t in load_proto(model).graph.initializer}


def initializer_protos(model: ModelLike) -> dict[str, onnx.TensorProto]:
    """Every initializer as its ``TensorProto`` (its ONNX type, dims and storage), by name."""
    return {t.name: t for t in load_proto(model).graph.initializer}


def attrs(node: onnx.NodeProto) -> dict[str, Any]:
    """A node's attributes, by name (absent ones are absent: ``attrs(n).get("axis")``)."""
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def matmul_nbits_nodes(model: ModelLike) -> list[onnx.NodeProto]:
    """The ``MatMulNBits`` nodes, in graph order."""
    return [n for n in load_proto(model).graph.node if n.op_type == "MatMulNBits"]


def int8_weights(model: ModelLike, min_size: int = 1000) -> dict[str, np.ndarray]:
    """The int8 / uint8 initializers of at least ``min_size`` values (quantized weights), by name, in graph order."""
    return {t.name: numpy_helper.to_array(t) for t in load_proto(model).graph.initializer
            if t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8) and math.prod(t.dims) >= min_size}


def max_abs_int8_weight(model: ModelLike) -> int:
    """The largest ``|q|`` of the int8 (signed) weights of :func:`int8_weights`: 127 or 128 with 8-bit weights,
    64 with ``reduce_range``. Fails if the model has none."""
    weights = [w for w in int8_weights(model).values() if w.dtype == np.int8]
    assert weights, "no int8 weights of 1000+ values"
    return max(int(np.abs(w.astype(np.int16)).max()) for w in weights)


def activation_scales(model: ModelLike) -> dict[str, float]:
    """The scale of every ``QuantizeLinear`` (activations in QDQ), by the quantized tensor's name.

    A scale must be per tensor (one value, of any shape); a larger one is an error.
    """
    proto = load_proto(model)
    inits = initializers(proto)
    out = {}
    for n in proto.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[1] in inits:
            scale = inits[n.input[1]]
            if scale.size != 1:
                raise ValueError(f"QuantizeLinear {n.name!r}: a scale of {scale.size} values, not per tensor")
            out[n.input[0]] = float(scale.reshape(-1)[0])
    return out


def zero_point_types(model: ModelLike) -> tuple[set[np.dtype], set[np.dtype]]:
    """The numpy dtypes of the weights' and of the activations' zero points (QDQ ``DequantizeLinear`` inputs 2):
    a weight's ``DequantizeLinear`` reads an initializer, an activation's does not."""
    proto = load_proto(model)
    inits = initializers(proto)
    weights: set[np.dtype] = set()
    acts: set[np.dtype] = set()
    for n in proto.graph.node:
        if n.op_type == "DequantizeLinear" and len(n.input) > 2 and n.input[2] in inits:
            (weights if n.input[0] in inits else acts).add(inits[n.input[2]].dtype)
    return weights, acts


def weight_scales(model: ModelLike, op_types: Iterable[str] = ("MatMul",)) -> list[np.ndarray]:
    """The scales of the weights' ``DequantizeLinear`` (input 0 an initializer) feeding a node of ``op_types``,
    in graph order."""
    proto = load_proto(model)
    inits = initializers(proto)
    kinds = set(op_types)
    into = {i for n in proto.graph.node if n.op_type in kinds for i in n.input}
    return [inits[n.input[1]] for n in proto.graph.node
            if n.op_type == "DequantizeLinear" and n.input[0] in inits and n.output[0] in into]


def assert_plain_onnx(model: ModelLike) -> None:
    """Only standard and ``com.microsoft`` ops (:data:`STANDARD_DOMAINS`), every used domain declared, nothing
    else declared: a model that ONNX Runtime runs without a toolkit's custom-op library."""
    proto = load_proto(model)
    used = {n.domain for n in proto.graph.node}
    declared = {o.domain for o in proto.opset_import}
    assert used <= STANDARD_DOMAINS, f"ops from {used - STANDARD_DOMAINS} need a custom-op library"
    assert used - {""} <= declared, f"op domains used but not declared: {used - {''} - declared}"
    assert declared <= STANDARD_DOMAINS, f"unused opset imports left: {declared - STANDARD_DOMAINS}"


# -- ONNX Runtime ----------------------------------------------------------------------------------------
def session(path: str | os.PathLike[str], *, exact_qdq: bool = False) -> ort.InferenceSession:
    """A quiet CPU session of the saved model at ``path``.

    ``exact_qdq``: ONNX Runtime fuses ``DequantizeLinear -> MatMul`` into MatMulNBits at load, by default at
    accuracy level 4 (int8 activations, its own error on top of the quantizer's); with ``exact_qdq`` it fuses
    at level 1 (float32), which computes what the QDQ graph says (``session.qdq_matmulnbits_accuracy_level``).
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if exact_qdq:
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    return ort.InferenceSession(os.fspath(path), opts, providers=["CPUExecutionProvider"])


def ort_outputs(path: str | os.PathLike[str], feeds: dict[str, np.ndarray], *,
                exact_qdq: bool = False) -> list[np.ndarray]:
    """Every output of :func:`session` ``(path)`` run on ``feeds``."""
    return session(path, exact_qdq=exact_qdq).run(None, feeds)


def random_feeds(src: str | os.PathLike[str], seed: int, *, batch: int = 2, seq: int = 16) -> dict[str, np.ndarray]:
    """Random inputs for every graph input of the model at ``src`` (:func:`bitpress.synthetic.random_inputs`)."""
    from bitpress import synthetic

    return synthetic.random_inputs(src, batch=batch, seq=seq, seed=seed)


def relative_error(ref: np.ndarray, approx: np.ndarray) -> float:
    """``||approx - ref|| / ||ref||`` (Frobenius norm over every element)."""
    return float(np.linalg.norm(ref - approx) / np.linalg.norm(ref))


def output_error(src: str | os.PathLike[str], out: str | os.PathLike[str], *, every_output: bool = False,
                 finite: bool = False, exact_qdq: bool = False, seeds: Iterable[int] = ERROR_SEEDS,
                 batch: int = 2, seq: int = 16) -> float:
    """:func:`relative_error` of the model at ``out`` against the float model at ``src``, the worst over
    :func:`random_feeds` batches (one per seed; ``batch`` x ``seq`` tokens).

    Of the first output only, unless ``every_output`` (then ``out`` must have as many outputs as ``src``, and
    the worst of them counts). ``finite``: every output of ``out`` (a session runs them all) must be finite.
    ``exact_qdq``: both sessions as :func:`session` makes them with it.
    """
    ref, quant = session(src, exact_qdq=exact_qdq), session(out, exact_qdq=exact_qdq)
    worst = 0.0
    for seed in seeds:
        feeds = random_feeds(src, seed, batch=batch, seq=seq)
        got = quant.run(None, feeds)
        if every_output:
            assert len(got) == len(ref.get_outputs()), (len(got), len(ref.get_outputs()))
        if finite:
            assert all(np.isfinite(o).all() for o in got), "non-finite outputs"
        want = ref.run(None, feeds)
        pairs = zip(want, got, strict=True) if every_output else [(want[0], got[0])]
        for a, b in pairs:
            worst = max(worst, relative_error(a, b))
    return worst


# -- processes -------------------------------------------------------------------------------------------
def run_python(code: str, *args: str, timeout: float, cwd: str | os.PathLike[str] | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -c code *args`` in a fresh process of this interpreter (nothing imported before); fails with
    its stderr unless it exits 0. Text output captured."""
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc


def default_signals() -> None:
    """A ``preexec_fn`` for a subprocess a test stops with a signal: SIGINT, SIGTERM and SIGHUP at their default.

    A signal ignored when bitpress starts stays ignored (``nohup`` ignores SIGHUP; a shell's background job
    SIGINT), and the child inherits what the test runner ignores: without this, a suite started under
    ``nohup`` would see its SIGHUP tests hang."""
    import signal

    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)


@contextlib.contextmanager
def restored_logger(name: str = "bitpress") -> Iterator[logging.Logger]:
    """The logger's handlers, level and ``propagate`` put back afterwards (the CLI points ``bitpress`` at the
    stderr of the moment: in a test, pytest's capture)."""
    logger = logging.getLogger(name)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        yield logger
    finally:
        logger.handlers[:] = saved[0]
        logger.setLevel(saved[1])
        logger.propagate = saved[2]


def process_state() -> dict[str, object]:
    """What a contained toolkit call must leave as it was: the root logger (handlers, level, filters), the
    warning filters and ``showwarning``, ``logging.basicConfig``, ``os.environ``, ``sys.path``, ``sys.stdout``
    and ``sys.stderr``. Compare one taken before with one taken after; add the toolkit's own items."""
    root = logging.getLogger()
    return {
        "root_handlers": list(root.handlers), "root_level": root.level, "root_filters": list(root.filters),
        "warning_filters": list(warnings.filters), "showwarning": warnings.showwarning,
        "basicConfig": logging.basicConfig, "environ": dict(os.environ), "sys_path": list(sys.path),
        "stdout": sys.stdout, "stderr": sys.stderr,
    }


# -- a toolkit that is not installed ----------------------------------------------------------------------
def unavailable_registry(plugin: str, monkeypatch: Any, tmp_path: Path) -> Registry:
    """The installed plugins (entry points), with no plugin environment: an environment named ``plugin``
    would run its passes. Fails the test if the plugin itself is not installed. ``monkeypatch``: pytest's
    fixture (``BITPRESS_ENVS`` points at an empty folder under ``tmp_path`` for the test)."""
    import importlib.metadata as md

    from bitpress.plugins import Registry

    if not any(ep.name == plugin for ep in md.entry_points(group="bitpress")):
        import pytest

        pytest.fail(f"bitpress-{plugin} is not installed in this environment: run `make venv` "
                    f"(or pip install -e plugins/{plugin})")
    monkeypatch.setenv("BITPRESS_ENVS", str(Path(tmp_path) / "no-envs"))
    return Registry()


def assert_plugin_loaded(plugins_output: str, plugin: str) -> None:
    """``bitpress plugins`` printed ``plugin`` as loaded (``ok``): listed, not broken, toolkit or not."""
    assert any(line.startswith(f"{plugin} ") and line.rstrip().endswith("ok")
               for line in plugins_output.splitlines()), plugins_output
