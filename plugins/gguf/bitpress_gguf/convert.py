"""A GGUF model to an ONNX Runtime GenAI package holding the GGUF's own blocks.

1. The graph comes from an existing exporter: ``mobius build-gguf`` in float (its weights are
   the GGUF's dequantization, q / k rows back in Hugging Face's rotary order), built for the
   package's EP (``cpu``: ``GroupQueryAttention``).
2. Every quantized GGUF tensor replaces its float weight: the planner of bitpress's weight-only
   pass finds the readers (``MatMul``, the tied ``Gather`` + ``Transpose`` + ``MatMul``), and its
   writer stores ``MatMulNBits`` / ``GatherBlockQuantized`` holding the blocks decoded by
   :mod:`bitpress_gguf.codec` (the tied table once). Before a weight is replaced, its decoded
   values are compared with the exporter's float weight (bit for bit for integer zero points,
   within float32 rounding for float ones), which also finds the row order of q / k. A float
   minimum (Q4_1, Q2_K, Q4_K, Q5_1, Q5_K) is written as uint8 zero points plus the block-sum
   correction of :mod:`bitpress.onnx.correction` (:func:`add_corrections`): ONNX Runtime's packed
   kernels, llama.cpp's values (:func:`bitpress_gguf.codec.integer_form`). ``accuracy_level``:
   the target's default (4, int8 compute, on cpu) unless given.
3. ``genai_config.json`` comes from mobius (``build --config --no-weights`` on the GGUF's
   configuration as transformers reads it), the tokenizer and chat template from the GGUF
   through transformers; the package is then checked (ONNX checker, ONNX Runtime, one
   ``onnxruntime_genai`` generation step) and, on cpu, its logits compared with transformers'
   forward of the GGUF's dequantized weights, prefill and decode, on float activations, to float
   rounding (:func:`bitpress.plugin.check_logits`; skipped for tensors ``requantize`` changes).
   mobius 0.1.0's Gemma-3 graph is corrected first (:func:`bitpress.plugin.fix_gemma3`: every
   layer read the sliding layers' rope, no layer had its window).

Nothing is read outside the GGUF file and the run's work folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bitpress.plugin import ExportError
from bitpress_gguf.codec import TYPES, Blocks, decode, integer_form, pack
from bitpress_gguf.model import GgufModel

log = logging.getLogger(__name__)

ROW_CHUNK = 8192
TIMEOUT_S = 3600
WRITABLE_BITS = (4, 8)  # what bitpress's MatMulNBits writer packs


@dataclass
class Encoded:
    """One weight's blocks in ``MatMulNBits`` form (rows = N): ``(q - zeros) * scales``, plus ``correction[row,
    block]`` for a float-minimum type (:func:`bitpress_gguf.codec.integer_form`, added by :func:`add_corrections`)."""

    bits: int
    block: int
    packed: np.ndarray  # uint8 [rows, n_blocks, block * bits / 8]
    scales: np.ndarray  # float32 [rows, n_blocks]
    zeros: np.ndarray  # uint8 [rows, n_blocks]
    correction: np.ndarray | None = None  # float32 [rows, n_blocks]
    degenerate: int = 0


@dataclass
class Fix:
    """A block-sum correction to add after the ``MatMulNBits`` writing one weight's output."""

    c_name: str  # C's initializer
    c: np.ndarray  # float32 [rows = N, n_blocks]
    block: int
    k: int


#: how each architecture's graph is built, checked against the GGUF's own model: "gguf" = mobius
#: build-gguf (llama: SmolLM2's package has the dequantized model's perplexity); "hf" = mobius build
#: --config on the float folder transformers dequantizes (gemma3: mobius build-gguf 0.1.0's own graph of
#: gemma-3-270m predicts nonsense, perplexity 2.8e13, where this one agrees with transformers' argmax
#: on every token). Others are refused.
ROUTES = {"llama": "gguf", "gemma3": "hf"}
VERIFIED = tuple(ROUTES)


def requantized(model: GgufModel, spec: dict[str, Any] | None) -> set[str]:
    """The GGUF tensors ``spec["tensors"]`` names (names or globs), each pattern matching something."""
    import fnmatch

    if not spec:
        return set()
    names = set(model.file.tensors)
    out: set[str] = set()
    for pattern in spec["tensors"]:
        hits = {n for n in names if fnmatch.fnmatchcase(n, pattern)}
        if not hits:
            raise ExportError(f"requantize: {pattern!r} matches no tensor of {model.source.name}")
        out |= hits
    return out


def refuse_unconvertible(model: GgufModel, skip: set[str] | None = None) -> None:
    """One error for an architecture no exporter converts faithfully, or listing every tensor with no exact
    form, before any build."""
    f = model.file
    arch = f.architecture
    if arch not in VERIFIED:
        raise ExportError(f"{model.source.name}: architecture {arch!r} is not converted: its exporter graph is not "
                          f"verified against the GGUF's model; converted: {', '.join(VERIFIED)}")
    bad = []
    for t in f.tensors.values():
        if t.type_name in ("F32", "F16", "BF16") or t.name in (skip or set()):
            continue
        info = TYPES.get(t.type_name)
        if info is None:
            bad.append(f"{t.name} ({t.type_name}: no ONNX Runtime form)")
        elif t.name == "token_embd.weight" and not info.gatherable:
            bad.append(f"{t.name} ({t.type_name}: float zero points, which GatherBlockQuantized cannot hold)")
    if bad:
        from bitpress.plugin import summarize_names

        raise ExportError(f"{model.source.name}: {len(bad)} tensor(s) have no exact ONNX form: "
                          f"{summarize_names(bad)}")


def target_of(ep: str) -> str:
    """The kernel target (:mod:`bitpress.onnx.kernels`) a package built for ``ep`` runs on (``default``: cpu)."""
    return "cpu" if ep == "default" else ep


def convert(model: GgufModel, workdir: Path, *, ep: str = "cpu", check: bool = True,
            requantize: dict[str, Any] | None = None, accuracy_level: int | None = None,
            timeout: float = TIMEOUT_S) -> Any:
    """Build the package (see the module's docstring) in ``workdir/package``; returns a GenaiPackage.
    ``accuracy_level``: MatMulNBits', None for the target's default (4 on cpu and webgpu, 0 elsewhere)."""
    from bitpress.plugin import GenaiPackage, check_package, resolve_accuracy_level

    target = target_of(ep)
    level = resolve_accuracy_level(accuracy_level, target)
    redo = requantized(model, requantize)
    refuse_unconvertible(model, skip=redo)
    workdir = Path(workdir)
    floatdir, out = workdir / "float", workdir / "package"
    for d in (floatdir, out):
        shutil.rmtree(d, ignore_errors=True)
    src = model.source.absolute()
    route = ROUTES[model.file.architecture]
    out.mkdir(parents=True)
    if route == "gguf":
        _run([sys.executable, "-m", "mobius", "build-gguf", str(src), "-o", str(floatdir), "--ep", ep,
              "--dtype", "f32"], workdir, "mobius build-gguf", timeout)
        config = write_companions(model, workdir, out, ep, timeout)
    else:
        config = build_from_hf_folder(src, workdir, floatdir, out, ep, timeout)
    stats = replace_weights(model, floatdir / "model.onnx", out / "model.onnx", accuracy_level=level, target=target,
                            redo=redo, requantize=requantize, workdir=workdir)
    shutil.rmtree(floatdir, ignore_errors=True)
    cfg_path = out / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    context = model.file.field(f"{model.file.architecture}.context_length")
    if isinstance(context, int) and context > 0:
        cfg["model"]["context_length"] = context
        cfg.setdefault("search", {})["max_length"] = min(int(cfg["search"].get("max_length", context)), context)
    cfg_path.write_text(json.dumps(cfg, indent=4) + "\n")
    checked = None
    if check:
        check_package(out, target)
        if target == "cpu" and not redo:  # requantized tensors are no longer the GGUF's: no reference for them
            checked = check_against_transformers(model, out, workdir, str(config.get("model_type")))
    exporter = "mobius build-gguf" if route == "gguf" else "mobius build --config (transformers' float folder)"
    made = {"source": model.source.name, "exporter": f"{exporter} + bitpress-gguf blocks",
            "exporter_arguments": ["--ep", ep, "--dtype", "f32"], "checkpoint": "gguf",
            "architecture": model.file.architecture, "tensors": stats, "model_type": config.get("model_type"),
            "accuracy_level": level}
    if checked is not None:
        made["check"] = checked
    return GenaiPackage(model.source, out, made)


def check_against_transformers(model: GgufModel, out: Path, workdir: Path, model_type: str) -> dict[str, Any]:
    """The package's logits against transformers' forward of the GGUF's dequantized weights (float activations,
    to float rounding: :func:`bitpress.plugin.check_logits`); raises ExportError when they differ."""
    import torch
    from transformers import AutoModelForCausalLM

    from bitpress.plugin import check_logits

    src = model.source.absolute()
    try:
        reference = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32).eval()
    except Exception as exc:  # transformers raises many kinds for a GGUF it cannot dequantize
        raise ExportError(f"transformers cannot load {src.name} as the check's reference: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:200] if str(exc) else ''}; --option check=false skips the "
                          "check") from None
    try:
        return check_logits(out, reference, dtype="f32", what=src.name, model_type=model_type,
                            workdir=workdir).to_json()
    finally:
        del reference


def _run(argv: list[str], cwd: Path, name: str, timeout: float) -> None:
    from bitpress.plugin import builder_reason

    log.info("%s: %s", name, " ".join(argv[2:]))
    logfile = cwd / f"{name.split()[-1]}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        with logfile.open("w") as fh:
            proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, env=env, timeout=timeout,
                                  check=False)
    except subprocess.TimeoutExpired:
        raise ExportError(f"{name} did not finish in {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise ExportError(f"{name} failed: {builder_reason(logfile)} (-v shows its output)")


# -- tokenizer and genai_config ---------------------------------------------------------------------
def write_companions(model: GgufModel, workdir: Path, out: Path, ep: str, timeout: float) -> dict[str, Any]:
    """Tokenizer files and chat template (transformers reads them from the GGUF) and genai_config.json
    (mobius, from the GGUF's configuration); returns that configuration."""
    from transformers import AutoConfig, AutoTokenizer

    src = model.source.absolute()
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    except Exception as exc:  # transformers raises many kinds for an architecture it does not know
        raise ExportError(f"transformers cannot read the configuration / tokenizer of {src.name}: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
    tok.save_pretrained(out)
    plain_byte_level(out / "tokenizer.json")
    from bitpress_gguf.hf_folder import bos_template, spm_as_bpe

    spm_as_bpe(out / "tokenizer.json", src)
    bos_template(out / "tokenizer.json", src)
    cfgdir, built = workdir / "config", workdir / "config-built"
    shutil.rmtree(cfgdir, ignore_errors=True)
    config.save_pretrained(cfgdir)
    _run([sys.executable, "-m", "mobius", "build", "--config", str(cfgdir), str(built), "--no-weights", "--ep", ep,
          "--runtime", "ort-genai"], workdir, "mobius build", timeout)
    shutil.copyfile(built / "genai_config.json", out / "genai_config.json")
    shutil.rmtree(built, ignore_errors=True)
    return config.to_dict()


def build_from_hf_folder(src: Path, workdir: Path, floatdir: Path, out: Path, ep: str,
                         timeout: float) -> dict[str, Any]:
    """The float graph by ``mobius build --config`` on the folder transformers dequantizes the GGUF into
    (:mod:`bitpress_gguf.hf_folder`, its own process); genai_config.json and the tokenizer come with it."""
    hfdir = workdir / "hf"
    shutil.rmtree(hfdir, ignore_errors=True)
    _run([sys.executable, "-m", "bitpress_gguf.hf_folder", str(src), str(hfdir)], workdir, "transformers hf_folder",
         timeout)
    _run([sys.executable, "-m", "mobius", "build", "--config", str(hfdir), str(floatdir), "--dtype", "f32", "--ep", ep,
          "--runtime", "ort-genai"], workdir, "mobius build", timeout)
    config = json.loads((hfdir / "config.json").read_text())
    from bitpress.plugin import fix_gemma3

    fix_gemma3(floatdir, config)  # mobius 0.1.0's Gemma-3 attention: each layer type's rope, window and scale
    shutil.rmtree(hfdir, ignore_errors=True)  # the float weights twice on disk only while mobius reads them
    for f in floatdir.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx"):
            shutil.copyfile(f, out / f.name)
    return config


def plain_byte_level(path: Path) -> None:
    """transformers turns a GGUF ``gpt2`` vocabulary into a BPE with ``byte_fallback`` and a SentencePiece
    decoder chain, which ONNX Runtime GenAI's tokenizer misreads (wrong ids, a literal ``Ġ``): such a
    byte-level BPE gets the plain ByteLevel decoder and no byte fallback. Other tokenizers are kept."""
    tok = json.loads(path.read_text(encoding="utf-8"))
    if tok.get("model", {}).get("type") != "BPE" or (tok.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        return
    tok["model"]["byte_fallback"] = False
    tok["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    path.write_text(json.dumps(tok, ensure_ascii=False, indent=2), encoding="utf-8")


# -- the weights --------------------------------------------------------------------------------------
def gguf_names(weight: str, arch: str, n_blocks: int) -> list[str]:
    """The GGUF tensors behind an exporter's initializer name (q / k / v fused: three)."""
    import gguf

    arches = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in arches:
        return []
    tmap = gguf.get_tensor_name_map(arches[arch], n_blocks)
    base = weight.removesuffix("_t")
    parts = base.split("__axis_")[0].split("__") if "__axis_" in base else [base]
    names = [tmap.get_name(p, try_suffixes=(".weight",)) for p in parts]
    return [n for n in names if n] if all(names) else []


def replace_weights(model: GgufModel, src: Path, dest: Path, *, accuracy_level: int = 4, target: str = "cpu",
                    redo: set[str] | None = None, requantize: dict[str, Any] | None = None,
                    workdir: Path | None = None) -> dict[str, int]:
    """Every float weight of ``src`` that a quantized GGUF tensor holds, replaced by that tensor's blocks."""
    from bitpress.plugin import (
        OnnxModel,
        QuantizedBlocks,
        Result,
        SaveOptions,
        WeightOnlyOptions,
        Writer,
        plan,
        save_onnx,
    )

    f = model.file
    arch = f.architecture
    n_blocks = int(f.field(f"{arch}.block_count", 0) or 0)
    heads = int(f.field(f"{arch}.attention.head_count", 0) or 0)
    kv_heads = int(f.field(f"{arch}.attention.head_count_kv", heads) or heads)
    onnx_model = OnnxModel.load(src)
    retie_head(onnx_model, "output.weight" in f.tensors)
    p = plan(onnx_model, WeightOnlyOptions(gather_min_rows=1))
    # uint8 zero points only (float minimums come corrected), so the writer adds no correction of its own
    writer = Writer(onnx_model, accuracy_level)
    stats = {"quantized": 0, "float": 0, "degenerate_blocks": 0}
    quantized_names = {n for n, t in f.tensors.items() if t.type_name in TYPES}
    used: set[str] = set()
    splits: list[tuple[Any, list[Encoded], int]] = []
    fixes: dict[str, Fix] = {}  # MatMulNBits output -> its correction
    redo = redo or set()
    redo_weights: list[str] = []
    for group in p.groups:
        names = gguf_names(group.weight, arch, n_blocks)
        if names and any(n in redo for n in names):
            if not all(n in redo for n in names):
                raise ExportError(f"requantize: {group.weight} fuses {', '.join(names)}: name all of them or none")
            redo_weights.append(group.weight)  # left float here, for the requantize pass
            used.update(names)
            continue
        if not names or not all(n in quantized_names for n in names):
            if names and any(n in quantized_names for n in names):
                raise ExportError(f"{group.weight} fuses {', '.join(names)}, of which only some are quantized")
            stats["float"] += 1
            continue
        weight = float_weight(onnx_model, group)  # [rows = N, K], the exporter's values
        parts, row = [], 0
        for name in names:
            t = f.tensors[name]
            rows = t.shape[0]
            enc = encode_checked(f, name, weight[row:row + rows], heads, kv_heads)
            parts.append(enc)
            row += rows
        if row != weight.shape[0]:
            raise ExportError(f"{group.weight}: {row} rows in {', '.join(names)}, the graph's weight has "
                              f"{weight.shape[0]}")
        enc = concat(parts, group.weight)
        stats["quantized"] += len(names)
        stats["degenerate_blocks"] += sum(p.degenerate for p in parts)
        used.update(names)
        if enc is None:
            # Q4_K q / k beside a Q6_K v: one MatMulNBits each, their outputs concatenated. After the writer's
            # edits: its nodes stay as planned.
            splits.append((group, parts, weight.shape[1]))
            stats["split"] = stats.get("split", 0) + 1
            continue
        g = replace(group, bits=enc.bits, block_size=enc.block, symmetric=False)
        blocks = QuantizedBlocks(np.empty((enc.scales.shape[0], enc.scales.shape[1], 0), np.uint8), enc.scales,
                                 enc.zeros)
        writer.write(Result(g, blocks, enc.packed, weight.shape[1], np.dtype(np.float32), 0.0))
        if enc.correction is not None:
            if any(u.is_gather for u in group.uses):  # refused before: GatherBlockQuantized has no correction
                raise ExportError(f"{group.weight}: a float-minimum table cannot be gathered")
            fix = Fix(f"{group.weight}_zero_point_correction", enc.correction, enc.block, weight.shape[1])
            fixes.update({u.node.output[0]: fix for u in group.uses})  # the writer's MatMulNBits writes it
        del weight, parts, enc
    writer.finish()
    for group, parts, k in splits:
        fixes.update(split_fused(onnx_model, group, parts, k, accuracy_level))
    stats["corrected"] = add_corrections(onnx_model, fixes)
    if redo_weights:
        assert requantize is not None
        onnx_model = run_requantize(onnx_model, redo_weights, requantize, workdir or dest.parent, target,
                                    accuracy_level)
        stats["requantized"] = len(redo_weights)
    warn_slow(onnx_model.graph, target, model.source.name)
    missing = sorted(quantized_names - used)
    if missing:
        from bitpress.plugin import summarize_names

        raise ExportError(f"the exporter's graph has no weight for {summarize_names(missing)}: not converted")
    save_onnx(onnx_model, dest, SaveOptions(external_data=True, check=False))
    onnx_model.close()
    log.info("GGUF blocks written: %d tensors (%d zero-scale blocks written exactly), %d float weights kept",
             stats["quantized"], stats["degenerate_blocks"], stats["float"])
    return stats


def run_requantize(model: Any, weights: list[str], spec: dict[str, Any], workdir: Path, target: str = "cpu",
                   accuracy_level: int | None = None) -> Any:
    """The ONNX weight-only pass ``spec["pass"]`` on ``weights`` only (the exporter's float values, llama.cpp's
    dequantization), with ``spec["options"]``; the package's target and accuracy_level unless they say others."""
    import dataclasses

    from bitpress.plugin import BitpressError, PassContext, get_registry

    cls = get_registry().get_pass(spec["pass"])
    if "onnx" not in cls.model_kinds or getattr(cls, "needs_data", False):
        raise ExportError(f"requantize: pass {cls.name} is not a calibration-free ONNX weight-only pass")
    options = {**spec.get("options", {}), "nodes_to_include": list(weights)}
    fields = {f.name for f in dataclasses.fields(cls.Options)} if dataclasses.is_dataclass(cls.Options) else set()
    for key, value in (("target", target), ("accuracy_level", accuracy_level)):
        if key in fields:  # the requantized weights run on the same kernels as the GGUF's
            options.setdefault(key, value)
    try:
        pass_ = cls.from_config(options, strict=True)
    except BitpressError as exc:
        raise ExportError(f"requantize: {exc}") from None
    log.info("requantize: %s on %s", cls.name, ", ".join(weights))
    return pass_.run(model, PassContext(workdir=workdir))


def float_weight(model: Any, group: Any) -> np.ndarray:
    """The group's float weight as ``[rows = N, K]`` float32 (a memory-mapped view; transposed where
    stored ``[K, N]``)."""
    w = np.asarray(model.array(group.weight))
    if w.dtype != np.float32:
        raise ExportError(f"{group.weight} is {w.dtype} in the exporter's graph: the conversion reads float32")
    return w if group.uses[0].rows_are_table_rows else w.T


def retie_head(model: Any, has_output: bool) -> bool:
    """Where the GGUF ties its head to ``token_embd`` but the exporter wrote the head as a copy of the table
    (``lm_head.weight_t`` ``[H, V]``, mobius for Gemma-3), the head reads the table through a ``Transpose``
    again (after checking the copy equals it, by row chunks): one table, quantized once."""
    from onnx import helper

    if has_output:
        return False
    g = model.graph
    inits = model.initializers()
    gathers = [n for n in g.node if n.op_type == "Gather" and n.input[0] in inits and "input_ids" in n.input[1:]]
    if len(gathers) != 1:
        return False
    table = gathers[0].input[0]
    v, h = (int(d) for d in inits[table].dims)
    for i, n in enumerate(g.node):
        if n.op_type != "MatMul" or n.input[1] not in inits or n.input[1] == table:
            continue
        if [int(d) for d in inits[n.input[1]].dims] != [h, v]:
            continue
        head, tab = np.asarray(model.array(n.input[1])), np.asarray(model.array(table))
        if not all(np.array_equal(head[:, r:r + ROW_CHUNK].T, tab[r:r + ROW_CHUNK]) for r in range(0, v, ROW_CHUNK)):
            return False
        del head, tab
        copy, name = n.input[1], f"{table}/bitpress_head_transpose"
        g.node.insert(i, helper.make_node("Transpose", [table], [name], perm=[1, 0], name=name))
        g.node[i + 1].input[1] = name
        model.remove_unused_initializers()
        log.info("the head's copy of the table (%s) replaced by the table itself: one table", copy)
        return True
    return False


def _unpermute(rows: int, heads: int) -> np.ndarray | None:
    """Row order taking llama.cpp's rotary permutation of q / k back to Hugging Face's."""
    if heads <= 0 or rows % (2 * heads):
        return None
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def encode_checked(f: Any, name: str, want: np.ndarray, heads: int, kv_heads: int) -> Encoded:
    """``name``'s blocks, rows ordered as the exporter's float weight ``want`` ``[rows, K]``, checked
    against it: the exact values, or an error."""
    t = f.tensors[name]
    info = TYPES[t.type_name]
    rows, k = t.shape
    nb = k // info.block
    per_row = k // info.elements
    ints = np.empty((rows, k), np.uint8)
    scales = np.empty((rows, nb), np.float32)
    zeros = np.empty((rows, nb), np.float32 if info.float_zero else np.uint8)
    minimum = np.empty((rows, nb), np.float32) if info.float_zero else None
    degenerate = 0
    for start in range(0, rows, ROW_CHUNK):
        stop = min(rows, start + ROW_CHUNK)
        b = decode(t.type_name, f.raw(name, slice(start, stop)).reshape(-1, info.nbytes))
        ints[start:stop] = b.ints.reshape(stop - start, k)
        scales[start:stop] = b.scale.reshape(stop - start, nb)
        zeros[start:stop] = b.zero.reshape(stop - start, nb)
        if minimum is not None and b.minimum is not None:
            minimum[start:stop] = np.broadcast_to(b.minimum, b.scale.shape).reshape(stop - start, nb)
        degenerate += b.degenerate
    order: Any = None
    orders = [slice(None)] + [o for o in (_unpermute(rows, heads), _unpermute(rows, kv_heads)) if o is not None]
    for candidate in orders:
        if _matches(info, ints[candidate][:64], scales[candidate][:64], zeros[candidate][:64], want[:64], per_row):
            order = candidate
            break
    if order is None:
        raise ExportError(f"{name} ({t.type_name}): the exporter's float weight is not the GGUF's dequantization "
                          "(in any row order tried): not converted")
    ints, scales, zeros = ints[order], scales[order], zeros[order]
    minimum = None if minimum is None else minimum[order]
    for start in range(0, rows, ROW_CHUNK):
        sl = slice(start, min(rows, start + ROW_CHUNK))
        if not _matches(info, ints[sl], scales[sl], zeros[sl], want[sl], per_row):
            raise ExportError(f"{name} ({t.type_name}): rows {sl.start}-{sl.stop} differ from the exporter's float "
                              "weight: not converted")
    bits = info.bits if info.bits in WRITABLE_BITS else 4  # Q2_K's 2-bit integers, held exactly in 4 bits
    packed = pack(ints, bits).reshape(rows, nb, -1)
    if minimum is None:
        return Encoded(bits, info.block, packed, scales, zeros, None, degenerate)
    # a float minimum: uint8 zero points + C (Q5_1 / Q5_K: 5-bit integers in one 8-bit MatMulNBits)
    zi, c = integer_form(scales, zeros, minimum, bits)
    return Encoded(bits, info.block, packed, scales, zi, c, degenerate)


def _matches(info: Any, ints: np.ndarray, scales: np.ndarray, zeros: np.ndarray, want: np.ndarray,
             per_row: int) -> bool:
    rows = ints.shape[0]
    b = Blocks(info, ints.reshape(rows * per_row, info.elements), scales.reshape(rows * per_row, -1),
               zeros.reshape(rows * per_row, -1))
    got = b.values().reshape(want.shape)
    if not info.float_zero:
        return bool(np.array_equal(got, want))
    sub = info.block
    q = ints.reshape(rows, -1, sub).astype(np.float32)
    terms = np.maximum(np.abs(q * scales[..., None]), np.abs(zeros.astype(np.float32) * scales)[..., None])
    tol = 4 * np.spacing(np.maximum(terms, np.finfo(np.float32).tiny)).reshape(want.shape)
    return bool((np.abs(got - want) <= tol).all())


def concat(parts: list[Encoded], weight: str) -> Encoded | None:
    """Blocks of fused weights (q / k / v) stacked by rows: the same bits and block, or promoted where exact
    (4-bit integers stored in 8 bits; larger blocks split into smaller ones with the same scale, zero point and
    correction; an integer part's correction 0). None (the caller splits) where a 4-bit float-minimum part
    would be promoted beside 8-bit integers (Q4_K q / k, Q6_K v): split, it keeps its 4 bits."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    block = min(p.block for p in parts)
    if any(p.correction is not None and p.bits < bits for p in parts):
        return None
    corrected = any(p.correction is not None for p in parts)
    out_p, out_s, out_z, out_c = [], [], [], []
    for p in parts:
        rows, nb, _ = p.packed.shape
        factor = p.block // block
        packed = p.packed
        if p.bits != bits or factor != 1:
            ints = _unpack(p.packed, p.bits).reshape(rows, nb * p.block)
            packed = pack(ints, bits).reshape(rows, nb * factor, -1)
        out_p.append(packed)
        out_s.append(np.repeat(p.scales, factor, axis=1))
        out_z.append(np.repeat(p.zeros, factor, axis=1))
        if corrected:
            c = p.correction if p.correction is not None else np.zeros((rows, nb), np.float32)
            out_c.append(np.repeat(c, factor, axis=1))
    return Encoded(bits, block, np.concatenate(out_p), np.concatenate(out_s), np.concatenate(out_z),
                   np.concatenate(out_c) if corrected else None, sum(p.degenerate for p in parts))


def split_fused(model: Any, group: Any, parts: list[Encoded], k: int, accuracy_level: int) -> dict[str, Fix]:
    """A fused weight whose parts have no common exact form: one ``MatMulNBits`` per part on its reader's input,
    concatenated along the last axis into the fused output. Returns the parts' corrections (by output)."""
    from onnx import helper

    from bitpress.plugin import MS_DOMAIN, QuantizedBlocks, to_matmul_nbits

    uses = [u for u in group.uses if not u.is_gather]
    if len(uses) != 1 or uses[0].node.op_type != "MatMul" or uses[0].transpose is not None:
        raise ExportError(f"{group.weight}: its blocks need {len(parts)} MatMulNBits on one input, and its reader "
                          "is not one plain MatMul: not converted")
    g = model.graph
    out_name = uses[0].node.output[0]
    at = next(i for i, n in enumerate(g.node) if n.op_type == "MatMul" and list(n.output) == [out_name])
    x = g.node[at].input[0]
    new: list[Any] = []
    fixes: dict[str, Fix] = {}
    for i, p in enumerate(parts):
        base, out = f"{group.weight}/part{i}", f"{out_name}/part{i}"
        blocks = QuantizedBlocks(np.empty((p.scales.shape[0], p.scales.shape[1], 0), np.uint8), p.scales, p.zeros)
        mt = to_matmul_nbits(blocks, p.bits, k, np.float32, flat=True, packed_q=p.packed)
        names = [f"{base}_Q{p.bits}", f"{base}_scales", f"{base}_zero_points"]
        for name, array in zip(names, (mt.b, mt.scales, mt.zero_points), strict=True):
            g.initializer.append(model.make_tensor(name, array))
        new.append(helper.make_node("MatMulNBits", [x, *names], [out], name=f"{base}_MatMulNBits", domain=MS_DOMAIN,
                                    **mt.attributes(accuracy_level)))
        if p.correction is not None:
            fixes[out] = Fix(f"{base}_zero_point_correction", p.correction, p.block, k)
    new.append(helper.make_node("Concat", [n.output[0] for n in new], [out_name], axis=-1,
                                name=f"{group.weight}/concat"))
    del g.node[at]
    for j, n in enumerate(new):
        g.node.insert(at + j, n)
    model.remove_unused_initializers()
    log.info("%s: %d parts, one MatMulNBits each", group.weight, len(parts))
    return fixes


def add_corrections(model: Any, fixes: dict[str, Fix]) -> int:
    """After each ``MatMulNBits`` writing an output ``fixes`` names, its block-sum correction (the host's
    :func:`bitpress.onnx.correction.insert_corrections`: ``+ MatMul(MatMul(x, E), C)``, the block sums of an input
    computed once). Returns how many were added."""
    import onnx

    from bitpress.plugin import CorrectionFix, insert_corrections

    g = model.graph
    have = {t.name for t in g.initializer}
    for fix in fixes.values():
        if fix.c_name not in have:  # one weight read by two MatMuls: one C
            have.add(fix.c_name)
            g.initializer.append(model.make_tensor(fix.c_name, np.ascontiguousarray(fix.c.T)))  # [n_blocks, N]
    host = {out: CorrectionFix(f.c_name, f.k, f.block, np.dtype(np.float32)) for out, f in fixes.items()}
    try:
        nodes = insert_corrections(list(g.node), host,
                                   lambda name, array: g.initializer.append(model.make_tensor(name, array)))
    except ValueError as exc:  # the writer wrote something else there (a Gemm's bias)
        raise ExportError(f"{exc}: its float minimums cannot be corrected") from None
    copies = [onnx.NodeProto() for _ in nodes]
    for dst, src in zip(copies, nodes, strict=True):
        dst.CopyFrom(src)
    del g.node[:]
    g.node.extend(copies)
    return len(fixes)


def warn_slow(graph: Any, target: str, where: str) -> None:
    """One warning naming the nodes that run on ONNX Runtime's slow path (an explicit accuracy_level below 4 with
    8-bit weights on cpu), :mod:`bitpress.onnx.kernels`."""
    from bitpress.plugin import graph_paths

    warning = graph_paths(graph, target).warning(where)
    if warning:
        log.warning(warning)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    flat = packed.reshape(packed.shape[0], -1)
    return np.stack([(flat >> np.uint8(i * bits)) & mask for i in range(per)], axis=-1).reshape(packed.shape[0], -1)
