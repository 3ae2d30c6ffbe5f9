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
    "MultiDraft": "specdec.drafters.tree",
}


def __getattr__(name: str):
    module = _CLASSES.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec.drafters' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

#: Names accepted by `make_drafter` and the CLI's --drafter.
DRAFTER_KINDS = ("draft", "prompt-lookup", "bigram", "layer-skip", "draft-tree", "multi-draft")

#: Options each kind accepts (make_drafter keyword -> CLI flag, for error messages).
_OPTIONS = {
    "draft": {},
    "prompt-lookup": {"ngram_max": "--ngram-max", "ngram_min": "--ngram-min"},
    "bigram": {"bigram_path": "--bigram"},
    "layer-skip": {"draft_layers": "--draft-layers"},
    "draft-tree": {"tree_top_k": "--tree-top-k", "tree_depth": "--tree-depth", "max_nodes": "--max-nodes"},
    "multi-draft": {"num_drafts": "--num-drafts", "replacement": "--replacement"},
}


def make_drafter(kind: str, target=None, draft=None, **options) -> Drafter:
    """Build a drafter by name.

    "draft": the separate `draft` model. "prompt-lookup": n-gram lookup (ngram_max=3, ngram_min=1).
    "draft-tree": an EAGLE-2-style token tree from `draft` (tree_top_k, tree_depth, max_nodes).
    "multi-draft": num_drafts sampled chains from `draft` as a tree (replacement=True: SpecInfer).
    "bigram": a bigram table loaded from bigram_path (a file saved by Bigram.save), or else built from the
    target's own one-token predictions (Bigram.from_model). "layer-skip": the target's first draft_layers
    decoder layers (default half of them). Options given as None are ignored; an option that does not apply
    to `kind` is an error.
    """
    from specdec.drafters.bigram import Bigram
    from specdec.drafters.draft_model import DraftModel
    from specdec.drafters.layer_skip import LayerSkip
    from specdec.drafters.prompt_lookup import PromptLookup
    from specdec.drafters.tree import DraftTree, MultiDraft

    if kind not in _OPTIONS:
        raise ConfigError(f"unknown drafter {kind!r}; choose one of: {', '.join(DRAFTER_KINDS)}")
    options = {k: v for k, v in options.items() if v is not None}
    for key in options:
        if key not in _OPTIONS[kind]:
            owners = [f"--drafter {k}" for k, opts in _OPTIONS.items() if key in opts]
            flag = next((opts[key] for opts in _OPTIONS.values() if key in opts), key)
            where = f"; it applies to {' / '.join(owners)}" if owners else ""
            raise ConfigError(f"option {flag} does not apply to --drafter {kind}{where}")
    if kind == "draft":
        if draft is None:
            raise ConfigError("--drafter draft needs a draft model: pass --draft PATH (or draft=model)")
        return DraftModel(draft)
    if kind in ("draft-tree", "multi-draft"):
        if draft is None:
            raise ConfigError(f"--drafter {kind} needs a draft model: pass --draft PATH (or draft=model)")
        if kind == "multi-draft":
            return MultiDraft(draft, num_drafts=options.get("num_drafts", 3),
                              replacement=options.get("replacement", True))
        tree = {"top_k": "tree_top_k", "depth": "tree_depth", "max_nodes": "max_nodes"}
        return DraftTree(draft, **{arg: options[key] for arg, key in tree.items() if key in options})
    if kind == "prompt-lookup":
        return PromptLookup(max_ngram=options.get("ngram_max", 3), min_ngram=options.get("ngram_min", 1))
    if kind == "bigram":
        if "bigram_path" in options:
            return Bigram.load(options["bigram_path"])
        if target is None:
            raise ConfigError("--drafter bigram needs the target (to build the table) or --bigram PATH")
        return Bigram.from_model(target)
    if target is None:
        raise ConfigError("--drafter layer-skip needs the target model (target=model)")
    return LayerSkip(target, num_layers=options.get("draft_layers"))


__all__ = [
    "DRAFTER_KINDS", "Bigram", "DraftModel", "DraftTree", "Drafter", "LayerSkip", "MultiDraft", "PromptLookup",
    "Proposal", "make_drafter",
]
