"""`specdec generate`: stream a continuation of a prompt, then one stats line."""

from __future__ import annotations

import argparse
import sys


def add_decoding_args(parser: argparse.ArgumentParser) -> None:
    """Sampling and speculation options shared by generate, demo, verify and bench."""
    parser.add_argument("--gamma", default=None,
                        help="draft tokens per round: an integer >= 1, or 'auto' to adapt it (default 4; for "
                        "--drafter draft-tree the tree's depth, which an explicit --gamma caps)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default off)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (default off)")
    parser.add_argument("--seed", type=int, default=None, help="random seed; same seed + inputs = same output")


def add_draft_tokenizer_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-tokenizer", default=None, metavar="PATH",
                        help="the draft model's tokenizer when it is not the target's (default: the one saved "
                        "with --draft, if any); a different one drafts by token-level intersection or string "
                        "match (--drafter draft-tli / draft-slem; 'draft' picks)")


def draft_tokenizer(args, target_tokenizer):
    """The draft's tokenizer: --draft-tokenizer, else the one saved with --draft (None if absent or the same
    vocabulary as the target's)."""
    from specdec.hub.vocab import same_vocabulary

    found = _draft_tokenizer_found(args)
    if found is None:
        return None
    if target_tokenizer is not None and same_vocabulary(found, target_tokenizer):
        return None if getattr(args, "draft_tokenizer", None) is None else found
    return found


def _draft_tokenizer_found(args):
    """--draft-tokenizer loaded, else the tokenizer saved with --draft, else None."""
    from specdec.errors import ModelLoadError
    from specdec.hub.loading import load_tokenizer

    path = getattr(args, "draft_tokenizer", None)
    if path is not None:
        return load_tokenizer(path)
    if getattr(args, "draft", None):
        try:
            return load_tokenizer(args.draft)
        except ModelLoadError:  # a draft saved without a tokenizer: assume the target's
            return None
    return None


#: Drafters that run the draft model without translating tokens (token trees from it).
TREE_DRAFT_KINDS = ("draft-tree", "multi-draft", "multi-draft-specinfer", "multi-draft-spectr")


def vocab_tokenizer_options(kind: str | None, target_tokenizer) -> dict:
    """make_drafter's tokenizer for a reduced draft vocabulary (--drafter draft-vocab, self-draft-*): the
    target's, which ranks --draft-vocab N's tokens when the model is not of the default tokenizer."""
    from specdec.drafters import DRAFTER_OPTIONS

    return {"target_tokenizer": target_tokenizer} if "draft_vocab" in DRAFTER_OPTIONS.get(kind, {}) else {}


def draft_tokenizer_options(args, kind: str, target_tokenizer) -> dict:
    """make_drafter's tokenizer options for --drafter `kind`: the draft's own tokenizer (--draft-tokenizer, else
    the one saved with --draft) and the target's, when the draft drafts across tokenizers. A refusal names flags."""
    from specdec.errors import ConfigError

    if kind not in ("draft", "draft-tli", "draft-slem"):
        if kind in TREE_DRAFT_KINDS and getattr(args, "draft", None):  # they draft with the draft model, untranslated
            from specdec.hub.tokenizer_check import check_draft_tokenizer

            check_draft_tokenizer(target_tokenizer, _draft_tokenizer_found(args), target_name="the target",
                                  draft_name=args.draft, fix=f"--drafter {kind} needs a draft with the target's "
                                  "tokenizer (only --drafter draft, draft-tli and draft-slem translate)")
        return {}
    found = draft_tokenizer(args, target_tokenizer)
    if found is None and kind != "draft":
        saved = _draft_tokenizer_found(args)
        why = ("the draft's tokenizer is the target's" if saved is not None else
               f"no tokenizer is saved with --draft {args.draft}" if getattr(args, "draft", None) else
               "the shipped draft uses the target's tokenizer")
        raise ConfigError(f"--drafter {kind} drafts across tokenizers, but {why}; pass --draft-tokenizer PATH "
                          "with the draft's own tokenizer, or use --drafter draft")
    return {} if found is None else {"draft_tokenizer": found, "target_tokenizer": target_tokenizer}


def drafter_choices(*extra: str) -> dict:
    """argparse keywords for --drafter: every kind is accepted, but the eagle3 kinds are listed only where an
    EAGLE-3 head is shipped for the default target (elsewhere they need --head DIR)."""
    from pathlib import Path

    from specdec.drafters import DRAFTER_KINDS

    # specdec.hub.default_pair.HEAD_DIRS["eagle3"], without importing torch for --help
    eagle3 = (Path(__file__).resolve().parents[1] / "assets" / "default" / "eagle3" / "config.json").is_file()
    kinds = (*extra, *DRAFTER_KINDS)
    return {"choices": kinds, "metavar": "{" + ",".join(k for k in kinds if eagle3 or not k.startswith("eagle3")) + "}"}


def parse_gamma(value: str | None) -> int | str | None:
    if value is None:  # the decoder's default: 4, or a tree drafter's own depth
        return None
    return value if value == "auto" else int(value) if value.lstrip("-").isdigit() else value


def register(subparsers) -> None:
    from specdec.runtime.threads import add_threads_arg

    parser = subparsers.add_parser(
        "generate",
        help="continue a prompt with speculative (or plain) decoding",
        description="Continue PROMPT with the target model, drafting with --drafter; the output is "
        "distributed exactly as the target's own (token-identical at temperature 0). Streams the text, then "
        "prints α (acceptance rate), τ (tokens per target pass), tokens/s and target forwards.",
    )
    parser.add_argument("--target", help="target model: local path or hub id (default: the shipped pair; "
                        "'default-seq2seq': the shipped encoder-decoder pair, its draft included)")
    parser.add_argument("--draft", help="draft model path or hub id (its own tokenizer, if it differs from the "
                        "target's, is translated: see --draft-tokenizer)")
    add_draft_tokenizer_arg(parser)
    parser.add_argument("--drafter", **drafter_choices("plain", "auto"), default=None,
                        help="how to draft: 'draft' = the draft model (the default when --draft is given or "
                        "when the shipped pair is used, i.e. no --target); 'auto' = the target's own weights "
                        "quantized to w4a8 (SelfDraft, γ auto) where that measures faster than plain decoding on "
                        "this machine (measured once per model on its first prompt, then cached; the default with "
                        "--target and no --draft), else plain; 'plain' = no drafting (plain "
                        "decoding through the same loop); 'prompt-lookup' = n-gram matches in the prompt and "
                        "output; 'suffix' = SuffixDecoding, token trees from a suffix trie of the prompt and output "
                        "(docs/suffix.md); 'bigram' = a bigram table (--bigram, or built from the target); 'layer-skip' = "
                        "the target's first --draft-layers layers; 'draft-tree' / 'multi-draft' = token trees "
                        "from the draft model ('multi-draft-specinfer' / '-spectr': other sampling schemes); "
                        "'eagle' / 'medusa' = draft heads on the target's features (a tree; "
                        "'-chain' for one branch), --head or the heads shipped for the default target "
                        "('eagle3' / 'eagle3-chain': an EAGLE-3 head, --head DIR where none is shipped); "
                        "'draft-tli' / 'draft-slem' = a draft with another tokenizer; 'draft-vocab' = the draft "
                        "model drafting from its --draft-vocab most frequent tokens (a cheaper draft step); 'mtp' / "
                        "'mtp-tree' = the target's own multi-token-prediction layer (DeepSeek-V3, GLM-4.5, "
                        "GLM-4.7-Flash, Mellum), a chain or a tree; "
                        "'dflash' / 'dflash-tree' = a DFlash block head on the target's features, γ tokens from one "
                        "pass (--head, or the one shipped for the default target); 'parallel' = a PARD draft, γ "
                        "tokens from one pass over γ-1 mask tokens (--draft DIR adapted by `specdec distill "
                        "--parallel`, else the one shipped for the default pair)")
    parser.add_argument("--ngram-max", type=int, default=None,
                        help="prompt-lookup: longest n-gram matched (default 3)")
    parser.add_argument("--ngram-min", type=int, default=None,
                        help="prompt-lookup: shortest n-gram matched (default 1)")
    parser.add_argument("--draft-layers", type=int, default=None, metavar="K",
                        help="layer-skip: draft with the target's first K decoder layers (default half)")
    parser.add_argument("--bigram", default=None, metavar="PATH",
                        help="bigram: a table saved with specdec.Bigram.save (default: built from the target)")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="draft-vocab, self-draft-*: draft from the N most frequent tokens (the default pair's "
                             "training data; another model's tokenizer ranks its own in offline text) "
                             "(draft-vocab's default 2048; the self-drafts' the whole vocabulary)")
    parser.add_argument("--head", default=None, metavar="DIR",
                        help="eagle / medusa / dflash: a head saved by `specdec train-head` (default: the shipped one)")
    parser.add_argument("--prompt", required=True, help="the text to continue (an encoder-decoder target such as "
                        "T5: the source text its encoder reads)")
    add_decoding_args(parser)
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", default="auto",
                        help="model dtype: auto (bfloat16 where this machine computes it natively, measured once; "
                             "else float32), float32, bfloat16, float16, float64, checkpoint (the weights' own)")
    add_weights_arg(parser)
    add_threads_arg(parser)
    parser.add_argument("--compile", action="store_true",
                        help="the fast path: slot KV cache and compiled passes for target and draft model (the "
                        "first run of each shape compiles, then inductor's disk cache makes later starts "
                        "quick; same tokens; see docs/fastpath.md)")
    parser.set_defaults(func=run)


def add_weights_arg(parser) -> None:
    """--weights, for the commands that load models with `load(weights=...)` (generate, serve, verify)."""
    parser.add_argument("--weights", default=None, choices=("float32", "bfloat16", "int8", "int4", "w4a8", "w8a8"),
                        help="the target's (and draft model's) linear layers on packed weights of this format, on "
                        "specdec's CPU kernels: int8 / int4 quantize them (weight-only), w4a8 / w8a8 are int4 / int8 "
                        "on int8 activations (integer arithmetic, as llama.cpp's Q4_0 / Q8_0), bfloat16 halves the "
                        "bytes of a float32 model (default: the models' own layers; docs/quantization.md)")


def load_models(args):
    """(target, draft or None, tokenizer) from --target/--draft, or the default pair.

    Checks --device and --threads first.
    """
    import specdec
    from specdec.hub.default_pair import DEFAULT_SEQ2SEQ
    from specdec.hub.loading import check_device, load, load_model
    from specdec.runtime.threads import apply_threads

    check_device(args.device)
    apply_threads(args)
    weights = args.weights
    if weights and not str(args.device).startswith("cpu"):
        from specdec.errors import ConfigError

        raise ConfigError(f"--weights {weights} runs on specdec's CPU kernels only; use --device cpu")
    if args.target is None:
        from specdec.hub.loading import resolve_dtype

        dtype = resolve_dtype(getattr(args, "dtype", None), args.device)
        target, draft, tokenizer = specdec.load_default(
            device=args.device, **({} if dtype == "auto" else {"dtype": dtype}))
    elif args.target == DEFAULT_SEQ2SEQ and args.draft is None:  # the shipped seq2seq pair, draft included
        target, draft, tokenizer = specdec.load_default_seq2seq(device=args.device)
    else:  # packed as they are read where the checkpoint allows it (hub/streamed.py)
        target, tokenizer = load(args.target, args.device, args.dtype, weights)
        draft = None
    if args.draft is not None:  # its own tokenizer, if another, is translated (draft_tokenizer_options)
        draft = load_model(args.draft, args.device, args.dtype, weights)
    if weights and (args.target is None or args.target == DEFAULT_SEQ2SEQ):  # a shipped pair, loaded in float
        from specdec.runtime.weights import pack_model

        target = pack_model(target, weights)
        draft = pack_model(draft, weights) if draft is not None and args.draft is None else draft
    return target, draft, tokenizer


def choose_drafter(target, prompt_ids, args) -> tuple[object, str | None]:
    """--drafter auto: (the target's SelfDraft, its kind) where it measures faster than plain decoding on this
    machine (measured once, on this prompt, then cached), else (None, None); the choice is said on stderr."""
    from specdec.engine.self_draft_choice import choose_self_draft

    choice = choose_self_draft(target, prompt_ids, compile=args.compile)
    print(f"[specdec] {choice.reason}", file=sys.stderr)
    return choice.drafter, None if choice.drafter is None else f"self-draft-{choice.drafter.weights}"


def run(args) -> int:
    from dataclasses import replace

    from specdec.engine.decoding import SpeculativeDecoder
    from specdec.engine.options import DecodeOptions
    from specdec.hub.default_pair import DEFAULT_SEQ2SEQ
    from specdec.drafters import make_drafter
    from specdec.engine.text import detokenize, text_request
    from specdec.runtime.threads import decode_threads

    request = DecodeOptions(gamma=parse_gamma(args.gamma), max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    target, draft, tokenizer = load_models(args)
    shipped = args.target is None or args.target == DEFAULT_SEQ2SEQ  # a shipped pair: its draft by default
    # A target with no draft: its own quantized copy where that measures faster (engine/self_draft_choice.py).
    kind = args.drafter or ("draft" if args.draft or (shipped and draft is not None) else "auto")
    kind = None if kind == "plain" else kind
    options = {"ngram_max": args.ngram_max, "ngram_min": args.ngram_min, "draft_layers": args.draft_layers,
               "bigram_path": args.bigram, "head_path": args.head, "draft_vocab": args.draft_vocab}
    options.update(draft_tokenizer_options(args, kind, tokenizer))
    options.update(vocab_tokenizer_options(kind, tokenizer))
    if kind in (None, "auto") and any(v is not None for v in options.values()):
        from specdec.errors import ConfigError

        raise ConfigError("drafter options (--ngram-max, --ngram-min, --draft-layers, --bigram, --head, "
                          "--draft-vocab) need --drafter with a kind that takes them")
    # An encoder-decoder target (T5, BART, Marian) reads the prompt with its encoder.
    prompt_ids, encoder_inputs = text_request(target, tokenizer, args.prompt)
    if kind == "auto":
        drafter, kind = choose_drafter(target, prompt_ids, args)
        request = request if request.gamma is not None or drafter is None else replace(request, gamma="auto")
    else:
        drafter = make_drafter(kind, target=target, draft=draft, **options) if kind else None
    decoder = SpeculativeDecoder(target, drafter, options=request, compile=args.compile,
                                 encoder_inputs=encoder_inputs)
    if args.compile:
        import logging

        logging.getLogger("specdec.fastpath").setLevel(logging.INFO)  # say when a shape compiles
        if not logging.getLogger().handlers:
            logging.basicConfig(format="[specdec] %(message)s", stream=sys.stderr)
    for piece in detokenize(tokenizer, decoder.stream(prompt_ids)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    s = decoder.stats
    default = drafter.capabilities.default_gamma if drafter is not None else None
    gamma = request.gamma if request.gamma is not None else default or 4
    method = f"{kind} (γ={gamma})" if kind else "plain"
    threads = decode_threads(decoder.target.model)
    # Compiling (first use of each fast-path shape) is reported apart, never averaged into the speed.
    compiled = f" (compile {s.compile_s:.1f} s, not counted)" if s.compile_s > 0 else ""
    print(
        f"\n[{method}] α={s.acceptance_rate:.3f} τ={s.mean_accepted_tokens:.2f} "
        f"{s.tokens_per_s:.1f} tokens/s{compiled}, {s.new_tokens} tokens, {s.target_forwards} target forwards, "
        f"{threads} thread{'s' * (threads > 1)}",
        file=sys.stderr,
    )
    return 0
