"""Byte-level BPE tokenizer trained on the stdlib train split, saved as a PreTrainedTokenizerFast.

Files are separated by ``<|endoftext|>`` in the token stream; the same token serves as BOS and
PAD, so the vocabulary has exactly one special token.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

EOS_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, out_dir: str | Path | None = None
) -> Any:
    """Train a byte-level BPE on ``texts``; return it as a ``PreTrainedTokenizerFast``.

    When ``out_dir`` is given the tokenizer is saved there with ``save_pretrained`` so that
    ``AutoTokenizer.from_pretrained(out_dir)`` loads it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )
    fast.model_max_length = 2048
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(path: str | Path) -> Any:
    """Load a saved tokenizer directory, raising ModelLoadError with a fix when it is absent."""
    from specdec.errors import ModelLoadError

    if not (Path(path) / "tokenizer.json").is_file():
        raise ModelLoadError(
            f"no tokenizer.json in {path}; train one with `specdec train --out DIR` "
            "(it trains a tokenizer when --tokenizer is absent) or pass the right --tokenizer"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode_corpus(tokenizer: Any, texts: list[str]) -> np.ndarray:
    """All ``texts`` tokenized and concatenated, each file followed by EOS, as uint16 ids."""
    if len(tokenizer) > 65535:
        from specdec.errors import ConfigError

        raise ConfigError("vocabulary too large for uint16 token cache; use vocab_size <= 65535")
    backend = tokenizer.backend_tokenizer
    eos = tokenizer.eos_token_id
    pieces = []
    for enc in backend.encode_batch(texts, add_special_tokens=False):
        pieces.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)
