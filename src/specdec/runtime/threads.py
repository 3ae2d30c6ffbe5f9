"""CPU threads: one policy for specdec's decoding, in the library, the CLI and the server (README "Threads").

A small model's forward pass is a few milliseconds of work split into very small pieces. With more than one
intra-op thread, each piece ends in a barrier where the threads spin-wait for each other; when another
process holds one of the cores, that barrier waits for the OS to schedule the preempted thread, and decoding
collapses (default pair, 2-core CPU, one busy competing process: a one-token target pass took 4.4 ms with
1 thread and 48 ms with 2). On an idle machine, or with a large model, more threads are faster. So no fixed
count is right; specdec measures:

- `specdec.set_threads(n)` (CLI: `--threads N`): specdec decodes with n threads, and torch's count is set to
  n for the whole process.
- Otherwise (the default, `set_threads("auto")`, `--threads auto`): each decode call (`generate`, `stream`,
  `generate_text`, `stream_text`, `generate_batch`, `BatchDecoder`, the server's scheduler thread) runs with
  1 thread or with torch's current count N (the cores, or what `torch.set_num_threads` /
  `OMP_NUM_THREADS` gave), whichever ran the target's own one-token forward pass faster in a short
  interleaved measurement (N only when it is at least `FASTER_BY` times faster: a wrong N costs up to 10x,
  a wrong 1 at most N x). The measurement is made the first time specdec decodes with a model (per N), takes
  a few passes of each, and is repeated when it is older than `RECHECK_S` seconds (or 100 times its own
  cost), so a machine that became busy (or idle) is noticed. N = 1, a model off the CPU, or one over
  `LARGE_MODEL_PARAMETERS`: nothing is measured, torch's count is used.
- The count is set on entry and torch's previous count restored on exit (a stream restores it between
  tokens), so the caller's own torch work keeps the caller's setting. `torch.set_num_threads` sets the
  calling thread's OpenMP team size (and the default of threads that have not run torch yet), so the server's
  scheduler thread sets its own count around each round. Inter-op threads (`torch.set_num_interop_threads`)
  are not used by decoding and never changed.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
import weakref
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from specdec.errors import ConfigError

log = logging.getLogger("specdec.threads")

#: The CLI's --threads default: the measured choice (see the module docstring).
AUTO = "auto"
#: Kept for callers of the old constant: the CLI's default is now AUTO.
DEFAULT_THREADS = AUTO
#: More than one thread only when a one-token pass is at least this many times faster with them.
FASTER_BY = 1.2
#: A measurement older than this (seconds) is repeated at the next decode call or server round; later when
#: the measurement itself took longer than MEASURE_SHARE of that time.
RECHECK_S = 60.0
MEASURE_SHARE = 0.01
#: Timed one-token passes per thread count (interleaved), and a cap on the measurement's wall time.
MEASURE_PASSES = 5
MEASURE_BUDGET_S = 1.0
#: Models with more parameters than this decode with torch's count unmeasured: their operations are long
#: enough that a preempted thread costs a fraction, not a multiple, and one 1-thread pass would take seconds.
LARGE_MODEL_PARAMETERS = 1_000_000_000

T = TypeVar("T")


@dataclass(frozen=True)
class ThreadChoice:
    """One measurement: the count chosen, the median one-token pass time per count tried, and when."""

    threads: int
    seconds: tuple[tuple[int, float], ...]  # (threads, median seconds of a one-token pass); () not measured
    at: float  # time.monotonic() when measured
    cost_s: float = 0.0  # wall time the measurement took
    why: str = ""  # why it was not measured

    def describe(self) -> str:
        chosen = f"{self.threads} thread{'s' * (self.threads > 1)}"
        if not self.seconds:
            return f"{chosen} (not measured: {self.why})"
        tried = ", ".join(f"{n} thread{'s' * (n > 1)} {s * 1e3:.1f} ms" for n, s in self.seconds)
        return f"{chosen} (one-token target pass: {tried})"

    def expired(self, now: float) -> bool:
        """Time to measure again (see RECHECK_S); an unmeasured choice never expires."""
        return bool(self.seconds) and now - self.at > max(RECHECK_S, self.cost_s / MEASURE_SHARE)


_explicit: int | None = None  # set_threads(n); None: the measured choice
_choices: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {N: ThreadChoice}
_lock = threading.Lock()


def check_threads(threads: object, name: str = "threads") -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"{name} must be an integer >= 1 (e.g. 1, or the number of free cores), got {threads!r}")
    return threads


def set_threads(threads: int | str) -> None:
    """Decode with `threads` CPU threads (and set torch's count to it for this process), or with "auto" go back
    to the default: per model, 1 thread or torch's count, whichever measured faster (README "Threads")."""
    global _explicit
    if threads == AUTO:
        _explicit = None
        return
    import torch

    torch.set_num_threads(check_threads(threads))
    _explicit = threads


def explicit_threads() -> int | None:
    """The count given to `set_threads`, or None when specdec chooses by measurement."""
    return _explicit


def choose(seconds: dict[int, float]) -> int:
    """The rule: the count with the fastest pass among those at least FASTER_BY times faster than 1 thread;
    else 1."""
    best = 1
    for n, s in sorted(seconds.items()):
        if n > 1 and s * FASTER_BY <= seconds[1] and s < seconds[best]:
            best = n
    return best


def one_token_pass(model):
    """A function running `model`'s forward pass over one token, no cache: a plain decode step's cost.

    An encoder-decoder model runs its decoder (with one encoder state of zeros): decoding never reruns the
    encoder."""
    import torch
    from transformers.modeling_outputs import BaseModelOutput

    from specdec.runtime.seq2seq_lm import is_encoder_decoder

    token = torch.zeros((1, 1), dtype=torch.long, device=model.device)  # [1, 1]
    if is_encoder_decoder(model):
        width = model.get_input_embeddings().embedding_dim
        encoded = BaseModelOutput(last_hidden_state=torch.zeros((1, 1, width), dtype=model.dtype,
                                                                device=model.device))  # [1, 1, H]
        return lambda: model(decoder_input_ids=token, encoder_outputs=encoded, use_cache=False)
    return lambda: model(input_ids=token, use_cache=False)


def pass_seconds(model, counts: tuple[int, ...]) -> dict[int, float]:
    """Median one-token pass time (s) of `model` with each thread count, timed interleaved (one warm-up pass
    each, then up to MEASURE_PASSES each within MEASURE_BUDGET_S); torch's count is restored after."""
    import torch

    run = one_token_pass(model)
    before = torch.get_num_threads()
    times: dict[int, list[float]] = {n: [] for n in counts}
    try:
        with torch.inference_mode():
            for n in counts:  # warm-up: the thread team and the weights' first touch
                torch.set_num_threads(n)
                run()
            start = time.perf_counter()
            for i in range(MEASURE_PASSES):
                for n in counts if i % 2 == 0 else counts[::-1]:
                    torch.set_num_threads(n)
                    t = time.perf_counter()
                    run()
                    times[n].append(time.perf_counter() - t)
                if time.perf_counter() - start > MEASURE_BUDGET_S:
                    break
    finally:
        torch.set_num_threads(before)
    return {n: statistics.median(v) for n, v in times.items()}


def measure(model, threads: int) -> ThreadChoice:
    """Time `model`'s one-token pass with 1 and with `threads` threads and choose (see `choose`); a model over
    LARGE_MODEL_PARAMETERS keeps `threads` unmeasured."""
    size = sum(p.numel() for p in model.parameters())
    if size > LARGE_MODEL_PARAMETERS:
        return ThreadChoice(threads, (), time.monotonic(), why=f"{size / 1e9:.1f}B parameters: torch's count")
    start = time.perf_counter()
    seconds = pass_seconds(model, (1, threads))
    return ThreadChoice(choose(seconds), tuple(sorted(seconds.items())), time.monotonic(),
                        cost_s=time.perf_counter() - start)


def decode_threads(model) -> int:
    """The thread count specdec's decoding of `model` uses now, in the calling thread (see the module docstring):
    set_threads' count, else the measured choice between 1 and torch's current count."""
    import torch

    if _explicit is not None:
        return _explicit
    current = torch.get_num_threads()
    if current == 1 or model.device.type != "cpu":
        return current
    with _lock:
        per_count = _choices.setdefault(model, {})
        choice = per_count.get(current)
        if choice is None or choice.expired(time.monotonic()):
            previous = choice
            try:
                choice = measure(model, current)
            except Exception as exc:  # noqa: BLE001 (advice only: a model whose bare pass fails still decodes)
                log.warning("cannot time a one-token pass of %s (%s: %s); decoding with torch's %d threads",
                            type(model).__name__, type(exc).__name__, exc, current)
                choice = ThreadChoice(current, (), time.monotonic(), why=f"its bare pass failed: {exc}")
            per_count[current] = choice
            if previous is None or previous.threads != choice.threads:
                log.info("decoding with %s", choice.describe())
    return choice.threads


def last_choice(model) -> ThreadChoice | None:
    """The latest measurement for `model` at torch's current count in this thread (None: none made)."""
    import torch

    return _choices.get(model, {}).get(torch.get_num_threads())


@contextmanager
def threads_for(model, threads: int | None = None) -> Iterator[int]:
    """Run the block with `threads` (None: `decode_threads(model)`) torch threads, then restore the count."""
    import torch

    n = decode_threads(model) if threads is None else threads
    before = torch.get_num_threads()
    if n == before:
        yield n
        return
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def scoped_stream(items: Generator[T, None, None], model) -> Iterator[T]:
    """`items` advanced under `threads_for(model)`, the count chosen once at the first item; the caller's
    count is back in force at every yield."""
    threads = decode_threads(model)
    try:
        while True:
            with threads_for(model, threads):
                try:
                    item = next(items)
                except StopIteration:
                    return
            yield item
    finally:  # a consumer that stops early: the generator's own cleanup runs under the same count
        with threads_for(model, threads):
            items.close()


def parse_threads(value: object, name: str = "--threads") -> int | str:
    """--threads' value: "auto" or an integer >= 1."""
    if value == AUTO or value is None:
        return AUTO
    if isinstance(value, str):
        if not value.strip().lstrip("-").isdigit():
            raise ConfigError(f"{name} must be an integer >= 1 or 'auto', got {value!r}")
        value = int(value)
    return check_threads(value, name)


def add_threads_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--threads", default=AUTO, metavar="N",
        help="torch CPU threads: an integer, or 'auto' (default): 1 thread or torch's count (the cores), "
        "whichever runs the target's one-token pass faster, measured at first use and every minute "
        "(README 'Threads')")


def apply_threads(args: argparse.Namespace) -> None:
    """Validate --threads and apply an explicit count (call before loading models); 'auto' leaves the choice
    to each decode call."""
    threads = parse_threads(getattr(args, "threads", AUTO))
    args.threads = threads
    if threads != AUTO:
        set_threads(threads)
