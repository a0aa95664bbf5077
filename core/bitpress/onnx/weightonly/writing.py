"""Writing solved weights into the graph as ``com.microsoft`` ``MatMulNBits`` / ``GatherBlockQuantized`` nodes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx import correction, layout
from bitpress.onnx.graph import MS_DOMAIN
from bitpress.onnx.tensors import np_dtype
from bitpress.onnx.weightonly.planning import Group, Use
from bitpress.onnx.weightonly.solving import Result
from bitpress.quant.solver import QuantizedBlocks

#: how float zero points are written: ``correction`` (MatMulNBits with their rounded values as uint8 zero points
#: plus the exact block-sum correction of :mod:`bitpress.onnx.correction`: ONNX Runtime's fast kernels) or
#: ``native`` (MatMulNBits' float zero-point input: ONNX Runtime's CPU kernel dequantizes the whole weight on
#: every call)
FLOAT_ZERO_POINT_FORMS = ("correction", "native")


class Writer:
    """Applies solved groups to the graph (single-threaded: protobuf edits are not thread-safe).

    ``float_zero_point_form``: see :data:`FLOAT_ZERO_POINT_FORMS`.
    """

    def __init__(self, model: OnnxModel, accuracy_level: int, float_zero_point_form: str = "correction") -> None:
        if float_zero_point_form not in FLOAT_ZERO_POINT_FORMS:
            raise ValueError(f"float_zero_point_form must be one of {FLOAT_ZERO_POINT_FORMS}, "
                             f"got {float_zero_point_form!r}")
        self.model = model
        self.accuracy_level = accuracy_level
        self.float_zero_point_form = float_zero_point_form
        self.graph = model.graph
        self.replace: dict[int, list[onnx.NodeProto]] = {}  # id(old node) -> new nodes
        #: MatMulNBits output -> its block-sum correction (bitpress.onnx.correction), added by finish()
        self.fixes: dict[str, correction.Fix] = {}
        self.drop: set[int] = set()
        self.new_inits: list[onnx.TensorProto] = []
        self.stored_bytes = 0  # integers, scales and zero points written (a correction counts as zero points)

    def write(self, res: Result) -> None:
        g = res.group
        weight = g.weight
        scale_dtype = scale_dtype_of(res.dtype)
        has_gather = any(u.is_gather for u in g.uses)
        matmul_uses = [u for u in g.uses if not u.is_gather]
        tag = f"Q{g.bits}"
        if matmul_uses:
            blocks, fix = res.blocks, None
            if self._corrects(res) and not has_gather:
                # float zero points -> uint8 round(z) + C = s * zi - s * z (bitpress.onnx.correction)
                c_name = f"{weight}_zero_point_correction"
                zi, c = correction.split_zero_points(blocks.scales, blocks.zero_points, g.bits, scale_dtype,
                                                     res.offsets)
                self._add(c_name, c)
                blocks = QuantizedBlocks(blocks.q, blocks.scales, zi)
                fix = correction.Fix(c_name, res.k, g.block_size, scale_dtype)
            mt = layout.to_matmul_nbits(blocks, g.bits, res.k, scale_dtype, flat=not has_gather,
                                        packed_q=res.packed)
            b_name = f"{weight}_{tag}"
            s_name = f"{weight}_scales"
            z_name = f"{weight}_zero_points" if mt.zero_points is not None else ""
            self._add(b_name, mt.b)
            self._add(s_name, mt.scales)
            if z_name:
                self._add(z_name, mt.zero_points)
            for u in matmul_uses:
                self._matmul(u, mt, b_name, s_name, z_name, fix)
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

    def _corrects(self, res: Result) -> bool:
        zps = res.blocks.zero_points
        return self.float_zero_point_form == "correction" and zps is not None and zps.dtype != np.uint8

    def add(self, name: str, array: np.ndarray, *, count: bool = True) -> None:
        """A new initializer; ``count``: its bytes are quantized data (integers, scales, zero points)."""
        if count and array.dtype != np.int64:  # not the Reshape target shape
            self.stored_bytes += array.nbytes
        self.new_inits.append(self.model.make_tensor(name, array))

    _add = add

    def _matmul(self, u: Use, mt: layout.MatMulNBitsTensors, b: str, s: str, z: str,
                fix: correction.Fix | None = None) -> None:
        node = u.node
        out = node.output[0]
        inputs = [node.input[0], b, s] + ([z] if z else [])
        new_nodes = []
        gemm_bias = node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]
        mm_out = f"{out}_MatMulNBits" if gemm_bias else out
        if fix is not None:
            self.fixes[mm_out] = fix
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
        if self.fixes:  # E is graph plumbing: not counted in stored_bytes (as the tied table's Reshape shape)
            nodes = correction.insert_corrections(
                nodes, self.fixes, lambda name, array: self.new_inits.append(self.model.make_tensor(name, array)))
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


def planned_bytes(group: Group, tensor: onnx.TensorProto, zero_points: str, corrected: bool = False) -> int:
    """Bytes the :class:`Writer` stores for ``group`` (integers, scales, zero points), known from the plan.

    Mirrors :meth:`Writer.write` and the layouts of :mod:`bitpress.onnx.layout`: a tied table is
    stored once (as MatMulNBits' ``B``, K padded to whole blocks); a Gather-only table drops the
    padding. ``zero_points``: :func:`~bitpress.onnx.weightonly.planning.zero_point_kind`; ``corrected``: float
    zero points written as uint8 ones plus a block-sum correction (one value of the scales' type per block).
    """
    a, b = (int(d) for d in tensor.dims)
    rows, k = (a, b) if group.uses[0].rows_are_table_rows else (b, a)
    bits, bs = group.bits, group.block_size
    n_blocks = -(-k // bs)
    scale_bytes = scale_dtype_of(np_dtype(tensor)).itemsize
    # a MatMul reader stores B with K padded to whole blocks; a Gather-only table drops the padding
    data = rows * n_blocks * (bs * bits // 8) if any(not u.is_gather for u in group.uses) else rows * (k * bits // 8)
    zps = {"none": 0, "uint8": rows * -(-n_blocks * bits // 8), "float": rows * n_blocks * scale_bytes}[zero_points]
    if corrected and zero_points == "float":  # uint8 round(z) besides the correction
        zps += rows * -(-n_blocks * bits // 8)
    return data + rows * n_blocks * scale_bytes + zps
