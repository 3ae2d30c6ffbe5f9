"""llama.cpp side by side with specdec: the shipped default pair, greedy, the same held-out prompts and precision.

    python benchmarks/llamacpp_peer.py --setup --dir DIR        # once: build llama.cpp, convert the pair to GGUF
    flock /tmp/specdec-bench.lock taskset -c 1 python benchmarks/llamacpp_peer.py --dir DIR --dtype bfloat16 \\
        --num-prompts 12 --repeats 3 --out docs/bench/llamacpp-bf16

Setup (~3 min on 2 cores; ../shared/research/peer-llamacpp.md has the facts it follows):
- llama.cpp is the source bundled in the llama-cpp-python sdist (`pip download llama-cpp-python==VERSION
  --no-binary :all: --no-deps`), built with cmake (GGML_NATIVE, release, static) for its `llama-completion` and
  `llama-quantize` tools (`--no-amx`: without its AMX path, which crashes on Q4_0 / Q8_0 on a Xeon with AMX);
- the default target goes to GGUF (float32 and bfloat16 files) with the bundled `convert_hf_to_gguf.py` (it needs
  `pip install sentencepiece` beside transformers, even for a BPE tokenizer). Our
  byte-level BPE tokenizer's pre-tokenizer is not in its table of known hashes; its split is GPT-2's (ByteLevel,
  regex, no prefix space), so the converter is run with "gpt-2" for an unknown hash. The check below compares
  every output's text with specdec's plain decoding's (trailing newlines aside, which llama-completion adds), so a
  tokenization that differed would show.

The timed runs: one Python process interleaves, per prompt and repeat (in a rotated order), specdec's compiled
plain decoding, specdec with the draft model (γ from --gamma; over its whole vocabulary, and over the default pair's
2048 most frequent tokens) and llama.cpp's plain decoding (`llama-completion
-n 128 --temp 0 --top-k 1 --ignore-eos -t 1 -tb 1`, a child process). specdec's time is the wall time of the
`generate` call (prefill included); llama.cpp's is what it reports for the request itself: prompt eval + eval +
sampling time (its model load and warm-up excluded). tokens/s = new tokens / that time; medians and per-prompt
ratios with their range, like `specdec bench`. llama.cpp's own speculative decoding is slower than its plain
decoding on this pair (the research note), so its plain decoding is the peer's fastest method.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

import specdec
from specdec.bench.workloads import code_prompts
from specdec.hub.default_pair import default_assets_dir

VERSION = "0.3.36"  # llama-cpp-python, whose sdist bundles llama.cpp
NEW = 128
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}


def source_dir(root: Path) -> Path:
    return root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


SENTENCEPIECE = "0.2.3"  # what the GGUF converter imports


#: Runs the converter with an unknown pre-tokenizer hash converted as GPT-2's split (see the module's docstring).
CONVERT_SHIM = ("import sys, conversion.base as b\n"
                "original = b.TextModel.get_vocab_base_pre\n"
                "def pre(self, tokenizer):\n"
                "    try:\n        return original(self, tokenizer)\n"
                "    except NotImplementedError:\n        return 'gpt-2'\n"
                "b.TextModel.get_vocab_base_pre = pre\n"
                "sys.argv = sys.argv[1:]\n"
                "import runpy; runpy.run_path(sys.argv[0], run_name='__main__')\n")


#: llama.cpp 0.3.36's AMX path (ggml_backend_amx_mul_mat) crashes (SIGSEGV) on Q4_0 and Q8_0 on a Xeon with AMX
#: (BENCHMARKS.md); `--setup --no-amx` builds without it, so those types run on its AVX-512 VNNI kernels instead.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def setup(root: Path, no_amx: bool = False) -> None:
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-binary",
                        ":all:", "--no-deps", "-d", str(root)], check=True)
    src = source_dir(root)
    if not src.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    build = src / "build"
    subprocess.run(["cmake", "-B", str(build), "-S", str(src), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_OPENMP=ON",
                    # always set, so a rebuild without --no-amx clears what an earlier one left in cmake's cache
                    f"-DCMAKE_C_FLAGS={NO_AMX if no_amx else ''}", f"-DCMAKE_CXX_FLAGS={NO_AMX if no_amx else ''}"],
                   check=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", "llama-completion",
                    "llama-quantize"],
                   check=True)
    # the converter imports sentencepiece even for a BPE tokenizer
    if importlib.util.find_spec("sentencepiece") is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"sentencepiece=={SENTENCEPIECE}"], check=True)
    # the converter reads the tokenizer beside the weights: one folder with both (links)
    target = root / "default-target-hf"
    target.mkdir(exist_ok=True)
    for folder in ("target", "tokenizer"):
        for file in (default_assets_dir() / folder).iterdir():
            if not (target / file.name).exists():
                (target / file.name).symlink_to(file)
    for kind in GGUF_TYPES.values():
        out = root / f"default-target-{kind}.gguf"
        if not out.exists():
            convert(root, target, kind, out)
    print(f"llama.cpp built in {build}; GGUF files in {root}")


def convert(root: Path, checkpoint: Path, outtype: str, out: Path) -> None:
    """`checkpoint` (weights and tokenizer in one folder) to GGUF `outtype` at `out`, with the bundled converter."""
    src = source_dir(root)
    env = {**os.environ, "PYTHONPATH": f"{src}:{src / 'gguf-py'}"}
    subprocess.run([sys.executable, "-c", CONVERT_SHIM, str(src / "convert_hf_to_gguf.py"), str(checkpoint),
                    "--outtype", outtype, "--outfile", str(out)], check=True, env=env, cwd=src)


def rotated(names: list[str], prompts: list, repeats: int):
    """(repeat, prompt, name) in the timed order: each prompt and repeat runs every method, the first one rotating
    from one to the next, so that a slow phase of the machine does not always fall on the same method."""
    for repeat in range(repeats):
        for i, prompt in enumerate(prompts):
            shift = (i + repeat) % len(names)
            for name in names[shift:] + names[:shift]:
                yield repeat, prompt, name


def per_prompt_medians(runs: list[dict], names: list[str], prompts: list, key: str = "method") -> dict:
    """{name: {prompt name: median tokens/s of that method's runs on that prompt}} over `runs` (one method per
    run under `key`)."""
    per: dict = {name: {p.name: [] for p in prompts} for name in names}
    for r in runs:
        if r[key] in per:
            per[r[key]][r["prompt"]].append(r["tokens_per_s"])
    return {name: {p: statistics.median(v) for p, v in by_prompt.items()} for name, by_prompt in per.items()}


#: The request's times in llama.cpp's own report ("common_perf_print:        eval time = ... ms / ... runs").
PERF = {"sampling": re.compile(r"sampling time =\s+([0-9.]+) ms"),
        "prompt eval": re.compile(r"prompt eval time =\s+([0-9.]+) ms"),
        "eval": re.compile(r":\s+eval time =\s+([0-9.]+) ms")}


#: Attempts at a request whose llama-completion exits without its timing report (seen in long runs: it stops
#: after "generate:" with exit status 0, and the same prompt then runs normally); each retry is counted.
ATTEMPTS = 3
RETRIES: list[str] = []


def llamacpp_run(root: Path, model: Path, prompt_text: str, scratch: Path, new: int = NEW,
                 threads: int = 1) -> tuple[float, str]:
    """(seconds for the request as llama.cpp reports it, generated text): `new` tokens from GGUF `model`."""
    prompt_file = scratch / "prompt.txt"
    prompt_file.write_text(prompt_text)
    binary = source_dir(root) / "build" / "bin" / "llama-completion"
    for attempt in range(ATTEMPTS):
        proc = subprocess.run([str(binary), "-m", str(model), "-f", str(prompt_file), "-n", str(new), "--temp", "0",
                               "--top-k", "1", "--ignore-eos", "-t", str(threads), "-tb", str(threads), "-no-cnv",
                               "--no-display-prompt",
                               "-c", "1024", "--seed", "0"], capture_output=True, text=True, check=True,
                              stdin=subprocess.DEVNULL, errors="replace")  # a random model's bytes need not be UTF-8
        log = proc.stderr
        matches = {name: pattern.search(log) for name, pattern in PERF.items()}
        if all(matches.values()):
            return sum(float(m.group(1)) / 1e3 for m in matches.values()), proc.stdout
        RETRIES.append(prompt_text[:40])
    missing = next(name for name, m in matches.items() if m is None)
    raise RuntimeError(f"llama-completion printed no {missing} time in {ATTEMPTS} attempts:\n{log[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="where llama.cpp is built and the GGUF files are")
    parser.add_argument("--setup", action="store_true", help="build llama.cpp and convert the default pair, then exit")
    parser.add_argument("--no-amx", action="store_true", help="with --setup: build without llama.cpp's AMX path")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(GGUF_TYPES))
    parser.add_argument("--gamma", default="4,6")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=False)
    args = parser.parse_args()
    if args.setup:
        setup(args.dir, args.no_amx)
        return
    started = time.strftime("%Y-%m-%d %H:%M")
    specdec.set_threads(1)
    dtype = getattr(torch, args.dtype)
    target, draft, tokenizer = specdec.load_default(dtype=dtype)
    prompts = code_prompts(tokenizer, args.num_prompts)
    gammas = [int(g) for g in args.gamma.split(",")]
    scratch = args.dir / "scratch"
    scratch.mkdir(exist_ok=True)
    gguf = args.dir / f"default-target-{GGUF_TYPES[args.dtype]}.gguf"

    from specdec.drafters import DRAFT_VOCAB  # noqa: PLC0415
    from specdec.hub.default_pair import frequent_tokens  # noqa: PLC0415

    vocab = frequent_tokens(DRAFT_VOCAB)

    def specdec_run(prompt, gamma, reduced=False):
        drafter = specdec.DraftModel(draft, draft_vocab=vocab if reduced else None) if gamma else None
        start = time.perf_counter()
        out = specdec.generate(target, prompt.ids, drafter=drafter, gamma=gamma, max_new_tokens=NEW,
                               temperature=0.0, eos_token_id=[], compile=True)
        return time.perf_counter() - start, out.tokens

    methods = {"specdec plain, fast path": lambda p: specdec_run(p, None),
               **{f"specdec + draft, fast path, γ {g}": (lambda p, g=g: specdec_run(p, g)) for g in gammas},
               **{f"specdec + draft over {DRAFT_VOCAB} tokens, fast path, γ {g}": (
                   lambda p, g=g: specdec_run(p, g, reduced=True)) for g in gammas},
               "llama.cpp plain": lambda p: llamacpp_run(args.dir, gguf, p.text, scratch)}
    names = list(methods)
    for name in names:  # warm-up: compiles, page cache
        methods[name](prompts[0])
    runs = []
    for repeat, prompt, name in rotated(names, prompts, args.repeats):
        seconds, output = methods[name](prompt)
        # llama-completion ends its output with newlines of its own: texts compare without trailing ones
        text = (output if isinstance(output, str) else tokenizer.decode(output)).rstrip("\n")
        runs.append({"method": name, "prompt": prompt.name, "repeat": repeat, "seconds": seconds,
                     "tokens_per_s": NEW / seconds, "text": text})
    plain = {r["prompt"]: r["text"] for r in runs if r["method"] == names[0]}
    per = per_prompt_medians(runs, names, prompts)
    lines = [f"# llama.cpp side by side: default pair, {args.dtype}, greedy, {NEW} new tokens, 1 thread",
             "", f"`python benchmarks/llamacpp_peer.py --dtype {args.dtype} --num-prompts {args.num_prompts} "
             f"--repeats {args.repeats} --gamma {args.gamma}` (started {started}, "
             f"{platform.processor() or platform.machine()}, torch {torch.__version__}, llama.cpp from "
             f"llama-cpp-python {VERSION}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end)",
             "", f"llama-completion runs retried for a missing timing report: {len(RETRIES)}.",
             "", "| method | tokens/s (median) | output = specdec plain |", "|:---|---:|---:|"]
    for name in names:
        same = sum(r["text"] == plain[r["prompt"]] for r in runs if r["method"] == name)
        total = sum(r["method"] == name for r in runs)
        rate = statistics.median(r["tokens_per_s"] for r in runs if r["method"] == name)
        lines.append(f"| {name} | {rate:.0f} | {same}/{total} |")
    lines += ["", "Per-prompt ratios (median of each prompt's runs), median and range:", ""]
    for name in names[1:-1] + names[:1]:
        ratios = [per[name][p] / per["llama.cpp plain"][p] for p in per[name]]
        lines.append(f"- {name} ÷ llama.cpp plain: {statistics.median(ratios):.2f}x "
                     f"({min(ratios):.2f}–{max(ratios):.2f})")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(report)
        (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                           "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
