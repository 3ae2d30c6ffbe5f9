"""τ of prompt lookup and SuffixDecoding settings by replaying greedy decoding offline (no timing, so no load).

At T = 0 a round accepts the longest path of the proposal that spells the target's greedy continuation, so the
target's outputs, computed once, give every drafter's rounds exactly: each round proposes, the accepted path is read
off the known output, the drafter commits it and one more token. The requests run in order through one drafter,
as `specdec bench` runs them (SuffixDecoding's cache fills as it goes).

    python benchmarks/suffix_replay.py [--workloads agent,edit] [--num-prompts 8] [--seed 1]
"""

import argparse

import torch

import specdec
from specdec.bench.workloads import load_workload
from specdec.drafters.suffix import SuffixCache, SuffixDecoding

GREEDY = specdec.SamplingConfig(0.0)


def accepted(proposal, truth: list[int]) -> int:
    tokens = proposal.tokens.tolist()
    parents = proposal.parents.tolist() if proposal.parents is not None else list(range(-1, len(tokens) - 1))
    node, k = -1, 0
    while k < len(truth):
        child = next((i for i in range(len(tokens)) if parents[i] == node and tokens[i] == truth[k]), None)
        if child is None:
            break
        node, k = child, k + 1
    return k


def replay(drafter, gamma: int, requests, fast: bool) -> tuple[float, float]:
    """(τ, nodes proposed per round) over the requests, in order."""
    drafter.use_fast_path(fast)
    rounds = nodes = produced = 0
    for prompt, output in requests:
        context = list(prompt)
        drafter.reset(torch.tensor(context))
        done = 0
        while done < len(output):
            g = min(gamma, len(output) - done - 1)
            proposal = drafter.propose(torch.tensor(context), g, GREEDY, None) if g > 0 else None
            k = accepted(proposal, output[done : done + g]) if proposal is not None else 0
            nodes += len(proposal) if proposal is not None else 0
            context += output[done : done + k + 1]
            done += k + 1
            rounds += 1
            drafter.commit(torch.tensor(context), k)
        produced += len(output)
    return produced / rounds, nodes / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="agent,edit")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, _, tokenizer = specdec.load_default()
    workloads = args.workloads.split(",")
    requests = {}
    for workload in workloads:
        prompts = load_workload(workload, tokenizer, args.num_prompts, seed=args.seed)
        requests[workload] = [(p.ids, specdec.generate(target, p.ids, max_new_tokens=args.max_new_tokens,
                                                       eos_token_id=[]).tokens) for p in prompts]
    drafters = [
        ("PromptLookup γ=4", specdec.PromptLookup, 4, False),
        ("PromptLookup γ=6", specdec.PromptLookup, 6, False),
        ("PromptLookup γ=8", specdec.PromptLookup, 8, False),
        ("SuffixDecoding() (max_nodes 7, offset 1), fast path", SuffixDecoding, 15, True),
        ("SuffixDecoding(max_nodes=15, max_spec_offset=4), fast path",
         lambda: SuffixDecoding(max_nodes=15, max_spec_offset=4), 15, True),
        ("SuffixDecoding() without the cache (max_tokens=0), fast path",
         lambda: SuffixDecoding(cache=SuffixCache(max_tokens=0)), 15, True),
    ]
    print("| drafter | " + " | ".join(f"{w} τ (nodes / round)" for w in workloads) + " |")
    print("|---|" + "---:|" * len(workloads))
    for name, make, gamma, fast in drafters:
        cells = []
        for workload in workloads:
            tau, per_round = replay(make(), gamma, requests[workload], fast)
            cells.append(f"{tau:.2f} ({per_round:.1f})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
