"""Compiling a model whole against one graph per decoder layer (runtime/layer_graphs.py), in one process: two copies
of one ladder shape (random weights, built from the config), one compiled each way, each timed on its first
request (its compiles) and then on five more requests, interleaved, for the median of a plain decoding step.
Outputs must be identical. Start with a cold inductor cache (`TORCHINDUCTOR_CACHE_DIR` a new folder):

    python benchmarks/layer_graphs_ab.py --shape qwen2.5-1.5b --dtype float32 --weights bfloat16
"""

from __future__ import annotations

import argparse
import runpy
import statistics
import time
from pathlib import Path

import torch

from specdec.engine.decoding import SpeculativeDecoder
from specdec.runtime import layer_graphs
from specdec.runtime.weights import FORMATS, pack_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", help="a shape of benchmarks/size_ladder.py")
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    parser.add_argument("--weights", default="bfloat16", choices=("none", *FORMATS),
                        help="the target's packed weights (load(weights=...)); none: its own layers")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    ladder = runpy.run_path(str(Path(__file__).with_name("size_ladder.py")), run_name="size_ladder")
    torch.set_num_threads(args.threads)
    default_bytes = layer_graphs.LAYER_GRAPHS_MIN_BYTES
    decoders, outputs = {}, {}
    for mode in ("whole", "layers"):
        layer_graphs.LAYER_GRAPHS_MIN_BYTES = float("inf") if mode == "whole" else 0  # read when first compiled
        model = ladder["build"](args.shape, getattr(torch, args.dtype))
        if args.weights != "none":
            pack_model(model, args.weights)
        prompt = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
        decoder = SpeculativeDecoder(model, None, max_new_tokens=args.new_tokens, compile=True, eos_token_id=[])
        start = time.perf_counter()
        outputs[mode] = list(decoder.stream(prompt))
        print(f"{mode}: first request {time.perf_counter() - start:.1f} s, compile {decoder.stats.compile_s:.1f} s",
              flush=True)
        decoders[mode] = decoder
    layer_graphs.LAYER_GRAPHS_MIN_BYTES = default_bytes
    if outputs["whole"] != outputs["layers"]:
        raise SystemExit("the two compiles' outputs differ")
    steps = {mode: [] for mode in decoders}
    for _ in range(args.repeats):
        for mode, decoder in decoders.items():
            list(decoder.stream(prompt))
            steps[mode].append(1e3 * decoder.stats.target_s / decoder.stats.target_forwards)
    for mode, times in steps.items():
        print(f"{mode}: plain step {statistics.median(times):.1f} ms median ({min(times):.1f}-{max(times):.1f}, "
              f"{args.repeats} requests of {args.new_tokens} tokens)", flush=True)


if __name__ == "__main__":
    main()
