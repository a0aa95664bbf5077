"""AWQ on PyTorch (Hugging Face) models: ``awq_hf``, Olive's ``AutoAWQQuantizer``.

The searches of the ONNX ``awq`` pass (:mod:`bitpress_awq.search`) on the host's layer-wise
machinery (:mod:`bitpress.hf.calibrated`): per decoder block, each input's scales are searched
against the output error of the linears reading it and folded exactly into the norm or linear
that produces it (:mod:`bitpress.hf.scaling`), then every block of every weight gets its clip
ratio, and a block solver (``quantizer``: rtn, kquant or hqq) rounds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from bitpress.plugin import BlockSolver, CalibratedHfOptions, CalibratedHfPass, UsageError, option

if TYPE_CHECKING:
    from bitpress.plugin import Method

#: quantizer -> (module, function, distribution, plugin folder)
QUANTIZERS = {
    "rtn": ("bitpress_rtn.solver", "rtn_solver", "bitpress-rtn", "plugins/rtn"),
    "kquant": ("bitpress_kquant.solver", "kquant_solver", "bitpress-kquant", "plugins/kquant"),
    "hqq": ("bitpress_hqq.solver", "hqq_solver", "bitpress-hqq", "plugins/hqq"),
}


def block_solver(name: str) -> BlockSolver:
    """The block solver ``quantizer`` names, imported now; a clear error when its plugin is missing."""
    import importlib

    if name not in QUANTIZERS:
        raise UsageError(f"quantizer must be one of {', '.join(QUANTIZERS)}, got {name!r}")
    module, func, dist, folder = QUANTIZERS[name]
    try:
        fn: Any = getattr(importlib.import_module(module), func)
    except ImportError:
        raise UsageError(
            f"quantizer {name!r} needs the {dist} plugin: pip install {dist} (from a checkout: pip install -e {folder})"
        ) from None
    if name == "hqq":
        fn = functools.partial(fn, workers=1)  # the host already solves several weights at once
    return fn  # type: ignore[no-any-return]


@dataclass
class AwqHfOptions(CalibratedHfOptions):
    sym: bool = option(False, "symmetric (no zero points); default: an integer zero point per block, as AutoAWQ")
    zero_point: bool | None = option(None, "AutoAWQ's name, when given it sets sym: true = zero points (sym false)")
    quantizer: str = option("rtn", "the block solver that rounds the scaled weights: rtn, kquant or hqq")
    n_grid: int = option(20, "exponents tried by the scale search (a = 0, 1/n, ... < 1) and clip ratios")
    duo_scaling: bool = option(True, "scales from activation and weight magnitudes (AutoAWQ's newer form)")
    clip: bool = option(True, "search a clip ratio per block against its output error")
    max_shrink: float = option(0.5, "the clip search's smallest ratio is 1 - max_shrink")

    def validate(self) -> None:
        if self.zero_point is not None:
            self.sym = not self.zero_point
        super().validate()
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {', '.join(QUANTIZERS)}, got {self.quantizer!r}")
        if not 1 <= self.n_grid <= 100:
            raise ValueError(f"n_grid must be from 1 to 100, got {self.n_grid}")
        if not 0 <= self.max_shrink < 1:
            raise ValueError(f"max_shrink must be in [0, 1), got {self.max_shrink}")


class AwqHfPass(CalibratedHfPass):
    """AWQ (Lin et al.) on a Hugging Face model's linears, block by block, on CPU."""

    name = "awq_hf"
    algorithms = ("awq",)
    summary = "AWQ on a Hugging Face model's linears: exact scales, clipping, rtn/kquant/hqq rounding, in place"
    Options: ClassVar[type] = AwqHfOptions
    aliases: ClassVar[tuple[str, ...]] = ("AutoAWQQuantizer",)

    def solver(self) -> BlockSolver:
        return block_solver(self.options.quantizer)

    def method(self) -> Method:
        from bitpress.plugin import Method
        from bitpress_awq.search import AwqClipSolver, AwqScaler

        o = self.options
        rounding = self.solver()
        scaler = AwqScaler(rounding, n_grid=o.n_grid, duo_scaling=o.duo_scaling)
        clip = AwqClipSolver(rounding, n_grid=o.n_grid, max_shrink=o.max_shrink if o.clip else 0.0)
        return Method(clip, rounding, scaler)
