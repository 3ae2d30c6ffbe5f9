import time, torch, specdec, collections
from specdec.bench.workloads import code_prompts
from specdec.engine import round as rnd
specdec.set_threads(1)
target, draft, tok = specdec.load_default(dtype="bfloat16")
prompts = [p.ids for p in code_prompts(tok, 4, seed=0)]
acc = collections.defaultdict(float); calls = collections.Counter()
def wrap(cls, name):
    orig = getattr(cls, name)
    def f(*a, **k):
        s = time.perf_counter()
        try: return orig(*a, **k)
        finally: acc[name] += time.perf_counter() - s; calls[name] += 1
    setattr(cls, name, f)
for n in ["run", "_propose", "_score_and_verify", "_commit", "gammas"]:
    wrap(rnd.Engine, n)
from specdec.runtime import static_lm
wrap(static_lm.StaticCausalLM, "_run")
kw = dict(max_new_tokens=128, compile=True, eos_token_id=[])
for p in prompts[:2]: specdec.generate(target, p, **kw)
acc.clear(); calls.clear()
import gc, sys
if len(sys.argv) > 1 and sys.argv[1] == "nogc": gc.disable()
print("gc", gc.isenabled(), gc.get_threshold(), gc.get_count(), gc.get_freeze_count())
t0 = time.perf_counter(); N = 0
for _ in range(10):
    for p in prompts: specdec.generate(target, p, **kw); N += 128
wall = time.perf_counter() - t0
print(f"wall per token {wall/N*1e6:.1f} us")
for k in acc: print(f"{k:20s} {acc[k]/calls[k]*1e6:8.1f} us/call  calls/token {calls[k]/N:.2f}")
