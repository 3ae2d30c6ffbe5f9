"""`specdec verify`: check statistically that speculative sampling follows the exact target distribution."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    from specdec.cli.generate import add_decoding_args, drafter_choices
    from specdec.runtime.threads import add_threads_arg

    parser = subparsers.add_parser(
        "verify",
        help="check statistically that a decoding method samples exactly from the target",
        description="Draw --samples continuations of the prompt with each --drafter and test them against the "
        "target's exact (warped) distribution, computed from the target itself: all continuations of up to "
        "--max-new-tokens tokens when few enough, else the next-token distribution after every observed "
        "prefix. Prints, per method, the chi-square p-value, the estimated total variation distance to the "
        "target with a 95% interval, the smallest TV deviation the run detects with 80% power, and "
        "PASS/FAIL (FAIL when p < --alpha). Exits 1 if any method fails.",
    )
    parser.add_argument("--target", help="target model: local path or hub id (default: the shipped pair)")
    parser.add_argument("--draft", help="draft model path or hub id (another tokenizer: see --draft-tokenizer)")
    from specdec.cli.generate import add_draft_tokenizer_arg

    add_draft_tokenizer_arg(parser)
    parser.add_argument("--drafter", action="append", **drafter_choices("plain"), default=None,
                        help="method to check; repeat to check several (default: 'draft' when a draft model is "
                        "available, else 'plain')")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text (tokenized with the target's tokenizer)")
    prompt.add_argument("--prompt-ids", help="the prompt as comma-separated token ids, e.g. 5,9,3")
    add_decoding_args(parser)
    parser.add_argument("--samples", type=int, default=20_000, help="continuations drawn per method (default 20000)")
    parser.add_argument("--eos", default=None,
                        help="EOS token ids, comma-separated, or 'none' (default: the target's generation config)")
    parser.add_argument("--alpha", type=float, default=1e-3, help="significance level: FAIL when p < alpha "
                        "(default 1e-3)")
    parser.add_argument("--power", type=float, default=0.8,
                        help="power at which the detectable TV deviation is reported (default 0.8)")
    parser.add_argument("--mode", choices=("auto", "enumerate", "conditional"), default="auto",
                        help="reference: every continuation ('enumerate'), next-token distributions after the "
                        "observed prefixes ('conditional'), or pick by size ('auto', default)")
    parser.add_argument("--engine", choices=("auto", "memo", "cache"), default="auto",
                        help="how draws run the models: 'memo' answers repeated prefixes from a table, 'cache' "
                        "runs real KV-cached forwards (default auto: memo, cache if a method needs it)")
    parser.add_argument("--ngram-max", type=int, default=None, help="prompt-lookup: longest n-gram matched")
    parser.add_argument("--ngram-min", type=int, default=None, help="prompt-lookup: shortest n-gram matched")
    parser.add_argument("--draft-layers", type=int, default=None, metavar="K",
                        help="layer-skip: draft with the target's first K decoder layers")
    parser.add_argument("--bigram", default=None, metavar="PATH", help="bigram: a table saved with Bigram.save")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", default=None,
                        help="model dtype: float32, bfloat16, float16, float64, auto (default float32 on CPU)")
    add_threads_arg(parser)
    parser.set_defaults(func=run, temperature=1.0, max_new_tokens=3, seed=0)
    # The shared decoding options document generate's defaults; state verify's own.
    own = {"max_new_tokens": "continuation length L checked (default 3; all continuations are enumerated "
                             "when min(V, top-k)^L <= 50000)",
           "temperature": "sampling temperature > 0 (default 1.0); 0 checks greedy token identity",
           "seed": "random seed of the draws (default 0)"}
    for action in parser._actions:
        if action.dest in own:
            action.help = own[action.dest]


def _ids(text: str, what: str) -> list[int]:
    from specdec.errors import ConfigError

    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, e.g. 5,9,3; got {text!r}") from None


def _load(args):
    """(target, draft or None, tokenizer or None); the tokenizer is only needed for --prompt."""
    import specdec
    from specdec.hub.loading import check_device, load_model, load_tokenizer
    from specdec.runtime.threads import apply_threads

    check_device(args.device)
    apply_threads(args)
    if args.target is None:
        target, draft, tokenizer = specdec.load_default(device=args.device)
    else:
        target = load_model(args.target, args.device, args.dtype)
        draft = None
        tokenizer = load_tokenizer(args.target) if args.prompt is not None else None
    if args.draft is not None:  # its own tokenizer, if another, is translated (as `specdec generate` does)
        draft = load_model(args.draft, args.device, args.dtype)
    return target, draft, tokenizer


def _p_text(p: float) -> str:
    return "< 1e-300" if p == 0.0 else f"{p:.3g}"


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from specdec.cli.generate import draft_tokenizer_options, parse_gamma
    from specdec.drafters import DRAFTER_OPTIONS, make_drafter
    from specdec.errors import ConfigError
    from specdec.exactness import check_exactness
    from specdec.exactness.verifier import settings_text
    from specdec.engine.text import encode_prompt

    if args.samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {args.samples}")
    target, draft, tokenizer = _load(args)
    prompt_ids = encode_prompt(tokenizer, args.prompt) if args.prompt is not None else _ids(args.prompt_ids, "--prompt-ids")
    eos = None if args.eos is None else ([] if args.eos.lower() == "none" else _ids(args.eos, "--eos"))
    kinds = args.drafter or (["draft"] if draft is not None else ["plain"])
    options = {"ngram_max": args.ngram_max, "ngram_min": args.ngram_min, "draft_layers": args.draft_layers,
               "bigram_path": args.bigram}
    console = Console(stderr=args.json, highlight=False)
    results = []
    for kind in dict.fromkeys(kinds):
        # Each drafter gets the options that apply to it (several kinds may be checked in one run).
        applicable = {k: v for k, v in options.items() if k in DRAFTER_OPTIONS.get(kind, {})}
        if draft is not None:
            applicable.update(draft_tokenizer_options(args, kind, tokenizer))
        drafter = None if kind == "plain" else make_drafter(kind, target=target, draft=draft, **applicable)
        with console.status(f"verifying {kind}: {args.samples} draws ..."):
            result = check_exactness(
                target, prompt_ids, drafter, method=kind, gamma=parse_gamma(args.gamma),
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                eos_token_id=eos, max_new_tokens=args.max_new_tokens, samples=args.samples, seed=args.seed,
                alpha=args.alpha, power=args.power, mode=args.mode, engine=args.engine,
                # the verifier's many tiny batched ops: 1 thread unless --threads says otherwise
                threads=1 if args.threads == "auto" else args.threads,
            )
        results.append(result)
    passed = all(r.passed for r in results)
    if args.json:
        print(json.dumps({"passed": passed, "results": [r.to_dict() for r in results]}, indent=2))
        return 0 if passed else 1

    first = results[0]
    console.print(f"[bold]Exactness vs the warped target[/]  {settings_text(first.settings)}  prompt "
                  f"{len(prompt_ids)} tokens, seed {args.seed}, FAIL if p < {args.alpha:g}")
    table = Table(show_edge=False, pad_edge=False)
    for column in ("method", "n", "p", "TV [95% CI]", "detect", "accept", "result"):
        table.add_column(column, justify="left" if column == "method" else "right", no_wrap=True)
    for r in results:
        lo, hi = r.tv_ci
        table.add_row(
            r.method, str(r.samples), _p_text(r.p_value), f"{r.tv:.3f} [{lo:.3f}, {hi:.3f}]",
            f"{r.detectable_tv:.3f}", f"{r.acceptance_rate:.2f}",
            ("[yellow]PASS, no power[/]" if r.power_warning else "[green]PASS[/]") if r.passed else "[bold red]FAIL[/]",
        )
    console.print(table)
    for r in results:
        for note in r.notes:
            console.print(f"[yellow]{r.method}: {note}[/]")
    console.print(
        f"[dim]reference: {first.mode} ({first.test.cells} cells); TV: total variation distance between the "
        f"method's and the target's continuations (coarse cells); detect: every deviation of at least this "
        f"TV fails with probability >= {args.power:g}; accept: draft acceptance rate; draws/s: "
        + ", ".join(f"{r.method} {r.draws_per_s:.0f} ({r.engine})" for r in results) + "[/]"
    )
    return 0 if passed else 1

