"""One request's decoding options, validated once: `DecodeOptions` (the role of vLLM's SamplingParams).

`generate`, `stream`, `SpeculativeDecoder`, `generate_batch`, `BatchDecoder.add` and the server's request parsing
all build one; every check and its message lives here. The decoder-wide `compile` setting is checked by
`check_compile`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields

from specdec.core.sampling import SamplingConfig
from specdec.engine.policies import GammaPolicy
from specdec.errors import ConfigError

#: The `compile=` settings: the fast path compiled, the slot cache eager, or the eager adapters.
COMPILE_MODES = (False, True, "static")


@dataclass(frozen=True)
class DecodeOptions:
    """What one request asks for.

    gamma: draft tokens per round: an integer >= 1, "auto" (`AdaptiveGamma`), a policy object (`choose(stats)`,
        `update(stats)`), or None: the drafter's default (a tree drafter's depth), else `DEFAULT_GAMMA`.
    max_new_tokens: new tokens at most (an EOS may end the request earlier).
    temperature, top_k, top_p: the warp of the target's (and the drafter's) distributions; temperature 0 is
        greedy decoding (`SamplingConfig`).
    eos_token_id: an int, a list of ints, None (the target's generation_config) or [] (never stop early);
        kept as a tuple.
    seed: the request's random generator's seed (None: a random seed).
    logprobs: None, or k >= 0: batched decoding reports the emitted tokens' target log-probabilities and the k
        most likely alternatives at each position.
    """

    gamma: int | str | object | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | Sequence[int] | None = None
    seed: int | None = None
    logprobs: int | None = None
    sampling: SamplingConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_gamma(self.gamma)
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        object.__setattr__(self, "sampling", SamplingConfig(self.temperature, self.top_k, self.top_p))
        if self.eos_token_id is not None:
            eos = _int_list(self.eos_token_id, "eos_token_id", "an int, a list of ints, None (the target's "
                            "generation_config) or [] (never stop early)")
            object.__setattr__(self, "eos_token_id", tuple(eos))
        object.__setattr__(self, "seed", _check_seed(self.seed))
        logprobs = self.logprobs
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise ConfigError(f"logprobs must be None or an integer >= 0 (top alternatives), got {logprobs!r}")

    @classmethod
    def given(cls, options: DecodeOptions | None, **kwargs: object) -> DecodeOptions:
        """`options`, or the options the keyword arguments name: not both (a keyword left at its default is not
        given)."""
        if options is None:
            return cls(**kwargs)
        if not isinstance(options, DecodeOptions):
            raise ConfigError(f"options must be a specdec.DecodeOptions, got {type(options).__name__}")
        defaults = {f.name: f.default for f in fields(cls) if f.init}
        named = sorted(name for name, value in kwargs.items() if _differs(value, defaults[name]))
        if named:
            raise ConfigError(f"pass the request's options either as options=DecodeOptions(...) or as keyword "
                              f"arguments, not both (also given: {', '.join(named)})")
        return options


def check_compile(compile: object) -> bool | str:
    """The decoder's `compile` setting, or a ConfigError."""
    if compile not in COMPILE_MODES:
        raise ConfigError(f"compile must be True, False or 'static' (the slot cache without torch.compile), "
                          f"got {compile!r}")
    return compile


def _differs(value: object, default: object) -> bool:
    if value is default:
        return False
    try:
        return bool(value != default)
    except (TypeError, ValueError, RuntimeError):  # e.g. a tensor: given
        return True


def _check_gamma(gamma: object) -> None:
    if gamma is None or isinstance(gamma, GammaPolicy) or gamma == "auto":
        return  # the drafter's default, the adaptive policy, or a policy object
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ConfigError(f"gamma (draft tokens per round) must be an integer >= 1 or 'auto' (chosen as acceptance "
                          f"is measured), got {gamma!r}")


def _int_list(value: object, name: str, expected: str) -> list[int]:
    """`value` (an int or a sequence of ints, numpy/torch integers included) as a list of ints."""
    scalar = not isinstance(value, Iterable) or getattr(value, "ndim", 1) == 0
    items = [value] if scalar else value
    try:
        if isinstance(value, (str, bytes)) or any(isinstance(v, bool) for v in items):
            raise TypeError
        return [operator.index(v) for v in items]
    except TypeError:
        raise ConfigError(f"{name} must be {expected}, got {value!r}") from None


def _check_seed(seed: object) -> int | None:
    if seed is None:
        return None
    try:
        if isinstance(seed, bool):
            raise TypeError
        return operator.index(seed)
    except TypeError:
        raise ConfigError(f"seed must be an integer or None, got {seed!r}") from None
