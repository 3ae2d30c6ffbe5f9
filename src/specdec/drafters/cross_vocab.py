"""`CrossVocabDraft`: a draft model whose tokenizer is not the target's (Timor et al., ICML 2025).

`specdec.DraftModel(draft, tokenizer=draft_tokenizer, target_tokenizer=target_tokenizer, method=...)`
returns one of these when the two tokenizers differ. Two exact ways to draft:

- **TLI** (token-level intersection): the draft's logits are restricted to the tokens both vocabularies
  share (`specdec.hub.vocab.VocabMapping`), placed at the target's ids (-inf elsewhere) and warped there, so the
  proposal is an ordinary `draft_probs` row over the target's vocabulary: sampled from exactly the reported
  q, zero outside the intersection, and verified by the usual rejection rule.
- **SLEM** (string-level exact match): the draft writes γ tokens of text (its argmax); the text is
  re-tokenised by the target's tokenizer starting exactly at the end of the committed target tokens (which
  are never edited), and those target tokens are proposed as a point mass (`draft_probs=None`): accepted
  with probability p(x), at T = 0 exactly when they are the target's own argmax. Works for any intersection.

`method="auto"` drafts with SLEM when less than `AUTO_MIN_SHARED` of the draft's vocabulary is shared.
Otherwise it measures: the first `AUTO_PROBE_ROUNDS` rounds of a request draft with TLI, the next as many
with SLEM, and the rest with whichever accepted more tokens per round (TLI on a tie). Every round is exact
whichever method drafts it, so switching between rounds keeps decoding exact.

Both keep the draft's own token stream in step with the committed target text: every round the committed
target tokens are turned into bytes, and the text after the last special token is re-tokenised by the draft's
tokenizer over a short window at its end; the draft's KV cache keeps the longest prefix that still agrees and
feeds the rest (`_DraftStream`).
"""

from __future__ import annotations

import time

import torch

from specdec.core.sampling import SamplingConfig, sample
from specdec.drafters.base import DrafterCapabilities, Proposal
from specdec.drafters.draft_model import CROSS_VOCAB_METHODS, DraftModel
from specdec.errors import ConfigError
from specdec.hub.vocab import VocabMapping, check_tokenizer_fits, encode, vocab_mapping

#: "auto" considers TLI only when at least this share of the draft's vocabulary exists in the target's ...
AUTO_MIN_SHARED = 0.5
#: ... and then tries each method for this many rounds of a request before keeping the better one.
AUTO_PROBE_ROUNDS = 4
#: Draft tokens re-tokenised at the end of the committed text each round (the rest is kept as it was).
LOOKBEHIND = 8
#: Committed target tokens re-tokenised together with the draft's text to find where SLEM's proposal starts.
TARGET_LOOKBEHIND = 4


def _utf8_complete(data: bytes) -> int:
    """Length of the longest prefix of `data` that does not end inside a multi-byte UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return len(data) if back == 1 else len(data) - back + 1
        if byte >= 0xC0:  # a lead byte: complete if the sequence it starts fits
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) if back >= need else len(data) - back
    return len(data)


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class _DraftStream:
    """The committed context as the draft's token ids: `ids` (ids of specials and frozen text, then the
    draft's tokenisation of `text`, the bytes after the last special token).

    per_token=True (TLI) also takes every shared target token as its draft twin, re-tokenising only the
    runs of target tokens the draft lacks: the draft then reads the token boundaries it proposed in (TLI
    proposes shared tokens), so accepted drafts stay in its cache. per_token=False (SLEM) re-tokenises all
    text, so the draft reads its own tokenisation of the committed text, as when it wrote its proposal."""

    def __init__(self, mapping: VocabMapping, tokenizer, per_token: bool):
        self.mapping = mapping
        self.tokenizer = tokenizer
        self.per_token = per_token
        self.head: list[int] = []  # draft ids up to and including the last special token
        self.text = b""  # committed bytes after it
        self.text_ids: list[int] = []  # the draft's tokens for text[:complete]
        self.ends: list[int] = []  # byte offset in `text` where each of text_ids ends
        self.synced = 0  # committed target tokens already turned into bytes
        self.windowed = True  # False once a window's re-tokenisation did not reproduce its bytes

    @property
    def ids(self) -> list[int]:
        return self.head + self.text_ids

    def update(self, context: list[int]) -> None:
        """Take in the committed target tokens past `synced` (context is the whole committed context)."""
        target_bytes, t2d = self.mapping.target_bytes, self.mapping.target_to_draft
        for token in context[self.synced :]:
            piece = target_bytes[token] if token < len(target_bytes) else None
            twin = int(t2d[token]) if token < len(t2d) else -1
            if piece is None or (self.per_token and twin >= 0):
                # a special (or, per token, a shared) token: freeze the text so far, then its draft twin
                if self.text:
                    self._retokenize(full=True)
                    self.head += self.text_ids
                    self.text, self.text_ids, self.ends = b"", [], []
                if twin >= 0:
                    self.head.append(twin)
            else:
                self.text += piece
        self.synced = len(context)
        self._retokenize(full=not self.windowed)

    def _retokenize(self, full: bool) -> None:
        end = _utf8_complete(self.text)
        keep = 0 if full else max(0, len(self.text_ids) - LOOKBEHIND)
        while keep and (self.ends[keep - 1] >= end or 0x80 <= self.text[self.ends[keep - 1]] < 0xC0):
            keep -= 1  # start the window on a character boundary inside the complete text
        start = self.ends[keep - 1] if keep else 0
        window = self.text[start:end]
        ids = encode(self.tokenizer, _text(window)) if window else []
        draft_bytes = self.mapping.draft_bytes
        ends, offset = [], start
        for d in ids:
            offset += len(draft_bytes[d] or b"") if d < len(draft_bytes) else 0
            ends.append(offset)
        if offset != end:  # the tokenizer normalises or adds a prefix: window offsets cannot be trusted
            self.windowed = False
            if not full:
                self._retokenize(full=True)
                return
        self.text_ids = self.text_ids[:keep] + ids
        self.ends = self.ends[:keep] + ends


class CrossVocabDraft(DraftModel):
    """A draft model with its own tokenizer, drafting for a target with another (TLI or SLEM, exact)."""

    def __init__(self, model, compile: bool | str | None = None, *, tokenizer=None, target_tokenizer=None,
                 method: str = "auto"):
        super().__init__(model)  # the eager adapter: the stream re-sync crops and re-feeds at any length
        if tokenizer is None:
            raise ConfigError(
                "DraftModel(draft, target_tokenizer=...) also needs the draft's own tokenizer: pass "
                "tokenizer=draft_tokenizer"
            )
        if method not in CROSS_VOCAB_METHODS:
            raise ConfigError(f"method must be one of {CROSS_VOCAB_METHODS}, got {method!r}")
        check_tokenizer_fits(tokenizer, self.lm.vocab_size, "draft")
        self.tokenizer = tokenizer
        self.method = method
        self.vocab_size = None  # draft_probs rows are the target's width, known once bound to the target
        self.target_tokenizer = None
        self.mapping: VocabMapping | None = None
        self.active = "tli" if method == "auto" else method  # the method drafting now
        self.mapping_s = 0.0  # time spent translating between vocabularies in the current request
        self._probe: dict[str, list[int]] = {"tli": [], "slem": []}  # accepted per round, while probing
        if target_tokenizer is not None:
            self.set_target_tokenizer(target_tokenizer)

    @property
    def capabilities(self) -> DrafterCapabilities:
        """A chain drafter, one request at a time (its draft stream is re-tokenized per request)."""
        return DrafterCapabilities(encoder_decoder=self.is_encoder_decoder)

    def use_fast_path(self, mode: bool | str) -> None:
        """Stays on the eager adapter (the slot-cache fast path is not wired for cross-vocabulary drafting)."""

    @property
    def name(self) -> str:
        return f"CrossVocabDraft({self.method}{'→' + self.active if self.method == 'auto' else ''})"

    def set_target_tokenizer(self, target_tokenizer) -> None:
        """Pair with the target's tokenizer (the text API and the CLI call this with theirs)."""
        self.target_tokenizer = target_tokenizer
        self.mapping = vocab_mapping(self.tokenizer, target_tokenizer)
        if self.method == "auto":
            self.active = "tli" if self.mapping.draft_coverage >= AUTO_MIN_SHARED else "slem"

    def pair_tokenizer(self, target_tokenizer) -> None:
        """The text API's target tokenizer, unless one was given at construction."""
        if self.target_tokenizer is None:
            self.set_target_tokenizer(target_tokenizer)

    def match_target_vocab(self, target_vocab_size: int) -> bool:
        if self.mapping is None:
            raise ConfigError(
                "DraftModel(draft, tokenizer=...) drafts for a target with another tokenizer: pass the target's "
                "too, target_tokenizer=target_tokenizer (generate_text/stream_text and the CLI do this)"
            )
        check_tokenizer_fits(self.target_tokenizer, target_vocab_size, "target")
        self.vocab_size = target_vocab_size
        self._shared_draft = self.mapping.shared_draft.to(self.lm.device)  # [S]
        self._shared_target = self.mapping.shared_target.to(self.lm.device)  # [S]
        return True

    # ------------------------------------------------------------------------------------ draft stream

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.lm.reset()
        self.mapping_s = 0.0
        self._fed: list[int] = []  # the draft ids in the draft's KV cache, in order
        if self.method == "auto":
            self.active = "tli" if self.mapping.draft_coverage >= AUTO_MIN_SHARED else "slem"
            self._probe = {"tli": [], "slem": []} if self.active == "tli" else {}
        self._stream = _DraftStream(self.mapping, self.tokenizer, per_token=self.active == "tli")
        self._sync(prompt_ids)
        ids = self._stream.ids
        self._feed_prefill(ids[:-1])

    def _sync(self, context: torch.Tensor) -> None:
        """Bring the draft's token stream up to the committed context; crop its cache to what still agrees."""
        start = time.perf_counter()
        self._stream.update(context.tolist())
        ids, fed = self._stream.ids, self._fed
        agree = 0
        limit = min(len(ids) - 1, len(fed))  # the last id is always fed again to get the next logits
        while agree < limit and ids[agree] == fed[agree]:
            agree += 1
        if agree < len(fed):
            self.lm.crop(agree)
            del fed[agree:]
        self.mapping_s += time.perf_counter() - start

    def _feed_prefill(self, ids: list[int]) -> None:
        if ids:
            self.lm.prefill(torch.tensor(ids, dtype=torch.long, device=self.lm.device))
            self._fed.extend(ids)

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Append draft ids to the draft's cache; the logits after the last one: [1, V_draft]."""
        logits = self.lm.forward(torch.tensor(ids, dtype=torch.long, device=self.lm.device), last_only=True)
        self._fed.extend(ids)
        return logits

    def _catch_up(self) -> torch.Tensor | None:
        """Feed the committed draft ids the cache lacks; the draft's next-token logits [1, V_draft]."""
        ids = self._stream.ids
        if not ids:
            return None
        return self._feed(ids[len(self._fed) :])

    def commit(self, context: torch.Tensor, num_accepted: int) -> None:
        """The next `propose` re-syncs the draft's stream with the committed text (the draft's cache is
        indexed by draft tokens, not by target positions); "auto" counts the round."""
        if self.method == "auto":
            self._record_round(num_accepted)

    # -------------------------------------------------------------------------------------------- propose

    def propose(
        self,
        context: torch.Tensor,
        gamma: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        self._sync(context)
        logits = self._catch_up()  # [1, V_draft]
        if logits is None:  # nothing the draft can read (the context is special tokens it lacks)
            return Proposal(context.new_empty(0))
        if self.active == "tli":
            return self._propose_tli(logits, context, gamma, sampling, generator)
        return self._propose_slem(logits, context, gamma)

    def _to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [1, V_draft] -> [1, V_target]: shared tokens at their target ids, -inf elsewhere."""
        out = logits.new_full((1, self.vocab_size), float("-inf"))  # [1, V_target]
        out[:, self._shared_target] = logits[:, self._shared_draft]
        return out

    def _propose_tli(self, logits, context, gamma, sampling, generator) -> Proposal:
        t2d = self.mapping.target_to_draft
        tokens, probs = [], []
        for i in range(gamma):
            start = time.perf_counter()
            target_logits = self._to_target(logits)  # [1, V_target]
            self.mapping_s += time.perf_counter() - start
            if sampling.greedy:
                token = target_logits.argmax(dim=-1)  # [1]
            else:
                dist = sampling.warp(target_logits)  # [1, V_target], zero outside the intersection
                token = sample(dist, generator)  # [1]
                probs.append(dist)
            tokens.append(token)
            if i + 1 < gamma:
                logits = self._feed([int(t2d[int(token)])])  # [1, V_draft]
        return Proposal(
            tokens=torch.cat(tokens).to(context.device),  # [γ]
            draft_probs=torch.cat(probs).to(context.device) if probs else None,  # [γ, V_target]
        )

    def _propose_slem(self, logits, context, gamma) -> Proposal:
        drafted: list[int] = []
        special = self.mapping.draft_special
        for i in range(gamma):
            token = int(logits.argmax(dim=-1))
            if token in special or token >= len(self.mapping.draft_bytes) or self.mapping.draft_bytes[token] is None:
                break  # text ends here (EOS and the like are the target's to choose)
            drafted.append(token)
            if i + 1 < gamma:
                logits = self._feed([token])
        start = time.perf_counter()
        proposal = self._retokenize_for_target(context, drafted)[:gamma]
        self.mapping_s += time.perf_counter() - start
        return Proposal(torch.tensor(proposal, dtype=torch.long, device=context.device))  # [γ'], point mass

    def _retokenize_for_target(self, context: torch.Tensor, drafted: list[int]) -> list[int]:
        """Target ids for the draft's text, starting exactly where the committed target tokens end."""
        if not drafted:
            return []
        d_bytes, t_bytes = self.mapping.draft_bytes, self.mapping.target_bytes
        new = b"".join(d_bytes[d] for d in drafted)
        tail = []  # the last committed target tokens after the last special one
        for token in reversed(context[-TARGET_LOOKBEHIND:].tolist()):
            if token >= len(t_bytes) or t_bytes[token] is None:
                break
            tail.insert(0, token)
        for m in range(len(tail), -1, -1):
            before = b"".join(t_bytes[t] for t in tail[len(tail) - m :])
            if before and 0x80 <= before[0] < 0xC0:
                continue  # starts inside a character
            data = before + new
            data = data[: _utf8_complete(data)]
            if len(data) <= len(before):
                return []
            ids = encode(self.target_tokenizer, _text(data))
            if ids[:m] == tail[len(tail) - m :]:
                return ids[m:]
        return []

    # ---------------------------------------------------------------------------------------------- auto

    def _record_round(self, num_accepted: int) -> None:
        """auto: count what the drafting method got accepted; switch when its probe rounds are used up."""
        if not self._probe:
            return
        self._probe[self.active].append(num_accepted)
        if len(self._probe[self.active]) < AUTO_PROBE_ROUNDS:
            return
        if not self._probe["slem"]:
            chosen = "slem"
        else:
            mean = {m: sum(v) / len(v) for m, v in self._probe.items()}
            chosen = "tli" if mean["tli"] >= mean["slem"] else "slem"
            self._probe = {}  # decided for the rest of the request
        if chosen != self.active:  # the next sync rebuilds the stream the way the new method reads it
            self.active = chosen
            self._stream = _DraftStream(self.mapping, self.tokenizer, per_token=chosen == "tli")
