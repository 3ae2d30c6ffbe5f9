"""A self-draft's first request on the compiled path (or `--path static`) at one of the ladder's shapes (random
weights, built from the config in-process): what compiling costs, and the decode speed beside plain decoding's, with
one variant of the self-draft's draft graphs ("step": one step called γ times, `SelfDraft.per_step_graphs`;
"chain": γ steps per graph), and c and v (a draft step's and a verification pass's time over a plain step's).

One process per variant (compile times are per process): plain decoding's first request, packing the self-draft,
its first request (outputs checked identical to plain decoding's), and a second request. Random weights make the
acceptance meaningless; this measures compiling and the machinery:

    python benchmarks/self_draft_first_request.py --shape qwen2.5-1.5b --variant step
    python benchmarks/self_draft_first_request.py --shape qwen2.5-1.5b --dtype float32 --target-weights bfloat16
    python benchmarks/self_draft_first_request.py ... --whole   # every model compiled whole, for the A/B
"""

from __future__ import annotations

import argparse
import runpy
import time
from pathlib import Path

import torch

import specdec
from specdec.engine.decoding import SpeculativeDecoder
from specdec.runtime import layer_graphs
from specdec.runtime.weights import pack_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", help="a shape of benchmarks/size_ladder.py")
    parser.add_argument("--variant", choices=("step", "chain"), default="step")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--weights", default="w4a8", help="the self-draft's format")
    parser.add_argument("--target-weights", default=None, choices=("float32", "bfloat16"),
                        help="the target on packed weights of this format (load(weights=...)), its self-draft "
                             "quantized from them; default: the model's own layers")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the target's dtype (its activations' with --target-weights)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--path", choices=("compiled", "static"), default="compiled",
                        help="compiled: compile=True; static: the slot cache without inductor (compile='static')")
    parser.add_argument("--whole", action="store_true",
                        help="compile every model whole, not one graph per decoder layer (runtime/layer_graphs.py)")
    args = parser.parse_args()
    if args.whole:
        layer_graphs.LAYER_GRAPHS_MIN_BYTES = float("inf")
    ladder = runpy.run_path(str(Path(__file__).with_name("size_ladder.py")), run_name="size_ladder")
    if args.shape not in ladder["SHAPES"]:
        parser.error(f"--shape: choose one of {', '.join(ladder['SHAPES'])}")
    torch.set_num_threads(args.threads)
    path = True if args.path == "compiled" else "static"
    start = time.perf_counter()
    target = ladder["build"](args.shape, getattr(torch, args.dtype))
    if args.target_weights:
        pack_model(target, args.target_weights)
    print(f"build {time.perf_counter() - start:.1f} s", flush=True)
    prompt = torch.randint(0, target.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    plain = SpeculativeDecoder(target, None, max_new_tokens=args.new_tokens, compile=path, eos_token_id=[])
    expected = list(plain.stream(prompt))
    print(f"plain first request {time.perf_counter() - start:.1f} s wall, compile {plain.stats.compile_s:.1f} s, "
          f"{plain.stats.tokens_per_s:.2f} tok/s", flush=True)
    list(plain.stream(prompt))  # a second request: its stats time the passes without compiling
    print(f"plain second request {plain.stats.tokens_per_s:.2f} tok/s", flush=True)
    start = time.perf_counter()
    drafter = specdec.SelfDraft(target, args.weights)
    drafter.per_step_graphs = args.variant == "step"
    print(f"self-draft pack {time.perf_counter() - start:.1f} s", flush=True)
    decoder = SpeculativeDecoder(target, drafter, gamma=args.gamma, max_new_tokens=args.new_tokens, compile=path,
                                 eos_token_id=[])
    for request in ("first", "second"):
        start = time.perf_counter()
        if list(decoder.stream(prompt)) != expected:
            raise SystemExit(f"{args.variant}: the self-draft's output differs from plain decoding's")
        stats, step = decoder.stats, plain.stats.target_s / plain.stats.target_forwards  # a plain step's seconds
        print(f"{args.variant} self-draft γ{args.gamma} {request} request {time.perf_counter() - start:.1f} s wall, "
              f"compile {stats.compile_s:.1f} s, {stats.tokens_per_s:.2f} tok/s, α {stats.acceptance_rate:.2f}, "
              f"c {stats.draft_s / max(stats.drafted, 1) / step:.2f}, "
              f"v {stats.target_s / max(stats.target_forwards, 1) / step:.2f} (a plain step {1e3 * step:.0f} ms)",
              flush=True)


if __name__ == "__main__":
    main()
