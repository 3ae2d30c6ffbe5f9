"""Every decoding method in the project, for the greedy-equality and statistical exactness suites.

Adding a drafter or verification scheme to both suites is one line here: a name and a factory
`(target, draft) -> Drafter | None` (None = plain decoding through the same loop), or
`(target, draft) -> (Drafter, {decoder options})` for a method that also sets options such as gamma="auto".

The fast path (slot KV cache) runs in both suites uncompiled (compile="static": the same code minus
torch.compile, cheap to run everywhere); tests/test_fastpath.py runs it compiled on a few shapes.
"""

from __future__ import annotations

import specdec
import specdec.drafters.medusa

METHODS = {
    "plain": lambda target, draft: None,
    "draft-model": lambda target, draft: specdec.DraftModel(draft),
    "draft-model-auto-gamma": lambda target, draft: (specdec.DraftModel(draft), {"gamma": "auto"}),
    "prompt-lookup": lambda target, draft: specdec.PromptLookup(max_ngram=3, min_ngram=1),
    "prompt-lookup-branches": lambda target, draft: specdec.PromptLookup(max_ngram=3, min_ngram=1, branches=3),
    "bigram": lambda target, draft: specdec.Bigram.from_model(target),
    "layer-skip": lambda target, draft: specdec.LayerSkip(target),  # first half of the target's layers
    "draft-tree": lambda target, draft: specdec.DraftTree(draft, top_k=3, depth=4, max_nodes=8),
    "multi-draft": lambda target, draft: specdec.MultiDraft(draft, num_drafts=3, replacement=True),
    "multi-draft-norepl": lambda target, draft: specdec.MultiDraft(draft, num_drafts=3, replacement=False),
    "multi-draft-spectr": lambda target, draft: specdec.MultiDraft(draft, num_drafts=3, scheme="spectr"),
    "multi-draft-widths": lambda target, draft: specdec.MultiDraft(draft, widths=(2, 2), scheme="rrs"),
    "draft-tree-auto": lambda target, draft: specdec.DraftTree(draft, top_k=3, depth=4, max_nodes="auto"),
    "plain-static": lambda target, draft: (None, {"compile": "static"}),
    "draft-tree-static": lambda target, draft: (specdec.DraftTree(draft, top_k=2, depth=2, max_nodes=4),
                                                {"compile": "static"}),
    "draft-model-static": lambda target, draft: (specdec.DraftModel(draft), {"compile": "static"}),
    # A reduced draft vocabulary (FR-Spec): the draft's LM head keeps 2 tokens in 3, q is its softmax over them.
    "draft-model-vocab": lambda target, draft: specdec.DraftModel(draft, draft_vocab=_two_in_three(draft)),
    "draft-model-vocab-static": lambda target, draft: (specdec.DraftModel(draft, draft_vocab=_two_in_three(draft)),
                                                       {"compile": "static"}),
    # Untrained heads (exactness does not depend on training); they read the target's own features.
    # EAGLE-2 dynamic tree and Medusa static tree (point-mass children).
    "eagle": lambda target, draft: specdec.Eagle(target, specdec.EagleHead.init(target, seed=0), top_k=2, depth=4,
                                                 max_nodes=8),
    # The same head on the fast path: slot cache and one fixed-shape drafting round (uncompiled here).
    "eagle-static": lambda target, draft: (
        specdec.Eagle(target, specdec.EagleHead.init(target, seed=0), top_k=2, depth=4, max_nodes=8),
        {"compile": "static"}),
    # EAGLE-3: fused low/mid/high features (the target's hidden-state indices), own norm, and a reduced draft
    # vocabulary (-inf outside it). Its fast-path round is checked against this eager one in test_heads.py.
    "eagle3": lambda target, draft: specdec.Eagle(target, reduced_eagle3(target), top_k=2, depth=4, max_nodes=8),
    "medusa": lambda target, draft: specdec.Medusa(target, specdec.MedusaHeads.init(target, num_heads=4, seed=0),
                                                   tree=specdec.drafters.medusa.DEFAULT_TREE),
    # The target's own weights quantized (int4: the farthest from the target); its fast path and int8:
    # tests/test_quantize.py (the same drafter, other kernels).
    "self-draft": lambda target, draft: specdec.SelfDraft(target, weights="int4", group=8),
    # On the slot cache it drafts in the target's cache: the target's keys and values of the committed tokens.
    "self-draft-static": lambda target, draft: (specdec.SelfDraft(target, weights="int4", group=8),
                                                {"compile": "static"}),
    # Model-free trees from a suffix trie over the request and a cache of earlier requests' outputs.
    "suffix": lambda target, draft: suffix_drafter(),
    # The same on the slot cache: its node budgets are verification shapes, the padded rows filled with nodes.
    "suffix-static": lambda target, draft: (suffix_drafter(), {"compile": "static"}),
    # A DFlash block head (untrained): γ per-position marginals from one pass, sampled at T > 0 (q = each one's
    # warped marginal). Its top-k tree on the fast path's fixed-shape round: tests/test_block_drafters.py (against
    # the eager round; a tree of point masses verifies through the same rule as the draft tree's).
    "dflash": lambda target, draft: specdec.BlockDraft(target, specdec.DFlashHead.init(target, seed=0, block_size=6)),
    # PARD: the draft with a mask row appended (untrained), γ marginals from one pass over γ - 1 masks (its fast
    # path is the draft model's adapter, as draft-model-static; test_block_drafters.py checks it proposes the same).
    "parallel": lambda target, draft: specdec.ParallelDraft(specdec.ParallelDraft.adapt(draft)),
}

#: Methods whose head needs a Llama-style decoder layer (separate q/k/v, rotary positions): GPT-2 is refused.
LLAMA_STYLE_ONLY = ("eagle3", "dflash")


#: Earlier "requests" in the suffix cache of the registry's SuffixDecoding: continuations of the statistical
#: suite's prompt [1, 2, 1, 1, 2] that disagree, so its trees branch (and the cache, matching 5 tokens, outbids
#: the request's own 2-token match).
SUFFIX_HISTORY = ([1, 2, 0], [1, 2, 0], [1, 2, 0], [1, 2, 0], [1, 1, 3], [0, 4, 4])


def suffix_drafter(cls=None):
    """A SuffixDecoding (or subclass `cls`) whose cache holds SUFFIX_HISTORY after the suite's prompt."""
    from specdec.drafters.suffix import SuffixCache

    cache = SuffixCache(depth=16)
    for key, tail in enumerate(SUFFIX_HISTORY):
        cache.store(("history", key), [1, 2, 1, 1, 2, *tail])
    return (cls or specdec.SuffixDecoding)(max_nodes=6, max_depth=4, cache=cache)


def _two_in_three(draft):
    """A draft vocabulary of every token id but each third one."""
    return [i for i in range(draft.get_output_embeddings().out_features) if i % 3]


def reduced_eagle3(target):
    """An untrained EAGLE-3 head drafting from the lower half of the target's vocabulary only."""
    head = specdec.EagleHead.init(target, seed=0, variant="eagle3")
    return head.with_draft_vocab(target, range(target.get_output_embeddings().out_features // 2))


#: Methods for encoder-decoder targets (T5, BART, Marian, Whisper): tests/test_seq2seq.py runs each one in the
#: greedy-equality and the statistical suites. A factory (target, draft) -> Drafter | None, as METHODS.
SEQ2SEQ_METHODS = {
    "plain": lambda target, draft: None,
    "draft-model": lambda target, draft: specdec.DraftModel(draft),
    "prompt-lookup": lambda target, draft: specdec.PromptLookup(max_ngram=3, min_ngram=1),  # context + source
}


#: Token trees and heads on an encoder-decoder target whose decoder takes each token's position (Whisper's
#: decoder_position_ids; T5, BART and Marian refuse trees, docs/seq2seq.md): tests/test_seq2seq.py runs each
#: one in the greedy-equality suite and those in SEQ2SEQ_TREE_STATISTICAL in the statistical suite.
SEQ2SEQ_TREE_METHODS = {
    "draft-tree": lambda target, draft: specdec.DraftTree(draft, top_k=2, depth=3, max_nodes=5),
    "multi-draft": lambda target, draft: specdec.MultiDraft(draft, num_drafts=2),
    "prompt-lookup-branches": lambda target, draft: specdec.PromptLookup(max_ngram=2, min_ngram=1, branches=3),
    "medusa-chain": lambda target, draft: specdec.Medusa(target, specdec.MedusaHeads.init(target, num_heads=3)),
    "medusa": lambda target, draft: specdec.Medusa(target, specdec.MedusaHeads.init(target, num_heads=3),
                                                   tree=((0,), (1,), (0, 0), (1, 0), (0, 0, 0))),
}
#: One statistical check (CI time): MultiDraft's sampled tree exercises tree passes and commits on target and
#: draft and q rows; DraftTree's and Medusa's point-mass trees go through the same passes (greedy suite).
SEQ2SEQ_TREE_STATISTICAL = ("multi-draft",)


#: Drafters that read the target's own multi-token-prediction layer (`specdec.Mtp`). They need a target of an MTP
#: family, so tests/test_mtp.py builds one of each family it supports (`models.tiny_mtp`: a tiny random config
#: saved with MTP weights in the release's layout, loaded back) and runs every entry here in its greedy-identity
#: suite (float64, against transformers' greedy generate) and its batching tests, and those in MTP_STATISTICAL
#: in the statistical suite. A factory target -> Drafter, or -> (Drafter, {decoder options}), as METHODS.
MTP_METHODS = {
    "mtp": lambda target: specdec.Mtp(target),  # a chain: the layer's argmax at T = 0, sampled from warped q at T > 0
    "mtp-tree": lambda target: specdec.Mtp(target, top_k=2, depth=3, max_nodes=6),  # EAGLE-2 tree, point masses
    "mtp-static": lambda target: (specdec.Mtp(target), {"compile": "static"}),  # the target on its slot cache
}
#: One statistical check each, at its own level (test_mtp.py): the chain, whose drafts carry the MTP layer's
#: warped q. The tree's nodes are point masses, verified by the tree rule every tree method's checks cover; its
#: proposals are checked against a greedy reference and in the greedy suite (each check costs minutes on a busy CPU).
MTP_STATISTICAL = ("mtp",)

#: The METHODS entries tests/test_cuda.py checks at T > 0 with their models on a GPU (one check each): a chain, a
#: token tree, a multi-draft tree and the slot cache; the greedy suite there runs every entry.
DEVICE_STATISTICAL = ("draft-model", "draft-tree", "multi-draft", "draft-model-static")

#: The weight formats tests/test_quantize.py checks at T > 0 (one check each): a target and its draft on packed
#: weights, int8 and int4 (float32 arithmetic: a sum over each group's integers, then its scale), w4a8 and w8a8
#: (integer, on int8 activations).
QUANTIZED_STATISTICAL = ("int8", "int4", "w4a8", "w8a8")


def build_mtp(name: str, target):
    """(drafter, extra decoder options) for MTP_METHODS entry `name`."""
    built = MTP_METHODS[name](target)
    if isinstance(built, tuple):
        return built[0], dict(built[1])
    return built, {}


def build(name: str, target, draft):
    """(drafter or None, extra decoder options) for registry entry `name`."""
    built = METHODS[name](target, draft)
    if isinstance(built, tuple):
        return built[0], dict(built[1])
    return built, {}


#: Drafts with another tokenizer (tests/test_cross_vocab.py): a factory (draft, draft_tokenizer,
#: target_tokenizer) -> Drafter, one line per method.
CROSS_VOCAB_METHODS = {
    "draft-tli": lambda draft, dt, tt: specdec.DraftModel(draft, tokenizer=dt, target_tokenizer=tt, method="tli"),
    "draft-slem": lambda draft, dt, tt: specdec.DraftModel(draft, tokenizer=dt, target_tokenizer=tt, method="slem"),
    "draft-auto": lambda draft, dt, tt: specdec.DraftModel(draft, tokenizer=dt, target_tokenizer=tt),
}


def build_cross_vocab(name: str, draft, draft_tokenizer, target_tokenizer):
    return CROSS_VOCAB_METHODS[name](draft, draft_tokenizer, target_tokenizer)
