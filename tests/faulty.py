"""DELIBERATELY BROKEN verification rules and drafters: negative controls for the exactness checks.

Never use these to decode. Each reproduces a plausible bug in speculative sampling; the test suite plugs
them in (via `SpeculativeDecoder(..., verify_fn=...)` or as the drafter) and requires the verifier to
reject them, which shows the statistical test has power against real mistakes. All keep the interface of
`specdec.engine.verification.verify_round` (draft_tokens [γ], draft_probs [γ, V] | None, target_logits [γ+1, V],
sampling, generator) -> Verdict.
"""

from __future__ import annotations

import torch

from specdec.core.sampling import SamplingConfig, sample
from specdec.core.tree import TreeMask, children
from specdec.core.verify import Verdict, acceptance_ratio, kseq_residual, residual_distribution, verify_sampled
from specdec.drafters.base import Proposal
from specdec.drafters.block import BlockDraft
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.mtp import Mtp
from specdec.drafters.parallel import ParallelDraft
from specdec.drafters.suffix import SuffixDecoding
from specdec.drafters.tree import DraftTree
from specdec.engine.verification import verify_round
from specdec.runtime.causal_lm import CachedCausalLM


def _accept(draft_tokens, draft_probs, target_probs, generator) -> int:
    """The correct accept step: number of leading drafts kept (u < p/q)."""
    gamma = draft_tokens.shape[0]
    if not gamma:
        return 0
    ratio = acceptance_ratio(draft_tokens, draft_probs, target_probs)
    u = torch.rand(gamma, dtype=torch.float64, device=ratio.device, generator=generator)
    return int((u < ratio).cumprod(dim=0).sum())


def _sampled_only(name: str):
    def check(sampling: SamplingConfig) -> None:
        if sampling.greedy:
            raise ValueError(f"faulty.{name} is a sampling bug; use temperature > 0")

    return check


def no_residual(draft_tokens, draft_probs, target_logits, sampling, generator) -> Verdict:
    """BUG: after a rejection, the token is drawn from the target's p instead of max(0, p − q)."""
    _sampled_only("no_residual")(sampling)
    p = sampling.warp(target_logits)
    k = _accept(draft_tokens, draft_probs, p, generator)
    outcome = "recovered" if k < draft_tokens.shape[0] else "bonus"
    return Verdict(k, int(sample(p[k][None], generator)), outcome)


def _draft_row(draft_tokens, draft_probs, p, k):
    """q at draft position k: the drafter's row, or a one-hot on the drafted token for a point mass."""
    if draft_probs is not None:
        return draft_probs[k]
    q = torch.zeros_like(p[k])
    q[draft_tokens[k]] = 1.0
    return q


def residual_abs(draft_tokens, draft_probs, target_logits, sampling, generator) -> Verdict:
    """BUG: the residual skips the clamp and takes |p − q| (normalised) instead of max(0, p − q)."""
    _sampled_only("residual_abs")(sampling)
    p = sampling.warp(target_logits)
    k = _accept(draft_tokens, draft_probs, p, generator)
    if k == draft_tokens.shape[0]:
        return Verdict(k, int(sample(p[k][None], generator)), "bonus")
    q = _draft_row(draft_tokens, draft_probs, p, k)
    residual = (p[k] - q).abs()
    return Verdict(k, int(sample(residual[None], generator)), "recovered")


def residual_unnormalised(draft_tokens, draft_probs, target_logits, sampling, generator) -> Verdict:
    """BUG: max(0, p − q) is used as a sub-probability without normalising it: with probability
    Σ max(0, p − q) the token comes from the normalised residual, otherwise (the missing mass) from p."""
    _sampled_only("residual_unnormalised")(sampling)
    p = sampling.warp(target_logits)
    k = _accept(draft_tokens, draft_probs, p, generator)
    if k == draft_tokens.shape[0]:
        return Verdict(k, int(sample(p[k][None], generator)), "bonus")
    q = _draft_row(draft_tokens, draft_probs, p, k)
    residual = (p[k] - q).clamp_min(0.0)
    mass = float(residual.sum())
    u = float(torch.rand(1, dtype=torch.float64, generator=generator))
    row = residual if u < mass else p[k]
    return Verdict(k, int(sample(row[None], generator)), "recovered")


def accepted_off_by_one(draft_tokens, draft_probs, target_logits, sampling, generator) -> Verdict:
    """BUG: after a rejection the accepted count is one too many: the rejected draft token is kept, then the
    recovered token follows it."""
    verdict = verify_round(draft_tokens, draft_probs, target_logits, sampling, generator)
    if verdict.num_accepted < draft_tokens.shape[0]:
        return Verdict(verdict.num_accepted + 1, verdict.next_token, verdict.outcome)
    return verdict


def bonus_wrong_position(draft_tokens, draft_probs, target_logits, sampling, generator) -> Verdict:
    """BUG: after full acceptance, the bonus token is drawn from the target's distribution at the last
    draft position (row γ − 1) instead of the position after it (row γ)."""
    _sampled_only("bonus_wrong_position")(sampling)
    p = sampling.warp(target_logits)
    gamma = draft_tokens.shape[0]
    if gamma:
        p = p.clone()
        p[gamma] = p[gamma - 1]
    return verify_sampled(draft_tokens, draft_probs, p, generator)


def target_unwarped(draft_tokens, draft_probs, target_logits, sampling, generator) -> Verdict:
    """BUG: the target's probabilities are not warped (softmax of the raw logits) while the draft's are."""
    _sampled_only("target_unwarped")(sampling)
    return verify_sampled(draft_tokens, draft_probs, torch.softmax(target_logits.double(), dim=-1), generator)


class UnwarpedDraft(DraftModel):
    """BUG (a drafter): samples its tokens from its *unwarped* distribution softmax(logits) but reports the
    warped one (temperature / top-k / top-p) as draft_probs, so verification uses the wrong q."""

    def propose(self, context, gamma, sampling, generator) -> Proposal:
        if sampling.greedy:
            return super().propose(context, gamma, sampling, generator)
        logits = self.lm.forward(context[self.lm.length :], last_only=True)  # [1, V]
        tokens, probs = [], []
        for i in range(gamma):
            token = sample(torch.softmax(logits.double(), dim=-1), generator)  # [1], unwarped
            tokens.append(token)
            probs.append(sampling.warp(logits))  # ... but the warped q is reported
            if i + 1 < gamma:
                logits = self.lm.forward(token, last_only=True)
        return Proposal(torch.cat(tokens).to(context.device), torch.cat(probs).to(context.device))

    @property
    def name(self) -> str:
        return "UnwarpedDraft(faulty)"


class UnmappedDraftVocab(DraftModel):
    """BUG (a drafter with a reduced vocabulary, `draft_vocab=`): draws its tokens right, but reports q over the
    reduced head's columns as if they were token ids (the column -> token map left out of draft_probs)."""

    def propose(self, context, gamma, sampling, generator) -> Proposal:
        proposal = super().propose(context, gamma, sampling, generator)
        if proposal.draft_probs is None:
            return proposal
        columns = proposal.draft_probs[:, self.draft_vocab]  # [γ, N]: q over the reduced head's columns
        wrong = torch.zeros_like(proposal.draft_probs)  # [γ, V]
        wrong[:, : columns.shape[1]] = columns
        return Proposal(proposal.tokens, wrong)

    @property
    def name(self) -> str:
        return "UnmappedDraftVocab(faulty)"


class LateMtpQ(Mtp):
    """BUG (the MTP drafter): draws each draft from the warped distribution of its own MTP step, but reports the
    previous step's q for it (the q list one step behind the tokens: d_1 keeps its own q, d_i gets q_{i-1})."""

    def propose(self, context, gamma, sampling, generator) -> Proposal:
        proposal = super().propose(context, gamma, sampling, generator)
        if proposal.draft_probs is None or len(proposal) < 2:
            return proposal
        q = proposal.draft_probs  # [γ, V]
        return Proposal(proposal.tokens, torch.cat([q[:1], q[:-1]]))

    @property
    def name(self) -> str:
        return "LateMtpQ(faulty)"


def _shifted_q(proposal: Proposal) -> Proposal:
    """The proposal with each token's q replaced by the NEXT position's marginal (the last keeps its own)."""
    if proposal.draft_probs is None or len(proposal) < 2:
        return proposal
    probs = torch.cat([proposal.draft_probs[1:], proposal.draft_probs[-1:]])  # [γ, V], row i = position i+1's
    return Proposal(proposal.tokens, probs)


class ShiftedMarginalBlockDraft(BlockDraft):
    """BUG (a one-pass block drafter): draws each position's token from that position's marginal but reports the
    next position's marginal as its q: the block's rows read off by one."""

    def propose(self, context, gamma, sampling, generator) -> Proposal:
        return _shifted_q(super().propose(context, gamma, sampling, generator))

    @property
    def name(self) -> str:
        return "ShiftedMarginalBlockDraft(faulty)"


class ShiftedMarginalParallelDraft(ParallelDraft):
    """BUG (PARD): draws each position's token from its own row (the root's, then each mask's) but reports the
    next row's distribution as its q."""

    def propose(self, context, gamma, sampling, generator) -> Proposal:
        return _shifted_q(super().propose(context, gamma, sampling, generator))

    @property
    def name(self) -> str:
        return "ShiftedMarginalParallelDraft(faulty)"


#: name -> broken verify_fn, for loops in tests.
FAULTY_VERIFIERS = {
    "no_residual": no_residual,
    "residual_abs": residual_abs,
    "residual_unnormalised": residual_unnormalised,
    "accepted_off_by_one": accepted_off_by_one,
    "bonus_wrong_position": bonus_wrong_position,
    "target_unwarped": target_unwarped,
}


# ------------------------------------------------------------------------------------------- token trees


def tree_duplicates_skipped(proposal, target_logits, sampling, generator) -> Verdict:
    """BUG (tree verifier): an i.i.d. child whose token equals an already rejected sibling's is skipped
    without trying it and without its residual update (only the same *node* may be skipped)."""
    _sampled_only("tree_duplicates_skipped")(sampling)
    tokens = proposal.tokens.tolist()
    kids = children(proposal.parents)
    p = sampling.warp(target_logits)
    node, path = -1, []
    while True:
        running = p[node + 1].double()
        if not kids[node + 1]:
            return Verdict(len(path), int(sample(running[None], generator)), "bonus", tuple(path))
        accepted, rejected = None, set()
        for child in kids[node + 1]:
            x = tokens[child]
            if x in rejected:
                continue  # the bug
            q = None if proposal.draft_probs is None else proposal.draft_probs[child].double()
            qx = 1.0 if q is None else float(q[x])
            if float(torch.rand((), dtype=torch.float64, generator=generator)) < float(running[x]) / qx:
                accepted = child
                break
            rejected.add(x)
            running = residual_distribution(running, q, x)
        if accepted is None:
            return Verdict(len(path), int(sample(running[None], generator)), "recovered", tuple(path))
        path.append(accepted)
        node = accepted


def tree_kseq_rho_one(proposal, target_logits, sampling, generator) -> Verdict:
    """BUG (SpecTr verifier): k-sequential selection with ρ fixed at 1: each i.i.d. sibling accepted with
    min(1, p/q) independently of the others (no residual update between them), fallback residual at ρ = 1.
    Over-accepts tokens that q over-proposes; ρ must be the smallest valid ρ >= 1."""
    _sampled_only("tree_kseq_rho_one")(sampling)
    tokens = proposal.tokens.tolist()
    kids = children(proposal.parents)
    p = sampling.warp(target_logits)
    node, path = -1, []
    while True:
        running = p[node + 1].double()
        siblings = kids[node + 1]
        if not siblings:
            return Verdict(len(path), int(sample(running[None], generator)), "bonus", tuple(path))
        q = proposal.draft_probs[siblings[0]].double()
        beta = float(torch.minimum(q, running).sum())
        accepted = None
        for child in siblings:
            x = tokens[child]
            if float(torch.rand((), dtype=torch.float64, generator=generator)) * float(q[x]) < float(running[x]):
                accepted = child
                break
        if accepted is None:
            residual = kseq_residual(running, q, 1.0, beta, len(siblings))  # the bug: ρ = 1
            return Verdict(len(path), int(sample(residual[None], generator)), "recovered", tuple(path))
        path.append(accepted)
        node = accepted


class SoftmaxQDraftTree(DraftTree):
    """BUG (a drafter): proposes the deterministic top-k tree but reports the draft's warped softmax at each
    node's parent as draft_probs, as if the children had been sampled from it (they are a point mass)."""

    def propose(self, context, gamma, sampling, generator) -> Proposal:
        proposal = super().propose(context, gamma, sampling, generator)
        if sampling.greedy or not len(proposal):
            return proposal
        root = context[-1:]
        start = self.lm.length
        root_q = sampling.warp(self.lm.forward(root, last_only=True))  # [1, V]
        self.lm.crop(start)
        tokens, parents = proposal.tokens.tolist(), proposal.parents.tolist()
        node_q = sampling.warp(self._node_logits(root, tokens, parents, list(range(len(tokens)))))  # [N, V]
        rows = [root_q[0] if p < 0 else node_q[p] for p in parents]
        return Proposal(proposal.tokens, torch.stack(rows), proposal.parents)

    @property
    def name(self) -> str:
        return "SoftmaxQDraftTree(faulty)"


class FrequencyQSuffix(SuffixDecoding):
    """BUG (a drafter): proposes SuffixDecoding's tree but reports its frequency estimates as draft_probs: every
    child's row is its siblings' count ratios, as if the children had been drawn from them (they are point masses)."""

    def propose(self, context, gamma, sampling, generator) -> Proposal:
        proposal = super().propose(context, gamma, sampling, generator)
        if sampling.greedy or not len(proposal):
            return proposal
        _, _, scores = self.draft(gamma)  # the same tree again (the index did not change), with its scores
        tokens = proposal.tokens.tolist()
        parents = proposal.parents.tolist() if proposal.parents is not None else list(range(-1, len(tokens) - 1))
        rows = torch.zeros(len(tokens), self.width)  # [N, V]
        for i, parent in enumerate(parents):
            siblings = [j for j, p in enumerate(parents) if p == parent]
            total = sum(scores[j] for j in siblings)
            for j in siblings:
                rows[i, tokens[j]] = scores[j] / total
        return Proposal(proposal.tokens, rows, torch.tensor(parents))

    def match_target_vocab(self, target_vocab_size: int) -> bool:
        self.width = target_vocab_size
        return True

    @property
    def name(self) -> str:
        return "FrequencyQSuffix(faulty)"


class SiblingVisibleLM(CachedCausalLM):
    """BUG (a target adapter): the tree mask also lets each node attend to its previous sibling."""

    def score(self, input_ids, *, tree=None, hidden=False):
        if tree is not None:
            ancestors = tree.ancestors.clone()
            parent_row = [int(ancestors[i, :i].nonzero().max()) if i else -1 for i in range(tree.size)]
            for i in range(1, tree.size):
                earlier = [j for j in range(1, i) if parent_row[j] == parent_row[i]]
                if earlier:
                    ancestors[i, earlier[-1]] = True  # the bug
            tree = TreeMask(tree.depths, ancestors)
        return super().score(input_ids, tree=tree, hidden=hidden)


# ------------------------------------------------------------------------------ cross-vocabulary drafts


def _cross_vocab_base():
    from specdec.drafters.cross_vocab import CrossVocabDraft  # noqa: PLC0415 (only these controls need it)

    return CrossVocabDraft


class UnnormalisedIntersection(_cross_vocab_base()):
    """BUG (TLI): the draft's probabilities are restricted to the shared tokens but not renormalised: it
    samples from the renormalised restriction (as TLI does) and reports the unnormalised one as q, so every
    ratio p/q is too large by 1 / (the draft's mass inside the intersection)."""

    def _propose_tli(self, logits, context, gamma, sampling, generator) -> Proposal:
        if sampling.greedy:
            return super()._propose_tli(logits, context, gamma, sampling, generator)
        tokens, probs = [], []
        for i in range(gamma):
            dist = sampling.warp(self._to_target(logits))  # [1, V_target]: the TLI distribution, sampled
            token = int(sample(dist, generator))
            inside = sampling.warp(logits)[0, self._shared_draft].sum()  # the draft's mass on shared tokens
            tokens.append(token)
            probs.append(dist[0] * inside)  # ... but reported without renormalising
            if i + 1 < gamma:
                logits = self._feed([int(self.mapping.target_to_draft[token])])
        return Proposal(torch.tensor(tokens, device=context.device), torch.stack(probs).to(context.device))

    @property
    def name(self) -> str:
        return "UnnormalisedIntersection(faulty)"


class OutsideIntersection(_cross_vocab_base()):
    """BUG (TLI): the draft samples from its whole vocabulary and proposes a draft-only token as the target
    token its text starts with, while reporting the intersection's renormalised q, which never counts the
    draft-only tokens' mass."""

    def _propose_tli(self, logits, context, gamma, sampling, generator) -> Proposal:
        if sampling.greedy:
            return super()._propose_tli(logits, context, gamma, sampling, generator)
        d2t = self.mapping.draft_to_target
        tokens, probs = [], []
        for i in range(gamma):
            draft_token = int(sample(sampling.warp(logits), generator))
            target_token = int(d2t[draft_token])
            if target_token < 0:  # outside the intersection: pass it off as its first target token
                text = self.mapping.draft_bytes[draft_token].decode("utf-8", errors="replace")
                target_token = self.target_tokenizer(text, add_special_tokens=False)["input_ids"][0]
            tokens.append(target_token)
            probs.append(sampling.warp(self._to_target(logits))[0])  # the TLI q, blind to draft-only mass
            if i + 1 < gamma:
                logits = self._feed([draft_token])
        return Proposal(torch.tensor(tokens, device=context.device), torch.stack(probs).to(context.device))

    @property
    def name(self) -> str:
        return "OutsideIntersection(faulty)"
