"""What ``bitpress eval`` measures, as plain dataclasses that serialize to JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bitpress.errors import BitpressError


class EvalError(BitpressError):
    """The two models cannot be evaluated as given (unsupported inputs, ONNX Runtime failure)."""


class ModelMismatchError(EvalError):
    """QUANTIZED and the reference do not take the same inputs or give the same outputs."""


@dataclass
class OutputMetrics:
    """How far one output of the quantized model is from the reference's, over every sample.

    ``relative_l2`` is ``||q - r|| / ||r||`` and ``cosine`` is ``<q, r> / (||q|| ||r||)``, both over
    all elements of all samples; ``top1_agreement`` (logits only) is the share of positions
    whose arg-max over the last axis is the same.
    """

    name: str
    shape: list[int]  # of one sample's output
    elements: int  # compared, over all samples
    max_abs_error: float
    mean_abs_error: float
    relative_l2: float
    cosine: float
    top1_agreement: float | None = None
    is_logits: bool = False


@dataclass
class PerplexityResult:
    """Perplexity of both models on the same token windows (next-token NLL, no padding)."""

    text: str
    windows: int
    seq_len: int
    tokens: int  # predicted tokens: windows * (seq_len - 1)
    reference: float
    quantized: float

    @property
    def relative_change(self) -> float:
        return self.quantized / self.reference - 1.0 if self.reference else math.nan


@dataclass
class TensorError:
    """Quantization error of one quantized weight, against its float original in the reference.

    ``sqnr_db`` is ``10 * log10(||W||^2 / ||W - W_deq||^2)``; ``None`` (with a ``note``) when the
    tensor could not be matched or dequantized.
    """

    nodes: list[str]  # quantized nodes reading the tensor, in node order
    op_type: str
    quantized: str  # the quantized initializer
    weight: str | None  # the float initializer of the reference
    shape: list[int] = field(default_factory=list)  # of the float weight as stored
    bits: int | None = None
    block_size: int | None = None
    sqnr_db: float | None = None
    relative_error: float | None = None
    max_abs_error: float | None = None
    note: str = ""

    @property
    def node(self) -> str:
        return self.nodes[0]


@dataclass
class EvalResult:
    quantized: Path  # the .onnx files evaluated
    reference: Path
    data: str  # what the comparison ran on, in words
    samples: int  # model runs compared
    batch: int
    seq_len: int
    threads: int
    outputs: list[OutputMetrics] = field(default_factory=list)
    perplexity: PerplexityResult | None = None
    tensors: list[TensorError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    weights_compared: bool = True  # False with weights=False (--no-weights): ``tensors`` is empty by choice
    quantized_bytes: int = 0  # the .onnx file and the external data it reads
    reference_bytes: int = 0
    #: 8 x bytes stored for the quantized weights (integers, scales, zero points) / their weights
    bits_per_weight: float | None = None
    #: the passes that made QUANTIZED, from its ``bitpress`` metadata (``[{"pass", "plugin",
    #: "options"}]``); ``None`` when the model records none (not written by bitpress)
    quantization: list[dict[str, Any]] | None = None
    #: the kernel each quantized node of QUANTIZED runs on (:mod:`bitpress.onnx.kernels`)
    runtime: dict[str, Any] | None = None
    #: QUANTIZED's speed against the reference's, measured alternately (:func:`bitpress.speed.compare`);
    #: ``None`` with ``speed=False`` (``--no-speed``)
    speed: dict[str, Any] | None = None
    #: the Hugging Face Hub ids given (``quantized``, ``reference``, ``tokenizer``) and the commits they resolved
    #: to (:meth:`bitpress.hub.HubModel.record`); empty for local paths
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)

    def logits(self) -> OutputMetrics | None:
        return next((o for o in self.outputs if o.is_logits), None)

    def sqnr_summary(self) -> dict[str, Any] | None:
        """Lowest / median / highest SQNR of the matched tensors (``None`` without any)."""
        rows = [t for t in self.tensors if t.sqnr_db is not None]
        if not rows:
            return None
        values = sorted(t.sqnr_db for t in rows)  # type: ignore[misc]
        worst = min(rows, key=lambda t: t.sqnr_db)  # type: ignore[arg-type, return-value]
        mid = len(values) // 2
        median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
        return {"tensors": len(rows), "min_db": values[0], "median_db": median, "max_db": values[-1],
                "worst": worst.weight, "worst_node": worst.node}

    def to_json(self) -> dict[str, Any]:
        ppl = None
        if self.perplexity is not None:
            ppl = {**asdict(self.perplexity), "relative_change": self.perplexity.relative_change}
        out = {
            "quantized": str(self.quantized),
            "reference": str(self.reference),
            "data": self.data,
            "samples": self.samples,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "threads": self.threads,
            "outputs": [asdict(o) for o in self.outputs],
            "perplexity": ppl,
            "tensors": [{**asdict(t), "node": t.node} for t in self.tensors],
            "weights_compared": self.weights_compared,
            "sqnr_summary": self.sqnr_summary(),
            "notes": list(self.notes),
            "seconds": self.seconds,
            "quantized_bytes": self.quantized_bytes,
            "reference_bytes": self.reference_bytes,
            "bits_per_weight": self.bits_per_weight,
            "quantization": self.quantization,
            "runtime": self.runtime,
            "speed": self.speed,
            "sources": dict(self.sources),
        }
        return _finite(out)

    def write_html(self, path: str | Path) -> Path:
        """Write the self-contained HTML report (no scripts, styles or fonts from elsewhere)."""
        from bitpress.errors import OutputError
        from bitpress.evaluate.report import render_html

        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(render_html(self), encoding="utf-8")
        except OSError as exc:
            raise OutputError(f"cannot write the report {path}: {exc.strerror or exc}") from None
        return path


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
