"""Permission to use AMX tiles, asked for before any kernel needs it (Linux, x86-64).

Linux lets a process execute AMX tile instructions only after it asked the kernel for the
tile-data state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, kernel >= 5.16);
until then the first tile instruction is an illegal instruction and the process dies with
SIGILL. oneDNN asks when it first JIT-compiles an AMX GEMM, so a vLLM-CPU worker that has run
a prefill through its linear layers has the permission. vLLM-CPU's attention kernel uses AMX
too and never asks: on an AMX host (Sapphire Rapids and later) a fresh worker whose very first
request loads its whole prefix from a KV connector reaches that kernel first, and dies. The
bridge asks for the permission in every vLLM process it is loaded into; where the CPU has no
AMX, or the kernel does not know the request, nothing happens.
"""

from __future__ import annotations

import sys

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (empty where it does not)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_amx() -> bool:
    return "amx_tile" in cpu_flags()


def allow_amx() -> bool:
    """Ask for AMX tile permission for this process (all its threads); True when granted."""
    import platform

    if not sys.platform.startswith("linux") or platform.machine() != "x86_64" or not cpu_has_amx():
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
