"""ONNX Runtime's GPTQ (``MatMulNBitsQuantizer`` + ``GPTQWeightOnlyQuantConfig``), as documented.

    python peers/ort_gptq.py MODEL_DIR_OR_ONNX OUT_DIR --data TEXT --tokenizer DIR --samples 32
    python peers/ort_gptq.py MODEL_DIR_OR_ONNX OUT_DIR --rtn    # ORT's RTN (DefaultWeightOnlyQuantConfig), no data

The calibration feeds are built by ``bitpress.calibration.data.iter_feeds`` (windows of ``--seq-len`` tokens
of the text, KV-cache inputs fed empty as ``bitpress quantize --data`` feeds them), so this tool
and bitpress see the very same token windows. A GenAI folder is written as a GenAI folder: the
quantized decoder under the input's file name, every other file of the folder copied.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any


def decoder_path(model: Path) -> Path:
    """The .onnx itself, or the decoder a GenAI folder's genai_config.json names."""
    if model.is_file():
        return model
    cfg = json.loads((model / "genai_config.json").read_text())
    return model / cfg["model"]["decoder"]["filename"]


def calibration_feeds(onnx_path: Path, text: Path, tokenizer: Path, samples: int, seq_len: int) -> list[dict[str, Any]]:
    import onnx

    from bitpress.calibration.data import DataConfig, iter_feeds

    proto = onnx.load(str(onnx_path), load_external_data=False)
    config = DataConfig(source=str(text), tokenizer=str(tokenizer), samples=samples, seq_len=seq_len)
    return list(iter_feeds(proto, config, onnx_path.parent))


class Reader:
    """A ``CalibrationDataReader`` over a list of feeds (ORT deep-copies it before reading)."""

    def __init__(self, feeds: list[dict[str, Any]]) -> None:
        self.feeds = feeds
        self.pos = 0

    def get_next(self) -> dict[str, Any] | None:
        if self.pos >= len(self.feeds):
            return None
        self.pos += 1
        return self.feeds[self.pos - 1]

    def rewind(self) -> None:
        self.pos = 0

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> dict[str, Any]:
        feed = self.get_next()
        if feed is None:
            raise StopIteration
        return feed


def save(proto: Any, src: Path, out: Path) -> None:
    """Write the result beside nothing of the input's.

    ORT's own ``save_model_to_file`` cannot: the initializers GPTQ left alone (norms, embedding) still
    point into the input's ``model.onnx.data``, and with the working directory in the input's folder onnx
    refuses to write a file of that name (``FileExistsError``). Their data is read in first.
    """
    import onnx
    from onnx.external_data_helper import load_external_data_for_model

    external = any(src.parent.glob(src.name + ".data*"))
    if external:
        load_external_data_for_model(proto, str(src.parent))
    os.chdir(out.parent)  # onnx checks the data file's name against the working directory
    onnx.save_model(proto, str(out), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=out.name + ".data", size_threshold=1024)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="a .onnx file or a GenAI folder")
    p.add_argument("output", type=Path, help="folder; the model keeps its file name")
    p.add_argument("--data", type=Path, help="calibration text")
    p.add_argument("--tokenizer", type=Path)
    p.add_argument("--rtn", action="store_true", help="ORT's RTN instead (same model handling, no data)")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128, help="quantization group (MatMulNBits block)")
    p.add_argument("--symmetric", action="store_true")
    p.add_argument("--percdamp", type=float, default=0.01)
    p.add_argument("--actorder", action="store_true")
    args = p.parse_args()
    if not args.rtn and (args.data is None or args.tokenizer is None):
        p.error("GPTQ needs --data and --tokenizer")
    for name in ("model", "output", "data", "tokenizer"):  # bitpress.paths wants absolute folders
        if getattr(args, name) is not None:
            setattr(args, name, getattr(args, name).resolve())

    from onnxruntime.quantization.calibrate import CalibrationDataReader
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        GPTQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
        WeightOnlyQuantConfig,
    )

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    src = decoder_path(args.model)
    config: WeightOnlyQuantConfig
    if args.rtn:
        config = DefaultWeightOnlyQuantConfig(block_size=args.block_size, is_symmetric=args.symmetric)
    else:
        t0 = time.perf_counter()
        feeds = calibration_feeds(src, args.data, args.tokenizer, args.samples, args.seq_len)
        logging.info("%d calibration feeds (%s) in %.1f s", len(feeds),
                     ", ".join(f"{k} {tuple(v.shape)}" for k, v in list(feeds[0].items())[:3]),
                     time.perf_counter() - t0)
        reader: CalibrationDataReader = Reader(feeds)  # type: ignore[assignment]
        config = GPTQWeightOnlyQuantConfig(calibration_data_reader=reader, percdamp=args.percdamp,
                                           block_size=128, actorder=args.actorder)
    # ORT's GPTQ opens its sessions from the serialized proto: external data (model.onnx.data) is then
    # looked up relative to the working directory, so it must be the model's folder
    os.chdir(src.parent)
    quantizer = MatMulNBitsQuantizer(str(src), block_size=args.block_size, is_symmetric=args.symmetric,
                                     algo_config=config)
    t1 = time.perf_counter()
    quantizer.process()
    logging.info("quantized in %.1f s", time.perf_counter() - t1)
    args.output.mkdir(parents=True, exist_ok=True)
    if args.model.is_dir():
        for f in args.model.iterdir():
            if f.is_file() and not f.name.startswith(src.name):
                shutil.copy2(f, args.output / f.name)
    save(quantizer.model.model, src, args.output / src.name)
    logging.info("written to %s", args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
