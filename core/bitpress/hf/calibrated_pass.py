"""The base of calibrated passes on Hugging Face models (``gptq_hf``, ``awq_hf``, third parties').

Torch-free (plugins import it when they register). A plugin subclasses :class:`CalibratedHfPass`
and returns its :class:`~bitpress.hf.calibrated.Method` (a calibrated solver, an optional input
scaler, a block solver for tables) from :meth:`CalibratedHfPass.method`; the host machinery in
:mod:`bitpress.hf.calibrated` does the rest. See docs/huggingface.md, "Calibrated".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from bitpress.calibration.data import DataConfig
from bitpress.errors import QuantizationError, UsageError
from bitpress.hf.model import HfModel
from bitpress.hf.passes import HfQuantPass
from bitpress.hf.rules import HfQuantOptions
from bitpress.options import option
from bitpress.passes import PassContext

if TYPE_CHECKING:
    from bitpress.hf.calibrated import Method

log = logging.getLogger(__name__)


@dataclass
class CalibratedHfOptions(HfQuantOptions):
    """:class:`~bitpress.hf.rules.HfQuantOptions` plus what every calibrated pass takes."""

    sequential: bool = option(
        True, "inputs of each decoder block from the model whose earlier blocks are already quantized; "
        "false: the float model's (faster, usually a little worse)"
    )
    stream: bool = option(False, "calibration runs the model forward, so it is always loaded whole: must be false")

    def validate(self) -> None:
        super().validate()
        if self.stream:
            raise ValueError("stream: a calibrated pass runs the model on its calibration data, so it loads the "
                             "whole model; leave stream false (rtn_hf / kquant_hf stream)")


def check_float_model(model: HfModel, pass_name: str) -> None:
    """Refuse a model an earlier pass quantized: a calibration pass needs a clean float model (passes that
    leave it float, such as rotations, say so in their history entry: ``"float": true``)."""
    earlier = [str(h.get("pass", "?")) for h in model.history if isinstance(h, dict) and not h.get("float")]
    if earlier:
        raise QuantizationError(_order_message(pass_name, ", ".join(earlier), "already quantized this one"))


def check_order(passes: Sequence[Any]) -> None:
    """Refuse, before any pass runs, a calibrated pass after a Hugging Face quantization pass.

    For a workflow's steps (``[Rtn, Gptq]``); :meth:`CalibratedHfPass.run` checks the model itself too.
    """
    earlier: str | None = None
    for p in passes:
        if isinstance(p, CalibratedHfPass) and earlier is not None:
            raise UsageError(_order_message(p.name, earlier, "runs before it"))
        if isinstance(p, HfQuantPass) and earlier is None:
            earlier = p.name


def _order_message(name: str, earlier: str, how: str) -> str:
    return (f"{name} calibrates on a float model, but {earlier} {how}. Run {name} first, then the other pass "
            f"for what it leaves float, e.g. [{{type: {name}}}, {{type: Rtn, moe: true, embeds: true}}]")


class CalibratedHfPass(HfQuantPass):
    """A weight-only pass whose solver sees its inputs' statistics on the calibration data."""

    needs_data: ClassVar[bool] = True
    own_text_default: ClassVar[bool] = True
    distributes: ClassVar[bool] = False  # forward passes, layer by layer, on this machine
    Options: ClassVar[type] = CalibratedHfOptions

    def method(self) -> Method:
        raise NotImplementedError

    def float_zero_points(self) -> bool:
        return False  # the calibrated solvers write integer zero points

    def run(self, model: Any, context: PassContext) -> Any:
        from bitpress.hf import quantize
        from bitpress.hf.calibrated import quantize_calibrated
        from bitpress.hf.layer_inputs import calibration_batches
        from bitpress.hf.qtensor import QuantTensor

        if not isinstance(model, HfModel):
            raise QuantizationError(f"{self.name} quantizes Hugging Face models, got {model.kind}")
        check_float_model(model, self.name)
        opts = self.options
        model.allow(trust_remote_code=opts.trust_remote_code, allow_pickle=opts.allow_pickle)
        torch_model = model.torch_model()
        done = [n for n, p in torch_model.named_parameters() if isinstance(p, QuantTensor)]
        if done:
            raise QuantizationError(f"{self.name} calibrates on a float model, but {len(done)} parameters "
                                    f"({done[0]}, ...) are already quantized; start from the float checkpoint")
        p = quantize.plan(torch_model, opts.rules(), float_zero_points=False)  # raises before any work
        method = self.method()
        emb = torch_model.get_input_embeddings()
        vocab = int(getattr(emb, "num_embeddings", 0) or getattr(torch_model.config, "vocab_size", 0))
        widest = max((int(j.param.shape[-1]) for j in p.jobs), default=1)
        data = None
        if context.data is not None:
            data = DataConfig.from_value(context.data).enough_for(widest, self.name).with_own_text(self.name)
        batches = calibration_batches(data, model.source, vocab, torch_model)
        torch_model.eval()
        with context.step(len(p.jobs), "quantizing") as advance:
            report = quantize_calibrated(torch_model, p, method, batches, sequential=opts.sequential,
                                         jobs=context.jobs, progress=advance, name=self.name)
        record = {k: v for k, v in asdict(opts).items() if k not in ("trust_remote_code", "allow_pickle", "stream")}
        model.history.append({"pass": self.name, "options": record})
        context.extras.setdefault("reports", []).append((self.name, model.source, report))
        log.info("%s: %s", self.name, report.summary())
        return model
