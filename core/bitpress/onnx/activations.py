"""Per-input-channel activation statistics, for algorithms that weight their error by them.

llama.cpp's imatrix idea: the mean of ``x**2`` for every input channel of a MatMul tells which
columns of its weight matter. Collected by running the model once per calibration sample
in ONNX Runtime with the MatMul inputs exposed as extra outputs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx

from bitpress.errors import QuantizationError
from bitpress.models.onnx_model import OnnxModel

log = logging.getLogger(__name__)


def channel_importance(
    model: OnnxModel, readers: dict[str, list[str]], feeds: Iterable[dict[str, np.ndarray]], workdir: Path,
) -> dict[str, np.ndarray]:
    """``{weight: mean(x**2) per input channel}`` for ``readers`` = ``{weight: [activation names]}``."""
    import onnxruntime as ort

    from bitpress.onnx.save import SaveOptions, save_onnx

    wanted = sorted({a for acts in readers.values() for a in acts})
    if not wanted:
        return {}
    copy = onnx.ModelProto()
    copy.CopyFrom(model.proto)
    existing = {o.name for o in copy.graph.output}
    for name in wanted:
        if name not in existing:
            copy.graph.output.append(onnx.ValueInfoProto(name=name))
    probe = OnnxModel(copy, model.source)
    probe.resolver = model.resolver  # same files: the input's data and this run's scratch
    path = Path(workdir) / "calibration" / "model.onnx"
    save_onnx(probe, path, SaveOptions(external_data=True, check=False))
    del copy, probe
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise QuantizationError(f"cannot run the model for calibration: {exc}") from None
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    n = 0
    for feed in feeds:
        outs = session.run(wanted, feed)
        for name, x in zip(wanted, outs, strict=True):
            x = np.asarray(x, dtype=np.float32)
            x2 = (x.reshape(-1, x.shape[-1]) ** 2).sum(axis=0)
            sums[name] = sums.get(name, 0) + x2
            counts[name] = counts.get(name, 0) + x.size // x.shape[-1]
        n += 1
    if n == 0:
        raise QuantizationError("the calibration data yielded no samples")
    del session
    result = {}
    for weight, acts in readers.items():
        total = sum(sums[a] for a in acts)
        count = sum(counts[a] for a in acts)
        result[weight] = (total / max(count, 1)).astype(np.float32)
    log.info("collected activation statistics for %d weights from %d samples", len(result), n)
    return result
