"""Token trees on the fast path, default pair: the target's pass cost vs rows, the draft tree graph's cost,
and decoding runs of chains and trees side by side (methods interleaved per prompt and repeat).

    flock /tmp/specdec-bench.lock python benchmarks/tree_fastpath.py costs --rows 4,5,9,13,17
    flock /tmp/specdec-bench.lock python benchmarks/tree_fastpath.py run --methods plain,chain3,tree:2:6:12,auto \
        --prompts 4 --tokens 128 --path compiled

Methods: plain, chainG (DraftModel, γ = G), tree:K:D:N (DraftTree(top_k=K, depth=D, max_nodes=N)),
auto / auto:K:D (DraftTree(max_nodes="auto")). Prints one JSON line per run, then a summary; --out saves both.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

import torch

import specdec
from specdec.bench.workloads import code_prompts
from specdec.core.sampling import SamplingConfig
from specdec.engine.decoding import SpeculativeDecoder
from specdec.hub.default_pair import load_default
from specdec.runtime.causal_lm import CachedCausalLM
from specdec.runtime.static_lm import StaticCausalLM


def build(method: str, draft):
    if method == "plain":
        return None, None
    if method.startswith("chain"):
        return specdec.DraftModel(draft), int(method[5:])
    if method.startswith("tree"):
        k, d, n = (int(x) for x in method.split(":")[1:])
        return specdec.DraftTree(draft, top_k=k, depth=d, max_nodes=n), None
    if method.startswith("auto"):
        parts = method.split(":")[1:]
        k, d = (int(x) for x in parts) if parts else (2, 6)
        return specdec.DraftTree(draft, top_k=k, depth=d, max_nodes="auto"), None
    raise SystemExit(f"unknown method {method}")


def costs(args, target, draft):
    lm = StaticCausalLM(target, compile=args.path == "compiled")
    lm.ensure_capacity(512)
    lm.prefill(torch.arange(100) % 1000 + 5)
    out = {}
    for rows in (int(r) for r in args.rows.split(",")):
        lm.buckets = (rows,)
        times = []
        for i in range(args.repeats + 1):
            t = time.perf_counter()
            lm.forward(torch.arange(rows) + 7)
            lm.crop(100)
            if i:
                times.append(time.perf_counter() - t)
        out[rows] = 1000 * statistics.median(times)
        print(json.dumps({"rows": rows, "ms": out[rows]}), flush=True)
    dlm = StaticCausalLM(draft, compile=args.path == "compiled")
    dlm.ensure_capacity(512)
    ctx = torch.arange(101) % 1000 + 5
    dlm.prefill(ctx[:-1])
    for shape in args.trees.split(","):
        k, d = (int(x) for x in shape.split(":"))
        times = []
        for i in range(args.repeats + 1):
            t = time.perf_counter()
            dlm.draft_tree(ctx, k, d, d, SamplingConfig(0.0, None, None))
            if i:
                times.append(time.perf_counter() - t)
        print(json.dumps({"tree": shape, "ms": 1000 * statistics.median(times)}), flush=True)
    for g in (3, 4):
        times = []
        for i in range(args.repeats + 1):
            t = time.perf_counter()
            dlm.draft_steps(ctx, g, SamplingConfig(0.0, None, None), None)
            dlm.crop(100)
            if i:
                times.append(time.perf_counter() - t)
        print(json.dumps({"chain_draft": g, "ms": 1000 * statistics.median(times)}), flush=True)


def run(args, target, draft, tokenizer):
    prompts = code_prompts(tokenizer, args.prompts, seed=args.seed)
    methods = args.methods.split(",")
    compile = {"compiled": True, "static": "static", "eager": False}[args.path]
    drafters = {m: build(m, draft) for m in methods}
    target_lm = CachedCausalLM(target) if compile is False else StaticCausalLM(target, compile=compile is True)
    rows = []
    graph_ms = {}
    if args.graph == "pick":  # compile the tree both ways, time both interleaved, keep the faster
        import specdec.runtime.draft_graphs as draft_graphs

        dlm = StaticCausalLM(draft, compile=True)
        dlm.ensure_capacity(512)
        ctx = torch.tensor(prompts[0].ids)
        dlm.prefill(ctx[:-1])
        greedy = SamplingConfig(0.0, None, None)
        times = {"level": [], "whole": []}
        for i in range(args.pick_repeats + 1):
            for mode in times:
                draft_graphs.TREE_GRAPH = mode
                t = time.perf_counter()
                dlm.draft_tree(ctx, 2, 6, 6, greedy)
                if i:
                    times[mode].append(time.perf_counter() - t)
        graph_ms = {m: 1000 * statistics.median(v) for m, v in times.items()}
        draft_graphs.TREE_GRAPH = min(graph_ms, key=graph_ms.get)
        print(json.dumps({"tree_graph_ms": graph_ms, "picked": draft_graphs.TREE_GRAPH, "load": os.getloadavg()}),
              flush=True)
    # warm-up (compiles every shape) on the first prompt, 32 tokens, untimed
    for m in methods:
        drafter, gamma = drafters[m]
        dec = SpeculativeDecoder(target_lm, drafter, gamma=gamma, max_new_tokens=args.tokens, eos_token_id=[],
                                 compile=compile)  # same cache size as the timed runs: same compiled shapes
        list(dec.stream(torch.tensor(prompts[0].ids)))
    print(json.dumps({"warm": True, "load": os.getloadavg()}), flush=True)
    for rep in range(args.repeats):
        for p in prompts:
            for m in methods:
                drafter, gamma = drafters[m]
                dec = SpeculativeDecoder(target_lm, drafter, gamma=gamma, max_new_tokens=args.tokens,
                                         eos_token_id=[], compile=compile)
                t = time.perf_counter()
                tokens = list(dec.stream(torch.tensor(p.ids)))
                wall = time.perf_counter() - t
                s = dec.stats
                row = dict(method=m, prompt=p.name, rep=rep, tok_s=len(tokens) / wall, tau=s.new_tokens / max(1, s.rounds),
                           rounds=s.rounds, drafted_per_round=s.drafted / max(1, s.rounds),
                           target_ms=1000 * s.target_s / max(1, s.rounds), draft_ms=1000 * s.draft_s / max(1, s.rounds),
                           load=os.getloadavg()[0])
                if drafter is not None and getattr(drafter, "budget", None) is not None:
                    rep_ = drafter.budget.report()
                    row["budget"] = {"chosen_last": rep_["chosen"][-s.rounds:], "cost_ms": rep_["cost_ms"],
                                     "fixed_ms": rep_["fixed_ms"],
                                     "predicted": {b: v for b, v in rep_["predicted"].items()}}
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        summary[m] = dict(tok_s=statistics.median(r["tok_s"] for r in mine),
                          tok_s_mean=statistics.mean(r["tok_s"] for r in mine),
                          tau=statistics.mean(r["tau"] for r in mine),
                          nodes=statistics.mean(r["drafted_per_round"] for r in mine),
                          target_ms=statistics.mean(r["target_ms"] for r in mine),
                          draft_ms=statistics.mean(r["draft_ms"] for r in mine))
    # paired ratios vs the first method, per (prompt, rep)
    base = methods[0]
    for m in methods:
        ratios = [r["tok_s"] / b["tok_s"] for r in rows if r["method"] == m
                  for b in rows if b["method"] == base and b["prompt"] == r["prompt"] and b["rep"] == r["rep"]]
        summary[m]["vs_" + base] = statistics.median(ratios)
    auto = next((d for d, _ in drafters.values() if getattr(d, "budget", None) is not None), None)
    if auto is not None:  # the auto model's prediction for every budget, against the fixed trees measured
        report = auto.budget.report()
        summary["budget_model"] = {"cost_ms": report["cost_ms"], "fixed_ms": report["fixed_ms"],
                                   "acceptance": report["acceptance"][:20], "predicted": report["predicted"]}
    summary["tree_graph_ms"] = graph_ms
    print(json.dumps({"summary": summary, "load_end": os.getloadavg()}, indent=1), flush=True)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump({"rows": rows, "summary": summary, "args": vars(args)}, f, indent=1)
        os.replace(args.out + ".tmp", args.out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["costs", "run"])
    parser.add_argument("--path", default="compiled", choices=["compiled", "static", "eager"])
    parser.add_argument("--rows", default="4,5,9,13,17")
    parser.add_argument("--trees", default="2:6")
    parser.add_argument("--methods", default="plain,chain3,tree:2:6:12")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--warm", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pick-repeats", type=int, default=15)
    parser.add_argument("--out", default="")
    parser.add_argument("--graph", default="", choices=["", "level", "whole", "pick"],
                        help="override draft_graphs.TREE_GRAPH (one graph per level, or the whole tree)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.graph in ("level", "whole"):
        import specdec.runtime.draft_graphs as draft_graphs

        draft_graphs.TREE_GRAPH = args.graph
    target, draft, tokenizer = load_default()
    print(json.dumps({"load": os.getloadavg(), "threads": torch.get_num_threads()}), flush=True)
    if args.what == "costs":
        costs(args, target, draft)
    else:
        run(args, target, draft, tokenizer)


if __name__ == "__main__":
    main()
