"""Token data for training: the tokenizer + cached uint16 token streams, and deterministic batches.

The batch of step ``s`` depends only on ``(seed, s)``, never on the history of the run, which is
what makes ``--resume`` reproduce an uninterrupted run exactly.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.training import corpus
from specdec.training.tokenizer import DEFAULT_VOCAB_SIZE, encode_corpus, load_tokenizer, train_tokenizer


@dataclass
class TokenData:
    """The tokenizer and both token streams (each file followed by EOS)."""

    tokenizer: Any
    train: np.ndarray
    heldout: np.ndarray


def obtain_tokenizer(out_dir: Path, tokenizer_dir: str | Path | None, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Any:
    """Load ``tokenizer_dir`` if given and present, else ``out_dir/tokenizer``, else train one there."""
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
        return load_tokenizer(tokenizer_dir)
    target = Path(tokenizer_dir) if tokenizer_dir is not None else out_dir / "tokenizer"
    if (target / "tokenizer.json").is_file():
        return load_tokenizer(target)
    return train_tokenizer(corpus.read_corpus("train"), vocab_size, target)


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    """Short hash of the tokenizer's serialized form, to key the token cache."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:12]


def cached_tokens(tokenizer: Any, split: corpus.Split, cache_dir: Path) -> np.ndarray:
    """Token stream of ``split``, read from / written to ``cache_dir/tokens-<split>-<hash>.npy``."""
    path = cache_dir / f"tokens-{split}-{_tokenizer_fingerprint(tokenizer)}.npy"
    if path.is_file():
        return np.load(path)
    ids = encode_corpus(tokenizer, corpus.read_corpus(split))
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, ids)
    tmp.replace(path)
    return ids


def load_token_data(out_dir: Path, tokenizer_dir: str | Path | None = None) -> TokenData:
    """Tokenizer plus cached train/held-out token streams for a run writing to ``out_dir``."""
    tokenizer = obtain_tokenizer(out_dir, tokenizer_dir)
    cache = out_dir / "cache"
    return TokenData(tokenizer, cached_tokens(tokenizer, "train", cache), cached_tokens(tokenizer, "heldout", cache))


def sample_batch(tokens: np.ndarray, step: int, seed: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len`` tokens; a pure function of (seed, step)."""
    from specdec.errors import ConfigError

    if len(tokens) <= seq_len:
        raise ConfigError(f"corpus has {len(tokens)} tokens, not more than --seq-len {seq_len}; lower --seq-len")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=gen).tolist()
    return torch.from_numpy(np.stack([tokens[s : s + seq_len].astype(np.int64) for s in starts]))


def sequential_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_tokens: int | None = None
) -> list[torch.Tensor]:
    """Non-overlapping windows from the start of ``tokens`` (evaluation), grouped into batches."""
    limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    n_windows = limit // seq_len
    windows = [tokens[i * seq_len : (i + 1) * seq_len].astype(np.int64) for i in range(n_windows)]
    return [torch.from_numpy(np.stack(windows[i : i + batch_size])) for i in range(0, n_windows, batch_size)]
