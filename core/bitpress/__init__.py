"""bitpress: a plugin host for model quantization.

>>> import bitpress
>>> bitpress.quantize("model.onnx", "out/", algorithm="rtn", precision="int4")  # doctest: +SKIP
"""

from bitpress.api import load_model, quantize, run
from bitpress.errors import BitpressError
from bitpress.hookspecs import hookimpl
from bitpress.passes import Pass, PassContext

__version__ = "0.1.0"

__all__ = [
    "BitpressError",
    "Pass",
    "PassContext",
    "__version__",
    "hookimpl",
    "load_model",
    "quantize",
    "run",
]
