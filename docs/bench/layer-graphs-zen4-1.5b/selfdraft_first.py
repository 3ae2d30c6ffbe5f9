"""The first request of a self-drafted 1.5B target on the fast path, from a cold compile cache (a one-off probe)."""
import runpy, sys, time
import torch
import specdec
from specdec.engine.decoding import SpeculativeDecoder
from specdec.runtime.weights import pack_model

ladder = runpy.run_path("benchmarks/size_ladder.py", run_name="size_ladder")
torch.set_num_threads(1)
model = ladder["build"]("qwen2.5-1.5b", torch.bfloat16)
pack_model(model, "bfloat16")
prompt = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
for label, drafter, gamma in (("self-draft w4a8, gamma auto", specdec.SelfDraft(model, "w4a8"), "auto"),):
    decoder = SpeculativeDecoder(model, drafter, gamma=gamma, max_new_tokens=16, compile=True, eos_token_id=[])
    start = time.perf_counter()
    out = list(decoder.stream(prompt))
    print(f"{label}: first request {time.perf_counter() - start:.1f} s, compile {decoder.stats.compile_s:.1f} s, "
          f"{len(out)} tokens", flush=True)
    start = time.perf_counter()
    list(decoder.stream(prompt))
    print(f"{label}: second request {time.perf_counter() - start:.1f} s", flush=True)
