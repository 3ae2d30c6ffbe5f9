"""A request as the decode loop holds it: its checked prompt, options, random generator, γ policy, EOS set and
statistics (`Row`), and what a finished one returns (`GenerationOutput`). A lone request is a batch of one row."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from specdec.core.sampling import SamplingConfig
from specdec.core.stats import DecodeStats
from specdec.drafters.base import Drafter
from specdec.engine.options import DecodeOptions
from specdec.errors import PromptError


@dataclass
class GenerationOutput:
    tokens: list[int]  # the new tokens only, up to and including an EOS
    stats: DecodeStats = field(default_factory=DecodeStats)


@dataclass
class Row:
    """One request being decoded."""

    key: object
    context: torch.Tensor  # [n0 + max_new_tokens + 1]; context[:n] is committed
    n: int
    options: DecodeOptions
    generator: torch.Generator
    gamma_policy: object
    eos: frozenset[int]
    stats: DecodeStats = field(default_factory=DecodeStats)
    drafter: Drafter | None = None  # the row's own drafter (a fork; a lone request's drafter itself)
    encoder_inputs: Mapping[str, object] | None = None  # an encoder-decoder request's encoder input
    source_ids: torch.Tensor | None = None  # [S] its source token ids (text encoders), once prefilled
    produced: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def sampling(self) -> SamplingConfig:
        return self.options.sampling

    @property
    def max_new_tokens(self) -> int:
        return self.options.max_new_tokens

    @property
    def logprobs(self) -> int | None:
        return self.options.logprobs


def new_row(key: object, prompt_ids: Sequence[int] | torch.Tensor, options: DecodeOptions, target,
            gamma_policy: object, generator: torch.Generator | None = None,
            encoder_inputs: Mapping[str, object] | None = None) -> Row:
    """A checked, not yet prefilled row for `target` (a `RowTarget`): the prompt read and checked against the
    target's vocabulary and limits (a PromptError before any work), its generator seeded (or `generator`, a
    lone decoder's own, kept across its requests)."""
    prompt = prompt_tensor(prompt_ids, target.vocab_size)  # [n0]
    n = prompt.shape[0]
    target.check_fits(n, options.max_new_tokens)
    if generator is None:
        generator = seeded_generator(options.seed, target.device)
    context = torch.empty(n + options.max_new_tokens + 1, dtype=torch.long, device=target.device)
    context[:n] = prompt
    return Row(key, context, n, options, generator, gamma_policy, eos_ids(target.model, options.eos_token_id),
               encoder_inputs=encoder_inputs)


def seeded_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A request's random generator: seeded with `seed`, or from the OS when None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def check_prompt_fits(prompt_len: int, max_new_tokens: int, limit: int | None, what: str = "the target's context",
                      fix: str = "shorten the prompt or lower max_new_tokens") -> None:
    """Raise before any work if the prompt plus every new token would pass `limit` (`what` names it)."""
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise PromptError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {prompt_len + max_new_tokens} "
            f"exceeds {what} of {limit} tokens; {fix}"
        )


def eos_ids(target: PreTrainedModel, eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    """The request's EOS ids: `eos_token_id` (checked by `DecodeOptions`), or the target's generation_config's."""
    if eos_token_id is None:
        config = getattr(target, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None:
            return frozenset()
    return frozenset(DecodeOptions(eos_token_id=eos_token_id).eos_token_id)


def prompt_tensor(prompt_ids: Sequence[int] | torch.Tensor, vocab: int) -> torch.Tensor:
    """The prompt as a 1-D long tensor on the CPU [n], or a PromptError naming the fix."""
    if isinstance(prompt_ids, Mapping):  # a tokenizer's BatchEncoding: use its input_ids
        if "input_ids" not in prompt_ids:
            raise PromptError("prompt_ids is a mapping without 'input_ids'; pass tokenizer(text).input_ids")
        prompt_ids = prompt_ids["input_ids"]
    if isinstance(prompt_ids, str):
        raise PromptError("prompt_ids must be token ids, not a string: use specdec.generate_text for text")
    if not isinstance(prompt_ids, torch.Tensor):
        try:
            prompt_ids = torch.tensor(list(prompt_ids), dtype=torch.long)
        except (TypeError, ValueError, RuntimeError):
            raise PromptError(
                f"prompt_ids must be a list of ints or a 1-D integer tensor, got {type(prompt_ids).__name__} "
                f"{str(prompt_ids)[:60]}; pass tokenizer(text).input_ids"
            ) from None
    if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
        prompt_ids = prompt_ids[0]
    if prompt_ids.dim() != 1 or prompt_ids.dtype.is_floating_point:
        raise PromptError(
            f"prompt_ids must be one sequence (a 1-D integer tensor, a list of ints, or a batch of one), "
            f"got shape {tuple(prompt_ids.shape)} and dtype {prompt_ids.dtype}; decode one prompt at a "
            "time: pass tokenizer(text).input_ids"
        )
    ids = prompt_ids.detach().to("cpu", torch.long)
    if ids.numel() == 0:
        raise PromptError("the prompt is empty: pass at least one token id (e.g. the BOS token)")
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        first = int(ids[bad][0])
        raise PromptError(
            f"prompt token id {first} is outside the target's vocabulary [0, {vocab}); "
            "tokenize with the target's own tokenizer"
        )
    return ids
