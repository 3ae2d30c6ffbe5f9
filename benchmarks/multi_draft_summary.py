"""Summary of benchmarks/multi_draft_tau.py output: τ per config, per-run ratios to the chain with as many nodes,
and the chain τ interpolated at each tree's actual drafted tokens per round.

    python benchmarks/multi_draft_summary.py OUT.jsonl
"""
import argparse
import collections
import json
import statistics as st

import numpy as np


def nodes(c):
    p = c.split(":")
    if p[0] == "chain":
        return int(p[1])
    w = [int(x) for x in p[1].split("x")]
    g = int(p[2])
    tot, width = 0, 1
    for level in range(g):
        width *= w[level] if level < len(w) else 1
        tot += width
    return tot


def summarize(path: str) -> None:
    recs = [json.loads(line) for line in open(path)]
    by = collections.defaultdict(dict)
    for r in recs:
        by[(r["wl"], r["prompt"], r["seed"])][r["cfg"]] = r
    cfgs = list(dict.fromkeys(r["cfg"] for r in recs))
    for wl in ("code", "edit"):
        keys = [k for k in by if k[0] == wl and len(by[k]) == len(cfgs)]
        print(f"== {wl}: {len(keys)} complete (prompt, seed) runs")
        for c in cfgs:
            taus = [by[k][c]["tau"] for k in keys]
            if not taus:
                continue
            dr = sum(by[k][c]["drafted"] for k in keys) / sum(by[k][c]["rounds"] for k in keys)
            chain = f"chain:{nodes(c)}"
            ratio = ""
            if not c.startswith("chain") and chain in cfgs:
                rs = [by[k][c]["tau"] / by[k][chain]["tau"] for k in keys]
                ratio = (f"vs {chain}: mean ratio {st.mean(rs):.3f} (of mean τ "
                         f"{st.mean(taus)/st.mean([by[k][chain]['tau'] for k in keys]):.3f}) min {min(rs):.2f} "
                         f"max {max(rs):.2f} wins {sum(r>1 for r in rs)}/{len(rs)}")
            ts = sum(by[k][c]["target_s"] for k in keys)
            ds = sum(by[k][c]["draft_s"] for k in keys)
            print(f"{c:16s} nodes {nodes(c):3d} drafted/round {dr:5.2f} τ mean {st.mean(taus):.3f} "
                  f"sd {st.stdev(taus) if len(taus)>1 else 0:.2f} [{min(taus):.2f},{max(taus):.2f}] "
                  f"τ/node {st.mean(taus)/nodes(c):.3f} tok/s(t+d) {128*len(keys)/(ts+ds):.1f} {ratio}")

    # chain τ interpolated at the tree's actual drafted tokens per round (means over the same runs)
    for wl in ("code", "edit"):
        keys = [k for k in by if k[0] == wl and len(by[k]) == len(cfgs)]
        chains = sorted((sum(by[k][c]["drafted"] for k in keys) / sum(by[k][c]["rounds"] for k in keys),
                         st.mean(by[k][c]["tau"] for k in keys)) for c in cfgs if c.startswith("chain"))
        xs, ys = zip(*chains)
        for c in cfgs:
            if c.startswith("chain"):
                continue
            d = sum(by[k][c]["drafted"] for k in keys) / sum(by[k][c]["rounds"] for k in keys)
            t = st.mean(by[k][c]["tau"] for k in keys)
            print(f"{wl} {c:14s} drafted/round {d:5.2f} τ {t:.3f} chain τ at that many drafts (interp.) "
                  f"{np.interp(d, xs, ys):.3f} ratio {t/np.interp(d, xs, ys):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", help="the JSONL file benchmarks/multi_draft_tau.py wrote")
    summarize(parser.parse_args().runs)


if __name__ == "__main__":
    main()
