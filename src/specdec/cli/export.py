"""`specdec export`: write a trained head in the layout vLLM or SGLang loads, or everything `vllm serve` needs."""

from __future__ import annotations

import argparse

from specdec.cli.train import DefaultsHelpFormatter


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `export` subcommand."""
    p = subparsers.add_parser(
        "export",
        help="write an EAGLE / Medusa head in the checkpoint layout vLLM or SGLang loads, or a bundle vllm serve runs",
        description=(
            "Write --head (a directory saved by `specdec train-head`, or 'default' for the head shipped with "
            "the default target) as config.json + model.safetensors with the key names and config each "
            "engine's loader expects. --format vllm writes what `vllm serve` needs instead: the target and the "
            "drafter (--drafter: the draft model or a head in vLLM's layout), each with its tokenizer, and "
            "speculative_config.json; then prints the one command that serves them. The export is written to a "
            "temporary directory, then renamed to --out."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--format", required=True,
                   choices=["vllm-eagle", "sglang-eagle", "eagle3", "vllm-medusa", "vllm"],
                   help="target engine layout (vllm: a bundle for `vllm serve`)")
    p.add_argument("--head", default=None,
                   help="head directory, or 'default' (the shipped head of that kind); required by the head formats")
    p.add_argument("--target", default="default", help="the head's target model directory, or 'default'")
    p.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    vllm = p.add_argument_group("--format vllm")
    vllm.add_argument("--drafter", default="draft", choices=["draft", "eagle", "eagle3", "medusa", "suffix", "none"],
                      help="what vLLM drafts with: the --draft model, or --head (default: the shipped head) in "
                      "vLLM's layout; suffix: vLLM's suffix decoding (no model); none: plain serving")
    vllm.add_argument("--draft", default="default", help="the draft model directory, or 'default'")
    vllm.add_argument("--gamma", type=int, default=None,
                      help="drafts per round (num_speculative_tokens; default 4, and for suffix decoding the most "
                      "it may draft, 24: vLLM's default)")
    vllm.add_argument("--vllm-env", default=None, metavar="DIR",
                      help="the vLLM environment the printed command runs from (default: $SPECDEC_VLLM_ENV, else "
                      "~/.cache/specdec/vllm-env; `specdec bench --vllm-setup` creates it)")
    vllm.add_argument("--port", type=int, default=8000, help="the port in the printed command")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Handler of `specdec export`."""
    import json
    from pathlib import Path

    from specdec.hub.default_pair import ASSETS_DIR, HEAD_DIRS
    from specdec.errors import ModelLoadError
    from specdec.heads import EagleHead, MedusaHeads
    from specdec.heads.export import export_head

    if args.format == "vllm":
        return _vllm_bundle(args)
    if args.head is None:
        from specdec.errors import ConfigError

        raise ConfigError(f"--format {args.format} writes a head: pass --head DIR (or --head default)")
    kind = {"vllm-medusa": "medusa", "eagle3": "eagle3"}.get(args.format, "eagle")
    path = ASSETS_DIR / HEAD_DIRS[kind] if args.head == "default" else Path(args.head)
    if args.head == "default" and not (path / "config.json").is_file():
        raise ModelLoadError(f"no {kind} head is shipped for the default target ({path} is missing); train one with "
                             f"`specdec train-head --kind {kind} --target default` and pass --head DIR")
    if args.target == "default":
        import specdec

        target, _, _ = specdec.load_default()
    else:
        from specdec.hub.loading import load_model

        target = load_model(args.target, "cpu", "float32")
    try:
        saved_kind = json.loads((path / "config.json").read_text()).get("kind")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a head directory ({exc}); pass a directory from `specdec train-head`") from exc
    head = (EagleHead if saved_kind == "eagle" else MedusaHeads).load(path, target)
    out = export_head(head, args.format, args.out, target=target)
    print(f"wrote {args.format} export of {path} to {out}")
    return 0


def _vllm_bundle(args: argparse.Namespace) -> int:
    """`--format vllm`: the bundle, then the command that serves it."""
    import shlex

    from specdec.bench.vllm_env import default_vllm_env, run_environment, serve_command
    from specdec.hub.vllm_bundle import write_vllm_bundle

    drafter = None if args.drafter == "none" else args.drafter
    bundle = write_vllm_bundle(args.out, drafter=drafter, target=args.target, draft=args.draft,
                               head=args.head or "default", gamma=args.gamma)
    env_dir = args.vllm_env or default_vllm_env()
    variables = run_environment(env_dir, threads=None)
    command = serve_command(env_dir, bundle.target, bundle.speculative_config, port=args.port)
    print(f"wrote a vLLM bundle to {bundle.path}: target {bundle.target}"
          + (f", {args.drafter} {bundle.drafter}" if bundle.drafter else "") + ", speculative_config.json")
    print("serve it with vLLM's CPU build (environment: `specdec bench --vllm-setup`):")
    print(" ".join(["env", *(f"{k}={shlex.quote(v)}" for k, v in variables.items()), *map(shlex.quote, command)]))
    return 0
