"""Model handles: what passes receive and the host saves.

:class:`~bitpress.models.base.ModelHandle` (the contract), :class:`OnnxModel` (one ``.onnx`` file
and its external data), :class:`OnnxPackage` (a folder of them, e.g. a GenAI package: its
``genai_config.json`` is read through :mod:`bitpress.genai.package`), and the files of a
Hugging Face folder (:mod:`~bitpress.models.hf_files`; the handle itself is :mod:`bitpress.hf.model`).

May import: errors, genai, hf, onnx, paths (hf only through the old path models.hf_model).
"""

from bitpress.models.base import ModelHandle
from bitpress.models.onnx_model import OnnxModel
from bitpress.models.onnx_package import OnnxPackage

__all__ = ["ModelHandle", "OnnxModel", "OnnxPackage"]
