"""How much each weight's rounding costs the model's output, measured (for the ``bpw`` budget).

Every planned weight is rounded alone to the layout it would get at the smallest size, and the
model is run on a few samples with that one weight replaced; the weight's sensitivity is the mean
KL divergence of the output distribution (the ``logits`` output, softmax over the last axis) from
the float model's, per position; for a model without logits (an encoder), the relative squared
error of its first output, ``||y - y0||^2 / ||y0||^2``. A tied table is one weight read twice (the embedding Gather and
the head), so its measure covers both reads.

One ONNX Runtime session serves every weight: the planned weights become *overridable
initializers* (graph inputs of the same name, IR 4 and later), so a run feeds only the one
rounded weight and reads every other from the model's own files, memory-mapped as
:mod:`bitpress.onnx.activations` does. Memory stays one rounded weight plus one run's activations
and the float model's log-probabilities of the samples.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper

from bitpress.errors import QuantizationError, one_line
from bitpress.onnx.activations import prune, relocate, session_for

if TYPE_CHECKING:
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.weightonly.planning import Group

log = logging.getLogger(__name__)

#: rows of the output handled at a time in float64 (bounds the copies of a wide vocabulary)
ROWS = 16

def _measured_output(graph: onnx.GraphProto) -> tuple[str, bool]:
    """The output the measure compares, and whether it is logits (KL) rather than features (squared error)."""
    names = [o.name for o in graph.output]
    for name in names:
        if name.endswith("logits"):
            return name, True
    if not names:
        raise QuantizationError("bpw: the model has no output to measure sensitivity on")
    return names[0], False


def _rows(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).reshape(-1, x.shape[-1])


def _kl(reference: np.ndarray, logits: np.ndarray) -> float:
    """Sum over rows of KL(softmax(reference) || softmax(logits)), in float64 by chunks of rows.

    Written with the logits' difference, ``sum p0 (z0 - z) - (lse(z0) - lse(z))``: log-probabilities
    rounded to float32 first would bury the small divergences of one rounded weight in their noise."""
    total = 0.0
    for r in range(0, reference.shape[0], ROWS):
        z0 = reference[r:r + ROWS].astype(np.float64)
        z = logits[r:r + ROWS].astype(np.float64)
        m0, m = z0.max(axis=1, keepdims=True), z.max(axis=1, keepdims=True)
        e0 = np.exp(z0 - m0)
        s0 = e0.sum(axis=1, keepdims=True)
        lse0 = m0 + np.log(s0)
        lse = m + np.log(np.exp(z - m).sum(axis=1, keepdims=True))
        total += float(((e0 / s0) * (z0 - z)).sum() - (lse0 - lse).sum())
    return total


def measure(
    model: OnnxModel, groups: list[Group], layouts: dict[str, tuple[int, int]], feeds: Iterable[dict[str, np.ndarray]],
) -> dict[str, float]:
    """``{weight: the output's divergence when only that weight is rounded to layouts[weight]}``."""
    from bitpress.onnx.weightonly.budget import fake_quantize, weight_matrix

    groups = [g for g in groups if g.weight in layouts]
    if not groups:
        return {}
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    graph = proto.graph
    output, logits = _measured_output(graph)
    del graph.output[:]
    graph.output.append(onnx.ValueInfoProto(name=output))
    prune(graph)
    inits = {t.name: t for t in graph.initializer}
    present = {i.name for i in graph.input}
    for g in groups:
        t = inits.get(g.weight)
        if t is None or g.weight in present:
            continue
        graph.input.append(helper.make_tensor_value_info(g.weight, t.data_type, list(t.dims)))
    proto.ir_version = max(proto.ir_version, 4)  # initializers that are inputs are overridable defaults
    base = relocate(proto, model)
    session = session_for(proto.SerializeToString(), base)
    del proto, graph

    feeds = list(feeds)
    started = time.perf_counter()
    try:
        reference = [_rows(session.run([output], feed)[0]) for feed in feeds]
        if not logits:
            reference = [r.astype(np.float64) for r in reference]
    except Exception as exc:  # ORT's own exception types
        raise QuantizationError(f"bpw: cannot run the model to measure sensitivity: {one_line(exc)}") from None
    result: dict[str, float] = {}
    for i, g in enumerate(groups):
        bits, block = layouts[g.weight]
        stored = model.array(g.weight)
        matrix = weight_matrix(model, g, stored)
        rounded = fake_quantize(matrix, bits, block, g.symmetric)
        if g.uses[0].rows_are_table_rows:  # back to the stored orientation
            rounded = rounded.T
        rounded = np.ascontiguousarray(rounded.astype(stored.dtype, copy=False))
        total = 0.0
        count = 0
        for feed, ref in zip(feeds, reference, strict=True):
            out = _rows(session.run([output], {**feed, g.weight: rounded})[0])
            if logits:
                total += _kl(ref, out)
                count += ref.shape[0]
            else:
                diff = out.astype(np.float64) - ref
                total += float(np.einsum("ij,ij->", diff, diff)) / max(float(np.einsum("ij,ij->", ref, ref)), 1e-30)
                count += 1
        result[g.weight] = max(total / max(count, 1), 0.0)
        if i == 0 or (i + 1) % 25 == 0 or i + 1 == len(groups):
            log.info("bpw: sensitivity of %d/%d weights measured (%.0f s)", i + 1, len(groups),
                     time.perf_counter() - started)
    return result
