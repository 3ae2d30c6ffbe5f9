"""`specdec demo`: the main job. Continue a held-out stdlib prompt with the default pair, streaming the text,
then compare plain and speculative decoding side by side."""

from __future__ import annotations

import statistics


def register(subparsers) -> None:
    from specdec.cli.generate import add_decoding_args

    parser = subparsers.add_parser(
        "demo",
        help="see speculative decoding work on the shipped default model pair (offline)",
        description="Continues a held-out Python standard-library prompt with the shipped default pair "
        "(a target and a ~10x cheaper draft trained by specdec on the stdlib), streams the text coloured by "
        "where each token came from, then times plain and speculative decoding on the same prompt.",
    )
    parser.add_argument("--prompt", default=None, help="your own prompt text (default: a held-out stdlib file)")
    parser.add_argument("--prompt-index", type=int, default=0, help="which held-out prompt to use (default 0)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method; medians shown (default 3)")
    add_decoding_args(parser)
    parser.set_defaults(func=run, max_new_tokens=128)


def _speculative_stream(console, decoder, tokenizer, prompt_ids):
    """Print the continuation as it is produced: accepted draft tokens in green, target tokens in blue."""
    from rich.text import Text

    from specdec.text import detokenize

    style = {"accepted": "green", "recovered": "bold blue", "bonus": "blue", "target": "blue"}
    tokens: list[int] = []

    def collect():
        for token in decoder.stream(prompt_ids):
            tokens.append(token)
            yield token

    for piece in detokenize(tokenizer, collect()):
        console.print(Text(piece, style=style[decoder.last_token_source]), end="")
    console.print()
    return tokens


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    import specdec
    from specdec.cli.generate import parse_gamma
    from specdec.decoding import SpeculativeDecoder
    from specdec.stats import expected_speedup
    from specdec.text import encode_prompt

    console = Console(highlight=False)
    target, draft, tokenizer = specdec.load_default()
    if args.prompt is not None:
        prompt_ids, source = encode_prompt(tokenizer, args.prompt), "your prompt"
    else:
        from specdec.training.corpus import heldout_prompts

        prompts = heldout_prompts(tokenizer, args.prompt_index + 1, prompt_tokens=160, seed=0)
        prompt_ids, source = prompts[args.prompt_index], "a held-out file of Python's standard library"
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    console.rule("[bold]specdec demo")
    console.print(
        f"Target: {n_target / 1e6:.1f}M-parameter Llama; draft: {n_draft / 1e6:.1f}M ({n_target / n_draft:.0f}x "
        f"smaller). Both trained by specdec on the Python standard library.\n"
        f"Prompt: the end of {source} ({len(prompt_ids)} tokens):"
    )
    console.print(tokenizer.decode(prompt_ids[-60:]), style="dim", markup=False)
    console.rule("continuation (speculative decoding)")
    console.print("[green]green[/] = draft tokens the target accepted, [blue]blue[/] = tokens from the target "
                  "(a correction, or the bonus after a fully accepted draft)\n")

    settings = dict(gamma=parse_gamma(args.gamma), max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=[])
    seed = 0 if args.seed is None else args.seed

    def decoder(drafter):
        return SpeculativeDecoder(target, drafter, seed=seed, **settings)

    spec = decoder(specdec.DraftModel(draft))
    spec_tokens = _speculative_stream(console, spec, tokenizer, prompt_ids)

    # Time both methods on the same prompt, interleaved, after a warm-up.
    runs: dict[str, list] = {"plain": [], "speculative": []}
    outputs: dict[str, list[int]] = {}
    with console.status("timing plain vs speculative decoding..."):
        list(decoder(None).stream(prompt_ids))  # warm-up (the speculative one ran while streaming)
        for _ in range(max(1, args.repeats)):
            for name in runs:
                d = decoder(specdec.DraftModel(draft) if name == "speculative" else None)
                outputs[name] = list(d.stream(prompt_ids))
                runs[name].append(d.stats)

    def median(name, attr):
        return statistics.median(getattr(s, attr) for s in runs[name])

    plain_tps = median("plain", "tokens_per_s")
    table = Table(title="plain vs speculative decoding (same target, same prompt; medians of "
                        f"{max(1, args.repeats)} runs)")
    for column in ("method", "tokens/s", "speedup", "α (acceptance)", "τ (tokens / target pass)",
                   "target passes"):
        table.add_column(column, justify="right" if column != "method" else "left")
    for name in runs:
        tps = median(name, "tokens_per_s")
        drafted = name == "speculative"
        table.add_row(
            name if not drafted else f"speculative (γ={args.gamma})",
            f"{tps:.1f}", f"{tps / plain_tps:.2f}x",
            f"{median(name, 'acceptance_rate'):.2f}" if drafted else "-",
            f"{median(name, 'mean_accepted_tokens'):.2f}",
            f"{int(median(name, 'target_forwards'))}",
        )
    console.print(table)
    s = runs["speculative"][-1]
    if isinstance(settings["gamma"], int):
        alpha = s.estimated_alpha
        predicted = expected_speedup(alpha, settings["gamma"], s.cost_ratio)
        console.print(f"Theory (Leviathan et al.): a draft token is accepted with probability α≈{alpha:.2f} "
                      f"(accepted / tested) and costs c={s.cost_ratio:.2f} of a target pass, so the expected "
                      f"speedup is τ/(γc+1) = {predicted:.2f}x, ignoring that a target pass over γ+1 tokens "
                      "costs more than over one.")
    if args.temperature == 0:
        same = outputs["plain"] == outputs["speculative"] == spec_tokens
        console.print(f"Greedy outputs identical, token for token: [bold]{'yes' if same else 'NO'}[/]")
        return 0 if same else 1
    console.print("Sampling (T > 0): outputs differ run to run, but follow the target's distribution exactly "
                  "(see `specdec verify`).")
    return 0
