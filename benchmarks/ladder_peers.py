"""specdec's plain decoding against llama.cpp's and OpenVINO GenAI's at the same bits, on the size ladder's shapes
(random weights).

    python benchmarks/llamacpp_peer.py --setup --dir DIR      # once: llama.cpp's llama-completion and llama-quantize
    specdec bench --openvino-setup                            # once, for --openvino: the export environment
    flock /tmp/specdec-bench.lock taskset -c 1 python benchmarks/ladder_peers.py --dir DIR --models qwen2.5-0.5b \\
        --num-prompts 6 --repeats 2 [--openvino] --out docs/bench/ladder-peers-NAME

Per shape, once: the random model of benchmarks/size_ladder.py (weights from one tiled block of N(0, 0.02), seed 0,
each parameter from its own place in it) saved under DIR/ladder/NAME-buildBUILD in bfloat16 with the default pair's
tokenizer (the converter pads its vocabulary to the shape's with unused tokens; the LM head is saved beside the
embedding, so both sides read an untied head), converted to GGUF bf16 by llama.cpp's converter, then to Q8_0 and
Q4_0 by `llama-quantize`. The pairs, each at the same bits:

| specdec `load(weights=...)` | llama.cpp |
|:---|:---|
| `bfloat16` (packed bfloat16: 16 bits a weight) | `bf16` |
| `int8` (groups of 64, a float32 scale each: 8.5 bits) | `Q8_0` (blocks of 32, an fp16 scale each: 8.5 bits) |
| `int4` (the same groups: 4.5 bits; the LM head int8) | `Q4_0` (4.5 bits; llama-quantize makes its head Q8_0) |
| `w4a8` (int4's weights on int8 activations: integer arithmetic, as Q4_0's on a CPU) | `Q4_0` |
| `w8a8` (int8's weights on int8 activations: integer arithmetic, as Q8_0's on a CPU) | `Q8_0` |

With --openvino, OpenVINO GenAI's `LLMPipeline` on optimum-intel exports of the same checkpoint
(`specdec.bench.openvino_export`, cached by content hash) is a third side: `bfloat16` against the float32 IR run
at OpenVINO's bf16 precision (the CPU plugin converts the weights to it; f32 where the plugin has no bf16, and
--openvino-dtype chooses), `int8` and `w8a8` against its INT8 weights (symmetric, per output channel: 8 bits and
one scale a row), `int4` and `w4a8` against its INT4 weights (symmetric, groups of 64, every layer; embeddings and
head int8). The plugin's own defaults decide the rest (its dynamic quantization of activations for compressed weights
included); its KV cache is in the run's precision, as specdec's. OpenVINO's time is `generate`'s wall time with
prompt ids in and ids out (prefill included, its tokenizer off the timed path), as specdec's.

Timed: per prompt and repeat, in rotated order, specdec's plain decoding (`specdec.generate`, `compile=True`,
--threads threads; a warm-up request compiles first), `llama-completion` (-t and -tb the same; a child process on
the same cores) and with --openvino OpenVINO's (INFERENCE_NUM_THREADS the same), NEW new tokens, greedy, EOS
ignored. specdec's time is `generate`'s wall time (prefill included); llama.cpp's is its own report for the request
(prompt eval + eval + sampling; load and warm-up excluded). tokens/s = new tokens / time; per format, the median
tokens/s of each side and specdec's per-prompt ratio to each peer, median and range. The weights are random, so
nothing here measures quality, and the sides' outputs part at near-ties (not compared).
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
from size_ladder import BUILD, SHAPES, build  # noqa: E402
from specdec.bench.report import machine_info  # noqa: E402
from specdec.bench.workloads import code_prompts  # noqa: E402
from specdec.hub.default_pair import default_assets_dir  # noqa: E402

NEW = 64
#: specdec's weight format -> llama.cpp's type at the same bits.
PAIRS = {"bfloat16": "bf16", "int8": "Q8_0", "int4": "Q4_0", "w4a8": "Q4_0", "w8a8": "Q8_0"}
#: specdec's weight format -> OpenVINO's export format (openvino_export.WEIGHT_FORMATS) at the same bits.
OV_PAIRS = {"bfloat16": "fp32", "int8": "int8", "int4": "int4", "w4a8": "int4", "w8a8": "int8"}


def prepare(root: Path, name: str, kinds: tuple[str, ...] = ("bf16", "Q8_0", "Q4_0")) -> dict[str, Path]:
    """The shape's HF checkpoint and one GGUF per llama.cpp type in `kinds` (none: no llama.cpp side), made once under
    root/ladder/NAME-buildBUILD (a folder of an older build is not read). The bfloat16 GGUF, which the quantized ones
    are made from, is written only where a type asked for is missing (at 8B it is 16 GB)."""
    folder = root / "ladder" / f"{name}-build{BUILD}"
    checkpoint = folder / "hf"
    if not (checkpoint / "config.json").exists():
        checkpoint.mkdir(parents=True, exist_ok=True)
        build(name, torch.bfloat16).save_pretrained(checkpoint)
        for file in (default_assets_dir() / "tokenizer").iterdir():
            shutil.copy(file, checkpoint / file.name)
    files = {kind: folder / f"model-{kind}.gguf" for kind in kinds}
    missing = [kind for kind in kinds if not files[kind].exists()]
    bf16 = folder / "model-bf16.gguf"
    if missing and not bf16.exists():
        convert(root, checkpoint, "bf16", bf16)
    quantize = source_dir(root) / "build" / "bin" / "llama-quantize"
    for kind in missing:
        if kind != "bf16":
            subprocess.run([str(quantize), str(bf16), str(files[kind]), kind, "1"], check=True, capture_output=True)
    return {"hf": checkpoint, **files}


def openvino_side(checkpoint: Path, fmt: str, dtype: torch.dtype, threads: int, args: argparse.Namespace):
    """(OpenVINO's run of one prompt -> seconds, what ran) for specdec's format `fmt` on `checkpoint`."""
    from specdec.bench.openvino_peer import OpenVINOPeer, OpenVINOSettings  # noqa: PLC0415 (the openvino extra)

    settings = OpenVINOSettings(target_dir=str(checkpoint), cache_dir=args.openvino_cache,
                                export_env=args.openvino_export_env, weights=OV_PAIRS[fmt])
    peer = OpenVINOPeer(settings, dtype=dtype, threads=threads, speculative=False)

    def run(prompt, new: int = NEW) -> float:
        return peer.run("ov-plain", None, prompt.ids, max_new_tokens=new).wall_s

    return run, peer.describe()


def openvino_dtype(choice: str | None = None) -> torch.dtype:
    """OpenVINO's compute and KV precision: `choice`, else bfloat16 where its CPU plugin has it, else float32."""
    import openvino as ov  # noqa: PLC0415 (the openvino extra)

    default = "bfloat16" if "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES") else "float32"
    return getattr(torch, choice or default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="llama.cpp's folder (llamacpp_peer.py --setup)")
    parser.add_argument("--models", default="qwen2.5-0.5b", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--formats", default=",".join(PAIRS), help="comma list of bfloat16, int8, int4, w4a8, w8a8")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads on each side (default 1)")
    parser.add_argument("--openvino", action="store_true",
                        help="OpenVINO GenAI as a third side (pip install \"specdec[openvino]\" and specdec bench "
                             "--openvino-setup first)")
    parser.add_argument("--no-llamacpp", action="store_true",
                        help="leave llama.cpp out (with --openvino): for a shape where three copies of the model "
                             "do not fit in memory, llama.cpp's side run apart")
    parser.add_argument("--openvino-export-env", default=None, metavar="DIR",
                        help="the export environment (default: $SPECDEC_OPENVINO_EXPORT_ENV, as specdec bench)")
    parser.add_argument("--openvino-cache", default=None, metavar="DIR",
                        help="where exports are cached (default: $SPECDEC_OPENVINO_CACHE, as specdec bench)")
    parser.add_argument("--openvino-dtype", choices=("bfloat16", "float32"), default=None,
                        help="OpenVINO's compute and KV precision (default bfloat16 where its CPU plugin has it, "
                             "else float32)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.no_llamacpp and not args.openvino:
        parser.error("--no-llamacpp leaves specdec with no peer: add --openvino")
    formats = args.formats.split(",")
    unknown = [fmt for fmt in formats if fmt not in PAIRS]
    if unknown:
        parser.error(f"--formats: {', '.join(unknown)} is not one of {', '.join(PAIRS)}")
    started = time.strftime("%Y-%m-%d %H:%M")
    specdec.set_threads(args.threads)
    ov_dtype = openvino_dtype(args.openvino_dtype) if args.openvino else None
    scratch = args.dir / "scratch"
    scratch.mkdir(exist_ok=True)
    tokenizer = specdec.load_default()[2]
    prompts = code_prompts(tokenizer, args.num_prompts)
    runs, rows, peers = [], [], {}
    kinds = () if args.no_llamacpp else tuple(dict.fromkeys(PAIRS[fmt] for fmt in formats))  # llama.cpp's GGUFs
    for name in args.models.split(","):
        files = prepare(args.dir, name, kinds)
        for fmt in formats:
            model = specdec.load(files["hf"], dtype=torch.bfloat16, weights=fmt)[0]

            def specdec_run(prompt, model=model):
                start = time.perf_counter()
                specdec.generate(model, prompt.ids, max_new_tokens=NEW, temperature=0.0, eos_token_id=[],
                                 compile=True)
                return time.perf_counter() - start

            sides = {"specdec": specdec_run}
            if not args.no_llamacpp:
                sides["llama.cpp"] = lambda prompt, gguf=files[PAIRS[fmt]]: llamacpp_run(
                    args.dir, gguf, prompt.text, scratch, NEW, args.threads)[0]
            if args.openvino:
                run, peers[f"{name} {fmt}"] = openvino_side(files["hf"], fmt, ov_dtype, args.threads, args)
                sides["OpenVINO"] = run
            first = {side: run(prompts[0]) for side, run in sides.items()}  # warm-up: compiles, page cache
            these = []
            for repeat, prompt, side in rotated(list(sides), prompts, args.repeats):
                seconds = sides[side](prompt)
                these.append({"model": name, "format": fmt, "side": side, "prompt": prompt.name, "repeat": repeat,
                              "seconds": seconds, "tokens_per_s": NEW / seconds})
            runs += these
            per = per_prompt_medians(these, list(sides), prompts, key="side")
            row = {"model": name, "format": fmt, "llamacpp_type": PAIRS[fmt],
                   "specdec_tokens_per_s": statistics.median(per["specdec"].values()),
                   # the warm-up request's seconds per side: specdec's compiles its passes (a new shape's cost)
                   "first_request_s": first}
            for side, key in (("llama.cpp", "llamacpp"), ("OpenVINO", "openvino")):
                if side not in sides:
                    continue
                ratios = [per["specdec"][p.name] / per[side][p.name] for p in prompts]
                row.update({f"{key}_tokens_per_s": statistics.median(per[side].values()),
                            f"ratio_{key}_median": statistics.median(ratios), f"ratio_{key}_min": min(ratios),
                            f"ratio_{key}_max": max(ratios)})
            if args.openvino:
                row["openvino_weights"] = OV_PAIRS[fmt]
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
            del model, sides
            gc.collect()
    machine = {**machine_info(), "llama_cpp": f"llama-cpp-python {VERSION}", "load_average_at_end": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({
        "machine": machine, "build": BUILD, "new_tokens": NEW, "openvino_dtype": str(ov_dtype).replace("torch.", "") if ov_dtype
        else None, "openvino": peers, "rows": rows, "runs": runs}, indent=1))
    ov_note = (f", OpenVINO at {str(ov_dtype).replace('torch.', '')}" if ov_dtype else "")
    against = " and ".join(([] if args.no_llamacpp else ["llama.cpp"]) + (["OpenVINO"] if args.openvino else []))
    lines = [f"# specdec plain vs {against} plain at the same bits: "
             f"{args.models}, {NEW} new tokens, {args.threads} thread(s) each",
             "", f"`python benchmarks/ladder_peers.py --models {args.models} --formats {args.formats} --num-prompts "
             f"{args.num_prompts} --repeats {args.repeats} --threads {args.threads}"
             f"{' --openvino' if args.openvino else ''}{' --no-llamacpp' if args.no_llamacpp else ''}` "
             f"(started {started}; {machine['cpu']}, "
             f"{machine['cpu_family_model']}, kernels {machine['kernel_tier']}, {platform.machine()}{ov_note}; load "
             f"average {' '.join(f'{x:.2f}' for x in machine['load_average_at_end'])} at the end; the random models "
             f"of size_ladder.py's build {BUILD})", ""]
    if args.no_llamacpp:
        header, rule = "| shape | specdec | specdec tok/s |", "|:---|:---|---:|"
    else:
        header = ("| shape | specdec | llama.cpp | specdec tok/s | llama.cpp tok/s | specdec ÷ llama.cpp "
                  "(median, range) |")
        rule = "|:---|:---|:---|---:|---:|---:|"
    if args.openvino:
        header += " OpenVINO | OpenVINO tok/s | specdec ÷ OpenVINO (median, range) |"
        rule += ":---|---:|---:|"
    lines += [header, rule]
    for r in rows:
        if args.no_llamacpp:
            line = f"| {r['model']} | {r['format']} | {r['specdec_tokens_per_s']:.2f} |"
        else:
            line = (f"| {r['model']} | {r['format']} | {r['llamacpp_type']} | {r['specdec_tokens_per_s']:.2f} | "
                    f"{r['llamacpp_tokens_per_s']:.2f} | **{r['ratio_llamacpp_median']:.2f}x** "
                    f"({r['ratio_llamacpp_min']:.2f}–{r['ratio_llamacpp_max']:.2f}) |")
        if args.openvino:
            line += (f" {r['openvino_weights']} | {r['openvino_tokens_per_s']:.2f} | "
                     f"**{r['ratio_openvino_median']:.2f}x** "
                     f"({r['ratio_openvino_min']:.2f}–{r['ratio_openvino_max']:.2f}) |")
        lines.append(line)
    (args.out / "log.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
