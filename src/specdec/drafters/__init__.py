"""Drafters: every way of proposing tokens, behind one small interface (`Drafter`).

The classes are imported on first use, so the CLI can read `DRAFTER_KINDS` without loading torch.
"""

from __future__ import annotations

import importlib

from specdec.errors import ConfigError

_CLASSES = {
    "Drafter": "specdec.drafters.base",
    "Proposal": "specdec.drafters.base",
    "Bigram": "specdec.drafters.bigram",
    "DraftModel": "specdec.drafters.draft_model",
    "LayerSkip": "specdec.drafters.layer_skip",
    "PromptLookup": "specdec.drafters.prompt_lookup",
    "DraftTree": "specdec.drafters.tree",
    "MultiDraft": "specdec.drafters.multi_draft",
    "Eagle": "specdec.drafters.eagle",
    "Medusa": "specdec.drafters.medusa",
    "SelfDraft": "specdec.drafters.self_draft",
    "Mtp": "specdec.drafters.mtp",
    "SuffixDecoding": "specdec.drafters.suffix",
    "SuffixCache": "specdec.drafters.suffix",
    "BlockDraft": "specdec.drafters.block",
    "ParallelDraft": "specdec.drafters.parallel",
}


def __getattr__(name: str):
    module = _CLASSES.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec.drafters' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


#: Names accepted by `make_drafter` and the CLI's --drafter. "draft-tli" / "draft-slem": the draft model
#: with its own tokenizer (--draft-tokenizer), by token-level intersection or string-level exact match.
#: "multi-draft" is MultiDraft's default scheme (recursive rejection sampling); "multi-draft-specinfer" /
#: "multi-draft-spectr" pick the other two schemes (so `specdec bench` can run them side by side).
#: "draft-vocab" is the draft model drafting from a reduced vocabulary (`DraftModel(draft_vocab=...)`): by default
#: the DRAFT_VOCAB most frequent tokens of the default pair's training data. "mtp" / "mtp-tree": the target's own
#: multi-token-prediction layer (`Mtp`: DeepSeek-V3, GLM-4.5, GLM-4.7-Flash, Mellum targets), a chain or an
#: EAGLE-2 tree of EAGLE_TREE's shape. "suffix" is SuffixDecoding: trees from a suffix trie over the request and a
#: cache of earlier requests' outputs (one cache per drafter and its forks). "self-draft-int8" / "self-draft-int4" /
#: "self-draft-w4a8" / "self-draft-w8a8": the target's own weights quantized (SelfDraft).
DRAFTER_KINDS = ("draft", "prompt-lookup", "bigram", "layer-skip", "draft-tree", "multi-draft", "eagle", "eagle-chain",
                 "medusa", "medusa-chain", "draft-tli", "draft-slem", "multi-draft-specinfer", "multi-draft-spectr",
                 "eagle3", "eagle3-chain", "draft-vocab", "self-draft-int8", "self-draft-int4", "self-draft-w4a8",
                 "self-draft-w8a8", "mtp", "mtp-tree", "suffix", "dflash", "dflash-tree", "parallel")

#: Tokens the "draft-vocab" kind drafts from by default. On the default pair (8192 tokens) the 2048 most frequent
#: hold 98% of the target's greedy tokens on held-out code, and the draft's greedy agreement with the target fell
#: from 0.816 to 0.814 there, while its draft step got ~35% cheaper (BENCHMARKS.md, "A reduced draft vocabulary").
DRAFT_VOCAB = 2048

_TOKENIZERS = {"draft_tokenizer": "--draft-tokenizer", "target_tokenizer": "the target's tokenizer"}
#: A reduced draft vocabulary: its size or ids, and the tokenizer that ranks a size's tokens for a model that is
#: not of the default tokenizer (hub/frequency.py).
_VOCAB = {"draft_vocab": "--draft-vocab", "target_tokenizer": "the target's tokenizer"}

#: Options each kind accepts (make_drafter keyword -> CLI flag, for error messages).
DRAFTER_OPTIONS = {
    "draft": dict(_TOKENIZERS),
    "draft-vocab": _VOCAB,
    "draft-tli": dict(_TOKENIZERS),
    "draft-slem": dict(_TOKENIZERS),
    "prompt-lookup": {"ngram_max": "--ngram-max", "ngram_min": "--ngram-min", "lookup_branches": "--lookup-branches"},
    "bigram": {"bigram_path": "--bigram"},
    "layer-skip": {"draft_layers": "--draft-layers"},
    "self-draft-int8": _VOCAB,
    "self-draft-int4": _VOCAB,
    "self-draft-w4a8": _VOCAB,
    "self-draft-w8a8": _VOCAB,
    "draft-tree": {"tree_top_k": "--tree-top-k", "tree_depth": "--tree-depth", "max_nodes": "--max-nodes"},
    "multi-draft": {"num_drafts": "--num-drafts", "replacement": "--replacement", "scheme": "--scheme",
                    "widths": "--widths"},
    "multi-draft-specinfer": {"num_drafts": "--num-drafts", "widths": "--widths"},
    "multi-draft-spectr": {"num_drafts": "--num-drafts", "widths": "--widths"},
    "eagle": {"head_path": "--head"},
    "eagle-chain": {"head_path": "--head"},
    "eagle3": {"head_path": "--head"},
    "eagle3-chain": {"head_path": "--head"},
    "medusa": {"head_path": "--head"},
    "medusa-chain": {"head_path": "--head"},
    "mtp": {},
    "mtp-tree": {},
    "suffix": {"max_nodes": "--max-nodes", "tree_depth": "--tree-depth", "min_token_prob": "--min-token-prob",
               "max_spec_factor": "--max-spec-factor", "suffix_cache_tokens": "--suffix-cache-tokens"},
    "dflash": {"head_path": "--head"},
    "dflash-tree": {"head_path": "--head"},
    "parallel": {"parallel_draft": "parallel_draft= (a model or a directory)"},
}

#: EAGLE-2 tree shape used by the "eagle" kind (per level: expand the `top_k` best nodes; keep `max_nodes`).
#: Measured on the default pair (BENCHMARKS.md, Draft heads): a depth-3 tree beat depth 8 on both paths
#: (1.22x vs 0.91x plain HF generate compiled), and the chain at γ = 8 (Eagle's default depth) beat both.
EAGLE_TREE = {"top_k": 4, "depth": 3, "max_nodes": 24}

#: The tree the "dflash-tree" kind drafts from the block's per-position marginals.
DFLASH_TREE = {"top_k": 4, "max_nodes": 24}


def _head_drafter(kind: str, target, head_path) -> Drafter:
    """An Eagle / Medusa / BlockDraft drafter from a saved head, or the head shipped for the default target
    ("eagle3": the shipped EAGLE-3 head, drafting the same chain / tree as "eagle")."""
    from specdec.hub.default_pair import load_default_heads
    from specdec.drafters.block import BlockDraft
    from specdec.drafters.eagle import Eagle
    from specdec.drafters.medusa import DEFAULT_TREE, Medusa
    from specdec.heads import DFlashHead, EagleHead, MedusaHeads

    family = kind.split("-")[0]
    if head_path is not None:
        head = {"medusa": MedusaHeads, "dflash": DFlashHead}.get(family, EagleHead).load(head_path, target)
    else:
        heads = load_default_heads(target)  # IncompatibleModelsError unless target is the default one
        if family not in heads:
            from specdec.errors import ModelLoadError

            raise ModelLoadError(f"no {family} head is shipped for the default target; train one with "
                                 f"`specdec train-head --kind {family} --target default` and pass --head DIR")
        head = heads[family]
    chain = kind.endswith("-chain")
    if family == "dflash":
        return BlockDraft(target, head, **DFLASH_TREE) if kind.endswith("-tree") else BlockDraft(target, head)
    if family in ("eagle", "eagle3"):
        return Eagle(target, head) if chain else Eagle(target, head, **EAGLE_TREE)
    return Medusa(target, head) if chain else Medusa(target, head, tree=DEFAULT_TREE)


def _parallel_drafter(target, draft, parallel_draft=None) -> Drafter:
    """"parallel": `parallel_draft` (a model, or a directory saved by `specdec distill --parallel`), else the given
    draft when it carries a mask row (one row past the target's vocabulary), else the adapted draft shipped for the
    default pair."""
    from transformers import PreTrainedModel

    from specdec.drafters.parallel import ParallelDraft
    from specdec.runtime.causal_lm import vocab_size

    if target is None:
        raise ConfigError("--drafter parallel needs the target model (target=model)")
    if parallel_draft is not None:
        if isinstance(parallel_draft, PreTrainedModel):
            return ParallelDraft(parallel_draft)
        from specdec.hub.loading import load_model

        param = next(target.parameters())
        return ParallelDraft(load_model(parallel_draft, str(param.device), param.dtype))
    if draft is not None and vocab_size(draft) == vocab_size(target) + 1:
        return ParallelDraft(draft)
    from specdec.hub.default_pair import load_default_parallel

    return ParallelDraft(load_default_parallel(target))


def _draft_vocab_ids(model, draft_vocab, tokenizer=None):
    """draft_vocab as token ids. An int N names N most frequent tokens: the default pair's (its training data's
    ranking) for a model of the default tokenizer's width, else those of `tokenizer` (the model's own) in offline
    text (hub/frequency.py). Anything else is taken as the ids themselves."""
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int):
        return draft_vocab
    from specdec.hub.default_pair import assets_present, frequent_tokens, token_ranking
    from specdec.runtime.causal_lm import vocab_size

    width, ranked = vocab_size(model), len(token_ranking()) if assets_present() else None
    if width == ranked:
        return frequent_tokens(draft_vocab)
    if tokenizer is None:
        rows = f"{width} token rows" + (f", not the default tokenizer's {ranked}" if ranked else "")
        raise ConfigError(f"--draft-vocab {draft_vocab} ranks the model's own tokenizer's tokens when the model is not "
                          f"of the default tokenizer ({rows}): pass target_tokenizer=tokenizer, or the ids "
                          "themselves (draft_vocab=specdec.frequent_tokens(tokenizer, N, texts=...))")
    from specdec.hub.frequency import frequent_tokens as offline_frequent_tokens

    if len(tokenizer) > width:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model only {width} token rows: "
                          "pass the model's own tokenizer")
    return offline_frequent_tokens(tokenizer, draft_vocab)


def make_drafter(kind: str, target=None, draft=None, **options) -> Drafter:
    """Build a drafter by name.

    "draft": the separate `draft` model. "prompt-lookup": n-gram lookup (ngram_max=3, ngram_min=1).
    "prompt-lookup" with lookup_branches=k proposes the continuations of k earlier matches as a tree.
    "draft-tree": an EAGLE-2-style token tree from `draft` (tree_top_k, tree_depth, max_nodes).
    "multi-draft": num_drafts sampled chains from `draft` as a tree (scheme "rrs" / "specinfer" / "spectr",
    or replacement=True: SpecInfer; widths: children per node by level).
    "draft-tli" / "draft-slem": the draft model with its own tokenizer (draft_tokenizer, and the target's
    target_tokenizer); "draft" with both tokenizers picks the method itself (same tokenizer: plain).
    "draft-vocab": the draft model drafting from a reduced vocabulary (FR-Spec): draft_vocab = N, the N most
    frequent tokens (default DRAFT_VOCAB) of the default pair's training data, or for a model of another tokenizer
    those of target_tokenizer in offline text (specdec.frequent_tokens); or a sequence of token ids.
    "suffix": SuffixDecoding (max_nodes, tree_depth, min_token_prob, max_spec_factor), its cache of earlier requests
    holding at most suffix_cache_tokens tokens (its forks, e.g. a server's rows, share that one cache).
    "dflash" / "dflash-tree": a DFlash block head (head_path, or the one shipped for the default target) drafting
    a chain / a tree from one pass. "parallel": a PARD draft (`draft` when it carries the mask row, else the
    adapted draft shipped for the default pair).
    "bigram": a bigram table loaded from bigram_path (a file saved by Bigram.save), or else built from the
    target's own one-token predictions (Bigram.from_model). "layer-skip": the target's first draft_layers
    decoder layers (default half of them). "self-draft-int8" / "self-draft-int4" / "self-draft-w4a8" /
    "self-draft-w8a8": the target's own weights quantized (SelfDraft; with draft_vocab, over those tokens as
    "draft-vocab" reads it). "mtp" / "mtp-tree": the target's own MTP
    layer, read from the checkpoint the target was loaded from (a chain, or an EAGLE_TREE-shaped tree). Options
    given as None are ignored; an option that does not apply to `kind` is an error.
    """
    from specdec.drafters.bigram import Bigram
    from specdec.drafters.draft_model import DraftModel
    from specdec.drafters.layer_skip import LayerSkip
    from specdec.drafters.prompt_lookup import PromptLookup
    from specdec.drafters.multi_draft import MultiDraft
    from specdec.drafters.tree import DraftTree

    if kind not in DRAFTER_OPTIONS:
        raise ConfigError(f"unknown drafter {kind!r}; choose one of: {', '.join(DRAFTER_KINDS)}")
    options = {k: v for k, v in options.items() if v is not None}
    for key in options:
        if key not in DRAFTER_OPTIONS[kind]:
            owners = [f"--drafter {k}" for k, opts in DRAFTER_OPTIONS.items() if key in opts]
            flag = next((opts[key] for opts in DRAFTER_OPTIONS.values() if key in opts), key)
            where = f"; it applies to {' / '.join(owners)}" if owners else ""
            raise ConfigError(f"option {flag} does not apply to --drafter {kind}{where}")
    if kind in ("draft", "draft-tli", "draft-slem"):
        if draft is None:
            raise ConfigError(f"--drafter {kind} needs a draft model: pass --draft PATH (or draft=model)")
        if kind == "draft" and "draft_tokenizer" not in options:
            return DraftModel(draft)
        if "draft_tokenizer" not in options or "target_tokenizer" not in options:
            raise ConfigError(f"--drafter {kind} needs the draft's tokenizer (--draft-tokenizer PATH) and the "
                              "target's (draft_tokenizer=..., target_tokenizer=...)")
        method = {"draft": "auto", "draft-tli": "tli", "draft-slem": "slem"}[kind]
        return DraftModel(draft, tokenizer=options["draft_tokenizer"], target_tokenizer=options["target_tokenizer"],
                          method=method)
    if kind == "draft-vocab":
        if draft is None:
            raise ConfigError("--drafter draft-vocab needs a draft model: pass --draft PATH (or draft=model)")
        return DraftModel(draft, draft_vocab=_draft_vocab_ids(draft, options.get("draft_vocab", DRAFT_VOCAB),
                                                              options.get("target_tokenizer")))
    if kind in ("multi-draft-specinfer", "multi-draft-spectr"):
        if draft is None:
            raise ConfigError(f"--drafter {kind} needs a draft model: pass --draft PATH (or draft=model)")
        return MultiDraft(draft, num_drafts=options.get("num_drafts", 2), scheme=kind.rsplit("-", 1)[1],
                          widths=options.get("widths"))
    if kind in ("draft-tree", "multi-draft"):
        if draft is None:
            raise ConfigError(f"--drafter {kind} needs a draft model: pass --draft PATH (or draft=model)")
        if kind == "multi-draft":
            return MultiDraft(draft, num_drafts=options.get("num_drafts", 2), replacement=options.get("replacement"),
                              scheme=options.get("scheme"), widths=options.get("widths"))
        tree = {"top_k": "tree_top_k", "depth": "tree_depth", "max_nodes": "max_nodes"}
        return DraftTree(draft, **{arg: options[key] for arg, key in tree.items() if key in options})
    if kind == "prompt-lookup":
        return PromptLookup(max_ngram=options.get("ngram_max", 3), min_ngram=options.get("ngram_min", 1),
                            branches=options.get("lookup_branches", 1))
    if kind == "suffix":
        from specdec.drafters.suffix import DEFAULT_CACHE_TOKENS, SuffixCache, SuffixDecoding

        names = {"max_nodes": "max_nodes", "tree_depth": "max_depth", "min_token_prob": "min_token_prob",
                 "max_spec_factor": "max_spec_factor"}
        cache = SuffixCache(max_tokens=options.get("suffix_cache_tokens", DEFAULT_CACHE_TOKENS))
        return SuffixDecoding(cache=cache, **{arg: options[key] for key, arg in names.items() if key in options})
    if kind == "bigram":
        if "bigram_path" in options:
            return Bigram.load(options["bigram_path"])
        if target is None:
            raise ConfigError("--drafter bigram needs the target (to build the table) or --bigram PATH")
        return Bigram.from_model(target)
    if target is None:
        raise ConfigError(f"--drafter {kind} needs the target model (target=model)")
    if kind in ("eagle", "eagle-chain", "eagle3", "eagle3-chain", "medusa", "medusa-chain", "dflash", "dflash-tree"):
        return _head_drafter(kind, target, options.get("head_path"))
    if kind.startswith("self-draft-"):
        from specdec.drafters.self_draft import SelfDraft

        draft_vocab = options.get("draft_vocab")  # none: the whole vocabulary
        return SelfDraft(target, weights=kind.rsplit("-", 1)[1],
                         draft_vocab=None if draft_vocab is None else _draft_vocab_ids(
                             target, draft_vocab, options.get("target_tokenizer")))
    if kind in ("mtp", "mtp-tree"):
        from specdec.drafters.mtp import Mtp

        return Mtp(target) if kind == "mtp" else Mtp(target, **EAGLE_TREE)
    if kind == "parallel":
        return _parallel_drafter(target, draft, options.get("parallel_draft"))
    return LayerSkip(target, num_layers=options.get("draft_layers"))


__all__ = [
    "DRAFTER_KINDS", "Bigram", "BlockDraft", "DraftModel", "DraftTree", "Drafter", "Eagle", "LayerSkip", "Medusa",
    "Mtp", "MultiDraft", "ParallelDraft", "PromptLookup", "Proposal", "SelfDraft", "SuffixCache", "SuffixDecoding",
    "make_drafter",
]
