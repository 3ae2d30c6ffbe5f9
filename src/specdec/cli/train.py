"""`specdec train`: train a Llama causal LM from scratch on the Python stdlib sources (the default pair's recipe),
or, with `--recipe seq2seq-pair`, one model of the shipped BART seq2seq pair (specdec.training.seq2seq_pair)."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only where there is a default to show (not on required options, not None) and the
    help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if (action.required or action.default is None or isinstance(action.default, bool)
                or "default" in (action.help or "")):
            return action.help or ""
        return super()._get_help_string(action)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `train` subcommand."""
    p = subparsers.add_parser(
        "train",
        help="train a small Llama model on the Python standard library sources",
        description=(
            "Train a LlamaForCausalLM from scratch on the .py files of the running Python's standard "
            "library (test packages excluded; ~3% of files held out by a hash of their path for "
            "validation). Writes checkpoints to --out and, at the end, a 16-bit safetensors model plus "
            "tokenizer loadable with AutoModelForCausalLM/AutoTokenizer.from_pretrained(OUT). With --recipe "
            "seq2seq-pair: one model (--only target|draft) of the shipped BART encoder-decoder pair, on denoising "
            "stdlib code, until a CPU budget is spent (see src/specdec/assets/seq2seq/CARD.md)."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--out", required=True, help="run directory (checkpoints, token cache, final model)")
    p.add_argument("--recipe", choices=RECIPES, default="llama",
                   help="llama: a Llama causal LM (the default pair); seq2seq-pair: one model of the shipped BART "
                        "seq2seq pair (its options below)")
    p.add_argument("--model-size", choices=["target", "draft"], default=None,
                   help="preset shape of the shipped default pair; explicit shape flags override its fields")
    p.add_argument("--hidden-size", type=int, default=None, help="model width")
    p.add_argument("--layers", type=int, default=None, help="number of decoder layers")
    p.add_argument("--heads", type=int, default=None, help="attention heads (hidden size / heads must be even)")
    p.add_argument("--intermediate-size", type=int, default=None, help="MLP inner width")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory to reuse; if it does not exist a tokenizer is trained there "
                        "(default: OUT/tokenizer)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    add_loop_args(p, warmup_steps=50, weight_decay=0.1, eval_every=None,
                  eval_tokens_help="held-out tokens for periodic validation",
                  seed_help="seed for initialisation and data order", lr=None,
                  lr_help="peak learning rate (AdamW) (default: 0.001; seq2seq-pair: 0.001 for the target, "
                          "0.0015 for the draft)",
                  eval_every_help="steps between held-out evaluations (default: 200; seq2seq-pair: 150)")
    g = p.add_argument_group(
        "--recipe seq2seq-pair (also --out, --batch-size, --lr, --eval-every; --threads default 1)")
    g.add_argument("--only", choices=["target", "draft"], default=None, help="the model of the pair to train")
    g.add_argument("--arch", choices=["t5", "bart"], default=None, help="architecture (default: bart)")
    g.add_argument("--mask-style", choices=["span", "aligned"], default=None,
                   help="span: one <mask> per masked span (BART's text infilling); aligned: one <mask> per masked "
                        "token, so the output lines up with the source position by position (default: aligned)")
    g.add_argument("--cpu-minutes", type=float, default=None,
                   help="train until this much process CPU time is spent (default: 15)")
    g.add_argument("--wall-minutes", type=float, default=None,
                   help="also stop after this much wall time (a shared, busy machine); the learning rate decays "
                        "with whichever budget runs out first")
    g.add_argument("--heldout-prompts", metavar="FILE",
                   help="write held-out sources (masked chunks) as bench JSONL prompts and exit (nothing trained)")
    g.add_argument("--num-prompts", type=int, default=None, help="prompts --heldout-prompts writes (default: 16)")
    p.set_defaults(func=run)


#: What `specdec train --recipe` trains.
RECIPES = ("llama", "seq2seq-pair")
#: Options of one recipe only (their defaults are None, so that giving one to the other recipe is refused).
_LLAMA_ONLY = ("model_size", "hidden_size", "layers", "heads", "intermediate_size", "tokenizer")
_SEQ2SEQ_ONLY = ("only", "arch", "mask_style", "cpu_minutes", "wall_minutes", "heldout_prompts", "num_prompts")


def add_loop_args(p: argparse.ArgumentParser, *, warmup_steps: int, weight_decay: float, eval_every: int | None,
                  eval_tokens_help: str, seed_help: str, lr: float | None = 1e-3,
                  lr_help: str = "peak learning rate (AdamW)",
                  eval_every_help: str = "steps between held-out evaluations") -> None:
    """Options of the shared optimisation loop (AdamW, schedule, evaluation, checkpoints, device). A default of
    None is the caller's to fill (and its help to state)."""
    p.add_argument("--lr", type=float, default=lr, help=lr_help)
    p.add_argument("--warmup-steps", type=int, default=warmup_steps, help="linear warm-up steps before cosine decay")
    p.add_argument("--schedule", choices=["cosine", "wsd"], default="cosine",
                   help="LR schedule after warm-up: cosine over the whole run, or constant then cosine over "
                        "the last --decay-steps (wsd; lets --resume change --steps before the decay starts)")
    p.add_argument("--decay-steps", type=int, default=0, help="length of the final decay with --schedule wsd")
    p.add_argument("--weight-decay", type=float, default=weight_decay, help="AdamW weight decay (matrices only)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--eval-every", type=int, default=eval_every, help=eval_every_help)
    p.add_argument("--eval-tokens", type=int, default=32768, help=eval_tokens_help)
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:0, ...")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default="float16",
                   help="dtype of the exported safetensors weights")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (same arguments)")


def loop_config(args: argparse.Namespace):
    """The LoopConfig from the options `add_loop_args` added (and --threads applied)."""
    import torch

    from specdec.training.loop import LoopConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    return LoopConfig(
        steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, seed=args.seed,
        schedule=args.schedule, decay_steps=args.decay_steps,
    )


def model_spec(args: argparse.Namespace):
    """The ModelSpec from --model-size and/or the explicit shape flags."""
    from specdec.errors import ConfigError
    from specdec.training.train import MODEL_SIZES, ModelSpec

    base = MODEL_SIZES[args.model_size] if args.model_size else None
    fields = {
        "hidden_size": args.hidden_size,
        "layers": args.layers,
        "heads": args.heads,
        "intermediate_size": args.intermediate_size,
    }
    if base is None and any(v is None for v in fields.values()):
        raise ConfigError(
            "give --model-size {target,draft}, or all of --hidden-size, --layers, --heads and --intermediate-size"
        )
    merged = {k: (v if v is not None else getattr(base, k)) for k, v in fields.items()}
    return ModelSpec(**merged)


def run(args: argparse.Namespace) -> int:
    """Handler of `specdec train`."""
    from pathlib import Path

    from specdec.errors import ConfigError

    other = _SEQ2SEQ_ONLY if args.recipe == "llama" else _LLAMA_ONLY
    given = [f"--{name.replace('_', '-')}" for name in other if getattr(args, name) is not None]
    if given:
        want = "seq2seq-pair" if args.recipe == "llama" else "llama"
        raise ConfigError(f"{', '.join(given)}: only for --recipe {want}; drop it, or train with --recipe {want}")
    if args.recipe == "seq2seq-pair":
        return run_seq2seq_pair(args)
    from specdec.training.train import TrainConfig, train

    args.lr = 1e-3 if args.lr is None else args.lr
    args.eval_every = 200 if args.eval_every is None else args.eval_every
    loop = loop_config(args)
    cfg = TrainConfig(
        out=Path(args.out), model=model_spec(args), loop=loop, batch_size=args.batch_size, seq_len=args.seq_len,
        device=args.device, tokenizer=args.tokenizer, eval_tokens=args.eval_tokens, save_dtype=args.save_dtype,
        resume=args.resume,
    )
    report = train(cfg)
    print(f"saved model to {args.out} (val loss {report['final']['val_loss']:.4f}, ppl {report['final']['val_ppl']:.2f})")
    return 0


def run_seq2seq_pair(args: argparse.Namespace) -> int:
    """`specdec train --recipe seq2seq-pair`: one model of the BART pair, or (--heldout-prompts) its bench prompts."""
    from pathlib import Path

    import torch

    from specdec.errors import ConfigError
    from specdec.training.seq2seq_pair import PairConfig, train_pair, write_heldout_prompts

    torch.set_num_threads(args.threads or 1)
    mask_style = args.mask_style or "aligned"
    if args.heldout_prompts:
        write_heldout_prompts(Path(args.heldout_prompts), args.num_prompts or 16, mask_style)
        return 0
    if args.only is None:
        raise ConfigError("--recipe seq2seq-pair trains one model at a time: give --only target or --only draft")
    cfg = PairConfig(out=Path(args.out), only=args.only,
                     cpu_minutes=15.0 if args.cpu_minutes is None else args.cpu_minutes,
                     wall_minutes=args.wall_minutes, arch=args.arch or "bart", mask_style=mask_style,
                     batch=args.batch_size, lr=args.lr, eval_every=150 if args.eval_every is None else args.eval_every)
    report = train_pair(cfg)
    print(f"saved {args.only} to {Path(args.out) / args.only} (held-out loss {report['heldout_loss']:.4f})")
    return 0
