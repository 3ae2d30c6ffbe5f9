"""Greedy tie-breaks under low precision: does scoring γ+1 tokens in one pass pick the same argmax as
feeding them one at a time?

Speculative decoding's target pass scores the last committed token and γ drafts together; plain decoding
scores one token per pass. In exact arithmetic the logits are identical; in float32 / bfloat16 the two
computations differ in matmul shapes and accumulation order, so logits differ by rounding, and when the top
two logits are (nearly) tied the argmax can differ. Then greedy speculative output differs from greedy plain
output — not a bug in the algorithm, a property of the arithmetic. `argmax_agreement` measures how often.

    python -m specdec.exactness.numerics            # tiny random models, float32 and bfloat16
    python -m specdec.exactness.numerics --default  # also the shipped default pair's target
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel

from specdec.runtime.causal_lm import CachedCausalLM


@dataclass
class Agreement:
    model: str
    dtype: str
    gamma: int
    positions: int
    argmax_differs: int  # positions where the block-of-(γ+1) pass and the one-token passes disagree
    rounds: int  # blocks of γ+1 positions (one verification pass each)
    rounds_differ: int  # blocks with at least one such position
    differs_from_float64: tuple[int, int]  # (one-token, block) argmax != float64 argmax
    exact_top2_ties: int  # positions where the one-token pass's top-2 logits are exactly equal
    max_abs_logit_diff: float
    seconds: float


@torch.inference_mode()
def _logits(lm: CachedCausalLM, tokens: torch.Tensor, block: int) -> torch.Tensor:
    """Feed tokens [T] in blocks of `block` after a reset; logits [T, V] (position i predicts token i+1)."""
    lm.reset()
    rows = [lm.forward(tokens[i : i + block]) for i in range(0, tokens.shape[0], block)]
    return torch.cat(rows)


def argmax_agreement(
    model: PreTrainedModel, dtype: torch.dtype, *, gamma: int = 4, sequences: int = 10, length: int = 200,
    seed: int = 0, name: str = "", tokens: list[int] | None = None,
) -> Agreement:
    """Compare argmaxes of one-token passes and (γ+1)-token passes of `model` cast to `dtype`, over
    `sequences` token sequences of `length` (teacher forcing: both see the same context): consecutive
    slices of `tokens` (e.g. real text) when given, else uniformly random tokens."""
    start = time.perf_counter()
    low = copy.deepcopy(model).to(dtype).eval()
    ref = copy.deepcopy(model).to(torch.float64).eval()
    lm_low, lm_ref = CachedCausalLM(low), CachedCausalLM(ref)
    gen = torch.Generator().manual_seed(seed)
    differs = from_ref_one = from_ref_block = ties = positions = rounds = rounds_differ = 0
    max_diff = 0.0
    for i in range(sequences):
        if tokens is not None:
            ids = torch.tensor(tokens[i * length : (i + 1) * length], dtype=torch.long)
            if ids.shape[0] < length:
                break
        else:
            ids = torch.randint(0, lm_low.vocab_size, (length,), generator=gen)
        one = _logits(lm_low, ids, 1)
        block = _logits(lm_low, ids, gamma + 1)
        exact = _logits(lm_ref, ids, length)
        a_one, a_block, a_exact = one.argmax(-1), block.argmax(-1), exact.argmax(-1)
        mismatch = a_one != a_block  # [length]
        differs += int(mismatch.sum())
        for i in range(0, length, gamma + 1):
            rounds += 1
            rounds_differ += bool(mismatch[i : i + gamma + 1].any())
        from_ref_one += int((a_one != a_exact).sum())
        from_ref_block += int((a_block != a_exact).sum())
        top2 = one.topk(2, dim=-1).values
        ties += int((top2[:, 0] == top2[:, 1]).sum())
        max_diff = max(max_diff, float((one - block).abs().max()))
        positions += length
    return Agreement(name or type(model).__name__, str(dtype).replace("torch.", ""), gamma, positions, differs, rounds,
                     rounds_differ, (from_ref_one, from_ref_block), ties, max_diff, time.perf_counter() - start)


def _tiny_models() -> dict[str, PreTrainedModel]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.05))
    torch.manual_seed(1)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=2048, n_embd=128, n_layer=4, n_head=4, n_positions=512,
                                      bos_token_id=None, eos_token_id=None))
    return {"tiny-llama (V=2048, d=128, 4 layers)": llama.eval(), "tiny-gpt2 (V=2048, d=128, 4 layers)": gpt2.eval()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=10)
    parser.add_argument("--length", type=int, default=200)
    parser.add_argument("--default", action="store_true", help="also measure the default pair (target, draft)")
    parser.add_argument("--model", action="append", default=[], help="also measure this model (path)")
    parser.add_argument("--text", help="contexts from this text file, tokenized with --tokenizer (default: "
                        "random tokens); used for --default / --model")
    parser.add_argument("--tokenizer", help="tokenizer path for --text (default: the default pair's)")
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny random models")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models = {} if args.no_tiny else _tiny_models()
    tokenizer = None
    if args.default:
        import specdec

        target, draft, tokenizer = specdec.load_default()
        models["default target"], models["default draft"] = target, draft
    for path in args.model:
        from specdec.hub.loading import load_model

        models[path] = load_model(path)
    text_tokens = None
    if args.text:
        from transformers import AutoTokenizer

        if args.tokenizer:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        with open(args.text, encoding="utf-8") as handle:
            text_tokens = tokenizer(handle.read())["input_ids"]
    for name, model in models.items():
        real = text_tokens is not None and not name.startswith("tiny-")
        for dtype in (torch.float32, torch.bfloat16):
            result = argmax_agreement(model, dtype, gamma=args.gamma, sequences=args.sequences,
                                      length=args.length, name=name + (" (text)" if real else " (random tokens)"),
                                      tokens=text_tokens if real else None)
            print(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()
