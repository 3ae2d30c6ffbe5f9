"""`specdec` command line: one module per subcommand, each exposing ``register(subparsers)``.

Subcommand modules import heavy dependencies (torch, transformers) inside their handlers, so
``specdec --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys

# Order shown in --help. Adding a subcommand: a module here with `register(subparsers)`.
COMMANDS = ["generate", "demo", "bench", "verify", "train", "distill", "train-head", "export", "serve"]


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump): a mistyped option gets one clear line and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from specdec import __version__

    parser = Parser(
        prog="specdec",
        description="Exact speculative decoding for Hugging Face causal language models.",
    )
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"specdec.cli.{name.replace('-', '_')}")
        except ModuleNotFoundError as exc:  # a subcommand still being built
            if exc.name != f"specdec.cli.{name.replace('-', '_')}":
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from specdec.errors import SpecdecError

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.command_line = "specdec " + shlex.join(argv)  # for reports that record how they were made
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
