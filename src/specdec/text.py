"""Text in, text out: a convenience over `generate`/`stream` for users holding a tokenizer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from specdec.decoding import SpeculativeDecoder
from specdec.errors import PromptError
from specdec.stats import DecodeStats


@dataclass
class TextOutput:
    text: str  # the continuation only
    tokens: list[int]
    stats: DecodeStats


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    if not isinstance(prompt, str):
        raise PromptError(f"prompt must be a string, got {type(prompt).__name__}; for ids use specdec.generate")
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id]
    return ids


def detokenize(tokenizer, tokens: Iterable[int]) -> Iterator[str]:
    """Yield text pieces as tokens arrive; the pieces join to decode(all tokens).

    Decodes a short window (from the last token boundary before the previous piece) rather than the whole
    sequence each time, and holds back a piece that ends in an incomplete UTF-8 sequence.
    """
    ids: list[int] = []
    prefix, read = 0, 0  # ids[prefix:read] is text already emitted, kept for context
    for token in tokens:
        ids.append(token)
        prefix_text = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        text = tokenizer.decode(ids[prefix:], skip_special_tokens=True)
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            yield text[len(prefix_text):]
            prefix, read = read, len(ids)


def _pair_tokenizers(drafter, tokenizer) -> None:
    """A draft with its own tokenizer (DraftModel(draft, tokenizer=...)) translates to this target's."""
    if getattr(drafter, "target_tokenizer", False) is None and hasattr(drafter, "set_target_tokenizer"):
        drafter.set_target_tokenizer(tokenizer)


def stream_text(target, tokenizer, prompt: str, drafter=None, **kwargs) -> Iterator[str]:
    """Yield pieces of the continuation of `prompt` as tokens become final (kwargs: as `generate`)."""
    _pair_tokenizers(drafter, tokenizer)
    decoder = SpeculativeDecoder(target, drafter, **kwargs)
    yield from detokenize(tokenizer, decoder.stream(encode_prompt(tokenizer, prompt)))


def generate_text(target, tokenizer, prompt: str, drafter=None, **kwargs) -> TextOutput:
    """Continue `prompt` (a string); returns the continuation text, its tokens and the stats.

    Keyword arguments are those of `specdec.generate` (gamma, max_new_tokens, temperature, ...).
    A draft with another tokenizer, `specdec.DraftModel(draft, tokenizer=draft_tokenizer)`, is paired with
    `tokenizer` here.
    """
    _pair_tokenizers(drafter, tokenizer)
    decoder = SpeculativeDecoder(target, drafter, **kwargs)
    tokens = list(decoder.stream(encode_prompt(tokenizer, prompt)))
    return TextOutput(tokenizer.decode(tokens, skip_special_tokens=True), tokens, decoder.stats)
