"""A float Hugging Face folder from a GGUF (transformers dequantizes it), for exporters that build from one.

Run in its own process (``python -m bitpress_gguf.hf_folder MODEL.gguf OUT_DIR``) so that torch's
memory goes with it. transformers reads the GGUF's weights (llama.cpp's dequantization), config
and tokenizer; the weights are copied into a plain model of the same config (a GGUF-loaded model
refuses ``save_pretrained``) and saved with the tokenizer, which :func:`spm_as_bpe` corrects.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def spm_as_bpe(tokenizer_json: Path, gguf_path: Path) -> bool:
    """A GGUF ``llama`` (SentencePiece) vocabulary as the BPE llama.cpp tokenizes with: merges ordered by
    the merged piece's score, byte fallback kept.

    transformers 5.17 writes such a vocabulary as a ``Unigram`` model whose scores llama.cpp's
    tokenizer never treats as probabilities, and splits words into pieces the model never saw
    (gemma-3-270m: "The history of the city" -> ``The ▁h ist ory ▁of ▁t he ▁c ity``; as BPE:
    ``The ▁history ▁of ▁the ▁city``). Returns whether the file was rewritten.
    """
    from bitpress_gguf.reader import GgufFile

    f = GgufFile(gguf_path)
    if f.field("tokenizer.ggml.model") != "llama":
        return False
    tok = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    if (tok.get("model") or {}).get("type") != "Unigram":
        return False
    pieces: list[str] = f.field("tokenizer.ggml.tokens") or []
    scores: list[float] = f.field("tokenizer.ggml.scores") or [0.0] * len(pieces)
    types: list[int] = f.field("tokenizer.ggml.token_type") or [1] * len(pieces)
    vocab = {p: i for i, p in enumerate(pieces)}
    merges: list[tuple[float, int, int, int, str, str]] = []
    for i, piece in enumerate(pieces):
        if types[i] != 1 or len(piece) < 2:  # normal pieces only: control, byte and unused ones are never merged
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                merges.append((-scores[i], i, vocab[a], vocab[b], a, b))
    merges.sort()
    unk = f.field("tokenizer.ggml.unknown_token_id")
    tok["model"] = {
        "type": "BPE", "dropout": None, "unk_token": pieces[unk] if isinstance(unk, int) else None,
        "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
        "ignore_merges": False, "vocab": vocab, "merges": [[m[4], m[5]] for m in merges],
    }
    tokenizer_json.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    return True


def bos_template(tokenizer_json: Path, gguf_path: Path) -> bool:
    """Where the GGUF says its tokenizer adds BOS (``tokenizer.ggml.add_bos_token``) but the converted
    tokenizer.json does not, a post-processor that adds it (what llama.cpp and ONNX Runtime GenAI's
    tokenizer then do on encoding); returns whether the file was rewritten."""
    from bitpress_gguf.reader import GgufFile

    f = GgufFile(gguf_path)
    bos = f.field("tokenizer.ggml.bos_token_id")
    pieces = f.field("tokenizer.ggml.tokens") or []
    if f.field("tokenizer.ggml.add_bos_token") is not True or not isinstance(bos, int) or bos >= len(pieces):
        return False
    config = tokenizer_json.with_name("tokenizer_config.json")
    if config.is_file():  # the same said in the config (transformers reads it there)
        cfg = json.loads(config.read_text(encoding="utf-8"))
        cfg["add_bos_token"] = True
        config.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tok = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    post = tok.get("post_processor") or {}
    if post and json.dumps(post).find(json.dumps(pieces[bos])) >= 0:
        return False  # already adds it
    name = pieces[bos]
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {name: {"id": name, "ids": [bos], "tokens": [name]}},
    }
    tokenizer_json.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    return True


def main(gguf_path: Path, out: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
                                                  quantization_config=GgufConfig(dequantize=True))
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    del loaded
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise SystemExit(f"transformers' GGUF model does not fit its own config: missing {missing}, "
                         f"unexpected {unexpected}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    rewritten = spm_as_bpe(out / "tokenizer.json", gguf_path)
    bos = bos_template(out / "tokenizer.json", gguf_path)
    return {"model_type": model.config.model_type, "tokenizer_rewritten": rewritten, "bos_added": bos}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m bitpress_gguf.hf_folder MODEL.gguf OUT_DIR")
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))))
