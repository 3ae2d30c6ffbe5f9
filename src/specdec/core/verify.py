"""The accept / reject arithmetic of speculative sampling, on plain tensors.

Given γ draft tokens, the drafter's warped probabilities `draft_probs` (q) and the target's warped
probabilities `target_probs` (p) at the γ+1 positions the target scored:

- draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)) (strict u < ratio, u ~ U[0,1)
  in float64);
- at the first rejection i, the recovered token is drawn from max(0, p_i - q_i), normalised;
- if all γ are accepted, a bonus token is drawn from p_γ.

A drafter that proposes deterministically (argmax, n-gram lookup) passes ``draft_probs=None``: its q is a
point mass, so the ratio is p_i(x_i) and the residual is p_i with x_i removed.
Greedy decoding (temperature 0) accepts exactly the prefix that matches the target's argmax.

A tree (`verify_tree`) is walked from the root with one running target distribution r per visited node:
its children are tried in order, child x accepted with probability min(1, r(x)/q(x)) where q is exactly
the distribution that child was drawn from; after a rejection r ← norm(max(0, r − q)) and the next sibling
is tried. All rejected: the recovered token is drawn from r. A leaf reached: the bonus token is drawn from
the target there. Greedy: the longest path that follows the target's argmax.

SpecTr's k-sequential selection (`Proposal.selection == "spectr"`, Sun et al. 2023) replaces that sibling
rule at a node whose k >= 2 children are i.i.d. draws from one q: with β(ρ) = Σ_x min(q(x), p(x)/ρ) and
the smallest ρ in [1, k] with ρ·β(ρ) >= 1 − (1 − β(ρ))^k, child x_i is accepted with probability
min(1, p(x_i) / (ρ·q(x_i))), the first acceptance wins, no residual update between siblings; all rejected:
the token is drawn from p_res = [p − min(q, p/ρ)·(1 − (1 − β)^k)/β] / (1 − β)^k. The emitted token has
law p exactly; a node with one child is ordinary speculative sampling (ρ = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.sampling import SamplingConfig, inverse_cdf, sample
from specdec.core.tree import children


@dataclass(frozen=True)
class Verdict:
    """What one target pass decided: `num_accepted` draft tokens kept, then `next_token`."""

    num_accepted: int
    next_token: int
    # "recovered" when next_token corrects a rejected draft token, "bonus" when every draft was accepted.
    outcome: str
    # Node indices of the accepted drafts (len num_accepted) for a tree; None for a chain (0..k-1).
    path: tuple[int, ...] | None = None


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """draft_tokens [γ], target_logits [γ+1, V] -> accept the prefix that equals the target's argmax."""
    return greedy_verdict(draft_tokens.tolist(), target_logits.argmax(dim=-1).tolist())


def greedy_verdict(drafts: list[int], best: list[int]) -> Verdict:
    """The greedy rule on the target's argmax at each scored position, best [>= γ+1] (a batch takes one argmax
    over every row's pass): accept the drafts [γ] that equal it, then the argmax after them (recovered at the
    first mismatch, bonus when every draft was accepted)."""
    k = 0
    while k < len(drafts) and drafts[k] == best[k]:
        k += 1
    return Verdict(k, best[k], "bonus" if k == len(drafts) else "recovered")


def greedy_rule(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                best: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_verdict` on tensors, with no data-dependent branch (it runs inside the fast path's compiled
    verification pass): draft_tokens [γ], target_logits [γ+1, V] -> (k, next_token), both 0-dim: the drafts
    that equal the target's argmax, then the argmax after them. best [γ+1]: that argmax, where the caller has
    it already."""
    best = target_logits.argmax(dim=-1) if best is None else best  # [γ+1]
    gamma = draft_tokens.shape[0]
    k = (draft_tokens == best[:gamma]).cumprod(dim=0).sum()  # [] accepted prefix
    return k, best.index_select(0, k.view(1))[0]


def acceptance_ratio(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor
) -> torch.Tensor:
    """p_i(x_i) / q_i(x_i) for each draft position, in float64: [γ]."""
    positions = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    p = target_probs[positions, draft_tokens].double()  # [γ]
    if draft_probs is None:  # point mass: q(x) = 1
        return p
    q = draft_probs[positions, draft_tokens].double()  # [γ]
    return p / q.clamp_min(torch.finfo(torch.float64).tiny)


def residual_distribution(
    target_row: torch.Tensor, draft_row: torch.Tensor | None, draft_token: int | torch.Tensor
) -> torch.Tensor:
    """max(0, p - q) normalised: [..., V] for rows [..., V]. Falls back to p if the residual has no mass (p == q
    up to rounding). draft_row None: q is a point mass on draft_token (an int, or a tensor [...]), so the
    residual is p with that token removed. No data-dependent branch (it also runs in a compiled graph)."""
    if draft_row is None:
        token = torch.as_tensor(draft_token, device=target_row.device).reshape(*target_row.shape[:-1], 1)
        residual = target_row.scatter(-1, token, 0.0)
    else:
        residual = (target_row - draft_row).clamp_min(0.0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total, target_row)


def draw_uniforms(gamma: int, generator: torch.Generator | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """The uniforms one chain verification consumes, float64 [γ+1]: γ accept tests, then the next token's
    draw. Drawn in one call: the generator's stream is the same as drawing them one at a time."""
    return torch.rand(gamma + 1, dtype=torch.float64, device=device, generator=generator)


def rejection_rule(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule on tensors, with no data-dependent branch, so the same code runs eagerly (`verify_sampled`)
    and inside the fast path's compiled verification pass (runtime/static_lm.py `_verify_pass`).

    draft_tokens [γ], draft_probs [γ, V] or None (point mass), target_probs [γ+1, V], uniforms [γ+1] float64
    (`draw_uniforms`) -> (k, next_token), both 0-dim: k drafts accepted (u_i < p_i(x_i) / q_i(x_i) for every
    i < k, not at k), then next_token drawn from the residual at k (recovered) or, k == γ, from p_γ (bonus).
    """
    gamma = draft_tokens.shape[0]
    if not gamma:
        return uniforms.new_zeros((), dtype=torch.long), inverse_cdf(target_probs[:1], uniforms[gamma:])[0]
    ratio = acceptance_ratio(draft_tokens, draft_probs, target_probs)  # [γ]
    k = (uniforms[:gamma] < ratio).cumprod(dim=0).sum()  # [] accepted prefix
    # The row to draw from: the residual at the first rejection, or the target's own at γ (every draft kept).
    at = k.clamp_max(gamma - 1).view(1)  # [1] the rejected position (any, when k == γ)
    draft_row = None if draft_probs is None else draft_probs.index_select(0, at)  # [1, V] | None
    residual = residual_distribution(target_probs.index_select(0, at), draft_row, draft_tokens.index_select(0, at))
    row = torch.where(k < gamma, residual, target_probs[gamma:])  # [1, V]
    return k, inverse_cdf(row, uniforms[gamma:])[0]


def verify_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """draft_tokens [γ], draft_probs [γ, V] or None (point mass), target_probs [γ+1, V] -> Verdict."""
    gamma = draft_tokens.shape[0]
    uniforms = draw_uniforms(gamma, generator, target_probs.device)  # [γ+1]
    k, next_token = rejection_rule(draft_tokens, draft_probs, target_probs, uniforms)
    return chain_verdict(gamma, torch.stack([k, next_token]))


def chain_verdict(gamma: int, decided: torch.Tensor) -> Verdict:
    """The Verdict of `rejection_rule`'s (k, next_token) stacked as decided [2], for γ drafts."""
    k, next_token = decided.tolist()
    return Verdict(k, next_token, "bonus" if k == gamma else "recovered")


def kseq_rho(target_row: torch.Tensor, draft_row: torch.Tensor, k: int, iterations: int = 60) -> tuple[float, float]:
    """SpecTr's ρ for k i.i.d. drafts from q = draft_row [V] against p = target_row [V] (float64): the smallest
    ρ in [1, k] with ρ·β(ρ) >= 1 − (1 − β(ρ))^k, by bisection (the left side minus the right is
    nondecreasing in ρ, <= 0 at ρ = 1 and >= 0 at ρ = k). Returns (ρ, β(ρ))."""
    p, q = target_row.double(), draft_row.double()

    def beta(rho: float) -> float:
        return float(torch.minimum(q, p / rho).sum())

    def valid(rho: float) -> bool:
        b = beta(rho)
        return rho * b >= 1.0 - (1.0 - b) ** k

    lo, hi = 1.0, float(k)
    if k <= 1 or valid(lo):
        return lo, beta(lo)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if valid(mid) else (mid, hi)
    return hi, beta(hi)  # hi is always valid


def kseq_residual(target_row: torch.Tensor, draft_row: torch.Tensor, rho: float, beta: float, k: int) -> torch.Tensor:
    """SpecTr's fallback distribution after all k i.i.d. drafts were rejected: [V] (float64)."""
    p, q = target_row.double(), draft_row.double()
    miss = (1.0 - beta) ** k  # P(every draft rejected)
    if not miss > 0:  # every draft is surely accepted (p == q); never sampled from
        return p
    kept = torch.minimum(q, p / rho) * ((1.0 - miss) / beta) if beta > 0 else torch.zeros_like(p)  # [V]
    residual = (p - kept).clamp_min(0.0)  # >= 0 up to rounding when ρ is valid
    total = residual.sum()
    return residual / total if total > 0 else p


def verify_kseq(
    target_row: torch.Tensor, tokens: list[int], draft_row: torch.Tensor, generator: torch.Generator | None
) -> tuple[int | None, torch.Tensor | None]:
    """SpecTr k-sequential selection at one node: target_row [V] (p), the k sibling tokens (i.i.d. from
    draft_row [V], q) in draw order -> (index of the accepted sibling, None) or (None, the distribution
    [V] to draw the recovered token from)."""
    k = len(tokens)
    p, q = target_row.double(), draft_row.double()
    rho, beta = kseq_rho(p, q, k)
    for i, x in enumerate(tokens):
        u = float(torch.rand((), dtype=torch.float64, device=p.device, generator=generator))
        qx = float(q[x])
        if qx > 0 and u * rho * qx < float(p[x]):  # u < p(x) / (ρ q(x))
            return i, None
    return None, kseq_residual(p, q, rho, beta, k)


def verify_tree(
    proposal,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> Verdict:
    """proposal (tokens [N], draft_probs [N, V] | None, parents [N]), target_logits [N+1, V] (row 0 = root,
    row i+1 = node i) -> Verdict with the accepted `path` of node indices."""
    tokens = proposal.tokens.tolist()
    kids = children(proposal.parents)  # kids[u + 1]: children of node u, in order
    if sampling.greedy:
        argmax = target_logits.argmax(dim=-1).tolist()  # [N+1]
        node, path = -1, []
        while True:
            target_token = argmax[node + 1]
            match = next((c for c in kids[node + 1] if tokens[c] == target_token), None)
            if match is None:
                outcome = "recovered" if kids[node + 1] else "bonus"
                return Verdict(len(path), target_token, outcome, tuple(path))
            path.append(match)
            node = match
    target_probs = sampling.warp(target_logits)  # [N+1, V]
    draft_probs = proposal.draft_probs
    kseq = getattr(proposal, "selection", "sequential") == "spectr"  # Proposal.selection
    node, path = -1, []
    while True:
        running = target_probs[node + 1].double()  # r: [V]
        if not kids[node + 1]:
            return Verdict(len(path), int(sample(running[None], generator)), "bonus", tuple(path))
        if kseq and len(kids[node + 1]) > 1:  # SpecTr: the siblings are i.i.d. draws from one q
            siblings = kids[node + 1]
            index, residual = verify_kseq(running, [tokens[c] for c in siblings], draft_probs[siblings[0]], generator)
            if index is None:
                return Verdict(len(path), int(sample(residual[None], generator)), "recovered", tuple(path))
            path.append(siblings[index])
            node = siblings[index]
            continue
        accepted = None
        for child in kids[node + 1]:
            x = tokens[child]
            q = None if draft_probs is None else draft_probs[child].double()  # [V] | None (point mass)
            qx = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), dtype=torch.float64, device=running.device, generator=generator))
            if qx > 0 and u < float(running[x]) / qx:
                accepted = child
                break
            running = residual_distribution(running, q, x)  # norm(max(0, r − q))
        if accepted is None:
            return Verdict(len(path), int(sample(running[None], generator)), "recovered", tuple(path))
        path.append(accepted)
        node = accepted
