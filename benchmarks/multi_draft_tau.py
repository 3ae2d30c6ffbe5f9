"""Untimed τ at T = 1 (top-k 50, top-p 0.9, 128 new tokens) of draft chains and MultiDraft trees on the default
pair, code and edit prompts, one JSON line per run (BENCHMARKS.md, "Token trees", T = 1 multi-draft).

    python benchmarks/multi_draft_tau.py OUT.jsonl PROMPT_SEED NUM_PROMPTS NUM_SEEDS CONFIG...
    python benchmarks/multi_draft_tau.py --summary OUT.jsonl

CONFIG: "chain:γ" or "SCHEME:W1xW2...:γ" (SCHEME rrs | specinfer | spectr; widths per level; γ levels).
target_s / draft_s are recorded but only comparable between runs of the same (prompt, seed), interleaved.
"""
import argparse
import json
import runpy
import time
from pathlib import Path

import torch

import specdec
from specdec.bench.workloads import load_workload
from specdec.engine.decoding import SpeculativeDecoder
from specdec.hub.default_pair import load_default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", metavar="OUT.jsonl", help="summarise a finished run instead (multi_draft_summary)")
    parser.add_argument("out", nargs="?")
    parser.add_argument("prompt_seed", type=int, nargs="?")
    parser.add_argument("num_prompts", type=int, nargs="?")
    parser.add_argument("num_seeds", type=int, nargs="?")
    parser.add_argument("configs", nargs="*", help='"chain:G" | "SCHEME:W1xW2:G"')
    args = parser.parse_args()
    if args.summary:
        runpy.run_path(str(Path(__file__).with_name("multi_draft_summary.py")))["summarize"](args.summary)
        return
    if args.num_seeds is None:
        parser.error("give OUT.jsonl PROMPT_SEED NUM_PROMPTS NUM_SEEDS CONFIG..., or --summary OUT.jsonl")
    torch.set_num_threads(1)
    out, pseed, nprompts, nseeds, configs = args.out, args.prompt_seed, args.num_prompts, args.num_seeds, args.configs
    target, draft, tok = load_default()

    def make(cfg):
        parts = cfg.split(":")
        if parts[0] == "chain":
            return specdec.DraftModel(draft), int(parts[1])
        widths = tuple(int(w) for w in parts[1].split("x"))
        return specdec.MultiDraft(draft, scheme=parts[0], widths=widths), int(parts[2])

    workloads = {wl: load_workload(wl, tok, nprompts, seed=pseed) for wl in ("code", "edit")}
    with open(out, "a") as f:
        for s in range(nseeds):
            for pi in range(nprompts):
                for wl, prompts in workloads.items():
                    pr = prompts[pi]
                    for cfg in configs:
                        d, g = make(cfg)
                        dec = SpeculativeDecoder(target, d, gamma=g, max_new_tokens=128, temperature=1.0, top_k=50,
                                                 top_p=0.9, seed=1000 * s + pi, eos_token_id=[])
                        t = time.perf_counter()
                        list(dec.stream(pr.ids))
                        st = dec.stats
                        rec = dict(cfg=cfg, wl=wl, prompt=pi, seed=s, tau=st.mean_accepted_tokens, rounds=st.rounds,
                                   drafted=st.drafted, accepted=st.accepted, wall=time.perf_counter() - t,
                                   target_s=st.target_s, draft_s=st.draft_s)
                        f.write(json.dumps(rec) + "\n")
                        f.flush()


if __name__ == "__main__":
    main()
