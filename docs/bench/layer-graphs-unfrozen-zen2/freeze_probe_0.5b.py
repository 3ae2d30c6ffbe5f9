"""A by-layer model compiled with and without inductor's freezing: compile time, cache counters, decode speed."""
import os, runpy, sys, time
import torch
from torch._dynamo.utils import counters
import specdec
from specdec.engine.decoding import SpeculativeDecoder
from specdec.runtime import compiled
from specdec.runtime.weights import pack_model

if os.environ.get("FREEZE") == "0":
    compiled.COMPILE_OPTIONS["freezing"] = False
ladder = runpy.run_path("benchmarks/size_ladder.py", run_name="size_ladder")
torch.set_num_threads(1)
model = ladder["build"](sys.argv[1], torch.bfloat16)
pack_model(model, "bfloat16")
drafter = specdec.SelfDraft(model, "w4a8") if len(sys.argv) > 2 else None
prompt = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
decoder = SpeculativeDecoder(model, drafter, gamma=3 if drafter else None, max_new_tokens=32, compile=True,
                             eos_token_id=[])
start = time.perf_counter()
out = list(decoder.stream(prompt))
print(f"FREEZE={os.environ.get('FREEZE')}: first request {time.perf_counter() - start:.1f} s, "
      f"compile {decoder.stats.compile_s:.1f} s")
times = []
for _ in range(3):
    start = time.perf_counter()
    again = list(decoder.stream(prompt))
    times.append(time.perf_counter() - start)
    assert again == out
print(f"later requests {sorted(times)} s; tokens {out[:8]}...")
print({k: v for k, v in counters["inductor"].items() if "cache" in k}, dict(counters.get("aot_autograd", {})))
print("shared copies:", len(compiled.entry_for(model).copies), "by layer:", bool(compiled.entry_for(model).layers))
