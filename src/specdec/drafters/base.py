"""The drafter interface: everything that proposes tokens for the target to verify.

A round of the decode loop is ``drafter.propose`` → ``target.score`` → ``verify`` → ``commit``. A drafter
sees the committed context (prompt + generated tokens, a 1-D LongTensor view, never copied), proposes up to
γ tokens, and is told afterwards how many were accepted so it can roll its own state back or learn.

What the loop needs to know about a drafter (trees or chains, the target's features, its batched form, its
default γ, the widest pass it needs...) the drafter declares once, in `Drafter.capabilities`; the loop never
probes a drafter's attributes. Over a batch's rows a drafter runs as a `RowDrafters` (its own batched form, or
one fork per row), and a lone request's drafter as the one row of such a form.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specdec.core.sampling import SamplingConfig
from specdec.errors import ProposalError

if TYPE_CHECKING:
    from specdec.core.stats import DecodeStats


@dataclass(frozen=True)
class Proposal:
    """Draft tokens [γ'] (γ' <= γ, may be 0) and, for sampling drafters, their warped probabilities [γ', V].

    `draft_probs=None` means the proposal is deterministic (a point mass on each token), as for n-gram
    lookup or an argmax drafter; verification then uses q(x) = 1.

    A tree: `parents[i]` is the index of node i's parent among the N tokens (−1 = the root, the last
    committed token), nodes topologically ordered (parents[i] < i); `parents=None` is a chain
    ([−1, 0, 1, ...]). draft_probs[i] is exactly the distribution node i was drawn from (for siblings drawn
    without replacement: q with the earlier siblings removed); a one-hot row or None is a point mass.

    `selection` is how the verifier picks among a node's sibling children at T > 0 (at T = 0 it is ignored):
    "sequential" (default: try them in order, r ← norm(max(0, r − q)) after each rejection; covers i.i.d.,
    without-replacement and point-mass children through each node's q) or "spectr" (SpecTr's k-sequential
    selection: the siblings are i.i.d. draws from one q, the rows of draft_probs; see verify.verify_kseq).
    """

    tokens: torch.Tensor  # [N] long
    draft_probs: torch.Tensor | None = None  # [N, V] float, rows sum to 1
    parents: torch.Tensor | None = None  # [N] long, −1 = root; None = chain
    selection: str = "sequential"

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ProposalError(f"Proposal.selection must be one of {', '.join(map(repr, SELECTIONS))}, got "
                                f"{self.selection!r}")
        if self.selection == "spectr" and self.draft_probs is None and len(self):
            raise ProposalError("Proposal.selection='spectr' needs draft_probs (the q its i.i.d. siblings were drawn "
                                "from); a deterministic proposal uses the default selection='sequential'")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


#: Sibling selection rules the tree verifier knows (Proposal.selection).
SELECTIONS = ("sequential", "spectr")


@dataclass(frozen=True)
class DrafterCapabilities:
    """What the decode loop needs to know about a drafter, declared by the drafter (`Drafter.capabilities`).

    tree: it proposes token trees (`Proposal.parents`), not only chains.
    needs_hidden: the target's features it reads (EAGLE, Medusa): False, True (the final hidden states) or the
        indices of the layers whose outputs it reads side by side (EAGLE-3). The loop then passes them to
        `reset(..., hidden=)` and `commit(..., hidden=)`.
    batched: its form over the rows of a batch, `batched(drafter, setting=BatchSetting) -> RowDrafters`; None:
        it decodes one request at a time only (batched decoding refuses it).
    default_gamma: the γ a request uses when it names none (a tree's depth); None: the chain default.
    max_nodes: the most nodes a proposal has (the widest verification pass is max_nodes + 1 rows); None: a
        chain of γ, or see nodes_per_level.
    nodes_per_level: a tree of at most this many nodes per level, so nodes_per_level · γ in all (MultiDraft,
        PromptLookup with branches).
    draft_room: cache slots its own model needs past the committed context within a round.
    encoder_decoder: its own model is an encoder-decoder (True) or a decoder-only model (False); None: it has
        no model of its own (lookup tables, heads on the target's features).
    accepts_encoder_inputs: it may draft for an encoder-decoder target; the loop then passes the request's
        `encoder_inputs` and source `encoder_input_ids` to `reset`.
    """

    tree: bool = False
    needs_hidden: bool | tuple[int, ...] = False
    batched: Callable[..., RowDrafters] | None = None
    default_gamma: int | None = None
    max_nodes: int | None = None
    nodes_per_level: int | None = None
    draft_room: int = 0
    encoder_decoder: bool | None = None
    accepts_encoder_inputs: bool = False


class Drafter(ABC):
    """Proposes tokens; owns whatever state (a KV cache, an n-gram index) it needs between rounds.

    The loop calls, per request: `use_fast_path(compile)`, `plan(target)` and `ensure_capacity(tokens)` before
    the prefill, `reset` after it, `precompile` before the first round (a γ policy restricted to a γ set), then
    each round `propose` and `commit`. Keyword arguments it passes only to drafters whose capabilities ask for
    them: `hidden=` (needs_hidden) and `encoder_inputs=` / `encoder_input_ids=` (accepts_encoder_inputs).
    """

    #: Width of `draft_probs` rows (must equal the target's); None for drafters without a vocabulary.
    vocab_size: int | None = None

    @property
    def capabilities(self) -> DrafterCapabilities:
        """What the loop needs to know about this drafter. Default: a chain drafter, one request at a time."""
        return DrafterCapabilities()

    def reset(self, prompt_ids: torch.Tensor, *, hidden: torch.Tensor | None = None,
              encoder_inputs: Mapping[str, object] | None = None,
              encoder_input_ids: torch.Tensor | None = None) -> None:
        """Start a new request whose prompt is prompt_ids [n]. hidden [n-1, F]: the target's features of
        prompt_ids[:-1] (None for a one-token prompt). encoder_inputs / encoder_input_ids [S]: an
        encoder-decoder request's encoder input and source token ids (None for audio). Default: nothing."""

    @abstractmethod
    def propose(
        self,
        context: torch.Tensor,
        gamma: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Propose at most `gamma` tokens continuing context [n].

        At temperature 0 propose the most likely tokens (a point mass); at T > 0 either sample from
        `sampling.warp(...)` of your distribution and return it as `draft_probs`, or propose
        deterministically with `draft_probs=None`. Both keep decoding exact.
        """

    def commit(self, context: torch.Tensor, num_accepted: int, *, hidden: torch.Tensor | None = None) -> None:
        """The round is over: context [n'] is the new committed context, whose last token is the
        recovered or bonus token and whose `num_accepted` tokens before it are accepted drafts.
        Anything cached beyond context[:n'-1] is stale. hidden [k+1, F]: the target's features of the root
        and the accepted drafts, i.e. of context[n'-k-2 : n'-1] (features of rejected drafts are never
        passed). Default: nothing to update."""

    def fork(self) -> Drafter:
        """A drafter for another request decoded at the same time (batched decoding keeps one per row): the
        same weights and settings, its own per-request state; `reset` it before use. Default: a shallow copy,
        which is a proper fork for drafters whose `reset` rebinds all their per-request state (PromptLookup,
        Bigram); drafters holding a cache or features across `reset` override it."""
        return copy.copy(self)

    def match_target_vocab(self, target_vocab_size: int) -> bool:
        """Prepare to draft for a target whose logits are `target_vocab_size` wide; False if this drafter's
        tokens cannot be the target's. Default: the widths must be equal (or the drafter has none)."""
        return self.vocab_size is None or self.vocab_size == target_vocab_size

    def pair_tokenizer(self, target_tokenizer: object) -> None:
        """The target's tokenizer, from the text API (`generate_text`, `stream_text`): a drafter with a tokenizer
        of its own and no target's tokenizer yet pairs with it. Default: ignored."""

    def use_fast_path(self, mode: bool | str) -> None:
        """The decoder's `compile` setting (True, "static" or False), before each request. Default: ignored."""

    def plan(self, target: object) -> tuple[int, ...]:
        """Before each request, with the target's adapter: the node budgets it may propose this request when it
        picks one per round (each budget + 1 is a verification shape), else (). Default: ()."""
        return ()

    def ensure_capacity(self, tokens: int) -> None:
        """Size its caches for a request whose target needs `tokens` cache slots (prompt, new tokens and one
        round's widest pass). Default: nothing to size."""

    def precompile(self, gammas: Sequence[int], sampling: SamplingConfig, context: torch.Tensor) -> None:
        """Compile now the draft passes of every γ in `gammas`, after the prefill of context [n] (a γ policy
        restricted to a γ set on the fast path), so that no round compiles. Default: nothing to compile."""

    @property
    def forwards(self) -> int:
        """Model forward passes spent drafting in the current request (0 for model-free drafters)."""
        return 0

    @property
    def name(self) -> str:
        return type(self).__name__


class DraftRow(Protocol):
    """One row of a batch as a `RowDrafters` sees it: a request's committed context and its random state."""

    key: object
    context: torch.Tensor  # [n0 + max_new_tokens + 1]; context[:n] is committed
    n: int
    sampling: SamplingConfig
    generator: torch.Generator
    stats: DecodeStats
    drafter: Drafter | None  # the row's own drafter (its fork), for forms that keep one per row
    encoder_inputs: Mapping[str, object] | None  # an encoder-decoder request's encoder input
    source_ids: torch.Tensor | None  # [S] its source token ids (text encoders)


@dataclass(frozen=True)
class BatchSetting:
    """How a batch runs its passes (`BatchDecoder`'s compile and max_len), handed to a drafter's batched form: a
    form with a model of its own (`BatchedDraftModel`) runs it as the target runs (`batch_static.batched_adapter`);
    forms that draft per row keep each row's drafter as it drafts alone. target: the batch's target adapter, whose
    cache a form may draft in (`SelfDraft`'s; None: not known)."""

    compile: bool | str = False
    max_len: int | None = None
    target: object | None = None


class RowDrafters(Protocol):
    """A drafter over the rows of a batch: the drafter side of the round. `rows` are the batch's rows in order
    (`DraftRow`); a lone request is a batch of one row."""

    def add_rows(self, rows: Sequence[DraftRow], features: Sequence[torch.Tensor | None] | None) -> None:
        """New rows, prefilled: start each one's request (features[i] [n_i-1, F]: the target's features of its
        prompt but the last token, when the drafter reads them)."""

    def remove_rows(self, keep: Sequence[int]) -> None:
        """Keep only the rows at indices `keep`, in that order (the others finished or left)."""

    def precompile(self, rows: Sequence[int]) -> None:
        """On the batched fast path: compile now the passes of a model of the form's own for batches of `rows`
        rows, so that no request waits for one (a no-op for forms that hold none, and when eager)."""

    def propose(self, rows: Sequence[DraftRow], gammas: Sequence[int]) -> list[Proposal]:
        """Each row's proposal: at most gammas[i] tokens (a tree at most gammas[i] deep); an empty one where
        gammas[i] is 0."""

    def commit(self, rows: Sequence[DraftRow], accepted: Sequence[int | None],
               features: Sequence[torch.Tensor | None] | None) -> None:
        """After verification: rows[i] committed accepted[i] drafts and one more token (features[i] [k+1, F]: the
        target's features of its root and accepted drafts, when the drafter reads them); accepted[i] None: the
        row failed this round and leaves. Sets each row's `stats.draft_forwards`."""
