"""Algorithm-level quantization: the block-solver contract and integer packing.

Nothing here knows about ONNX or torch; the ONNX writers (``bitpress.onnx``) and the
Hugging Face path both call solvers through this contract.

May import: nothing else of the host (numpy only).
"""

from bitpress.quant.solver import BlockSolver, BlockSpec, QuantizedBlocks, check_block_size, dequantize

__all__ = ["BlockSolver", "BlockSpec", "QuantizedBlocks", "check_block_size", "dequantize"]
