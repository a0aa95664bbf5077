"""Shared ONNX machinery: tensors and external data, saving and checks, weight-only writers."""
