"""A GGUF model as bitpress sees it: its tensors, their types, and the exact ONNX form of each."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bitpress.plugin import ModelHandle
from bitpress_gguf.codec import FLOAT_TYPES, TYPES, decode
from bitpress_gguf.reader import GgufFile, TensorInfo

log = logging.getLogger(__name__)

#: rows decoded at a time when counting degenerate blocks (bounded memory)
ROW_CHUNK = 4096


@dataclass
class TypeSummary:
    type_name: str
    tensors: int = 0
    elements: int = 0
    n_bytes: int = 0
    degenerate: int = 0  # sub-blocks with a zero scale and a minimum (written exactly, counted)

    @property
    def onnx_form(self) -> str:
        if self.type_name in TYPES:
            t = TYPES[self.type_name]
            zp = ("float minimum: uint8 zero points + block-sum correction" if t.float_zero
                  else "integer zero points")
            bits = t.bits if t.bits in (4, 8) else 4  # Q2_K's 2-bit integers are held in 4 bits
            return f"MatMulNBits {bits}-bit block {t.block}, {zp}"
        if self.type_name in FLOAT_TYPES:
            return "float (kept as is)"
        return "no exact ONNX form (not converted)"

    @property
    def exact(self) -> bool:
        return self.type_name in TYPES or self.type_name in FLOAT_TYPES


class GgufModel(ModelHandle):
    """A ``.gguf`` file, memory-mapped; nothing is decoded until asked."""

    kind: ClassVar[str] = "gguf"

    def __init__(self, source: Path, file: GgufFile) -> None:
        super().__init__(source)
        self.file = file

    @classmethod
    def load(cls, source: Path) -> GgufModel:
        return cls(Path(source), GgufFile(Path(source)))

    def describe(self) -> str:
        return f"GGUF model {self.source} ({self.file.architecture}, {len(self.file.tensors)} tensors)"

    def summary(self, *, count_degenerate: bool = True) -> dict[str, TypeSummary]:
        """Per type: tensors, elements, bytes and (decoding every block, by row chunks) degenerate blocks."""
        out: dict[str, TypeSummary] = {}
        for t in self.file.tensors.values():
            s = out.setdefault(t.type_name, TypeSummary(t.type_name))
            s.tensors += 1
            s.elements += _elements(t)
            s.n_bytes += t.n_bytes
            if count_degenerate and t.type_name in TYPES and TYPES[t.type_name].float_zero:
                s.degenerate += degenerate_blocks(self.file, t)
        return out

    def inspect(self) -> dict[str, Any]:
        """``bitpress inspect model.gguf``: quant types per tensor, bits per weight, what maps exactly."""
        f = self.file
        types = self.summary()
        quantized = [s for s in types.values() if s.type_name in TYPES]
        q_elems = sum(s.elements for s in quantized)
        q_bytes = sum(s.n_bytes for s in quantized)
        kinds = Counter(_role(name) for name in f.tensors)
        per_role: dict[str, Counter[str]] = {}
        for t in f.tensors.values():
            per_role.setdefault(_role(t.name), Counter())[t.type_name] += 1
        tied = "output.weight" not in f.tensors and "token_embd.weight" in f.tensors
        table = f.tensors.get("token_embd.weight")
        table_note = ""
        if table is not None and table.type_name in TYPES:
            t = TYPES[table.type_name]
            table_note = (f" ({table.type_name}: GatherBlockQuantized {t.bits}-bit block {t.block})" if t.gatherable
                          else f" ({table.type_name}: float zero points, which GatherBlockQuantized cannot hold)")
        not_exact = sorted(s.type_name for s in types.values() if not s.exact)
        lines = [
            f"architecture {f.architecture}, {len(f.tensors)} tensors, {f.size / 1e6:.1f} MB, "
            f"GGUF v{f.field('GGUF.version')}",
            f"quantized weights: {q_elems:,} at {8 * q_bytes / max(q_elems, 1):.2f} bits per weight",
            "embedding / LM head: " + ("one table (token_embd, tied)" if tied else "separate (output.weight)")
            + table_note,
        ]
        for s in sorted(types.values(), key=lambda s: -s.n_bytes):
            bpw = 8 * s.n_bytes / max(s.elements, 1)
            extra = f", {s.degenerate} zero-scale blocks written exactly" if s.degenerate else ""
            lines.append(f"  {s.type_name:<6} {s.tensors:>4} tensors {s.n_bytes / 1e6:9.1f} MB {bpw:5.2f} bpw -> "
                         f"{s.onnx_form}{extra}")
        for role in sorted(per_role):
            lines.append(f"  {role}: " + ", ".join(f"{k} x{v}" for k, v in sorted(per_role[role].items())))
        if not_exact:
            lines.append(f"  not convertible exactly: {', '.join(not_exact)}")
        return {
            "model": str(self.source), "kind": self.kind, "architecture": f.architecture,
            "tensors": len(f.tensors), "bytes": f.size, "tied_embedding": tied,
            "bits_per_weight": 8 * q_bytes / q_elems if q_elems else None,
            "types": {k: {"tensors": s.tensors, "elements": s.elements, "bytes": s.n_bytes,
                          "onnx": s.onnx_form, "exact": s.exact, "degenerate_blocks": s.degenerate}
                      for k, s in types.items()},
            "roles": {k: dict(v) for k, v in per_role.items()}, "role_counts": dict(kinds),
            "lines": lines,
        }


def _elements(t: TensorInfo) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n


def _role(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``attn_q.weight``; others as they are."""
    parts = name.split(".")
    return ".".join(parts[2:]) if parts[0] == "blk" and len(parts) > 2 else name


def degenerate_blocks(file: GgufFile, t: TensorInfo) -> int:
    """Sub-blocks of ``t`` with a zero scale and a non-zero minimum (decoded by row chunks)."""
    info = TYPES[t.type_name]
    rows = t.shape[0] if len(t.shape) > 1 else 1
    count = 0
    for start in range(0, rows, ROW_CHUNK):
        raw = file.raw(t.name, slice(start, min(rows, start + ROW_CHUNK)))
        count += decode(info.name, raw.reshape(-1, info.nbytes)).degenerate
    return count
