"""The server's batched decoder with all 32 rows decoding (the default pair, float32, compiled, one thread; 64-token
held-out `code` prompts), at a fixed γ cap of 0, 2 or 4: tokens/s over the rounds while every row is still running,
by how far the rows are into their continuations (the median row's new tokens, in bins of 64). Only rounds of
all 32 rows count (a wave's tail, where rows have finished, is left out). Each γ twice, the first compiling.

    flock /tmp/specdec-bench.lock taskset -c 1 python docs/bench/goodput-pass-plane-zen4/steady_rounds.py
"""

import statistics
import time

from server_decoder import server_decoder

decoder, prompts = server_decoder()
for repeat in range(2):
    for gamma in (0, 2, 4):
        decoder.add_many([(i, p, dict(max_new_tokens=400, gamma=4, eos_token_id=[])) for i, p in enumerate(prompts)])
        written = [0] * len(prompts)
        bins: dict[int, list[tuple[int, float]]] = {}  # 64-token bin -> (tokens, seconds) per round
        while len(decoder) == len(prompts) and min(written) < 256:
            start = time.perf_counter()
            events = decoder.step(gamma)
            seconds = time.perf_counter() - start
            for event in events:
                written[event.key] += len(event.tokens)
            bins.setdefault(int(statistics.median(written)) // 64 * 64, []).append(
                (sum(len(e.tokens) for e in events), seconds))
        decoder.remove(decoder.keys)
        if repeat:
            print(f"γ {gamma}: " + ", ".join(
                f"+{b}: {sum(n for n, _ in v) / sum(s for _, s in v):.0f} tokens/s ({len(v)} rounds)"
                for b, v in sorted(bins.items())), flush=True)
