"""PromptLookup(branches=1|2|3) at T = 0 on the default target, code and edit prompts (seed 1), timed and interleaved
(rotated order per repeat); run under `flock /tmp/specdec-bench.lock`.

    python benchmarks/lookup_branches.py NUM_PROMPTS GAMMA REPEATS OUT.jsonl
"""
import argparse
import json
import time

import torch

import specdec
from specdec.bench.workloads import load_workload
from specdec.engine.decoding import SpeculativeDecoder
from specdec.hub.default_pair import load_default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("num_prompts", type=int)
    parser.add_argument("gamma", type=int)
    parser.add_argument("repeats", type=int)
    parser.add_argument("out", help="JSONL file the runs are appended to")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft, tok = load_default()
    nprompts, gamma, repeats = args.num_prompts, args.gamma, args.repeats
    branches = (1, 2, 3)
    out = open(args.out, "a")
    for wl in ("code", "edit"):
        prompts = load_workload(wl, tok, nprompts, seed=1)
        for pi, pr in enumerate(prompts):
            # warmup
            list(SpeculativeDecoder(target, specdec.PromptLookup(), gamma=gamma, max_new_tokens=16,
                                    eos_token_id=[]).stream(pr.ids))
            for r in range(repeats):
                order = branches[r % 3:] + branches[:r % 3]
                for b in order:
                    dec = SpeculativeDecoder(target, specdec.PromptLookup(branches=b), gamma=gamma, max_new_tokens=128,
                                             eos_token_id=[])
                    t = time.perf_counter()
                    list(dec.stream(pr.ids))
                    wall = time.perf_counter() - t
                    st = dec.stats
                    out.write(json.dumps(dict(wl=wl, prompt=pi, rep=r, branches=b, tau=st.mean_accepted_tokens,
                                              wall=wall, drafted=st.drafted, rounds=st.rounds,
                                              target_s=st.target_s)) + "\n")
                    out.flush()


if __name__ == "__main__":
    main()
