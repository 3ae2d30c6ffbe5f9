"""Text in, text out: a convenience over `generate`/`stream` for users holding a tokenizer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from specdec.core.stats import DecodeStats
from specdec.drafters.base import Drafter
from specdec.engine.decoding import SpeculativeDecoder
from specdec.errors import PromptError


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


def text_request(target, tokenizer, prompt: str, encoder_inputs=None) -> tuple[list[int] | None, dict | None]:
    """(decoder prompt ids, encoder inputs) for a text prompt. A decoder-only target continues the prompt; an
    encoder-decoder text target (T5, BART, Marian) reads the prompt with its encoder and decodes from its start
    token. A speech target (Whisper) needs its audio features as encoder_inputs; the text is then ignored unless
    given (a decoder prompt)."""
    from specdec.runtime.seq2seq_lm import is_encoder_decoder  # noqa: PLC0415

    model = getattr(target, "model", target)
    if not is_encoder_decoder(model):
        return encode_prompt(tokenizer, prompt), encoder_inputs
    if encoder_inputs is not None:  # the source is given: the text is the decoder prompt ("" = start token)
        return (encode_prompt(tokenizer, prompt) if prompt else None), encoder_inputs
    if model.main_input_name != "input_ids":
        raise PromptError(
            f"{type(model).__name__} reads audio, not text: pass its features, e.g. encoder_inputs="
            "processor(audio, sampling_rate=16000, return_tensors='pt'), to specdec.generate_text / generate"
        )
    if not isinstance(prompt, str):
        raise PromptError(f"prompt must be a string, got {type(prompt).__name__}; for ids use specdec.generate")
    source = tokenizer(prompt, add_special_tokens=True)
    return None, {"input_ids": source["input_ids"], "attention_mask": source["attention_mask"]}


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
    if isinstance(drafter, Drafter):
        drafter.pair_tokenizer(tokenizer)


def stream_text(target, tokenizer, prompt: str, drafter=None, **kwargs) -> Iterator[str]:
    """Yield pieces of the continuation of `prompt` as tokens become final (kwargs: as `generate`)."""
    _pair_tokenizers(drafter, tokenizer)
    prompt_ids, encoder_inputs = text_request(target, tokenizer, prompt, kwargs.pop("encoder_inputs", None))
    decoder = SpeculativeDecoder(target, drafter, encoder_inputs=encoder_inputs, **kwargs)
    yield from detokenize(tokenizer, decoder.stream(prompt_ids))


def generate_text(target, tokenizer, prompt: str, drafter=None, **kwargs) -> TextOutput:
    """Continue `prompt` (a string); returns the continuation text, its tokens and the stats.

    Keyword arguments are those of `specdec.generate` (gamma, max_new_tokens, temperature, ...).
    A draft with another tokenizer, `specdec.DraftModel(draft, tokenizer=draft_tokenizer)`, is paired with
    `tokenizer` here. An encoder-decoder target (T5, BART, Marian): `prompt` is the source its encoder reads,
    and the text returned is the decoder's output (docs/seq2seq.md).
    """
    _pair_tokenizers(drafter, tokenizer)
    prompt_ids, encoder_inputs = text_request(target, tokenizer, prompt, kwargs.pop("encoder_inputs", None))
    decoder = SpeculativeDecoder(target, drafter, encoder_inputs=encoder_inputs, **kwargs)
    tokens = list(decoder.stream(prompt_ids))
    return TextOutput(tokenizer.decode(tokens, skip_special_tokens=True), tokens, decoder.stats)
