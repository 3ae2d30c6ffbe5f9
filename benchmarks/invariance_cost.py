"""What row invariance costs: the default pair decoded with specdec's row-invariant kernels (what the library does)
against the same passes on PyTorch's own kernels (the fastest path without invariance), side by side in one
process, on the same prompts and precision.

    flock /tmp/specdec-bench.lock taskset -c 1 python benchmarks/invariance_cost.py --dtype bfloat16 --path compiled

Two copies of the default pair are loaded. The "library kernels" copy runs with the routing to
`specdec::row_attention` / `specdec::row_linear` switched off (the adapters' `row_invariant` replaced by a null
context, for this copy's calls only: its compiled graphs are traced without the kernels and keep their own
entries, keyed by model object); the "row-invariant" copy runs the library unchanged. Each method runs
on both copies, interleaved and rotated per prompt; tokens/s are medians over prompts of the median over
repeats. Each copy's greedy output is also compared with its own plain decoding (same copy, same path): the
library-kernel copy is the negative control of the identity the invariant one keeps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from unittest import mock

import torch


def _no_kernels(linear: bool = False):
    return contextlib.nullcontext()


@contextlib.contextmanager
def library_kernels():
    """The adapters' passes without the row-invariant routing (PyTorch's kernels, no mode entered), while inside."""
    import specdec.runtime.causal_lm as causal_lm
    import specdec.runtime.slot_cache as slot_cache

    with mock.patch.object(slot_cache, "row_invariant", _no_kernels), \
            mock.patch.object(causal_lm, "row_invariant", _no_kernels):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--path", default="compiled", choices=("compiled", "eager"),
                        help="compiled: the fast path (compile=True); eager: the eager adapter")
    parser.add_argument("--methods", default="plain,draft-g6", help="comma list of plain, draft-gN, draft-auto")
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out code prompts (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the results JSON here")
    args = parser.parse_args()

    import specdec
    from specdec.bench.workloads import code_prompts
    from specdec.runtime.precision import cpu_model

    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    compile_ = args.path == "compiled"
    copies = {"row-invariant": specdec.load_default(dtype=dtype), "library kernels": specdec.load_default(dtype=dtype)}
    prompts = code_prompts(copies["row-invariant"][2], args.num_prompts, prompt_tokens=128, seed=1)
    methods = args.methods.split(",")

    def run(copy: str, method: str, prompt) -> tuple[list[int], float]:
        target, draft, _ = copies[copy]
        drafter, gamma = None, None
        if method.startswith("draft-g"):
            drafter, gamma = specdec.DraftModel(draft), (int(method[7:]) if method[7:] != "auto" else "auto")
        elif method == "draft-auto":
            drafter, gamma = specdec.DraftModel(draft), "auto"
        with library_kernels() if copy == "library kernels" else contextlib.nullcontext():
            start = time.perf_counter()
            out = specdec.generate(target, prompt.ids, drafter=drafter, gamma=gamma, max_new_tokens=args.max_new_tokens,
                                   eos_token_id=[], compile=compile_)
            return list(out.tokens), time.perf_counter() - start

    cells = [(copy, method) for method in methods for copy in copies]
    for copy, method in cells:  # warm-up: compiles every shape outside the timings
        run(copy, method, prompts[0])
    walls = {cell: [] for cell in cells}
    same = {cell: [] for cell in cells}
    for i, prompt in enumerate(prompts):
        order = cells[i % len(cells):] + cells[: i % len(cells)]
        per_prompt = {cell: [] for cell in cells}
        tokens = {}
        for _ in range(args.repeats):
            for cell in order:
                tokens[cell], wall = run(*cell, prompt)
                per_prompt[cell].append(wall)
        for cell in cells:
            walls[cell].append(statistics.median(per_prompt[cell]))
            same[cell].append(tokens[cell] == tokens[(cell[0], "plain")] if (cell[0], "plain") in tokens else None)

    rows = []
    for method in methods:
        speeds = {copy: [args.max_new_tokens / w for w in walls[(copy, method)]] for copy in copies}
        ratios = [a / b for a, b in zip(speeds["row-invariant"], speeds["library kernels"])]
        rows.append({"method": method,
                     **{f"tok_s {copy}": round(statistics.median(v), 1) for copy, v in speeds.items()},
                     "invariant / library (median over prompts)": round(statistics.median(ratios), 3),
                     "range": [round(min(ratios), 3), round(max(ratios), 3)],
                     **{f"identical to plain, {copy}": f"{sum(bool(s) for s in same[(copy, method)])}/{len(prompts)}"
                        for copy in copies}})
    machine = {"cpu": cpu_model(), "python": platform.python_version(), "torch": torch.__version__,
               "load_average": os.getloadavg(), "dtype": args.dtype, "path": args.path, "threads": 1,
               "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats}
    print(json.dumps(machine))
    header = list(rows[0])
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[h]) for h in header) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
