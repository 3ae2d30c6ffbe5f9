"""Tokenizer pairs and draft models for the cross-vocabulary tests (drafts with another tokenizer).

- `stdlib_tokenizers()`: two byte-level BPEs trained on different slices of the stdlib with different vocab
  sizes (so different merges), trained once per test session in about a second.
- `letter_tokenizers()`: two 8-token BPEs over the letters a, b, c with different merges, small enough for
  the statistical suite to enumerate every continuation.
- `transplant(target, mapping, draft_vocab)`: a draft that shares the target's layers and has the target's
  embedding rows for the shared tokens, so it agrees with the target often but not always.
"""

from __future__ import annotations

import copy
import functools

import torch


@functools.lru_cache(maxsize=1)
def stdlib_tokenizers():
    """(target tokenizer, draft tokenizer): byte-level BPEs of 700 and 500 tokens on disjoint stdlib files."""
    from specdec.training.corpus import stdlib_files
    from specdec.training.tokenizer import train_tokenizer

    files = stdlib_files("train")
    texts = [f.read_text(errors="replace") for f in files[:80]]
    return train_tokenizer(texts[:40], vocab_size=700), train_tokenizer(texts[40:], vocab_size=500)


def _letters(vocab: list[str], merges: list[tuple[str, str]]):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=merges))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False)


@functools.lru_cache(maxsize=1)
def letter_tokenizers():
    """(target, draft): 8 tokens each over "abc"; shared: <eos> a b c bc ca; target only: ab abc; draft
    only: ba cab."""
    target = _letters(["<eos>", "a", "b", "c", "ab", "bc", "ca", "abc"],
                      [("a", "b"), ("b", "c"), ("c", "a"), ("ab", "c")])
    draft = _letters(["<eos>", "a", "b", "c", "ba", "ca", "cab", "bc"],
                     [("b", "a"), ("c", "a"), ("ca", "b"), ("b", "c")])
    return target, draft


def transplant(target, draft_vocab: int, draft_to_target: torch.Tensor, noise: float = 0.0, seed: int = 1):
    """A copy of `target` whose embedding / LM-head rows are indexed by the draft's ids: the target's row for a
    shared token, a random row of the same scale otherwise; then Gaussian noise (std noise x each tensor's
    std) on every weight."""
    draft = copy.deepcopy(target)
    draft.resize_token_embeddings(draft_vocab)
    gen = torch.Generator().manual_seed(seed)
    old_in = target.get_input_embeddings().weight
    old_out = target.get_output_embeddings().weight
    with torch.no_grad():
        new_in = draft.get_input_embeddings().weight
        new_out = draft.get_output_embeddings().weight
        for new, old in ((new_in, old_in), (new_out, old_out)):
            rows = torch.randn(draft_vocab, old.shape[1], generator=gen, dtype=torch.float64).to(old.dtype)
            new.copy_(rows * old.std())
            shared = (draft_to_target[:draft_vocab] >= 0).nonzero().view(-1)
            new[shared] = old[draft_to_target[shared]]
        if noise:
            for param in draft.parameters():
                eps = torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype)
                param.add_(eps * noise * (param.std() if param.numel() > 1 else 1.0))
    draft.config.vocab_size = draft_vocab
    return draft.eval()


def permuted(tokenizer, seed: int = 0):
    """The same tokenizer (same merges, same texts) with its non-special ids shuffled: another vocabulary
    that shares every token, so a permuted copy of a model drafts for the original with full acceptance."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    special = {t["id"] for t in spec["added_tokens"]}
    movable = sorted(i for i in vocab.values() if i not in special)
    order = torch.randperm(len(movable), generator=torch.Generator().manual_seed(seed)).tolist()
    new_id = dict(zip(movable, (movable[j] for j in order)))
    spec["model"]["vocab"] = {t: new_id.get(i, i) for t, i in vocab.items()}
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tokenizer.eos_token,
                                   bos_token=tokenizer.bos_token, clean_up_tokenization_spaces=False)
