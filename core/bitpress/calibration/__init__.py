"""Calibration data: what passes that need data run the model on (``--data``, ``data:`` in a config).

What it owns:

* :mod:`~bitpress.calibration.data`: the sources (``random``, ``.npz`` files, a text) as feeds
  for ONNX Runtime (:class:`~bitpress.calibration.data.DataConfig`,
  :func:`~bitpress.calibration.data.iter_feeds`), a KV cache filled where the model has one;
* :mod:`~bitpress.calibration.text`: a text as windows of tokens (the tokenizer found beside the
  model, BOS when it asks), shared with ``bitpress eval``'s perplexity;
* :mod:`~bitpress.calibration.generate`: windows the ONNX model writes itself (``generated``),
  sampled in ONNX Runtime with the model's KV cache.

The statistics collected on these feeds stay with the graphs they are collected from:
:mod:`bitpress.onnx.activations` (per-channel importance), :mod:`bitpress.onnx.calibrated`
(GPTQ / AWQ statistics, stage by stage), :mod:`bitpress.hf.layer_inputs` (PyTorch models); their
contract is :mod:`bitpress.quant.calibrated`. Toolkit plugins read the feeds through
:mod:`bitpress.toolkit.feeds`.

What it may import: the host machinery below it (:mod:`bitpress.paths`, :mod:`bitpress.errors`,
:mod:`bitpress.onnx` helpers, :mod:`bitpress.genai` for a decoder's KV cache and a package's
companion files); never the passes, the workflow, the API façade or the command line that use it.

Importing this package imports nothing else; the submodules do what they need.

May import: errors, genai, onnx, paths, quant.
"""
