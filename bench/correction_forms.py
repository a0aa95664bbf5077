"""Float zero points on ONNX Runtime's fast kernels: what each exact form costs at one token.

    ../.venv/bin/python correction_forms.py [--layers 30] [--rounds 15]

A stack of SmolLM2-135M's weight shapes (per layer: fused q/k/v 576 x 960, o 576 x 576, gate and
up 576 x 1536, down 1536 x 576; block 32, 4-bit, accuracy_level 4), each written as

* **sym**: ``MatMulNBits`` without zero points (the GenAI builder's int4);
* **u8**: with uint8 zero points (integer zero points, what ``float_zero_points=false`` writes);
* **mm**: u8 plus the block-sum correction of float zero points as bitpress writes it
  (:mod:`bitpress.onnx.correction`: block sums by a MatMul with the block indicator, shared per
  input, a float32 MatMul with ``C`` and an Add per weight);
* **reduce**: the same correction with the block sums by Reshape + ReduceSum (no indicator matrix);
* **q8**: the block sums times ``C`` as an 8-bit ``MatMulNBits`` (not exact: ``C`` rounded to 8 bits).

All of them in one process, one thread, timed alternately (the order rotates each round); prints
the median milliseconds of one call (all layers) and the ratio to the first form. Random weights:
the kernels' speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from onnx import numpy_helper as nh

SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate", 576, 1536), ("up", 576, 1536), ("down", 1536, 576)]
BLOCK = 32
FORMS = ("sym", "u8", "mm", "reduce", "q8")


def build(form: str, layers: int, rng: np.random.Generator) -> bytes:
    nodes, inits, outs = [], [], []

    def init(name: str, arr: np.ndarray) -> None:
        inits.append(nh.from_array(arr, name))

    init("axes", np.array([-1], np.int64))
    for k in (576, 1536):
        nb = k // BLOCK
        init(f"shape{k}", np.array([1, nb, BLOCK], np.int64))
        e = np.zeros((k, nb), np.float32)
        e[np.arange(k), np.arange(k) // BLOCK] = 1
        init(f"E{k}", e)
    sums: dict[tuple[str, int], str] = {}
    for layer in range(layers):
        for name, k, n in SHAPES:
            x = f"x{k}"
            p, nb = f"l{layer}_{name}", k // BLOCK
            init(p + "_B", rng.integers(0, 256, (n, nb, BLOCK // 2), dtype=np.uint8))
            init(p + "_s", rng.random((n * nb,), np.float32) * 0.01 + 0.001)
            ins = [x, p + "_B", p + "_s"]
            if form != "sym":
                init(p + "_zp", rng.integers(0, 256, (n * ((nb + 1) // 2),), dtype=np.uint8))
                ins.append(p + "_zp")
            out = p + "_y"
            main = out if form in ("sym", "u8") else p + "_main"
            nodes.append(helper.make_node("MatMulNBits", ins, [main], domain="com.microsoft", K=k, N=n, bits=4,
                                          block_size=BLOCK, accuracy_level=4))
            if form in ("mm", "reduce", "q8"):
                if (x, layer) not in sums:
                    s = sums[(x, layer)] = p + "_sums"
                    if form == "mm":
                        nodes.append(helper.make_node("MatMul", [x, f"E{k}"], [s]))
                    else:
                        nodes.append(helper.make_node("Reshape", [x, f"shape{k}"], [s + "_r"]))
                        nodes.append(helper.make_node("ReduceSum", [s + "_r", "axes"], [s], keepdims=0))
                s = sums[(x, layer)]
                if form == "q8":
                    nb2 = -(-nb // 16)
                    init(p + "_cB", rng.integers(0, 256, (n, nb2, 16), dtype=np.uint8))
                    init(p + "_cs", rng.random((n * nb2,), np.float32) * 0.001)
                    init(p + "_czp", np.full((n * nb2,), 128, np.uint8))
                    nodes.append(helper.make_node("MatMulNBits", [s, p + "_cB", p + "_cs", p + "_czp"], [p + "_corr"],
                                                  domain="com.microsoft", K=nb, N=n, bits=8, block_size=16,
                                                  accuracy_level=4))
                else:
                    init(p + "_C", rng.standard_normal((nb, n)).astype(np.float32) * 0.001)
                    nodes.append(helper.make_node("MatMul", [s, p + "_C"], [p + "_corr"]))
                nodes.append(helper.make_node("Add", [main, p + "_corr"], [out]))
            outs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, None))
    used = {i for node in nodes for i in node.input}
    inits = [t for t in inits if t.name in used]
    graph = helper.make_graph(nodes, form, [helper.make_tensor_value_info("x576", TensorProto.FLOAT, [1, 576]),
                                            helper.make_tensor_value_info("x1536", TensorProto.FLOAT, [1, 1536])],
                              outs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return model.SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--forms", default=",".join(FORMS), help="comma-separated, the first is the reference")
    args = ap.parse_args()
    forms = args.forms.split(",")
    rng = np.random.default_rng(0)
    sessions = {}
    for form in forms:
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        sessions[form] = ort.InferenceSession(build(form, args.layers, rng), so, providers=["CPUExecutionProvider"])
    feed = {"x576": rng.standard_normal((1, 576)).astype(np.float32),
            "x1536": rng.standard_normal((1, 1536)).astype(np.float32)}
    times: dict[str, list[float]] = {f: [] for f in forms}
    for r in range(args.rounds):
        for form in forms[r % len(forms):] + forms[:r % len(forms)]:
            sess = sessions[form]
            sess.run(None, feed)
            t0 = time.perf_counter()
            for _ in range(20):
                sess.run(None, feed)
            times[form].append((time.perf_counter() - t0) / 20 * 1e3)
    base = float(np.median(times[forms[0]]))
    for form in forms:
        med = float(np.median(times[form]))
        print(f"{form:8s} {med:7.3f} ms  x{base / med:5.2f}  (range {np.ptp(times[form]) / med:.0%})")


if __name__ == "__main__":
    main()
