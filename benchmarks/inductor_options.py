"""Inductor options for the fast path, side by side: for each option set, the first-call compile time and the
median warm time of the default target's 1-token and γ+1-token passes and of the draft's γ-step graph.

Each option set compiles fresh copies of the models (compiled callables are cached per model object), and the
sets are timed in turn, interleaved, `--rounds` times. Usage:
    flock /tmp/specdec-bench.lock python benchmarks/inductor_options.py [--gamma 4] [--threads 1] [--only freezing,cpp_wrapper]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

import specdec
from specdec.core.sampling import SamplingConfig
from specdec.runtime import compiled
from specdec.runtime.static_lm import StaticCausalLM

OPTION_SETS = {
    "none": {},
    "freezing": {"freezing": True},
    "freezing+cpp_wrapper": {"freezing": True, "cpp_wrapper": True},
    "freezing+coordinate_descent": {"freezing": True, "coordinate_descent_tuning": True},
    "freezing+max_autotune": {"freezing": True, "max_autotune": True},
    "freezing+cpp_wrapper+max_autotune": {"freezing": True, "cpp_wrapper": True, "max_autotune": True},
    # inductor's CPU GEMM template only (no other autotuning): the skinny GEMMs of a verification pass
    "freezing+cpp_wrapper+cpp_gemm": {"freezing": True, "cpp_wrapper": True, "max_autotune": True,
                                      "max_autotune_gemm_backends": "CPP"},
}


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def build(name: str, target, draft, gamma: int, context: int):
    """Compile the three shapes with option set `name` on fresh model copies; return runners and compile s."""
    compiled.COMPILE_OPTIONS = OPTION_SETS[name]
    target, draft = copy.deepcopy(target), copy.deepcopy(draft)
    prompt = torch.arange(10, 10 + context)
    runners, compile_s = {}, {}
    for n in (1, gamma + 1):
        lm = StaticCausalLM(target, compile=True)
        lm.buckets = (n,)
        lm.ensure_capacity(context + 2 * n + 8)
        lm.prefill(prompt)
        ids = torch.arange(20, 20 + n)

        def run(lm=lm, ids=ids):
            lm.crop(context)
            lm.forward(ids)

        compile_s[f"target_{n}"] = timed(run, 1)[0]
        runners[f"target_{n}"] = run
    lm = StaticCausalLM(draft, compile=True)
    lm.ensure_capacity(context + 16)
    lm.prefill(prompt[:-1])

    def run_draft(lm=lm):
        lm.crop(context - 1)
        lm.draft_steps(prompt, gamma, SamplingConfig(), None)

    compile_s[f"draft_g{gamma}"] = timed(run_draft, 1)[0]
    runners[f"draft_g{gamma}"] = run_draft
    return runners, compile_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of `--repeats` calls per set")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", default=",".join(OPTION_SETS), help="comma list of option sets")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64
    target, draft, _ = specdec.load_default()
    names = args.only.split(",")
    built, result = {}, {}
    for name in names:
        try:
            built[name], compile_s = build(name, target, draft, args.gamma, args.context)
            result[name] = {"compile_s": compile_s}
        except Exception as exc:  # an option this machine's inductor cannot take: say so, go on
            result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(name, json.dumps(result[name]), flush=True)
    samples = {name: {k: [] for k in runners} for name, runners in built.items()}
    for _ in range(args.rounds):
        for name, runners in built.items():
            for key, run in runners.items():
                samples[name][key] += timed(run, args.repeats)
    for name in built:
        result[name]["median_ms"] = {k: round(1e3 * statistics.median(v), 3) for k, v in samples[name].items()}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
