"""What the CPU says about itself (Linux: the first processor block of /proc/cpuinfo): its model name, x86 family and
model, and feature flags, read once. Empty where there is no /proc/cpuinfo (macOS, Windows)."""

from __future__ import annotations

import functools
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
