"""Passes of 3 rows and more on a model compiled by layer: one graph per width against one graph whose row count is
symbolic (runtime/static_lm.py, `SYMBOLIC_MIN_ROWS`), in one process: two copies of a ladder shape (random weights,
built from the config), one compiled each way. Each copy prefills a 64-token prompt, then verifies chains of
`--widths` rows (greedy, the rule in the graph): the first call of each width (its compile, if any), then the
median of `--repeats` calls per width, interleaved. Logits and verdicts must be identical. Start with a cold inductor
cache (`TORCHINDUCTOR_CACHE_DIR` a new folder):

    python benchmarks/symbolic_rows_ab.py --shape qwen2.5-1.5b --dtype float32 --weights bfloat16
"""

from __future__ import annotations

import argparse
import runpy
import statistics
import time
from pathlib import Path

import torch

from specdec.core.sampling import SamplingConfig
from specdec.runtime import layer_graphs, static_lm
from specdec.runtime.static_lm import StaticCausalLM
from specdec.runtime.weights import FORMATS, pack_model

PROMPT_TOKENS = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", help="a shape of benchmarks/size_ladder.py")
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    parser.add_argument("--weights", default="bfloat16", choices=("none", *FORMATS),
                        help="the target's packed weights (load(weights=...)); none: its own layers")
    parser.add_argument("--widths", default="3,5,8", help="rows per verification pass (γ + 1), each at least 3")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if min(widths) < static_lm.SYMBOLIC_MIN_ROWS:
        parser.error(f"--widths must each be at least {static_lm.SYMBOLIC_MIN_ROWS}")
    ladder = runpy.run_path(str(Path(__file__).with_name("size_ladder.py")), run_name="size_ladder")
    torch.set_num_threads(args.threads)
    layer_graphs_min, symbolic_min = layer_graphs.LAYER_GRAPHS_MIN_BYTES, static_lm.SYMBOLIC_MIN_ROWS
    layer_graphs.LAYER_GRAPHS_MIN_BYTES = 0  # both copies by layer, whatever the shape's size
    greedy = SamplingConfig()
    modes = {"per width": 1 << 30, "symbolic": symbolic_min}  # SYMBOLIC_MIN_ROWS for each copy's calls
    lms, outputs = {}, {}
    for mode, rows_from in modes.items():
        static_lm.SYMBOLIC_MIN_ROWS = rows_from
        model = ladder["build"](args.shape, getattr(torch, args.dtype))
        if args.weights != "none":
            pack_model(model, args.weights)
        prompt = torch.randint(0, model.config.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
        lm = lms[mode] = StaticCausalLM(model, compile=True, max_len=256)
        lm.buckets = tuple(sorted({1, *widths}))  # each width unpadded
        lm.prefill(prompt)
        start = time.perf_counter()
        for w in widths:
            t = time.perf_counter()
            scores, verdict = lm.score_and_verify(prompt[:w], None, greedy, None)
            outputs[mode, w] = scores.logits, verdict
            lm.crop(PROMPT_TOKENS)
            print(f"{mode}: width {w} first call {time.perf_counter() - t:.1f} s", flush=True)
        print(f"{mode}: the widths' first calls {time.perf_counter() - start:.1f} s in all", flush=True)
    for w in widths:
        (logits_a, verdict_a), (logits_b, verdict_b) = outputs["per width", w], outputs["symbolic", w]
        if not torch.equal(logits_a, logits_b) or verdict_a != verdict_b:
            raise SystemExit(f"width {w}: the two graphs' logits or verdicts differ")
    times = {(mode, w): [] for mode in lms for w in widths}
    for _ in range(args.repeats):
        for w in widths:
            for mode, lm in lms.items():
                static_lm.SYMBOLIC_MIN_ROWS = modes[mode]
                t = time.perf_counter()
                lm.score_and_verify(prompt[:w], None, greedy, None)
                times[mode, w].append(1e3 * (time.perf_counter() - t))
                lm.crop(PROMPT_TOKENS)
    layer_graphs.LAYER_GRAPHS_MIN_BYTES, static_lm.SYMBOLIC_MIN_ROWS = layer_graphs_min, symbolic_min
    for (mode, w), ms in times.items():
        print(f"{mode}: width {w} pass {statistics.median(ms):.1f} ms median ({min(ms):.1f}-{max(ms):.1f}, "
              f"{args.repeats} calls)", flush=True)


if __name__ == "__main__":
    main()
