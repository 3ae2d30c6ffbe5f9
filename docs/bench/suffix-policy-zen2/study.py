"""Replay study: suffix decoding's width policy under a measured pass-cost model (no timing).

    python docs/bench/suffix-policy-zen2/study.py     # from the repository root
"""
import json, sys, os
from pathlib import Path
import torch
import specdec
from specdec.bench.workloads import load_workload
from specdec.drafters.suffix import SuffixCache, SuffixDecoding
sys.path.insert(0, "benchmarks")  # run from the repository root
from suffix_replay import accepted, GREEDY

torch.set_num_threads(1)
OUT = str(Path(__file__).with_name("outputs.json"))
if not os.path.exists(OUT):
    target, _, tok = specdec.load_default(dtype=torch.bfloat16)
    data = {}
    for w in ("edit", "agent"):
        ps = load_workload(w, tok, 8, seed=1)
        data[w] = [(p.ids.tolist() if hasattr(p.ids, "tolist") else list(p.ids),
                    specdec.generate(target, p.ids, max_new_tokens=128, eos_token_id=[], compile=True).tokens)
                   for p in ps]
    json.dump(data, open(OUT, "w"))
data = json.load(open(OUT))
# Zen 2 bf16 pass cost by rows, in one-row passes (suffix-edit-zen2-avx2 run 2: 1 row 2.73 ms, 5 rows 4.25, 7 rows 5.57)
COST = {1: 1.0, 4: 1.45, 8: 2.08}
DRAFT = {"pl": 0.03, "suffix": 0.068}

def run(policy, workload, repeats_pl=False):
    drafter = SuffixDecoding(max_nodes=7)
    drafter.use_fast_path(True)
    tokens_out = 0; cost = 0.0; rounds = 0; acc_hist = []
    for prompt, output in data[workload]:
        context = list(prompt)
        drafter.reset(torch.tensor(context))
        done = 0
        while done < len(output):
            g = min(15, len(output) - done - 1)
            w = 0; k = 0
            if g > 0:
                toks, pars, scores = drafter.draft(g)
                w = policy(toks, pars, scores, drafter)
                toks, pars = toks[:w], pars[:w]
                if toks:
                    k = accepted(type("P", (), {"tokens": torch.tensor(toks), "parents": torch.tensor(pars)})(), output[done:done + g])
                cost += DRAFT["suffix"]
            rows = 1 if w == 0 else (4 if w <= 3 else 8)
            cost += COST[rows]
            context += output[done:done + k + 1]
            done += k + 1; rounds += 1
            drafter.commit(torch.tensor(context), k)
        tokens_out += len(output)
    drafter.finish()
    return tokens_out / cost, tokens_out / rounds

def current(t, p, s, d):
    return len(t)

def gain(scale=1.0, cal=None):
    def pol(t, p, s, d):
        best, bw = 1.0 / COST[1], 0
        for w in (3, 7):
            if len(t) < 1: break
            ss = [ (cal(x) if cal else x) for x in s[:w]]
            val = (1 + scale * sum(ss)) / COST[4 if w <= 3 else 8]
            if val > best: best, bw = val, w
        return min(bw, len(t))
    return pol

for wl in ("edit", "agent"):
    base = run(current, wl)
    print(wl, "current: tok/cost %.3f tau %.2f" % base)
    for sc in (0.5, 0.7, 0.85, 1.0):
        r = run(gain(sc), wl)
        print(wl, f"gain scale {sc}: tok/cost {r[0]:.3f} ({r[0]/base[0]:.3f}x) tau {r[1]:.2f}")
