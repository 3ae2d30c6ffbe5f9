"""Train a small T5 target and a smaller T5 draft on a stdlib task: a function's signature + docstring (the
source, read by the encoder) -> its body (the decoder's output). Reuses the default tokenizer; same held-out
split by file as the default pair (specdec.training.corpus).

    nice -n 10 env OMP_NUM_THREADS=1 python scripts/train_seq2seq_pair.py --out runs/seq2seq --only target \
        --cpu-minutes 15 &
    nice -n 10 env OMP_NUM_THREADS=1 python scripts/train_seq2seq_pair.py --out runs/seq2seq --only draft \
        --cpu-minutes 6

Each process trains its model until its CPU budget (process CPU time, data preparation and evaluation
included) is spent; the held-out loss (nats per body token) and an untrained model's, for comparison, go to
<out>/report-<name>.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

from specdec.training.corpus import read_text, stdlib_files

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "src/specdec/assets/default/tokenizer"
MAX_SOURCE, MAX_TARGET = 96, 96


def examples(split: str, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(source ids, target ids) for every function with a docstring in the split's stdlib files."""
    out = []
    for path in stdlib_files(split):
        text = read_text(path)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
                continue
            doc = node.body[0]
            if len(node.body) < 2 or node.end_lineno is None:
                continue
            source = "".join(lines[node.lineno - 1 : doc.end_lineno])
            body = "".join(lines[doc.end_lineno : node.end_lineno])
            src = tokenizer.encode(source)[:MAX_SOURCE]
            tgt = tokenizer.encode(body)[: MAX_TARGET - 1] + [tokenizer.eos_token_id]
            if len(tgt) >= 4:
                out.append((src, tgt))
    return out


def make(d_model: int, layers: int, heads: int, d_ff: int, vocab: int, seed: int) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    config = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // heads, d_ff=d_ff, num_layers=layers,
                      num_decoder_layers=layers, num_heads=heads, dropout_rate=0.0, pad_token_id=0,
                      eos_token_id=0, decoder_start_token_id=0, tie_word_embeddings=True,
                      feed_forward_proj="gated-gelu")
    return T5ForConditionalGeneration(config)


def batch(items, pad: int = 0):
    src_len = max(len(s) for s, _ in items)
    tgt_len = max(len(t) for _, t in items)
    src = torch.full((len(items), src_len), pad)
    mask = torch.zeros((len(items), src_len), dtype=torch.long)
    labels = torch.full((len(items), tgt_len), -100)
    for i, (s, t) in enumerate(items):
        src[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        labels[i, : len(t)] = torch.tensor(t)
    return src, mask, labels


@torch.no_grad()
def heldout_loss(model, data, batch_size: int = 32) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch_size):
        src, mask, labels = batch(data[i : i + batch_size])
        logits = model(input_ids=src, attention_mask=mask, labels=labels).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
        total += float(loss)
        count += int((labels != -100).sum())
    model.train()
    return total / count


def train(model, data, cpu_seconds: float, batch_size: int, lr: float, log, wall_seconds: float | None = None) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    rng = random.Random(0)
    start, wall_start = time.process_time(), time.perf_counter()
    step = 0
    model.train()
    while time.process_time() - start < cpu_seconds and (
            wall_seconds is None or time.perf_counter() - wall_start < wall_seconds):
        items = rng.sample(data, batch_size)
        src, mask, labels = batch(items)
        loss = model(input_ids=src, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        # linear warm-up over 50 steps, then constant (the budget, not a step count, ends training)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50)
        opt.step()
        step += 1
        if step % 25 == 0:
            log(f"step {step} loss {float(loss.detach()):.3f} cpu {time.process_time() - start:.0f}s")
    return {"steps": step, "batch": batch_size, "cpu_s": time.process_time() - start,
            "wall_s": time.perf_counter() - wall_start}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu-minutes", type=float, default=15.0)
    parser.add_argument("--only", choices=("target", "draft"))
    parser.add_argument("--heldout-prompts", metavar="FILE",
                        help="write the held-out sources (signature + docstring) as bench JSONL prompts and exit")
    parser.add_argument("--wall-minutes", type=float, default=None,
                        help="also stop training after this much wall time (a shared, busy machine)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    if args.heldout_prompts:
        rows = [json.dumps({"prompt": tokenizer.decode(src)}) for src, _ in examples("heldout", tokenizer)]
        Path(args.heldout_prompts).write_text("\n".join(rows) + "\n")
        return 0
    if args.only is None:
        parser.error("--only target|draft is required to train")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / f"train-{args.only}.log", "a")

    def log(msg: str) -> None:
        print(msg, file=logf, flush=True)

    t0 = time.process_time()
    train_data, held = examples("train", tokenizer), examples("heldout", tokenizer)
    held = held[:400]
    log(f"{len(train_data)} train / {len(held)} held-out examples; data cpu {time.process_time() - t0:.0f}s")
    budget = args.cpu_minutes * 60 - (time.process_time() - t0) - 30  # time for the evaluations
    shapes = {"target": dict(d_model=160, layers=3, heads=4, d_ff=320), "draft": dict(d_model=64, layers=1, heads=2,
                                                                                    d_ff=128)}
    report = {"task": "stdlib function signature + docstring -> body", "train_examples": len(train_data),
              "heldout_examples": len(held), "max_source": MAX_SOURCE, "max_target": MAX_TARGET}
    untrained = make(**shapes["draft"], vocab=len(tokenizer), seed=1)
    report["untrained_heldout_loss"] = heldout_loss(untrained, held)
    report["uniform_loss"] = math.log(len(tokenizer))
    for name, seed in ((args.only, 0 if args.only == "target" else 1),):
        model = make(**shapes[name], vocab=len(tokenizer), seed=seed)
        wall = None if args.wall_minutes is None else args.wall_minutes * 60
        info = train(model, train_data, budget, 16, 3e-3 if name == "draft" else 2e-3, log, wall)
        info["params"] = sum(p.numel() for p in model.parameters())
        info["shape"] = shapes[name]
        info["heldout_loss"] = heldout_loss(model, held)
        log(f"{name}: {info}")
        report[name] = info
        model.generation_config.eos_token_id = 0
        model.half().save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    report["total_cpu_s"] = time.process_time() - t0
    (out / f"report-{args.only}.json").write_text(json.dumps(report, indent=2))
    log(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
