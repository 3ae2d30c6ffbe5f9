"""A verification pass of 1, 3, 5 and 8 rows at the Qwen2.5-1.5B shape on the fast path (bfloat16 on bfloat16 packed
weights, one thread): what a one-row pass costs padded onto the graph of symbolic row count (3 rows) against its own
one-row graph. Medians of 10 calls each, interleaved, after two warm-up rounds (a one-off probe)."""
import runpy, statistics, time
import torch
from specdec.core.sampling import SamplingConfig
from specdec.runtime.static_lm import StaticCausalLM
from specdec.runtime.weights import pack_model

ladder = runpy.run_path("benchmarks/size_ladder.py", run_name="size_ladder")
torch.set_num_threads(1)
model = ladder["build"]("qwen2.5-1.5b", torch.bfloat16)
pack_model(model, "bfloat16")
lm = StaticCausalLM(model, compile=True)
lm.ensure_capacity(256)
lm.prefill(torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)))
start = lm.length
passes = {"1 row": ((1, 3, 5, 8), 1), "1 row padded to 3": ((3, 5, 8), 1), "3 rows": ((3, 5, 8), 3),
          "5 rows": ((3, 5, 8), 5), "8 rows": ((3, 5, 8), 8)}
times = {name: [] for name in passes}
for _ in range(12):
    for name, (buckets, rows) in passes.items():
        lm.buckets = buckets
        ids = torch.randint(0, 1000, (rows,))
        t = time.perf_counter()
        lm.score_and_verify(ids, None, SamplingConfig(), None)
        times[name].append(time.perf_counter() - t)
        lm.crop(start)
for name, seconds in times.items():
    print(f"{name}: median {1e3 * statistics.median(seconds[2:]):.2f} ms, min {1e3 * min(seconds[2:]):.2f} ms")
