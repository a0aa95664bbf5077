"""Export a (quantized) Hugging Face model to ONNX with ONNX Runtime's block-quantized ops.

The float graph comes from PyTorch's TorchScript exporter (offline, CPU), traced with every
quantized parameter swapped for its dequantized float weight and without constant folding, so
each weight stays an initializer named after its parameter. Then the graph is rewritten with the
checkpoint's own integers: the host's weight-only planner (:func:`bitpress.onnx.weightonly.plan`)
finds how each of those initializers is read (``Transpose`` -> ``MatMul``, ``Gemm(transB=1)``,
``Gather``), and its writer (:class:`bitpress.onnx.weightonly.Writer`) replaces the nodes with
``MatMulNBits`` / ``GatherBlockQuantized`` fed by the exact integers, scales and zero points of
the :class:`~bitpress.hf.qtensor.QuantTensor` (nothing is re-quantized). A tied embedding / LM
head is one quantized table in the checkpoint and one ``B`` tensor in the graph, which the
``GatherBlockQuantized`` reads through a ``Reshape`` (the same bytes).

``split_embedding=True`` writes two components instead of ``model.onnx``: ``embedding.onnx``
(``input_ids`` -> ``inputs_embeds``) and ``decoder.onnx`` (``inputs_embeds``, ``attention_mask``
-> ``logits``). A table tied between them is written once, to ``shared.onnx.data``, and both
components point at the same bytes.

The graphs take ``input_ids`` / ``attention_mask`` (int64, dynamic batch and sequence) and give
``logits`` (or ``last_hidden_state``) for the whole sequence: no KV cache. Not exported: 2-bit
weights (no ONNX Runtime kernel), mixture-of-experts models (the routing is data dependent, a
trace would freeze it; fused 3-D expert tensors have no ONNX writer here: a GenAI package's QMoE
nodes hold them, :mod:`bitpress.genai.moe`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import onnx
from onnx import numpy_helper

from bitpress.errors import OutputError, QuantizationError, ValidationError, summarize_names, summarize_problems
from bitpress.hf.model import HfModel
from bitpress.models.base import ModelHandle
from bitpress.models.onnx_model import OnnxModel

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

#: prefix of the traced wrapper's attribute; stripped so initializers carry the parameters' names
_PREFIX = "hf."
EXPORT_BITS = (4, 8)
INLINE_THRESHOLD = 1024
SHARED_DATA = "shared.onnx.data"


class HfOnnxExport(ModelHandle):
    """One or more ONNX graphs exported from a Hugging Face model, plus the folder's tokenizer files."""

    kind: ClassVar[str] = "onnx-export"

    def __init__(self, source: Path, models: dict[str, OnnxModel], shared: set[str], companions: list[Path]) -> None:
        super().__init__(source)
        self.models = models  # file name -> graph
        self.shared = shared  # initializer names stored once for every component
        self.companions = companions

    def save(self, dest: Path, *, external_data: bool | None = None, max_shard_size: int | None = None,
             check: bool = True) -> list[Path]:
        """Write the folder ``dest``: the graph(s), their data and the companion files."""
        from bitpress.onnx.save import SaveOptions, save_onnx

        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        if len(self.models) == 1:
            (name, model), = self.models.items()
            files = save_onnx(model, dest / name, SaveOptions(external_data, max_shard_size, check))
        else:
            files = _save_components(self.models, self.shared, dest, check)
        from bitpress.hf.checkpoint import copy_companion

        for f in self.companions:  # checked to stay inside the source folder right before each is read
            copy_companion(self.source, f, dest / f.name)
            files.append(dest / f.name)
        return files

    def close(self) -> None:
        for m in self.models.values():
            m.close()


# -- checks ---------------------------------------------------------------------------------------------
def check_exportable(model: nn.Module) -> None:
    """Raise before any tracing when the graph cannot carry the model's quantized weights."""
    from bitpress.hf.checkpoint import parameter_groups
    from bitpress.hf.qtensor import QuantTensor
    from bitpress.hf.quantize import config_is_moe, find_experts

    fused: list[str] = []
    by_bits: dict[int, list[str]] = {}
    for names, value in parameter_groups(model):
        if not isinstance(value, QuantTensor):
            continue
        if len(value.spec.shape) != 2:
            fused.append(names[0])
        elif value.spec.bits not in EXPORT_BITS:
            by_bits.setdefault(value.spec.bits, []).append(names[0])
    # one sentence per kind of problem, with a count and a few names (not one sentence per tensor)
    problems = []
    if fused:
        what = f"{len(fused)} tensors are" if len(fused) > 1 else "1 tensor is"
        problems.append(
            f"{what} fused MoE experts, quantized in 3-D ({summarize_names(fused)}): bitpress stores them but does "
            "not export them to a traced ONNX graph; export them to a GenAI package (hf_to_genai, the builder's "
            "QMoE: docs/moe.md lists the architectures) instead"
        )
    for bits, names in sorted(by_bits.items()):
        what = f"{len(names)} tensors are" if len(names) > 1 else "1 tensor is"
        problems.append(
            f"{what} {bits}-bit ({summarize_names(names)}): ONNX export needs "
            f"{' or '.join(map(str, EXPORT_BITS))} bits (ONNX Runtime's MatMulNBits / GatherBlockQuantized are "
            f"written for those), so {bits}-bit checkpoints stay PyTorch-only; quantize with bits=4 or 8 to export"
        )
    if problems:
        raise QuantizationError("; ".join(problems))
    config = getattr(model, "config", None)
    if (config is not None and config_is_moe(config)) or find_experts(model).roots:
        raise QuantizationError(
            "mixture-of-experts models are not exported to a traced ONNX graph: the expert routing is data dependent "
            "and a trace would freeze the experts chosen for the sample input; export a GenAI package instead "
            "(hf_to_genai: the builder writes QMoE nodes, docs/moe.md)"
        )


# -- tracing --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def float_view(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with every quantized parameter replaced by its float32 dequantization (ties kept),
    and every other parameter in float32; restored afterwards."""
    import torch
    from torch import nn

    from bitpress.hf.qtensor import QuantTensor

    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    floats: dict[int, nn.Parameter] = {}
    dtypes: list[tuple[nn.Parameter, torch.dtype]] = []
    try:
        for mod in model.modules():
            for attr, p in list(mod._parameters.items()):
                if isinstance(p, QuantTensor):
                    if id(p) not in floats:
                        floats[id(p)] = nn.Parameter(p.dequantize().to(torch.float32), requires_grad=False)
                    mod._parameters[attr] = floats[id(p)]
                    swapped.append((mod, attr, p))
        seen: set[int] = set()
        for p in model.parameters():
            if id(p) not in seen and p.dtype.is_floating_point and p.dtype != torch.float32:
                seen.add(id(p))
                dtypes.append((p, p.dtype))
                p.data = p.data.to(torch.float32)
        for b in model.buffers():
            if b.dtype.is_floating_point and b.dtype != torch.float32:
                raise QuantizationError(f"float buffer of dtype {b.dtype}: export a float32 checkpoint instead")
        yield model
    finally:
        for p, dt in dtypes:
            p.data = p.data.to(dt)
        for mod, attr, p in swapped:
            mod._parameters[attr] = p


def _trace(model: nn.Module, path: Path, part: str, opset: int, seq_len: int) -> tuple[list[str], list[str]]:
    """TorchScript-export one part of ``model``: ``full``, ``embedding`` or ``decoder``."""
    import torch
    from torch import nn

    hidden_name = "logits"

    class Full(nn.Module):
        def __init__(self, hf: nn.Module) -> None:
            super().__init__()
            self.hf = hf

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            out = self.hf(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state

    class Embedding(nn.Module):
        def __init__(self, hf: nn.Module) -> None:
            super().__init__()
            self.hf = hf

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.hf.get_input_embeddings()(input_ids)

    class Decoder(nn.Module):
        def __init__(self, hf: nn.Module) -> None:
            super().__init__()
            self.hf = hf

        def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            out = self.hf(inputs_embeds=inputs_embeds, attention_mask=attention_mask, use_cache=False)
            return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state

    config = model.config
    vocab = int((config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq_len), generator=gen)
    mask = torch.ones_like(ids)
    if part == "full":
        test_out = model(input_ids=ids[:, :2], attention_mask=mask[:, :2], use_cache=False)
        if getattr(test_out, "logits", None) is None:
            hidden_name = "last_hidden_state"
        wrapper: nn.Module = Full(model)
        args: tuple = (ids, mask)
        inputs, outputs = ["input_ids", "attention_mask"], [hidden_name]
    elif part == "embedding":
        wrapper, args = Embedding(model), (ids,)
        inputs, outputs = ["input_ids"], ["inputs_embeds"]
    else:
        with torch.no_grad():
            embeds = model.get_input_embeddings()(ids)
        wrapper, args = Decoder(model), (embeds, mask)
        inputs, outputs = ["inputs_embeds", "attention_mask"], ["logits"]
    axes = {n: {0: "batch_size", 1: "sequence_length"} for n in inputs + outputs}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracer warnings are expected
        torch.onnx.export(
            wrapper, args, str(path), dynamo=False, input_names=inputs, output_names=outputs,
            dynamic_axes=axes, opset_version=opset, do_constant_folding=False,
        )
    return inputs, outputs


def _strip_prefix(model: OnnxModel) -> None:
    renames = {t.name: t.name[len(_PREFIX):] for t in model.graph.initializer if t.name.startswith(_PREFIX)}
    for t in model.graph.initializer:
        t.name = renames.get(t.name, t.name)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]


# -- rewriting ------------------------------------------------------------------------------------------
def rewrite(onnx_model: OnnxModel, qparams: dict[str, Any], accuracy_level: int = 4) -> list[str]:
    """Replace the readers of each quantized initializer with MatMulNBits / GatherBlockQuantized.

    ``qparams`` maps parameter names (any alias of a tied one) to their QuantTensor. Returns the
    initializer names rewritten.
    """
    from bitpress.onnx.weightonly import Result, WeightOnlyOptions, Writer, plan

    inits = onnx_model.initializers()
    present: dict[str, Any] = {}
    for name, qt in qparams.items():
        if name in inits:
            present.setdefault(name, qt)
    if not present:
        return []
    overrides = {n: {"bits": qt.spec.bits, "block_size": qt.spec.group_size, "is_symmetric": qt.spec.symmetric}
                 for n, qt in present.items()}
    opts = WeightOnlyOptions(nodes_to_include=list(present), overrides=overrides, gather_min_rows=1)
    p = plan(onnx_model, opts)
    groups = {g.weight: g for g in p.groups}
    problems: list[tuple[str, str]] = []
    writer = Writer(onnx_model, accuracy_level=accuracy_level)
    for name, qt in present.items():
        group = groups.get(name)
        spec = qt.spec
        if group is None:
            why = p.skipped.get(name) or "it is not read as the weight of a MatMul, Gemm or Gather node"
            problems.append((name, why))
            continue
        if not group.uses[0].rows_are_table_rows:
            problems.append((name, "the graph multiplies by the weight untransposed; not a Linear/Embedding use"))
            continue
        if (group.bits, group.block_size, group.symmetric) != (spec.bits, spec.group_size, spec.symmetric):
            problems.append((name, f"the graph needs block size {group.block_size}, the checkpoint has "
                                   f"{spec.group_size} ({p.notes.get(name, '')})"))
            continue
        writer.write(_result(Result, group, qt))
    if problems:
        raise QuantizationError("cannot write the checkpoint's quantized weights into the ONNX graph: "
                                + summarize_problems(problems))
    writer.finish()
    left = set(present) & set(onnx_model.initializers())
    if left:
        raise QuantizationError(f"float copies of quantized weights remain in the graph: {', '.join(sorted(left))}")
    return sorted(present)


def _result(result_cls: type, group: Any, qt: Any) -> Any:
    """The writer's input for one group: the checkpoint's integers, already packed as ``B``."""
    from bitpress.quant.solver import QuantizedBlocks

    spec = qt.spec
    zp = None if qt.qzeros is None else qt.qzeros.numpy()
    # the writer reads the integers from ``packed`` (qweight's layout is MatMulNBits' B), not ``blocks.q``
    blocks = QuantizedBlocks(np.empty((spec.rows, spec.n_blocks, 0), np.uint8), qt.scales.numpy(), zp)
    return result_cls(group=group, blocks=blocks, packed=qt.qweight.numpy(), k=spec.k, dtype=np.dtype(np.float32),
                      error=0.0)


def export(handle: HfModel, workdir: Path, *, split_embedding: bool = False, opset: int = 17,
           seq_len: int = 8, accuracy_level: int = 4) -> HfOnnxExport:
    """Trace and rewrite ``handle``'s model; graphs stay under ``workdir`` until saved.

    ``accuracy_level``: of the ``MatMulNBits`` written (4, int8 compute, runs fastest on CPU)."""
    from bitpress.hf.checkpoint import companion_files, parameter_groups
    from bitpress.hf.online import mark_traced
    from bitpress.hf.qtensor import QuantTensor

    model = handle.torch_model()
    check_exportable(model)
    qparams: dict[str, Any] = {}
    for names, value in parameter_groups(model):
        if isinstance(value, QuantTensor):
            for n in names:
                qparams[n] = value
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    parts = ["embedding", "decoder"] if split_embedding else ["full"]
    models: dict[str, OnnxModel] = {}
    with float_view(model):
        for part in parts:
            path = workdir / f"{part}-traced.onnx"
            _trace(model, path, part, opset, seq_len)
            m = OnnxModel.load(path)
            m.use_workdir(workdir)
            _strip_prefix(m)
            written = rewrite(m, qparams, accuracy_level)
            mark_traced(m.graph)
            log.info("%s: %d quantized weights written as MatMulNBits / GatherBlockQuantized", part, len(written))
            models["model.onnx" if part == "full" else f"{part}.onnx"] = m
    shared: set[str] = set()
    if split_embedding:
        a, b = (set(m.initializers()) for m in models.values())
        shared = {n for n in a & b if any(n.startswith(q + "_") for q in qparams)}
    return HfOnnxExport(handle.source, models, shared, companion_files(handle.source))


def _tensor_bytes(model: OnnxModel, t: onnx.TensorProto) -> bytes:
    return np.ascontiguousarray(model.array(t)).tobytes()


def _external(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    for f in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        t.ClearField(f)
    del t.external_data[:]
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = key, value


def _save_components(models: dict[str, OnnxModel], shared: set[str], dest: Path, check: bool) -> list[Path]:
    """Each component with its own ``<name>.data``; ``shared`` tensors once in ``shared.onnx.data``."""
    files: list[Path] = []
    placed: dict[str, tuple[int, bytes]] = {}
    shared_path = dest / SHARED_DATA
    with open(shared_path, "wb") as sf:
        for fname, m in models.items():
            data_path = dest / f"{fname}.data"
            with open(data_path, "wb") as df:
                for t in m.graph.initializer:
                    raw = _tensor_bytes(m, t)
                    if t.name in shared:
                        if t.name not in placed:
                            sf.write(b"\0" * ((-sf.tell()) % 64))
                            placed[t.name] = (sf.tell(), raw)
                            sf.write(raw)
                        offset, first = placed[t.name]
                        if first != raw:
                            raise ValidationError(f"{t.name} differs between components; it cannot be shared")
                        _external(t, SHARED_DATA, offset, len(raw))
                    elif len(raw) >= INLINE_THRESHOLD:
                        df.write(b"\0" * ((-df.tell()) % 64))
                        offset = df.tell()
                        df.write(raw)
                        _external(t, data_path.name, offset, len(raw))
                    else:
                        t.CopyFrom(numpy_helper.from_array(np.asarray(m.array(t)), t.name))
            onnx.save_model(m.proto, str(dest / fname))
            files += [dest / fname, data_path]
    files.append(shared_path)
    if check:
        from bitpress.onnx.save import open_session

        for fname in models:
            try:
                open_session(dest / fname)
            except Exception as exc:
                raise ValidationError(f"ONNX Runtime cannot load the exported {fname}: {exc}") from None
    return files


# -- the host function ------------------------------------------------------------------------------
def hf_to_onnx(model: str | Path | HfModel, output: str | Path, *, split_embedding: bool = False, opset: int = 17,
               overwrite: bool = False, check: bool = True, accuracy_level: int = 4,
               **load_options: Any) -> list[Path]:
    """Export a Hugging Face folder (or loaded :class:`HfModel`) to the ONNX folder ``output``.

    Quantized linears become ``MatMulNBits``, quantized embeddings ``GatherBlockQuantized``, with
    the checkpoint's exact integers. ``accuracy_level``: of the ``MatMulNBits`` (4: int8 compute,
    ONNX Runtime's fast CPU kernels; 0: float32 compute). ``load_options``: ``trust_remote_code``,
    ``allow_pickle``. Written atomically: a failure leaves no ``output`` behind.
    """
    handle = model if isinstance(model, HfModel) else HfModel.load(Path(model), load_options)
    if isinstance(model, HfModel) and load_options:
        handle.allow(**load_options)
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise OutputError(f"the output {out} already exists; remove it or pass overwrite=True")
    if out.resolve() == handle.source.resolve() or out.resolve().is_relative_to(handle.source.resolve()):
        raise OutputError(f"the output {out} is inside the input folder {handle.source}; choose another folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.bitpress-", dir=out.parent))
    try:
        exp = export(handle, tmp / "work", split_embedding=split_embedding, opset=opset, accuracy_level=accuracy_level)
        files = exp.save(tmp / "out", check=check)
        exp.close()
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp / "out", out)
        return [out / f.relative_to(tmp / "out") for f in files]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
