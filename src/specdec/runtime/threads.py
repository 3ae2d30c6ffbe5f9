"""CPU threads: `specdec.set_threads` and the `--threads` option every model-running command takes.

A small model's forward pass is a few milliseconds of work split into very small pieces. With more than one
intra-op thread, each piece ends in a barrier where the threads spin-wait for each other; when another
process holds one of the cores, that barrier waits for the OS to schedule the preempted thread, and decoding
collapses (measured on the default pair, 2-core CPU, one busy competing process: 6 tokens/s with 2 threads
against 61 with 1; see README "Threads"). So the command line defaults to one thread; pass `--threads N`
(or call `specdec.set_threads(N)`) on an idle machine with a larger model.
"""

from __future__ import annotations

import argparse

from specdec.errors import ConfigError

#: Default of the CLI's --threads (the library leaves torch's own setting alone unless told).
DEFAULT_THREADS = 1


def check_threads(threads: object, name: str = "threads") -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"{name} must be an integer >= 1 (e.g. 1, or the number of free cores), got {threads!r}")
    return threads


def set_threads(threads: int) -> None:
    """Use `threads` CPU threads for torch's operators in this process (`torch.set_num_threads`).

    specdec never changes torch's thread count on its own; `torch.set_num_threads` works just as well.
    """
    import torch

    torch.set_num_threads(check_threads(threads))


def add_threads_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--threads", type=int, default=DEFAULT_THREADS, metavar="N",
        help=f"torch CPU threads (default {DEFAULT_THREADS}: a small model spin-waits and slows down "
        "sharply with more threads when another process is using a core; try the number of free cores on "
        "an idle machine)")


def apply_threads(args: argparse.Namespace) -> None:
    """Validate and apply --threads (call before loading models)."""
    threads = getattr(args, "threads", None)
    if threads is None:
        return
    set_threads(check_threads(threads, "--threads"))
