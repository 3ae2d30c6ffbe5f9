"""`specdec demo`: the main job. Loads the default pair in the precision this machine computes fastest
(`dtype="auto"`), picks the fastest exact method by a short measurement (the compiled fast path included),
streams a sampled continuation coloured by where each token came from, then times plain Hugging Face
`generate` (float32, and the same dtype when that differs), specdec's plain decoding (same path as the method)
and the method side by side on several held-out prompts of different kinds, and ends with one line to quote."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

#: Held-out prompts shown and timed (kind, index), and those used only to choose the method.
SHOWN = (("code", 0), ("code", 1), ("edit", 0), ("edit", 1))
CALIBRATION = (("code", 2), ("edit", 2))
#: The prompt whose sampled continuation is streamed: a function rewrite reads more like Python than the
#: middle of a file (often a data table) continued by a 14M-parameter model.
STREAMED = 3
SOURCE_STYLE = {"accepted": "green", "recovered": "yellow", "bonus": "cyan", "target": ""}


def register(subparsers) -> None:
    from specdec.runtime.threads import add_threads_arg

    parser = subparsers.add_parser(
        "demo",
        help="see speculative decoding work on the shipped default model pair (offline; 1.5–5 minutes, the "
             "first run the longest: it compiles)",
        description="Chooses the fastest exact method on this machine (a short timing on held-out prompts "
        "that are not shown), streams a sampled continuation coloured by where each token came from, then "
        "times plain Hugging Face generate, specdec's plain decoding and the method on held-out Python "
        "prompts of two kinds (continuing a file; rewriting a function, which repeats the prompt) and "
        "prints medians, spread, α, τ, target passes and whether the greedy outputs are identical.",
    )
    parser.add_argument("--prompt", default=None,
                        help="your own prompt text: time and stream this one instead of the held-out prompts")
    parser.add_argument("--prompt-index", type=int, default=None,
                        help=f"which held-out prompt to stream, 0..{len(SHOWN) - 1} (0, 1: code continuation; 2, "
                        f"3: rewrite a function; default {STREAMED})")
    parser.add_argument("--method", default="auto",
                        help="the method to show: 'auto' (default: measured on this machine), or one of "
                        "draft-g3, draft-heuristic, draft-auto, prompt-lookup-auto, draft-tree, draft-g3-compiled, "
                        "draft-g6-compiled, draft-auto-compiled, eagle-compiled")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the compiled fast path when choosing the method (default; it compiles first: "
                        "seconds a shape with a warm inductor cache, a few minutes on a cold one); --no-compile "
                        "chooses among the eager methods only")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="precision of both models: auto (default: bfloat16 where this machine computes it "
                        "natively, measured once; else float32), float32, bfloat16, float16. HF generate is timed "
                        "in float32 too, as the baseline a transformers user has")
    parser.add_argument("--gamma", default=None,
                        help="shortcut for the draft model with this fixed γ (an integer >= 1) or 'auto'")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs per method and prompt; medians shown (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per continuation (default 128)")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="temperature of the streamed, sampled continuation (default 0.7; timings are greedy)")
    parser.add_argument("--top-p", type=float, default=0.95, help="top-p of the sampled continuation (default 0.95)")
    parser.add_argument("--top-k", type=int, default=None, help="top-k of the sampled continuation (default off)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled continuation (default 0)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (method, median_speedup_vs_hf_generate, "
                        "median_speedup_vs_plain, greedy_identical, per-prompt numbers) instead of the show")
    add_threads_arg(parser)
    parser.set_defaults(func=run)


def _validate(args):
    """Every option checked before anything loads or prints; returns the fixed candidate or None (calibrate)."""
    from specdec.bench.candidates import CANDIDATES, Candidate, draft_model_candidate, get_candidate
    from specdec.errors import ConfigError
    from specdec.core.sampling import SamplingConfig
    from specdec.runtime.threads import parse_threads

    for name in ("repeats", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.threads = parse_threads(args.threads)
    if args.temperature <= 0:
        raise ConfigError(f"--temperature is for the sampled continuation and must be > 0, got {args.temperature} "
                          "(the timed runs are greedy already)")
    SamplingConfig(args.temperature, args.top_k, args.top_p)
    count = 1 if args.prompt is not None else len(SHOWN)
    if args.prompt_index is None:
        args.prompt_index = STREAMED if args.prompt is None else 0
    if not 0 <= args.prompt_index < count:
        raise ConfigError(f"--prompt-index must be in 0..{count - 1}, got {args.prompt_index}"
                          + (" (with --prompt there is one prompt)" if args.prompt is not None else ""))
    if args.gamma is not None:
        if args.method != "auto":
            raise ConfigError("give --method or --gamma, not both")
        gamma = args.gamma if args.gamma == "auto" else int(args.gamma) if args.gamma.isdigit() else None
        if gamma is None or gamma == 0:
            raise ConfigError(f"--gamma must be an integer >= 1 or 'auto', got {args.gamma!r}")
        return Candidate(f"draft-g{gamma}", f"draft model, γ = {gamma}", draft_model_candidate(lambda: gamma),
                         needs_draft=True)
    return None if args.method == "auto" else get_candidate(args.method, CANDIDATES)


#: Cache slots a request needs beyond its prompt and new tokens: its widest round (γ + 1 rows, a tree's nodes).
CAPACITY_ROOM = 64


def _prompts(tokenizer, kinds):
    from specdec.bench.workloads import code_prompts, edit_prompts

    needed = {kind: 1 + max(i for k, i in (*SHOWN, *CALIBRATION) if k == kind) for kind in ("code", "edit")}
    pools = {"code": code_prompts(tokenizer, needed["code"], prompt_tokens=128, seed=0),
             "edit": edit_prompts(tokenizer, needed["edit"], seed=0)}
    return [pools[kind][i] for kind, i in kinds]


def _hf_generate(target, prompt_ids, max_new_tokens, pad_token_id):
    """Plain `model.generate` (greedy, EOS off, exactly max_new_tokens): what a user runs without specdec."""
    import time

    import torch

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=pad_token_id)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start


def _stream(console, decoder, tokenizer, prompt_ids):
    """Print the continuation as tokens become final, coloured by where each came from."""
    from rich.text import Text

    from specdec.engine.text import detokenize

    def tokens():
        for token in decoder.stream(prompt_ids):
            yield token

    # detokenize yields a piece when the text grows; colour it by the source of the token that completed it.
    for piece in detokenize(tokenizer, tokens()):
        console.print(Text(piece, style=SOURCE_STYLE.get(decoder.last_token_source, "")), end="")
    console.print()


def _dtype_why(asked: str, dtype: str) -> str:
    if asked != "auto":
        return "as asked"
    # The verdict is measured (runtime/precision.py), not read off the flags: an AVX2 CPU without native bfloat16
    # instructions still passes when its kernels read half the bytes.
    verdict = "pays" if dtype == "bfloat16" else "does not pay"
    return f"chosen: bfloat16 measured against float32 on this CPU, and it {verdict}"


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(dtype, dtype)


def _same_as_hf(rows, low: bool) -> str:
    same = sum(r["same_as_hf_generate"] for r in rows)
    note = " (HF's kernels round differently in low precision: a near-tie can differ)" if low else ""
    return f"{same}/{len(rows)} prompts{note}"


def _spread(values):
    return statistics.median(values), min(values), max(values)


def run(args) -> int:
    from rich.console import Console

    fixed = _validate(args)
    console = Console(highlight=False, quiet=args.json)
    from specdec.runtime.threads import apply_threads, decode_threads

    apply_threads(args)
    import specdec
    from specdec.bench.candidates import Models
    from specdec.engine.text import encode_prompt

    with console.status("loading the default model pair..."):
        target, draft, tokenizer = specdec.load_default(dtype=args.dtype)
        dtype = str(target.dtype).removeprefix("torch.")
        models = Models(target, draft, tokenizer)
        if args.prompt is not None:
            from specdec.bench.workloads import BenchPrompt

            ids = encode_prompt(tokenizer, args.prompt)
            shown = [BenchPrompt(name="your prompt", ids=list(ids), text=args.prompt, source="--prompt")]
            calibration_prompts = _prompts(tokenizer, CALIBRATION)
        else:
            prompts = _prompts(tokenizer, SHOWN + CALIBRATION)
            shown, calibration_prompts = prompts[:len(SHOWN)], prompts[len(SHOWN):]
        # every request's cache slots at most (prompt, new tokens, a padded round): the fast path sizes its caches
        # once, so each compiled shape compiles once whatever the prompt's length
        models.capacity = (max(len(p.ids) for p in (*shown, *calibration_prompts)) + max(args.max_new_tokens, 64)
                           + CAPACITY_ROOM)
    # HF generate and specdec are timed with the same count: the measured one (README "Threads"), pinned.
    how = "--threads" if args.threads != "auto" else "measured; --threads N to choose"
    args.threads = decode_threads(target)
    specdec.set_threads(args.threads)
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    from specdec.runtime.precision import cpu_family_model, cpu_model
    from specdec.runtime.rowwise import kernel_tier

    family = cpu_family_model()
    console.rule("[bold]specdec demo")
    console.print(
        f"Target: {n_target / 1e6:.1f}M-parameter Llama; draft: {n_draft / 1e6:.1f}M ({n_target / n_draft:.0f}x "
        f"smaller), both trained by specdec on the Python standard library. {dtype} ({_dtype_why(args.dtype, dtype)}); "
        f"CPU: {cpu_model()}{f' ({family})' if family else ''}, kernels built for its {kernel_tier()} tier; "
        f"{args.threads} thread(s) ({how}), load average {load:.2f} on {os.cpu_count()} cores."
    )

    # 1. Choose the method by measurement (or take the user's).
    chosen, calibration = _choose(console, args, fixed, models, calibration_prompts)
    # 2. Stream one sampled continuation (small models loop under greedy decoding; sampling reads better).
    streamed = shown[args.prompt_index]
    s, sampled_tokens = _sample(console, args, chosen, models, streamed)
    # 3. Time HF generate, specdec plain (same path) and the method, greedy, interleaved and rotated.
    rows = _time(console, args, chosen, models, shown)

    identical = all(r["greedy_identical"] for r in rows)
    vs_hf = _spread([r["speedup_vs_hf_generate"] for r in rows])
    vs_plain = _spread([r["speedup_vs_plain"] for r in rows])
    same_dtype = ([r["speedup_vs_hf_generate_same_dtype"] for r in rows] if dtype != "float32" else None)
    result = {
        "method": chosen.name,
        "method_summary": chosen.summary,
        "dtype": dtype,
        "median_speedup_vs_hf_generate": round(vs_hf[0], 3),
        "median_speedup_vs_plain": round(vs_plain[0], 3),
        "speedup_vs_hf_generate_range": [round(vs_hf[1], 3), round(vs_hf[2], 3)],
        "speedup_vs_plain_range": [round(vs_plain[1], 3), round(vs_plain[2], 3)],
        "median_speedup_vs_hf_generate_same_dtype": (round(statistics.median(same_dtype), 3)
                                                     if same_dtype else None),
        "greedy_identical": identical,
        "prompts": rows,
        "calibration": None if calibration is None else {
            name: {"speedup_vs_eager_plain_geomean": round(calibration.score(name), 3),
                   "per_prompt": [round(v, 3) for v in values]}
            for name, values in calibration.speedups.items()},
        "sampled": {"prompt": streamed.name, "temperature": args.temperature, "top_p": args.top_p,
                    "top_k": args.top_k, "seed": args.seed, "acceptance_rate": s.acceptance_rate,
                    "tau": s.mean_accepted_tokens,
                    **({"text": tokenizer.decode(sampled_tokens)} if args.json else {})},
        "cpu": cpu_model(), "cpu_family_model": family, "kernel_tier": kernel_tier(),
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "threads": args.threads,
        "load_average_at_start": round(load, 2),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0 if identical else 1
    _show(console, chosen, chosen.drafter(models)[1], rows, result, vs_hf, vs_plain)
    return 0 if identical else 1


def _choose(console, args, fixed, models, calibration_prompts):
    """1. (the method, the calibration or None): the user's method, or the fastest exact one against plain
    decoding on the calibration prompts (not the shown ones)."""
    from specdec.bench.candidates import CANDIDATES, calibrate

    calibration = None
    if fixed is not None:
        chosen = fixed
        console.print(f"Method: [bold]{chosen.name}[/] ({chosen.summary}), as asked.")
    else:
        candidates = [c for c in CANDIDATES
                      if c.calibrated and c.available(models) and (args.compile or not c.compiled)]
        skipped = [c for c in CANDIDATES if c.calibrated and c.compiled and not args.compile]
        with console.status(f"choosing the method: timing {len(candidates)} exact methods against plain decoding "
                            f"on {len(calibration_prompts)} held-out prompts that are not shown below..."):
            calibration = calibrate(models, candidates, [p.ids for p in calibration_prompts],
                                    max_new_tokens=min(64, args.max_new_tokens),
                                    on_setup=lambda note: console.print(f"[dim]{note}[/]"))
        chosen = next(c for c in candidates if c.name == calibration.best())
        console.print("Method chosen by measurement (speed over specdec's plain decoding on the eager path, "
                      "geometric mean over "
                      f"{len(calibration_prompts)} held-out prompts not shown below, greedy, "
                      f"{min(64, args.max_new_tokens)} tokens):")
        for c in candidates:
            mark = "[bold]→[/]" if c is chosen else " "
            console.print(f"  {mark} {c.name:<20} {calibration.score(c.name):5.2f}x  [dim]{c.summary}[/]")
        for c in skipped:
            console.print(f"    {c.name:<20}   not measured  [dim]{c.summary}; measured unless --no-compile[/]")
    if chosen.setup_note and fixed is not None:
        console.print(f"[dim]{chosen.setup_note}[/]")
    return chosen, calibration


def _sample(console, args, chosen, models, streamed):
    """2. one sampled continuation of `streamed`, coloured by token source (or collected, with --json).
    Returns (its stats, its tokens or None)."""
    tokenizer = models.tokenizer
    sample_settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, eos_token_id=[], seed=args.seed)
    console.rule(f"{streamed.name} ({streamed.source}): prompt tail, then a sampled continuation")
    console.print(tokenizer.decode(streamed.ids[-60:]), style="dim", markup=False)
    console.print("[dim]── continuation ──[/]  colours: [green]accepted draft token[/], [yellow]recovered "
                  "(the target's correction of a rejected draft)[/], [cyan]bonus (after a fully accepted draft)"
                  "[/]\n")
    # A compiled method samples on its fast path's caches and kernels with eager passes: sampling's passes are
    # shapes of their own, and this run is shown, not timed (a cold machine would spend a minute compiling them).
    sampler = chosen.decoder(models, uncompiled=True, **sample_settings)
    sampled_tokens = None
    if args.json:
        sampled_tokens = list(sampler.stream(streamed.ids))
    else:
        _stream(console, sampler, tokenizer, streamed.ids)
    s = sampler.stats
    top = "" if args.top_p is None else f", top-p {args.top_p:g}"
    path = " (its passes uncompiled: not timed)" if chosen.compiled else ""
    console.print(f"[dim](sampled at T={args.temperature:g}{top}, seed {args.seed}{path}: exactly the target's own "
                  f"distribution; α {s.acceptance_rate:.2f}, τ {s.mean_accepted_tokens:.2f})[/]")
    return s, sampled_tokens


def _time(console, args, chosen, models, shown) -> list[dict]:
    """3. HF generate (float32, and the models' dtype when that differs), specdec plain (the method's path) and
    the method, greedy, timed interleaved and rotated on each shown prompt. Returns one row per prompt (`_row`)."""
    import copy

    import torch

    target, tokenizer = models.target, models.tokenizer
    greedy = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, eos_token_id=[], seed=0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # What a transformers user runs: HF generate in float32 (the same weights, cast up exactly).
    target_f32 = target if target.dtype == torch.float32 else copy.deepcopy(target).float()
    runners = {"hf": lambda p: (_hf_generate(target_f32, p, args.max_new_tokens, pad), None)}
    if target_f32 is not target:
        runners["hf_same_dtype"] = lambda p: (_hf_generate(target, p, args.max_new_tokens, pad), None)
    runners["plain"] = lambda p: _specdec(chosen.decoder(models, speculative=False, **greedy), p)
    runners["spec"] = lambda p: _specdec(chosen.decoder(models, **greedy), p)
    rows = []
    with console.status("timing HF generate, specdec plain and speculative decoding (greedy)...") as status:
        for name in runners:  # warm-up: HF once; specdec on every prompt (a longer one may need a larger cache's
            for prompt in shown if name in ("plain", "spec") else shown[:1]:  # compiled passes)
                runners[name](prompt.ids)
        for i, prompt in enumerate(shown):
            status.update(f"timing {prompt.name} ({i + 1}/{len(shown)}): HF generate, specdec plain and "
                          f"speculative, {args.repeats} run(s) each, interleaved...")
            walls = {name: [] for name in runners}
            outputs, stats = {}, {}
            for r in range(args.repeats):
                names = list(runners)
                for name in names[r % len(names):] + names[: r % len(names)]:
                    (tokens, wall), st = runners[name](prompt.ids)
                    walls[name].append(wall)
                    outputs.setdefault(name, []).append(tokens)
                    if st is not None:
                        stats.setdefault(name, []).append(st)
            rows.append(_row(prompt, walls, outputs, stats, args.max_new_tokens))
    return rows


def _specdec(decoder, prompt_ids):
    """((tokens, wall seconds), stats) of one specdec request."""
    from specdec.bench.candidates import timed_run

    return timed_run(decoder, prompt_ids), decoder.stats


def _row(prompt, walls, outputs, stats, max_new_tokens):
    med = {name: statistics.median(w) for name, w in walls.items()}
    spec = stats["spec"][-1]
    plain = stats["plain"][-1]
    tested = sum(st.accepted + st.recovered for st in stats["spec"])
    accepted = sum(st.accepted for st in stats["spec"])
    drafted = sum(st.drafted for st in stats["spec"])
    # A target pass over the drafts vs a one-token pass (Leviathan's model assumes they cost the same).
    per_pass = lambda st: st.target_s / st.target_forwards if st.target_forwards else 0.0  # noqa: E731
    verify_cost = per_pass(spec) / per_pass(plain) if per_pass(plain) else None
    reference = outputs["plain"][0]
    return {
        "prompt": prompt.name, "source": prompt.source, "prompt_tokens": len(prompt.ids),
        "tokens_per_s": {name: round(max_new_tokens / w, 1) for name, w in med.items()},
        "speedup_vs_hf_generate": med["hf"] / med["spec"],
        "speedup_vs_hf_generate_same_dtype": med.get("hf_same_dtype", med["hf"]) / med["spec"],
        "speedup_vs_plain": med["plain"] / med["spec"],
        "plain_vs_hf_generate": med["hf"] / med["plain"],
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_per_token": accepted / tested if tested else 0.0,
        "tau": spec.mean_accepted_tokens,
        "target_passes": {"speculative": spec.target_forwards, "plain": plain.target_forwards},
        "mean_gamma": drafted / max(1, sum(sum(1 for g in st.gammas if g) for st in stats["spec"])),
        "cost_ratio": spec.cost_ratio,
        "verify_pass_cost": verify_cost,
        # The promise: the method's tokens are plain decoding's, in the models' dtype, on the same path.
        "greedy_identical": all(out == reference for name in ("plain", "spec") for out in outputs[name]),
        # HF generate in the same dtype runs other kernels (in bfloat16 they round differently), so this one
        # can differ at a near-tie: shown, not promised.
        "same_as_hf_generate": all(out == reference for out in outputs.get("hf_same_dtype", outputs["hf"])),
    }


def _show(console, chosen, gamma, rows, result, vs_hf, vs_plain) -> None:
    """The table, the summary, the two α's, theory vs measurement, and the line to quote. `gamma`: the
    method's γ when it is fixed (the theory line applies), else its policy."""
    from rich.table import Table

    from specdec.core.stats import expected_speedup, expected_tokens_per_pass

    table = Table(title=f"tokens/s and speedups of {chosen.name}: greedy, {result['max_new_tokens']} new tokens, "
                        f"median of {result['repeats']} interleaved run(s) per prompt", box=None, pad_edge=False)
    dtype = result["dtype"]
    low = dtype != "float32"  # HF generate timed in float32 and in the models' dtype
    columns = ("prompt", "HF f32", *((f"HF {_short(dtype)}",) if low else ()), "plain", "spec", "×HF f32",
               "×plain", "α", "τ", "passes", "same")
    for column in columns:
        table.add_column(column, justify="left" if column == "prompt" else "right", no_wrap=True)
    for r in rows:
        tps = r["tokens_per_s"]
        table.add_row(
            r["prompt"], f"{tps['hf']:.0f}", *((f"{tps['hf_same_dtype']:.0f}",) if low else ()),
            f"{tps['plain']:.0f}", f"{tps['spec']:.0f}",
            f"{r['speedup_vs_hf_generate']:.2f}x", f"{r['speedup_vs_plain']:.2f}x", f"{r['acceptance_rate']:.2f}",
            f"{r['tau']:.2f}", f"{r['target_passes']['speculative']}/{r['target_passes']['plain']}",
            "yes" if r["greedy_identical"] else "[bold red]NO[/]")
    console.print(table)
    console.print("[dim]HF f32 = plain Hugging Face generate in float32 (what a transformers user runs)"
                  + (f"; HF {_short(dtype)} = the same in {dtype}" if low else "")
                  + f"; plain = specdec's loop with nothing drafted ({dtype}, same path); spec = the method; ×: "
                  "speedup of spec; passes = target forward passes, spec/plain; same = greedy output "
                  "token-identical to plain decoding[/]")
    n = len(rows)
    which = "held-out prompts" if rows[0]["source"] != "--prompt" else "prompt"
    same_dtype = result["median_speedup_vs_hf_generate_same_dtype"]
    console.print(f"Median over {n} prompt(s): [bold]{vs_hf[0]:.2f}x[/] vs HF generate in float32 (range "
                  f"{vs_hf[1]:.2f}–{vs_hf[2]:.2f}x)"
                  + (f", {same_dtype:.2f}x vs HF generate in {dtype}" if low else "")
                  + f", [bold]{vs_plain[0]:.2f}x[/] vs specdec's plain decoding on the same path (range "
                  f"{vs_plain[1]:.2f}–{vs_plain[2]:.2f}x). Greedy outputs identical to plain decoding, token for "
                  f"token: [bold]{'yes' if result['greedy_identical'] else 'NO'}[/]; to HF generate in {dtype}: "
                  f"{_same_as_hf(rows, low)}.")
    tested = statistics.median(r["acceptance_per_token"] for r in rows)
    kept = statistics.median(r["acceptance_rate"] for r in rows)
    console.print(f"[dim]Two α's: α = accepted ÷ drafted ({kept:.2f}, the share of draft tokens kept); per-token "
                  f"α = accepted ÷ tested ({tested:.2f}, the chance a draft token is accepted when the target "
                  "looks at it: drafts after a rejection are never tested). Theory uses the per-token α.[/]")
    costs = [r["verify_pass_cost"] for r in rows if r["verify_pass_cost"]]
    if isinstance(gamma, int) and costs and chosen.needs_draft:
        c = statistics.median(r["cost_ratio"] for r in rows)
        v = statistics.median(costs)
        ideal = expected_speedup(tested, gamma, c)
        with_v = expected_tokens_per_pass(tested, gamma) / (gamma * c + v)
        console.print(f"[dim]Theory vs measurement: Leviathan et al. predict τ/(γc+1) = {ideal:.2f}x over plain "
                      f"(per-token α {tested:.2f}, γ {gamma}, draft cost c {c:.2f}); measured {vs_plain[0]:.2f}x, "
                      f"because here a target pass over γ+1 tokens costs v = {v:.2f}x a one-token pass where the "
                      f"formula assumes 1 (with v: τ/(γc+v) = {with_v:.2f}x).[/]")
    elif costs:
        console.print(f"[dim]Theory vs measurement: Leviathan's τ/(γc+1) needs a fixed γ and a draft model; this "
                      f"method varies γ or has no draft model. A target pass over the drafts costs "
                      f"v = {statistics.median(costs):.2f}x "
                      "a one-token pass here, which the formula takes as 1.[/]")
    console.rule()
    console.print(f"[bold]specdec: {vs_hf[0]:.2f}x faster than Hugging Face generate (float32), {vs_plain[0]:.2f}x "
                  f"over its own plain decoding (median of {n} {which}, greedy, identical output; {dtype}) with "
                  f"{chosen.summary}.[/]"
                  if result["greedy_identical"] else
                  "[bold red]specdec: greedy outputs differ from plain decoding: this is a bug, please report it[/]")
    sys.stdout.flush()
