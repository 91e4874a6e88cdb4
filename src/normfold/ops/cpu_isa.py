"""Which ISA path of the CPU kernels this machine can run (/proc/cpuinfo flags, else
`torch.backends.cpu.get_cpu_capability()`), the compiler flags of each path, the order in which a failed
build falls back, and what NORMFOLD_CPU_ISA asks for (cpu.py's module docstring has the whole story)."""

from __future__ import annotations

import os
import platform

import torch

# Compiler flags of each ISA path (see csrc/nf_simd.h) and the path to try when its build fails.
ISA_FLAGS = {
    "avx512": ["-march=native"],  # only chosen on CPUs with AVX-512 F/BW/VL; picks up AVX512_BF16
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "neon": [],  # NEON is baseline on aarch64
    "portable": ["-DNF_FORCE_GENERIC"],
}
ISA_FALLBACK = {"avx512": "avx2", "avx2": "portable", "neon": "portable", "portable": None}
ISA_ALIASES = {"generic": "portable", "vector": "portable", "x86-64-v3": "avx2", "x86-64-v4": "avx512"}
ISA_NAMES = {2: "avx512", 3: "avx2", 4: "neon", 1: "portable"}


def cpu_flags() -> frozenset:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def detect_isa() -> str:
    """The best ISA path this CPU can run."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "neon"
    if machine not in ("x86_64", "amd64", "x64"):
        return "portable"
    flags = cpu_flags()
    if not flags:  # no /proc/cpuinfo: ask torch (its capability includes the OS's AVX state)
        try:
            cap = torch.backends.cpu.get_cpu_capability().upper()
        except (AttributeError, RuntimeError):
            cap = ""
        return "avx512" if cap.startswith("AVX512") else "avx2" if cap == "AVX2" else "portable"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "portable"


def chain(isa: str) -> list[str]:
    out = []
    while isa is not None:
        out.append(isa)
        isa = ISA_FALLBACK[isa]
    return out


def requested_isa(best: str) -> tuple[str, str | None]:
    """(path to start from, note): `best` (the detected path), or NORMFOLD_CPU_ISA when the CPU can run it."""
    want = os.environ.get("NORMFOLD_CPU_ISA", "").strip().lower()
    if not want or want in ("auto", "native"):
        return best, None
    want = ISA_ALIASES.get(want, want)
    if want not in ISA_FLAGS:
        return best, f"NORMFOLD_CPU_ISA={want!r} is not one of {', '.join(ISA_FLAGS)}; using {best}"
    if want not in chain(best):
        return best, f"NORMFOLD_CPU_ISA={want} cannot run on this CPU (best: {best}); using {best}"
    return want, None
