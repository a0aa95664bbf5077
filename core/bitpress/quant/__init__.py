"""Algorithm-level quantization: the block-solver contract and integer packing.

Nothing here knows about ONNX or torch; the ONNX writers (``bitpress.onnx``) and the
Hugging Face path both call solvers through this contract.
"""

from bitpress.quant.solver import BlockSolver, BlockSpec, QuantizedBlocks, dequantize

__all__ = ["BlockSolver", "BlockSpec", "QuantizedBlocks", "dequantize"]
