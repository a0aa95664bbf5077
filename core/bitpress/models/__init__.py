"""Model handles: what passes receive and the host saves."""

from bitpress.models.base import ModelHandle
from bitpress.models.onnx_model import OnnxModel
from bitpress.models.package import OnnxPackage

__all__ = ["ModelHandle", "OnnxModel", "OnnxPackage"]
