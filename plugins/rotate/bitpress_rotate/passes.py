"""The ``quarot`` pass (Olive's ``QuaRot``): rotate an ONNX decoder offline, before quantizing it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from bitpress.plugin import OnnxModel, OptionError, Pass, PassContext, UsageError, option
from bitpress_rotate.matrices import MODES, hadamard_order_parts
from bitpress_rotate.rotate import rotate
from bitpress_rotate.stream import StreamError, find_stream

log = logging.getLogger(__name__)


@dataclass
class RotationFields:
    """The options every rotation pass has (Olive's names); each pass checks them its own way."""

    rotate_mode: str = option("hadamard", "hadamard (randomized Hadamard, QuaRot's) or random (a random "
                                          "orthogonal matrix)")
    seed: int = option(0, "seed of the random signs / random matrix")
    rotate_heads: bool = option(True, "also rotate each attention value head (QuaRot's R2: v_proj and o_proj)")


@dataclass
class QuarotOptions(RotationFields):
    """Options of ``quarot`` and ``quarot_hf`` (Olive's QuaRot names)."""

    def validate(self) -> None:
        if self.rotate_mode not in MODES:
            raise OptionError(f"quarot: rotate_mode must be one of {', '.join(MODES)}, got {self.rotate_mode!r}")
        if self.seed < 0:
            raise OptionError(f"quarot: seed must be >= 0, got {self.seed}")


class QuarotPass(Pass):
    """QuaRot's offline rotation of a pre-norm decoder (ONNX): same outputs, weights without outliers."""

    name = "quarot"
    aliases = ("QuaRot",)
    algorithms = ("quarot",)
    precisions = ()
    model_kinds = ("onnx",)
    needs_data = False
    summary = ("rotate a decoder's residual stream and value heads offline (QuaRot); same float outputs, "
               "then quantize with gptq / rtn / kquant")
    Options: ClassVar[type] = QuarotOptions

    def run(self, model: Any, context: PassContext) -> Any:
        if not isinstance(model, OnnxModel):
            raise UsageError(f"{self.name} rotates ONNX decoders, got a {model.kind} model")
        where = model.source.name
        try:
            stream = find_stream(model.graph)
        except StreamError as exc:
            raise UsageError(f"{self.name}: cannot rotate {where}: {exc}") from None
        mode = self.options.rotate_mode
        if mode == "hadamard" and hadamard_order_parts(stream.hidden) is None:
            raise UsageError(f"{self.name}: no Hadamard matrix of order {stream.hidden} (the hidden size of {where}) "
                             "is known; use rotate_mode=random")
        if mode == "hadamard" and self.options.rotate_heads:
            for v in stream.values:
                if hadamard_order_parts(v.head_dim) is None:
                    raise UsageError(f"{self.name}: no Hadamard matrix of order {v.head_dim} (the head size of "
                                     f"{where}) is known; use rotate_mode=random or rotate_heads=false")
        result = rotate(model, stream, mode, self.options.seed, self.options.rotate_heads)
        for note in result.notes:
            log.warning("%s: %s: %s", self.name, where, note)
        log.info("%s: %s: %s", self.name, where, result.summary())
        return model
