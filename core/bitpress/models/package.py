"""Moved: reading a GenAI package is :mod:`bitpress.genai.package` (``genai_config.json``, ModelFile,
resolve_model); the folder handle is :mod:`bitpress.models.onnx_package` (OnnxPackage).

This path keeps working for one release and warns when imported.
"""

from __future__ import annotations

import warnings

from bitpress.genai.package import GENAI_CONFIG, ModelFile, check_genai_config, read_genai_config, resolve_model
from bitpress.models.onnx_package import OnnxPackage

warnings.warn("bitpress.models.package moved to bitpress.genai.package (genai_config.json, ModelFile, resolve_model) "
              "and bitpress.models.onnx_package (OnnxPackage); import them from there",
              DeprecationWarning, stacklevel=2)

__all__ = ["GENAI_CONFIG", "ModelFile", "OnnxPackage", "check_genai_config", "read_genai_config", "resolve_model"]
