"""llm-compressor's GPTQ (``oneshot`` + ``GPTQModifier``) on a Hugging Face causal LM, on CPU; and perplexity.

Runs in its own environment (``bench/.venv-llmc``: torch, llmcompressor), never the project's::

    python peers/llmc_gptq.py quantize HF_DIR OUT_DIR --windows calib.npy [--block-size 128] [--asym]
    python peers/llmc_gptq.py perplexity HF_DIR --windows eval.npy      # prints {"perplexity": ...} as JSON
    python peers/llmc_gptq.py perplexity HF_DIR --windows eval.npy --bitpress   # a bitpress HF checkpoint, read by
                                                                      # bitpress.hf.checkpoint (the project's venv)

``--windows`` is an ``int64 [n, seq]`` array of token windows (the benchmark writes the same windows
for every tool). Quantization is weight-only int4, groups of ``--block-size`` along the input,
``dampening_frac`` 0.01, no act-order (the settings the ONNX tools run with), ``lm_head`` left
float as llm-compressor's examples do.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any


def quantize(hf: Path, out: Path, windows: Any, block_size: int, symmetric: bool) -> None:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    rows = [[int(t) for t in w] for w in windows]
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group",
                               group_size=block_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], block_size=128,
                          dampening_frac=0.01, actorder=None)
    t0 = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=len(rows[0]),
            num_calibration_samples=len(rows), processor=tokenizer)
    print(f"[llmc] oneshot {time.perf_counter() - t0:.1f} s", flush=True)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)


def perplexity(hf: Path, windows: Any, bitpress: bool = False) -> dict[str, float]:
    """exp(mean next-token negative log-likelihood) over the windows, each run alone (no cache).

    ``bitpress``: the folder is a bitpress checkpoint (``quant_method: bitpress``), which transformers alone
    would load without its quantized weights; bitpress's loader restores them."""
    import torch
    from transformers import AutoModelForCausalLM

    if bitpress:
        from bitpress.hf.checkpoint import load_model

        model = load_model(hf)[0]
    else:
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.as_tensor(w, dtype=torch.long)[None]
            logits = model(input_ids=ids).logits[0, :-1].double()
            logp = torch.log_softmax(logits, -1)
            nll -= float(logp.gather(1, ids[0, 1:, None]).sum())
            count += ids.shape[1] - 1
    return {"perplexity": math.exp(nll / count), "tokens": count, "windows": len(windows)}


def main() -> int:
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("model", type=Path)
    q.add_argument("output", type=Path)
    q.add_argument("--windows", type=Path, required=True)
    q.add_argument("--block-size", type=int, default=128)
    q.add_argument("--asym", action="store_true")
    e = sub.add_parser("perplexity")
    e.add_argument("model", type=Path)
    e.add_argument("--windows", type=Path, required=True)
    e.add_argument("--bitpress", action="store_true", help="load with bitpress.hf.checkpoint.load_model")
    args = p.parse_args()
    windows = np.load(args.windows)
    if args.cmd == "quantize":
        quantize(args.model, args.output, windows, args.block_size, not args.asym)
    else:
        print(json.dumps(perplexity(args.model, windows, args.bitpress)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
