"""Same behaviour, proved: record the tokens every decoding method gives on tiny models for fixed seeds, then
compare two recordings (before and after a change of the decode loop).

    python benchmarks/same_tokens.py record before.json      # on the old tree
    python benchmarks/same_tokens.py record after.json       # on the new tree
    python benchmarks/same_tokens.py compare before.json after.json

Every method of tests/methods.py (METHODS on Llama and GPT-2 targets, SEQ2SEQ_METHODS on BART,
SEQ2SEQ_TREE_METHODS on Whisper) runs alone (`specdec.generate`) greedily and sampled (T = 1, top-k, top-p) for
two seeds, and batched (`specdec.generate_batch`, three prompts, the same options). Each entry is the tokens
plus the round counts (rounds, drafted, accepted, target passes), or the error a call raised (type and
message). `compare` prints the entries whose tokens (or errors) differ and those whose counts differ. Entries
whose γ or node budget is picked from measured times (gamma="auto", max_nodes="auto") may differ between two
runs of one tree at T > 0; record twice to see which.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
PROMPT = [(i * 37 + 11) % 96 for i in range(12)] * 2 + [5, 9, 14]  # repeats: n-gram drafters find matches
PROMPTS = [PROMPT, PROMPT[3:11], PROMPT[:2]]
SAMPLED = {"temperature": 1.0, "top_k": 20, "top_p": 0.9}
SEEDS = (0, 1, 2)


def _outcome(call) -> dict:
    """What a call gave: tokens and counts, or the error it raised."""
    try:
        out = call()
    except Exception as exc:  # noqa: BLE001 (an error is behaviour too)
        return {"error": f"{type(exc).__name__}: {exc}"}
    outs = out if isinstance(out, list) else [out]
    return {"tokens": [o.tokens for o in outs],
            "counts": [[o.stats.rounds, o.stats.drafted, o.stats.accepted, o.stats.target_forwards] for o in outs]}


def _settings():
    yield "greedy", {}, (0,)
    yield "sampled", SAMPLED, SEEDS


def _record_causal(record: dict) -> None:
    import specdec
    from methods import METHODS, build
    from models import perturbed, tiny

    for arch in ("llama", "qwen2", "gpt2"):
        target = tiny(arch, hidden=32, layers=3)
        draft = perturbed(target, 0.1)
        for name in sorted(METHODS):
            if name.startswith("eagle3") and arch == "gpt2":
                continue  # EAGLE-3's head needs a Llama-style layer
            for setting, sampling, seeds in _settings():
                for seed in seeds:
                    def alone():
                        drafter, options = build(name, target, draft)
                        return specdec.generate(target, PROMPT, drafter=drafter, **{
                            "gamma": 3, "max_new_tokens": 40, "seed": seed, **sampling, **options})

                    def batched():
                        drafter, options = build(name, target, draft)
                        return specdec.generate_batch(target, PROMPTS, drafter=drafter, **{
                            "gamma": 3, "max_new_tokens": 40, "seed": seed, **sampling, **options})

                    record[f"alone/{arch}/{name}/{setting}/{seed}"] = _outcome(alone)
                    record[f"batched/{arch}/{name}/{setting}/{seed}"] = _outcome(batched)
                    print(arch, name, setting, seed, flush=True)


def _record_seq2seq(record: dict) -> None:
    import specdec
    from methods import SEQ2SEQ_METHODS, SEQ2SEQ_TREE_METHODS
    from models import perturbed
    from seq2seq_models import encoder_inputs, tiny_seq2seq

    source = [(i * 37 + 11) % 90 + 3 for i in range(16)]
    for arch, methods in (("bart", SEQ2SEQ_METHODS), ("whisper", {**SEQ2SEQ_METHODS, **SEQ2SEQ_TREE_METHODS})):
        target = tiny_seq2seq(arch, hidden=32, layers=2, seed=0)
        draft = perturbed(target, 0.1)
        enc = encoder_inputs(arch, source)
        for name in sorted(methods):
            for setting, sampling, seeds in _settings():
                for seed in seeds:
                    def alone():
                        built = methods[name](target, draft)
                        drafter, options = built if isinstance(built, tuple) else (built, {})
                        return specdec.generate(target, None, drafter=drafter, encoder_inputs=enc, **{
                            "gamma": 3, "max_new_tokens": 40, "seed": seed, **sampling, **options})

                    record[f"alone/{arch}/{name}/{setting}/{seed}"] = _outcome(alone)
                    print(arch, name, setting, seed, flush=True)


def _record_exactness(record: dict) -> None:
    """The statistical suite's draws (tests/test_exactness.py's pair and settings, fewer samples): the sequences
    `specdec.exactness.draw` gets through the decode loop, with its memo engine."""
    import specdec
    import torch
    from methods import METHODS, build
    from models import perturbed, tiny
    from specdec.exactness.engine import draw, find_models

    prompt = [1, 2, 1, 1, 2]
    target = tiny("llama", hidden=16, layers=2, vocab=8, seed=3)
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([prompt])).logits[0, -1], -1)
    target.generation_config.eos_token_id = int(first.argsort(descending=True)[1])
    draft = perturbed(target, 0.3, seed=11)
    settings = {"T1.0-g2-L3": (1.0, None, None, 2, 3, []), "T0.5-top4-g3-L4-eos": (0.5, 4, None, 3, 4, None),
                "T1.5-top6-p0.8-g5-L3-eos": (1.5, 6, 0.8, 5, 3, None)}
    for name in sorted(METHODS):
        for setting, (temperature, top_k, top_p, gamma, max_new, eos) in settings.items():
            def sequences():
                drafter, options = build(name, target, draft)
                options = {"gamma": gamma, "max_new_tokens": max_new, "temperature": temperature, "top_k": top_k,
                           "top_p": top_p, "eos_token_id": eos, "seed": 1234, **options}
                draws = draw(lambda: specdec.SpeculativeDecoder(target, drafter, **options), prompt, 300,
                             models=find_models(target, drafter), compiled=options.get("compile") is True)
                return [list(s) for s in draws.sequences]

            try:
                record[f"exactness/{name}/{setting}"] = {"tokens": sequences()}
            except Exception as exc:  # noqa: BLE001
                record[f"exactness/{name}/{setting}"] = {"error": f"{type(exc).__name__}: {exc}"}
            print("exactness", name, setting, flush=True)


def record(path: str) -> None:
    import torch

    sys.path.insert(0, str(TESTS))
    torch.set_num_threads(1)
    out: dict = {}
    _record_causal(out)
    _record_seq2seq(out)
    _record_exactness(out)
    Path(path).write_text(json.dumps(out, indent=0, sort_keys=True))
    print(f"{len(out)} entries -> {path}")


def timing_driven(key: str) -> bool:
    """Entries whose γ or node budget is picked from measured times: at T > 0 their draws follow those picks, so
    two runs of one tree differ; at T = 0 their tokens do not (greedy tokens never depend on γ)."""
    return "-auto" in key and "/greedy/" not in key


def compare(before_path: str, after_path: str) -> int:
    before, after = json.loads(Path(before_path).read_text()), json.loads(Path(after_path).read_text())
    tokens = counts = same = loose = 0
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key), after.get(key)
        if b is None or a is None:
            print(f"only in {'after' if b is None else 'before'}: {key}")
            tokens += 1
        elif timing_driven(key) and "error" not in b and "error" not in a:
            loose += 1
        elif b.get("tokens") != a.get("tokens") or b.get("error") != a.get("error"):
            print(f"DIFFERENT tokens: {key}\n  before {str(b.get('error') or b.get('tokens'))[:300]}\n"
                  f"  after  {str(a.get('error') or a.get('tokens'))[:300]}")
            tokens += 1
        elif b.get("counts") != a.get("counts"):
            print(f"different counts: {key}: {b['counts']} -> {a['counts']}")
            counts += 1
        else:
            same += 1
    print(f"{same} identical, {tokens} with different tokens or errors, {counts} with different counts only, "
          f"{loose} timing-driven at T > 0 not compared ({len(before)} before, {len(after)} after)")
    return 1 if tokens else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record every method's tokens to a JSON file")
    rec.add_argument("path")
    cmp = sub.add_parser("compare", help="compare two recordings")
    cmp.add_argument("before")
    cmp.add_argument("after")
    args = parser.parse_args()
    if args.command == "record":
        record(args.path)
    else:
        sys.exit(compare(args.before, args.after))


if __name__ == "__main__":
    main()
