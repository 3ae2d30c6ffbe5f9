"""`specdec train`: train a Llama causal LM from scratch on the Python stdlib sources."""

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
            "tokenizer loadable with AutoModelForCausalLM/AutoTokenizer.from_pretrained(OUT)."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--out", required=True, help="run directory (checkpoints, token cache, final model)")
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
    add_loop_args(p, warmup_steps=50, weight_decay=0.1, eval_every=200,
                  eval_tokens_help="held-out tokens for periodic validation",
                  seed_help="seed for initialisation and data order")
    p.set_defaults(func=run)


def add_loop_args(p: argparse.ArgumentParser, *, warmup_steps: int, weight_decay: float, eval_every: int,
                  eval_tokens_help: str, seed_help: str) -> None:
    """Options of the shared optimisation loop (AdamW, schedule, evaluation, checkpoints, device)."""
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup-steps", type=int, default=warmup_steps, help="linear warm-up steps before cosine decay")
    p.add_argument("--schedule", choices=["cosine", "wsd"], default="cosine",
                   help="LR schedule after warm-up: cosine over the whole run, or constant then cosine over "
                        "the last --decay-steps (wsd; lets --resume change --steps before the decay starts)")
    p.add_argument("--decay-steps", type=int, default=0, help="length of the final decay with --schedule wsd")
    p.add_argument("--weight-decay", type=float, default=weight_decay, help="AdamW weight decay (matrices only)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--eval-every", type=int, default=eval_every, help="steps between held-out evaluations")
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

    from specdec.training.train import TrainConfig, train

    loop = loop_config(args)
    cfg = TrainConfig(
        out=Path(args.out), model=model_spec(args), loop=loop, batch_size=args.batch_size, seq_len=args.seq_len,
        device=args.device, tokenizer=args.tokenizer, eval_tokens=args.eval_tokens, save_dtype=args.save_dtype,
        resume=args.resume,
    )
    report = train(cfg)
    print(f"saved model to {args.out} (val loss {report['final']['val_loss']:.4f}, ppl {report['final']['val_ppl']:.2f})")
    return 0
