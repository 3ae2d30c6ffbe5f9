"""The size ladder: models of the shapes users run (0.5B-8B), built in-process from their published configs with
random weights (no download), on specdec's fast path, per weight format, against this machine's own limits.

Per (model, weights format), in a fresh process each (so peak RSS is that model's):
- build time (config -> random weights), packing / quantization time, the fast path's compile time, peak RSS;
- the compiled target pass at 1 to 8 rows over a 96-token context (median ms), and the weight bytes it reads;
- the bandwidth that implies, and the floors: bandwidth (bytes / measured read bandwidth) and compute
  (FLOPs / measured matmul throughput), and each width's pass time over the larger floor.
The machine's read bandwidth (one core, all cores) and a large square matmul's FLOP/s in PyTorch (one core, per
dtype) are measured in the same run. Acceptance is not: random weights accept nothing meaningful. What a pass costs
at each width (v) and what a quantized self-draft's pass costs against the target's (c) go into the paper's
formula, speed-up = τ / (γc + v), for an α measured elsewhere (docs/quantization.md).

    python benchmarks/size_ladder.py --models qwen2.5-0.5b,llama-3.2-1b --weights float32,bfloat16,int8,int4 \
        --json ladder.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

#: Published shapes: (family, hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings).
SHAPES = {
    "qwen2.5-0.5b": ("qwen2", 896, 4864, 24, 14, 2, 151936, True),
    "llama-3.2-1b": ("llama", 2048, 8192, 16, 32, 8, 128256, True),
    "qwen2.5-1.5b": ("qwen2", 1536, 8960, 28, 12, 2, 151936, True),
    "llama-3.2-3b": ("llama", 3072, 8192, 28, 24, 8, 128256, True),
    "llama-3.1-8b": ("llama", 4096, 14336, 32, 32, 8, 128256, False),
    "llama-tiny": ("llama", 64, 128, 2, 4, 2, 512, False),  # the smoke tests' (tests/test_benchmarks.py)
    "default-target": ("llama", 384, 1024, 6, 6, 6, 8192, True),  # the shipped default target's, in cache (kernel A/Bs)
    # An encoder-decoder (load_memory.py): encoder and decoder of `layers` each, 128 mel bins, tied output projection.
    "whisper-large-v3": ("whisper", 1280, 5120, 32, 20, 20, 51866, True),
    "whisper-tiny-random": ("whisper", 64, 128, 2, 4, 4, 512, True),  # the smoke tests' encoder-decoder
    # Mixture of experts (load_memory.py): intermediate is each expert's; MOE gives the experts and those per token.
    "olmoe-1b-7b": ("olmoe", 2048, 1024, 16, 16, 16, 50304, False),
    "olmoe-tiny-random": ("olmoe", 64, 32, 2, 4, 4, 512, False),  # the smoke tests' MoE
}
#: (experts, experts per token) of the MoE shapes.
MOE = {"olmoe-1b-7b": (64, 8), "olmoe-tiny-random": (8, 2)}


def experts_per_token(name: str) -> int:
    """The experts a token of shape `name` reads a layer (0 for a dense shape)."""
    return MOE.get(name, (0, 0))[1]
CONTEXT = 96
WIDTHS = (1, 2, 4, 6, 8)


#: Values in the one random block every weight is filled from (tiled): drawing 3B values one by one on torch's
#: single-threaded CPU generator took 114 s on 16 cores; copying a block runs at memory speed.
RANDOM_BLOCK = 1 << 24
#: Where in the block parameter i's values start: i * OFFSET_STEP (mod the block), so no two parameters hold the same
#: values. (Started at the block's first value, every layer's weights were the same: OpenVINO's INT8 export of the
#: 0.5B shape kept one copy of each, 143 MB where distinct weights take 606, and its CPU plugin ran all 24 layers on
#: that copy from cache, where specdec and llama.cpp read 24.)
OFFSET_STEP = 1_000_003
#: The build's version, in the names of the checkpoints saved from it (ladder_peers.py): 2 = distinct parameters.
BUILD = 2


def build(name: str, dtype):
    """A randomly initialised model of shape `name`, built in `dtype` (no float32 copy first: 8B in bfloat16 is
    16 GB, in float32 32), every weight filled from one block of N(0, 0.02) values (seed 0), tiled, each parameter
    from its own place in the block (OFFSET_STEP). Its speed and memory are a trained model's; its outputs mean
    nothing."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )
    from transformers.initialization import no_init_weights

    family, hidden, inter, layers, heads, kv, vocab, tied = SHAPES[name]
    if family == "whisper":
        model_cls = WhisperForConditionalGeneration
        config = WhisperConfig(d_model=hidden, encoder_ffn_dim=inter, decoder_ffn_dim=inter, encoder_layers=layers,
                               decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=kv,
                               vocab_size=vocab, num_mel_bins=128, tie_word_embeddings=tied, pad_token_id=vocab - 1,
                               bos_token_id=vocab - 2, eos_token_id=vocab - 2, decoder_start_token_id=vocab - 3)
    elif family == "olmoe":
        from transformers import OlmoeConfig, OlmoeForCausalLM

        model_cls = OlmoeForCausalLM
        experts, per_token = MOE[name]
        config = OlmoeConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                             tie_word_embeddings=tied, num_experts=experts, num_experts_per_tok=per_token,
                             max_position_embeddings=4096)
    else:
        config_cls, model_cls = ((Qwen2Config, Qwen2ForCausalLM) if family == "qwen2"
                                 else (LlamaConfig, LlamaForCausalLM))
        config = config_cls(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                            tie_word_embeddings=tied, max_position_embeddings=4096)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights():
            model = model_cls(config)
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(0)
    block = torch.empty(RANDOM_BLOCK).normal_(0.0, 0.02, generator=gen).to(dtype)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            flat, done, source = p.view(-1), 0, i * OFFSET_STEP % RANDOM_BLOCK
            while done < flat.numel():
                n = min(flat.numel() - done, RANDOM_BLOCK - source)
                flat[done : done + n].copy_(block[source : source + n])
                done, source = done + n, 0
    return model.eval()


def save_checkpoint(name: str, directory: str) -> None:
    """The random model of shape `name` saved to `directory` in bfloat16 (safetensors, shards of at most 2 GB), by
    a process of its own: a process's peak RSS (ru_maxrss) counts its parent's resident memory at the fork, so the
    processes that measure a load must not come from one that held the model."""
    subprocess.run([sys.executable, __file__, "--save", name, directory], check=True)


def weight_bytes(model, experts_per_token: int = 0) -> int:
    """Bytes a one-row pass reads of the linear layers' weights (packed or not); of a MoE's experts, those of
    `experts_per_token` experts a layer (a row reads only its own)."""
    from torch import nn

    from specdec.runtime.weights import PackedExperts, PackedLinear, stacked_experts

    total = 0
    for m in model.modules():
        if isinstance(m, PackedLinear):
            total += m.packed.numel() * m.packed.element_size()
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, PackedExperts):
            stacks = m.gate_up.numel() * m.gate_up.element_size() + m.down.numel() * m.down.element_size()
            total += stacks * experts_per_token // m.num_experts
    for name in stacked_experts(model):  # transformers' own (float) experts
        params = list(model.get_submodule(name).parameters(recurse=False))
        total += sum(p.numel() * p.element_size() * experts_per_token // p.shape[0] for p in params)
    return total


def linear_params(model, experts_per_token: int = 0) -> int:
    """Weights a row multiplies by: the linear layers', and of a MoE's experts those of `experts_per_token` a layer."""
    from torch import nn

    from specdec.runtime.weights import PackedExperts, PackedLinear, stacked_experts

    dense = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear)))
    packed = sum(3 * m.hidden * m.intermediate * experts_per_token for m in model.modules()
                 if isinstance(m, PackedExperts))
    own = sum(p[0].numel() * experts_per_token for name in stacked_experts(model)
              for p in model.get_submodule(name).parameters(recurse=False))
    return dense + packed + own


def one(name: str, dtype_name: str, weights: str | None, threads: int, repeats: int, compiled: bool = True,
        checkpoint: str | None = None) -> dict:
    """Everything measured for one (model, weights) in this process; `compiled=False`: the fast path's slot cache
    and kernels without inductor (`compile="static"`: no compile time, the per-op overhead of eager passes).
    `checkpoint`: the model saved there is loaded as a user loads it (`load_model(weights=...)`: packed as it is
    read), and build_s is that load's time (packing included, pack_s 0); else it is built and packed here."""
    import torch

    from specdec.bench.timing import median_ms
    from specdec.runtime.static_lm import StaticCausalLM
    from specdec.runtime.weights import pack_model

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    out = {"model": name, "dtype": dtype_name, "weights": weights or "hf", "threads": threads,
           "path": "compiled" if compiled else "static"}
    start = time.perf_counter()
    if checkpoint:
        from specdec.hub.loading import load_model

        model = load_model(checkpoint, dtype=dtype, weights=weights)
        out["source"] = "checkpoint"
    else:
        model = build(name, dtype)
    out["build_s"] = time.perf_counter() - start
    out["params"] = sum(p.numel() for p in model.parameters())
    flops_per_row = 2 * linear_params(model, experts_per_token(name))
    start = time.perf_counter()
    if not checkpoint:
        pack_model(model, weights)
    out["pack_s"] = time.perf_counter() - start
    out["weight_bytes"] = weight_bytes(model, experts_per_token(name))
    out["rss_after_load_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    lm = StaticCausalLM(model, compile=compiled)
    lm.buckets = WIDTHS
    lm.ensure_capacity(CONTEXT + 2 * max(WIDTHS) + 8)
    start = time.perf_counter()
    prompt = torch.arange(10, 10 + CONTEXT)
    lm.prefill(prompt)
    passes = {}
    compile_s = time.perf_counter() - start  # the prefill's own shapes
    for width in WIDTHS:
        ids = torch.arange(20, 20 + width)

        def run():
            lm.crop(CONTEXT)
            lm.forward(ids)

        start = time.perf_counter()
        run()  # compiles this width
        compile_s += time.perf_counter() - start
        passes[width] = median_ms(run, repeats)
    out["compile_s"] = compile_s
    out["pass_ms"] = passes
    out["flops_per_row"] = flops_per_row
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def machine(threads: int) -> dict:
    """Read bandwidth (one core, `threads` cores) and one core's matmul FLOP/s per dtype, measured now.

    The read: the fastest of three readers of 1 GB, on 1 and on `threads` threads: torch's integer maximum, numpy's,
    and a float32 matrix-vector product (BLAS: a weight read once, as a one-row pass reads it). An integer maximum
    costs one instruction a vector, so the memory bounds it where the loop keeps enough loads in flight; a float32
    sum (numpy's pairwise one included) is bound by its adds on one AVX2 core, and read 8.5-10.9 GB/s where this
    reads 10-12. On one Zen 2 core torch's maximum read 12.1-12.8 GB/s, numpy's 12.6-16.6 and the matrix-vector
    product 17.3-18.5, and specdec's one-row passes 18: one reader alone understates what the core can read."""
    import numpy as np
    import torch

    words = torch.ones(256 << 20, dtype=torch.int32)  # 1 GB, beyond any L3
    array = words.numpy()
    matrix, vector = words.view(torch.float32).view(16384, -1).t(), torch.zeros(16384)  # [16384, 16384] as BLAS reads
    before = torch.get_num_threads()

    def read_gb_s(n: int) -> dict:
        torch.set_num_threads(n)
        readers = {"torch max": words.amax, "numpy max": array.max, "matrix-vector": lambda: torch.mv(matrix, vector)}
        return {name: words.numel() * 4 / min(_time(fn) for _ in range(5)) / 1e9 for name, fn in readers.items()}

    one_core, all_cores = read_gb_s(1), read_gb_s(threads)
    torch.set_num_threads(1)
    roof = {}
    for dtype, n in ((torch.float32, 2048), (torch.bfloat16, 512)):  # bfloat16 is slow where it is emulated
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        best = min(_time(lambda: a @ b) for _ in range(3))
        roof[str(dtype).split(".")[1]] = 2 * n**3 / best / 1e9
    torch.set_num_threads(before)
    return {"read_gb_s_one_core": max(one_core.values()), "read_gb_s_all_cores": max(all_cores.values()),
            "readers_gb_s": {"one core": one_core, "all cores": all_cores}, "matmul_gflop_s_one_core": roof}


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2.5-0.5b,llama-3.2-1b,qwen2.5-1.5b,llama-3.2-3b")
    parser.add_argument("--dtype", default="float32", help="activations' dtype (float32 or bfloat16)")
    parser.add_argument("--weights", default="float32,bfloat16,int8,int4",
                        help="weight formats (runtime/weights.py), 'hf' for the model's own layers")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--path", choices=("compiled", "static"), default="compiled",
                        help="the fast path compiled (inductor), or its slot cache and kernels uncompiled")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="save each model once under DIR (bfloat16 safetensors) and load it as a user does, "
                             "packed as it is read, instead of building it in the measuring process")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "DTYPE", "WEIGHTS"), help=argparse.SUPPRESS)
    parser.add_argument("--save", nargs=2, metavar=("MODEL", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.save:
        import torch

        build(args.save[0], torch.bfloat16).save_pretrained(args.save[1], max_shard_size="2GB")
        return
    if args.one:
        model, dtype, weights = args.one
        print(json.dumps(one(model, dtype, None if weights == "hf" else weights, args.threads, args.repeats,
                             args.path == "compiled", args.checkpoint)))
        return
    report = {"machine": machine(args.threads if args.threads > 1 else os.cpu_count() or 1), "threads": args.threads,
              "runs": []}
    print(json.dumps(report["machine"]), flush=True)
    for model in args.models.split(","):
        source = []
        if args.checkpoint:
            saved = os.path.join(args.checkpoint, model)
            if not os.path.isfile(os.path.join(saved, "config.json")):
                save_checkpoint(model, saved)
            source = ["--checkpoint", saved]
        for weights in args.weights.split(","):
            proc = subprocess.run([sys.executable, __file__, "--one", model, args.dtype, weights, "--threads",
                                   str(args.threads), "--repeats", str(args.repeats), "--path", args.path, *source],
                                  capture_output=True, text=True)
            if proc.returncode:
                print(f"{model} {weights}: failed\n{proc.stderr[-2000:]}", flush=True)
                continue
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            report["runs"].append(run)
            # the floors at the run's thread count: all cores' read, one core's matmul roof times the threads, at the
            # activations' dtype (a bfloat16 pass computes at bfloat16's roof; the integer formats' own roof is not
            # measured, so theirs is a float one). Where float32 computes faster (a CPU without bfloat16 arithmetic,
            # whose PyTorch matmul emulates it), specdec's kernels widen bfloat16 to float32, so that is the roof.
            bw = report["machine"]["read_gb_s_all_cores" if args.threads > 1 else "read_gb_s_one_core"]
            roofs = report["machine"]["matmul_gflop_s_one_core"]
            roof = max(roofs[args.dtype], roofs["float32"]) * args.threads
            made = "load" if args.checkpoint else "build"
            row = [f"{model} {weights}: {made} {run['build_s']:.0f} s, compile {run['compile_s']:.0f} s, "
                   f"RSS {run['peak_rss_gb']:.2f} GB, weights {run['weight_bytes'] / 1e9:.2f} GB"]
            for width, ms in run["pass_ms"].items():
                floor = max(run["weight_bytes"] / bw / 1e6, run["flops_per_row"] * int(width) / roof / 1e6)
                row.append(f"{width} rows {ms:.1f} ms ({run['weight_bytes'] / ms / 1e6:.1f} GB/s, "
                           f"{ms / floor:.2f}x floor)")
            print("\n  ".join(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
