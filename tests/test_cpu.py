"""bitpress.cpu: CPU flags, int8 dot-product detection, and ``reduce_range=auto``."""

from __future__ import annotations

from pathlib import Path

import pytest

from bitpress import cpu
from bitpress.cpu import FLAGS_VAR, CpuFlags, ReduceRange, cpu_flags, resolve_reduce_range

# flags as /proc/cpuinfo writes them (trimmed)
HASWELL = "fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt avx f16c bmi1 avx2 bmi2"
SKYLAKE_SP = HASWELL + " avx512f avx512dq avx512cd avx512bw avx512vl"  # AVX-512 without VNNI
ICELAKE = SKYLAKE_SP + " avx512vbmi avx512_vbmi2 gfni vaes avx512_vnni avx512_bitalg"
ALDERLAKE = HASWELL + " avx_vnni"  # AVX-VNNI (VEX), no AVX-512
SAPPHIRE = ICELAKE + " amx_bf16 amx_tile amx_int8"
NEHALEM = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt"  # SSE only: a widening kernel, no saturation
GRAVITON2 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
CORTEX_A53 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid"  # Armv8.0: no dot product


def _flags(text: str) -> CpuFlags:
    flags = cpu.parse_flags(text)
    return CpuFlags(cpu._family("", flags), flags, FLAGS_VAR)


@pytest.mark.parametrize(("flags", "arch", "dot", "saturates", "reduce"), [
    (HASWELL, "x86", [], True, True),
    (SKYLAKE_SP, "x86", [], True, True),
    (ICELAKE, "x86", ["avx512_vnni"], False, False),
    (ALDERLAKE, "x86", ["avx_vnni"], False, False),
    (SAPPHIRE, "x86", ["avx512_vnni", "amx_int8"], False, False),
    (NEHALEM, "x86", [], False, False),
    (GRAVITON2, "arm", ["asimddp"], False, False),
    (CORTEX_A53, "arm", [], False, False),
    ("asimd i8mm", "arm", ["i8mm"], False, False),
])
def test_cpu_classes(flags: str, arch: str, dot: list[str], saturates: bool, reduce: bool) -> None:
    info = _flags(flags)
    assert info.arch == arch
    assert info.int8_dot() == dot
    assert cpu.has_int8_dot(info) is bool(dot)
    assert cpu.has_vnni(info) is (arch == "x86" and bool(dot))
    assert cpu.int8_saturates(info) is saturates
    value, reason = resolve_reduce_range("auto", info)
    assert value is reduce and reason.startswith("auto: ")
    if dot:
        assert dot[0] in reason
    elif saturates:
        assert "avx2" in reason or "avx512bw" in reason


def test_env_var_replaces_the_detected_flags(monkeypatch) -> None:
    monkeypatch.setenv(FLAGS_VAR, "SSE2, AVX2  fma")  # commas, spaces and case do not matter
    info = cpu_flags()
    assert info.flags == {"sse2", "avx2", "fma"} and info.source == FLAGS_VAR and info.arch == "x86"
    value, reason = resolve_reduce_range("auto")
    assert value is True and "avx2" in reason and FLAGS_VAR in reason  # the reason says where the flags came from
    monkeypatch.setenv(FLAGS_VAR, ICELAKE)
    assert resolve_reduce_range("auto").value is False and "avx512_vnni" in resolve_reduce_range("auto").reason
    monkeypatch.setenv(FLAGS_VAR, GRAVITON2)  # an Arm CPU, whatever this machine is
    assert cpu_flags().arch == "arm" and resolve_reduce_range("auto").value is False
    monkeypatch.setenv(FLAGS_VAR, "  ")  # blank: detection again
    assert cpu_flags().source != FLAGS_VAR


def test_explicit_values_win() -> None:
    for flags in (HASWELL, ICELAKE, GRAVITON2):
        for value in (True, False):
            assert resolve_reduce_range(value, _flags(flags)) == (value, "set explicitly")
    with pytest.raises(ValueError, match="'auto', true or false"):
        resolve_reduce_range("sometimes")  # type: ignore[arg-type]


def test_unknown_flags() -> None:
    x86 = CpuFlags("x86", frozenset(), "unknown")
    assert resolve_reduce_range("auto", x86).value is True  # no VNNI can be assumed: the safe choice
    assert cpu.int8_saturates(x86) and not cpu.has_int8_dot(x86)
    other = CpuFlags("riscv64", frozenset(), "unknown")
    assert resolve_reduce_range("auto", other).value is False


def test_report_summary() -> None:
    choice = resolve_reduce_range("auto", _flags(HASWELL))
    assert isinstance(choice, ReduceRange) and isinstance(choice, tuple)
    assert choice.summary().startswith("reduce_range=true (auto: x86 CPU with avx2 but without avx512_vnni")
    assert ReduceRange(False, "set explicitly").summary() == "reduce_range=false (set explicitly)"


def test_proc_cpuinfo_parsing(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text(f"processor\t: 0\nmodel name\t: Intel\nflags\t\t: {ICELAKE}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu._proc_cpuinfo(x86) == cpu.parse_flags(ICELAKE)  # the first processor's line
    arm = tmp_path / "arm"
    arm.write_text(f"processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: {GRAVITON2}\nCPU implementer\t: 0x41\n")
    assert "asimddp" in cpu._proc_cpuinfo(arm)
    assert cpu._proc_cpuinfo(tmp_path / "missing") is None


def test_detection_on_this_machine(monkeypatch) -> None:
    monkeypatch.delenv(FLAGS_VAR, raising=False)
    info = cpu_flags()
    assert info.source in ("/proc/cpuinfo", "numpy", "py-cpuinfo", "unknown")
    value, reason = resolve_reduce_range("auto")
    assert isinstance(value, bool) and reason.startswith("auto: ")
    numpy_flags = cpu._numpy_flags()  # CPUID through numpy: Linux-style names
    if numpy_flags and info.arch == "x86":
        assert {"sse2", "sse4_1"} <= numpy_flags
