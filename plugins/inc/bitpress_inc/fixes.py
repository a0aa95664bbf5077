"""Corrections bitpress applies to what INC 1.0 reads and writes.

**Scalar Mul constants before SmoothQuant and AWQ.** Both fold a per-channel scale into the node
before a MatMul; for a Mul they multiply its constant by the scale and write the product back with
the constant's *old* shape, so a scalar constant (BERT's attention scaling and GELU have them) makes
them fail ("Number of values (1536) does not match tensor dimensions requiring 1 elements", "Raw
data size does not match tensor's size"). :func:`broadcast_scalar_muls` gives such a Mul a vector
constant of the MatMul's input width holding the same value: the same model, numerically, that
INC can fold into.

**Zero points of asymmetric int4 MatMulNBits.** ONNX Runtime reads them as ``[N, ceil(k_blocks / 2)]``
bytes: each output row's 4-bit zero points start on a new byte. INC 1.0 packs them as one flat
nibble stream over all rows (``ceil(N * k_blocks / 2)`` bytes), which is the same layout only when
``k_blocks`` (``K / group_size``, rounded up) is even. With an odd count, ONNX Runtime 1.32 refuses
the model at load ("zero_points initializer shape ... does not match"); older versions read the
zero points of every row but the first from the wrong nibbles. :func:`repack_zero_points` rewrites
them row-aligned (padding nibble 8, ONNX Runtime's own), the values unchanged.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from bitpress.plugin import QuantizationError, iter_graphs


def _attrs(node: onnx.NodeProto) -> dict[str, int]:
    ints = (a for a in node.attribute if a.type == onnx.AttributeProto.INT)
    return {a.name: int(onnx.helper.get_attribute_value(a)) for a in ints}


def unpack_flat(packed: np.ndarray, rows: int, blocks: int) -> np.ndarray:
    """INC's flat nibble stream (low nibble first) as ``[rows, blocks]`` uint8 zero points."""
    nibbles = np.empty(packed.size * 2, dtype=np.uint8)
    nibbles[0::2] = packed & 0x0F
    nibbles[1::2] = packed >> 4
    return nibbles[: rows * blocks].reshape(rows, blocks)


def pack_rows(zero_points: np.ndarray) -> np.ndarray:
    """``[rows, blocks]`` 4-bit zero points as ONNX Runtime's ``[rows, ceil(blocks / 2)]`` bytes."""
    rows, blocks = zero_points.shape
    if blocks % 2:
        zero_points = np.concatenate([zero_points, np.full((rows, 1), 8, dtype=np.uint8)], axis=1)
    return (zero_points[:, 0::2] | (zero_points[:, 1::2] << 4)).astype(np.uint8)


def repack_zero_points(proto: onnx.ModelProto) -> int:
    """Make every 4-bit MatMulNBits zero-point tensor row-aligned; returns how many were rewritten."""
    inits = {t.name: t for g in iter_graphs(proto.graph) for t in g.initializer}
    fixed = 0
    for g in iter_graphs(proto.graph):
        for node in g.node:
            if node.op_type != "MatMulNBits" or len(node.input) < 4 or not node.input[3]:
                continue
            a = _attrs(node)
            if a.get("bits", 4) != 4 or node.input[3] not in inits:
                continue
            rows, blocks = a["N"], -(-a["K"] // a["block_size"])
            tensor = inits[node.input[3]]
            if tensor.data_type != onnx.TensorProto.UINT8:
                continue  # float zero points: one per block, no packing
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                raise QuantizationError(f"MatMulNBits {node.name}: zero points in external data cannot be checked")
            packed = numpy_helper.to_array(tensor).reshape(-1)
            aligned = rows * ((blocks + 1) // 2)
            if packed.size == aligned:  # row-aligned already (even block counts, or a single row)
                continue
            if packed.size != (rows * blocks + 1) // 2:
                raise QuantizationError(
                    f"MatMulNBits {node.name}: {packed.size} zero-point bytes fit neither ONNX Runtime's layout "
                    f"({aligned}) nor INC's flat one ({(rows * blocks + 1) // 2})"
                )
            repacked = pack_rows(unpack_flat(packed, rows, blocks))
            tensor.CopyFrom(numpy_helper.from_array(repacked.reshape(-1), tensor.name))
            fixed += 1
    return fixed


def broadcast_scalar_muls(proto: onnx.ModelProto) -> int:
    """Replace scalar float constants of Mul nodes that feed only MatMuls with [K] vectors; returns how many.

    ``K`` is the rows of the MatMuls' 2-D weight initializers (all equal); the scalar is an
    initializer or a Constant node's value. The vector gets a name of its own, so a scalar shared
    with other nodes stays as it is for them.
    """
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    # Constant nodes (torch.onnx exports) become initializers in INC's hands (ONNX Runtime's optimizer)
    constants = {n.output[0]: a.t for n in graph.node if n.op_type == "Constant"
                 for a in n.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    taken = set(inits) | {o for n in graph.node for o in n.output}
    changed = 0
    for node in graph.node:
        if node.op_type != "Mul" or len(node.input) != 2 or node.output[0] in outputs:
            continue
        scalar = [i for i, name in enumerate(node.input)
                  if _is_float_scalar(inits.get(name) or constants.get(name))]
        children = consumers.get(node.output[0], [])
        if len(scalar) != 1 or not children or any(c.op_type != "MatMul" or c.input[0] != node.output[0]
                                                   for c in children):
            continue
        weights = [inits.get(c.input[1]) for c in children]
        if any(w is None or len(w.dims) != 2 for w in weights) or len({w.dims[0] for w in weights}) != 1:
            continue
        index = scalar[0]
        tensor = inits.get(node.input[index]) or constants[node.input[index]]
        value = numpy_helper.to_array(tensor).reshape(-1)[0]
        name = f"{node.input[index]}_broadcast_{weights[0].dims[0]}"
        while name in taken:
            name += "_"
        taken.add(name)
        vector = np.full(int(weights[0].dims[0]), value, dtype=numpy_helper.to_array(tensor).dtype)
        graph.initializer.append(numpy_helper.from_array(vector, name))
        old = node.input[index]
        node.input[index] = name
        consumers[old] = [c for c in consumers.get(old, []) if c is not node]
        if not consumers[old] and old not in outputs:  # unused now: ONNX Runtime would warn about it
            _remove_source(graph, old)
        changed += 1
    return changed


def _remove_source(graph: onnx.GraphProto, name: str) -> None:
    for i, tensor in enumerate(graph.initializer):
        if tensor.name == name:
            del graph.initializer[i]
            return
    for i, node in enumerate(graph.node):
        if node.op_type == "Constant" and list(node.output) == [name]:
            del graph.node[i]
            return


def _is_float_scalar(tensor: onnx.TensorProto | None) -> bool:
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
    return (tensor is not None and tensor.data_type in floats and int(np.prod(tensor.dims)) == 1
            and tensor.data_location != onnx.TensorProto.EXTERNAL)
