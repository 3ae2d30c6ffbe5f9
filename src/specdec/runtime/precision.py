"""`dtype="auto"`: bfloat16 where the hardware computes it natively, float32 elsewhere.

On a GPU that supports bfloat16 the answer is bfloat16. On a CPU it is measured with the kernel specdec's
passes run (runtime/rowwise.py's packed linear, on packed weights): a bfloat16 matrix product is timed against the
same float32 one, at one row (a decoding pass: memory-bound) and at eight (a verification pass). bfloat16 is chosen when
it is at least 1.25x faster at both; a CPU that has to convert every bfloat16 operand is not. The verdict is cached per CPU model, core count,
torch version and kernel build in `~/.cache/specdec/precision.json` (`$XDG_CACHE_HOME`), so a machine measures it once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

log = logging.getLogger("specdec.precision")

#: bfloat16 must be at least this much faster than float32, at one row and at eight, to be chosen.
NATIVE_SPEEDUP = 1.25


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype `dtype="auto"` means on `device`: bfloat16 where it is computed natively, else float32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if cpu_computes_bf16() else torch.float32
    return torch.float32


@functools.cache
def cpu_computes_bf16() -> bool:
    """Whether this CPU runs bfloat16 matrix products natively (measured once per machine, then cached)."""
    key = _machine_key()
    cache = _cache_path()
    known = _read(cache)
    if key in known:
        return bool(known[key]["bf16"])
    try:
        f32, bf16 = _measure()
    except Exception as exc:  # noqa: BLE001 (no compiler for the kernels, ...): float32 is always safe
        log.info("bfloat16 not measured (%s): float32", exc)
        return False
    native = all(f / b >= NATIVE_SPEEDUP for f, b in zip(f32, bf16))
    log.info("bfloat16 on this CPU: %s (1 / 8 rows: float32 %.3f / %.3f ms, bfloat16 %.3f / %.3f ms)",
             "native" if native else "emulated", f32[0], f32[1], bf16[0], bf16[1])
    known[key] = {"bf16": native, "float32_ms": f32, "bfloat16_ms": bf16}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=1))
    except OSError:
        pass  # a read-only home: measure again next time
    return native


def _measure(repeats: int = 15) -> tuple[list[float], list[float]]:
    """Fastest ms of a [rows, 2048] x [2048, 4096]^T product through the kernel specdec's passes use (packed
    weights, `specdec::packed_linear`), rows 1 and 8, in float32 and in bfloat16, interleaved."""
    from specdec.runtime.rowwise import load_kernel  # noqa: PLC0415 (builds the kernels on first use)

    load_kernel()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 2048, generator=gen)  # 16 / 32 MB: streamed from memory, as real weights are
    cases = [(dtype, rows, torch.ops.specdec.pack_weight(weight.to(dtype)), torch.randn(rows, 2048, generator=gen).to(dtype))
             for dtype in (torch.float32, torch.bfloat16) for rows in (1, 8)]
    best = {(dtype, rows): float("inf") for dtype, rows, _, _ in cases}
    for _ in range(repeats):
        for dtype, rows, w, x in cases:
            start = time.perf_counter()
            torch.ops.specdec.packed_linear(x, w, None, 4096)
            best[dtype, rows] = min(best[dtype, rows], 1e3 * (time.perf_counter() - start))
    return ([best[torch.float32, 1], best[torch.float32, 8]], [best[torch.bfloat16, 1], best[torch.bfloat16, 8]])


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), for cache keys and reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _machine_key() -> str:
    """The CPU, its cores, torch, and the kernels' build (their tier and sources: a new kernel is measured anew)."""
    from specdec.runtime.rowwise import build_name, kernel_tier  # noqa: PLC0415

    return f"{cpu_model()} | {os.cpu_count()} cores | torch {torch.__version__} | {build_name(kernel_tier())}"


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdec" / "precision.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
