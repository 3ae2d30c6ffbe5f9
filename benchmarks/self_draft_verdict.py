"""What `--drafter auto` decides at one of the ladder's shapes (random weights, built from the config in-process):
`choose_self_draft` measured afresh (remeasure), its verdict and figures printed. Random weights make the acceptance
meaningless (a random model's quantized copy agrees with it almost always); this measures the machinery's c and v
at the shape, as a trained model's would be, not a trained model's α:

    python benchmarks/self_draft_verdict.py --shape qwen2.5-1.5b --dtype float32 --target-weights bfloat16 --compile
"""

from __future__ import annotations

import argparse
import runpy
import time
from pathlib import Path

import torch

from specdec.engine.self_draft_choice import choose_self_draft
from specdec.runtime.weights import pack_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", help="a shape of benchmarks/size_ladder.py")
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    parser.add_argument("--target-weights", default=None, choices=("float32", "bfloat16"),
                        help="the target on packed weights of this format; default: the model's own layers")
    parser.add_argument("--compile", action="store_true", help="the compiled path (else eager)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    ladder = runpy.run_path(str(Path(__file__).with_name("size_ladder.py")), run_name="size_ladder")
    torch.set_num_threads(args.threads)
    target = ladder["build"](args.shape, getattr(torch, args.dtype))
    if args.target_weights:
        pack_model(target, args.target_weights)
    prompt = torch.randint(0, target.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    choice = choose_self_draft(target, prompt, compile=args.compile, remeasure=True)
    print(f"{args.shape} {args.dtype} on {args.target_weights or 'its own'} weights, "
          f"{'compiled' if args.compile else 'eager'}: {choice.reason} "
          f"(plain {choice.plain:.2f} tok/s, self-draft {choice.self_draft:.2f} tok/s; "
          f"{time.perf_counter() - start:.0f} s to decide)", flush=True)


if __name__ == "__main__":
    main()
