"""A built GenAI package against transformers: the logits it computes, prefill and decode steps.

Generating a few tokens does not show that a package is right: a wrong rope theta, a missing
sliding window or a misread attention scale leave greedy tokens equal on short prompts while the
logits drift (Gemma-3 through mobius 0.1.0: off by up to 4.9 on a logit of 18). So every package
``hf_to_genai`` builds for a CPU-runnable EP is run through ``onnxruntime_genai`` (the package's own
runtime path, its KV cache included) on two prompts, each a prefill followed by
:data:`DECODE_STEPS` decode steps fed the reference's greedy tokens, and its logits are compared
with the forward of the model it was built from: transformers' model for a float checkpoint,
bitpress's quantized PyTorch model (each weight dequantized, float activations) for a quantized one.

* The long prompt crosses the model's sliding window when there is one of at most
  :data:`LONG_WINDOW` positions (the check's KV capacity is at least the window, as
  ``onnxruntime_genai`` requires), so a layer that ignores its window is caught.
* ``MatMulNBits`` at ``accuracy_level`` 4 quantize activations to int8 per block, which moves the
  logits by about 2% of their range on tiny random models; that would hide errors of the same
  size. The comparison therefore runs on a view of the package whose ``MatMulNBits`` compute in
  float (accuracy level 0; the weights are the same files, hard-linked), where the package must
  equal the reference to float rounding; the package as built is run too and its difference is
  reported (:attr:`LogitsCheck.own_level_max_abs`), not bounded.
* Tolerance: the largest absolute difference over every compared position, relative to the
  reference's largest absolute logit (at least 1), must be at most :data:`TOLERANCE` for the
  package's float dtype: float32 5e-3, float16 2e-2, bfloat16 5e-2. Measured in float32: 1e-7 to
  2e-6 on the tiny models of docs/architectures.md; gemma-3-270m (18 layers, a 520-token prompt
  of random ids, logits up to 146) 1.3e-3 through the builder and 9.5e-4 through mobius; a wrong
  rope theta 0.27 (gemma-3-270m, real text) to 0.5 (tiny), a swapped weight 1.3.

A package outside the tolerance is refused: the export stops with one line naming the model
type, where the logits differ and by how much, and what to try; nothing is written. The check
needs the model in PyTorch once (its own dtype); ``check: false`` (``--option check=false``)
skips it, and with it this guarantee.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bitpress.errors import ExportError

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

#: the largest difference accepted, relative to the reference's largest |logit| (at least 1), by float dtype
TOLERANCE = {"f32": 5e-3, "f16": 2e-2, "bf16": 5e-2}
DECODE_STEPS = 3
#: prompt lengths: a short one, and a longer one (crossing a sliding window up to LONG_WINDOW positions)
SHORT_PROMPT, LONG_PROMPT = 7, 24
LONG_WINDOW = 1024
SKIP_HINT = "--option check=false skips this check"


@dataclass
class LogitsCheck:
    """The package's logits against the reference's, on every compared position."""

    max_abs: float
    scale: float  # the reference's largest |logit|
    tolerance: float  # relative to max(scale, 1)
    worst: str  # where the largest difference is
    prompts: list[int]  # prompt lengths
    steps: int
    window: int  # the sliding window crossed (0: none)
    greedy_equal: bool
    own_level_max_abs: float | None = None  # the package as built (int8 activations), when it differs

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.tolerance * max(self.scale, 1.0)

    def summary(self) -> str:
        text = (f"logits equal transformers' within {self.max_abs:.2e} (largest logit {self.scale:.3g}, tolerance "
                f"{self.tolerance:g} of it) on prompts of {', '.join(map(str, self.prompts))} tokens and "
                f"{self.steps} decode steps each")
        if self.window:
            text += f", crossing the sliding window of {self.window}"
        if self.own_level_max_abs is not None:
            text += f"; with the package's int8 activations {self.own_level_max_abs:.2e}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {"summary": self.summary(), "max_abs": self.max_abs, "largest_logit": self.scale,
                "tolerance": self.tolerance, "prompts": self.prompts, "decode_steps": self.steps,
                "sliding_window": self.window,
                "greedy_equal": self.greedy_equal, "package_accuracy_level_max_abs": self.own_level_max_abs}


def check_logits(package: Path, reference: nn.Module, *, dtype: str, what: str, model_type: str,
                 workdir: Path) -> LogitsCheck:
    """Compare ``package``'s logits with ``reference``'s; raise :class:`ExportError` when they differ.

    ``dtype``: the package's float dtype (f32, f16, bf16); ``what``: the model's name for messages.
    """
    from bitpress.genai.package import read_genai_config, sliding_window

    genai = read_genai_config(package)
    cfg = (genai or {}).get("model") or {}
    vocab = int(cfg.get("vocab_size") or 0)
    context = int(cfg.get("context_length") or 0)
    window = sliding_window(genai) or _config_window(reference)  # mobius writes none: the model's own
    if vocab < 2 or context < SHORT_PROMPT + DECODE_STEPS + 1:
        raise ExportError(f"the package built from {what} cannot be checked against transformers (genai_config.json "
                          f"gives vocab_size {vocab}, context_length {context}); {SKIP_HINT}")
    long = LONG_PROMPT
    if 0 < window <= LONG_WINDOW:
        long = max(long, window + 8)
    long = min(long, context - DECODE_STEPS - 1)
    rng = np.random.default_rng(20261207)
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in (SHORT_PROMPT, long)]
    refs = [_reference(reference, p, what) for p in prompts]
    exact = _float_activations_view(package, workdir / "logits-check")
    try:
        got = [_package_logits(exact or package, p, steps, context, window) for p, (steps, _) in zip(prompts, refs,
                                                                                                       strict=True)]
        own = None
        if exact is not None:
            own_logits = [_package_logits(package, p, steps, context, window)
                          for p, (steps, _) in zip(prompts, refs, strict=True)]
            own = max(float(np.abs(g - r).max()) for g, (_, r) in zip(own_logits, refs, strict=True))
    except ExportError:
        raise
    except Exception as exc:  # onnxruntime_genai raises plain RuntimeErrors
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ExportError(f"onnxruntime_genai cannot run the package built from {what} on the check's prompts: "
                          f"{first}") from None
    finally:
        if exact is not None:
            shutil.rmtree(exact, ignore_errors=True)
    worst, max_abs, scale, greedy = "", 0.0, 0.0, True
    for i, (g, (_steps, r), p) in enumerate(zip(got, refs, prompts, strict=True)):
        scale = max(scale, float(np.abs(r).max()))
        diff = np.abs(g - r).max(axis=-1)
        at = int(diff.argmax())
        if float(diff[at]) > max_abs:
            max_abs = float(diff[at])
            where = f"prompt position {at}" if at < len(p) else f"decode step {at - len(p) + 1}"
            worst = f"prompt {i + 1} of {len(p)} tokens, {where}"
        greedy &= bool((g[len(p) - 1:].argmax(-1) == r[len(p) - 1:].argmax(-1)).all())
    result = LogitsCheck(max_abs, scale, TOLERANCE.get(dtype, TOLERANCE["f32"]), worst, [len(p) for p in prompts],
                         DECODE_STEPS, window if 0 < window < long else 0, greedy, own)
    if not result.ok:
        raise ExportError(
            f"the package built from {what} (model_type {model_type!r}) computes logits that differ from "
            f"transformers' by up to {max_abs:.3g} ({worst}; largest logit {scale:.3g}, tolerance "
            f"{result.tolerance:g} of it): the exporter builds this architecture wrong; try the other exporter "
            f"(--exporter builder / mobius) or --runtime onnx; {SKIP_HINT}"
        )
    log.info("checked against transformers: %s", result.summary())
    return result


def _config_window(model: nn.Module) -> int:
    """The model's sliding window (0 when it has none), from its transformers config or its text_config."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        window = getattr(cfg, "sliding_window", None) if cfg is not None else None
        if isinstance(window, int) and window > 0 and (getattr(cfg, "use_sliding_window", True) is not False):
            return window
    return 0


def _reference(model: nn.Module, prompt: list[int], what: str) -> tuple[list[int], np.ndarray]:
    """The reference's greedy continuation of ``prompt`` (DECODE_STEPS tokens) and its float32 logits
    for every position of prompt + continuation but the last."""
    import torch

    ids = list(prompt)
    try:
        with torch.no_grad():
            for _ in range(DECODE_STEPS):
                logits = model(input_ids=torch.tensor([ids])).logits[0]
                ids.append(int(logits[-1].argmax()))
    except Exception as exc:  # whatever transformers raises for a model it cannot run on token ids alone
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ExportError(f"the check against transformers cannot run {what} on token ids: {first}; "
                          f"{SKIP_HINT}") from None
    # the last forward read prompt + every step but the last: the positions the package is compared on
    return ids[len(prompt):], logits.float().numpy()


def _package_logits(folder: Path, prompt: list[int], steps: list[int], context: int, window: int) -> np.ndarray:
    """The package's logits for the prompt (prefill) then each of ``steps[:-1]`` fed one at a time."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    need = len(prompt) + len(steps) + 1
    params.set_search_options(max_length=min(max(need, window), context), do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([prompt], dtype=np.int32))
    rows = [np.asarray(gen.get_output("logits"), dtype=np.float32)[0]]
    if rows[0].shape[0] != len(prompt):  # a package whose prefill returns the last position only
        rows[0] = rows[0][-1:]
    for t in steps[:-1]:
        gen.append_tokens(np.array([[t]], dtype=np.int32))
        rows.append(np.asarray(gen.get_output("logits"), dtype=np.float32)[0][-1:])
    out = np.concatenate(rows, axis=0)
    if out.shape[0] != len(prompt) + len(steps) - 1:
        raise ExportError(f"the package's prefill returns {rows[0].shape[0]} of {len(prompt)} positions' logits: "
                          f"the check compares every position; {SKIP_HINT}")
    return out


def _float_activations_view(package: Path, dest: Path) -> Path | None:
    """A copy of ``package`` whose ``MatMulNBits`` compute with float activations (accuracy_level 0), the
    other files hard-linked; None when every ``MatMulNBits`` already does."""
    import onnx
    from onnx import helper

    protos = {}
    for path in sorted(package.rglob("*.onnx")):
        proto = onnx.load(str(path), load_external_data=False)
        changed = False
        for n in proto.graph.node:
            if n.op_type != "MatMulNBits":
                continue
            level = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "accuracy_level"), 0)
            if level != 0:
                kept = [a for a in n.attribute if a.name != "accuracy_level"]
                del n.attribute[:]
                n.attribute.extend(kept)
                changed = True
        if changed:
            protos[path] = proto
    if not protos:
        return None
    shutil.rmtree(dest, ignore_errors=True)
    for path in sorted(package.rglob("*")):
        target = dest / path.relative_to(package)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if path in protos:
            onnx.save(protos[path], str(target))  # external data names stay relative: the linked files
        else:
            try:
                os.link(path, target)
            except OSError:
                shutil.copyfile(path, target)
    return dest
