"""Which drafter may draft for which target: one rule each, for a lone request and a batch's rows alike.

- the drafter is a `Drafter`;
- its vocabulary is the target's (`Drafter.match_target_vocab`: equal widths, or LM-head padding of one
  tokenizer, or a cross-vocabulary draft bound to both tokenizers);
- an encoder-decoder target gets a drafter that takes its encoder inputs, and trees only where its decoder
  takes positions;
- over a batch's rows the drafter runs in the batched form its capabilities declare.
"""

from __future__ import annotations

from specdec.drafters.base import BatchSetting, Drafter, RowDrafters
from specdec.errors import ConfigError, IncompatibleModelsError, PromptError, UnsupportedModelError
from specdec.runtime.seq2seq_lm import is_encoder_decoder, tree_unsupported_reason


def check_drafter(drafter: object, target_vocab_size: int) -> Drafter | None:
    """`drafter` (None: plain decoding) bound to a target whose logits are `target_vocab_size` wide."""
    if drafter is None:
        return None
    if not isinstance(drafter, Drafter):
        raise ConfigError(
            f"drafter must be a specdec Drafter (e.g. specdec.DraftModel(model)), got {type(drafter).__name__}"
        )
    if not drafter.match_target_vocab(target_vocab_size):
        raise IncompatibleModelsError(
            f"the drafter's vocabulary has {drafter.vocab_size} tokens but the target's has "
            f"{target_vocab_size} (more than LM-head padding explains); speculative decoding "
            "needs the same tokenizer, or both tokenizers to translate between them: pass "
            "specdec.DraftModel(draft, tokenizer=draft_tokenizer, target_tokenizer=target_tokenizer) "
            "(CLI: --draft-tokenizer), pick a draft model from the target's family, or a model-free "
            "drafter (specdec.PromptLookup)"
        )
    return drafter


def batched_form(drafter: Drafter | None, setting: BatchSetting | None = None) -> RowDrafters | None:
    """The drafter over a batch's rows, as its capabilities declare it (ConfigError where they declare none), for
    a batch whose passes run as `setting` says."""
    if drafter is None:
        return None
    batched = drafter.capabilities.batched
    if batched is None:
        raise ConfigError(
            f"{drafter.name} cannot be batched (its capabilities name no batched form); batched decoding "
            "supports DraftModel, LayerSkip, DraftTree, MultiDraft, Eagle, Medusa, PromptLookup and Bigram: use "
            "one of them, or specdec.generate for one request at a time"
        )
    return batched(drafter, setting=setting or BatchSetting())


def check_encoder_pairing(target: object, drafter: Drafter | None, encoder_inputs: object) -> object:
    """Encoder inputs go with an encoder-decoder target only (`target`: its adapter), and its drafter must take
    them. Returns the encoder inputs (None for a decoder-only target)."""
    seq2seq = is_encoder_decoder(target.model)
    capabilities = drafter.capabilities if drafter is not None else None
    if not seq2seq:
        if encoder_inputs is not None:
            raise ConfigError(
                f"encoder_inputs was given but the target {type(target.model).__name__} is a decoder-only model "
                "with no encoder; put the whole text in prompt_ids, or load an encoder-decoder target "
                "(AutoModelForSeq2SeqLM / AutoModelForSpeechSeq2Seq)"
            )
        if drafter is not None and capabilities.encoder_decoder:
            raise IncompatibleModelsError(
                "the draft is an encoder-decoder model but the target is decoder-only; pair a decoder-only "
                "draft with it (or use an encoder-decoder target of the draft's family)"
            )
        return None
    if encoder_inputs is None:
        raise PromptError(
            f"{type(target.model).__name__} is an encoder-decoder model: pass what its encoder reads, "
            f"encoder_inputs={{'{target.main_input}': ...}} (e.g. dict(tokenizer(source_text)), or a feature "
            "extractor's output for Whisper); prompt_ids is the decoder prompt (None = the start token)"
        )
    if drafter is not None and capabilities.encoder_decoder is False:
        raise IncompatibleModelsError(
            "the draft is a decoder-only model but the target is an encoder-decoder model, and a decoder-only "
            "draft cannot see the source; load the draft as an encoder-decoder model of the target's family "
            "(AutoModelForSeq2SeqLM, e.g. t5-small for t5-large), or use specdec.PromptLookup"
        )
    if drafter is not None and not capabilities.accepts_encoder_inputs and capabilities.needs_hidden:
        raise UnsupportedModelError(
            f"{type(drafter).__name__}'s head is one decoder layer of the target's family fed the target's "
            f"features, and {type(target.model).__name__}'s decoder layers also cross-attend to the encoder "
            "output, which the head does not model; use specdec.Medusa (its heads read only the decoder's last "
            "hidden state), specdec.DraftModel or specdec.PromptLookup with this target"
        )
    if drafter is not None and not capabilities.accepts_encoder_inputs:
        raise IncompatibleModelsError(
            f"{type(drafter).__name__} cannot draft for an encoder-decoder target; use specdec.DraftModel with a "
            "smaller encoder-decoder draft of the same vocabulary, or specdec.PromptLookup (it also copies from "
            "the source)"
        )
    reason = tree_unsupported_reason(target.model)
    if drafter is not None and capabilities.tree and reason is not None:
        raise UnsupportedModelError(
            f"{drafter.name} drafts token trees, but {reason}; draft chains for this target (specdec.DraftModel, "
            "specdec.PromptLookup with branches=1, specdec.Medusa without tree=), or use a decoder that takes "
            "decoder_position_ids (Whisper)"
        )
    return encoder_inputs
