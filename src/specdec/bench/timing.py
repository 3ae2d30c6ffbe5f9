"""Wall-clock medians of a repeated call, for the scripts in benchmarks/ that time single passes and kernels."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median milliseconds of `repeats` calls of `fn`, after `warmup` untimed calls (caches, lazy builds)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)
