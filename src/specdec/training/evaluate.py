"""Evaluation of trained models: held-out loss / perplexity and the draft-acceptance proxy."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F


@torch.no_grad()
def lm_loss(model: torch.nn.Module, token_batches: Iterable[torch.Tensor], device: str | torch.device = "cpu") -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` over ``token_batches``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in token_batches:
        batch = batch.to(device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        targets = batch[:, 1:]
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum").item()
        count += targets.numel()
    model.train(was_training)
    return total / max(count, 1)


def perplexity(loss: float) -> float:
    """exp(loss), capped to avoid overflow."""
    return math.exp(min(loss, 50.0))


def acceptance_from_logits(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-position acceptance of one draft token, shape = logits shape without the vocab axis.

    ``temperature > 0``: alpha = sum_x min(p(x), q(x)) with p, q the softmax of logits/T, the exact
    probability that speculative sampling accepts one draft token (Leviathan et al., 2023).
    ``temperature == 0``: 1.0 where the argmaxes agree, else 0.0 (greedy acceptance).
    """
    if temperature < 0:
        from specdec.errors import ConfigError

        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    target_logits, draft_logits = target_logits.float(), draft_logits.float()
    if temperature == 0:
        return (target_logits.argmax(-1) == draft_logits.argmax(-1)).float()
    p = torch.softmax(target_logits / temperature, dim=-1)
    q = torch.softmax(draft_logits / temperature, dim=-1)
    return torch.minimum(p, q).sum(-1)


@torch.no_grad()
def acceptance_proxy(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    token_batches: Iterable[torch.Tensor],
    temperature: float,
    device: str | torch.device = "cpu",
) -> float:
    """Teacher-forced mean per-position acceptance rate of ``draft`` against ``target``.

    Both models read the same real text; at every position their next-token distributions are
    compared with :func:`acceptance_from_logits`. Identical models give exactly 1.0.
    """
    total, count = 0.0, 0
    for batch in token_batches:
        batch = batch.to(device)
        alpha = acceptance_from_logits(target(input_ids=batch).logits, draft(input_ids=batch).logits, temperature)
        total += alpha.sum().item()
        count += alpha.numel()
    return total / max(count, 1)


def forward_kl(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of KL(p_target || q_draft) at ``temperature`` (nats)."""
    log_p = torch.log_softmax(target_logits.float() / temperature, dim=-1)
    log_q = torch.log_softmax(draft_logits.float() / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()
