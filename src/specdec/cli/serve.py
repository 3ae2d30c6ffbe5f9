"""`specdec serve`: an OpenAI-compatible server with continuous batching of speculative decoding."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    from specdec.drafters import DRAFTER_KINDS

    parser = subparsers.add_parser(
        "serve",
        help="serve OpenAI-compatible /v1/completions and /v1/chat/completions, batched and speculative",
        description="Serve the target (default: the shipped pair) over HTTP with OpenAI's protocol. Concurrent "
        "requests decode together in one batch (rows join and leave between rounds); each stays exact. The "
        "draft length follows measured goodput and backs off to plain decoding under load. Needs the "
        "'server' extra: pip install 'specdec[server]'.",
    )
    parser.add_argument("--target", help="target model: local path or hub id (default: the shipped pair)")
    parser.add_argument("--draft", help="draft model path or hub id (same tokenizer as the target)")
    parser.add_argument("--drafter", choices=[*DRAFTER_KINDS, "none"],
                        default=None, help="how to draft (default: 'draft' when a draft model is available, else "
                        "none); 'prompt-lookup', 'bigram' and 'layer-skip' need no draft model, 'eagle' / "
                        "'medusa' use the heads shipped for the default target")
    parser.add_argument("--head", default=None, metavar="PATH",
                        help="--drafter eagle / medusa: a head saved by `specdec train-head` (default: the heads "
                        "shipped for the default target)")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="--drafter layer-skip: the target's first N layers draft (default: half of them)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--model-name", default=None, help="the id clients send as 'model' (default: 'specdec-default' "
                        "or the target's directory name)")
    parser.add_argument("--gamma", type=int, default=4, help="largest draft length per round (default 4)")
    parser.add_argument("--fixed-gamma", action="store_true",
                        help="always draft --gamma tokens (no load-based back-off)")
    parser.add_argument("--max-batch", type=int, default=64, help="most requests decoded together (default 64)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template for /v1/chat/completions when the tokenizer has none")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="run the target's batched passes compiled over a preallocated cache of --max-len "
                        "slots; every pass shape (batch bucket x input width) is compiled at start-up, one log "
                        "line each. Off by default: on this CPU it measured faster at 1 row, and not clearly "
                        "faster at 8+ rows (BENCHMARKS.md 'Serving')")
    parser.add_argument("--max-len", type=int, default=512,
                        help="cache slots per row on the compiled path: prompt + max_tokens + 9 must fit, else "
                        "the request gets a 400 (default 512)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", default=None, help="model dtype (default float32 on CPU)")
    parser.set_defaults(func=run)


def build_app(args):
    from pathlib import Path

    from specdec.cli.generate import load_models
    from specdec.drafters import make_drafter
    from specdec.errors import ConfigError
    from specdec.server import create_app

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_models(args)
    kind = args.drafter or ("draft" if draft is not None else None)
    options = {"head_path": args.head, "draft_layers": args.draft_layers}
    drafter = None if kind in (None, "none") else make_drafter(kind, target=target, draft=draft, **options)
    if args.gamma < 1 or args.max_batch < 1:
        raise ConfigError("--gamma and --max-batch must be integers >= 1")
    template = Path(args.chat_template).read_text() if args.chat_template else None
    name = args.model_name or ("specdec-default" if args.target is None else Path(args.target.rstrip("/")).name)
    if args.compile:
        import logging

        for name in ("specdec.fastpath", "specdec.serve"):  # one line per compile and its time
            logging.getLogger(name).setLevel(logging.INFO)
        if not logging.getLogger().handlers:
            logging.basicConfig(format="[specdec] %(message)s", stream=sys.stderr)
    if args.compile and args.max_len < 16:
        raise ConfigError("--max-len must be at least 16 cache slots")
    return create_app(target, tokenizer, drafter, model_name=name, max_batch=args.max_batch, max_gamma=args.gamma,
                      adaptive_gamma=not args.fixed_gamma, chat_template=template, compile=args.compile,
                      max_len=args.max_len if args.compile else None)


def run(args) -> int:
    try:
        import uvicorn
    except ModuleNotFoundError:
        print("specdec serve needs the server extra: pip install 'specdec[server]'", file=sys.stderr)
        return 2
    app = build_app(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=30)
    return 0
