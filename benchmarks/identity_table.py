"""The identity table: per method, the fraction of held-out prompts whose greedy output is token-identical to plain
decoding on the same path (`specdec.check_greedy`), on the shipped default pair, at 1 thread.

--weights FORMAT packs the target's linear layers in that format first (`load(weights=...)`'s packing: int8, int4,
w8a8, w4a8, bfloat16, float32), so the table checks the quantized model against its own plain decoding (the promise
of docs/quantization.md, "What is exact"); the draft stays in the dtype. The `self-draft-*` methods draft with the
target's own quantized copy (`SelfDraft`), on a target in its float weights.

Fast-path methods (compile=True) are held to compiled plain decoding, eager ones to eager plain decoding, and
`generate_batch` rows (1, 8, 32 rows; eager and compile=True) to each request decoded alone on the same path.
Each divergence is listed with its prompt, position and the plain pass's top-2 gap (docs/exactness.md).

    OMP_NUM_THREADS=1 python benchmarks/identity_table.py --out docs/bench/identity-bf16
    (default: bfloat16 on 64 prompts x 128 new tokens, then float16 on 8 and float32 on 16 prompts as checks)
    OMP_NUM_THREADS=1 python benchmarks/identity_table.py --dtypes bfloat16:64 --weights w4a8 \
        --methods "draft γ=4,draft γ=auto,generate_batch draft γ=4 at 8 rows" --out docs/bench/identity-w4a8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

import specdec
from specdec.bench.workloads import code_prompts
from specdec.drafters import make_drafter
from specdec.exactness import plain_reference
from specdec.runtime.weights import FORMATS, QUANTIZED, pack_model

#: label -> (drafter kind or None for plain, drafter options, gamma, compile, batch_size).
METHODS = {
    "draft γ=4": ("draft", {}, 4, True, None),
    "draft γ=auto": ("draft", {}, "auto", True, None),
    "draft-tree": ("draft-tree", {}, None, True, None),
    "eagle": ("eagle", {}, None, True, None),
    "eagle-chain γ=4": ("eagle-chain", {}, 4, True, None),
    "prompt-lookup γ=4": ("prompt-lookup", {}, 4, True, None),
    "eager draft γ=4": ("draft", {}, 4, False, None),
    "eager draft-tree": ("draft-tree", {}, None, False, None),
    "eager layer-skip γ=4": ("layer-skip", {}, 4, False, None),
    "self-draft-w4a8 γ=auto": ("self-draft-w4a8", {}, "auto", True, None),
    "self-draft-w8a8 γ=4": ("self-draft-w8a8", {}, 4, True, None),
    "self-draft-int4 γ=4": ("self-draft-int4", {}, 4, True, None),
    **{f"{path}generate_batch draft γ=4 at {rows} rows": ("draft", {}, 4, compile, rows)
       for compile, path in ((False, "eager "), (True, "")) for rows in (1, 8, 32)},
}


def _against(compile: bool, batch_size: int | None) -> str:
    path = "compiled" if compile else "eager"
    return f"{path} plain, each request alone" if batch_size else f"{path} plain"


def run(label: str, target, draft, prompts: dict, new_tokens: int, references: dict) -> dict:
    kind, options, gamma, compile, batch_size = METHODS[label]
    settings = {"max_new_tokens": new_tokens, "eos_token_id": [], "compile": compile}
    if compile not in references:  # plain decoding on this path, once for all its methods
        references[compile] = plain_reference(target, prompts, **settings)
    drafter = None if kind is None else make_drafter(kind, target=target, draft=draft, **options)
    report = specdec.check_greedy(target, prompts, drafter, method=label, gamma=gamma, batch_size=batch_size,
                                  reference=references[compile], **settings)
    out = report.to_dict()
    out["against"] = _against(compile, batch_size)
    for d in out["divergences"]:
        d["prompt_source"] = prompts[d["prompt"]]
    return out


def table(results: list[dict]) -> str:
    lines = ["| dtype | method | against | identical | fraction | tokens compared | near-ties crossed | "
             "divergences (prompt @ position: top-2 gap, margin in ulp) |", "|:---|:---|:---|---:|---:|---:|---:|:---|"]
    for r in results:
        divs = "; ".join(f"{d['prompt']} @ {d['position']}: gap {d['gap']:.4g}, margin {d['ulps']:.3g} ulp"
                         if d["margin"] is not None else f"{d['prompt']} @ {d['position']}: one output ended"
                         for d in r["divergences"]) or "none"
        packed = r.get("weights", "as loaded")
        dtype = r["dtype"] if packed == "as loaded" else f"{r['dtype']}, {packed} weights"
        lines.append(f"| {dtype} | {r['method']} | {r['against']} | {r['identical']}/{r['prompts']} | "
                     f"{100 * r['identical_fraction']:.1f}% | {r['tokens_compared']} | {r['near_ties']} | {divs} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16:64,float16:8,float32:16",
                        help="dtype:prompts, comma-separated (default bfloat16:64,float16:8,float32:16)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="which held-out code prompts (default 0)")
    parser.add_argument("--methods", default=None, help=f"comma-separated subset of: {', '.join(METHODS)}")
    parser.add_argument("--weights", default=None, choices=FORMATS,
                        help="the target's linear layers packed in this format (default: as loaded)")
    parser.add_argument("--out", default=None, help="directory for results.json and table.md")
    args = parser.parse_args()
    quantized = args.weights in QUANTIZED  # a target on quantized weights has no float weights to self-draft from
    methods = ([m for m in METHODS if not (quantized and METHODS[m][0].startswith("self-draft-"))]
               if args.methods is None else [m.strip() for m in args.methods.split(",")])
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    specdec.set_threads(1)  # identity does not depend on the thread count; the machine is shared
    start, results = time.time(), []
    for spec in args.dtypes.split(","):
        dtype, count = spec.split(":")
        target, draft, tokenizer = specdec.load_default(dtype=dtype)
        pack_model(target, args.weights)  # None: nothing
        prompts = {p.name: p.ids for p in code_prompts(tokenizer, int(count), seed=args.seed)}
        references: dict = {}
        for label in methods:
            results.append(run(label, target, draft, prompts, args.new_tokens, references))
            r = results[-1]
            r["weights"] = args.weights or "as loaded"
            print(f"{dtype} {label}: {r['identical']}/{r['prompts']} identical ({r['elapsed_s']:.0f} s)",
                  file=sys.stderr, flush=True)
            if args.out is not None:  # after every method: a stopped run keeps what it measured
                write(Path(args.out), results, args, time.time() - start)
    print(table(results))


def write(out: Path, results: list[dict], args: argparse.Namespace, elapsed_s: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["OMP_NUM_THREADS=1", "python", *sys.argv]), "machine": platform.processor()
            or platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "load_avg": os.getloadavg(),
            "elapsed_s": elapsed_s, "new_tokens": args.new_tokens, "seed": args.seed, "weights": args.weights}
    (out / "results.json").write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    (out / "table.md").write_text(f"`{meta['command']}`\n\n{table(results)}\n")

if __name__ == "__main__":
    main()
