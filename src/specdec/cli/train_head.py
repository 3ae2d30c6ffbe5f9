"""`specdec train-head`: train an EAGLE head or Medusa heads on a frozen target's own features."""

from __future__ import annotations

import argparse

from specdec.cli.train import DefaultsHelpFormatter, add_loop_args, loop_config


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `train-head` subcommand."""
    p = subparsers.add_parser(
        "train-head",
        help="train an EAGLE head or Medusa heads for a target (drafters that read the target's features)",
        description=(
            "Train a draft head on the frozen --target's last hidden states (output_hidden_states): an EAGLE "
            "head (one decoder layer of the target's family; feature regression + soft labels, unrolled on its "
            "own features) or Medusa heads (residual blocks predicting t+2..t+k+1). Reports the held-out loss "
            "and the teacher-forced acceptance proxy per draft depth; saves OUT/head (config.json + "
            "model.safetensors), loadable with specdec.EagleHead.load / specdec.MedusaHeads.load."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--kind", choices=["eagle", "eagle3", "medusa", "dflash"], required=True,
                   help="which head to train (eagle3: EAGLE-3, fused low/mid/high target features, token loss; "
                        "dflash: a DFlash block drafter, γ masked positions filled in one pass)")
    p.add_argument("--feature-layers", default=None,
                   help="eagle3 / dflash: comma-separated hidden-state indices of the fused features (input of that "
                        "layer); default eagle3: EAGLE-3's (2, N//2, N-3), the high one moved to N-1 on shallow "
                        "targets; dflash: three spread over the depth, the deepest the final state")
    p.add_argument("--target", default="default",
                   help="target model directory or hub id, or 'default' for the shipped default target")
    p.add_argument("--out", required=True, help="run directory (checkpoints, token cache, report, OUT/head)")
    p.add_argument("--data", default=None,
                   help="a .txt file (documents separated by blank lines) or .jsonl file with a \"text\" field; "
                        "default: the Python stdlib corpus")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="EAGLE: passes per step (1 teacher-forced + unrolls on the head's own features)")
    p.add_argument("--num-heads", type=int, default=4, help="Medusa: number of heads (tokens drafted per round)")
    p.add_argument("--init", default=None,
                   help="start from a saved head directory ('default': the head shipped for the default target) "
                        "instead of a fresh one")
    p.add_argument("--noise", type=float, default=0.2, help="EAGLE: uniform noise on input features (x their RMS)")
    p.add_argument("--block-size", type=int, default=16,
                   help="dflash: the longest block it is trained for (root + masked positions; γ <= block size - 1)")
    p.add_argument("--draft-layers", type=int, default=1, help="dflash: decoder layers of the head")
    p.add_argument("--anchors", type=int, default=16, help="dflash: blocks per training window")
    p.add_argument("--decay", type=float, default=None,
                   help="dflash: position decay of the loss, weight exp(-(j-1)/decay) (default 7 for 16-row blocks)")
    p.add_argument("--self-distill", type=int, default=0,
                   help="dflash: windows of the target's own greedy continuations of train-split prompts to generate "
                        "(cached in OUT/cache) and train on beside the text; 0: text only")
    p.add_argument("--self-distill-share", type=float, default=0.5,
                   help="dflash: share of each batch drawn from the self-distillation windows")
    p.add_argument("--prompt-len", type=int, default=128,
                   help="dflash: prompt tokens of each self-distillation window (the rest is the continuation)")
    add_loop_args(p, warmup_steps=30, weight_decay=0.0, eval_every=100,
                  eval_tokens_help="held-out tokens for the loss and acceptance proxy", seed_help="seed (init, data order)")
    p.set_defaults(func=run, eval_tokens=16384)


def run(args: argparse.Namespace) -> int:
    """Handler of `specdec train-head`."""
    from pathlib import Path

    from specdec.training.heads import HeadTrainConfig, train_head

    from specdec.errors import ConfigError

    loop = loop_config(args)
    layers = None
    if args.feature_layers is not None:
        if args.kind not in ("eagle3", "dflash"):
            raise ConfigError("--feature-layers applies to --kind eagle3 and dflash only; drop it")
        try:
            layers = tuple(int(x) for x in args.feature_layers.split(","))
        except ValueError as exc:
            raise ConfigError(f"--feature-layers must be comma-separated integers such as 2,3,5, got "
                              f"{args.feature_layers!r}") from exc
    if args.target == "default":
        import specdec

        target, _, tokenizer = specdec.load_default()
    else:
        from specdec.hub.loading import load

        target, tokenizer = load(args.target, "cpu", "float32")
    cfg = HeadTrainConfig(
        kind=args.kind, out=Path(args.out), loop=loop, data=args.data, batch_size=args.batch_size,
        seq_len=args.seq_len, ttt_steps=args.ttt_steps, num_heads=args.num_heads, noise=args.noise,
        feature_layers=layers, device=args.device, eval_tokens=args.eval_tokens, save_dtype=args.save_dtype, resume=args.resume, init=args.init,
        block_size=args.block_size, draft_layers=args.draft_layers, anchors=args.anchors, decay=args.decay,
        self_distill=args.self_distill, self_distill_share=args.self_distill_share, prompt_len=args.prompt_len,
    )
    report = train_head(cfg, target, tokenizer)
    final = report["final"]
    print("held-out: " + ", ".join(f"{k}={v:.4f}" for k, v in final.items()))
    print(f"CPU minutes: {report['cpu_minutes']:.1f}; saved {args.out}/head")
    return 0
