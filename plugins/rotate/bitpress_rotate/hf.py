"""QuaRot on a Hugging Face (PyTorch) decoder: ``quarot_hf``, the form that runs before ``gptq_hf`` / ``rtn_hf``.

The same rotation as the ONNX pass (:mod:`bitpress_rotate.rotate`), on the model's parameters:

* every RMS norm that reads the residual stream folds its per-channel scale ``g`` into the linears
  reading its output (``W diag(g)``) and keeps a unit scale (Gemma's ``1 + w`` norms: ``w = 0``);
* the stream is multiplied by an orthogonal ``Q``: the embedding rows become ``E Q``, the linears
  reading the stream ``W Q``, those writing into it (``o_proj``, ``down_proj``, their biases)
  ``Q^T W``; an LM head of its own becomes ``W diag(g) Q``;
* each value head by ``R2`` (QuaRot's R2): ``v_proj``'s rows (and bias) per key/value head,
  ``o_proj``'s columns per attention head;
* **a tied embedding / LM head stays one table**: it holds ``E Q`` and the head reads the final
  norm's output through one float ``Q^T diag(g) Q`` (hidden x hidden), an online product
  (:mod:`bitpress.hf.online`) saved with the checkpoint and carried into exported graphs.

Decoders with norms that write into the stream (Gemma 2 / 3's sandwich norms) would need two such
products per layer, which a Hugging Face checkpoint cannot carry: they are refused, naming the ONNX
form. Everything is computed in float64 and rounded once to the parameters' dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from bitpress.plugin import Pass, PassContext, UsageError
from bitpress_rotate.matrices import hadamard_order_parts, orthogonal
from bitpress_rotate.passes import QuarotOptions

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

READERS = {"attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
WRITERS = {"attn": "o_proj", "mlp": "down_proj"}
#: per-layer modules that mark norms writing into the residual stream (Gemma 2 / 3)
SANDWICH = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


class RotationError(Exception):
    """The model is not a decoder this rotation handles; the message says why."""


@dataclass
class Layout:
    """Where a decoder's stream-side modules are."""

    embed: nn.Module
    head: nn.Module
    final_norm: nn.Module
    layers: list[nn.Module]
    tied: bool
    hidden: int
    head_dim: int
    heads: int
    kv_heads: int
    head_name: str
    offsets: dict[int, float] = field(default_factory=dict)  # id(norm) -> 0 (w) or 1 (1 + w)
    names: dict[int, str] = field(default_factory=dict)  # id(parameter) -> its (first) name


def _linear(module: nn.Module, name: str, where: str) -> nn.Module:
    from torch import nn

    sub = getattr(module, name, None)
    if not isinstance(sub, nn.Linear):
        raise RotationError(f"{where} has no linear {name}")
    return sub


def norm_offset(norm: nn.Module, hidden: int, where: str) -> float:
    """0 when ``norm(x) == x / rms(x) * w``, 1 when ``... * (1 + w)`` (Gemma); RotationError otherwise."""
    import torch

    w = getattr(norm, "weight", None)
    if w is None or tuple(w.shape) != (hidden,) or getattr(norm, "bias", None) is not None:
        raise RotationError(f"{where} is not an RMS norm with one per-channel scale of width {hidden}")
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    with torch.no_grad():
        y = norm(x.to(w.dtype)).float()
    r = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    wf = w.detach().float()
    for offset in (0.0, 1.0):
        expected = r * (wf + offset)
        if torch.allclose(y, expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()) + 1e-6):
            return offset
    raise RotationError(f"{where} ({type(norm).__name__}) is not an RMS norm (x / rms(x) times a per-channel scale)")


def layout(model: nn.Module) -> Layout:
    """The decoder's embedding, layers, norms and head; RotationError naming what does not fit."""
    from torch import nn

    from bitpress.plugin import ONLINE_BUFFER as BUFFER
    from bitpress.plugin import QuantTensor
    from bitpress.plugin import output_embedding_name as head_module

    if any(isinstance(p, QuantTensor) for p in model.parameters()):
        raise RotationError("the model is quantized already: rotate the float model, then quantize")
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if text is None or not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear):
        raise RotationError("not a causal language model with a token embedding and an LM head")
    if hasattr(head, BUFFER):
        raise RotationError("the model is rotated already (its LM head has an online product)")
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    final_norm = getattr(base, "norm", None)
    if layers is None or final_norm is None:
        raise RotationError("no decoder layers (model.layers) and final norm (model.norm) found")
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    for i, layer in enumerate(layers):
        where = f"layer {i}"
        sandwich = [n for n in SANDWICH if hasattr(layer, n)]
        if sandwich:
            raise RotationError(
                f"{where} has norms that write into the residual stream ({', '.join(sandwich)}, Gemma 2 / 3's "
                "sandwich norms): each needs an online product after it, which a Hugging Face checkpoint cannot "
                "hold; export the model to ONNX and run the quarot pass on the graph")
        mlp = getattr(layer, "mlp", None)
        if mlp is None or hasattr(mlp, "experts"):
            raise RotationError(f"{where}: only dense MLPs are rotated (a mixture of experts is not, yet)")
        attn = getattr(layer, "self_attn", None)
        known = {id(_linear(attn, n, f"{where} attention")) for n in (*READERS["attn"], WRITERS["attn"])}
        known |= {id(_linear(mlp, n, f"{where} MLP")) for n in (*READERS["mlp"], WRITERS["mlp"])}
        other = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear) and id(m) not in known]
        if other:
            raise RotationError(f"{where} has linears the rotation does not know where to put: {', '.join(other)}")
        for norm_name in ("input_layernorm", "post_attention_layernorm"):
            if getattr(layer, norm_name, None) is None:
                raise RotationError(f"{where} has no {norm_name}")
    if tuple(embed.weight.shape) != (embed.weight.shape[0], hidden) or head.in_features != hidden:
        raise RotationError(f"the embedding or the LM head is not {hidden} wide")
    out = Layout(embed, head, final_norm, list(layers), head.weight is embed.weight, hidden, head_dim, heads,
                 kv_heads, head_module(model) or "lm_head")
    for i, layer in enumerate(out.layers):
        for norm_name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, norm_name)
            out.offsets[id(norm)] = norm_offset(norm, hidden, f"layer {i} {norm_name}")
    out.offsets[id(final_norm)] = norm_offset(final_norm, hidden, "the final norm")
    for n, p in model.named_parameters(remove_duplicate=True):
        out.names.setdefault(id(p), n)
    return out


@dataclass
class HfRotation:
    """What :func:`rotate_model` changed."""

    weights: int = 0
    norms: int = 0
    heads: int = 0
    online: list[str] = field(default_factory=list)

    def summary(self) -> str:
        extra = f"; online product before {', '.join(self.online)} (the tied table stays one)" if self.online else ""
        return f"{self.weights} weights rotated, {self.norms} norm scales folded, {self.heads} value heads{extra}"


def fold_norms(model: nn.Module, lay: Layout) -> torch.Tensor:
    """Fold every stream-reading norm's scale into the linears reading it and give the norm a unit scale
    (in place, float64 math); an untied head takes the final norm's. Returns the final norm's scale ``g``
    (float64), which a tied head needs in its online product."""
    import torch

    f64 = torch.float64

    def unit(norm: nn.Module) -> torch.Tensor:
        offset = lay.offsets[id(norm)]
        g = norm.weight.detach().to(f64) + offset
        norm.weight.fill_(1.0 - offset)
        return g

    with torch.no_grad():
        for layer in lay.layers:
            for part, norm_name in (("attn", "input_layernorm"), ("mlp", "post_attention_layernorm")):
                g = unit(getattr(layer, norm_name))
                block = layer.self_attn if part == "attn" else layer.mlp
                for name in READERS[part]:
                    w = getattr(block, name).weight
                    w.copy_((w.to(f64) * g[None, :]).to(w.dtype))
        g = unit(lay.final_norm)
        if not lay.tied:
            w = lay.head.weight
            w.copy_((w.to(f64) * g[None, :]).to(w.dtype))
    return g


def rotated(lay: Layout, r1: torch.Tensor, r2s: list[torch.Tensor] | None,
            value: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{parameter name: rotated value}`` for every parameter the rotation changes, from the folded model.

    ``value(parameter)`` gives a parameter's current value in the dtype to compute in (float64 to apply
    the rotation, float32 with gradients to train it); ``r2s``: one head rotation per layer (None: none).
    Differentiable in ``r1`` and ``r2s``.
    """
    out: dict[str, torch.Tensor] = {}
    name = lay.names
    out[name[id(lay.embed.weight)]] = value(lay.embed.weight) @ r1
    for i, layer in enumerate(lay.layers):
        attn, mlp = layer.self_attn, layer.mlp
        r2 = r2s[i] if r2s is not None else None
        for block, part in ((attn, "attn"), (mlp, "mlp")):
            for reader in READERS[part]:
                lin = getattr(block, reader)
                w = value(lin.weight) @ r1
                if reader == "v_proj" and r2 is not None:
                    w = (r2.T @ w.reshape(lay.kv_heads, lay.head_dim, lay.hidden)).reshape(w.shape)
                    if lin.bias is not None:
                        b = value(lin.bias).reshape(lay.kv_heads, lay.head_dim) @ r2
                        out[name[id(lin.bias)]] = b.reshape(-1)
                out[name[id(lin.weight)]] = w
            lin = getattr(block, WRITERS[part])
            w = value(lin.weight)
            if part == "attn" and r2 is not None:
                w = (w.reshape(lay.hidden, lay.heads, lay.head_dim) @ r2).reshape(w.shape)
            out[name[id(lin.weight)]] = r1.T @ w
            if lin.bias is not None:
                out[name[id(lin.bias)]] = value(lin.bias) @ r1
    if not lay.tied:
        out[name[id(lay.head.weight)]] = value(lay.head.weight) @ r1
    return out


def head_product(r1: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The tied head's online product ``R1^T diag(g) R1``."""
    return r1.T @ (g[:, None] * r1)


def apply_rotation(model: nn.Module, lay: Layout, g: torch.Tensor, r1: torch.Tensor,
                   r2s: list[torch.Tensor] | None) -> HfRotation:
    """Write the rotation (float64 math, one rounding) into the folded ``model``; attach a tied head's product."""
    import torch

    from bitpress.plugin import attach_online as attach

    f64 = torch.float64
    params = dict(model.named_parameters(remove_duplicate=True))
    with torch.no_grad():
        new = rotated(lay, r1.to(f64), None if r2s is None else [r.to(f64) for r in r2s], lambda p: p.to(f64))
        for n, value in new.items():
            params[n].copy_(value.to(params[n].dtype))
    result = HfRotation(weights=sum(v.ndim == 2 for v in new.values()), norms=2 * len(lay.layers) + 1,
                        heads=len(lay.layers) * lay.kv_heads if r2s is not None else 0)
    if lay.tied:
        attach(model, lay.head_name, head_product(r1.to(f64), g).to(torch.float32))
        result.online.append(lay.head_name)
    return result


def rotate_model(model: nn.Module, mode: str = "hadamard", seed: int = 0, heads: bool = True) -> HfRotation:
    """Rotate ``model`` in place with QuaRot's fixed matrices (see the module's docstring); RotationError
    before any change."""
    import torch

    lay = layout(model)
    rng = np.random.default_rng(seed)
    r1 = torch.from_numpy(orthogonal(lay.hidden, mode, rng))
    r2s = [torch.from_numpy(orthogonal(lay.head_dim, mode, rng)) for _ in lay.layers] if heads else None
    g = fold_norms(model, lay)
    return apply_rotation(model, lay, g, r1, r2s)


HF_REQUIRES = ("torch", "transformers", "safetensors")
HF_HINT = 'pip install "torch==2.13.0" "transformers==5.17.0" safetensors'


def check_hadamard(pass_name: str, model: nn.Module, opts: Any, where: str) -> None:
    """UsageError when ``rotate_mode=hadamard`` has no Hadamard matrix for the model's widths."""
    if opts.rotate_mode != "hadamard":
        return
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hidden = int(config.hidden_size)
    head_dim = int(getattr(config, "head_dim", None) or hidden // int(config.num_attention_heads))
    for what, n in (("hidden size", hidden), ("head size", head_dim if opts.rotate_heads else 1)):
        if hadamard_order_parts(n) is None:
            also = " or rotate_heads=false" if what == "head size" else ""
            raise UsageError(f"{pass_name}: no Hadamard matrix of order {n} (the {what} of {where}) is known; "
                             f"use rotate_mode=random{also}")


class QuarotHfPass(Pass):
    """QuaRot's offline rotation of a Hugging Face decoder (PyTorch): same outputs, weights mixed across channels."""

    name = "quarot_hf"
    algorithms = ("quarot",)
    precisions = ()
    model_kinds = ("hf",)
    needs_data = False
    summary = ("rotate a Hugging Face decoder's residual stream and value heads (QuaRot); same float outputs, "
               "then quantize with gptq_hf / rtn_hf / kquant_hf")
    Options: ClassVar[type] = QuarotOptions
    requires: ClassVar[tuple[str, ...]] = HF_REQUIRES
    install_hint: ClassVar[str | None] = HF_HINT

    def run(self, model: Any, context: PassContext) -> Any:
        from bitpress.plugin import HfModel

        if not isinstance(model, HfModel):
            raise UsageError(f"{self.name} rotates Hugging Face models, got a {model.kind} model")
        where = model.source.name
        torch_model = model.torch_model()
        check_hadamard(self.name, torch_model, self.options, where)
        try:
            result = rotate_model(torch_model, self.options.rotate_mode, self.options.seed, self.options.rotate_heads)
        except RotationError as exc:
            raise UsageError(f"{self.name}: cannot rotate {where}: {exc}") from None
        model.history.append({"pass": self.name, "options": asdict(self.options), "float": True})
        log.info("%s: %s: %s", self.name, where, result.summary())
        return model
