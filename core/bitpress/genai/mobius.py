"""mobius (``mobius build``, the ``genai`` extra) as the exporter of a GenAI package.

mobius builds the ONNX graph from the architecture's definition (not by tracing) and, with
``--runtime ort-genai``, writes ``genai_config.json`` and copies the tokenizer files. bitpress
hands it the same staged folder as the builder (:mod:`bitpress.genai.export`): a float
checkpoint, or an olive checkpoint written with mobius's conventions
(:func:`bitpress.hf.olive.write_olive` with ``exporter="mobius"``), so a quantized tied table is
gathered by ``GatherBlockQuantized`` and read by the LM head's ``MatMulNBits`` from the same
initializers.

What mobius 0.1.0 gets wrong, measured here and handled:

* ``genai_config.json`` says ``context_length`` / ``max_length`` 4096 whatever the model's
  ``max_position_embeddings`` (its rotary tables hold that many positions): both are set to the
  model's;
* ``bf16`` packages for ``cpu`` / ``default`` do not load in ONNX Runtime (no bf16 ``MatMul`` on
  its CPU EP): refused before the build;
* ``MatMulNBits`` get ``accuracy_level`` 4 on every EP; an explicit ``accuracy_level`` is set on
  them after the build;
* ``genai_config.json``'s ``model.type`` is the Hugging Face ``model_type``, which
  ``onnxruntime_genai`` 0.18 refuses for some ("Unsupported model_type": ``mixtral``,
  ``qwen3_moe``, ``gpt_oss``, ``olmo2``, ``gpt2``): it is set to the decoder type
  ``onnxruntime_genai`` runs the same graph inputs and outputs with (:data:`GENAI_TYPES`; each
  package's logits are then checked against transformers');
* Gemma-3 (``gemma3_text``, and the text model of ``gemma3``): every ``GroupQueryAttention`` reads
  the sliding layers' rotary tables (theta 1e4), none has the sliding window, and the scale is
  ``head_dim ** -0.5`` where Gemma's is ``query_pre_attn_scalar ** -0.5``. Measured on gemma-3-270m
  (an 84-token prompt): last-position logits off by up to 4.93 against transformers.
  :func:`fix_gemma3` gives the full-attention layers rotary tables of their own theta (and linear
  scaling factor), the sliding layers ``local_window_size``, and every layer Gemma's scale; the
  package then equals transformers to float rounding (checked on every build,
  :mod:`bitpress.genai.check`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Any

from bitpress.errors import ExportError
from bitpress.genai import GENAI_INSTALL_HINT

log = logging.getLogger(__name__)

#: mobius's ``--ep`` choices a GenAI package is built for ("default": portable ONNX, no vendor fusions)
MOBIUS_EPS = ("default", "cpu", "cuda", "dml", "webgpu", "trt-rtx", "qnn", "openvino")
#: the EPs whose packages this machine can load and run (ONNX Runtime's CPU EP)
CPU_RUNNABLE = ("default", "cpu")
#: mobius's genai_config model types onnxruntime_genai 0.18 does not know -> the type it runs them as
#: (a decoder-only LLM with the same inputs and outputs; measured: the packages generate, logits as the model's)
GENAI_TYPES = {"mixtral": "mistral", "qwen3_moe": "qwen3", "gpt_oss": "gptoss", "olmo2": "olmo", "gpt2": "llama"}


def mobius_missing() -> str | None:
    """Why mobius cannot run here (None when it can)."""
    needed = ("mobius", "onnxruntime_genai", "transformers", "torch")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        return f"mobius needs {', '.join(missing)}: {GENAI_INSTALL_HINT}"
    return None


def config_fault(config: dict[str, Any]) -> str | None:
    """Why mobius 0.1.0 builds this config wrong (measured; None when nothing is known)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("rope_type") == "yarn" and rope.get("truncate") is False:
        return ("mobius 0.1.0 ignores YaRN's truncate: false (as gpt-oss sets it): its package's logits differ from "
                "transformers' (by 1.6 of 3.4 on a tiny gpt-oss, measured)")
    if text.get("mlp_bias"):
        return "mobius 0.1.0 drops the MLP biases of a model with mlp_bias=true (its package's logits differ)"
    return None


def check_config(config: dict[str, Any]) -> None:
    """Refuse, before the build, configs mobius 0.1.0 is known to build wrong (measured)."""
    why = config_fault(config)
    if why:
        raise ExportError(f"{why}: use --exporter builder")


def mobius_argv(staged: Path, out: Path, *, dtype: str, ep: str) -> list[str]:
    """The ``mobius build`` command line for a staged checkpoint folder."""
    if ep not in MOBIUS_EPS:
        raise ExportError(f"unknown execution provider {ep!r} for mobius; known: {', '.join(MOBIUS_EPS)}")
    if dtype == "bf16" and ep in CPU_RUNNABLE:
        raise ExportError(f"mobius bf16 packages for {ep} do not load in ONNX Runtime (its CPU EP has no bf16 "
                          "MatMul): use --dtype f16 or f32, or build bf16 for cuda")
    return [sys.executable, "-m", "mobius", "build", "--config", str(staged), str(out), "--dtype", dtype,
            "--ep", ep, "--runtime", "ort-genai"]


def finish_mobius(out: Path, config: dict, accuracy_level: int | None) -> None:
    """Correct what mobius writes (see the module's docstring) in the package ``out``."""
    fixed = fix_gemma3(out, config)
    if fixed:
        log.info("Gemma-3: %d attention nodes given their layer type's rotary tables, window and scale", fixed)
    path = out / "genai_config.json"
    positions = config.get("max_position_embeddings")
    if path.is_file():
        cfg = json.loads(path.read_text())
        model, search = cfg.get("model", {}), cfg.get("search", {})
        changed = False
        if isinstance(positions, int) and positions > 0 and (model.get("context_length", 0) > positions
                                                            or search.get("max_length", 0) > positions):
            log.info("genai_config.json: context_length %s -> %d (the model's max_position_embeddings)",
                     model.get("context_length"), positions)
            model["context_length"] = positions
            search["max_length"] = min(search.get("max_length", positions), positions)
            changed = True
        if model.get("type") in GENAI_TYPES:
            log.info("genai_config.json: model type %s -> %s (onnxruntime_genai 0.18 does not know %s)",
                     model["type"], GENAI_TYPES[model["type"]], model["type"])
            model["type"] = GENAI_TYPES[model["type"]]
            changed = True
        if changed:
            path.write_text(json.dumps(cfg, indent=4) + "\n")
    if accuracy_level is not None:
        n = set_accuracy_level(out, accuracy_level)
        log.info("MatMulNBits accuracy_level %d on %d nodes", accuracy_level, n)


def set_accuracy_level(folder: Path, level: int) -> int:
    """Set ``accuracy_level`` on every ``MatMulNBits`` of the package's graphs; returns how many."""
    import onnx
    from onnx import helper

    count = 0
    for path in sorted(folder.rglob("*.onnx")):
        proto = onnx.load(str(path), load_external_data=False)
        changed = False
        for n in proto.graph.node:
            if n.op_type != "MatMulNBits":
                continue
            kept = [a for a in n.attribute if a.name != "accuracy_level"]
            del n.attribute[:]
            n.attribute.extend([*kept, helper.make_attribute("accuracy_level", int(level))])
            changed = True
            count += 1
        if changed:
            onnx.save(proto, str(path))  # external data untouched: the tensors still point at their file
    return count


def fix_gemma3(folder: Path, config: dict[str, Any]) -> int:
    """Give the ``GroupQueryAttention`` nodes of a mobius Gemma-3 graph their layer type's rotary tables,
    sliding window and Gemma's attention scale (see the module's docstring); returns the nodes changed."""
    import re

    import onnx
    from onnx import helper, numpy_helper

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if text.get("model_type") not in ("gemma3_text", "gemma3") and config.get("model_type") not in ("gemma3",):
        return 0
    types = text.get("layer_types") or []
    rope = text.get("rope_parameters") or {}
    full = rope.get("full_attention") if isinstance(rope.get("full_attention"), dict) else None
    window = text.get("sliding_window")
    scalar = text.get("query_pre_attn_scalar")
    count = 0
    for path in sorted(Path(folder).rglob("*.onnx")):
        proto = onnx.load(str(path), load_external_data=False)
        g = proto.graph
        inits = {t.name: t for t in g.initializer}
        changed = False
        for n in g.node:
            if n.op_type != "GroupQueryAttention":
                continue
            m = re.search(r"layers\.(\d+)\.", n.name) or re.search(r"layers\.(\d+)\.", n.input[0])
            if m is None or int(m.group(1)) >= len(types):
                raise ExportError(f"mobius's Gemma-3 graph {path.name}: attention node {n.name!r} names no layer of "
                                  f"the {len(types)} the config lists; the package cannot be corrected")
            kind = types[int(m.group(1))]
            attrs = {a.name: a for a in n.attribute}
            if isinstance(scalar, int | float) and scalar > 0:
                attrs["scale"] = helper.make_attribute("scale", float(scalar) ** -0.5)
            if kind == "sliding_attention" and isinstance(window, int) and window > 0:
                attrs["local_window_size"] = helper.make_attribute("local_window_size", int(window))
            if kind == "full_attention" and full is not None and len(n.input) > 8:
                cos = numpy_helper.to_array(inits[n.input[7]], base_dir=str(path.parent))
                names = ("bitpress.rotary_full.cos_cache", "bitpress.rotary_full.sin_cache")
                if names[0] not in inits:
                    for name, table in zip(names, _rotary_tables(full, *cos.shape), strict=True):
                        t = numpy_helper.from_array(table.astype(cos.dtype), name)
                        g.initializer.append(t)
                        inits[name] = t
                n.input[7], n.input[8] = names
            del n.attribute[:]
            n.attribute.extend(attrs.values())
            changed = True
            count += 1
        if changed:
            onnx.save(proto, str(path))  # external data untouched: the tensors still point at their file
    return count


def _rotary_tables(rope: dict[str, Any], positions: int, half: int) -> tuple[Any, Any]:
    """cos / sin tables ``[positions, half]`` of ``rope`` (theta; ``default`` or ``linear`` scaling)."""
    import numpy as np

    kind = rope.get("rope_type", "default")
    if kind not in ("default", "linear"):
        raise ExportError(f"mobius's Gemma-3 graph: full-attention rope_type {kind!r} is not corrected by bitpress "
                          "(default and linear are): use --exporter builder")
    inv = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half)))
    if kind == "linear":
        inv = inv / float(rope["factor"])
    angles = np.outer(np.arange(positions, dtype=np.float64), inv)
    return np.cos(angles), np.sin(angles)
