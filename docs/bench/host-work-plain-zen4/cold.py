import time, torch, specdec, collections, sys
from specdec.bench.workloads import code_prompts
from specdec.engine import round as rnd
specdec.set_threads(1)
target, draft, tok = specdec.load_default(dtype="bfloat16")
prompts = [p.ids for p in code_prompts(tok, 4, seed=0)]
acc = collections.defaultdict(list)
orig = rnd.Engine._commit
def c(self, rows, proposals, trees, scores, outcomes, draft_s, target_s):
    ctx = rows[0].context
    t0 = time.perf_counter(); a = torch.tensor([5]); t1 = time.perf_counter(); b = torch.tensor([6]); t2 = time.perf_counter()
    ctx[-1:] = a; t3 = time.perf_counter(); ctx[-1:] = b; t4 = time.perf_counter()
    x = [1, 2, 3] + [4]; t5 = time.perf_counter()
    acc["1st tensor"].append(t1 - t0); acc["2nd tensor"].append(t2 - t1); acc["1st setitem"].append(t3 - t2); acc["2nd setitem"].append(t4 - t3); acc["list"].append(t5-t4)
    return orig(self, rows, proposals, trees, scores, outcomes, draft_s, target_s)
rnd.Engine._commit = c
kw = dict(max_new_tokens=128, compile=True, eos_token_id=[])
for p in prompts[:2]: specdec.generate(target, p, **kw)
acc.clear()
for _ in range(5):
    for p in prompts: specdec.generate(target, p, **kw)
import statistics
for k, v in acc.items(): print(f"{k:12s} median {statistics.median(v)*1e6:7.1f} us  mean {statistics.mean(v)*1e6:7.1f}")
