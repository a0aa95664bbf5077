"""The CPU's int8 features, and what they mean for int8 quantization (``reduce_range``).

ONNX Runtime's u8 x s8 int8 kernels (``MatMulInteger``, ``QLinearMatMul``, ``QGemm``, the QDQ
fusions of static int8, ``DynamicQuantizeMatMul``) pick their instructions by CPU: with AVX-512
VNNI, AVX-VNNI or AMX-INT8 (``vpdpbusd`` / ``tdpbusd``) products are accumulated in int32;
without them, on AVX2 and AVX-512 (BW) CPUs, ``vpmaddubsw`` adds each *pair* of u8 x s8 products
into an int16 **with saturation**: 255 x 127 x 2 = 64770 does not fit, and full 8-bit weights
lose accuracy. 7-bit weights (``reduce_range=True``, ONNX Runtime's advice for such CPUs) keep
every pair below 2^15. x86 CPUs with neither (SSE4 only) take a widening kernel that does not
saturate (measured under ``qemu-x86_64 -cpu Nehalem``). Arm's dot-product instructions
(``asimddp`` / ``sdot``, ``i8mm``) accumulate in int32 as VNNI does; the saturation is an x86
AVX2 / AVX-512 matter.

The flags are read from ``/proc/cpuinfo`` on Linux, elsewhere from numpy's (CPUID-based)
feature table, then py-cpuinfo when installed; ``BITPRESS_CPU_FLAGS`` (a flags string, as in
``/proc/cpuinfo``: ``"avx2 fma"``, ``"avx2 avx512_vnni"``, ``"asimd asimddp"``) replaces the
detected flags, for tests and for quantizing on one machine for another CPU class.

Under user-mode emulation (``qemu-x86_64 -cpu Haswell``) ``/proc/cpuinfo`` is the host's, while
ONNX Runtime sees the emulated CPU through CPUID: set ``BITPRESS_CPU_FLAGS`` there.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

#: replaces the detected flags (whitespace- or comma-separated, case-insensitive)
FLAGS_VAR = "BITPRESS_CPU_FLAGS"

#: x86 flags (``/proc/cpuinfo`` names) of int8 dot products that accumulate in int32
X86_INT8_DOT = ("avx512_vnni", "avx_vnni", "amx_int8", "avx512vnni", "avxvnni")  # the last two: py-cpuinfo
#: Arm flags of int8 dot products (``sdot``/``udot``, ``smmla``): no int16 intermediate
ARM_INT8_DOT = ("asimddp", "dotprod", "i8mm")

#: x86 flags of the SIMD levels whose u8 x s8 kernels use ``vpmaddubsw``
X86_PAIR_SATURATING = ("avx2", "avx512bw")
_X86_MARKERS = frozenset({"sse", "sse2", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "fma", "avx512f", "avx512bw"})
_ARM_MARKERS = frozenset({"asimd", "neon", "fp", "asimdhp", "sve", "asimddp", "i8mm", "dotprod"})
_X86_MACHINES = frozenset({"x86_64", "amd64", "x64", "i386", "i486", "i586", "i686", "x86"})
_ARM_MACHINES = frozenset({"aarch64", "arm64", "armv8l", "armv8", "armv7l", "arm"})

#: numpy's feature names (``__cpu_features__``) that differ from Linux's
_NUMPY_NAMES = {
    "AVX512VNNI": "avx512_vnni", "AVX512VBMI2": "avx512_vbmi2", "AVX512BITALG": "avx512_bitalg",
    "AVX512VPOPCNTDQ": "avx512_vpopcntdq", "AVX512BF16": "avx512_bf16", "AVX512FP16": "avx512_fp16",
    "SSE41": "sse4_1", "SSE42": "sse4_2", "FMA3": "fma", "ASIMDDP": "asimddp", "ASIMDHP": "asimdhp",
    "ASIMDFHM": "asimdfhm", "NEON": "neon",
}


@dataclass(frozen=True)
class CpuFlags:
    """The CPU's architecture family (``x86``, ``arm`` or the machine name) and feature flags."""

    arch: str
    flags: frozenset[str]
    #: where the flags came from: ``/proc/cpuinfo``, ``BITPRESS_CPU_FLAGS``, ``numpy``, ``py-cpuinfo``, ``unknown``
    source: str

    @property
    def known(self) -> bool:
        return bool(self.flags)

    def int8_dot(self) -> list[str]:
        """The int8 dot-product features present (VNNI, AMX-INT8, Arm dot product / i8mm)."""
        wanted = X86_INT8_DOT if self.arch == "x86" else ARM_INT8_DOT if self.arch == "arm" else (
            *X86_INT8_DOT, *ARM_INT8_DOT)
        return [f for f in wanted if f in self.flags]


def parse_flags(text: str) -> frozenset[str]:
    """A flags string (whitespace- or comma-separated) as a set of lower-case names."""
    return frozenset(f for f in re.split(r"[\s,]+", text.strip().lower()) if f)


def _family(machine: str, flags: frozenset[str] = frozenset()) -> str:
    """``x86`` or ``arm``: from the flags when they tell (an override may describe another CPU), else the machine."""
    if flags & _X86_MARKERS or flags & set(X86_INT8_DOT):
        return "x86"
    if flags & _ARM_MARKERS:
        return "arm"
    machine = machine.lower()
    if machine in _X86_MACHINES:
        return "x86"
    if machine in _ARM_MACHINES or machine.startswith(("arm", "aarch64")):
        return "arm"
    return machine or "unknown"


def _proc_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The first processor's ``flags`` (x86) or ``Features`` (Arm) line."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            return parse_flags(value)
    return None


def _numpy_flags() -> frozenset[str] | None:
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features  # numpy >= 2
    except ImportError:
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as features  # numpy 1.x
        except ImportError:
            return None
    names = {_NUMPY_NAMES.get(k, k.lower()) for k, v in features.items() if v}
    return frozenset(names) or None


def _py_cpuinfo_flags() -> frozenset[str] | None:
    try:
        import cpuinfo  # type: ignore[import-not-found]  # py-cpuinfo, optional
    except ImportError:
        return None
    try:
        flags = cpuinfo.get_cpu_info().get("flags") or []
    except Exception:  # it runs subprocesses and parses their output: never let it fail a run
        return None
    return frozenset(str(f).lower() for f in flags) or None


@functools.lru_cache(maxsize=1)
def _detected() -> tuple[frozenset[str], str]:
    import sys

    readers = [("/proc/cpuinfo", _proc_cpuinfo)] if sys.platform.startswith("linux") else []
    readers += [("numpy", _numpy_flags), ("py-cpuinfo", _py_cpuinfo_flags)]
    for source, read in readers:
        flags = read()
        if flags:
            return flags, source
    return frozenset(), "unknown"


def cpu_flags() -> CpuFlags:
    """This CPU's flags (or ``BITPRESS_CPU_FLAGS``, read at each call)."""
    override = os.environ.get(FLAGS_VAR)
    if override is not None and override.strip():
        flags, source = parse_flags(override), FLAGS_VAR
    else:
        flags, source = _detected()
    return CpuFlags(_family(platform.machine(), flags), flags, source)


def has_vnni(cpu: CpuFlags | None = None) -> bool:
    """An x86 CPU with AVX-512 VNNI, AVX-VNNI or AMX-INT8."""
    cpu = cpu or cpu_flags()
    return cpu.arch == "x86" and bool(cpu.int8_dot())


def has_int8_dot(cpu: CpuFlags | None = None) -> bool:
    """Int8 dot products accumulated in int32: x86 VNNI / AMX-INT8, or Arm ``asimddp`` / ``i8mm``."""
    return bool((cpu or cpu_flags()).int8_dot())


def int8_saturates(cpu: CpuFlags | None = None) -> bool:
    """Whether ONNX Runtime's u8 x s8 kernels saturate int16 pair sums here: x86 AVX2 / AVX-512 without VNNI.

    Unknown flags on x86 count as saturating (the safe assumption).
    """
    cpu = cpu or cpu_flags()
    if cpu.arch != "x86" or cpu.int8_dot():
        return False
    return not cpu.known or any(f in cpu.flags for f in X86_PAIR_SATURATING)


class ReduceRange(NamedTuple):
    """A resolved ``reduce_range``: the value and why; a pass report (``summary()``)."""

    value: bool
    reason: str

    def summary(self) -> str:
        return f"reduce_range={'true' if self.value else 'false'} ({self.reason})"


def resolve_reduce_range(value: Literal["auto"] | bool, cpu: CpuFlags | None = None) -> ReduceRange:
    """``(reduce_range, reason)`` for an option value: ``True``/``False`` as given, ``"auto"`` by CPU.

    ``auto`` is ``True`` (7-bit weights) on x86 AVX2 / AVX-512 CPUs without VNNI, where 8-bit
    u8 x s8 products saturate in int16, and ``False`` where VNNI / AMX-INT8 or an Arm dot product
    exists, on x86 CPUs without AVX2 (SSE kernels widen, no saturation), and on other
    architectures. The reason names the feature that decided it.
    """
    if isinstance(value, bool):
        return ReduceRange(value, "set explicitly")
    if value != "auto":
        raise ValueError(f"reduce_range must be 'auto', true or false, got {value!r}")
    cpu = cpu or cpu_flags()
    where = "" if cpu.source == "/proc/cpuinfo" else f", flags from {cpu.source}"
    dot = cpu.int8_dot()
    if dot:
        return ReduceRange(False, f"auto: the CPU has {dot[0]} (int8 dot products accumulate in int32{where})")
    if cpu.arch == "x86":
        if not cpu.known:
            return ReduceRange(True, "auto: x86 CPU whose flags are unknown, assumed without VNNI (int16 saturation "
                                     f"risk; set {FLAGS_VAR} to decide)")
        simd = [f for f in X86_PAIR_SATURATING if f in cpu.flags]
        if not simd:
            return ReduceRange(False, "auto: x86 CPU without avx2/avx512bw: ONNX Runtime's SSE int8 kernels do not "
                                      f"saturate{where}")
        return ReduceRange(True, f"auto: x86 CPU with {simd[-1]} but without avx512_vnni/avx_vnni/amx_int8: ONNX "
                                 f"Runtime's u8s8 kernels (VPMADDUBSW) saturate int16 pair sums with 8-bit "
                                 f"weights{where}")
    return ReduceRange(False, f"auto: {cpu.arch} CPU: no x86 VPMADDUBSW int16 saturation{where}")


__all__ = [
    "FLAGS_VAR",
    "CpuFlags",
    "ReduceRange",
    "cpu_flags",
    "has_int8_dot",
    "has_vnni",
    "int8_saturates",
    "parse_flags",
    "resolve_reduce_range",
]
