"""`dtype="auto"`: bfloat16 where the hardware computes it natively, float32 elsewhere.

On a GPU that supports bfloat16 the answer is bfloat16. On a CPU it is measured with the kernel specdec's
passes run (runtime/rowwise.py's packed linear, on packed weights): a bfloat16 matrix product is timed against the
same float32 one, at one row (a decoding or drafting pass: memory-bound) and at eight (a verification pass).
bfloat16 is chosen when the geometric mean of its two speed-ups is at least 1.25 and it is slower at neither: a
speculative round is one wide pass and γ one-row passes, so both count. A CPU that has to convert every bfloat16
operand in a slow loop fails it; one that widens bfloat16 exactly in registers and reads half the bytes passes it
(the AVX2 Zen 3 EPYC: 1.9x at one row, 1.22x at eight, and end to end on the default pair bfloat16 ran plain decoding
2.6x and speculative decoding 1.8x float32's tokens/s; BENCHMARKS.md). The timings are cached per CPU model, core
count, torch version and kernel build in `~/.cache/specdec/precision.json` (`$XDG_CACHE_HOME`), so a machine
measures once; the verdict is recomputed from them with today's rule.

A batched server's passes are wider, and in bfloat16 its eager passes take another kernel: `specdec serve --dtype
auto` (`serving_dtype`) keeps bfloat16 only where, besides, the linear kernel of its batched passes is at least
NATIVE_SPEEDUP times faster in bfloat16 than in float32 at `SERVING_ROWS` rows (a margin: the rest of a pass, norms
and attention, gains less or loses). Eager, bfloat16 rows run the row-invariant `row_linear` and float32 rows
PyTorch's `F.linear`; compiled, both run `packed_linear`. On the AVX2 Zen 3 at 32 rows: `row_linear` in bfloat16
74.6 ms against `F.linear` in float32 10.7 ms, and the eager batched decoder ran bfloat16 at 0.25x its float32
tokens/s; `packed_linear` 6.7 against 7.0 ms, and the compiled one at 0.80x (32 rows, plain, one core). Both serve
float32 there.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
import time
from pathlib import Path

import torch

from specdec.runtime.cpuinfo import first_processor

log = logging.getLogger("specdec.precision")

#: bfloat16's speed-up over float32 (geometric mean of one row's and eight rows') needed for it to be chosen.
NATIVE_SPEEDUP = 1.25


def bf16_pays(float32_ms: list[float], bfloat16_ms: list[float]) -> bool:
    """The rule, on the two products' times at [1 row, 8 rows]: geometric-mean speed-up >= NATIVE_SPEEDUP, and
    bfloat16 slower at neither."""
    ratios = [f / b for f, b in zip(float32_ms, bfloat16_ms, strict=True)]
    return min(ratios) >= 1.0 and math.prod(ratios) ** (1 / len(ratios)) >= NATIVE_SPEEDUP


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
    key = machine_key()
    cache = cache_file("precision.json")
    known = read_cache(cache)
    if key in known and "float32_ms" in known[key]:
        return bf16_pays(known[key]["float32_ms"], known[key]["bfloat16_ms"])
    try:
        f32, bf16 = _measure()
    except Exception as exc:  # noqa: BLE001 (no compiler for the kernels, ...): float32 is always safe
        log.info("bfloat16 not measured (%s): float32", exc)
        return False
    native = bf16_pays(f32, bf16)
    log.info("bfloat16 on this CPU: %s (1 / 8 rows: float32 %.3f / %.3f ms, bfloat16 %.3f / %.3f ms)",
             "native" if native else "emulated", f32[0], f32[1], bf16[0], bf16[1])
    entry = known.get(key)  # other timings of this machine (`batched_linear_ms`) stay
    known[key] = {**(entry if isinstance(entry, dict) else {}), "bf16": native, "float32_ms": f32, "bfloat16_ms": bf16}
    write_cache(cache, known)
    return native


#: Rows of a batched server's pass at which its bfloat16 and float32 linear kernels are compared.
SERVING_ROWS = 32


def serving_dtype(device: str | torch.device, compiled: bool) -> torch.dtype:
    """What `specdec serve --dtype auto` loads: `auto_dtype`, but float32 on a CPU where the batched passes' linear
    kernel (compiled: `packed_linear`; eager: `row_linear` for bfloat16, `F.linear` for float32) is not at least
    NATIVE_SPEEDUP times faster in bfloat16 at SERVING_ROWS rows (measured once per machine, cached with the
    one-row verdict)."""
    dtype = auto_dtype(device)
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return dtype
    float32_ms, bfloat16_ms = batched_linear_ms(compiled)
    if float32_ms < NATIVE_SPEEDUP * bfloat16_ms:
        log.info("serving in float32: the %s batched passes' linear kernel at %d rows takes %.2f ms in bfloat16, "
                 "%.2f ms in float32", "compiled" if compiled else "eager", SERVING_ROWS, bfloat16_ms, float32_ms)
        return torch.float32
    return dtype


def batched_linear_ms(compiled: bool) -> tuple[float, float]:
    """(float32 ms, bfloat16 ms) of the batched passes' linear kernel at SERVING_ROWS rows (cached per machine)."""
    path = "compiled" if compiled else "eager"
    key, cache = machine_key(), cache_file("precision.json")
    known = read_cache(cache)
    entry = known.get(key)
    entry = entry if isinstance(entry, dict) else {}
    measured = entry.setdefault("batched_ms", {})
    if path not in measured:
        measured[path] = measure_batched(compiled)
        known[key] = entry
        write_cache(cache, known)
    float32_ms, bfloat16_ms = measured[path]
    return float32_ms, bfloat16_ms


def measure_batched(compiled: bool, repeats: int = 5) -> list[float]:
    """Fastest ms of a [SERVING_ROWS, 2048] x [2048, 4096]^T product in float32 and in bfloat16, each through the
    kernel the batched passes of that dtype run (see `serving_dtype`), interleaved."""
    from specdec.runtime.rowwise import load_kernel  # noqa: PLC0415 (builds the kernels on first use)

    load_kernel()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 2048, generator=gen)
    x = torch.randn(SERVING_ROWS, 2048, generator=gen)
    if compiled:
        cases = [(x.to(dtype), torch.ops.specdec.pack_weight(weight.to(dtype))) for dtype in (torch.float32, torch.bfloat16)]
        runs = [lambda x=x, w=w: torch.ops.specdec.packed_linear(x, w, None, 4096) for x, w in cases]
    else:
        w16, x16 = weight.to(torch.bfloat16), x.to(torch.bfloat16)
        runs = [lambda: torch.nn.functional.linear(x, weight),
                lambda: torch.ops.specdec.row_linear(x16, w16, None)]
    return _fastest_ms(runs, repeats)


def _fastest_ms(runs: list, repeats: int) -> list[float]:
    """Each of `runs` (calls) timed `repeats` times, interleaved: the fastest ms of each."""
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], 1e3 * (time.perf_counter() - start))
    return best


def _measure(repeats: int = 15) -> tuple[list[float], list[float]]:
    """Fastest ms of a [rows, 2048] x [2048, 4096]^T product through the kernel specdec's passes use (packed
    weights, `specdec::packed_linear`), rows 1 and 8, in float32 and in bfloat16, interleaved."""
    from specdec.runtime.rowwise import load_kernel  # noqa: PLC0415 (builds the kernels on first use)

    load_kernel()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 2048, generator=gen)  # 16 / 32 MB: streamed from memory, as real weights are
    cases = [(dtype, rows, torch.ops.specdec.pack_weight(weight.to(dtype)), torch.randn(rows, 2048, generator=gen).to(dtype))
             for dtype in (torch.float32, torch.bfloat16) for rows in (1, 8)]
    best = _fastest_ms([lambda w=w, x=x: torch.ops.specdec.packed_linear(x, w, None, 4096) for _, _, w, x in cases],
                       repeats)
    return best[:2], best[2:]  # float32 at 1 and 8 rows, bfloat16 at 1 and 8 rows (the cases' order)


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), for cache keys and reports."""
    return first_processor().get("model name") or platform.processor() or platform.machine() or "unknown"


def cpu_family_model() -> str | None:
    """"family F model M" of an x86 CPU (Linux: /proc/cpuinfo), which names its generation where the model name
    does not ("AMD EPYC"); None elsewhere."""
    info = first_processor()
    if "cpu family" not in info or "model" not in info:
        return None
    return f"family {info['cpu family']} model {info['model']}"


def machine_key() -> str:
    """The CPU, its cores, torch, and the kernels' version (their tier and sources: a new kernel is measured anew):
    what a measurement cached on this machine is valid for."""
    from specdec.runtime.rowwise import kernel_tier, kernels_version  # noqa: PLC0415

    tier = kernel_tier()
    return f"{cpu_model()} | {os.cpu_count()} cores | torch {torch.__version__} | {tier} {kernels_version(tier)}"


def cache_file(name: str) -> Path:
    """`name` in specdec's cache folder for measurements of this machine (`$XDG_CACHE_HOME/specdec`, else
    `~/.cache/specdec`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdec" / name


def write_cache(path: Path, data: dict) -> None:
    """Write a cache file; a read-only home leaves it unwritten (measured again next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    except OSError:
        pass


def read_cache(path: Path) -> dict:
    """A cache file's JSON object ({} if it is missing, unreadable or not an object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
