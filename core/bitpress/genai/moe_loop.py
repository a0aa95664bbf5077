"""mobius's per-expert loops fused into ``com.microsoft.QMoE`` nodes holding bitpress's experts.

mobius 0.1.0 builds a float mixture-of-experts model (Mixtral, Qwen3-MoE, gpt-oss; float32, ``cpu``,
measured) without any ``MoE`` node: each decoder layer runs every expert on every token as plain
ONNX ops (the pattern, and its fusion into a float ``MoE`` node: :mod:`bitpress.onnx.expert_loops`).
:func:`fuse_experts` fuses each loop of a package, checks every expert tensor against bitpress's
dequantized experts (the package was built from them, so they agree within float32 rounding;
otherwise an :class:`ExportError` names the tensor) and rewrites the node as ``QMoE`` holding
bitpress's integers, scales and zero points with the ONNX-side writer
(:func:`bitpress.onnx.weightonly.qmoe.write`); a routing that is the full softmax at the top ``k``
(Qwen3-MoE without ``norm_topk_prob``) goes to QMoE's ``router_weights`` with
``normalize_routing_weights`` 0. A loop that is not exactly MoE's stops the export, naming what differs.

May import: errors, genai.moe, models, onnx.
"""

from __future__ import annotations

import logging
import shutil
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bitpress.errors import ExportError
from bitpress.onnx import expert_loops
from bitpress.onnx.expert_loops import ExpertLoop

if TYPE_CHECKING:
    from bitpress.genai.moe import ExpertWeights, MoeLayer
    from bitpress.models.onnx_model import OnnxModel

log = logging.getLogger(__name__)

# QMoE input 14: router_weights (aggregation weights gathered at the experts selected on router_probs)
_ROUTER_WEIGHTS = 14


def find_loops(model: OnnxModel) -> list[ExpertLoop]:
    """Every loop over experts in ``model``'s main graph; one that is not exactly MoE's stops the export."""
    loops, other = expert_loops.find_loops(model)
    for name, why in other.items():
        raise ExportError(f"{name}: mobius's experts are not the loop bitpress fuses into QMoE ({why}); "
                          "nothing is written")
    return loops


def _check(w: ExpertWeights, built: np.ndarray, what: str) -> None:
    """bitpress's dequantized experts equal mobius's float ones (built from them) within float32 rounding."""
    ours = w.dequantize()
    if ours.shape != built.shape:
        raise ExportError(f"{w.name}: bitpress's experts are {list(ours.shape)} but mobius's {what} are "
                          f"{list(built.shape)}: the mapping is wrong")
    tol = 4 * np.finfo(np.float32).eps * max(float(np.abs(ours).max()), 1e-30)
    bad = np.abs(ours - built) > tol
    if bad.any():
        ex, row, col = (int(i[0]) for i in np.nonzero(bad))
        raise ExportError(
            f"{w.name} does not match mobius's {what} (expert {ex}, row {row}, column {col}: "
            f"{ours[ex, row, col]:.6g} vs {built[ex, row, col]:.6g}, {int(bad.sum())} values off): the mapping of "
            "bitpress's experts onto QMoE is wrong for this model, so nothing is written"
        )


def _solved(w: ExpertWeights) -> object:
    from bitpress.onnx.layout import pack_along_last
    from bitpress.onnx.weightonly.solving import Solved

    e, n, k = w.q.shape
    nb = k // w.group_size
    packed = pack_along_last(w.q.reshape(e * n, nb, w.group_size), w.bits)
    zp = None if w.zero_points is None else w.zero_points.reshape(e * n, nb).astype(np.uint8)
    return Solved(packed, w.scales.reshape(e * n, nb).astype(np.float32), zp, k, np.dtype(np.float32), 0.0)


def fuse_experts(folder: Path, layers: list[MoeLayer], accuracy_level: int, workdir: Path) -> int:
    """Replace each loop over experts in the package ``folder`` by a QMoE node holding ``layers``'
    integers (see the module's docstring); returns the nodes written."""
    from bitpress.models.onnx_model import OnnxModel
    from bitpress.onnx.save import SaveOptions, save_onnx
    from bitpress.onnx.weightonly import qmoe
    from bitpress.onnx.weightonly.moe import describe
    from bitpress.onnx.weightonly.writing import Writer

    by_layer = {x.layer: x for x in layers}
    written: set[int] = set()
    for path in sorted(p for p in Path(folder).rglob("*.onnx") if p.is_file()):
        model = OnnxModel.load(path)
        scratch = Path(workdir) / "moe-scratch"
        model.use_workdir(scratch)
        try:
            loops = find_loops(model)
            if not loops:
                continue
            for loop in loops:
                layer = by_layer.get(loop.layer) if loop.layer is not None else None
                if layer is None:
                    raise ExportError(f"{path.name}: the experts of {loop.name} have no quantized bitpress experts "
                                      f"to hold (bitpress's are in layers {sorted(by_layer)})")
            nodes = list(zip(expert_loops.fuse(model, loops), loops, strict=True))
            inits = model.initializers()
            readers: dict[str, int] = defaultdict(int)
            for n in model.graph.node:
                for i in set(n.input):
                    readers[i] += 1
            writer = Writer(model, accuracy_level)
            moe_nodes = {n.name: n for n in model.graph.node if n.op_type == "MoE"}
            for old, loop in nodes:
                node = moe_nodes[old.name]
                layer = by_layer[loop.layer]  # type: ignore[index]
                group, why = describe(node, inits, readers)
                if group is None:
                    raise ExportError(f"{path.name}: {node.name} cannot become QMoE: {why}")
                fc1, fc2 = layer.fc1, layer.fc2
                if (group.experts, group.hidden, group.inter) != (fc1.q.shape[0], fc2.q.shape[1], fc2.q.shape[2]):
                    raise ExportError(f"{fc1.name}: bitpress's experts are {list(fc1.q.shape)} / {list(fc2.q.shape)} "
                                      f"but {node.name} holds {group.experts} experts of {group.hidden} x "
                                      f"{group.inter}: the mapping is wrong")
                _check(fc1, np.asarray(model.array(group.weights["fc1"]), np.float32), f"{node.name} fc1 (gate/up)")
                _check(fc2, np.asarray(model.array(group.weights["fc2"]), np.float32), f"{node.name} fc2 (down)")
                group.bits, group.block_size, group.symmetric = fc1.bits, fc1.group_size, fc1.zero_points is None
                qmoe.write(writer, group, {"fc1": _solved(fc1), "fc2": _solved(fc2)}, accuracy_level)  # type: ignore[dict-item]
                if loop.router_weights:  # unnormalized top-k of the full softmax: aggregate with it (input 14)
                    q = writer.replace[id(node)][0]
                    while len(q.input) <= _ROUTER_WEIGHTS:
                        q.input.append("")
                    q.input[_ROUTER_WEIGHTS] = loop.router_weights
                written.add(loop.layer)  # type: ignore[arg-type]
                log.info("%s: mobius's loop over %d experts -> QMoE with bitpress's %d-bit experts (block %d%s)",
                         loop.name, group.experts, group.bits, group.block_size,
                         ", zero points" if not group.symmetric else "")
            writer.finish()
            expert_loops.drop_dead(model)
            model.remove_unused_initializers()
            tmp = Path(workdir) / "moe-fused"
            shutil.rmtree(tmp, ignore_errors=True)
            files = save_onnx(model, tmp / path.name, SaveOptions(external_data=True, check=False))
        finally:
            model.close()
        for f in path.parent.iterdir():  # the old graph's data files go with it
            if f.is_file() and f.name.startswith(path.name + ".data"):
                f.unlink()
        path.unlink()
        for f in files:
            shutil.move(str(f), str(path.parent / f.name))
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    missing = sorted(set(by_layer) - written)
    if missing:
        raise ExportError(f"the package has no loop over experts for the experts of layer(s) {missing}")
    return len(written)
