"""Machinery for plugins that wrap a third-party quantization toolkit.

A vendor toolkit (AMD Quark, Qualcomm AIMET, NVIDIA ModelOpt, Intel Neural Compressor, ONNX
Runtime's quantizer) takes model *paths* and calibration *readers*, and has side effects on
the process that calls it. The pieces every such plugin needs live here, once:

* :mod:`bitpress.toolkit.feeds`: the host's calibration data as an ONNX Runtime style reader;
* :mod:`bitpress.toolkit.workspace`: a private folder per call (the model saved there, the
  toolkit's output loaded back as the new handle), op counts and the run report;
* :mod:`bitpress.toolkit.containment`: the toolkit's logging, warnings, working-directory,
  environment and global-state side effects confined to the call.

Nothing here imports a toolkit.

May import: calibration, errors, models, onnx, passes.
"""
