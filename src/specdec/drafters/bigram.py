"""`Bigram`: the trivial draft model of Leviathan et al. (2023): P(next | previous token), a lookup table.

The table is either dense (a [V, V] tensor of log-probabilities) or, for big vocabularies, sparse: for each
previous token the top-k next tokens with their exact probabilities, and the remaining mass spread evenly
over the other V - k tokens. Either way each row is a proper distribution over the whole vocabulary.

Drafting: at temperature 0 the argmax chain (prev -> argmax P(.|prev) -> ...), a point mass; at T > 0 each
token is sampled from `sampling.warp(log P(.|prev))` and those warped rows are returned as `draft_probs`, so
the rejection rule stays exact.

Building:
- `Bigram.from_corpus(token_ids, vocab_size, smoothing)`: add-`smoothing` (Lidstone) estimate from counts;
  sequences in a list are counted separately (no pair across a boundary).
- `Bigram.from_model(target)`: the target's own next-token distribution after each single token: every
  token id t is fed as a one-token context at position 0 (after an optional `prefix`, e.g. the BOS token),
  batched, and softmax(logits) at temperature 1 (no warp: the decoding warp is applied when drafting) is row
  t. V batched forwards of one token each; no corpus needed.
- `Bigram.load(path)` / `bigram.save(path)`: safetensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.core.sampling import SamplingConfig, sample
from specdec.drafters.base import Drafter, DrafterCapabilities, Proposal
from specdec.drafters.per_row import PerRow
from specdec.errors import ConfigError

#: Vocabularies up to this size get a dense [V, V] table by default (4096² float32 = 64 MiB).
DENSE_MAX_VOCAB = 4096
#: Entries kept per row by default when the table is sparse.
DEFAULT_TOP_K = 64


class Bigram(Drafter):
    """A bigram table drafter. Build with `from_corpus`, `from_model`, `load`, or from a [V, V] table."""

    def __init__(self, probs: torch.Tensor | None = None, *, log_probs: torch.Tensor | None = None):
        """probs [V, V] (rows sum to 1) or log_probs [V, V]: a dense table, row = previous token."""
        if (probs is None) == (log_probs is None):
            raise ConfigError("Bigram needs exactly one of probs [V, V] or log_probs [V, V]")
        if log_probs is None:
            log_probs = probs.double().clamp_min(0).log()
        if log_probs.dim() != 2 or log_probs.shape[0] != log_probs.shape[1]:
            raise ConfigError(f"a bigram table must be square [V, V], got shape {tuple(log_probs.shape)}")
        self._set_dense(log_probs)

    @property
    def capabilities(self) -> DrafterCapabilities:
        """A chain drafter; batched as one fork per row (a fork shares the table)."""
        return DrafterCapabilities(batched=PerRow)

    # -- storage -------------------------------------------------------------------------------------
    def _set_dense(self, log_probs: torch.Tensor) -> None:
        log_probs = _normalise_rows(log_probs.double()).float()  # [V, V]
        self.vocab_size = int(log_probs.shape[0])
        self._dense: torch.Tensor | None = log_probs  # [V, V]
        self._top_ids: torch.Tensor | None = None
        self._top_log_probs: torch.Tensor | None = None
        self._rest_log_prob: torch.Tensor | None = None
        self._argmax = log_probs.argmax(dim=-1)  # [V]

    @classmethod
    def sparse(cls, top_ids: torch.Tensor, top_probs: torch.Tensor, vocab_size: int) -> "Bigram":
        """top_ids [V, K] (-1 = unused slot), top_probs [V, K]: each row's kept entries; the rest of the mass
        (1 - sum) is spread evenly over that row's other tokens."""
        if top_ids.shape != top_probs.shape or top_ids.dim() != 2 or top_ids.shape[0] != vocab_size:
            raise ConfigError(
                f"sparse bigram: top_ids and top_probs must both be [V={vocab_size}, K], got "
                f"{tuple(top_ids.shape)} and {tuple(top_probs.shape)}"
            )
        self = cls.__new__(cls)
        valid = top_ids >= 0  # [V, K]
        probs = torch.where(valid, top_probs.double().clamp_min(0), torch.zeros((), dtype=torch.float64))
        kept = probs.sum(dim=-1)  # [V]
        scale = torch.where(kept > 1, kept, torch.ones_like(kept))  # renormalise rows that overshoot
        probs = probs / scale[:, None]
        kept = kept / scale
        others = vocab_size - valid.sum(dim=-1)  # [V] tokens sharing the rest
        rest = (1 - kept).clamp_min(0) / others.clamp_min(1)  # [V] probability of each other token
        self.vocab_size = int(vocab_size)
        self._dense = None
        self._top_ids = top_ids.long()  # [V, K]
        self._top_log_probs = torch.where(valid, probs.log(), torch.full_like(probs, -math.inf)).float()  # [V, K]
        self._rest_log_prob = rest.log().float()  # [V]
        # argmax: the best kept entry, unless the spread rest is larger (only for rows with no kept mass).
        best = self._top_log_probs.argmax(dim=-1)  # [V]
        best_id = self._top_ids.gather(1, best[:, None])[:, 0]  # [V]
        best_lp = self._top_log_probs.gather(1, best[:, None])[:, 0]  # [V]
        fallback = _first_unkept(self._top_ids, vocab_size)  # [V]
        self._argmax = torch.where((best_id < 0) | (self._rest_log_prob > best_lp), fallback, best_id)
        return self

    @property
    def is_sparse(self) -> bool:
        return self._dense is None

    def to(self, device: str | torch.device) -> "Bigram":
        for name in ("_dense", "_top_ids", "_top_log_probs", "_rest_log_prob", "_argmax"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        return self

    def log_probs(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [m] token ids -> log P(. | prev) [m, V] (float32)."""
        prev = prev.to(self._argmax.device)
        if self._dense is not None:
            return self._dense[prev]  # [m, V]
        rows = self._rest_log_prob[prev][:, None].expand(-1, self.vocab_size).clone()  # [m, V]
        ids = self._top_ids[prev]  # [m, K]
        valid = ids >= 0  # [m, K]
        row_index = torch.arange(prev.shape[0], device=ids.device)[:, None].expand_as(ids)  # [m, K]
        rows[row_index[valid], ids[valid]] = self._top_log_probs[prev][valid]
        return rows

    def probs(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [m] -> P(. | prev) [m, V]."""
        return self.log_probs(prev).exp()

    # -- drafting ------------------------------------------------------------------------------------
    def propose(
        self,
        context: torch.Tensor,
        gamma: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        prev = int(context[-1])
        if prev >= self.vocab_size:
            raise ConfigError(
                f"token id {prev} is outside the bigram table's vocabulary of {self.vocab_size}; build the "
                "table with the target's vocabulary size"
            )
        if sampling.greedy:
            draft = []
            for _ in range(gamma):
                prev = int(self._argmax[prev])
                draft.append(prev)
            return Proposal(tokens=torch.tensor(draft, dtype=torch.long, device=context.device))  # [γ]
        tokens, rows = [], []
        token = context[-1:]  # [1]
        for _ in range(gamma):
            dist = sampling.warp(self.log_probs(token).to(context.device))  # [1, V]
            token = sample(dist, generator)  # [1]
            tokens.append(token)
            rows.append(dist)
        if not tokens:
            return Proposal(tokens=context.new_empty(0))
        return Proposal(tokens=torch.cat(tokens), draft_probs=torch.cat(rows))  # [γ], [γ, V]

    # -- building ------------------------------------------------------------------------------------
    @classmethod
    def from_corpus(
        cls,
        token_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int] | torch.Tensor],
        vocab_size: int,
        smoothing: float = 0.1,
        top_k: int | None = None,
    ) -> "Bigram":
        """Estimate P(next | prev) = (count(prev, next) + smoothing) / (count(prev) + smoothing * V).

        token_ids: one sequence (1-D tensor / list of ints) or a list of sequences (counted separately).
        A previous token never seen (with smoothing 0) gets a uniform row. top_k: keep only the k most
        frequent next tokens per row (sparse); default dense up to DENSE_MAX_VOCAB tokens, else top-64.
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ConfigError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
        if not (isinstance(smoothing, (int, float)) and math.isfinite(smoothing) and smoothing >= 0):
            raise ConfigError(f"smoothing must be a finite number >= 0, got {smoothing!r}")
        prev, nxt = _pairs(token_ids)  # [P], [P]
        if prev.numel() and (int(torch.minimum(prev.min(), nxt.min())) < 0 or
                             int(torch.maximum(prev.max(), nxt.max())) >= vocab_size):
            raise ConfigError(f"corpus token ids must lie in [0, {vocab_size})")
        keys, counts = torch.unique(prev * vocab_size + nxt, return_counts=True)  # [U], [U]
        rows, cols = keys // vocab_size, keys % vocab_size  # [U], [U]
        counts = counts.double()
        totals = torch.zeros(vocab_size, dtype=torch.float64).index_add_(0, rows, counts)  # [V]
        denom = totals + smoothing * vocab_size  # [V]
        if top_k is None and vocab_size <= DENSE_MAX_VOCAB:
            table = torch.full((vocab_size, vocab_size), float(smoothing), dtype=torch.float64)  # [V, V]
            table[rows, cols] += counts
            empty = denom <= 0
            table[empty] = 1.0  # unseen previous token, no smoothing: uniform
            return cls(table / table.sum(dim=-1, keepdim=True))
        top_k = DEFAULT_TOP_K if top_k is None else _check_top_k(top_k, vocab_size)
        probs = (counts + smoothing) / denom[rows].clamp_min(1e-300)  # [U]
        top_ids, top_probs = _top_k_per_row(rows, cols, probs, vocab_size, top_k)
        # Rows without any observation: with smoothing they are uniform (the rest spread over all V tokens).
        return cls.sparse(top_ids, top_probs, vocab_size)

    @classmethod
    def from_model(
        cls,
        target,
        top_k: int | None = None,
        prefix: Sequence[int] = (),
        batch_size: int = 256,
    ) -> "Bigram":
        """Row t = softmax of the target's logits after the context prefix + [t] (batched, no KV cache).

        target: a Hugging Face causal LM (or a CachedCausalLM). top_k: as in `from_corpus` (dense by
        default up to DENSE_MAX_VOCAB tokens). Costs V one-token forwards, batch_size at a time.
        """
        from specdec.runtime.causal_lm import CachedCausalLM, check_rollback_support, vocab_size as model_vocab

        model = target.model if isinstance(target, CachedCausalLM) else target
        if getattr(model.config, "is_encoder_decoder", False):
            check_rollback_support(model)  # UnsupportedModelError: a bigram table needs a decoder-only model
        vocab = model_vocab(model)
        device = next(model.parameters()).device
        prefix_ids = torch.tensor(list(prefix), dtype=torch.long, device=device)  # [p]
        dense = top_k is None and vocab <= DENSE_MAX_VOCAB
        if not dense:
            top_k = DEFAULT_TOP_K if top_k is None else _check_top_k(top_k, vocab)
        log_rows, top_ids, top_probs = [], [], []
        with torch.inference_mode():
            for start in range(0, vocab, batch_size):
                ids = torch.arange(start, min(start + batch_size, vocab), device=device)  # [b]
                batch = torch.cat([prefix_ids[None].expand(ids.shape[0], -1), ids[:, None]], dim=1)  # [b, p+1]
                logits = model(input_ids=batch, use_cache=False, logits_to_keep=1).logits[:, -1]  # [b, V]
                log_p = torch.log_softmax(logits.double(), dim=-1).cpu()  # [b, V]
                if dense:
                    log_rows.append(log_p.float())
                else:
                    values, index = log_p.topk(top_k, dim=-1)  # [b, K]
                    top_ids.append(index)
                    top_probs.append(values.exp())
        if dense:
            return cls(log_probs=torch.cat(log_rows))
        return cls.sparse(torch.cat(top_ids), torch.cat(top_probs), vocab)

    # -- persistence ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the table to a .safetensors file."""
        from safetensors.torch import save_file

        if self._dense is not None:
            tensors = {"log_probs": self._dense.cpu().contiguous()}
        else:
            tensors = {
                "top_ids": self._top_ids.cpu().contiguous(),
                "top_log_probs": self._top_log_probs.cpu().contiguous(),
                "rest_log_prob": self._rest_log_prob.cpu().contiguous(),
            }
        save_file(tensors, str(path), metadata={"format": "specdec-bigram", "vocab_size": str(self.vocab_size)})

    @classmethod
    def load(cls, path: str | Path) -> "Bigram":
        from safetensors import safe_open
        from safetensors.torch import load_file

        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
            tensors = load_file(str(path))
        except (OSError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"cannot read a bigram table from {str(path)!r}: {exc}") from exc
        if metadata.get("format") != "specdec-bigram":
            raise ConfigError(f"{str(path)!r} is not a bigram table saved by specdec.Bigram.save")
        if "log_probs" in tensors:
            return cls(log_probs=tensors["log_probs"])
        vocab = int(metadata["vocab_size"])
        top_ids = tensors["top_ids"]
        probs = tensors["top_log_probs"].double().exp()  # [V, K]
        return cls.sparse(top_ids, probs, vocab)


def _normalise_rows(log_probs: torch.Tensor) -> torch.Tensor:
    """log_probs [V, V] -> rows renormalised to sum to 1; rows with no finite mass become uniform."""
    norm = torch.logsumexp(log_probs, dim=-1, keepdim=True)  # [V, 1]
    bad = ~torch.isfinite(norm[:, 0])  # [V]
    out = log_probs - torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
    if bool(bad.any()):
        out[bad] = -math.log(log_probs.shape[1])
    return out


def _pairs(token_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(prev [P], next [P]): consecutive pairs within each sequence."""
    if isinstance(token_ids, torch.Tensor):
        sequences = [token_ids.reshape(-1)] if token_ids.dim() <= 1 else list(token_ids)
    else:
        token_ids = list(token_ids)
        nested = any(isinstance(t, (list, tuple, torch.Tensor)) for t in token_ids)
        sequences = token_ids if nested else [token_ids]
    prevs, nexts = [], []
    for seq in sequences:
        seq = torch.as_tensor(seq, dtype=torch.long).reshape(-1)  # [L]
        prevs.append(seq[:-1])
        nexts.append(seq[1:])
    if not prevs:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    return torch.cat(prevs), torch.cat(nexts)


def _check_top_k(top_k: object, vocab_size: int) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab_size:
        raise ConfigError(f"top_k must be an integer in [1, {vocab_size}], got {top_k!r}")
    return top_k


def _top_k_per_row(rows, cols, probs, vocab_size: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries (rows [U], cols [U], probs [U]) -> top_ids [V, K] (-1 padded), top_probs [V, K]."""
    order = torch.argsort(probs, descending=True, stable=True)  # [U]
    order = order[torch.argsort(rows[order], stable=True)]  # by row, then probability descending
    rows, cols, probs = rows[order], cols[order], probs[order]
    starts = torch.zeros(vocab_size + 1, dtype=torch.long)
    starts[1:] = torch.bincount(rows, minlength=vocab_size).cumsum(0)
    rank = torch.arange(rows.shape[0]) - starts[rows]  # [U] position within its row
    keep = rank < k
    top_ids = torch.full((vocab_size, k), -1, dtype=torch.long)
    top_probs = torch.zeros((vocab_size, k), dtype=torch.float64)
    top_ids[rows[keep], rank[keep]] = cols[keep]
    top_probs[rows[keep], rank[keep]] = probs[keep]
    return top_ids, top_probs


def _first_unkept(top_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """top_ids [V, K] -> [V]: the smallest token id not among each row's kept ids (0 if all kept)."""
    k = top_ids.shape[1]
    candidates = torch.arange(k + 1, device=top_ids.device)  # one of 0..K is always free
    taken = (top_ids[:, :, None] == candidates[None, None, :]).any(dim=1)  # [V, K+1]
    first = (~taken).float().argmax(dim=-1)  # [V]
    return torch.where(first < vocab_size, first, torch.zeros_like(first))
