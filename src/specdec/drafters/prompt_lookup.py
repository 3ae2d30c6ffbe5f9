"""`PromptLookup`: model-free drafting by n-gram matching against the prompt and the text generated so far.

Each round, the last n committed tokens (n from `max_ngram` down to `min_ngram`, longest first) are looked up
among the earlier occurrences of the same n-gram in the context; the most recent earlier occurrence wins,
and the tokens that followed it are proposed. The proposal is deterministic, so `draft_probs` is None
(a point mass) and verification stays exact at any temperature.

Cost: the drafter keeps, for each n, a dict from n-gram (a tuple of ids) to the position just after its
most recent occurrence that has a follower. The dicts are extended only with the n-grams that newly got a
follower (a handful per round: accepted drafts + one), so a round costs O(max_ngram + γ + new tokens)
dict operations, independent of the context length. Building the index for a new prompt is linear in the
prompt, once per request (`reset`).

Overlapping matches: if the match ends p tokens before the end of the context (p < γ, e.g. in a loop
"a b a b" or a run "x x x"), its continuation runs into the tokens being proposed; they are filled in as the
periodic continuation (draft[j] = draft[j - p]), which is what copying "the tokens that followed" means once
the proposed tokens are part of the text. Disable with `extend_periodic=False` to propose only tokens that
are already in the context.

Branches (`branches=k > 1`): the continuations of up to k different earlier matches (the `k` most recent
occurrences of each n-gram, longest n first) are proposed together as a token tree, identical prefixes
merged into one node (a trie, so siblings are distinct tokens). Every node is still a deterministic
function of the context, a point mass, so verification is exact at any temperature. With one distinct
continuation the proposal is the same chain as with branches=1.

Encoder-decoder targets: the request's source tokens (`reset(..., encoder_input_ids=)`, handed over by the
decoder) get an index of their own, built once per request. For each n, longest first, a match in the decoded
context wins (most recent); otherwise the source's most recent match is copied (summaries and translations
often copy spans of the source); with branches > 1 the source's k most recent matches follow the context's.
Source tokens must be ids of the decoder's vocabulary (T5, BART, Marian
share one vocabulary between encoder and decoder).
"""

from __future__ import annotations

import torch

from specdec.core.sampling import SamplingConfig
from specdec.drafters.base import Drafter, DrafterCapabilities, Proposal
from specdec.drafters.per_row import PerRow
from specdec.errors import ConfigError


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class PromptLookup(Drafter):
    """Propose the continuation of the most recent earlier match of the latest n-gram (longest n first).

    max_ngram / min_ngram: the n-gram sizes tried, longest first (1 <= min_ngram <= max_ngram).
    num_pred_tokens: at most this many tokens per round (None: the γ the decode loop asks for).
    extend_periodic: continue an overlapping match periodically instead of stopping at the context's end.
    branches: propose the continuations of up to this many earlier matches as a tree (default 1: a chain).
    """

    vocab_size = None  # no vocabulary of its own: any target works

    def __init__(
        self,
        max_ngram: int = 3,
        min_ngram: int = 1,
        num_pred_tokens: int | None = None,
        extend_periodic: bool = True,
        branches: int = 1,
    ):
        self.max_ngram = _check_int("max_ngram", max_ngram, 1)
        self.min_ngram = _check_int("min_ngram", min_ngram, 1)
        if self.min_ngram > self.max_ngram:
            raise ConfigError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        self.num_pred_tokens = None if num_pred_tokens is None else _check_int("num_pred_tokens", num_pred_tokens, 1)
        self.extend_periodic = bool(extend_periodic)
        self.branches = _check_int("branches", branches, 1)
        self._tokens: list[int] = []  # the committed context seen so far, as Python ints
        # _index[n - min_ngram]: n-gram tuple -> e, the end (exclusive) of its most recent occurrence
        # that has a follower (e <= len(_tokens) - 1), so _tokens[e] is the token that followed it.
        self._index: list[dict[tuple[int, ...], int]] = []
        # branches > 1: _recent[n - min_ngram]: n-gram -> the ends of its `branches` most recent occurrences.
        self._recent: list[dict[tuple[int, ...], list[int]]] = []
        self._source: list[int] = []  # an encoder-decoder request's source tokens (empty otherwise)
        self._source_index: list[dict[tuple[int, ...], int]] = []  # as _index, over _source
        self._source_recent: list[dict[tuple[int, ...], list[int]]] = []  # as _recent, over _source
        self.reset(torch.empty(0, dtype=torch.long))

    @property
    def capabilities(self) -> DrafterCapabilities:
        """A chain, or with branches > 1 a tree of at most branches·γ nodes; batched as one fork per row (its own
        index); an encoder-decoder target's source tokens are looked up too."""
        tree = self.branches > 1
        return DrafterCapabilities(tree=tree, batched=PerRow, nodes_per_level=self.branches if tree else None,
                                   accepts_encoder_inputs=True)

    # -- index maintenance -------------------------------------------------------------------------
    def reset(self, prompt_ids: torch.Tensor, *, encoder_input_ids: torch.Tensor | None = None,
              encoder_inputs=None) -> None:
        self._tokens = []
        self._index = [{} for _ in range(self.min_ngram, self.max_ngram + 1)]
        self._recent = [{} for _ in self._index] if self.branches > 1 else []
        self._extend(prompt_ids)
        self._source = [] if encoder_input_ids is None else encoder_input_ids.tolist()
        self._source_index = [{} for _ in range(self.min_ngram, self.max_ngram + 1)]
        self._source_recent = [{} for _ in self._source_index] if self.branches > 1 else []
        for n, index in zip(range(self.min_ngram, self.max_ngram + 1), self._source_index):
            for end in range(n, len(self._source)):
                index[tuple(self._source[end - n : end])] = end  # the most recent occurrence with a follower
        for n, recent in zip(range(self.min_ngram, self.max_ngram + 1), self._source_recent):
            for end in range(n, len(self._source)):
                ends = recent.setdefault(tuple(self._source[end - n : end]), [])
                ends.append(end)
                if len(ends) > self.branches:
                    del ends[0]

    def _extend(self, context: torch.Tensor) -> None:
        """Index the n-grams that got a follower since the last call. context [n] starts with _tokens."""
        old = len(self._tokens)
        if context.shape[0] < old:  # a different (shorter) context: not ours, start over
            self._tokens, old = [], 0
            self._index = [{} for _ in range(self.min_ngram, self.max_ngram + 1)]
            self._recent = [{} for _ in self._index] if self.branches > 1 else []
        if context.shape[0] == old:
            return
        tokens = self._tokens
        tokens.extend(context[old:].tolist())
        length = len(tokens)
        # n-grams ending (exclusive) at e in [old, length - 1] now have a follower tokens[e]. (The one ending
        # at `old` had none before: tokens[old] did not exist yet.)
        for n, index in zip(range(self.min_ngram, self.max_ngram + 1), self._index):
            for end in range(max(old, n), length):
                index[tuple(tokens[end - n : end])] = end  # ascending: the most recent occurrence wins
        for n, recent in zip(range(self.min_ngram, self.max_ngram + 1), self._recent):
            for end in range(max(old, n), length):
                ends = recent.setdefault(tuple(tokens[end - n : end]), [])
                ends.append(end)
                if len(ends) > self.branches:
                    del ends[0]

    def commit(self, context: torch.Tensor, num_accepted: int) -> None:
        self._extend(context)

    # -- lookup --------------------------------------------------------------------------------------
    def match(self, gamma: int) -> list[int]:
        """Up to `gamma` proposed tokens continuing the indexed context (empty if no n-gram matches)."""
        tokens = self._tokens
        length = len(tokens)
        if gamma <= 0:
            return []
        for n in range(min(self.max_ngram, length), self.min_ngram - 1, -1):
            end = self._index[n - self.min_ngram].get(tuple(tokens[length - n :]))
            if end is None and self._source:  # copy from an encoder-decoder request's source
                end = self._source_index[n - self.min_ngram].get(tuple(tokens[length - n :]))
                if end is not None:
                    return self._source[end : end + gamma]
            if end is None:
                continue
            return self._continuation(end, gamma)
        return []

    def _continuation(self, end: int, gamma: int) -> list[int]:
        """Up to `gamma` tokens following the match that ends (exclusive) at `end`."""
        tokens, length = self._tokens, len(self._tokens)
        if not self.extend_periodic:
            return tokens[end : min(end + gamma, length)]
        period = length - end  # >= 1: the match ends before the context does
        draft: list[int] = []
        for j in range(gamma):
            draft.append(tokens[end + j] if end + j < length else draft[j - period])
        return draft

    def match_branches(self, gamma: int) -> list[list[int]]:
        """Up to `branches` distinct continuations (most recent match of the longest n-gram first)."""
        tokens, length = self._tokens, len(self._tokens)
        found: list[list[int]] = []
        if gamma <= 0:
            return found
        for n in range(min(self.max_ngram, length), self.min_ngram - 1, -1):
            key = tuple(tokens[length - n :])
            drafts = [self._continuation(end, gamma) for end in reversed(self._recent[n - self.min_ngram].get(key, []))]
            if self._source_recent:  # then the source's matches (an encoder-decoder request)
                ends = reversed(self._source_recent[n - self.min_ngram].get(key, []))
                drafts += [self._source[end : end + gamma] for end in ends]
            for draft in drafts:
                if draft and draft not in found:
                    found.append(draft)
                    if len(found) == self.branches:
                        return found
        return found

    def propose(
        self,
        context: torch.Tensor,
        gamma: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        self._extend(context)  # no-op after commit; catches up if commit was skipped
        if self.num_pred_tokens is not None:
            gamma = min(gamma, self.num_pred_tokens)
        if self.branches > 1:
            return self._tree(self.match_branches(gamma), context.device)
        draft = self.match(gamma)
        # A point mass at any temperature: q(x) = 1 for the proposed token.
        return Proposal(tokens=torch.tensor(draft, dtype=torch.long, device=context.device))  # [γ']

    @staticmethod
    def _tree(drafts: list[list[int]], device) -> Proposal:
        """The drafts as a trie: shared prefixes are one node, siblings are distinct tokens (point masses)."""
        if len(drafts) <= 1:
            return Proposal(tokens=torch.tensor(drafts[0] if drafts else [], dtype=torch.long, device=device))
        tokens: list[int] = []
        parents: list[int] = []
        node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for draft in drafts:
            node = -1
            for token in draft:
                child = node_of.get((node, token))
                if child is None:
                    child = node_of[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = child
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long, device=device),  # [N]
                        parents=torch.tensor(parents, dtype=torch.long))  # [N]
