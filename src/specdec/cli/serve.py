"""`specdec serve`: an OpenAI-compatible server with continuous batching of speculative decoding."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    from specdec.cli.generate import add_weights_arg, drafter_choices
    from specdec.runtime.threads import add_threads_arg

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
    parser.add_argument("--drafter", **drafter_choices("none", "auto"),
                        default=None, help="how to draft (default: 'draft' when a draft model is available; with "
                        "--target and no --draft, 'auto': the target's own weights quantized to w4a8 (SelfDraft) "
                        "where that measures faster than plain decoding on this machine, measured once at start-up "
                        "and cached, else none); 'prompt-lookup', 'suffix', 'bigram' and 'layer-skip' need no "
                        "draft model, 'eagle' / 'medusa' / 'dflash' use the heads shipped for the default target "
                        "('eagle3': --head DIR where none is shipped), 'mtp' / 'mtp-tree' the target's own MTP layer "
                        "(DeepSeek-V3, GLM-4.5, ...); 'parallel' a PARD draft (--draft DIR adapted by `specdec "
                        "distill --parallel`)")
    parser.add_argument("--head", default=None, metavar="PATH",
                        help="--drafter eagle / medusa / dflash: a head saved by `specdec train-head` (default: the heads "
                        "shipped for the default target)")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="--drafter layer-skip: the target's first N layers draft (default: half of them)")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="--drafter draft-vocab, self-draft-*: draft from the N most frequent tokens (the default "
                        "pair's training data; another model's tokenizer ranks its own in offline text) "
                        "(draft-vocab's default 2048; the self-drafts' the whole vocabulary)")
    parser.add_argument("--suffix-cache-tokens", type=int, default=None, metavar="N",
                        help="--drafter suffix: the most tokens of earlier requests' outputs the server keeps to "
                        "draft from (one cache for all requests; least recently used requests leave first; "
                        "default 65536)")
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
    add_threads_arg(parser)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="run the target's batched passes compiled over a preallocated cache of --max-len "
                        "slots; every pass shape (batch bucket x input width) is compiled at start-up, one log "
                        "line each. The default pair in float32 on a Zen 4 core served 2.7x / 1.8x / 1.7x the "
                        "eager server's tokens/s at 1 / 8 / 32 streams, after 34 s of start-up from a warm "
                        "compile cache (77 s cold; minutes for larger models). Off by default: it also holds "
                        "--max-batch x --max-len cache slots from the start, and a request must fit --max-len")
    parser.add_argument("--max-len", type=int, default=512,
                        help="cache slots per row on the compiled path: prompt + max_tokens + 9 must fit, else "
                        "the request gets a 400 (default 512)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", default="auto",
                        help="model dtype: auto (bfloat16 where this machine computes it natively and the batched "
                             "passes' linear kernel is 1.25x faster in it at 32 rows, measured once; else float32), "
                             "float32, bfloat16, float16, float64, checkpoint (the weights' own)")
    add_weights_arg(parser)
    parser.set_defaults(func=run)


#: The modules of the `server` extra (pip install "specdec[server]").
SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client")


def check_server_extra() -> None:
    """ConfigError naming the extra when a module of it is missing (before anything loads)."""
    import importlib

    from specdec.errors import ConfigError

    missing = []
    for module in SERVER_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ConfigError(f"specdec serve needs {', '.join(missing)}, which is not installed: "
                          'pip install "specdec[server]"')


def check_options(args) -> str | None:
    """Every option that can be checked without the models; returns the --chat-template text (or None)."""
    from pathlib import Path

    from specdec.errors import ConfigError

    if args.gamma < 1 or args.max_batch < 1:
        raise ConfigError("--gamma and --max-batch must be integers >= 1")
    if args.compile and args.max_len < 16:
        raise ConfigError("--max-len must be at least 16 cache slots")
    if args.chat_template is None:
        return None
    try:
        return Path(args.chat_template).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read --chat-template {args.chat_template!r} ({exc.strerror if isinstance(exc, OSError) else exc}); "
                          "pass a text file with a Jinja chat template") from None


def bind(host: str, port: int):
    """A socket bound to (host, port), so a bad or busy address is reported before the models load; uvicorn
    then serves on it."""
    import errno
    import socket

    from specdec.errors import ConfigError

    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} is not an address of this machine ({exc.strerror}); "
                          "e.g. 127.0.0.1, or 0.0.0.0 for every interface") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart without a wait
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use (another server?); stop it, or pass "
                              "another --port") from None
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}); pass another --host or --port") from None
    return sock


def build_app(args):
    """The app for these options (checked first, then the models load)."""
    from pathlib import Path

    from specdec.cli.generate import load_models, vocab_tokenizer_options
    from specdec.drafters import make_drafter
    from specdec.hub.tokenizer_check import check_draft_tokenizer_at
    from specdec.runtime.threads import decode_threads, explicit_threads, last_choice
    from specdec.server import create_app

    template = check_options(args)
    if args.dtype == "auto":  # the batched passes' kernel at a server's width decides too (runtime/precision.py)
        from specdec.hub.loading import check_device
        from specdec.runtime.precision import serving_dtype

        args.dtype = str(serving_dtype(check_device(args.device), compiled=args.compile)).removeprefix("torch.")
    target, draft, tokenizer = load_models(args)
    if args.draft is not None:
        check_draft_tokenizer_at(tokenizer, args.draft, target_name=args.target or "the shipped default target",
                                 fix="specdec serve batches drafts with the target's tokenizer only; use such a "
                                 "--draft, or `specdec generate --draft` (one request at a time, translated)")
    # A target with no draft: its own quantized copy where that measures faster (engine/self_draft_choice.py).
    kind = args.drafter or ("draft" if draft is not None else "auto" if args.target is not None else None)
    options = {"head_path": args.head, "draft_layers": args.draft_layers, "draft_vocab": args.draft_vocab,
               "suffix_cache_tokens": args.suffix_cache_tokens}
    if kind in ("auto", "none") and any(v is not None for v in options.values()):
        from specdec.errors import ConfigError

        raise ConfigError("drafter options (--head, --draft-layers, --draft-vocab, --suffix-cache-tokens) need "
                          "--drafter with a kind that takes them")
    if kind == "auto":
        drafter = choose_self_draft_at_start(target, tokenizer, args)
    else:
        options.update(vocab_tokenizer_options(kind, tokenizer))
        drafter = None if kind in (None, "none") else make_drafter(kind, target=target, draft=draft, **options)
    model_name = args.model_name or ("specdec-default" if args.target is None else Path(args.target.rstrip("/")).name)
    if args.compile:
        import logging

        for logger in ("specdec.fastpath", "specdec.serve"):  # one line per compile and its time
            logging.getLogger(logger).setLevel(logging.INFO)
        if not logging.getLogger().handlers:
            logging.basicConfig(format="[specdec] %(message)s", stream=sys.stderr)
    else:
        print("[specdec] serving eagerly: --compile serves faster once its passes are compiled at start-up "
              "(`specdec serve --help`)", file=sys.stderr)
    threads = decode_threads(target)  # measured now (README "Threads"), and said
    measured = last_choice(target) if explicit_threads() is None else None
    said = measured.describe() if measured is not None else f"{threads} thread{'s' * (threads > 1)}"
    print(f"[specdec] decoding with {said}", file=sys.stderr)
    return create_app(target, tokenizer, drafter, model_name=model_name, max_batch=args.max_batch,
                      max_gamma=args.gamma, adaptive_gamma=not args.fixed_gamma, chat_template=template,
                      compile=args.compile, max_len=args.max_len if args.compile else None)


#: What `--drafter auto` measures the self-draft on at start-up (a server has no prompt yet): plain prose, whose
#: continuation the verdict's 24 greedy tokens time.
MEASURE_PROMPT = ("The lighthouse keeper climbed the stairs at dusk, as he had every evening for thirty years, and "
                  "found on the top step a letter addressed to him in his own handwriting.")


def choose_self_draft_at_start(target, tokenizer, args):
    """--drafter auto: generate's choice (the target's SelfDraft where it measures faster than plain decoding here,
    else None; said on stderr), measured on MEASURE_PROMPT with lone requests on the server's path."""
    from specdec.cli.generate import choose_drafter

    return choose_drafter(target, tokenizer(MEASURE_PROMPT, return_tensors="pt").input_ids[0], args)[0]


def run(args) -> int:
    check_server_extra()
    check_options(args)
    sock = bind(args.host, args.port)  # before the models load: a busy port is reported at once
    try:
        import uvicorn

        app = build_app(args)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=30)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0
