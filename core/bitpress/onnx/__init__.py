"""Shared ONNX machinery: tensors and external data, saving and checks, weight-only writers.

May import: calibration, errors, executors, interrupts, memory, models, options, passes, paths,
plugins, quant, selection.
"""
