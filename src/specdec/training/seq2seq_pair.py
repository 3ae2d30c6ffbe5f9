"""Train a seq2seq pair to ship: a BART (or T5, --arch) target and a smaller draft on denoising stdlib code.

The task: a chunk of code (whole lines, <= 64 tokens) with ~15% of its tokens replaced by ``<mask>``, one per
token (``--mask-style aligned``, the default; ``span``: one ``<mask>`` per masked span), is the source (read by
the encoder); the original chunk is the target (the decoder's output). Data is unlimited
(every chunk of every training file, with fresh masks every step); most of the output is copied from the source,
and filling the masked spans is where a larger model beats a smaller one. Held-out split by file, as for the
default pair (specdec.training.corpus). Reuses the default tokenizer plus one added ``<mask>`` token.
With aligned masks output and source line up position by position, which BART's absolute positions copy
within a few hundred steps. Results: BENCHMARKS.md, "Encoder-decoder"; the shipped pair's card:
src/specdec/assets/seq2seq/CARD.md. Run as `specdec train --recipe seq2seq-pair`; the shipped pair (the two ran
side by side, one thread each):

    OMP_NUM_THREADS=1 specdec train --recipe seq2seq-pair --out runs/seq2seq --only target \
        --cpu-minutes 20 --wall-minutes 35 &
    OMP_NUM_THREADS=1 specdec train --recipe seq2seq-pair --out runs/seq2seq --only draft \
        --cpu-minutes 8 --wall-minutes 35 &
    specdec train --recipe seq2seq-pair --out runs/seq2seq --heldout-prompts prompts.jsonl --num-prompts 8

Each process trains its model until its CPU budget (process CPU time, data preparation and evaluation included)
is spent, evaluating the held-out loss (nats per target token) and saving a checkpoint (fp16) every
``--eval-every`` steps, so it can be stopped early; the report goes to <out>/report-<name>.json.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

from specdec.hub.default_pair import default_assets_dir
from specdec.training.corpus import read_text, stdlib_files

MASK = "<mask>"
CHUNK_CHARS, MAX_TOKENS = 240, 64
MASK_FRACTION, MEAN_SPAN = 0.15, 3.0
SHAPES = {
    "target": dict(d_model=192, enc_layers=3, dec_layers=3, heads=4, d_ff=512),
    "draft": dict(d_model=96, enc_layers=2, dec_layers=1, heads=2, d_ff=192),
}


def load_tokenizer():
    """The default pair's tokenizer with ``<mask>`` added (id 8192), without its chat template (no chat here)."""
    tokenizer = AutoTokenizer.from_pretrained(default_assets_dir() / "tokenizer")
    tokenizer.add_special_tokens({"mask_token": MASK})
    tokenizer.chat_template = None
    return tokenizer


def chunks(split: str, tokenizer, max_chunks: int | None = None) -> list[list[int]]:
    """Token ids of consecutive whole lines (<= CHUNK_CHARS characters, <= MAX_TOKENS tokens) of the split's files."""
    texts = []
    for path in stdlib_files(split):
        buf = ""
        for line in read_text(path).splitlines(keepends=True):
            if len(buf) + len(line) > CHUNK_CHARS and buf.strip():
                texts.append(buf)
                buf = ""
            buf += line
        if buf.strip() and len(buf) > CHUNK_CHARS // 3:
            texts.append(buf)
    if max_chunks is not None and len(texts) > max_chunks:
        texts = random.Random(0).sample(texts, max_chunks)
    out = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        if len(ids) >= 16:
            out.append(ids[:MAX_TOKENS])
    return out


def corrupt(ids: list[int], mask_id: int, rng: random.Random, aligned: bool = False) -> list[int]:
    """Replace spans (lengths ~ Poisson(MEAN_SPAN), >= 1) covering ~MASK_FRACTION of ``ids`` by one mask each
    (aligned: by one mask per token, so source and output positions line up)."""
    budget = max(1, round(MASK_FRACTION * len(ids)))
    masked = [False] * len(ids)
    starts = set()
    tries = 0
    while budget > 0 and tries < 20:
        tries += 1
        length = min(budget, max(1, _poisson(MEAN_SPAN, rng)))
        start = rng.randrange(0, len(ids) - length + 1)
        if any(masked[max(0, start - 1): start + length + 1]):
            continue
        for i in range(start, start + length):
            masked[i] = True
        starts.add(start)
        budget -= length
    if aligned:
        return [mask_id if masked[i] else t for i, t in enumerate(ids)]
    return [mask_id if i in starts else t for i, t in enumerate(ids) if not masked[i] or i in starts]


def _poisson(lam: float, rng: random.Random) -> int:
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def make(d_model: int, enc_layers: int, dec_layers: int, heads: int, d_ff: int, vocab: int,
         seed: int, arch: str = "t5"):
    """A fresh T5 (relative position bias) or BART (learned absolute positions) of the given shape."""
    torch.manual_seed(seed)
    if arch == "bart":
        config = BartConfig(vocab_size=vocab, d_model=d_model, encoder_layers=enc_layers, decoder_layers=dec_layers,
                            encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=d_ff,
                            decoder_ffn_dim=d_ff, max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
                            activation_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                            decoder_start_token_id=0, forced_bos_token_id=None, forced_eos_token_id=None,
                            tie_word_embeddings=True, init_std=d_model ** -0.5)
        model = BartForConditionalGeneration(config)
        # id 0 is pad, eos and decoder start at once: nn.Embedding's padding_idx would pin its row at zero with no
        # gradient, so the (tied) logit of eos could never be learned and the first decoder input carries nothing.
        # Padding is already kept out by the attention mask and the -100 labels.
        for embedding in {model.get_input_embeddings(), model.model.encoder.embed_tokens,
                          model.model.decoder.embed_tokens}:
            embedding.padding_idx = None
        return model
    config = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // heads, d_ff=d_ff, num_layers=enc_layers,
                      num_decoder_layers=dec_layers, num_heads=heads, dropout_rate=0.0, pad_token_id=0,
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


def pairs(data: list[list[int]], mask_id: int, eos: int, rng: random.Random,
          aligned: bool) -> list[tuple[list[int], list[int]]]:
    return [(corrupt(ids, mask_id, rng, aligned), ids + [eos]) for ids in data]


@torch.no_grad()
def heldout_loss(model, data, batch_size: int = 32) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch_size):
        src, mask, labels = batch(data[i : i + batch_size])
        logits = model(input_ids=src, attention_mask=mask, labels=labels).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
        total += float(loss)
        count += int((labels != -100).sum())
    model.train()
    return total / count


def save(model, tokenizer, path: Path) -> None:
    """fp16 copy of ``model`` in ``path``, the tokenizer (shared by target and draft) once in ``path/../tokenizer``:
    the layout of src/specdec/assets/seq2seq. Each written to a temporary directory, then renamed."""
    import copy
    import shutil

    def replace(directory: Path, write) -> None:
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)

    half = copy.deepcopy(model).half()
    half.generation_config.eos_token_id = 0
    half.generation_config.decoder_start_token_id = 0
    replace(path, half.save_pretrained)
    replace(path.parent / "tokenizer", tokenizer.save_pretrained)


@dataclass(frozen=True)
class PairConfig:
    """One model of the pair to train (`specdec train --recipe seq2seq-pair`): `only` "target" or "draft", until
    `cpu_minutes` of process CPU time (or `wall_minutes` of wall time) are spent; lr None: 1e-3 for the target,
    1.5e-3 for the draft."""

    out: Path
    only: str
    cpu_minutes: float = 15.0
    wall_minutes: float | None = None
    arch: str = "bart"
    mask_style: str = "aligned"
    batch: int = 8
    lr: float | None = None
    eval_every: int = 150


def write_heldout_prompts(path: Path, num_prompts: int = 16, mask_style: str = "aligned") -> None:
    """Held-out sources (masked chunks of MAX_TOKENS tokens) as bench JSONL prompts, written atomically."""
    tokenizer = load_tokenizer()
    held = chunks("heldout", tokenizer)
    rng = random.Random(1)
    picked = rng.sample([c for c in held if len(c) == MAX_TOKENS], num_prompts)
    rows = [json.dumps({"prompt": tokenizer.decode(corrupt(ids, tokenizer.mask_token_id, rng,
                                                            mask_style == "aligned"))}) for ids in picked]
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(rows) + "\n")
    tmp.rename(path)


def train_pair(cfg: PairConfig) -> dict:
    """Train one model of the pair; checkpoints (fp16) under cfg.out / cfg.only, the report in
    cfg.out / report-<name>.json (also returned)."""
    aligned = cfg.mask_style == "aligned"
    tokenizer = load_tokenizer()
    mask_id, eos = tokenizer.mask_token_id, tokenizer.eos_token_id
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / f"train-{cfg.only}.log", "a")

    def log(msg: str) -> None:
        print(msg, file=logf, flush=True)

    t0 = time.process_time()
    train_data = chunks("train", tokenizer, max_chunks=150_000)
    held = pairs(random.Random(2).sample(chunks("heldout", tokenizer), 128), mask_id, eos, random.Random(3), aligned)
    log(f"{len(train_data)} train chunks / {len(held)} held-out; data cpu {time.process_time() - t0:.0f}s")
    name = cfg.only
    model = make(**SHAPES[name], vocab=len(tokenizer), seed=0 if name == "target" else 1, arch=cfg.arch)
    params = sum(p.numel() for p in model.parameters())
    lr = cfg.lr or (1e-3 if name == "target" else 1.5e-3)
    report = {"task": "denoising stdlib code: chunk with ~15% of tokens in masked spans -> original chunk",
              "train_chunks": len(train_data), "heldout_examples": len(held), "max_tokens": MAX_TOKENS,
              "mask_fraction": MASK_FRACTION, "mean_span": MEAN_SPAN, "mask_style": cfg.mask_style,
              "arch": cfg.arch, "shape": SHAPES[name], "params": params,
              "batch": cfg.batch, "lr": lr, "uniform_loss": math.log(len(tokenizer)), "evals": []}
    budget = cfg.cpu_minutes * 60 - 20  # the final evaluation and save
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    rng = random.Random(0 if name == "target" else 1)
    start, wall_start = time.process_time(), time.perf_counter()
    wall = math.inf if cfg.wall_minutes is None else cfg.wall_minutes * 60 - 30

    def spent() -> float:  # the fraction of the budget used (CPU or wall, whichever is further along)
        return max((time.process_time() - t0) / budget, (time.perf_counter() - wall_start) / wall)

    step = 0
    model.train()
    while spent() < 1.0:
        items = pairs(rng.sample(train_data, cfg.batch), mask_id, eos, rng, aligned)
        src, mask, labels = batch(items)
        loss = model(input_ids=src, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        # warm-up over 50 steps, then linear decay to 10% as the CPU budget runs out
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * max(0.1, 1.0 - spent())
        opt.step()
        step += 1
        if step % 25 == 0:
            log(f"step {step} loss {float(loss.detach()):.3f} cpu {time.process_time() - t0:.0f}s")
        if step % cfg.eval_every == 0:
            h = heldout_loss(model, held)
            report["evals"].append({"step": step, "cpu_s": round(time.process_time() - t0), "heldout_loss": h})
            log(f"eval step {step} heldout {h:.3f}")
            save(model, tokenizer, out / name)
    report.update(steps=step, train_cpu_s=time.process_time() - start, wall_s=time.perf_counter() - wall_start,
                  heldout_loss=heldout_loss(model, held))
    save(model, tokenizer, out / name)
    report["total_cpu_s"] = time.process_time() - t0
    (out / f"report-{name}.json").write_text(json.dumps(report, indent=2))
    log(json.dumps(report))
    logf.close()
    return report
