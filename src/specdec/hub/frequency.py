"""A reduced draft vocabulary for any tokenizer, from text that every Python installation carries.

A draft restricted to its N most frequent tokens (FR-Spec) computes an N-row LM head instead of the whole one,
which at a 150k-token vocabulary is a large share of a small draft's step. The default pair ranks its tokens by its
own training data (hub/default_pair.py). Any other tokenizer is ranked here by offline text: this interpreter's
standard library source (code) and pydoc's topic pages (English prose), tokenized with that tokenizer, with its
special tokens (the end-of-sequence token among them) always kept.

On real tokenizers, scored on text the ranking never read (benchmarks/draft_vocab_coverage.py;
docs/bench/draft-vocab-coverage), the 32,768 tokens ranked this way hold 96.3% (Qwen2) and 97.9% (Llama 3) of the
standard library's packages' tokens and 93.5% / 94.9% of installed packages' descriptions, where the 32,768 lowest
ids (a byte-level BPE numbers its tokens in merge order) hold 93.9% / 95.6% and 91.0% / 92.8%. A SentencePiece
vocabulary's ids follow no such order: 16,384 ranked tokens hold 96.6–99.3% (Llama 2, Phi-3), its lowest ids
55–74%. Which tokens a draft may propose changes its acceptance, never the output: the verification keeps the
target's distribution whatever the draft proposes. A user's own text ranks best (`texts=`).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch

from specdec.errors import ConfigError

#: How much standard-library source the ranking reads (the modules in name order up to this many characters):
#: about a second of a fast tokenizer's time.
CODE_CHARS = 1_500_000


def offline_texts(code_chars: int = CODE_CHARS) -> list[str]:
    """The ranking's text: the top-level modules of this interpreter's standard library in name order, up to
    `code_chars` characters, and pydoc's topic pages. Either may be missing from a trimmed installation."""
    texts: list[str] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    size = 0
    for path in sorted(stdlib.glob("*.py")):
        if size >= code_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
    try:
        from pydoc_data.topics import topics  # noqa: PLC0415
    except ImportError:
        topics = {}
    texts.extend(topics.values())
    return texts


def token_counts(tokenizer, texts: list[str]) -> np.ndarray:
    """How often each id of `tokenizer` occurs in `texts` [V] (no special tokens added)."""
    width = len(tokenizer)
    counts = np.zeros(width, dtype=np.int64)  # [V]
    for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:  # no warning on long texts
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=width)[:width]
    return counts


def most_frequent(counts: np.ndarray, n: int) -> torch.Tensor:
    """The `n` ids of the highest counts, as ascending ids [n] (equal counts: the lower id first)."""
    return torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[:n]))


def frequent_tokens(tokenizer, n: int, texts: list[str] | None = None) -> torch.Tensor:
    """The `n` most frequent ids of `tokenizer` in `texts` (default: `offline_texts()`), its special tokens always
    among them, as ascending ids [n]: a draft vocabulary for a model of that tokenizer
    (`SelfDraft(target, draft_vocab=frequent_tokens(tokenizer, 32768))`, `DraftModel(draft, draft_vocab=...)`).
    Ties, and ids the text never shows, go by id (lowest first)."""
    width = len(tokenizer)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= width:
        raise ConfigError(f"a draft vocabulary of this tokenizer holds 1..{width} tokens, got {n!r}")
    texts = offline_texts() if texts is None else texts
    if not texts:
        raise ConfigError("no text to rank the tokens by: pass texts=[...] (e.g. samples of your prompts), or the "
                          "draft vocabulary's ids themselves")
    counts = token_counts(tokenizer, texts)
    special = [i for i in tokenizer.all_special_ids if 0 <= i < width]
    counts[special] = counts.max() + 1  # kept whatever the text holds
    return most_frequent(counts, n)
