"""Refuse a draft whose tokenizer differs from the target's, where both tokenizers are at hand (`specdec serve`,
which batches drafts with the target's tokenizer only; `generate`, `verify` and `bench` translate instead).

Same-size vocabularies from different tokenizers pass the decoder's vocabulary-size check, but token id i
then means different text to the two models: every draft is rejected and speculation only costs time.
"""

from __future__ import annotations

from typing import Any

from specdec.errors import IncompatibleModelsError


def same_tokenizer(a: Any, b: Any) -> bool:
    """True when the two tokenizers map the same strings to the same ids (same vocabulary, same specials)."""
    if a is b:
        return True
    return a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids


#: What a refusal tells the user to do (`specdec serve` batches drafts with the target's tokenizer only).
FIX = "use a draft with the target's tokenizer, or pass --draft-tokenizer to draft across tokenizers"


def check_draft_tokenizer(target_tokenizer: Any, draft_tokenizer: Any, *, target_name: str, draft_name: str,
                          fix: str = FIX) -> None:
    """Raise IncompatibleModelsError when the draft's tokenizer is not the target's."""
    if draft_tokenizer is None or target_tokenizer is None or same_tokenizer(target_tokenizer, draft_tokenizer):
        return
    sizes = (len(target_tokenizer), len(draft_tokenizer))
    size_note = f"both have {sizes[0]} tokens, but " if sizes[0] == sizes[1] else f"{sizes[0]} vs {sizes[1]} tokens; "
    raise IncompatibleModelsError(
        f"the draft {draft_name!r} uses a different tokenizer from the target {target_name!r} ({size_note}the "
        f"same id means different text), so its drafts would be rejected; {fix}"
    )


def check_draft_tokenizer_at(target_tokenizer: Any, draft_path: str, *, target_name: str, fix: str = FIX) -> None:
    """Load the tokenizer stored with the draft model at `draft_path`, if any, and compare it (none: no check)."""
    from specdec.errors import ModelLoadError
    from specdec.hub.loading import load_tokenizer

    try:
        draft_tokenizer = load_tokenizer(draft_path)
    except ModelLoadError:
        return  # the draft ships no tokenizer: nothing to compare with
    check_draft_tokenizer(target_tokenizer, draft_tokenizer, target_name=target_name, draft_name=str(draft_path),
                          fix=fix)
