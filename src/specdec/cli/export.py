"""`specdec export`: write a trained head in the layout vLLM or SGLang loads."""

from __future__ import annotations

import argparse

from specdec.cli.train import DefaultsHelpFormatter


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `export` subcommand."""
    p = subparsers.add_parser(
        "export",
        help="write an EAGLE / Medusa head in the checkpoint layout vLLM or SGLang loads",
        description=(
            "Write --head (a directory saved by `specdec train-head`, or 'default' for the head shipped with "
            "the default target) as config.json + model.safetensors with the key names and config each "
            "engine's loader expects. The export is written to a temporary directory, then renamed to --out."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--format", required=True, choices=["vllm-eagle", "sglang-eagle", "eagle3", "vllm-medusa"],
                   help="target engine layout")
    p.add_argument("--head", required=True, help="head directory, or 'default' (the shipped head of that kind)")
    p.add_argument("--target", default="default", help="the head's target model directory, or 'default'")
    p.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Handler of `specdec export`."""
    import json
    from pathlib import Path

    from specdec.hub.default_pair import ASSETS_DIR, HEAD_DIRS
    from specdec.errors import ModelLoadError
    from specdec.heads import EagleHead, MedusaHeads
    from specdec.heads.export import export_head

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
