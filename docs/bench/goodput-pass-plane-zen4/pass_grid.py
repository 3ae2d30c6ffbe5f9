"""The server's batched target pass at every row count and width it runs: the default pair in float32, compiled, one
thread, 64-token held-out `code` prompts; rows 1, 2, 4, 8, 16, 32 x widths 1, 3, 5 (γ 0 / 2 / 4), the median
target-pass time of rounds 4-25 of a decode (the pass as `BatchDecoder.last_round` reports it to the server's
cost model), after a first sweep that compiles. Then the goodput policy's two pass models fitted on the rows <= 8
passes only (what a server has seen before its first 32-row batch) and their prices for 32 rows: the line in
scored tokens N, a + c·N, and the plane in tokens and rows R, a + c·N + d·R (`server/goodput.py`).

    flock /tmp/specdec-bench.lock taskset -c 1 python docs/bench/goodput-pass-plane-zen4/pass_grid.py
"""

import statistics

from specdec.server.goodput import CostModel

from server_decoder import server_decoder

decoder, prompts = server_decoder()
grid = {}
for sweep in range(2):
    for rows in (1, 2, 4, 8, 16, 32):
        for gamma in (0, 2, 4):
            decoder.add_many([(i, p, dict(max_new_tokens=60, gamma=4, eos_token_id=[]))
                              for i, p in enumerate(prompts[:rows])])
            times = []
            for _ in range(25):
                decoder.step(gamma)
                times.append(decoder.last_round["target_s"])
            decoder.remove(decoder.keys)
            if sweep:
                grid[rows, gamma + 1] = statistics.median(times[3:])
                print(f"{rows:2d} rows x {gamma + 1} inputs: {1e3 * grid[rows, gamma + 1]:.2f} ms", flush=True)
cost = CostModel()  # what a server has seen before its first 32-row batch: each pass of <= 8 rows, three rounds
for (rows, width), seconds in grid.items():
    if rows <= 8:
        for _ in range(3):
            cost.observe_pass(rows * width, rows, seconds)
for width in (1, 3, 5):
    print(f"32 rows x {width}: measured {1e3 * grid[32, width]:.2f} ms; priced by the line in tokens "
          f"{1e3 * cost.pass_seconds(32 * width):.2f}, by the plane in tokens and rows "
          f"{1e3 * cost.pass_seconds(32 * width, 32):.2f}")
