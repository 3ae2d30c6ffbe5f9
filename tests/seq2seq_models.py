"""Tiny random encoder-decoder models for tests: T5, BART, Marian and Whisper configs of a given size."""

from __future__ import annotations

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    PreTrainedModel,
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

VOCAB = 96
MELS = 8  # Whisper: log-mel bins
FRAMES = 32  # Whisper: input frames (= 2 x max_source_positions)
ARCHS = ("t5", "bart", "marian", "whisper")


def _bart_like(hidden: int, layers: int, vocab: int) -> dict:
    return dict(vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * hidden,
                decoder_ffn_dim=2 * hidden, init_std=0.2, dropout=0.0, attention_dropout=0.0)


def tiny_seq2seq(arch: str, hidden: int = 32, layers: int = 2, vocab: int = VOCAB, seed: int = 0,
                 dtype: torch.dtype = torch.float64) -> PreTrainedModel:
    """A random tiny encoder-decoder of `arch`, eval mode, no EOS configured (tests set one when they need it).
    Special ids: T5 starts the decoder with 0 (its pad); BART with 2; Marian with vocab-1; Whisper with vocab-3."""
    torch.manual_seed(seed)
    if arch == "t5":
        config = T5Config(vocab_size=vocab, d_model=hidden, d_kv=hidden // 4, d_ff=2 * hidden, num_layers=layers,
                          num_decoder_layers=layers, num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                          eos_token_id=1, initializer_factor=2.0, dropout_rate=0.0)
        model = T5ForConditionalGeneration(config)
    elif arch == "bart":
        config = BartConfig(**_bart_like(hidden, layers, vocab), max_position_embeddings=128, pad_token_id=1,
                            bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
                            forced_bos_token_id=None)
        model = BartForConditionalGeneration(config)
    elif arch == "marian":
        config = MarianConfig(**_bart_like(hidden, layers, vocab), max_position_embeddings=128,
                              pad_token_id=vocab - 1, eos_token_id=0, decoder_start_token_id=vocab - 1,
                              forced_eos_token_id=None)
        model = MarianMTModel(config)
    elif arch == "whisper":
        config = WhisperConfig(**_bart_like(hidden, layers, vocab), num_mel_bins=MELS,
                               max_source_positions=FRAMES // 2, max_target_positions=64, pad_token_id=vocab - 1,
                               bos_token_id=vocab - 2, eos_token_id=vocab - 2, decoder_start_token_id=vocab - 3,
                               begin_suppress_tokens=None, suppress_tokens=None)
        model = WhisperForConditionalGeneration(config)
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = None
    model.generation_config.forced_eos_token_id = None
    model.generation_config.forced_bos_token_id = None
    return model.to(dtype).eval()


def encoder_inputs(arch: str, source: list[int] | None = None, seed: int = 0) -> dict:
    """One request's encoder input: source token ids for text models, random log-mel features for Whisper."""
    if arch == "whisper":
        gen = torch.Generator().manual_seed(seed)
        return {"input_features": torch.randn(1, MELS, FRAMES, generator=gen, dtype=torch.float64)}
    ids = torch.tensor([source])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def hf_greedy_seq2seq(model: PreTrainedModel, enc: dict, decoder_prompt: list[int], max_new_tokens: int,
                      eos=None) -> list[int]:
    """Reference: transformers' own greedy generate with the same decoder prompt, new decoder tokens only."""
    out = model.generate(**enc, decoder_input_ids=torch.tensor([decoder_prompt]), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=model.config.pad_token_id)
    tokens = out[0].tolist()
    # Whisper's generate returns the new tokens only; the others return the decoder prompt too.
    if model.main_input_name != "input_features":
        assert tokens[: len(decoder_prompt)] == decoder_prompt
        tokens = tokens[len(decoder_prompt):]
    elif eos is not None and len(tokens) < max_new_tokens:  # Whisper's generate also drops the EOS it stopped at
        tokens.append(eos)
    return tokens
