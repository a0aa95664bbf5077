"""ONNX Runtime's own weight-only quantizer, the way its documentation uses it.

``MatMulNBitsQuantizer`` + ``DefaultWeightOnlyQuantConfig`` (RTN, MLAS kernels) on a model path,
then ``save_model_to_file``; external data when the input has it. Run by ``bench_rtn.py`` in a
fresh process of the project's venv (the quantizer imports ``onnx_ir``, which onnxruntime does
not declare as a dependency).

    python peers/ort_rtn.py MODEL.onnx OUT_DIR --block-size 32 --symmetric true --op-types MatMul Gather
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("output", type=Path, help="folder; the model keeps its file name")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--symmetric", choices=["true", "false"], default="false")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--op-types", nargs="+", default=["MatMul"])
    args = p.parse_args()

    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    config = DefaultWeightOnlyQuantConfig(
        block_size=args.block_size, is_symmetric=args.symmetric == "true", bits=args.bits,
        op_types_to_quantize=tuple(args.op_types),
    )
    quantizer = MatMulNBitsQuantizer(str(args.model), algo_config=config)
    quantizer.process()
    args.output.mkdir(parents=True, exist_ok=True)
    external = any(args.model.parent.glob(args.model.name + ".data*"))
    quantizer.model.save_model_to_file(str(args.output / args.model.name), use_external_data_format=external)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
