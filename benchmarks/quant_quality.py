"""How far int8 and int4 weights move the default target from itself (the table llama.cpp's perplexity tool
prints): teacher-forced over held-out stdlib text, per format and group size, against the float32 model (and
bfloat16 for scale):

- top-1 agreement: how often the quantized model's argmax is the float32 model's (what greedy self-drafting
  accepts, to a first approximation);
- mean KL(p_f32 || p_quant) in nats per token;
- perplexity of the text under each model.

    python benchmarks/quant_quality.py [--tokens 20000] [--groups 32,64,128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import specdec
from specdec.runtime.weights import pack_model
from specdec.training.corpus import read_corpus


def windows(tokenizer, tokens: int, width: int = 256) -> list[torch.Tensor]:
    """Held-out text as windows of `width` token ids, `tokens` in all."""
    ids: list[int] = []
    for text in read_corpus("heldout"):
        ids += tokenizer(text).input_ids
        if len(ids) >= tokens:
            break
    ids = ids[:tokens]
    return [torch.tensor(ids[i : i + width]) for i in range(0, len(ids) - width + 1, width)]


@torch.no_grad()
def log_probs(model, batch: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.log_softmax(model(w[None]).logits[0].double(), -1) for w in batch]  # each [T, V]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--groups", default="32,64,128")
    parser.add_argument("--formats", default="int8,int4,w4a8", help="the quantized formats to compare")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, _, tokenizer = specdec.load_default(dtype=torch.float32)
    batch = windows(tokenizer, args.tokens)
    reference = log_probs(target, batch)
    rows = []

    def compare(name: str, model) -> None:
        got = log_probs(model, batch)
        agree = kl = nll = count = 0
        for w, ref, lp in zip(batch, reference, got):
            agree += int((ref[:-1].argmax(-1) == lp[:-1].argmax(-1)).sum())
            kl += float((ref[:-1].exp() * (ref[:-1] - lp[:-1])).sum())
            nll -= float(lp[:-1].gather(-1, w[1:, None]).sum())
            count += len(w) - 1
        rows.append({"model": name, "top1_agreement": agree / count, "kl_nats": kl / count,
                     "perplexity": math.exp(nll / count), "tokens": count})
        print(f"{name:>14}  top-1 {agree / count:.4f}  KL {kl / count:.5f}  ppl {math.exp(nll / count):.4f}",
              flush=True)

    compare("float32", target)
    compare("bfloat16", specdec.load_default(dtype=torch.bfloat16)[0])
    for weights in args.formats.split(","):
        for group in (int(g) for g in args.groups.split(",")):
            model = specdec.load_default(dtype=torch.float32)[0]
            compare(f"{weights} g{group}", pack_model(model, weights, group))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
