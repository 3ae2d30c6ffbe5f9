"""specdec's plain decoding against llama.cpp's at the same bits, on the size ladder's shapes (random weights).

    python benchmarks/llamacpp_peer.py --setup --dir DIR      # once: llama.cpp's llama-completion and llama-quantize
    flock /tmp/specdec-bench.lock taskset -c 1 python benchmarks/ladder_peers.py --dir DIR --models qwen2.5-0.5b \\
        --num-prompts 6 --repeats 2 --out docs/bench/ladder-peers-NAME

Per shape, once: the random model of benchmarks/size_ladder.py (weights from one tiled block of N(0, 0.02), seed 0)
saved in bfloat16 with the default pair's tokenizer (the converter pads its vocabulary to the shape's with unused
tokens; the LM head is saved beside the embedding, so both sides read an untied head), converted to GGUF bf16 by
llama.cpp's converter, then to Q8_0 and Q4_0 by `llama-quantize`. The pairs, each at the same bits:

| specdec `load(weights=...)` | llama.cpp |
|:---|:---|
| `bfloat16` (packed bfloat16: 16 bits a weight) | `bf16` |
| `int8` (groups of 64, a float32 scale each: 8.5 bits) | `Q8_0` (blocks of 32, an fp16 scale each: 8.5 bits) |
| `int4` (the same groups: 4.5 bits; the LM head int8) | `Q4_0` (4.5 bits; llama-quantize makes its head Q8_0) |
| `w4a8` (int4's weights on int8 activations: integer arithmetic, as Q4_0's on a CPU) | `Q4_0` |

Timed: per prompt and repeat, in rotated order, specdec's plain decoding (`specdec.generate`, `compile=True`,
--threads threads; a warm-up request compiles first) and `llama-completion` (-t and -tb the same; a child process on
the same cores), NEW new tokens, greedy, EOS ignored. specdec's time is `generate`'s wall time (prefill included);
llama.cpp's is its own report for the request (prompt eval + eval + sampling; load and warm-up excluded).
tokens/s = new tokens / time; per format, the median tokens/s of each side and the per-prompt ratio's median and
range. The weights are random, so nothing here measures quality, and the two sides' outputs part at near-ties (not
compared).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts below

import specdec  # noqa: E402
from llamacpp_peer import VERSION, convert, llamacpp_run, per_prompt_medians, rotated, source_dir  # noqa: E402
from size_ladder import SHAPES, build  # noqa: E402
from specdec.bench.report import machine_info  # noqa: E402
from specdec.bench.workloads import code_prompts  # noqa: E402
from specdec.hub.default_pair import default_assets_dir  # noqa: E402

NEW = 64
#: specdec's weight format -> llama.cpp's type at the same bits.
PAIRS = {"bfloat16": "bf16", "int8": "Q8_0", "int4": "Q4_0", "w4a8": "Q4_0"}


def prepare(root: Path, name: str) -> dict[str, Path]:
    """The shape's HF checkpoint and one GGUF per llama.cpp type, made once under root/ladder/NAME."""
    folder = root / "ladder" / name
    checkpoint = folder / "hf"
    if not (checkpoint / "config.json").exists():
        checkpoint.mkdir(parents=True, exist_ok=True)
        build(name, torch.bfloat16).save_pretrained(checkpoint)
        for file in (default_assets_dir() / "tokenizer").iterdir():
            shutil.copy(file, checkpoint / file.name)
    ggufs = {"bf16": folder / "model-bf16.gguf"}
    if not ggufs["bf16"].exists():
        convert(root, checkpoint, "bf16", ggufs["bf16"])
    quantize = source_dir(root) / "build" / "bin" / "llama-quantize"
    for kind in ("Q8_0", "Q4_0"):
        ggufs[kind] = folder / f"model-{kind}.gguf"
        if not ggufs[kind].exists():
            subprocess.run([str(quantize), str(ggufs["bf16"]), str(ggufs[kind]), kind, "1"], check=True,
                           capture_output=True)
    return {"hf": checkpoint, **ggufs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="llama.cpp's folder (llamacpp_peer.py --setup)")
    parser.add_argument("--models", default="qwen2.5-0.5b", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--formats", default=",".join(PAIRS), help="comma list of bfloat16, int8, int4, w4a8")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads on each side (default 1)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M")
    specdec.set_threads(args.threads)
    scratch = args.dir / "scratch"
    scratch.mkdir(exist_ok=True)
    tokenizer = specdec.load_default()[2]
    prompts = code_prompts(tokenizer, args.num_prompts)
    runs, rows = [], []
    for name in args.models.split(","):
        files = prepare(args.dir, name)
        for fmt in args.formats.split(","):
            gguf = files[PAIRS[fmt]]
            model = specdec.load(files["hf"], dtype=torch.bfloat16, weights=fmt)[0]

            def specdec_run(prompt, model=model):
                start = time.perf_counter()
                specdec.generate(model, prompt.ids, max_new_tokens=NEW, temperature=0.0, eos_token_id=[],
                                 compile=True)
                return time.perf_counter() - start

            sides = {"specdec": specdec_run,
                     "llama.cpp": lambda prompt, gguf=gguf: llamacpp_run(args.dir, gguf, prompt.text, scratch,
                                                                         NEW, args.threads)[0]}
            for side in sides.values():  # warm-up: compiles, page cache
                side(prompts[0])
            these = []
            for repeat, prompt, side in rotated(list(sides), prompts, args.repeats):
                seconds = sides[side](prompt)
                these.append({"model": name, "format": fmt, "side": side, "prompt": prompt.name, "repeat": repeat,
                              "seconds": seconds, "tokens_per_s": NEW / seconds})
            runs += these
            per = per_prompt_medians(these, list(sides), prompts, key="side")
            ratios = [per["specdec"][p.name] / per["llama.cpp"][p.name] for p in prompts]
            rows.append({"model": name, "format": fmt, "llamacpp_type": PAIRS[fmt],
                         "specdec_tokens_per_s": statistics.median(per["specdec"].values()),
                         "llamacpp_tokens_per_s": statistics.median(per["llama.cpp"].values()),
                         "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                         "ratio_max": max(ratios)})
            print(json.dumps(rows[-1]), flush=True)
            del model
            gc.collect()
    machine = {**machine_info(), "llama_cpp": f"llama-cpp-python {VERSION}", "load_average_at_end": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"machine": machine, "new_tokens": NEW, "rows": rows,
                                                       "runs": runs}, indent=1))
    lines = [f"# specdec plain vs llama.cpp plain at the same bits: {args.models}, {NEW} new tokens, "
             f"{args.threads} thread(s) each",
             "", f"`python benchmarks/ladder_peers.py --models {args.models} --formats {args.formats} --num-prompts "
             f"{args.num_prompts} --repeats {args.repeats} --threads {args.threads}` (started {started}; "
             f"{machine['cpu']}, "
             f"{machine['cpu_family_model']}, kernels {machine['kernel_tier']}, {platform.machine()}; load average "
             f"{' '.join(f'{x:.2f}' for x in machine['load_average_at_end'])} at the end)", "",
             "| shape | specdec | llama.cpp | specdec tok/s | llama.cpp tok/s | specdec ÷ llama.cpp (median, range) |",
             "|:---|:---|:---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['format']} | {r['llamacpp_type']} | {r['specdec_tokens_per_s']:.2f} | "
                     f"{r['llamacpp_tokens_per_s']:.2f} | **{r['ratio_median']:.2f}x** ({r['ratio_min']:.2f}–"
                     f"{r['ratio_max']:.2f}) |")
    (args.out / "log.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
