"""ONNX Runtime GenAI packages: everything about a folder that ``onnxruntime_genai`` loads.

What it owns, one module each:

* :mod:`~bitpress.genai.package`: reading one: ``genai_config.json`` checked (its file names stay
  inside the folder), a model's companion files found from its folder up to the package's
  (never above), and which ``.onnx`` of a path runs (:class:`~bitpress.genai.package.ModelFile`,
  :func:`~bitpress.genai.package.resolve_model`);
* :mod:`~bitpress.genai.kvcache`: feeding its decoder: the KV-cache inputs (empty, or zeros of a
  sliding-window / static capacity), ``input_ids`` / ``attention_mask`` / ``position_ids`` of
  token windows;
* :mod:`~bitpress.genai.export`: building one from a Hugging Face model with the ONNX Runtime
  GenAI model builder, checking it (ONNX checker, a session, a generation step);
  :mod:`~bitpress.genai.mobius`: the same by mobius; :mod:`~bitpress.genai.split`: a built
  package cut into embedding and decoder components;
* :mod:`~bitpress.genai.manifest`: ``bitpress-manifest.json`` written beside a package and
  verified against a copy;
* :mod:`~bitpress.genai.publish`: ``bitpress publish``, one model to a tree of packages (dtype x
  EP x variant);
* :mod:`~bitpress.genai.push`: ``publish --push``, the built packages uploaded to a Hub repo and
  checked there; :mod:`~bitpress.genai.remote`: ``bitpress verify org/name``, a repo's packages
  checked against their manifests without downloading them (both through :mod:`bitpress.hub_remote`).

What it may import: the host machinery below it (:mod:`bitpress.paths`, :mod:`bitpress.errors`,
:mod:`bitpress.onnx` helpers, :mod:`bitpress.models`, :mod:`bitpress.hf` for staging a checkpoint),
never the command line (:mod:`bitpress.cli`) nor the API façade (:mod:`bitpress.api`). Two rules
keep it free of import circles:

* :mod:`~bitpress.genai.package` imports only :mod:`bitpress.paths` and :mod:`bitpress.errors`:
  the model handles read ``genai_config.json`` through it
  (:class:`~bitpress.models.onnx_package.OnnxPackage`), so it cannot import them back;
* :mod:`~bitpress.genai.publish` is the top of the package: it runs whole workflows
  (:func:`bitpress.workflow.runner.run`) and evaluations (:mod:`bitpress.evaluate`) for each cell, so
  nothing below the workflow (the rest of this package included) imports it.

Calibration data built from text and the KV-cache feeds here is :mod:`bitpress.calibration`'s
(it imports this package, never the other way round).

Importing this package imports nothing else (no onnx, no torch); the submodules do what they need.

May import: errors, evaluate, hf, hub, hub_remote, models, onnx, output, paths, workflow (the last two, and
evaluate: publish only; hub: publish and push; hub_remote: push and remote).
"""

from __future__ import annotations

#: how to install what either exporter needs (torch pinned first: an unpinned one can pull a CUDA build)
GENAI_INSTALL_HINT = 'pip install "torch==2.13.0" "bitpress[genai]"'

__all__ = ["GENAI_INSTALL_HINT"]
