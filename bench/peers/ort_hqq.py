"""ONNX Runtime's HQQ weight-only quantizer (``HQQWeightOnlyQuantConfig``), as documented.

    python peers/ort_hqq.py MODEL.onnx OUT_DIR --block-size 128

Needs torch in the environment (ORT's HQQ runs on torch); the project's venv has the CPU wheel.
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
    p.add_argument("--bits", type=int, default=4)
    args = p.parse_args()

    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    config = HQQWeightOnlyQuantConfig(block_size=args.block_size, bits=args.bits)
    quantizer = MatMulNBitsQuantizer(str(args.model), algo_config=config)
    quantizer.process()
    args.output.mkdir(parents=True, exist_ok=True)
    external = any(args.model.parent.glob(args.model.name + ".data*"))
    quantizer.model.save_model_to_file(str(args.output / args.model.name), use_external_data_format=external)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
