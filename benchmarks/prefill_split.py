"""Where a ladder request's time goes, prefill or decode: specdec's plain decoding against OpenVINO GenAI's and
llama.cpp's at the same bits, each request timed at 1 and at NEW new tokens (ladder_peers.py's requests, which
include the prefill).

    flock /tmp/specdec-bench.lock taskset -c 1 python benchmarks/ladder_peers.py ...   # once: the checkpoint
    flock /tmp/specdec-bench.lock taskset -c 1 python benchmarks/prefill_split.py --dir DIR --model qwen2.5-1.5b \\
        --format w8a8 [--peers OpenVINO,llama.cpp] --openvino-export-env ENV --openvino-cache CACHE

On the checkpoint ladder_peers.py saved (DIR/ladder/NAME-buildBUILD/hf) and OpenVINO's export of it at the same bits
(ladder_peers.py's OV_PAIRS and its OpenVINO side) and its GGUF at the same bits (PAIRS; llama.cpp's time is its own
report, as ladder_peers.py's), one thread each: after a warm-up request per side, --repeats rounds over --num-prompts
held-out `code` prompts, the sides and the two lengths alternated. Per side the median wall time of a one-token
request (the prefill and one token) and of a NEW-token one, and from them the time per decoded token
((NEW-token request - one-token request) / (NEW - 1)); for specdec also `DecodeStats.prefill_s`. Greedy, EOS ignored,
specdec compiled (`compile=True`), OpenVINO in bfloat16 where its CPU plugin has it, as ladder_peers.py runs them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import specdec  # noqa: E402
from ladder_peers import NEW, OV_PAIRS, PAIRS, openvino_dtype, openvino_side  # noqa: E402
from llamacpp_peer import llamacpp_run  # noqa: E402
from size_ladder import BUILD, SHAPES  # noqa: E402
from specdec.bench.report import machine_info  # noqa: E402
from specdec.bench.workloads import code_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="ladder_peers.py's --dir")
    parser.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--format", default="w8a8", choices=sorted(OV_PAIRS))
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peers", default="OpenVINO", help="comma list of OpenVINO, llama.cpp (default OpenVINO)")
    parser.add_argument("--openvino-export-env", default=None, metavar="DIR")
    parser.add_argument("--openvino-cache", default=None, metavar="DIR")
    args = parser.parse_args()
    checkpoint = args.dir / "ladder" / f"{args.model}-build{BUILD}" / "hf"
    peers = args.peers.split(",")
    if not set(peers) <= {"OpenVINO", "llama.cpp"}:  # ("" included: --peers "" names no peer)
        raise SystemExit(f"prefill_split: --peers takes OpenVINO and llama.cpp, got {args.peers!r}")
    if not (checkpoint / "config.json").exists():
        raise SystemExit(f"prefill_split: no checkpoint at {checkpoint}; run ladder_peers.py --models {args.model} "
                         "first")
    specdec.set_threads(1)
    prompts = code_prompts(specdec.load_default()[2], args.num_prompts)
    model = specdec.load(checkpoint, dtype=torch.bfloat16, weights=args.format)[0]
    prefills: list[float] = []

    def specdec_run(prompt, new: int) -> float:
        start = time.perf_counter()
        out = specdec.generate(model, prompt.ids, max_new_tokens=new, temperature=0.0, eos_token_id=[], compile=True)
        prefills.append(out.stats.prefill_s)
        return time.perf_counter() - start

    sides = {"specdec": specdec_run}
    if "OpenVINO" in peers:
        sides["OpenVINO"] = openvino_side(checkpoint, args.format, openvino_dtype(), 1, args)[0]
    if "llama.cpp" in peers:
        gguf, scratch = checkpoint.parent / f"model-{PAIRS[args.format]}.gguf", args.dir / "scratch"
        scratch.mkdir(exist_ok=True)
        sides["llama.cpp"] = lambda prompt, new: llamacpp_run(args.dir, gguf, prompt.text, scratch, new, 1)[0]
    for run in sides.values():
        run(prompts[0], NEW)  # warm-up: compiles, page cache
    prefills.clear()
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for prompt in prompts:
            for side, run in sides.items():
                for new in (1, NEW):
                    times.setdefault((side, new), []).append(run(prompt, new))
    machine = machine_info()
    print(f"{args.model} {args.format} (OpenVINO {OV_PAIRS[args.format]}, llama.cpp {PAIRS[args.format]}), "
          f"{args.num_prompts} prompts of "
          f"{len(prompts[0].ids)} tokens x {args.repeats}; {machine['cpu']} ({machine['cpu_family_model']}), one "
          "thread each")
    per_token = {}
    for side in sides:
        one, full = statistics.median(times[(side, 1)]), statistics.median(times[(side, NEW)])
        per_token[side] = (full - one) / (NEW - 1)
        print(f"  {side}: a 1-token request {one:.3f} s, a {NEW}-token one {full:.3f} s "
              f"({min(times[(side, NEW)]):.3f}-{max(times[(side, NEW)]):.3f}); {per_token[side] * 1e3:.1f} ms a "
              "decoded token")
    print(f"  specdec's prefill (DecodeStats.prefill_s): median {statistics.median(prefills):.3f} s")
    for peer in peers:
        ratio = statistics.median(times[(peer, NEW)]) / statistics.median(times[("specdec", NEW)])
        print(f"  specdec ÷ {peer}: {ratio:.2f}x the {NEW}-token request's speed, "
              f"{per_token[peer] / per_token['specdec']:.2f}x a decoded token's, "
              f"{statistics.median(times[(peer, 1)]) / statistics.median(times[('specdec', 1)]):.2f}x the "
              "1-token request's")


if __name__ == "__main__":
    main()
