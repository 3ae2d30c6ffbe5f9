"""What the CPU says about itself (Linux: the first processor block of /proc/cpuinfo): its model name, x86 family and
model, and feature flags, read once. Empty where there is no /proc/cpuinfo (macOS, Windows)."""

from __future__ import annotations

import ctypes
import functools
import platform
from pathlib import Path


@functools.cache
def first_processor() -> dict[str, str]:
    """The first processor's "key: value" lines (every processor of one machine lists the same features)."""
    try:
        return parse(Path("/proc/cpuinfo").read_text())
    except OSError:
        return {}


def parse(text: str) -> dict[str, str]:
    """The first block of a /proc/cpuinfo text (blocks are separated by blank lines), each key's first value."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def flags() -> set[str]:
    """The CPU's feature flags: x86 `flags`, aarch64 `Features`."""
    info = first_processor()
    return set((info.get("flags") or info.get("Features") or "").split())


@functools.cache
def amx_tiles_granted() -> bool:
    """Whether Linux lets this process use AMX's tile registers: it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
    XFEATURE_XTILEDATA, Linux 5.16+), which grants them to the whole process. False elsewhere, and where the kernel
    or a hypervisor says no: a CPU flag alone does not make AMX usable."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False
