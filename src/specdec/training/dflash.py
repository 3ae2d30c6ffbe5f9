"""Training a DFlash block head (`specdec train-head --kind dflash`) on a frozen target's features.

Every step runs the frozen target over a batch of windows [B, L] with ``output_hidden_states`` and takes its
fused features (`DFlashHead.feature_layers`) and its logits. Then, as DFlash trains: `anchors` random positions
a per window each start one block [x_a, mask, ..., mask] at positions a .. a+s−1 (s: the block's size, drawn
from 2..block_size so that every γ below the head's block size is in distribution); the block sees the
context rows of positions < a (the features a drafter holds when x_a is the root) and, bidirectionally, its own
rows, never another block's. All blocks of a window go through the head in ONE pass (context rows, then every
block), with a 4D mask that gives each block exactly what drafting gives it (`block_visibility`).

Loss: row j >= 1 of a block predicts token a+j; soft cross-entropy against the target's distribution there
(its logits at a+j−1), weighted exp(−(j−1)/decay) (DFlash's position decay: a draft is accepted as a prefix,
so an early position counts more), averaged over the valid rows.

Data: the stdlib train split (or `--data`), and optionally the target's own greedy continuations of train-split
prompts (`self_distill_windows`, cached in OUT/cache): the head then learns the tokens the target will really
produce after the root, which is what a greedy request verifies. `share` of every batch comes from them.

The held-out report gives the teacher-forced acceptance proxy per block position j (the head's argmax equals the
target's) and `block_tau`: 1 + the mean number of leading agreements in a full block (a τ proxy for γ =
block_size − 1), over deterministic anchors of held-out text. With self-distillation the same metrics, prefixed
`own_`, are reported over blocks rooted in the target's greedy continuations of held-out prompts: the text a
greedy request drafts on, where the target's argmax is the next token itself.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from specdec.core.masks import additive_mask
from specdec.heads.dflash import DFlashHead


def draw_blocks(batch_size: int, seq_len: int, anchors: int, block_size: int, generator: torch.Generator,
                full: bool = False, low: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts [B, N], sizes [B, N]): N = `anchors` distinct anchor positions per window in low..L−2 (each block
    has context before it and a label after it), ascending, and each block's size in 2..min(block_size, L−a) (the
    full block_size where it fits when `full`)."""
    span = seq_len - 1 - low
    count = min(anchors, span)
    keys = torch.rand(batch_size, span, generator=generator)
    starts = keys.argsort(dim=1)[:, :count].sort(dim=1).values + low  # [B, N]
    room = (seq_len - starts).clamp(max=block_size)  # [B, N] rows that fit: labels a+1 .. a+size−1 <= L−1
    if full:
        return starts, room
    sizes = 2 + (torch.rand(starts.shape, generator=generator) * (room - 1)).long()  # [B, N] in 2..room
    return starts, sizes.clamp(max=room)


def block_visibility(starts: torch.Tensor, sizes: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Visibility [B, L + N·bs, L + N·bs] of one training pass: rows (and keys) are the L context rows, then
    the N blocks of `block_size` rows. A block row sees the context rows before its anchor and its own block's
    first `size` rows (bidirectional); a context row sees itself only (its output is never read)."""
    b, n = starts.shape
    rows = n * block_size
    device = starts.device
    t = torch.arange(seq_len, device=device)
    j = torch.arange(block_size, device=device)
    ctx = torch.eye(seq_len, dtype=torch.bool, device=device).expand(b, seq_len, seq_len)
    ctx = torch.cat([ctx, torch.zeros(b, seq_len, rows, dtype=torch.bool, device=device)], dim=2)  # [B, L, L + R]
    sees_ctx = (t[None, None, :] < starts[:, :, None])  # [B, N, L]
    sees_ctx = sees_ctx[:, :, None, :].expand(b, n, block_size, seq_len).reshape(b, rows, seq_len)
    own = (j[None, None, :] < sizes[:, :, None])  # [B, N, bs] the block's valid rows
    same = torch.eye(n, dtype=torch.bool, device=device)  # [N, N]
    sees_block = same[None, :, None, :, None] & own[:, None, None, :, :]  # [B, N, 1, N, bs]
    sees_block = sees_block.expand(b, n, block_size, n, block_size).reshape(b, rows, rows)
    sees_block = sees_block | torch.eye(rows, dtype=torch.bool, device=device)  # padding rows see themselves
    block = torch.cat([sees_ctx, sees_block], dim=2)  # [B, R, L + R]
    return torch.cat([ctx, block], dim=1)


def block_pass(head: DFlashHead, target, batch: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor,
               features: torch.Tensor) -> torch.Tensor:
    """The head's outputs [B, N, bs, H] for the blocks at `starts` of `sizes` in the windows batch [B, L], whose
    target features are `features` [B, L, F]: one pass over all context rows and blocks."""
    b, seq_len = batch.shape
    bs = head.block_size
    n = starts.shape[1]
    embed = target.get_input_embeddings()
    root = embed(batch.gather(1, starts)).reshape(b * n, -1)  # [B·N, H]
    block = head.block_embeds(root, bs - 1).reshape(b, n * bs, -1)  # [B, N·bs, H]
    block_pos = (starts[:, :, None] + torch.arange(bs, device=batch.device)).reshape(b, n * bs)
    positions = torch.cat([torch.arange(seq_len, device=batch.device).expand(b, seq_len), block_pos], dim=1)
    mask = additive_mask(block_visibility(starts, sizes, seq_len, bs), block.dtype)[:, None]  # [B, 1, Q, K]
    out = head(features, block, positions, mask)  # [B, N·bs, H]
    return out.reshape(b, n, bs, -1)


def _labels(starts: torch.Tensor, sizes: torch.Tensor, block_size: int, seq_len: int):
    """(valid [B, N, bs]: rows 1..size−1; label position [B, N, bs] of row j: a + j − 1, whose target logits
    give the distribution of token a + j; clamped into the window for the rows that are not valid)."""
    j = torch.arange(block_size, device=starts.device)
    valid = (j >= 1) & (j[None, None, :] < sizes[:, :, None])
    return valid, (starts[:, :, None] + j - 1).clamp(0, seq_len - 1)


def dflash_loss(head: DFlashHead, target, batch: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor,
                decay: float) -> torch.Tensor:
    """Position-decayed soft cross-entropy of every block row against the target's distribution there."""
    from specdec.training.heads import target_features

    features, logits = target_features(target, batch, head.feature_layers)  # [B, L, F], [B, L, V]
    out = block_pass(head, target, batch, starts, sizes, features)  # [B, N, bs, H]
    valid, where = _labels(starts, sizes, head.block_size, batch.shape[1])
    rows = valid.nonzero(as_tuple=True)  # (batch, block, j) of each supervised row
    draft = head.logits(out[rows], target.get_output_embeddings()).float()  # [M, V]
    teacher = logits[rows[0], where[rows]]  # [M, V]
    ce = -(torch.softmax(teacher, -1) * torch.log_softmax(draft, -1)).sum(-1)  # [M]
    weight = torch.exp(-(rows[2] - 1).float() / decay)  # [M]
    return (ce * weight).sum() / weight.sum()


@torch.no_grad()
def evaluate_dflash(head: DFlashHead, target, batches: list[torch.Tensor], anchors: int, seed: int = 0,
                    low: int = 1) -> dict[str, float]:
    """Held-out loss (decay 7), teacher-forced acceptance per block row j and `block_tau` (full blocks), over
    blocks whose root is at position `low` or later."""
    from specdec.training.heads import target_features

    was = head.training
    head.eval()
    lm_head = target.get_output_embeddings()
    bs = head.block_size
    hits = torch.zeros(bs)
    counts = torch.zeros(bs)
    runs: list[float] = []
    losses = []
    generator = torch.Generator().manual_seed(seed)
    for batch in batches:
        starts, sizes = draw_blocks(batch.shape[0], batch.shape[1], anchors, bs, generator, full=True, low=low)
        starts, sizes = starts.to(batch.device), sizes.to(batch.device)
        features, logits = target_features(target, batch, head.feature_layers)
        out = block_pass(head, target, batch, starts, sizes, features)  # [B, N, bs, H]
        valid, where = _labels(starts, sizes, bs, batch.shape[1])
        guess = head.logits(out, lm_head).argmax(-1)  # [B, N, bs]
        truth = logits.argmax(-1).gather(1, where.flatten(1)).view_as(where)  # [B, N, bs]
        agree = (guess == truth) & valid
        hits += agree.sum((0, 1)).float().cpu()
        counts += valid.sum((0, 1)).float().cpu()
        full = sizes == bs  # [B, N]
        lead = agree[..., 1:].long().cumprod(-1).sum(-1)  # [B, N] leading agreements
        runs.extend(lead[full].float().tolist())
        rows = valid.nonzero(as_tuple=True)
        draft = head.logits(out[rows], lm_head).float()
        teacher = logits[rows[0], where[rows]]
        ce = -(torch.softmax(teacher, -1) * torch.log_softmax(draft, -1)).sum(-1)
        weight = torch.exp(-(rows[2] - 1).float() / 7.0)
        losses.append(float((ce * weight).sum() / weight.sum()))
    head.train(was)
    metrics = {"heldout_loss": float(np.mean(losses)), "block_tau": 1.0 + float(np.mean(runs)) if runs else 1.0}
    for j in range(1, bs):
        if counts[j] > 0:
            metrics[f"accept_d{j}"] = float(hits[j] / counts[j])
    return metrics


@torch.no_grad()
def self_distill_windows(target, tokens: np.ndarray, count: int, seq_len: int, prompt_len: int, seed: int,
                         cache_dir: Path, batch_size: int = 128, log=print, split: str = "train") -> np.ndarray:
    """`count` windows [count, seq_len] int32: a prompt of `prompt_len` tokens of `tokens` (the `split` stream,
    from a random position) and the target's greedy continuation of it (no end of sequence), cached in
    `cache_dir` per (split, count, seq_len, prompt_len, seed)."""
    path = Path(cache_dir) / f"selfgen-{split}-{count}x{seq_len}-p{prompt_len}-s{seed}.npy"
    if path.is_file():
        return np.load(path)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - prompt_len, (count,), generator=generator).tolist()
    device = next(target.parameters()).device
    out = np.zeros((count, seq_len), dtype=np.int32)
    for i in range(0, count, batch_size):
        chunk = starts[i : i + batch_size]
        prompts = torch.from_numpy(np.stack([tokens[s : s + prompt_len].astype(np.int64) for s in chunk])).to(device)
        ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                              max_new_tokens=seq_len - prompt_len, eos_token_id=None, pad_token_id=0)
        out[i : i + len(chunk)] = ids[:, :seq_len].cpu().numpy()
        log(f"self-distillation data ({split}): {min(i + batch_size, count)}/{count} windows")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, out)
    tmp.replace(path)
    return out


def mixed_batch(train: np.ndarray, generated: np.ndarray | None, step: int, seed: int, batch_size: int,
                seq_len: int, share: float) -> torch.Tensor:
    """Step `step`'s windows [B, L], a pure function of (seed, step): round(share · B) of them from `generated`
    (the target's own continuations), the rest random windows of `train`."""
    from specdec.training.data import sample_batch

    own = 0 if generated is None else int(round(share * batch_size))
    parts = []
    if own < batch_size:
        parts.append(sample_batch(train, step, seed, batch_size - own, seq_len))
    if own:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 7)
        picks = torch.randint(0, generated.shape[0], (own,), generator=gen).tolist()
        parts.append(torch.from_numpy(generated[picks].astype(np.int64)))
    return torch.cat(parts)


def anchors_at(step: int, seed: int, batch_size: int, seq_len: int, anchors: int, block_size: int):
    """Step `step`'s blocks (`draw_blocks`), a pure function of (seed, step)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step + 13)
    return draw_blocks(batch_size, seq_len, anchors, block_size, generator)


def decay_default(block_size: int) -> float:
    """DFlash's position decay for a block size (7 for 16 rows)."""
    return max(1.0, math.ceil(7 * block_size / 16))
