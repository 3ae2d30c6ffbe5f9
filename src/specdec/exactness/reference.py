"""The reference distribution, computed exactly from the target (never by sampling it).

- `enumerate_continuations`: every continuation of the prompt with non-zero probability, each with its
  probability = the product of the target's warped next-token probabilities, a continuation ending at the
  first EOS or after `max_new_tokens` tokens, whichever comes first (exactly the decode loop's stopping
  rule). Breadth-first, one batched forward pass per depth (all prefixes of a depth have the same length).
- `iter_conditionals`: the warped next-token distribution after each distinct prefix of given sequences
  (teacher forcing: one batched pass over the distinct sequences gives every position).

Logits are warped in float64 by `specdec.exactness.warp.reference_warp`, the warp written from its
definition, separately from the decoder's `SamplingConfig.warp` (the code under test), so a warp bug cannot
hide by being on both sides. At temperature 0 the distribution is the point mass on the argmax (first index
on ties, as `torch.argmax` and the greedy verifier).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from specdec.core.sampling import SamplingConfig
from specdec.exactness.warp import reference_warp


def warped(logits: torch.Tensor, sampling: SamplingConfig) -> np.ndarray:
    """logits [b, V] -> the distribution the decoder must sample from, float64 [b, V] (`reference_warp`)."""
    return reference_warp(logits.double().numpy(), sampling.temperature, sampling.top_k, sampling.top_p)


@torch.inference_mode()
def _last_logits(model: PreTrainedModel, batch: list[list[int]]) -> torch.Tensor:
    """Logits after each of the equal-length sequences in `batch`: [b, V]."""
    device = next(model.parameters()).device
    ids = torch.tensor(batch, dtype=torch.long, device=device)
    out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return out.logits[:, -1].detach().cpu()


@torch.inference_mode()
def _tail_logits(model: PreTrainedModel, batch: list[list[int]], keep: int) -> torch.Tensor:
    """Logits at the last `keep` positions of the equal-length sequences in `batch`: [b, keep, V]."""
    device = next(model.parameters()).device
    ids = torch.tensor(batch, dtype=torch.long, device=device)
    return model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits.detach().cpu()


@dataclass
class Enumeration:
    """All continuations with non-zero probability (new tokens only) and their probabilities."""

    sequences: list[tuple[int, ...]]
    probs: np.ndarray  # float64 [S], sums to 1 (up to rounding)
    expanded: int  # prefixes whose next-token distribution was computed
    index: dict[tuple[int, ...], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.index:
            self.index = {seq: i for i, seq in enumerate(self.sequences)}

    def __len__(self) -> int:
        return len(self.sequences)

    def probability(self, sequence: Sequence[int]) -> float:
        i = self.index.get(tuple(sequence))
        return 0.0 if i is None else float(self.probs[i])


class EnumerationTooLarge(ValueError):
    """More continuations than the enumeration limit: use the conditional mode."""


def enumerate_continuations(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    sampling: SamplingConfig,
    eos: frozenset[int] | set[int],
    max_new_tokens: int,
    *,
    max_sequences: int = 200_000,
    batch_size: int = 1024,
) -> Enumeration:
    """Every continuation of `prompt_ids` the warped target can produce, with its exact probability."""
    prompt = [int(t) for t in prompt_ids]
    live: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    leaves: list[tuple[int, ...]] = []
    leaf_probs: list[float] = []
    expanded = 0
    for depth in range(max_new_tokens):
        nxt: list[tuple[tuple[int, ...], float]] = []
        last = depth + 1 == max_new_tokens
        for start in range(0, len(live), batch_size):
            chunk = live[start : start + batch_size]
            probs = warped(_last_logits(model, [prompt + list(p) for p, _ in chunk]), sampling)
            expanded += len(chunk)
            for (prefix, mass), row in zip(chunk, probs):
                for token in np.flatnonzero(row > 0).tolist():
                    seq, p = prefix + (token,), mass * float(row[token])
                    if last or token in eos:
                        leaves.append(seq)
                        leaf_probs.append(p)
                    else:
                        nxt.append((seq, p))
            if len(leaves) + len(nxt) > max_sequences:
                raise EnumerationTooLarge(
                    f"more than {max_sequences} continuations of non-zero probability; lower max_new_tokens, "
                    "use top-k / top-p, or the conditional mode"
                )
        live = nxt
    return Enumeration(leaves, np.asarray(leaf_probs, dtype=np.float64), expanded)


def iter_conditionals(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    sequences: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    *,
    batch_size: int = 256,
) -> Iterator[tuple[list[tuple[int, ...]], np.ndarray]]:
    """For the distinct prefixes h of `sequences` that are followed by a token (h = s[:j], j < len(s)),
    yield chunks (prefixes, probs [b, V] float64): the warped next-token distribution after prompt + h."""
    prompt = [int(t) for t in prompt_ids]
    distinct = sorted({tuple(int(t) for t in s) for s in sequences if len(s)}, key=lambda s: (len(s), s))
    done: set[tuple[int, ...]] = set()
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for s in distinct:
        by_length.setdefault(len(s), []).append(s)
    # Longest first: a shorter sequence that is a prefix of a longer one adds nothing new.
    for length in sorted(by_length, reverse=True):
        group = [s for s in by_length[length] if s[:-1] not in done]
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            # Input prompt + s[:-1]; its last `length` positions predict s[0], ..., s[length - 1].
            logits = _tail_logits(model, [prompt + list(s[:-1]) for s in chunk], length)  # [b, length, V]
            prefixes, rows = [], []
            for r, s in enumerate(chunk):
                for j in range(len(s)):
                    h = s[:j]
                    if h in done:
                        continue
                    done.add(h)
                    prefixes.append(h)
                    rows.append(logits[r, j])
            if prefixes:
                yield prefixes, warped(torch.stack(rows), sampling)
