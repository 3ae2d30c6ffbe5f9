"""The server's batched decoder offline: 32 rows of the default pair (64-token held-out `code` prompts, float32,
compiled, one thread), 128 greedy tokens each, every round at a fixed γ cap (0 = plain, 2, 4). Decode only (the
prefill is outside the timing); each γ twice, the first pass of each compiling its shapes.

    flock /tmp/specdec-bench.lock taskset -c 1 python docs/bench/serve-vllm-zen4-f32-3/fixed_gamma_rounds.py
"""

import time

import torch

import specdec
from specdec.bench.workloads import load_workload
from specdec.engine.batch import BatchDecoder

torch.set_num_threads(1)
target, draft, tokenizer = specdec.load_default(dtype="float32")
prompts = [list(p.ids) for p in load_workload("code", tokenizer, 32, prompt_tokens=64)]
decoder = BatchDecoder(target, specdec.DraftModel(draft), compile=True, max_len=512)
decoder.target.query_buckets = (1, 3, 5)  # the server's widths at γ 0 / 2 / 4
for repeat in range(2):
    for gamma in (0, 2, 4):
        decoder.add_many([(i, p, dict(max_new_tokens=128, gamma=4, eos_token_id=[])) for i, p in enumerate(prompts)])
        start, tokens, rounds, target_s = time.perf_counter(), 0, 0, 0.0
        while len(decoder):
            events = decoder.step(gamma)
            tokens += sum(len(e.tokens) for e in events)
            rounds += 1
            target_s += decoder.last_round["target_s"] or 0.0
        elapsed = time.perf_counter() - start
        print(f"repeat {repeat} γ {gamma}: {tokens / elapsed:.1f} tokens/s, {rounds} rounds, "
              f"{1e3 * elapsed / rounds:.2f} ms a round, of it the target pass {1e3 * target_s / rounds:.2f} ms",
              flush=True)
