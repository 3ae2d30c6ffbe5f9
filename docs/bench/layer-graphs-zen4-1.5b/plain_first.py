"""Plain decoding's first request at the Qwen2.5-1.5B shape on the fast path, from a cold compile cache (a one-off
probe: selfdraft_first.py without a drafter)."""
import runpy, time
import torch
import specdec
from specdec.runtime.weights import pack_model

ladder = runpy.run_path("benchmarks/size_ladder.py", run_name="size_ladder")
torch.set_num_threads(1)
model = ladder["build"]("qwen2.5-1.5b", torch.bfloat16)
pack_model(model, "bfloat16")
prompt = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
for request in ("first", "second"):
    start = time.perf_counter()
    out = specdec.generate(model, prompt, max_new_tokens=16, compile=True, eos_token_id=[])
    print(f"plain: {request} request {time.perf_counter() - start:.1f} s, compile {out.stats.compile_s:.1f} s, "
          f"{len(out.tokens)} tokens", flush=True)
