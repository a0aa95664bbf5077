"""The quantized tensor that replaces a parameter's float storage, and its byte layout.

A quantized parameter keeps its module and its name: ``module.weight`` becomes a
:class:`QuantTensor`, a ``torch.Tensor`` subclass with the parameter's shape and dtype that holds
only the integers, scales and zero points. Any operation on it (``F.linear``, ``F.embedding``,
indexing a fused-experts tensor) sees the dequantized float tensor, so modules run unchanged.

Layout (the same on disk, see :mod:`bitpress.hf.checkpoint`), for a weight of shape
``[..., K]`` flattened to ``rows = prod(shape[:-1])`` rows of ``K`` quantized along K in blocks
of ``group_size`` (K padded with zeros to ``n_blocks * group_size``):

* ``qweight``: uint8 ``[rows, n_blocks, group_size * bits / 8]``, ``8 / bits`` values per byte,
  the lower K index in the lower bits (ONNX Runtime's ``MatMulNBits`` ``B`` layout at 4 and 8 bits);
* ``scales``: float32 ``[rows, n_blocks]``;
* ``qzeros``: ``None`` when symmetric (the implied zero point is ``2**(bits-1)``), else uint8
  ``[rows, n_blocks]`` (one integer zero point per byte, unpacked) or float32 ``[rows, n_blocks]``
  (float offsets, 4-bit linear weights only: what ``MatMulNBits`` accepts).

``w ~= (q - zero_point) * scale``, the convention of :mod:`bitpress.quant.solver`.

Transposed fused experts (``QuantSpec.transposed``; gpt-oss's ``[E, K, OUT]`` tensors, which the
forward multiplies as ``x @ w[e]``): the parameter keeps its stored shape ``[..., K, OUT]``, but the
integers are those of its transpose ``[..., OUT, K]`` (:attr:`QuantSpec.quant_shape`), one row per
output channel blocked along the input axis K; :meth:`QuantTensor.dequantize` transposes back to
the stored layout, so the module runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map

from bitpress.quant.solver import QuantizedBlocks

_aten = torch.ops.aten

#: dtype names as written in ``quantization_config`` (torch dtypes have no stable JSON form)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported parameter dtype {dtype}")


@dataclass(frozen=True)
class QuantSpec:
    """How one parameter is quantized; everything needed to read its tensors back."""

    bits: int
    group_size: int
    symmetric: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    zero_points: str  # "none" | "uint8" | "float"
    #: the integers are the transpose's (last two axes of ``shape`` swapped): rows along the middle axis
    transposed: bool = False

    @property
    def quant_shape(self) -> tuple[int, ...]:
        """The shape the integers are laid out in: ``[..., rows, K]`` (``shape``, or its transpose)."""
        if not self.transposed:
            return self.shape
        return (*self.shape[:-2], self.shape[-1], self.shape[-2])

    @property
    def k(self) -> int:
        return self.quant_shape[-1]

    @property
    def rows(self) -> int:
        return int(np.prod(self.quant_shape[:-1], dtype=np.int64))

    @property
    def n_blocks(self) -> int:
        return -(-self.k // self.group_size)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric,
            "shape": list(self.shape), "dtype": dtype_name(self.dtype), "zero_points": self.zero_points,
        }
        if self.transposed:  # only then: checkpoints without it read as before
            out["transposed"] = True
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> QuantSpec:
        transposed = d.get("transposed", False)
        if not isinstance(transposed, bool):
            raise ValueError(f"transposed must be true or false, not {transposed!r}")
        shape = tuple(int(s) for s in d["shape"])
        if transposed and len(shape) < 2:
            raise ValueError(f"a transposed weight needs at least 2 axes, not shape {list(shape)}")
        return cls(
            bits=int(d["bits"]), group_size=int(d["group_size"]), symmetric=bool(d["symmetric"]),
            shape=shape, dtype=DTYPES[d["dtype"]], zero_points=str(d["zero_points"]), transposed=transposed,
        )


# -- packing (numpy: the solvers' side) -------------------------------------------------------------
def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 ``[..., n]`` values below ``2**bits`` -> ``[..., n * bits / 8]`` bytes, low bits first."""
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8)
    per = 8 // bits
    if q.shape[-1] % per:
        raise ValueError(f"{q.shape[-1]} values do not fill whole bytes at {bits} bits")
    v = q.astype(np.uint8).reshape(*q.shape[:-1], q.shape[-1] // per, per)
    out = np.zeros(v.shape[:-1], np.uint8)
    for i in range(per):
        out |= (v[..., i] & ((1 << bits) - 1)) << (i * bits)
    return out


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`."""
    if bits == 8:
        return np.asarray(packed, dtype=np.uint8)
    per = 8 // bits
    p = np.asarray(packed, dtype=np.uint8)
    parts = [(p >> (i * bits)) & ((1 << bits) - 1) for i in range(per)]
    return np.stack(parts, axis=-1).reshape(*p.shape[:-1], p.shape[-1] * per)


def _unpack_torch(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    v = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return v.reshape(*packed.shape[:-1], packed.shape[-1] * per)


# -- the tensor ------------------------------------------------------------------------------------
class QuantTensor(torch.Tensor):
    """A parameter's quantized storage; reads as its dequantized float tensor in every operation."""

    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor | None
    spec: QuantSpec

    @staticmethod
    def __new__(cls, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                spec: QuantSpec) -> QuantTensor:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, spec.shape, dtype=spec.dtype, device=qweight.device, requires_grad=False
        )

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                 spec: QuantSpec) -> None:
        blob = spec.group_size * spec.bits // 8
        if tuple(qweight.shape) != (spec.rows, spec.n_blocks, blob) or qweight.dtype != torch.uint8:
            raise ValueError(f"qweight must be uint8 {(spec.rows, spec.n_blocks, blob)}, got {qweight.dtype} "
                             f"{tuple(qweight.shape)}")
        if tuple(scales.shape) != (spec.rows, spec.n_blocks):
            raise ValueError(f"scales must be {(spec.rows, spec.n_blocks)}, got {tuple(scales.shape)}")
        if (qzeros is None) != (spec.zero_points == "none"):
            raise ValueError(f"zero points {spec.zero_points!r} do not match the tensors given")
        self.qweight = qweight
        self.scales = scales
        self.qzeros = qzeros
        self.spec = spec

    # -- conversions ---------------------------------------------------------------------------
    @classmethod
    def from_blocks(cls, blocks: QuantizedBlocks, spec: QuantSpec) -> QuantTensor:
        """From a solver's answer (``q`` unpacked ``[rows, n_blocks, group_size]``)."""
        qweight = torch.from_numpy(pack_bits(blocks.q, spec.bits))
        scales = torch.from_numpy(np.ascontiguousarray(blocks.scales, dtype=np.float32))
        zp = None if blocks.zero_points is None else torch.from_numpy(np.ascontiguousarray(blocks.zero_points))
        return cls(qweight, scales, zp, spec)

    def blocks(self) -> QuantizedBlocks:
        """The solver-form arrays: integers unpacked to one per byte (numpy, shared where possible)."""
        q = unpack_bits(self.qweight.numpy(), self.spec.bits)
        zp = None if self.qzeros is None else self.qzeros.numpy()
        return QuantizedBlocks(q=q, scales=self.scales.numpy(), zero_points=zp)

    def dequantize(self) -> torch.Tensor:
        """The float tensor (the parameter's shape and dtype) that the integers encode."""
        s = self.spec
        q = _unpack_torch(self.qweight, s.bits).to(torch.float32)
        if self.qzeros is None:
            zp = torch.full_like(self.scales, float(2 ** (s.bits - 1)))
        else:
            zp = self.qzeros.to(torch.float32)
        w = (q - zp.unsqueeze(-1)) * self.scales.unsqueeze(-1)
        w = w.reshape(s.rows, s.n_blocks * s.group_size)[:, : s.k].reshape(s.quant_shape)
        if s.transposed:  # back to the stored [..., K, OUT] the module multiplies by
            w = w.transpose(-1, -2).contiguous()
        return w.to(s.dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        s = self.spec
        return (f"QuantTensor(shape={list(s.shape)}, bits={s.bits}, group_size={s.group_size}, "
                f"symmetric={s.symmetric}, zero_points={s.zero_points}{', transposed' if s.transposed else ''})")

    # Only dispatch-level handling: metadata (shape, dtype, device) comes from the wrapper.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # detach/alias keep the quantized form: nn.Parameter() and state_dict() go through them
        if func in (_aten.detach.default, _aten.alias.default):
            t = args[0]
            return QuantTensor(t.qweight, t.scales, t.qzeros, t.spec)
        if func is _aten.clone.default:
            t = args[0]
            zp = None if t.qzeros is None else t.qzeros.clone()
            return QuantTensor(t.qweight.clone(), t.scales.clone(), zp, t.spec)
        if func is _aten.copy_.default and isinstance(args[0], QuantTensor):
            # writing floats into integers would silently do nothing: refuse
            raise RuntimeError("cannot copy into a quantized parameter; replace the parameter instead")

        def unwrap(x: Any) -> Any:
            return x.dequantize() if isinstance(x, QuantTensor) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def is_quantized(t: Any) -> bool:
    return isinstance(t, QuantTensor)
