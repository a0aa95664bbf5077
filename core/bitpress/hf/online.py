"""Online products: a fixed float matrix applied to a module's input at run time, kept with the checkpoint.

A rotated model whose embedding and LM head share one table (QuaRot on SmolLM2, Qwen2.5-0.5B, Gemma)
needs one small float product between the final norm and the head (``Q^T diag(g) Q``, hidden x
hidden): the shared table can hold the rotation the embedding needs, not the head's norm scale as
well. Untying the table instead would add vocabulary x hidden parameters.

The product lives on the module as the buffer :data:`BUFFER` (so it is saved with the model's other
tensors, under ``<module>.bitpress_online_input``) and runs as a forward pre-hook (so PyTorch,
calibration and the traced ONNX export compute it). ``quantization_config.online`` lists the
modules that carry one: a standard transformers load does not know the buffer, which is why such a
checkpoint is marked with bitpress's ``quantization_config`` (transformers warns that it does not know
the method) and :func:`restore` re-attaches it when bitpress loads the folder.

GenAI packages built by an exporter from the checkpoint (which drops the buffer) get the product
inserted before their LM head by :func:`insert_before_head`, as a float ``MatMul`` marked
``bitpress.keep_float`` so that no quantizer touches it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bitpress.errors import ExportError, ModelLoadError

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

BUFFER = "bitpress_online_input"
#: the ops a graph may have between the LM head's MatMul and its ``logits`` output (casts, Gemma's soft cap)
_HEAD_TAIL = ("Cast", "Div", "Tanh", "Mul", "Add", "Identity")


def _pre_hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    x = args[0]
    matrix = getattr(module, BUFFER)
    if matrix.dtype != x.dtype:  # (only then: a traced graph reads the initializer directly)
        matrix = matrix.to(x.dtype)
    return (x @ matrix, *args[1:])


def attach(model: nn.Module, module_name: str, matrix: torch.Tensor) -> None:
    """Apply ``x @ matrix`` to the input of ``model``'s submodule ``module_name`` from now on (and save it)."""
    module = model.get_submodule(module_name)
    if hasattr(module, BUFFER):
        raise ValueError(f"{module_name} has an online product already")
    module.register_buffer(BUFFER, matrix.detach().contiguous(), persistent=True)
    module._bitpress_online_hook = module.register_forward_pre_hook(_pre_hook)


def detach(model: nn.Module, module_name: str) -> None:
    """Remove the online product of ``model``'s submodule ``module_name`` (its buffer and its hook)."""
    module = model.get_submodule(module_name)
    module._bitpress_online_hook.remove()
    del module._bitpress_online_hook
    del module._buffers[BUFFER]


def products(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{module name: matrix}`` for every module of ``model`` that carries an online product."""
    return {name: getattr(mod, BUFFER) for name, mod in model.named_modules() if BUFFER in mod._buffers}


def is_online(tensor_name: str) -> bool:
    """Whether a state-dict / checkpoint tensor name is an online product (never a weight to quantize)."""
    return tensor_name.rsplit(".", 1)[-1] == BUFFER


def restore(model: nn.Module, files: list[Path], names: Any, where: str) -> None:
    """Re-attach the products ``quantization_config.online`` lists (``names``), read from ``files``."""
    from safetensors import safe_open

    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ModelLoadError(f"{where}.online must be a list of module names")
    wanted = {f"{n}.{BUFFER}": n for n in names}
    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key in wanted:
                    found[wanted[key]] = sf.get_tensor(key)
    for name in names:
        if name not in found:
            raise ModelLoadError(f"{where}.online names {name}, whose product {name}.{BUFFER} is not in the checkpoint")
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ModelLoadError(f"{where}.online names {name}, which the model does not have") from None
        matrix = found[name]
        width = getattr(module, "in_features", None)
        if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or (width is not None and matrix.shape[0] != width):
            raise ModelLoadError(f"{where}.online: the product of {name} has shape {tuple(matrix.shape)}, not "
                                 f"{width} x {width}")
        attach(model, name, matrix)


def head_module(model: nn.Module) -> str | None:
    """The name of ``model``'s output embedding (the LM head), or None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None
    return next((n for n, m in model.named_modules() if m is head), None)


def check_exportable(model: nn.Module) -> dict[str, np.ndarray]:
    """The products an exported graph must carry (``{module: float32 matrix}``): only the LM head's is
    supported; any other is refused before a build."""
    import torch

    found = products(model)
    head = head_module(model)
    other = sorted(n for n in found if n != head)
    if other:
        raise ExportError(f"online products on {', '.join(other)} cannot be exported (only one before the LM head "
                          "can); rotate the exported ONNX graph with quarot instead")
    return {n: m.detach().to(torch.float32).cpu().numpy() for n, m in found.items()}


def mark_traced(graph: Any) -> int:
    """Mark the ``MatMul`` nodes of a traced graph that read an online product ``bitpress.keep_float``."""
    from bitpress.onnx.graph import KEEP_FLOAT

    marked = 0
    for node in graph.node:
        if node.op_type == "MatMul" and any(is_online(i) for i in node.input):
            entry = node.metadata_props.add()
            entry.key, entry.value = KEEP_FLOAT, "a rotation's online product (hidden x hidden)"
            marked += 1
    return marked


def insert_before_head(folder: Path, matrix: np.ndarray, *, name: str = "lm_head") -> int:
    """Insert ``x @ matrix`` before the LM head of every ONNX graph in ``folder`` that outputs ``logits``.

    The head is the ``MatMul`` / ``MatMulNBits`` / ``Gemm`` that ``logits`` comes from (through casts and
    a soft cap); the product is kept float (``bitpress.keep_float``) in the dtype of the head's float
    inputs. Returns the number of graphs changed; ExportError when a decoder has no such head.
    """
    import onnx
    from onnx import helper, numpy_helper

    from bitpress.onnx.graph import KEEP_FLOAT

    changed = 0
    for path in sorted(Path(folder).rglob("*.onnx")):
        model = onnx.load(str(path), load_external_data=False)
        graph = model.graph
        if "logits" not in {o.name for o in graph.output}:
            continue
        producer = {o: n for n in graph.node for o in n.output}
        node = producer.get("logits")
        while node is not None and node.op_type in _HEAD_TAIL:
            node = next((producer[i] for i in node.input if i in producer), None)
        if node is None or node.op_type not in ("MatMul", "MatMulNBits", "Gemm"):
            raise ExportError(f"{path.name}: cannot find the LM head that computes logits, so the rotation's online "
                              "product cannot be inserted")
        inits = {t.name: t for t in graph.initializer}
        dtype = next((inits[i].data_type for i in node.input[1:] if i in inits
                      and inits[i].data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)),
                     onnx.TensorProto.FLOAT)
        weight = f"{name}.{BUFFER}"
        out = f"{node.input[0]}/{BUFFER}"
        graph.initializer.append(numpy_helper.from_array(
            matrix.astype(helper.tensor_dtype_to_np_dtype(dtype)), weight))
        product = helper.make_node("MatMul", [node.input[0], weight], [out], name=f"/{name}/online_product")
        entry = product.metadata_props.add()
        entry.key, entry.value = KEEP_FLOAT, "a rotation's online product before a tied LM head (hidden x hidden)"
        node.input[0] = out
        index = next(i for i, n in enumerate(graph.node) if n is node)
        graph.node.insert(index, product)
        onnx.save(model, str(path))
        changed += 1
    return changed
