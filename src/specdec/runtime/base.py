"""What every model adapter offers the decode loop (the eager `CachedCausalLM` and any compiled one)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from specdec.errors import NumericalError
from specdec.runtime.rowwise import all_finite

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdec.core.tree import TreeMask


@dataclass(frozen=True)
class Scores:
    """One scoring pass: logits [M, V] and, when asked, hidden states (rows as logits): with hidden=True the
    final ones [M, H]; with hidden=(i, j, ...) those layers' outputs side by side [M, len * H]."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


def select_hidden(hidden_states: tuple[torch.Tensor, ...], hidden: bool | tuple[int, ...],
                  rows: bool = False) -> torch.Tensor | None:
    """The features a `hidden=` request asks for, from HF's output_hidden_states of one pass ([B, M, H] each;
    index 0 = the embeddings, -1 = the final, normed state): None, the final state [M, H] (True), or the
    given indices' states concatenated [M, len * H] (a tuple, e.g. EAGLE-3's low / mid / high layers); of the
    first row (a batch of one), or with rows=True of every row ([B, M, H], [B, M, len * H])."""
    if not hidden:
        return None
    layers = [hidden_states[-1]] if hidden is True else [hidden_states[i] for i in hidden]
    if not rows:
        layers = [layer[0] for layer in layers]
    return layers[0] if len(layers) == 1 else torch.cat(layers, dim=-1)


def as_float_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits as sampling and verification read them: float32 or float64 kept, anything narrower upcast to float32."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def numerical_error(model: object, where: str) -> NumericalError:
    """The error for NaN or infinite logits from `model`; `where` says which ("at positions 3..7")."""
    return NumericalError(
        f"{type(model).__name__} produced NaN or infinite logits {where}; this usually means float16 overflow or "
        "broken weights: load the model in float32 or bfloat16")


def check_finite(logits: torch.Tensor, model: object, where: str) -> None:
    """Raise `numerical_error(model, where)` unless every logit is finite (one host sync; `rowwise.all_finite`'s
    one read where the kernels are loaded)."""
    if not all_finite(logits):
        raise numerical_error(model, where)


def cache_kwarg(model: object, cache: object) -> dict[str, object]:
    """`cache` as the keyword `model`'s forward takes it: `cache` from transformers 5.24 on (where the old name
    `past_key_values` warns), `past_key_values` before, and in model classes written for the old name."""
    if torch.compiler.is_compiling():  # traced once per compile; a memo read here would become a guard
        return {_cache_name(type(model)): cache}
    name = _CACHE_NAMES.get(type(model))
    if name is None:
        name = _CACHE_NAMES[type(model)] = _cache_name(type(model))
    return {name: cache}


_CACHE_NAMES: dict[type, str] = {}


def _cache_name(model_class: type) -> str:
    try:
        parameters = inspect.signature(model_class.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


@runtime_checkable
class ModelAdapter(Protocol):
    """One request's model and the KV cache it owns (`CachedCausalLM`, `StaticCausalLM`, `CachedSeq2SeqLM`): what the
    decode loop calls on a lone request's target, through `engine.targets.OneRow`. `length` tokens are cached."""

    model: PreTrainedModel
    vocab_size: int
    device: torch.device
    length: int
    forwards: int  # decoding passes (score and forward) since reset; prefill not counted
    forward_s: float
    prefill_s: float
    #: The longest sequence the model's positions allow (None: unbounded or unknown).
    context_limit: int | None
    #: Slots of a preallocated cache (None: the cache grows).
    capacity: int | None
    #: Does `score_and_verify` verify a chain at T > 0 inside the target's own (compiled) pass?
    verifies_in_graph: bool

    def prepare(self, tokens: int, buckets: tuple[int, ...]) -> None:
        """Before a request: room for `tokens` cache slots, and the widths its passes are padded to (a fixed-shape
        cache; a growing one ignores both). Raises a PromptError before any work if the request cannot fit."""

    def reset(self, **encoder: object) -> None:
        """Start a request (an encoder-decoder adapter runs its encoder on `encoder_inputs=` here)."""

    def prefill(self, input_ids: torch.Tensor, hidden: bool | tuple[int, ...] = False) -> torch.Tensor | None:
        """Cache input_ids [n]; return their hidden states [n, H] when asked."""

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append input_ids [n]; return logits [n or 1, V]."""

    def score(self, input_ids: torch.Tensor, *, tree: TreeMask | None = None,
              hidden: bool | tuple[int, ...] = False) -> Scores:
        """Append input_ids [M] at slots length..length+M−1 (a chain, or a tree: row 0 the root)."""

    def supports_tree(self, num_rows: int, warn: bool = True) -> bool:
        """Can a tree of `num_rows` rows (root included) be scored in one pass now?"""

    def crop(self, length: int) -> None:
        """Roll the cache back to its first `length` tokens."""

    def commit(self, start: int, keep: torch.Tensor) -> None:
        """Keep rows keep [k] (increasing, relative to `start`) of the last score at slots start..start+k−1."""

    def precompile(self, sizes, *, verify=None) -> None:
        """Compile now the passes of `sizes` rows (verifying passes for the sampling config `verify`), so that no
        round compiles; a no-op for an eager adapter."""
