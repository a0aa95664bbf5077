"""Rewriting ``DequantizeLinear(W_int) -> MatMul`` into ``com.microsoft`` ``MatMulNBits``, exactly.

Toolkits such as NVIDIA ModelOpt write weight-only int4 / int8 models in QDQ form: a constant
integer weight ``W [K, N]``, ``DequantizeLinear`` with blocks along K (opset 21 ``block_size``,
``axis=0``) and the float ``MatMul``. ONNX Runtime fuses that pattern itself each time a CPU
session loads (paying for it in load time, and with accuracy_level 4: int8 activations, see
docs/qdq-to-nbits.md). :func:`convert_qdq_to_nbits` writes the fused form into the file: the same
integers, scales and zero points (nothing is quantized again), laid out as the host's own
weight-only passes write ``MatMulNBits`` (:mod:`bitpress.onnx.layout`, written by
:class:`bitpress.onnx.weightonly.Writer`).

What is converted (anything else is reported in :attr:`QdqConversion.skipped` with the reason):

* the weight: an initializer (not also a graph input) of type int4, uint4, int8 or uint8, 2-D;
  signed integers become unsigned with the zero point moved by ``2**(bits-1)``
  (``(q + 8) - (zp + 8) == q - zp``), which ``MatMulNBits`` requires;
* the quantization: blockwise along K (``block_size`` > 0 on the K axis), per output channel
  (``block_size`` 0, 1-D scales along N) or per tensor (scalar scale); scales float32 or float16
  (the ``MatMulNBits`` node then computes in that type, as the MatMul did);
* ``MatMulNBits`` needs a power-of-two block of at least 16 along K. A DQ block of
  ``b = 2**j * odd`` elements is written as ``b / p`` blocks of ``p = min(2**j, 256)`` with its
  scale and zero point repeated, so the dequantized weight is the same; a per-channel or
  per-tensor DQ becomes blocks of ``min(256, next power of two >= K)``. K not a multiple of the
  block is padded with the block's zero point (the padding dequantizes to 0);
* the readers: every node reading the DQ output must be a ``MatMul`` taking it as its weight
  (input B), directly, through a ``Transpose`` (a weight stored ``[N, K]`` with blocks along
  its last axis) or through a no-op ``Reshape`` to the weight's own shape. A DQ read by several
  MatMuls (tied or shared weights) is converted once and the new nodes share the tensors. A DQ
  also read by anything else (Gather, Gemm, a graph output, a subgraph) is left as it is, as
  are all its MatMuls: converting some would store the weight twice;
* the activation side is not touched: AWQ's pre-quant-scale ``Mul`` stays where it is.

The DQ nodes (and the Transpose / Reshape) of converted weights are removed with the
initializers nothing reads any more, and the ``com.microsoft`` opset is declared. Weights are
read one at a time and converted in row chunks (the host's usual ``CHUNK_ELEMENTS``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx import helper

from bitpress.errors import QuantizationError, UsageError
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx import weightonly
from bitpress.onnx.graph import consumers, ensure_opsets
from bitpress.onnx.kernels import TargetOptions
from bitpress.onnx.layout import pack_along_last
from bitpress.onnx.tensors import is_external, iter_graphs, tensor_nbytes
from bitpress.onnx.weightonly.planning import Group, Use
from bitpress.onnx.weightonly.solving import Result
from bitpress.onnx.weightonly.writing import Writer
from bitpress.options import option
from bitpress.passes import Pass, PassContext
from bitpress.quant.solver import QuantizedBlocks
from bitpress.selection import NameMatcher

log = logging.getLogger(__name__)

T = onnx.TensorProto
#: integer weight type -> (bits, signed); MatMulNBits (ORT 1.32) also takes bits=2, which the
#: host's MatMulNBits writer (:mod:`bitpress.onnx.layout`) does not pack
WEIGHT_TYPES: dict[int, tuple[int, bool]] = {T.INT4: (4, True), T.UINT4: (4, False), T.INT8: (8, True),
                                             T.UINT8: (8, False)}
SCALE_TYPES = {T.FLOAT: np.dtype(np.float32), T.FLOAT16: np.dtype(np.float16)}
#: the largest block written (what every bitpress writer and kernel takes, see quant.solver.check_block_size)
MAX_BLOCK = 256
MIN_BLOCK = 16


@dataclass
class QdqConversion:
    """What :func:`convert_qdq_to_nbits` did.

    ``converted``: the MatMul nodes rewritten (names; an unnamed node by its output's name), in
    graph order. ``skipped``: MatMul node (or name asked for in ``nodes``) -> why it was left.
    """

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    #: integer weights converted (a shared weight counts once)
    weights: int = 0
    #: bytes of the MatMulNBits tensors written (integers, scales, zero points)
    stored_bytes: int = 0
    #: bytes of the initializers the conversion removed (DQ integers, scales, zero points)
    removed_bytes: int = 0

    def summary(self) -> str:
        if not self.converted:
            return f"converted no MatMul ({len(self.skipped)} skipped)"
        text = (f"converted {len(self.converted)} MatMul nodes ({self.weights} weights) to MatMulNBits, "
                f"{self.removed_bytes / 1e6:.2f} MB of QDQ tensors -> {self.stored_bytes / 1e6:.2f} MB")
        if self.skipped:
            text += f"; {len(self.skipped)} skipped (see -v)"
        return text

    def to_json(self) -> dict[str, Any]:
        return {"converted": list(self.converted), "skipped": dict(self.skipped), "weights": self.weights,
                "stored_bytes": self.stored_bytes, "removed_bytes": self.removed_bytes}


@dataclass
class _Weight:
    """One DequantizeLinear weight to convert, and the MatMuls reading it."""

    dq: onnx.NodeProto
    weight: str
    scale: str
    zero_point: str
    bits: int
    signed: bool
    k: int
    n: int
    stored_nk: bool  # the integer tensor is [N, K] (read through a Transpose), else [K, N]
    dq_block: int  # DQ elements per block along K; 0: one scale per output channel / per tensor
    block: int  # the MatMulNBits block_size
    matmuls: list[onnx.NodeProto]
    between: list[onnx.NodeProto]  # the Transpose / Reshape nodes between DQ and the MatMuls
    scale_dtype: np.dtype


def node_key(node: onnx.NodeProto) -> str:
    """How a node is named in reports and selections: its name, else its first output's name."""
    return node.name or (node.output[0] if node.output else node.op_type)


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _target_block(dq_block: int, k: int) -> int:
    """The MatMulNBits block for a DQ block of ``dq_block`` (0: one block spanning K); 0 when none fits."""
    if dq_block == 0:
        return min(MAX_BLOCK, max(MIN_BLOCK, 1 << max(0, (k - 1).bit_length())))
    p = min(MAX_BLOCK, dq_block & -dq_block)  # the largest power of two dividing the DQ block
    return p if p >= MIN_BLOCK else 0


class _Finder:
    """Finds the DequantizeLinear -> MatMul weights of a graph; reads no tensor data."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.inits = {t.name: t for t in graph.initializer}
        self.cons = consumers(graph)
        self.graph_inputs = {i.name for i in graph.input}
        self.graph_outputs = {o.name for o in graph.output}
        self.subgraph_reads: set[str] = set()
        for node in graph.node:
            for attr in node.attribute:
                subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                for sub in subs:
                    for g in iter_graphs(sub):
                        self.subgraph_reads.update(i for n in g.node for i in n.input if i)

    def find(self) -> tuple[list[_Weight], dict[str, str]]:
        found: list[_Weight] = []
        skipped: dict[str, str] = {}
        for node in self.graph.node:
            if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx") or not node.output:
                continue
            matmuls, between, stored_nk, why = self._readers(node)
            if not matmuls:
                continue  # feeds no MatMul: not this converter's business
            if why is None:
                weight, why = self._weight(node, matmuls, between, stored_nk)
                if weight is not None:
                    found.append(weight)
                    continue
            for m in matmuls:
                skipped[node_key(m)] = why or "not convertible"
        return found, skipped

    def _elsewhere(self, name: str) -> bool:
        return name in self.graph_outputs or name in self.subgraph_reads

    def _readers(self, dq: onnx.NodeProto) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto], bool, str | None]:
        """The MatMuls reading ``dq`` (directly or through one Transpose / no-op Reshape), the nodes
        between, whether the weight is read transposed, and why not convertible (None: it is)."""
        out = dq.output[0]
        matmuls: list[onnx.NodeProto] = []
        between: list[onnx.NodeProto] = []
        others: list[str] = []
        orientations: set[bool] = set()
        elsewhere = self._elsewhere(out)
        for reader in self.cons.get(out, []):
            if reader.op_type == "MatMul" and reader.domain in ("", "ai.onnx"):
                if len(reader.input) > 1 and reader.input[1] == out and reader.input[0] != out:
                    matmuls.append(reader)
                    orientations.add(False)
                else:
                    matmuls.append(reader)
                    others.append(f"MatMul {node_key(reader)} reads it as its input A")
                continue
            via = self._via(reader, dq)
            if via is None:
                others.append(f"{reader.op_type} {node_key(reader)}")
                continue
            transposed, why = via
            r_out = reader.output[0]
            elsewhere |= self._elsewhere(r_out)
            readers = self.cons.get(r_out, [])
            mm = [r for r in readers if r.op_type == "MatMul" and r.domain in ("", "ai.onnx")
                  and len(r.input) > 1 and r.input[1] == r_out and r.input[0] != r_out]
            matmuls.extend(mm)
            if why is not None or len(mm) != len(readers):
                others.append(why or f"{reader.op_type} {node_key(reader)} also feeds "
                              + ", ".join(f"{r.op_type} {node_key(r)}" for r in readers if r not in mm))
                # MatMuls that read the reshaped / transposed weight as A are not ours to report
                continue
            between.append(reader)
            orientations.add(transposed)
        if not matmuls:
            return [], [], False, None
        if elsewhere:
            others.append("a graph output or a subgraph")
        if not others and len(orientations) > 1:
            others.append("MatMuls reading it both directly and transposed (two orientations)")
        if others:
            shown = "; ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            return matmuls, between, False, (
                f"its DequantizeLinear {node_key(dq)} is also read by {shown}: left as QDQ "
                "(converting only some readers would store the weight twice)"
            )
        return matmuls, between, orientations.pop(), None

    def _via(self, node: onnx.NodeProto, dq: onnx.NodeProto) -> tuple[bool, str | None] | None:
        """For a Transpose / Reshape reading the DQ output: (transposes?, why not usable); None: other op."""
        if node.domain not in ("", "ai.onnx") or not node.output or node.input[0] != dq.output[0]:
            return None
        tensor = self.inits.get(dq.input[0])
        dims = [int(d) for d in tensor.dims] if tensor is not None else []
        if node.op_type == "Transpose":
            perm = list(_attr(node, "perm", [1, 0]))
            if len(dims) == 2 and perm == [1, 0]:
                return True, None
            if len(dims) == 2 and perm == [0, 1]:
                return False, None
            return True, f"Transpose {node_key(node)} with perm {perm} (not a 2-D transpose)"
        if node.op_type == "Reshape":
            shape = self.inits.get(node.input[1]) if len(node.input) > 1 else None
            if shape is not None and shape.data_type == T.INT64 and not is_external(shape):
                target = [int(v) for v in onnx.numpy_helper.to_array(shape).reshape(-1)]
                if _reshaped(dims, target, bool(_attr(node, "allowzero", 0))) == dims:
                    return False, None
            return False, f"Reshape {node_key(node)} changes the weight's shape (only a no-op Reshape is converted)"
        return None

    def _weight(self, dq: onnx.NodeProto, matmuls: list[onnx.NodeProto], between: list[onnx.NodeProto],
                stored_nk: bool) -> tuple[_Weight | None, str]:
        where = f"DequantizeLinear {node_key(dq)}"
        names = list(dq.input) + [""] * (3 - len(dq.input))
        w_name, s_name, z_name = names[:3]
        tensor = self.inits.get(w_name)
        if not s_name:
            return None, f"{where} has no scale input"
        if tensor is None:
            return None, f"{where}: its integer weight {w_name!r} is not a constant initializer"
        for name, what in ((w_name, "weight"), (s_name, "scale"), (z_name, "zero point")):
            if name and name in self.graph_inputs:
                return None, f"{where}: its {what} {name!r} is also a graph input (it can be fed at run time)"
            if name and name not in self.inits:
                return None, f"{where}: its {what} {name!r} is not a constant initializer"
        if tensor.data_type not in WEIGHT_TYPES:
            tname = T.DataType.Name(tensor.data_type)
            return None, f"{where}: weight type {tname} (int4, uint4, int8 and uint8 are converted)"
        bits, signed = WEIGHT_TYPES[tensor.data_type]
        dims = [int(d) for d in tensor.dims]
        if len(dims) != 2 or 0 in dims:
            return None, f"{where}: weight shape {dims} is not a 2-D matrix"
        k, n = (dims[1], dims[0]) if stored_nk else (dims[0], dims[1])
        scale = self.inits[s_name]
        if scale.data_type not in SCALE_TYPES:
            tname = T.DataType.Name(scale.data_type)
            return None, f"{where}: {tname} scales (MatMulNBits is written with float32 or float16 scales)"
        out_dtype = int(_attr(dq, "output_dtype", 0))
        if out_dtype and out_dtype != scale.data_type:
            return None, f"{where}: output_dtype {T.DataType.Name(out_dtype)} differs from its scales' type"
        if z_name and self.inits[z_name].data_type != tensor.data_type:
            return None, f"{where}: zero point type differs from the weight's"
        if z_name and list(self.inits[z_name].dims) != list(scale.dims):
            return None, f"{where}: zero point shape {list(self.inits[z_name].dims)} differs from the scales'"
        s_dims = [int(d) for d in scale.dims]
        axis = int(_attr(dq, "axis", 1))
        axis = axis + 2 if axis < 0 else axis
        block_size = int(_attr(dq, "block_size", 0))
        k_axis, n_axis = (1, 0) if stored_nk else (0, 1)
        if block_size > 0:
            if axis != k_axis:
                return None, f"{where}: blocks run along N (axis {axis}); MatMulNBits' blocks run along K"
            want = [n, -(-k // block_size)] if stored_nk else [-(-k // block_size), n]
            if s_dims != want:
                return None, f"{where}: scale shape {s_dims} does not fit blocks of {block_size} (expected {want})"
            dq_block = block_size
        elif len(s_dims) == 0:
            dq_block = 0
        elif len(s_dims) == 1:
            if axis != n_axis or s_dims[0] != n:
                return None, f"{where}: scales per input channel (K), not per output channel: no MatMulNBits form"
            dq_block = 0
        else:
            return None, f"{where}: scale shape {s_dims} without block_size"
        block = _target_block(dq_block, k)
        if not block:
            return None, (f"{where}: block_size {dq_block} has no power-of-two divisor of at least {MIN_BLOCK} "
                          "(MatMulNBits' blocks are powers of two from 16)")
        return _Weight(dq, w_name, s_name, z_name, bits, signed, k, n, stored_nk, dq_block, block, matmuls,
                       between, SCALE_TYPES[scale.data_type]), ""


def _reshaped(dims: list[int], target: list[int], allowzero: bool) -> list[int] | None:
    """The shape ``Reshape(target)`` gives a tensor of ``dims`` (0 copies a dim unless allowzero; one -1)."""
    if len(target) != len(dims) and 0 in target and not allowzero:
        return None
    out = [dims[i] if t == 0 and not allowzero and i < len(dims) else t for i, t in enumerate(target)]
    if out.count(-1) == 1:
        known = int(np.prod([t for t in out if t != -1], dtype=np.int64))
        total = int(np.prod(dims, dtype=np.int64))
        if known <= 0 or total % known:
            return None
        out[out.index(-1)] = total // known
    return out


def _unsigned(values: np.ndarray, bits: int, signed: bool) -> np.ndarray:
    """``values`` (any integer type of one byte, ml_dtypes int4 included) as unsigned ``bits``-wide
    integers, signed ones shifted by ``2**(bits-1)`` (two's complement: an XOR of the top bit); a new array."""
    u = np.array(values, copy=True).view(np.uint8)
    if bits == 4:
        u &= 0x0F  # ml_dtypes keeps int4 as a byte whose low nibble is the value
    if signed:
        u ^= np.uint8(1 << (bits - 1))
    return u


def _per_row(scale: np.ndarray, w: _Weight, n_blocks: int) -> np.ndarray:
    """Scales (or zero points) ``[N, n_blocks]`` in MatMulNBits' blocks, from the DQ's layout."""
    if w.dq_block == 0:  # per tensor (one value) or per output channel (N values): every block alike
        return np.repeat(np.broadcast_to(scale.reshape(-1, 1), (w.n, 1)), n_blocks, axis=1)
    rows = scale if w.stored_nk else scale.T
    # a DQ block of r MatMulNBits blocks: its scale / zero point repeated r times
    return np.ascontiguousarray(np.repeat(rows, w.dq_block // w.block, axis=1)[:, :n_blocks])


def _convert_weight(model: OnnxModel, w: _Weight) -> Result:
    """The MatMulNBits tensors of one weight: the DQ's integers re-laid, never re-quantized."""
    inits = model.initializers()
    bits, bs, k, n = w.bits, w.block, w.k, w.n
    n_blocks = -(-k // bs)
    scales = _per_row(np.asarray(model.array(inits[w.scale])), w, n_blocks).astype(w.scale_dtype, copy=False)
    if not np.isfinite(scales).all():
        raise QuantizationError(f"weight {w.weight}: its DequantizeLinear scales hold NaN or infinite values")
    if w.zero_point:
        zp = _per_row(_unsigned(model.array(inits[w.zero_point]), bits, w.signed), w, n_blocks)
    else:  # DQ's default zero point is 0, which is 2**(bits-1) once a signed weight is shifted
        zp = np.full((n, n_blocks), (1 << (bits - 1)) if w.signed else 0, np.uint8)
    q_all = model.array(inits[w.weight])  # memory-mapped when external (int4: unpacked, one byte each)
    padded = n_blocks * bs
    packed = np.empty((n, n_blocks, bs * bits // 8), np.uint8)
    rows = max(1, weightonly.CHUNK_ELEMENTS // padded)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        part = q_all[r0:r1] if w.stored_nk else q_all[:, r0:r1].T
        q = np.empty((r1 - r0, padded), np.uint8)
        q[:, :k] = _unsigned(part, bits, w.signed)
        if padded > k:  # the padding dequantizes to 0: the last block's zero point
            q[:, k:] = zp[r0:r1, -1:]
        packed[r0:r1] = pack_along_last(q.reshape(r1 - r0, n_blocks, bs), bits)
    default = 1 << (bits - 1)
    zero_points = None if bool((zp == default).all()) else zp  # absent means 2**(bits-1): exact, smaller
    group = Group(weight=w.weight, bits=bits, block_size=bs, symmetric=zero_points is None)
    # the Transpose / Reshape between is dropped by the caller with the DQ node
    group.uses = [Use(m, "matmul_t" if w.stored_nk else "matmul") for m in w.matmuls]
    blocks = QuantizedBlocks(np.empty((n, n_blocks, 0), np.uint8), scales, zero_points)
    return Result(group, blocks, packed, k, w.scale_dtype, 0.0)


def _check_names(model: OnnxModel, w: _Weight) -> str | None:
    """Why the Writer's tensor names for ``w`` would collide with names in the graph, or None."""
    g = model.graph
    taken = {t.name for t in g.initializer} | {i.name for i in g.input} | {o for x in g.node for o in x.output}
    for name in (f"{w.weight}_Q{w.bits}", f"{w.weight}_scales", f"{w.weight}_zero_points"):
        if name in taken:
            return f"the name {name!r} the MatMulNBits tensors would get is already used in the graph"
    return None


def convert_qdq_to_nbits(
    model: onnx.ModelProto | OnnxModel, *, base_dir: Path | None = None, accuracy_level: int = 0,
    nodes: Collection[str] | None = None,
) -> QdqConversion:
    """Rewrite every ``DequantizeLinear -> MatMul`` weight of ``model`` into ``MatMulNBits``, in place.

    ``model``: a ``ModelProto`` (weights in external data are read from ``base_dir``, the model's
    folder; new tensors are stored inline) or the host's :class:`OnnxModel` (read through its
    resolver; large new tensors spill to its work folder). ``accuracy_level``: the ``MatMulNBits``
    attribute (0 leaves it unset). ``nodes``: only these MatMul nodes (see :func:`node_key`);
    ``None``: all. A shared weight is converted only when all its MatMuls are selected.
    """
    if accuracy_level not in range(5):
        raise UsageError(f"accuracy_level must be 0 to 4, got {accuracy_level!r}")
    if isinstance(model, OnnxModel):
        handle = model
    else:
        folder = Path(base_dir) if base_dir is not None else None
        handle = OnnxModel(model, (folder or Path.cwd()) / "model.onnx", folder)
    result = QdqConversion()
    found, result.skipped = _Finder(handle.graph).find()
    if nodes is not None:
        wanted = set(nodes)
        seen = {node_key(m) for w in found for m in w.matmuls} | set(result.skipped)
        for name in sorted(wanted - seen):
            result.skipped[name] = "no MatMul of that name reads a DequantizeLinear weight"
        kept = []
        for w in found:
            out = [node_key(m) for m in w.matmuls if node_key(m) not in wanted]
            if not out:
                kept.append(w)
            elif len(out) < len(w.matmuls):
                why = (f"shares its weight {w.weight} with {', '.join(out)}, not selected: all stay QDQ so the "
                       "weight stays one tensor")
                result.skipped.update({node_key(m): why for m in w.matmuls if node_key(m) in wanted})
            # MatMuls not selected are not reported: the caller left them out
        found = kept
    if not found:
        return result
    if not isinstance(model, OnnxModel) and base_dir is None:
        inits = handle.initializers()
        for w in found:
            for name in (w.weight, w.scale, w.zero_point):
                if name and is_external(inits[name]):
                    raise UsageError(f"tensor {name!r} is stored as external data: pass base_dir, the model's folder")
    before = {t.name: tensor_nbytes(t) for t in handle.graph.initializer}
    writer = Writer(handle, accuracy_level)
    written: dict[tuple[str, ...], Result] = {}
    converted: set[str] = set()
    for w in found:
        key = (w.weight, w.scale, w.zero_point, str(w.dq_block), str(w.stored_nk))
        res = written.get(key)
        if res is not None:  # a second DQ of the same tensors: its MatMuls share the first's
            res.group.uses.extend(Use(m, "matmul_t" if w.stored_nk else "matmul", None) for m in w.matmuls)
        else:
            why = _check_names(handle, w) if key[0] not in {k[0] for k in written} else (
                f"its integer weight {w.weight} is also dequantized with other scales by another node")
            if why:
                result.skipped.update({node_key(m): why for m in w.matmuls})
                continue
            written[key] = _convert_weight(handle, w)
        writer.drop.add(id(w.dq))
        writer.drop.update(id(b) for b in w.between)
        converted.update(node_key(m) for m in w.matmuls)
    order = [node_key(n) for n in handle.graph.node if n.op_type == "MatMul" and node_key(n) in converted]
    for res in written.values():
        writer.write(res)
    dropped_outputs = {o for node in handle.graph.node if id(node) in writer.drop for o in node.output}
    writer.finish()
    ensure_opsets(handle.proto)
    keep_info = [v for v in handle.graph.value_info if v.name not in dropped_outputs]
    if len(keep_info) != len(handle.graph.value_info):
        del handle.graph.value_info[:]
        handle.graph.value_info.extend(keep_info)
    after = {t.name for t in handle.graph.initializer}
    result.removed_bytes = sum(size for name, size in before.items() if name not in after)
    result.stored_bytes = writer.stored_bytes
    result.weights = len(written)
    result.converted = order
    for name in result.converted:
        result.skipped.pop(name, None)
    for name, why in result.skipped.items():
        log.info("not converted: %s: %s", name, why)
    return result


# -- the host pass ------------------------------------------------------------------------------------
@dataclass
class QdqToNbitsOptions(TargetOptions):
    """Options of the ``qdq_to_nbits`` pass."""

    nodes_to_exclude: list[str] = option(
        [], "MatMul nodes left as DequantizeLinear -> MatMul (names, globs or re:REGEX)"
    )

    def validate(self) -> None:
        NameMatcher(self.nodes_to_exclude, what="nodes_to_exclude")


class QdqToNbitsPass(Pass):
    """Rewrites a QDQ weight-only model (ModelOpt, Quark, ORT's QDQ int4) into MatMulNBits, exactly."""

    name = "qdq_to_nbits"
    algorithms = ("qdq_to_nbits",)
    precisions = ()
    model_kinds = ("onnx",)
    needs_data = False
    summary = "DequantizeLinear(int4/int8 weight) -> MatMul into com.microsoft MatMulNBits, same integers"
    Options: ClassVar[type] = QdqToNbitsOptions

    def run(self, model: Any, context: PassContext) -> Any:
        if not isinstance(model, OnnxModel):
            raise QuantizationError(f"{self.name} rewrites ONNX models, got {model.kind}")
        exclude = NameMatcher(self.options.nodes_to_exclude, what="nodes_to_exclude")
        matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
        for pattern in exclude.unmatched(node_key(n) for n in matmuls):
            log.warning("%s: nodes_to_exclude pattern %r matches no MatMul", model.source.name, pattern)
        nodes = [node_key(n) for n in matmuls if not exclude.matches(node_key(n))] if exclude else None
        result = convert_qdq_to_nbits(model, accuracy_level=self.options.resolved_accuracy_level(), nodes=nodes)
        if not result.converted:
            reasons = defaultdict(list)
            for name, why in result.skipped.items():
                reasons[why].append(name)
            detail = "; ".join(f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: {why}"
                               for why, names in list(reasons.items())[:3])
            if not detail:
                excluded = bool(exclude) and bool(_Finder(model.graph).find()[0])
                detail = ("every DequantizeLinear -> MatMul is excluded by nodes_to_exclude" if excluded
                          else "no DequantizeLinear feeds a MatMul weight")
            raise UsageError(
                f"{self.name}: {model.source.name} has no DequantizeLinear -> MatMul weight to convert ({detail}); "
                "it takes QDQ weight-only models (int4/uint4/int8/uint8 weights, e.g. NVIDIA ModelOpt's); "
                "to quantize a float model use a quantization algorithm such as rtn"
            )
        context.extras.setdefault("reports", []).append((self.name, model.source, result))
        log.info("%s: %s", self.name, result.summary())
        return model
