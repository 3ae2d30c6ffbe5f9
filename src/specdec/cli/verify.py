"""`specdec verify`: check statistically that speculative sampling follows the exact target distribution, or with
--greedy that greedy output is token-identical to plain decoding on the same path."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    from specdec.cli.generate import add_decoding_args, add_weights_arg, drafter_choices
    from specdec.runtime.threads import add_threads_arg

    parser = subparsers.add_parser(
        "verify",
        help="check statistically that a decoding method samples exactly from the target (--greedy: that greedy "
        "output is token-identical to plain decoding)",
        description="Draw --samples continuations of the prompt with each --drafter and test them against the "
        "target's exact (warped) distribution, computed from the target itself: all continuations of up to "
        "--max-new-tokens tokens when few enough, else the next-token distribution after every observed "
        "prefix. Prints, per method, the chi-square p-value, the estimated total variation distance to the "
        "target with a 95% interval, the smallest TV deviation the run detects with 80% power, and "
        "PASS/FAIL (FAIL when p < --alpha). Exits 1 if any method fails. With --greedy: decode prompts greedily "
        "with each --drafter and plainly, same dtype and --compile, and report the identical fraction and, for each "
        "divergence, its position and the plain pass's top-2 logit gap there (a near-tie or a bug); exits 1 if any "
        "prompt diverges.",
    )
    parser.add_argument("--greedy", action="store_true",
                        help="check greedy token identity with plain decoding over prompts (--prompt, --prompt-ids, "
                        "--prompts; default --prompts code) instead of the statistical test")
    parser.add_argument("--target", help="target model: local path or hub id (default: the shipped pair)")
    parser.add_argument("--draft", help="draft model path or hub id (another tokenizer: see --draft-tokenizer)")
    from specdec.cli.generate import add_draft_tokenizer_arg

    add_draft_tokenizer_arg(parser)
    parser.add_argument("--drafter", action="append", **drafter_choices("plain"), default=None,
                        help="method to check; repeat to check several (default: 'draft' when a draft model is "
                        "available, else 'plain')")
    parser.add_argument("--prompt", action="append", default=None,
                        help="the prompt text (tokenized with the target's tokenizer); --greedy: repeat for several")
    parser.add_argument("--prompt-ids", action="append", default=None,
                        help="the prompt as comma-separated token ids, e.g. 5,9,3; --greedy: repeat for several")
    parser.add_argument("--prompts", default=None, metavar="WORKLOAD",
                        help="--greedy: the bench's prompts too: 'code' (held-out stdlib files), 'edit', or a prompt "
                        "file (default 'code' when no prompt is given)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"--greedy: how many --prompts to use (default {GREEDY_PROMPTS}; --seed picks them)")
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
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="draft-vocab, self-draft-*: draft from the default pair's N most frequent tokens "
                             "(draft-vocab's default 2048; the self-drafts' the whole vocabulary)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", default=None,
                        help="model dtype: float32, bfloat16, float16, float64, auto (default float32 on CPU)")
    parser.add_argument("--compile", action="store_true",
                        help="--greedy: both decodes on the fast path (slot KV cache, compiled passes)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="ROWS",
                        help="--greedy: decode with generate_batch, ROWS prompts at a time, and compare each row "
                        "with its prompt decoded alone")
    add_weights_arg(parser)
    add_threads_arg(parser)
    parser.set_defaults(func=run, temperature=None, max_new_tokens=None, seed=0)
    # The shared decoding options document generate's defaults; state verify's own.
    own = {"max_new_tokens": "continuation length L checked (default 3; all continuations are enumerated "
                             f"when min(V, top-k)^L <= 50000); --greedy: new tokens per prompt, {GREEDY_TOKENS} unless given",
           "temperature": "sampling temperature > 0 (default 1.0); 0 checks greedy token identity in distribution "
                          "(--greedy compares outputs on many prompts)",
           "seed": "random seed of the draws (default 0); --greedy: which --prompts are drawn"}
    for action in parser._actions:
        if action.dest in own:
            action.help = own[action.dest]


#: --greedy's defaults: prompts drawn from --prompts code, new tokens per prompt.
GREEDY_PROMPTS, GREEDY_TOKENS = 8, 128


def _ids(text: str, what: str) -> list[int]:
    from specdec.errors import ConfigError

    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, e.g. 5,9,3; got {text!r}") from None


def _load(args, need_tokenizer: bool):
    """(target, draft or None, tokenizer or None); the tokenizer is only needed for text prompts."""
    import specdec
    from specdec.hub.loading import check_device, load_model, load_tokenizer, resolve_dtype
    from specdec.runtime.threads import apply_threads
    from specdec.runtime.weights import pack_model

    check_device(args.device)
    apply_threads(args)
    if args.target is None:
        target, draft, tokenizer = specdec.load_default(device=args.device,
                                                        dtype=resolve_dtype(args.dtype, args.device))
        if args.weights:  # the shipped pair, loaded in float
            target, draft = pack_model(target, args.weights), pack_model(draft, args.weights)
    else:
        target = load_model(args.target, args.device, args.dtype, args.weights)
        draft = None
        tokenizer = load_tokenizer(args.target) if need_tokenizer else None
    if args.draft is not None:  # its own tokenizer, if another, is translated (as `specdec generate` does)
        draft = load_model(args.draft, args.device, args.dtype, args.weights)
    return target, draft, tokenizer


def _say_weights(console, args) -> None:
    """--weights: what every result below holds for (the models' linear layers on packed weights of that format)."""
    if args.weights:
        console.print(f"target and draft model on packed {args.weights} weights (--weights): every result below is "
                      "for that model")


def _eos(args) -> list[int] | None:
    """--eos: None (the tokenizer's), [] for "none", or the listed ids."""
    return None if args.eos is None else ([] if args.eos.lower() == "none" else _ids(args.eos, "--eos"))


def _drafters(args, target, draft, tokenizer):
    """(kind, drafter) for each --drafter once (None for "plain"), each built with the options that apply to it
    (several kinds may be checked in one run)."""
    from specdec.cli.generate import draft_tokenizer_options, vocab_tokenizer_options
    from specdec.drafters import DRAFTER_OPTIONS, make_drafter

    kinds = args.drafter or (["draft"] if draft is not None else ["plain"])
    options = {"ngram_max": args.ngram_max, "ngram_min": args.ngram_min, "draft_layers": args.draft_layers,
               "bigram_path": args.bigram, "draft_vocab": args.draft_vocab}
    for kind in dict.fromkeys(kinds):
        applicable = {k: v for k, v in options.items() if k in DRAFTER_OPTIONS.get(kind, {})}
        if draft is not None:
            applicable.update(draft_tokenizer_options(args, kind, tokenizer))
        applicable.update(vocab_tokenizer_options(kind, tokenizer))
        yield kind, None if kind == "plain" else make_drafter(kind, target=target, draft=draft, **applicable)


def _p_text(p: float) -> str:
    return "< 1e-300" if p == 0.0 else f"{p:.3g}"


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from specdec.cli.generate import parse_gamma
    from specdec.errors import ConfigError
    from specdec.exactness import check_exactness
    from specdec.exactness.verifier import settings_text
    from specdec.engine.text import encode_prompt

    if args.greedy:
        return run_greedy(args)
    if args.samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {args.samples}")
    for flag, value in (("--prompts", args.prompts), ("--num-prompts", args.num_prompts),
                        ("--compile", args.compile or None), ("--batch-size", args.batch_size)):
        if value is not None:
            raise ConfigError(f"{flag} applies to --greedy; the statistical check takes one --prompt or --prompt-ids")
    given = (args.prompt or []) + (args.prompt_ids or [])
    if len(given) != 1:
        raise ConfigError(f"verify checks one prompt: pass one --prompt or --prompt-ids (got {len(given)}); "
                          "--greedy checks several")
    if args.temperature is None:
        args.temperature = 1.0
    if args.max_new_tokens is None:
        args.max_new_tokens = 3
    target, draft, tokenizer = _load(args, need_tokenizer=args.prompt is not None)
    prompt_ids = encode_prompt(tokenizer, args.prompt[0]) if args.prompt else _ids(args.prompt_ids[0], "--prompt-ids")
    eos = _eos(args)
    console = Console(stderr=args.json, highlight=False)
    _say_weights(console, args)
    results = []
    for kind, drafter in _drafters(args, target, draft, tokenizer):
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
        print(json.dumps({"passed": passed, "weights": args.weights, "results": [r.to_dict() for r in results]},
                         indent=2))
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


def _greedy_options(args) -> None:
    """Refuse options --greedy does not take and fill its defaults, before any model loads."""
    from specdec.errors import ConfigError

    if args.temperature not in (None, 0.0):
        raise ConfigError(f"--greedy decodes at temperature 0; drop --temperature {args.temperature:g} (or drop "
                          "--greedy to test sampling statistically)")
    for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)):
        if value is not None:
            raise ConfigError(f"{flag} does nothing at temperature 0: drop it with --greedy")
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.num_prompts is not None and (args.prompt or args.prompt_ids) and args.prompts is None:
        raise ConfigError("--num-prompts counts --prompts: pass --prompts code (or edit, or a file) with it")
    if args.max_new_tokens is None:
        args.max_new_tokens = GREEDY_TOKENS


def _greedy_prompts(args, tokenizer) -> list:
    """--greedy's prompts as BenchPrompts: --prompt texts, --prompt-ids, then --prompts (default 'code' when no
    prompt is given)."""
    from specdec.bench.workloads import BenchPrompt, load_workload, user_prompts

    prompts = [BenchPrompt(name=f"text-{i}", ids=p.ids, text=p.text, source="--prompt")
               for i, p in enumerate(user_prompts(tokenizer, args.prompt or [], source="--prompt"))]
    prompts += [BenchPrompt(name=f"ids-{i}", ids=_ids(text, "--prompt-ids"), text=text, source="--prompt-ids")
                for i, text in enumerate(args.prompt_ids or [])]
    workload = args.prompts or (None if prompts else "code")
    if workload is not None:
        count = GREEDY_PROMPTS if args.num_prompts is None else args.num_prompts
        prompts += load_workload(workload, tokenizer, count, seed=args.seed)
    return prompts


def run_greedy(args) -> int:
    from rich.console import Console

    from specdec.cli.generate import parse_gamma
    from specdec.exactness import check_greedy, plain_reference

    _greedy_options(args)
    target, draft, tokenizer = _load(args, need_tokenizer=bool(args.prompt) or not args.prompt_ids
                                     or args.prompts is not None)
    prompts = _greedy_prompts(args, tokenizer)
    eos = _eos(args)
    console = Console(stderr=args.json, highlight=False)
    _say_weights(console, args)
    if args.compile:
        _say_when_compiling()
    named = {p.name: p.ids for p in prompts}
    settings = {"max_new_tokens": args.max_new_tokens, "eos_token_id": eos, "compile": args.compile}
    with console.status(f"plain decoding: {len(prompts)} prompts x {args.max_new_tokens} tokens ..."):
        reference = plain_reference(target, named, **settings)  # once for every --drafter
    reports = []
    for kind, drafter in _drafters(args, target, draft, tokenizer):
        with console.status(f"greedy {kind}: {len(prompts)} prompts x {args.max_new_tokens} tokens ..."):
            reports.append(check_greedy(target, named, drafter, method=kind, gamma=parse_gamma(args.gamma),
                                        batch_size=args.batch_size, reference=reference, **settings))
    passed = all(r.passed for r in reports)
    if args.json:
        results = [r.to_dict() for r in reports]
        for d in (d for r in results for d in r["divergences"]):
            d["plain_text"], d["method_text"] = _piece(tokenizer, d["plain_token"]), _piece(tokenizer, d["method_token"])
        print(json.dumps({"passed": passed, "weights": args.weights, "results": results}, indent=2))
    else:
        for r in reports:
            _print_greedy(console, r, tokenizer)
    return 0 if passed else 1


def _say_when_compiling() -> None:
    import logging
    import sys

    logging.getLogger("specdec.fastpath").setLevel(logging.INFO)  # say when a shape compiles
    if not logging.getLogger().handlers:
        logging.basicConfig(format="[specdec] %(message)s", stream=sys.stderr)


def _piece(tokenizer, token: int | None) -> str | None:
    """A token's text (None: no token, or no tokenizer)."""
    return None if token is None or tokenizer is None else tokenizer.decode([token])


def _token(tokenizer, token: int | None) -> str:
    piece = _piece(tokenizer, token)
    return "(ended)" if token is None else str(token) if piece is None else f"{piece!r} ({token})"


def _print_greedy(console, r, tokenizer) -> None:
    from rich.markup import escape
    from rich.table import Table

    from specdec.exactness import NEAR_TIE_ULPS

    path = {False: "eager", True: "compiled", "static": "slot cache"}[r.compile]
    how = "alone" if r.batch_size is None else f"generate_batch, {r.batch_size} rows"
    verdict = "[green]PASS[/]" if r.passed else "[bold red]FAIL[/]"
    console.print(f"[bold]Greedy identity with plain decoding[/]  {r.method} ({how}), {r.dtype}, {path}, "
                  f"{r.prompts} prompts x {r.max_new_tokens} new tokens: {verdict}")
    console.print(f"identical: {r.identical}/{r.prompts} prompts ({100 * r.identical_fraction:.1f}%), "
                  f"{r.tokens_compared} tokens compared; accepted {r.accepted}/{r.drafted} drafted; "
                  f"{r.near_ties} of {r.plain_steps} plain steps were near-ties (top-2 gap <= {NEAR_TIE_ULPS} ulp)")
    if r.divergences:
        table = Table(show_edge=False, pad_edge=False)
        for column in ("prompt", "position", "plain", "method", "top-2 gap", "margin", "reading"):
            table.add_column(column, justify="right" if column in ("position", "top-2 gap", "margin") else "left")
        for d in r.divergences:
            if d.margin is None:
                margin, reading = "-", "[bold red]one output ended early: a bug[/]"
            else:
                margin = f"{d.margin:.4g} ({d.ulps:.3g} ulp)"
                reading = ("near-tie: rounding" if d.near_tie else
                           "[bold red]large: the method's token is not the target's; a bug[/]")
            table.add_row(d.prompt, str(d.position), escape(_token(tokenizer, d.plain_token)),
                          escape(_token(tokenizer, d.method_token)), "-" if d.gap is None else f"{d.gap:.4g}",
                          margin, reading)
        console.print(table)
    for note in r.notes:
        console.print(f"[yellow]{r.method}: {note}[/]")
    if r.divergences:
        console.print("[dim]top-2 gap: the plain pass's best logit minus its second-best at the divergence; margin: "
                      f"its best minus its logit of the method's token, also in units of the last place (ulp) of "
                      f"{r.dtype}: a few ulp is a near-tie that a pass of another shape rounded the other way[/]")
