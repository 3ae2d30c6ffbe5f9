"""Adapting a draft LM to PARD drafting (`specdec distill --parallel`): γ − 1 mask tokens, γ tokens from one pass.

The draft gets one more embedding row, the mask token (`ParallelDraft.adapt`; id V, the target's vocabulary
size). Each step, as PARD trains (its "conditional drop-token" subsampling, by anchors): the windows [B, L] are
read as usual (every row t predicts token t+1), and `anchors` random root positions a per window each get a
block of K − 1 masks at positions a+1 .. a+K−1 appended to the sequence; mask j sees the real tokens up to a
and the masks before it in its own block (causal), never another block, and predicts token a+j+1 (what
`ParallelDraft` asks of it at inference). All rows go through the draft in ONE pass with a 4D mask
(`parallel_visibility`).

Loss: the distillation divergence (forward KL at `temperature`, or TVD) against the target's distribution at
each row's position (the target's logits at t for a real row t, at a+j for mask j), real rows averaged as in
plain distillation, plus the mask rows averaged with DFlash's position decay exp(−(j−1)/decay). The mask's own
logit column is never read (cut before the softmax), so it gets no probability.

Evaluation per offset j (0 = the root's row, the plain next-token prediction; j >= 1 = mask j): the greedy
agreement with the target's argmax and the T=1 acceptance Σ min(p, q), on held-out windows.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specdec.core.masks import additive_mask
from specdec.training.evaluate import acceptance_from_logits


def draw_roots(batch_size: int, seq_len: int, anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Root positions [B, N]: N = `anchors` distinct positions in 0..L−3 per window (mask 1 has a label), sorted."""
    span = seq_len - 2
    keys = torch.rand(batch_size, span, generator=generator)
    return keys.argsort(dim=1)[:, : min(anchors, span)].sort(dim=1).values


def parallel_visibility(roots: torch.Tensor, seq_len: int, masks: int) -> torch.Tensor:
    """Visibility [B, L + N·M, L + N·M]: the L real rows causal; mask j of block n sees the real rows up to its
    root and masks 1..j of its own block."""
    b, n = roots.shape
    rows = n * masks
    device = roots.device
    t = torch.arange(seq_len, device=device)
    j = torch.arange(masks, device=device)
    real = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril().expand(b, seq_len, seq_len)
    real = torch.cat([real, torch.zeros(b, seq_len, rows, dtype=torch.bool, device=device)], dim=2)
    sees_real = (t[None, None, :] <= roots[:, :, None])[:, :, None, :].expand(b, n, masks, seq_len)
    own = (j[None, :] <= j[:, None])  # [M, M] causal within the block
    same = torch.eye(n, dtype=torch.bool, device=device)  # [N, N]
    sees_masks = (same[:, None, :, None] & own[None, :, None, :]).expand(b, n, masks, n, masks)
    block = torch.cat([sees_real.reshape(b, rows, seq_len), sees_masks.reshape(b, rows, rows)], dim=2)
    return torch.cat([real, block], dim=1)


def parallel_pass(draft, batch: torch.Tensor, roots: torch.Tensor, masks: int, mask_token_id: int) -> torch.Tensor:
    """The draft's logits over the target's V tokens: [B, L + N·M, V] (the L real rows, then each block's masks)."""
    b, seq_len = batch.shape
    n = roots.shape[1]
    ids = torch.cat([batch, batch.new_full((b, n * masks), mask_token_id)], dim=1)
    mask_pos = (roots[:, :, None] + 1 + torch.arange(masks, device=batch.device)).reshape(b, n * masks)
    positions = torch.cat([torch.arange(seq_len, device=batch.device).expand(b, seq_len), mask_pos], dim=1)
    dtype = draft.get_input_embeddings().weight.dtype
    mask = additive_mask(parallel_visibility(roots, seq_len, masks), dtype)[:, None]  # [B, 1, Q, Q]
    logits = draft(input_ids=ids, position_ids=positions, attention_mask=mask).logits
    return logits[..., :mask_token_id]


def _mask_labels(roots: torch.Tensor, seq_len: int, masks: int):
    """(valid [B, N, M]: mask j's label position a+j <= L−2; label position [B, N, M], clamped)."""
    where = roots[:, :, None] + 1 + torch.arange(masks, device=roots.device)  # a + j, j = 1..M
    return where <= seq_len - 2, where.clamp(max=seq_len - 2)


def row_divergence(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float, loss: str
                   ) -> torch.Tensor:
    """Per-row divergence [...] (forward KL, or TVD) at `temperature`."""
    log_p = torch.log_softmax(target_logits.float() / temperature, dim=-1)
    log_q = torch.log_softmax(draft_logits.float() / temperature, dim=-1)
    if loss == "fkl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def parallel_loss(target, draft, batch: torch.Tensor, roots: torch.Tensor, masks: int, mask_token_id: int,
                  temperature: float, loss: str, decay: float) -> torch.Tensor:
    """Real rows' mean divergence + mask rows' position-decayed mean divergence, against the target."""
    with torch.no_grad():
        teacher = target(input_ids=batch).logits  # [B, L, V]
    logits = parallel_pass(draft, batch, roots, masks, mask_token_id)  # [B, L + N·M, V]
    seq_len = batch.shape[1]
    real = row_divergence(teacher, logits[:, :seq_len], temperature, loss).mean()
    valid, where = _mask_labels(roots, seq_len, masks)
    rows = valid.nonzero(as_tuple=True)  # (batch, block, j-1)
    flat = rows[1] * masks + rows[2]
    student = logits[:, seq_len:][rows[0], flat]  # [R, V]
    div = row_divergence(teacher[rows[0], where[rows]], student, temperature, loss)  # [R]
    weight = torch.exp(-rows[2].float() / decay)  # mask j = rows[2] + 1: exp(-(j - 1) / decay)
    return real + (div * weight).sum() / weight.sum()


@torch.no_grad()
def parallel_metrics(target, draft, batches: list[torch.Tensor], masks: int, mask_token_id: int, anchors: int,
                     seed: int = 0) -> dict[str, float]:
    """Held-out acceptance per offset j (0: the root's row; j: mask j): greedy agreement (`alpha_T0_j`), T=1
    Σ min(p, q) (`alpha_T1_j`), and `block_tau_T0`: 1 + mean leading greedy agreements over a full block."""
    was = draft.training
    draft.eval()
    generator = torch.Generator().manual_seed(seed)
    sums = np.zeros((2, masks + 1))
    counts = np.zeros(masks + 1)
    runs: list[float] = []
    for batch in batches:
        device = next(draft.parameters()).device
        batch = batch.to(device)
        b, seq_len = batch.shape
        roots = draw_roots(b, seq_len, anchors, generator).to(device)
        teacher = target(input_ids=batch).logits.float()  # [B, L, V]
        logits = parallel_pass(draft, batch, roots, masks, mask_token_id).float()
        valid, where = _mask_labels(roots, seq_len, masks)  # [B, N, M]
        root_rows = logits.gather(1, roots[:, :, None].expand(-1, -1, logits.shape[-1]))  # [B, N, V] the root's row
        mask_rows = logits[:, seq_len:].reshape(b, roots.shape[1], masks, -1)  # [B, N, M, V]
        student = torch.cat([root_rows[:, :, None], mask_rows], dim=2)  # [B, N, M+1, V]
        at = torch.cat([roots[:, :, None], where], dim=2)  # [B, N, M+1] label positions
        ok = torch.cat([torch.ones_like(valid[:, :, :1]), valid], dim=2)  # [B, N, M+1]
        teach = teacher[torch.arange(b, device=device)[:, None, None], at]  # [B, N, M+1, V]
        greedy = acceptance_from_logits(teach, student, 0.0) * ok
        sampled = acceptance_from_logits(teach, student, 1.0) * ok
        sums[0] += greedy.sum((0, 1)).cpu().numpy()
        sums[1] += sampled.sum((0, 1)).cpu().numpy()
        counts += ok.sum((0, 1)).float().cpu().numpy()
        full = ok.all(-1)  # [B, N]
        lead = greedy.long().cumprod(-1).sum(-1)  # leading agreements, the root's row first
        runs.extend(lead[full].float().tolist())
    draft.train(was)
    metrics = {"block_tau_T0": 1.0 + float(np.mean(runs)) if runs else 1.0}
    for j in range(masks + 1):
        if counts[j]:
            metrics[f"alpha_T0_{j}"] = float(sums[0, j] / counts[j])
            metrics[f"alpha_T1_{j}"] = float(sums[1, j] / counts[j])
    return metrics


def roots_at(step: int, seed: int, batch_size: int, seq_len: int, anchors: int) -> torch.Tensor:
    """Step `step`'s roots, a pure function of (seed, step)."""
    return draw_roots(batch_size, seq_len, anchors, torch.Generator().manual_seed(seed * 1_000_003 + step + 17))


def mask_decay(max_gamma: int) -> float:
    """The position decay of the mask rows' loss (DFlash's 7 for 16-row blocks, scaled to K)."""
    return max(1.0, math.ceil(7 * max_gamma / 16))
