"""`specdec distill`: DistillSpec-style distillation of a draft model on a target's distributions."""

from __future__ import annotations

import argparse

from specdec.cli.train import DefaultsHelpFormatter, add_loop_args, loop_config


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `distill` subcommand."""
    p = subparsers.add_parser(
        "distill",
        help="distil a draft model towards a target model (better speculative acceptance)",
        description=(
            "Fine-tune --draft to match --target's next-token distributions on the stdlib train split "
            "(teacher forcing), minimising forward KL(target || draft) or TVD at --temperature. Reports "
            "the held-out acceptance proxy (T=0 argmax agreement, T=1 sum-min) before and after, and "
            "saves the distilled draft (16-bit safetensors + tokenizer) to --out."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--target", required=True, help="directory of the trained target model")
    p.add_argument("--draft", required=True, help="directory of the trained draft model (starting point; has the tokenizer)")
    p.add_argument("--out", required=True, help="run directory (checkpoints, token cache, distilled draft)")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature of both distributions in the loss")
    p.add_argument("--loss", choices=["fkl", "tvd"], default="fkl", help="forward KL(target||draft) or total variation")
    p.add_argument("--parallel", action="store_true",
                   help="PARD: add a mask token to the draft (unless it has one) and teach it to propose --max-gamma "
                        "tokens from one pass over --max-gamma - 1 masks; load the result with specdec.ParallelDraft "
                        "(--drafter parallel)")
    p.add_argument("--max-gamma", type=int, default=8, help="--parallel: tokens per block (the root's row + masks)")
    p.add_argument("--anchors", type=int, default=16, help="--parallel: mask blocks per training window")
    add_loop_args(p, warmup_steps=20, weight_decay=0.0, eval_every=250,
                  eval_tokens_help="held-out tokens for the acceptance proxy", seed_help="seed for the data order")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Handler of `specdec distill`."""
    from pathlib import Path

    from specdec.training.distill import DistillConfig, distill

    loop = loop_config(args)
    cfg = DistillConfig(
        target=Path(args.target), draft=Path(args.draft), out=Path(args.out), loop=loop, batch_size=args.batch_size,
        seq_len=args.seq_len, temperature=args.temperature, loss=args.loss, device=args.device,
        eval_tokens=args.eval_tokens, save_dtype=args.save_dtype, resume=args.resume, parallel=args.parallel,
        max_gamma=args.max_gamma, anchors=args.anchors,
    )
    report = distill(cfg)
    b, a = report["before"], report["after"]
    if args.parallel:
        print(f"block tau T=0 (teacher-forced): {b['block_tau_T0']:.3f} -> {a['block_tau_T0']:.3f}; per offset "
              "alpha T=0: " + ", ".join(f"{a[k]:.3f}" for k in sorted(a) if k.startswith("alpha_T0_")))
    else:
        print(f"alpha T=0: {b['alpha_T0']:.4f} -> {a['alpha_T0']:.4f}; alpha T=1: {b['alpha_T1']:.4f} -> "
              f"{a['alpha_T1']:.4f}")
    print(f"saved distilled draft to {args.out}")
    return 0
