"""Writing solved weights into the graph as ``com.microsoft`` ``MatMulNBits`` / ``GatherBlockQuantized`` nodes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx import layout
from bitpress.onnx.graph import MS_DOMAIN
from bitpress.onnx.tensors import np_dtype
from bitpress.onnx.weightonly.planning import Group, Use
from bitpress.onnx.weightonly.solving import Result


class Writer:
    """Applies solved groups to the graph (single-threaded: protobuf edits are not thread-safe)."""

    def __init__(self, model: OnnxModel, accuracy_level: int) -> None:
        self.model = model
        self.accuracy_level = accuracy_level
        self.graph = model.graph
        self.replace: dict[int, list[onnx.NodeProto]] = {}  # id(old node) -> new nodes
        self.drop: set[int] = set()
        self.new_inits: list[onnx.TensorProto] = []
        self.stored_bytes = 0  # integers, scales and zero points written

    def write(self, res: Result) -> None:
        g = res.group
        weight = g.weight
        scale_dtype = scale_dtype_of(res.dtype)
        has_gather = any(u.is_gather for u in g.uses)
        matmul_uses = [u for u in g.uses if not u.is_gather]
        tag = f"Q{g.bits}"
        if matmul_uses:
            mt = layout.to_matmul_nbits(res.blocks, g.bits, res.k, scale_dtype, flat=not has_gather,
                                        packed_q=res.packed)
            b_name = f"{weight}_{tag}"
            s_name = f"{weight}_scales"
            z_name = f"{weight}_zero_points" if mt.zero_points is not None else ""
            self._add(b_name, mt.b)
            self._add(s_name, mt.scales)
            if z_name:
                self._add(z_name, mt.zero_points)
            for u in matmul_uses:
                self._matmul(u, mt, b_name, s_name, z_name)
        if has_gather:
            hidden = res.k
            gt_attrs = {"bits": g.bits, "block_size": g.block_size, "gather_axis": 0, "quantize_axis": 1}
            if matmul_uses:
                # tied: one B tensor; the Gather reads it through a Reshape (same bytes)
                rows = res.packed.shape[0]
                shape_name = f"{weight}_gather_shape"
                data_name = f"{weight}_{tag}_gather"
                self._add(shape_name, np.array([rows, hidden * g.bits // 8], np.int64))
                reshape = helper.make_node(
                    "Reshape", [b_name, shape_name], [data_name], name=f"{weight}_{tag}_Reshape"
                )
                gs_name, gz_name = s_name, z_name
                pre = [reshape]
            else:
                gt = layout.to_gather_block_quantized(res.blocks, g.bits, hidden, scale_dtype, packed_q=res.packed)
                data_name = f"{weight}_{tag}"
                gs_name = f"{weight}_scales"
                gz_name = f"{weight}_zero_points" if gt.zero_points is not None else ""
                self._add(data_name, gt.data)
                self._add(gs_name, gt.scales)
                if gz_name:
                    self._add(gz_name, gt.zero_points)
                pre = []
            for i, u in enumerate(u for u in g.uses if u.is_gather):
                inputs = [data_name, u.node.input[1], gs_name] + ([gz_name] if gz_name else [])
                node = helper.make_node(
                    "GatherBlockQuantized", inputs, list(u.node.output),
                    name=f"{u.node.name or weight}_{tag}", domain=MS_DOMAIN, **gt_attrs,
                )
                self.replace[id(u.node)] = ([*pre] if i == 0 else []) + [node]
                if u.transpose is not None:
                    self.drop.add(id(u.transpose))

    def _add(self, name: str, array: np.ndarray) -> None:
        if array.dtype != np.int64:  # not the Reshape target shape
            self.stored_bytes += array.nbytes
        self.new_inits.append(self.model.make_tensor(name, array))

    def _matmul(self, u: Use, mt: layout.MatMulNBitsTensors, b: str, s: str, z: str) -> None:
        node = u.node
        out = node.output[0]
        inputs = [node.input[0], b, s] + ([z] if z else [])
        new_nodes = []
        gemm_bias = node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]
        mm_out = f"{out}_MatMulNBits" if gemm_bias else out
        new_nodes.append(helper.make_node(
            "MatMulNBits", inputs, [mm_out], name=f"{node.name or out}_Q{mt.bits}", domain=MS_DOMAIN,
            **mt.attributes(self.accuracy_level),
        ))
        if gemm_bias:
            new_nodes.append(helper.make_node("Add", [mm_out, node.input[2]], [out], name=f"{node.name}_bias"))
        self.replace[id(node)] = new_nodes
        if u.transpose is not None:
            self.drop.add(id(u.transpose))

    def finish(self) -> None:
        """Swap nodes in place (keeping topological order) and drop orphaned initializers."""
        nodes = []
        for node in self.graph.node:
            if id(node) in self.drop:
                continue
            nodes.extend(self.replace.get(id(node), [node]))
        new = [onnx.NodeProto() for _ in nodes]
        for dst, src in zip(new, nodes, strict=True):
            dst.CopyFrom(src)
        del self.graph.node[:]
        self.graph.node.extend(new)
        # tensors are solved in parallel and finish in any order: sorted, the output's bytes are reproducible
        self.graph.initializer.extend(sorted(self.new_inits, key=lambda t: t.name))
        self.model.remove_unused_initializers()
        self.model.modified = True


def scale_dtype_of(dtype: np.dtype) -> np.dtype:
    """The scales' dtype for a weight of ``dtype``: float16 stays float16, everything else float32."""
    return np.dtype(np.float16) if np.dtype(dtype) == np.float16 else np.dtype(np.float32)


def planned_bytes(group: Group, tensor: onnx.TensorProto, zero_points: str) -> int:
    """Bytes the :class:`Writer` stores for ``group`` (integers, scales, zero points), known from the plan.

    Mirrors :meth:`Writer.write` and the layouts of :mod:`bitpress.onnx.layout`: a tied table is
    stored once (as MatMulNBits' ``B``, K padded to whole blocks); a Gather-only table drops the
    padding. ``zero_points``: :func:`~bitpress.onnx.weightonly.planning.zero_point_kind`.
    """
    a, b = (int(d) for d in tensor.dims)
    rows, k = (a, b) if group.uses[0].rows_are_table_rows else (b, a)
    bits, bs = group.bits, group.block_size
    n_blocks = -(-k // bs)
    scale_bytes = scale_dtype_of(np_dtype(tensor)).itemsize
    # a MatMul reader stores B with K padded to whole blocks; a Gather-only table drops the padding
    data = rows * n_blocks * (bs * bits // 8) if any(not u.is_gather for u in group.uses) else rows * (k * bits // 8)
    zps = {"none": 0, "uint8": rows * -(-n_blocks * bits // 8), "float": rows * n_blocks * scale_bytes}[zero_points]
    return data + rows * n_blocks * scale_bytes + zps
