"""The public API for plugin authors: what a bitpress plugin may import from the host.

A plugin imports host code from here, and only from here::

    from bitpress.plugin import WeightOnlyOptions, WeightOnlyPass, hookimpl, option

**Stability.** Every name listed in ``__all__`` keeps working across releases: when the host moves
the code behind a name, this module follows it, and a name that has to go is first kept for a
release with a ``DeprecationWarning``. Everything else under ``bitpress.*`` (the modules these names
come from included) is internal and may move or change without notice; a plugin that imports it
directly may break with any release. What a plugin needs and does not find here is a request for
this module, not a reason to reach into the host.

**Cost.** Importing this module is cheap: names are loaded on first use (:pep:`562`), each from the
host module that defines it, so ``from bitpress.plugin import hookimpl`` in a plugin's entry-point
module (imported for ``bitpress passes list``) loads nothing else, and heavy parts (the Hugging Face
path, which imports torch) are imported only by the plugin code that uses them: import those
inside the function that needs them, as before.

What it offers, by topic (see ``docs/writing-a-plugin.md``):

* **The plugin contract.** ``hookimpl`` (decorate the hook implementations of
  :mod:`bitpress.hookspecs`), ``Pass`` and ``PassContext`` (a pass class and what its ``run``
  receives), ``option`` (an option field with a default and a help text), ``NoOptions``,
  ``parse_options`` and ``coerce`` (the host's option parsing, for options of one's own), and
  ``get_registry`` (the process's registry of passes, to look a pass up by name).
* **Errors.** ``BitpressError`` and the subclasses a plugin raises for failures a user can act on:
  ``UsageError``, ``OptionError``, ``ModelLoadError``, ``ValidationError``, ``QuantizationError``,
  ``ExportError``; ``summarize_names`` keeps a list of names in a message short.
* **Models and ONNX helpers.** ``ModelHandle`` (the base of every model handle), ``OnnxModel``;
  ``iter_graphs``, ``iter_tensors``, ``is_external``, ``tensor_nbytes``, ``MS_DOMAIN``;
  ``KEEP_FLOAT`` and ``keeps_float`` (a node marked to keep its weight in float: quantizers skip it);
  ``save_onnx``, ``SaveOptions``, ``SINGLE_FILE_LIMIT``.
* **Block solvers.** ``BlockSolver``, ``BlockSpec``, ``QuantizedBlocks``, ``dequantize``,
  ``check_block_size``; the optional fast path ``PackingKernel``, ``PackedBlocks``.
* **Weight-only quantization of ONNX.** ``WeightOnlyPass``, ``WeightOnlyOptions``, ``plan``,
  ``Plan``, ``Group``, ``Report``, ``planned_report``, ``Estimate``, ``KernelOf``; writing nodes
  directly: ``Writer``, ``Result``; kernels: ``resolve_accuracy_level``, ``bnb4_path``,
  ``graph_paths``; layouts: ``to_matmul_nbits``, ``MatMulNBitsTensors``, ``split_zero_points``,
  ``insert_corrections``, ``CorrectionFix``, the ``MatMulBnb4`` layout (``quantize_bnb4``,
  ``dequantize_bnb4``, ``BNB4_QUANT_TYPES``, ``BNB4_BLOCK_SIZES``, ``NF4_CODEBOOK``,
  ``FP4_CODEBOOK``); QDQ to ``MatMulNBits``: ``convert_qdq_to_nbits``, ``QdqConversion``.
* **Calibrated solvers.** ``CalibratedPass``, ``CalibratedOptions``, ``CalibratedSolver``,
  ``InputScaler``, ``LayerStats``, ``Target``, ``output_error``, ``rounding_solver``.
* **Selection and CPU.** ``NameMatcher`` (names, globs, ``re:`` patterns), ``short`` (a bounded
  ``repr``); ``cpu_flags``, ``int8_saturates``, ``ReduceRange``, ``resolve_reduce_range``.
* **Calibration data.** ``Feed``, ``FeedReader``, ``calibration_feeds``, ``placeholder_feeds``,
  ``split_feeds``; ``DataConfig`` (``data:``) and ``GENERATED`` (``source: generated``, the model's own text).
* **Wrapping a vendor toolkit.** Isolation: ``contained``, ``import_contained``, ``Relay``,
  ``ToolMessages`` (a plugin's ``sandbox`` module builds on them); the scratch workspace:
  ``Workspace``, ``ToolReport``, ``record_report``, ``count_ops``, ``drop_unused_opsets``,
  ``dist_version``.
* **The Hugging Face path** (imports torch: use inside functions). ``HfToOnnxPass``,
  ``HfQuantPass``, ``HfQuantOptions``, ``CalibratedHfPass``, ``CalibratedHfOptions``, ``Method``,
  ``HfModel``, ``QuantTensor``, ``calibration_batches``; a module's online product (a float matrix
  applied to its input, saved with the checkpoint and carried into exports): ``attach_online``,
  ``detach_online``, ``ONLINE_BUFFER``, ``output_embedding_name``.
* **Evaluation.** ``OutputAccumulator`` (relative error of a model's outputs, sample by sample).
* **GenAI packages.** ``GenaiPackage``, ``check_package``, ``builder_reason``; ``check_logits`` (a built
  package's logits against a PyTorch model's, prefill and decode: the check every export passes) and
  ``fix_gemma3`` (mobius's Gemma-3 graphs given their layer types' rotary tables, window and scale).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs; at run time names load on first use
    from bitpress.calibration.data import GENERATED, DataConfig
    from bitpress.cpu import ReduceRange, cpu_flags, int8_saturates, resolve_reduce_range
    from bitpress.errors import (
        BitpressError,
        ExportError,
        ModelLoadError,
        OptionError,
        QuantizationError,
        UsageError,
        ValidationError,
        summarize_names,
    )
    from bitpress.evaluate.metrics import OutputAccumulator
    from bitpress.genai.check import check_logits
    from bitpress.genai.export import GenaiPackage, builder_reason, check_package
    from bitpress.genai.mobius import fix_gemma3
    from bitpress.hf.calibrated import Method
    from bitpress.hf.calibrated_pass import CalibratedHfOptions, CalibratedHfPass, check_float_model
    from bitpress.hf.layer_inputs import calibration_batches
    from bitpress.hf.model import HfModel
    from bitpress.hf.online import BUFFER as ONLINE_BUFFER
    from bitpress.hf.online import attach as attach_online
    from bitpress.hf.online import detach as detach_online
    from bitpress.hf.online import head_module as output_embedding_name
    from bitpress.hf.passes import HfQuantPass, HfToOnnxPass
    from bitpress.hf.qtensor import QuantSpec, QuantTensor
    from bitpress.hf.rules import HfQuantOptions
    from bitpress.hookspecs import hookimpl
    from bitpress.models.base import ModelHandle
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.bnb4 import (
        BNB4_BLOCK_SIZES,
        BNB4_QUANT_TYPES,
        FP4_CODEBOOK,
        NF4_CODEBOOK,
        dequantize_bnb4,
        quantize_bnb4,
    )
    from bitpress.onnx.calibrated import CalibratedOptions, CalibratedPass
    from bitpress.onnx.calibrated.passes import rounding_solver
    from bitpress.onnx.correction import Fix as CorrectionFix
    from bitpress.onnx.correction import insert_corrections, split_zero_points
    from bitpress.onnx.graph import KEEP_FLOAT, MS_DOMAIN, keeps_float
    from bitpress.onnx.kernels import bnb4_path, graph_paths, resolve_accuracy_level
    from bitpress.onnx.layout import MatMulNBitsTensors, to_matmul_nbits
    from bitpress.onnx.qdq_nbits import QdqConversion, convert_qdq_to_nbits
    from bitpress.onnx.save import SINGLE_FILE_LIMIT, SaveOptions, save_onnx
    from bitpress.onnx.tensors import is_external, iter_graphs, iter_tensors, tensor_nbytes
    from bitpress.onnx.weightonly import (
        Group,
        Plan,
        Report,
        Result,
        WeightOnlyOptions,
        WeightOnlyPass,
        Writer,
        plan,
        planned_report,
    )
    from bitpress.onnx.weightonly.report import Estimate, KernelOf
    from bitpress.options import NoOptions, coerce, option, parse_options
    from bitpress.passes import Pass, PassContext
    from bitpress.plugins import get_registry
    from bitpress.quant.calibrated import CalibratedSolver, InputScaler, LayerStats, Target, output_error
    from bitpress.quant.solver import (
        BlockSolver,
        BlockSpec,
        PackedBlocks,
        PackingKernel,
        QuantizedBlocks,
        check_block_size,
        dequantize,
    )
    from bitpress.selection import NameMatcher, short
    from bitpress.toolkit.containment import Relay, ToolMessages, contained, import_contained
    from bitpress.toolkit.feeds import Feed, FeedReader, calibration_feeds, placeholder_feeds, split_feeds
    from bitpress.toolkit.workspace import (
        ToolReport,
        Workspace,
        count_ops,
        dist_version,
        drop_unused_opsets,
        record_report,
    )

#: public name -> the host module it comes from (``"module:attribute"`` when the name differs there).
#: Moving a name inside the host means changing its entry here (and the import above); nothing else.
_EXPORTS: dict[str, str] = {
    # --- the plugin contract: hooks, passes, options, the registry ---
    "hookimpl": "bitpress.hookspecs",
    "Pass": "bitpress.passes",
    "PassContext": "bitpress.passes",
    "option": "bitpress.options",
    "NoOptions": "bitpress.options",
    "parse_options": "bitpress.options",
    "coerce": "bitpress.options",
    "get_registry": "bitpress.plugins",
    # --- errors ---
    "BitpressError": "bitpress.errors",
    "UsageError": "bitpress.errors",
    "OptionError": "bitpress.errors",
    "ModelLoadError": "bitpress.errors",
    "ValidationError": "bitpress.errors",
    "QuantizationError": "bitpress.errors",
    "ExportError": "bitpress.errors",
    "summarize_names": "bitpress.errors",
    # --- models and ONNX helpers ---
    "ModelHandle": "bitpress.models.base",
    "OnnxModel": "bitpress.models.onnx_model",
    "MS_DOMAIN": "bitpress.onnx.graph",
    "KEEP_FLOAT": "bitpress.onnx.graph",
    "keeps_float": "bitpress.onnx.graph",
    "iter_graphs": "bitpress.onnx.tensors",
    "iter_tensors": "bitpress.onnx.tensors",
    "is_external": "bitpress.onnx.tensors",
    "tensor_nbytes": "bitpress.onnx.tensors",
    "save_onnx": "bitpress.onnx.save",
    "SaveOptions": "bitpress.onnx.save",
    "SINGLE_FILE_LIMIT": "bitpress.onnx.save",
    # --- block solvers ---
    "BlockSolver": "bitpress.quant.solver",
    "BlockSpec": "bitpress.quant.solver",
    "QuantizedBlocks": "bitpress.quant.solver",
    "PackedBlocks": "bitpress.quant.solver",
    "PackingKernel": "bitpress.quant.solver",
    "check_block_size": "bitpress.quant.solver",
    "dequantize": "bitpress.quant.solver",
    # --- weight-only quantization of ONNX: pass, plan, report, writer ---
    "WeightOnlyPass": "bitpress.onnx.weightonly",
    "WeightOnlyOptions": "bitpress.onnx.weightonly",
    "plan": "bitpress.onnx.weightonly",
    "Plan": "bitpress.onnx.weightonly",
    "Group": "bitpress.onnx.weightonly",
    "Report": "bitpress.onnx.weightonly",
    "planned_report": "bitpress.onnx.weightonly",
    "Writer": "bitpress.onnx.weightonly",
    "Result": "bitpress.onnx.weightonly",
    "Estimate": "bitpress.onnx.weightonly.report",
    "KernelOf": "bitpress.onnx.weightonly.report",
    # --- weight-only: kernels, layouts, corrections, MatMulBnb4, QDQ conversion ---
    "resolve_accuracy_level": "bitpress.onnx.kernels",
    "bnb4_path": "bitpress.onnx.kernels",
    "graph_paths": "bitpress.onnx.kernels",
    "to_matmul_nbits": "bitpress.onnx.layout",
    "MatMulNBitsTensors": "bitpress.onnx.layout",
    "split_zero_points": "bitpress.onnx.correction",
    "insert_corrections": "bitpress.onnx.correction",
    "CorrectionFix": "bitpress.onnx.correction:Fix",
    "quantize_bnb4": "bitpress.onnx.bnb4",
    "dequantize_bnb4": "bitpress.onnx.bnb4",
    "BNB4_QUANT_TYPES": "bitpress.onnx.bnb4",
    "BNB4_BLOCK_SIZES": "bitpress.onnx.bnb4",
    "NF4_CODEBOOK": "bitpress.onnx.bnb4",
    "FP4_CODEBOOK": "bitpress.onnx.bnb4",
    "convert_qdq_to_nbits": "bitpress.onnx.qdq_nbits",
    "QdqConversion": "bitpress.onnx.qdq_nbits",
    # --- calibrated solvers ---
    "CalibratedPass": "bitpress.onnx.calibrated",
    "CalibratedOptions": "bitpress.onnx.calibrated",
    "rounding_solver": "bitpress.onnx.calibrated.passes",
    "CalibratedSolver": "bitpress.quant.calibrated",
    "InputScaler": "bitpress.quant.calibrated",
    "LayerStats": "bitpress.quant.calibrated",
    "Target": "bitpress.quant.calibrated",
    "output_error": "bitpress.quant.calibrated",
    # --- selection and CPU ---
    "NameMatcher": "bitpress.selection",
    "short": "bitpress.selection",
    "cpu_flags": "bitpress.cpu",
    "int8_saturates": "bitpress.cpu",
    "ReduceRange": "bitpress.cpu",
    "resolve_reduce_range": "bitpress.cpu",
    # --- calibration data: feeds ---
    "Feed": "bitpress.toolkit.feeds",
    "FeedReader": "bitpress.toolkit.feeds",
    "calibration_feeds": "bitpress.toolkit.feeds",
    "placeholder_feeds": "bitpress.toolkit.feeds",
    "split_feeds": "bitpress.toolkit.feeds",
    "DataConfig": "bitpress.calibration.data",
    "GENERATED": "bitpress.calibration.data",
    # --- wrapping a vendor toolkit: isolation (containment) and the scratch workspace ---
    "contained": "bitpress.toolkit.containment",
    "import_contained": "bitpress.toolkit.containment",
    "Relay": "bitpress.toolkit.containment",
    "ToolMessages": "bitpress.toolkit.containment",
    "Workspace": "bitpress.toolkit.workspace",
    "ToolReport": "bitpress.toolkit.workspace",
    "record_report": "bitpress.toolkit.workspace",
    "count_ops": "bitpress.toolkit.workspace",
    "drop_unused_opsets": "bitpress.toolkit.workspace",
    "dist_version": "bitpress.toolkit.workspace",
    # --- the Hugging Face path (imports torch) ---
    "HfToOnnxPass": "bitpress.hf.passes",
    "HfQuantPass": "bitpress.hf.passes",
    "HfQuantOptions": "bitpress.hf.rules",
    "CalibratedHfPass": "bitpress.hf.calibrated_pass",
    "CalibratedHfOptions": "bitpress.hf.calibrated_pass",
    "Method": "bitpress.hf.calibrated",
    "HfModel": "bitpress.hf.model",
    "QuantTensor": "bitpress.hf.qtensor",
    "QuantSpec": "bitpress.hf.qtensor",
    "check_float_model": "bitpress.hf.calibrated_pass",
    "calibration_batches": "bitpress.hf.layer_inputs",
    "attach_online": "bitpress.hf.online:attach",
    "detach_online": "bitpress.hf.online:detach",
    "ONLINE_BUFFER": "bitpress.hf.online:BUFFER",
    "output_embedding_name": "bitpress.hf.online:head_module",
    # --- evaluation ---
    "OutputAccumulator": "bitpress.evaluate.metrics",
    # --- GenAI packages ---
    "GenaiPackage": "bitpress.genai.export",
    "check_package": "bitpress.genai.export",
    "builder_reason": "bitpress.genai.export",
    "check_logits": "bitpress.genai.check",
    "fix_gemma3": "bitpress.genai.mobius",
}

__all__ = [
    "BNB4_BLOCK_SIZES",
    "BNB4_QUANT_TYPES",
    "FP4_CODEBOOK",
    "GENERATED",
    "KEEP_FLOAT",
    "MS_DOMAIN",
    "NF4_CODEBOOK",
    "ONLINE_BUFFER",
    "SINGLE_FILE_LIMIT",
    "BitpressError",
    "BlockSolver",
    "BlockSpec",
    "CalibratedHfOptions",
    "CalibratedHfPass",
    "CalibratedOptions",
    "CalibratedPass",
    "CalibratedSolver",
    "CorrectionFix",
    "DataConfig",
    "Estimate",
    "ExportError",
    "Feed",
    "FeedReader",
    "GenaiPackage",
    "Group",
    "HfModel",
    "HfQuantOptions",
    "HfQuantPass",
    "HfToOnnxPass",
    "InputScaler",
    "KernelOf",
    "LayerStats",
    "MatMulNBitsTensors",
    "Method",
    "ModelHandle",
    "ModelLoadError",
    "NameMatcher",
    "NoOptions",
    "OnnxModel",
    "OptionError",
    "OutputAccumulator",
    "PackedBlocks",
    "PackingKernel",
    "Pass",
    "PassContext",
    "Plan",
    "QdqConversion",
    "QuantSpec",
    "QuantTensor",
    "QuantizationError",
    "QuantizedBlocks",
    "ReduceRange",
    "Relay",
    "Report",
    "Result",
    "SaveOptions",
    "Target",
    "ToolMessages",
    "ToolReport",
    "UsageError",
    "ValidationError",
    "WeightOnlyOptions",
    "WeightOnlyPass",
    "Workspace",
    "Writer",
    "attach_online",
    "bnb4_path",
    "builder_reason",
    "calibration_batches",
    "calibration_feeds",
    "check_block_size",
    "check_float_model",
    "check_logits",
    "check_package",
    "coerce",
    "contained",
    "convert_qdq_to_nbits",
    "count_ops",
    "cpu_flags",
    "dequantize",
    "dequantize_bnb4",
    "detach_online",
    "dist_version",
    "drop_unused_opsets",
    "fix_gemma3",
    "get_registry",
    "graph_paths",
    "hookimpl",
    "import_contained",
    "insert_corrections",
    "int8_saturates",
    "is_external",
    "iter_graphs",
    "iter_tensors",
    "keeps_float",
    "option",
    "output_embedding_name",
    "output_error",
    "parse_options",
    "placeholder_feeds",
    "plan",
    "planned_report",
    "quantize_bnb4",
    "record_report",
    "resolve_accuracy_level",
    "resolve_reduce_range",
    "rounding_solver",
    "save_onnx",
    "short",
    "split_feeds",
    "split_zero_points",
    "summarize_names",
    "tensor_nbytes",
    "to_matmul_nbits",
]


def __getattr__(name: str) -> Any:
    """Load a public name from its host module on first use (then it is an ordinary attribute)."""
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(
            f"module 'bitpress.plugin' has no attribute {name!r}: it is not part of the plugin API "
            "(see bitpress.plugin.__all__ and docs/writing-a-plugin.md; the rest of bitpress.* is internal)"
        )
    module, _, attr = where.partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
