"""SpinQuant on a Hugging Face decoder: ``spinquant_hf`` (Olive's ``SpinQuant``), rotations learned, not fixed.

The rotation of :mod:`bitpress_rotate.hf` (R1 on the residual stream, one R2 per layer on the value
heads, norms folded, a tied table kept one) with its matrices trained instead of drawn: starting
from QuaRot's (``rotate_mode``, ``seed``), R1 and the R2s follow Cayley SGD on the orthogonal group
(each step ``X <- (I + a/2 A)^-1 (I - a/2 A) X`` with the skew-symmetric ``A = G X^T - X G^T`` of the
gradient ``G``, scaled so that ``a ||A||`` is the step's learning rate: the iterate stays orthogonal)
to minimize the KL divergence from the float model's next-token distribution to that of the rotated
model whose layer weights are fake-quantized as the quantizer after it will store them (``w_bits``,
``w_group_size``, ``w_symmetric``; rounding with a straight-through gradient) and, when ``a_bits`` < 16,
whose linear layers' inputs are fake-quantized per token (``a_bits`` 8 models the int8 compute of
``MatMulNBits`` at accuracy_level 4). The float model is its own teacher, so the loss needs no
labels and the calibration text may be the model's own (the default when no data is given).

The result is written exactly as QuaRot's (same function to float rounding; the learned matrices
are re-orthogonalized in float64 before they are applied), then a quantizer pass follows.
"""

from __future__ import annotations

import copy
import logging
import re
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from bitpress.plugin import OptionError, Pass, PassContext, UsageError, option
from bitpress_rotate.hf import (
    HF_HINT,
    HF_REQUIRES,
    READERS,
    WRITERS,
    HfRotation,
    Layout,
    RotationError,
    apply_rotation,
    check_hadamard,
    fold_norms,
    head_product,
    layout,
    rotated,
)
from bitpress_rotate.matrices import MODES, orthogonal
from bitpress_rotate.passes import RotationFields

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

#: training_args keys read (Hugging Face TrainingArguments names, as Olive passes them) and their defaults
TRAINING_DEFAULTS: dict[str, Any] = {"max_steps": 100, "learning_rate": 0.05, "per_device_train_batch_size": 4}
#: the samples of the model's own text trained on when no calibration data is given
DEFAULT_SAMPLES = 32
#: windows the reported loss (before and after training) is measured on
EVAL_WINDOWS = 8
#: a device name of one CUDA GPU by its index
_CUDA_INDEX = re.compile(r"cuda:\d+")
#: SpinQuant's extra start: no rotation (the training then only ever improves on the unrotated model)
IDENTITY = "identity"


def start(n: int, mode: str, rng: np.random.Generator) -> np.ndarray:
    """The matrix training starts from: QuaRot's (``hadamard`` / ``random``) or the identity."""
    return np.eye(n) if mode == IDENTITY else orthogonal(n, mode, rng)


@dataclass
class SpinQuantOptions(RotationFields):
    """Options of ``spinquant_hf`` (Olive's SpinQuant names, plus the weight format trained for)."""

    rotate_mode: str = option("hadamard", "the matrices training starts from: hadamard (QuaRot's randomized "
                                          "Hadamard), random (random orthogonal) or identity (no rotation)")

    a_bits: int = option(16, "bits of the linear layers' inputs the rotation is trained for: 16 (weights only), "
                             "8 (MatMulNBits' int8 compute at accuracy_level 4), 4")
    a_symmetric: bool = option(True, "activations quantized symmetrically (false: with a zero point)")
    a_per_token: bool = option(True, "one activation scale per token (false: one per tensor)")
    w_bits: int = option(4, "weight bits the rotation is trained for: those of the quantizer that follows (4 or 8)")
    w_group_size: int = option(128, "weights per block of that quantizer")
    w_symmetric: bool = option(True, "that quantizer is symmetric (false: zero points)")
    device: str = option("auto", "where the rotation trains: auto (a CUDA GPU when torch sees one, else the CPU), "
                                 "cpu, cuda or cuda:N; the rotated model is always returned on the CPU")
    training_args: dict[str, Any] = option(
        {}, "max_steps (100), learning_rate (0.05: the rotation angle of a step, decaying linearly to 0), "
            "per_device_train_batch_size (4 windows per step); other TrainingArguments keys are ignored, named in "
            "a warning")

    def validate(self) -> None:
        if self.rotate_mode not in (*MODES, IDENTITY):
            raise OptionError(f"spinquant: rotate_mode must be one of {', '.join((*MODES, IDENTITY))}, got "
                              f"{self.rotate_mode!r}")
        if self.seed < 0:
            raise OptionError(f"spinquant: seed must be >= 0, got {self.seed}")
        if self.a_bits not in (4, 8, 16):
            raise OptionError(f"spinquant: a_bits must be 4, 8 or 16, got {self.a_bits}")
        if self.w_bits not in (2, 4, 8):
            raise OptionError(f"spinquant: w_bits must be 2, 4 or 8, got {self.w_bits}")
        if self.w_group_size < 16 or self.w_group_size & (self.w_group_size - 1):
            raise OptionError(f"spinquant: w_group_size must be a power of two >= 16, got {self.w_group_size}")
        if not (self.device in ("auto", "cpu", "cuda") or _CUDA_INDEX.fullmatch(str(self.device))):
            raise OptionError(f"spinquant: device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not isinstance(self.training_args, dict):
            raise OptionError("spinquant: training_args must be a mapping")
        args = self.training()
        if not isinstance(args["max_steps"], int) or args["max_steps"] < 0:
            raise OptionError(f"spinquant: training_args.max_steps must be a whole number >= 0, got "
                              f"{args['max_steps']!r}")
        rate = args["learning_rate"]
        if not isinstance(rate, int | float) or not 0 < rate <= 1:
            raise OptionError(f"spinquant: training_args.learning_rate must be in (0, 1] (radians per step), "
                              f"got {rate!r}")
        size = args["per_device_train_batch_size"]
        if not isinstance(size, int) or size < 1:
            raise OptionError(f"spinquant: training_args.per_device_train_batch_size must be >= 1, got {size!r}")

    def training(self) -> dict[str, Any]:
        return {**TRAINING_DEFAULTS, **{k: v for k, v in self.training_args.items() if k in TRAINING_DEFAULTS}}


def training_device(name: str) -> torch.device:
    """The torch device ``device`` names (``auto``: the first CUDA GPU when torch sees one, else the CPU); a
    GPU asked for that torch cannot use is an OptionError saying why."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device visible to torch"
        raise OptionError(f"spinquant: device {name} asked for, but torch cannot use a CUDA GPU here ({build}); "
                          "use device: cpu (or auto, which takes a GPU only when there is one)")
    index = int(name.split(":")[1]) if ":" in name else 0
    if index >= torch.cuda.device_count():
        raise OptionError(f"spinquant: device {name} asked for, but torch sees {torch.cuda.device_count()} CUDA "
                          "device(s); use cuda:0 .. cuda:N-1, or auto")
    return torch.device("cuda", index)


def fake_quant(x: torch.Tensor, bits: int, group: int | None, symmetric: bool) -> torch.Tensor:
    """``x`` quantized and dequantized along its last dimension (blocks of ``group``; None: the whole row) on
    bitpress's RTN grid, with a straight-through gradient for the rounding (scales get their own gradients).

    Symmetric: ``scale = -m / 2**(bits-1)`` with ``m`` the block's value of largest magnitude (it lands on the
    lowest level); asymmetric: the range widened to include 0, ``scale = (max - min) / (2**bits - 1)``, an
    integer zero point."""
    import torch

    shape = x.shape
    k = shape[-1]
    g = k if group is None else group
    pad = (-k) % g
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    blocks = x.reshape(*x.shape[:-1], -1, g)
    top = 2**bits - 1
    if symmetric:
        mid = 2 ** (bits - 1)
        peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        scale = -peak / mid
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = torch.full_like(scale, float(mid))
    else:
        lo = blocks.amin(-1, keepdim=True).clamp_max(0)
        hi = blocks.amax(-1, keepdim=True).clamp_min(0)
        scale = (hi - lo) / top
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = (-lo / scale).round().detach()
    q = blocks / scale + zero
    q = (q + (q.round() - q).detach()).clamp(0, top)
    out = ((q - zero) * scale).reshape(*x.shape)
    return out[..., :k] if pad else out


def cayley_step(x: torch.Tensor, grad: torch.Tensor, rate: float) -> float:
    """One Cayley SGD step of the orthogonal matrix ``x`` (in place) against ``grad``, turning it by ``rate``
    (Frobenius norm of the generator); returns the generator's norm before scaling (0: no step)."""
    import torch

    a = grad @ x.T - x @ grad.T
    norm = float(a.norm())
    if norm == 0.0 or rate == 0.0:
        return norm
    a = a * (rate / norm)
    eye = torch.eye(x.shape[0], dtype=x.dtype, device=x.device)
    x.copy_(torch.linalg.solve(eye + a / 2, (eye - a / 2) @ x))
    return norm


def _orthonormal(x: torch.Tensor) -> torch.Tensor:
    """The orthogonal matrix nearest ``x`` (polar factor, float64)."""
    import torch

    u, _, vh = torch.linalg.svd(x.to(torch.float64))
    return u @ vh


@dataclass
class Training:
    """What training the rotation did."""

    steps: int
    windows: int
    first_loss: float
    last_loss: float
    seconds: float

    def summary(self) -> str:
        return (f"{self.steps} Cayley steps on {self.windows} windows in {self.seconds:.0f} s: KL to the float model "
                f"(quantized as trained for, on {min(self.windows, EVAL_WINDOWS)} windows) {self.first_loss:.4f} -> "
                f"{self.last_loss:.4f}")


class _ActivationQuant:
    """Forward pre-hooks fake-quantizing the inputs of a decoder's linear layers while :attr:`on`."""

    def __init__(self, lay: Layout, bits: int, symmetric: bool, per_token: bool) -> None:
        self.bits, self.symmetric, self.per_token = bits, symmetric, per_token
        self.on = False
        self.handles = []
        if bits >= 16:
            return
        for layer in lay.layers:
            for part, block in (("attn", layer.self_attn), ("mlp", layer.mlp)):
                for name in (*READERS[part], WRITERS[part]):
                    self.handles.append(getattr(block, name).register_forward_pre_hook(self._hook))

    def _hook(self, _module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not self.on:
            return None
        x = args[0]
        if self.per_token:
            q = fake_quant(x, self.bits, None, self.symmetric)
        else:
            q = fake_quant(x.reshape(1, -1), self.bits, None, self.symmetric).reshape(x.shape)
        return (q, *args[1:])

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def train_rotation(model: nn.Module, lay: Layout, g: torch.Tensor, windows: list[tuple[torch.Tensor, Any]],
                   opts: SpinQuantOptions, progress: Any = None) -> tuple[torch.Tensor, list[torch.Tensor], Training]:
    """Learn R1 and the R2s on the folded float32 ``model`` (a tied head carries the product ``diag(g)``
    already), on the device the model's parameters are on; returns them (float64, orthonormal, on the CPU)
    and what the training did."""
    import torch
    from torch.func import functional_call

    from bitpress.plugin import ONLINE_BUFFER as BUFFER

    args = opts.training()
    steps, rate0, size = int(args["max_steps"]), float(args["learning_rate"]), int(args["per_device_train_batch_size"])
    rng = np.random.default_rng(opts.seed)
    device = lay.embed.weight.device
    r1 = torch.from_numpy(start(lay.hidden, opts.rotate_mode, rng)).float().to(device)
    r2s = [torch.from_numpy(start(lay.head_dim, opts.rotate_mode, rng)).float().to(device) for _ in lay.layers] \
        if opts.rotate_heads else None
    quantized = {lay.names[id(getattr(b, n).weight)] for layer in lay.layers
                 for part, b in (("attn", layer.self_attn), ("mlp", layer.mlp))
                 for n in (*READERS[part], WRITERS[part])}
    g32 = g.to(device=device, dtype=torch.float32)
    product = f"{lay.head_name}.{BUFFER}"
    ids = torch.cat([w for w, _ in windows]).to(device)
    masks = torch.cat([m if m is not None else torch.ones_like(w) for w, m in windows]).to(device)
    requires = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    hooks = _ActivationQuant(lay, opts.a_bits, opts.a_symmetric, opts.a_per_token)
    t0 = time.perf_counter()

    def loss_of(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """KL(float || rotated and fake-quantized), mean over the valid tokens of ``x``."""
        hooks.on = False
        with torch.no_grad():  # the folded float model: the original function
            teacher = torch.log_softmax(model(input_ids=x, attention_mask=mask).logits.float(), -1)
        hooks.on = True
        params = rotated(lay, r1, r2s, lambda p: p.detach().float())
        for name in quantized:
            params[name] = fake_quant(params[name], opts.w_bits, opts.w_group_size, opts.w_symmetric)
        if lay.tied:
            params[product] = head_product(r1, g32)
        student = torch.log_softmax(functional_call(model, params, (), {"input_ids": x, "attention_mask": mask})
                                    .logits.float(), -1)
        hooks.on = False
        kl = (teacher.exp() * (teacher - student)).sum(-1)
        weight = mask.float()
        return (kl * weight).sum() / weight.sum().clamp_min(1.0)

    def measure() -> float:
        """The loss on a fixed set of windows (the first ``EVAL_WINDOWS``), for the report."""
        with torch.no_grad():
            return float(loss_of(ids[:EVAL_WINDOWS], masks[:EVAL_WINDOWS]))

    try:
        first = measure()
        for step in range(steps):
            rows = [(step * size + i) % len(ids) for i in range(size)]
            r1.requires_grad_(True)
            for r in r2s or []:
                r.requires_grad_(True)
            loss = loss_of(ids[rows], masks[rows])
            loss.backward()
            rate = rate0 * (1.0 - step / max(steps, 1))
            with torch.no_grad():
                for m in [r1, *(r2s or [])]:
                    grad = m.grad
                    m.requires_grad_(False)
                    m.grad = None
                    cayley_step(m, grad, rate)
            if progress is not None:
                progress()
            log.debug("spinquant step %d: KL %.5f", step, float(loss.detach()))
        last = measure()
    finally:
        hooks.close()
        for p in model.parameters():
            p.requires_grad_(requires.get(id(p), False))
    r1_out = _orthonormal(r1.detach()).cpu()
    r2_out = [_orthonormal(r.detach()).cpu() for r in r2s] if r2s is not None else None
    return r1_out, r2_out, Training(steps, len(ids), first, last, time.perf_counter() - t0)


class SpinQuantHfPass(Pass):
    """SpinQuant: QuaRot's rotation of a Hugging Face decoder with R1 / R2 trained (Cayley SGD) for the quantizer
    that follows."""

    name = "spinquant_hf"
    aliases = ("SpinQuant",)
    algorithms = ("spinquant",)
    precisions = ()
    model_kinds = ("hf",)
    needs_data = False  # the model's own text when none is given
    summary = ("rotate a Hugging Face decoder with rotations trained for the quantizer after it (SpinQuant, "
               "Cayley SGD); same float outputs, then gptq_hf / rtn_hf / kquant_hf")
    Options: ClassVar[type] = SpinQuantOptions
    requires: ClassVar[tuple[str, ...]] = HF_REQUIRES
    install_hint: ClassVar[str | None] = HF_HINT

    def run(self, model: Any, context: PassContext) -> Any:
        import torch

        from bitpress.plugin import GENERATED, DataConfig, HfModel, calibration_batches
        from bitpress.plugin import attach_online as attach
        from bitpress.plugin import detach_online as detach

        if not isinstance(model, HfModel):
            raise UsageError(f"{self.name} rotates Hugging Face models, got a {model.kind} model")
        opts = self.options
        ignored = sorted(set(opts.training_args) - set(TRAINING_DEFAULTS))
        if ignored:
            log.warning("%s: training_args %s ignored (read: %s)", self.name, ", ".join(ignored),
                        ", ".join(TRAINING_DEFAULTS))
        device = training_device(opts.device)  # a GPU that cannot be used is refused before the model is read
        where = model.source.name
        torch_model = model.torch_model()
        check_hadamard(self.name, torch_model, opts, where)
        try:
            lay = layout(torch_model)
        except RotationError as exc:
            raise UsageError(f"{self.name}: cannot rotate {where}: {exc}") from None
        if context.data is None:
            data = DataConfig(source=GENERATED, samples=DEFAULT_SAMPLES)
            log.info("%s: no calibration data given: training on %d windows of the model's own text", self.name,
                     DEFAULT_SAMPLES)
        else:
            data = DataConfig.from_value(context.data).with_own_text(self.name)
        vocab = int(lay.embed.num_embeddings)
        torch_model.eval()
        batches = calibration_batches(data, model.source, vocab, torch_model)
        windows = [(b.input_ids, b.attention_mask) for b in batches]
        # train on a float32 copy when the model is in another dtype (the rotation is applied to the model itself)
        trainee = torch_model if all(p.dtype == torch.float32 for p in torch_model.parameters()) \
            else copy.deepcopy(torch_model).float()
        train_lay = lay if trainee is torch_model else layout(trainee)
        g = fold_norms(trainee, train_lay)
        if train_lay.tied:
            attach(trainee, train_lay.head_name, torch.diag(g).to(torch.float32))
        if device.type != "cpu":
            log.info("%s: training the rotation on %s (%s)", self.name, device, torch.cuda.get_device_name(device))
        try:
            trainee.to(device)
            with context.step(int(opts.training()["max_steps"]), "training the rotation") as advance:
                r1, r2s, training = train_rotation(trainee, train_lay, g, windows, opts, progress=advance)
        finally:
            trainee.to("cpu")
        if trainee is not torch_model:
            del trainee
            g = fold_norms(torch_model, lay)
        elif train_lay.tied:  # the training's product gives way to the learned one
            detach(torch_model, lay.head_name)
        result: HfRotation = apply_rotation(torch_model, lay, g, r1, r2s)
        model.history.append({"pass": self.name, "options": asdict(opts), "float": True})
        log.info("%s: %s: %s; %s", self.name, where, training.summary(), result.summary())
        return model
