"""Measure CPU forward-pass wall time of candidate Llama sizes for the default (target, draft) pair.

For each candidate: fp32 on CPU, ``torch.inference_mode()``, a KV cache already holding
``--context`` tokens, then the median wall time of ``--repeats`` forwards of 1 token and of
``gamma + 1`` tokens (each forward rolls the cache back so the context length stays fixed).
Also times one training step (forward + backward + AdamW) to estimate training tokens/s.

    python benchmarks/size_sweep.py --vocab 8192 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# name: (hidden, layers, heads, intermediate)
CANDIDATES: dict[str, tuple[int, int, int, int]] = {
    "d128-L1": (128, 1, 2, 384),
    "d192-L1": (192, 1, 3, 512),
    "d256-L1": (256, 1, 4, 768),
    "d256-L2": (256, 2, 4, 768),
    "d384-L4": (384, 4, 6, 1024),
    "d384-L6": (384, 6, 6, 1024),
    "d512-L6": (512, 6, 8, 1408),
    "d512-L8": (512, 8, 8, 1408),
    "d640-L8": (640, 8, 10, 1728),
}


def build(hidden: int, layers: int, heads: int, inter: int, vocab: int) -> torch.nn.Module:
    """A randomly initialised LlamaForCausalLM with tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=inter,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


@torch.inference_mode()
def time_forward(model: torch.nn.Module, vocab: int, context: int, n_new: int, repeats: int) -> float:
    """Median seconds of a forward of ``n_new`` tokens on top of a ``context``-token KV cache."""
    ids = torch.randint(0, vocab, (1, context))
    out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    new = torch.randint(0, vocab, (1, n_new))
    times = []
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        model(input_ids=new, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cache.crop(-n_new)  # roll back to `context` tokens
    return statistics.median(times[3:])


def time_train_step(model: torch.nn.Module, vocab: int, batch: int, seq: int, repeats: int) -> float:
    """Training tokens per second for one AdamW step at (batch, seq)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (batch, seq))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    model.eval()
    return batch * seq / statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--train-batch", type=int, default=16)
    parser.add_argument("--train-seq", type=int, default=256)
    parser.add_argument("--no-train", action="store_true", help="skip the training-throughput column")
    parser.add_argument("--only", nargs="*", help="candidate names to run (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"| model | params (total) | non-emb params | fwd 1 tok (ms) | fwd {args.gamma + 1} tok (ms) | train tok/s |")
    print("|---|---|---|---|---|---|")
    for name, (h, layers, heads, inter) in CANDIDATES.items():
        if args.only and name not in args.only:
            continue
        model = build(h, layers, heads, inter, args.vocab)
        total = sum(p.numel() for p in model.parameters())
        non_emb = total - model.get_input_embeddings().weight.numel()
        t1 = time_forward(model, args.vocab, args.context, 1, args.repeats)
        tg = time_forward(model, args.vocab, args.context, args.gamma + 1, args.repeats)
        tps = "-" if args.no_train else f"{time_train_step(model, args.vocab, args.train_batch, args.train_seq, 3):.0f}"
        print(f"| {name} | {total / 1e6:.2f}M | {non_emb / 1e6:.2f}M | {t1 * 1e3:.2f} | {tg * 1e3:.2f} | {tps} |", flush=True)


if __name__ == "__main__":
    main()
