"""Is OpenVINO GenAI's sampling exact? Its draws through specdec's chi-square test (docs/exactness.md).

    peer = OpenVINOPeer(OpenVINOSettings(target_dir, draft_dir), dtype=torch.float32, threads=1, speculative=True)
    result = check_openvino_exactness(peer, target, prompt_ids, method="ov-speculative", gamma=2,
                                      temperature=1.0, top_k=4, max_new_tokens=3, samples=20_000)
    result.verdict, result.p_value, result.detectable_tv

Each draw is one `LLMPipeline.generate` of `max_new_tokens` tokens (EOS ignored) with its own `rng_seed`
(OpenVINO's sampler is seeded per request: the same seed gives the same continuation). The reference is
every continuation with its exact probability under the warped target (`enumerate_continuations`, computed
from the PyTorch target in float64), so the warp must keep the continuations few: a small `top_k`. The test
is the one `check_exactness` runs in enumeration mode (`multinomial_test`: Pearson chi-square, rare cells
pooled; `detectable_tv` is its power). A draw the reference gives probability 0 fails the check outright.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import numpy as np

from specdec.core.sampling import SamplingConfig
from specdec.errors import ConfigError
from specdec.exactness import (
    DEFAULT_ALPHA,
    DEFAULT_POWER,
    EnumerationTooLarge,
    ExactnessResult,
    enumerate_continuations,
    multinomial_test,
)
from specdec.exactness.verifier import power_warning

#: Most continuations the reference enumerates (as `check_exactness`'s automatic choice).
MAX_ENUMERATION = 50_000


def check_openvino_exactness(peer, target, prompt_ids: Sequence[int], *, method: str, gamma: int | None = None,
                             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                             max_new_tokens: int = 3, samples: int = 20_000, seed: int = 0,
                             alpha: float = DEFAULT_ALPHA, power: float = DEFAULT_POWER) -> ExactnessResult:
    """Draw `samples` continuations of `prompt_ids` from `peer` (an `OpenVINOPeer`) with `method`
    ("ov-plain" or "ov-speculative" at `gamma`) and test them against the warped `target`'s exact
    distribution over continuations. `target` is the PyTorch model the peer's IR was exported from."""
    if temperature <= 0.0:
        raise ConfigError("the exactness check samples: give a temperature > 0")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ConfigError(f"samples must be an integer >= 1, got {samples!r}")
    prompt = [int(t) for t in prompt_ids]
    sampling = SamplingConfig(temperature, top_k, top_p)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    try:
        enum = enumerate_continuations(target, prompt, sampling, frozenset(), max_new_tokens,
                                       max_sequences=MAX_ENUMERATION)
    except EnumerationTooLarge:
        raise ConfigError(f"more than {MAX_ENUMERATION} continuations of {max_new_tokens} tokens: lower top_k or "
                          "max_new_tokens so that the reference can be enumerated") from None
    timings["reference_s"] = time.perf_counter() - start

    counts: Counter = Counter()
    drafted = accepted = new_tokens = forwards = 0
    start = time.perf_counter()
    for i in range(samples):
        run = peer.run(method, gamma, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=seed * 1_000_003 + i)
        counts[tuple(run.tokens)] += 1
        drafted, accepted = drafted + run.stats.drafted, accepted + run.stats.accepted
        new_tokens, forwards = new_tokens + len(run.tokens), forwards + run.stats.target_forwards
    timings["draw_s"] = time.perf_counter() - start

    start = time.perf_counter()
    observed = np.zeros(len(enum) + 1)  # the last cell: continuations of probability 0
    for sequence, count in counts.items():
        observed[enum.index.get(sequence, len(enum))] += count
    test = multinomial_test(observed, np.append(enum.probs, 0.0), alpha=alpha, power=power,
                            rng=np.random.default_rng(seed))
    timings["test_s"] = time.perf_counter() - start
    notes = []
    if observed[-1]:
        bad = [s for s in counts if s not in enum.index][:3]
        notes.append(f"{int(observed[-1])} draws are continuations of probability 0, e.g. {bad}")
    warning = power_warning(drafted, accepted) if method == "ov-speculative" else None  # as `specdec verify`
    if warning is not None:
        notes.append(warning)
    settings = {"gamma": gamma, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "max_new_tokens": max_new_tokens, "eos": [], "prompt_length": len(prompt), "seed": seed,
                "alpha": alpha}
    return ExactnessResult(
        method=method, settings=settings, mode="enumerate", samples=samples, test=test,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        tokens_per_round=new_tokens / forwards if forwards else 0.0, drafted=drafted, accepted=accepted,
        draws_per_s=samples / timings["draw_s"] if timings["draw_s"] > 0 else 0.0, engine="openvino",
        timings=timings, notes=notes, power_warning=warning,
    )
