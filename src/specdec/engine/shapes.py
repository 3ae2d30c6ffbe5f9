"""A lone request's shapes, fixed before its prefill: the cache room it needs and the widths its target passes
are padded to (on the fast path each width is one compiled shape), and the shapes compiled up front.

A fixed γ pads every chain pass to γ+1 rows; a tree drafter's widest pass is its node budget + 1 (every
budget + 1 when it picks one per round); an adaptive γ restricted to a γ set (gamma="auto" on the fast path)
pads to one of those; any other adaptive γ to `DEFAULT_BUCKETS`. An adapter with a growing cache and eager
passes ignores all of it (`ModelAdapter.prepare`, `precompile`).
"""

from __future__ import annotations

import torch

from specdec.core.sampling import SamplingConfig
from specdec.drafters.base import Drafter
from specdec.engine.policies import FixedGamma
from specdec.runtime.base import ModelAdapter
from specdec.runtime.compiled import DEFAULT_BUCKETS


def plan(target: ModelAdapter, drafter: Drafter | None, policy: object, prompt_len: int,
         max_new_tokens: int) -> tuple[int, ...]:
    """Size the caches for the request (or raise a PromptError before any work) and fix the pass widths;
    returns them (the buckets)."""
    fixed = isinstance(policy, FixedGamma)
    capabilities = drafter.capabilities if drafter is not None else None
    widest = policy.gamma + 1 if fixed else DEFAULT_BUCKETS[-1]
    tree_nodes = capabilities.max_nodes if capabilities is not None else None  # a tree's node budget: the width
    if capabilities is not None and capabilities.nodes_per_level is not None and tree_nodes is None:
        tree_nodes = capabilities.nodes_per_level * (policy.gamma if fixed else DEFAULT_BUCKETS[-1])  # k chains
    # A drafter that picks its node budget per round (DraftTree(max_nodes="auto")) names every budget it may use:
    # each one is a verification shape (budget + 1 rows), fixed before the request.
    budgets = drafter.plan(target) if drafter is not None else ()
    if budgets:
        tree_nodes = max(budgets)
    if tree_nodes is not None:
        widest = max(widest, tree_nodes + 1)
    allowed = getattr(policy, "gammas", None)  # an adaptive policy restricted to a γ set (optional attribute)
    if allowed and tree_nodes is None:
        widest = max(allowed) + 1
    need = prompt_len + max_new_tokens + widest
    if drafter is None:
        buckets = (1,)
    elif fixed:
        buckets = (widest,)
    elif allowed and tree_nodes is None:
        buckets = (1, *sorted(g + 1 for g in allowed))
    else:
        buckets = DEFAULT_BUCKETS
    if len(budgets) > 1:
        buckets = tuple(sorted({b + 1 for b in budgets} | {widest}))
    target.prepare(need, buckets)
    if drafter is not None:
        drafter.ensure_capacity(need)
    return buckets


def precompile(target: ModelAdapter, drafter: Drafter | None, policy: object, buckets: tuple[int, ...],
               sampling: SamplingConfig, fused: bool, context: torch.Tensor) -> None:
    """A policy restricted to a γ set on a compiled target (gamma="auto" on the fast path): compile every shape
    it may use now, after the prefill of context [n], so that no round compiles (and no compile time is
    measured as a round's cost). Only the first request of a process pays; later ones find them compiled."""
    allowed = getattr(policy, "gammas", None)
    if not allowed or drafter is None:
        return
    capabilities = drafter.capabilities
    if capabilities.needs_hidden or capabilities.tree:
        return  # their passes have other shapes (hidden states, tree masks): compiled on first use
    target.precompile(buckets, verify=sampling if fused else None)
    drafter.precompile(allowed, sampling, context)
