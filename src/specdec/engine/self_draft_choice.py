"""The drafter for a target that has none: its own quantized copy (`SelfDraft`), where that measures faster.

Most models have no draft trained for them. `choose_self_draft(target, prompt_ids)` decides whether the target's own
weights, quantized (`SelfDraft(target, weights=SELF_DRAFT_WEIGHTS)`), make its decoding faster on this machine, on
the path the requests run (eager or `compile=`), by measuring it: the prompt's greedy continuation is decoded
`MEASURE_TOKENS` tokens at a time, plainly and with the self-draft (γ "auto"), twice each, interleaved, and the
best decode tokens/s of each (compiling and prefill left out) are compared. The self-draft is chosen when it is at
least `PAYS` times plain decoding's. Both runs are greedy, so their tokens must be identical (the identity promise);
if they are not, plain decoding is chosen and a warning says so.

The verdict is cached per machine (CPU, cores, torch, the kernels' build), model (its config, size, dtype and a
sample of its weights), path and threads set in `~/.cache/specdec/self_draft.json` (`$XDG_CACHE_HOME`): a model is
measured once, on its first prompt; later calls build the self-draft, or not, without measuring. What the verdict
does not decide, `gamma="auto"` does per round: it drafts nothing in rounds where drafting does not pay, so a
request whose text the copy predicts worse than the measured one loses little.

Measured on the AVX2 Zen 3 EPYC (BENCHMARKS.md): the default target's w4a8 self-draft ran 1.47x its plain decoding
with `gamma="auto"`. At the 1.5B shape it pays for a float32 target on bfloat16 packed weights (the fast form on a
CPU without bfloat16 arithmetic: 1.62x compiled with every draft accepted; 1.30–1.35x through the oracle harness at
a trained model's acceptance), not for the same target in bfloat16 on its own layers (0.64–0.79x: torch's
multi-row bfloat16 pass costs 4.7 one-row passes there).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import warnings
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specdec.drafters.self_draft import SelfDraft
from specdec.engine.decoding import SpeculativeDecoder
from specdec.runtime.precision import cache_file, machine_key, read_cache, write_cache
from specdec.runtime.threads import explicit_threads
from specdec.runtime.weights import FLOATS, packed_formats

log = logging.getLogger("specdec.self_draft")

#: The quantized copy that drafts: int4 weights on int8 activations, the format that paid best on the CPUs measured
#: (docs/quantization.md: on the default pair w4a8 1.47x plain, int4 and int8 less).
SELF_DRAFT_WEIGHTS = "w4a8"
#: Tokens decoded per measuring run (two plain runs and two self-draft runs, once per model and machine).
MEASURE_TOKENS = 24
#: A measuring run that ends (EOS) before this many tokens measures nothing: the verdict waits for a longer prompt.
MIN_MEASURED_TOKENS = 8
#: The self-draft's decode tokens/s over plain decoding's needed to choose it (a margin over timing noise: the
#: copy costs memory, an eighth of float32's bytes).
PAYS = 1.05


@dataclasses.dataclass(frozen=True)
class SelfDraftChoice:
    """What `choose_self_draft` decided. drafter: the `SelfDraft` to decode with, or None (plain decoding).
    reason: one line for users. plain / self_draft: the measured decode tokens/s (None where nothing was measured);
    alpha: the self-draft's acceptance rate in its measuring run; cached: the verdict came from the cache."""

    drafter: SelfDraft | None
    reason: str
    plain: float | None = None
    self_draft: float | None = None
    alpha: float | None = None
    cached: bool = False

    @property
    def speedup(self) -> float | None:
        """The self-draft's tokens/s over plain decoding's, as measured (None where nothing was)."""
        return None if self.plain is None or self.self_draft is None else self.self_draft / self.plain


def choose_self_draft(target: PreTrainedModel, prompt_ids: Sequence[int] | torch.Tensor, *,
                      compile: bool | str = False, weights: str = SELF_DRAFT_WEIGHTS,
                      remeasure: bool = False) -> SelfDraftChoice:
    """`SelfDraft(target, weights)` if it measures at least `PAYS` times faster than plain decoding on this machine
    and path (see the module's docstring), else None; measured on `prompt_ids`' continuation the first time, then
    cached. remeasure=True measures again and replaces the cached verdict."""
    why_not = _unsuitable(target)
    if why_not is not None:
        return SelfDraftChoice(None, why_not)
    path, key = cache_file("self_draft.json"), _key(target, weights, compile)
    known = read_cache(path)
    if key in known and not remeasure:
        entry = known[key]
        drafter = SelfDraft(target, weights) if entry["pays"] else None
        return SelfDraftChoice(drafter, _reason(weights, entry, cached=True), entry["plain"], entry["self_draft"],
                               entry["alpha"], cached=True)
    log.info("measuring once whether SelfDraft(%s) decodes this model faster than plain decoding here", weights)
    drafter = SelfDraft(target, weights)
    plain, drafted, alpha, same = _measure(target, drafter, prompt_ids, compile)
    if plain is None:
        return SelfDraftChoice(None, f"SelfDraft({weights}) not measured: the prompt's continuation ended before "
                               f"{MIN_MEASURED_TOKENS} tokens (measured on a later prompt)")
    if not same:
        warnings.warn(f"SelfDraft({weights})'s greedy tokens differed from plain decoding's on this model: plain "
                      "decoding is used. This breaks specdec's identity promise; please report it with the model "
                      "and the command", RuntimeWarning, stacklevel=2)
        return SelfDraftChoice(None, f"SelfDraft({weights}) not used: its greedy tokens differed from plain "
                               "decoding's", plain, drafted, alpha)
    entry = {"pays": alpha is not None and drafted >= PAYS * plain, "plain": plain, "self_draft": drafted,
             "alpha": alpha}
    known[key] = entry
    write_cache(path, known)
    return SelfDraftChoice(drafter if entry["pays"] else None, _reason(weights, entry, cached=False), plain, drafted,
                           alpha)


def _unsuitable(target: PreTrainedModel) -> str | None:
    """Why a target cannot have a self-draft (None: it can)."""
    if target.config.is_encoder_decoder:
        return "no self-draft for an encoder-decoder target: plain decoding"
    if any(p.device.type != "cpu" for p in target.parameters()):
        return "no self-draft off the CPU (SelfDraft runs on specdec's CPU kernels): plain decoding"
    quantized = sorted(packed_formats(target) - set(FLOATS))
    if quantized:
        return f"no self-draft for a target on {', '.join(quantized)} weights: plain decoding"
    return None


def _key(target: PreTrainedModel, weights: str, compile: bool | str) -> str:
    """The machine, the model (config, size, dtype, a sample of its embedding), the draft's format, the path and the
    threads set for the process (else specdec chooses them per model): what a cached verdict holds for."""
    digest = hashlib.sha256(target.config.to_json_string(use_diff=False).encode())
    embedding = target.get_input_embeddings().weight
    digest.update(embedding[:2, :64].detach().float().numpy().tobytes())
    size = sum(p.numel() for p in target.parameters())
    path = "eager" if not compile else "compiled" if compile is True else str(compile)
    packed = ",".join(sorted(packed_formats(target))) or "its own"
    return (f"{machine_key()} | {target.config.name_or_path or type(target).__name__} {size} params "
            f"{embedding.dtype} {digest.hexdigest()[:16]} {packed} weights | self-draft {weights} | {path} | "
            f"threads {explicit_threads() or 'chosen per model'}")


def _measure(target: PreTrainedModel, drafter: SelfDraft, prompt_ids, compile) -> tuple:
    """(plain tokens/s, self-draft tokens/s, α, same tokens): the best of two greedy runs each, interleaved, and the
    self-draft's acceptance over both (None if it drafted nothing); (None, ...) when a run ended before
    MIN_MEASURED_TOKENS."""
    plain = SpeculativeDecoder(target, None, max_new_tokens=MEASURE_TOKENS, compile=compile)
    drafted = SpeculativeDecoder(target, drafter, gamma="auto", max_new_tokens=MEASURE_TOKENS, compile=compile)
    best = {plain: 0.0, drafted: 0.0}
    outputs, tested, accepted = {}, 0, 0
    for _ in range(2):
        for decoder in (plain, drafted):
            outputs[decoder] = list(decoder.stream(prompt_ids))
            if len(outputs[decoder]) < MIN_MEASURED_TOKENS:
                return None, None, None, True
            best[decoder] = max(best[decoder], decoder.stats.tokens_per_s)
        tested, accepted = tested + drafted.stats.drafted, accepted + drafted.stats.accepted
    alpha = accepted / tested if tested else None
    return best[plain], best[drafted], alpha, outputs[plain] == outputs[drafted]


def _reason(weights: str, entry: dict, *, cached: bool) -> str:
    when = "measured earlier on this machine" if cached else "measured now, once"
    ratio = entry["self_draft"] / entry["plain"]
    if entry["pays"]:
        return f"SelfDraft({weights}): {ratio:.2f}x plain decoding's tokens/s ({when}; α {entry['alpha']:.2f})"
    if entry["alpha"] is None:
        return (f"plain decoding: SelfDraft({weights}) ran {ratio:.2f}x its tokens/s and γ auto drafted nothing "
                f"({when})")
    return (f"plain decoding: SelfDraft({weights}) ran {ratio:.2f}x its tokens/s, under the {PAYS:.2f}x it must "
            f"gain ({when})")
