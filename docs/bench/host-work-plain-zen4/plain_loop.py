import time, torch, specdec
from specdec.bench.workloads import code_prompts
specdec.set_threads(1)
target, draft, tok = specdec.load_default(dtype="bfloat16")
prompts = [p.ids for p in code_prompts(tok, 4, seed=0)]
import sys
mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
drafter = None if mode == "plain" else specdec.make_drafter("draft", target=target, draft=draft)
kw = dict(max_new_tokens=128, compile=True, eos_token_id=[])
if drafter is not None: kw["gamma"] = 6
for p in prompts[:2]:
    specdec.generate(target, p, drafter=drafter, **kw)
t0 = time.time(); n = 0
while time.time() - t0 < float(sys.argv[2] if len(sys.argv) > 2 else 20):
    for p in prompts:
        s = time.perf_counter(); out = specdec.generate(target, p, drafter=drafter, **kw); n += 1
print("requests", n, "s/request", (time.time() - t0) / n)
