"""What `vllm serve` needs to serve a specdec pair or head: `specdec export --format vllm`.

    bundle = write_vllm_bundle("exports/vllm", drafter="eagle", head="default", gamma=4)
    bundle.speculative_config  # {"method": "eagle", "model": ".../eagle", "num_speculative_tokens": 4}

The bundle directory holds `target/` (the target checkpoint with its tokenizer beside config.json: vLLM loads
both from one directory), the drafter's directory (`draft/` for a draft model, with the tokenizer too, or the
head exported in vLLM's layout: `eagle/` (`--format vllm-eagle`), `eagle3/`, `medusa/` (`vllm-medusa`); none
for `suffix`, vLLM's model-free suffix decoding, which needs the arctic-inference package in vLLM's
environment), and `speculative_config.json`, the JSON `vllm serve --speculative-config` takes, with absolute
paths. The whole bundle is written to a temporary directory and renamed into place.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import ConfigError, ModelLoadError

#: Drafters a bundle can carry -> vLLM's speculative method and the head export format ("draft": a model;
#: "suffix": nothing to export).
DRAFTERS = {"draft": ("draft_model", None), "eagle": ("eagle", "vllm-eagle"), "eagle3": ("eagle3", "eagle3"),
            "medusa": ("medusa", "vllm-medusa"), "suffix": ("suffix", None)}
#: num_speculative_tokens unless told: γ for a drafter's chain; for suffix decoding, which drafts as many tokens
#: as its match earns, the most it may draft (vLLM's own default, its suffix tree depth).
DEFAULT_GAMMA, SUFFIX_MAX_TOKENS = 4, 24
#: Tokenizer files copied beside a checkpoint's config.json when its directory has none.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model")
#: Files of a checkpoint directory copied into the bundle.
CHECKPOINT_SUFFIXES = (".json", ".safetensors", ".jinja", ".txt", ".model")
SPEC_FILE = "speculative_config.json"


@dataclass(frozen=True)
class VLLMBundle:
    """A written bundle: its directory, the target's and drafter's directories, vLLM's speculative config."""

    path: Path
    target: Path
    drafter: Path | None
    speculative_config: dict | None

    def as_dict(self) -> dict:
        return {"path": str(self.path), "target": str(self.target),
                "drafter": str(self.drafter) if self.drafter is not None else None,
                "speculative_config": self.speculative_config}


def copy_checkpoint(source: Path, out: Path, tokenizer_dir: Path | None) -> Path:
    """Copy the checkpoint in `source` to `out`, with the tokenizer files of `tokenizer_dir` when `source` has
    no tokenizer of its own."""
    if not (source / "config.json").is_file():
        raise ModelLoadError(f"{source} is not a checkpoint directory (no config.json); pass a local Hugging Face "
                             "checkpoint directory")
    out.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix in CHECKPOINT_SUFFIXES:
            shutil.copy2(path, out / path.name)
    if not (out / "tokenizer.json").is_file() and not (out / "tokenizer.model").is_file():
        if tokenizer_dir is None:
            raise ModelLoadError(f"{source} has no tokenizer files and vLLM loads the tokenizer from the model's "
                                 "directory: pass a checkpoint saved with its tokenizer")
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, out / name)
    return out


def speculative_config(drafter: str, gamma: int | None = None, model: str | Path | None = None) -> dict:
    """vLLM's `speculative_config` for `drafter` (a key of DRAFTERS) with γ = `gamma` (None: DEFAULT_GAMMA, or
    SUFFIX_MAX_TOKENS for suffix decoding), drafting with the checkpoint in `model` where the method has one."""
    return {"method": DRAFTERS[drafter][0], **({"model": str(model)} if model is not None else {}),
            "num_speculative_tokens": _gamma(drafter, gamma)}


def _gamma(drafter: str | None, gamma: int | None) -> int:
    """`gamma`, or its default for `drafter`; a ConfigError below 1."""
    if gamma is None:
        gamma = SUFFIX_MAX_TOKENS if drafter == "suffix" else DEFAULT_GAMMA
    if gamma < 1:
        raise ConfigError(f"--gamma must be >= 1 (vLLM's num_speculative_tokens), got {gamma}")
    return gamma


def write_vllm_bundle(out: str | Path, *, drafter: str | None = "draft", target: str | Path = "default",
                      draft: str | Path = "default", head: str | Path = "default",
                      gamma: int | None = None) -> VLLMBundle:
    """Write the bundle for `target` (a checkpoint directory or "default") drafted by `drafter` (a key of
    DRAFTERS, or None for plain serving): the `draft` checkpoint for "draft", suffix decoding for "suffix", else
    `head` (a `specdec train-head` directory or "default") exported in vLLM's layout; γ = `gamma` drafts per
    round (None: DEFAULT_GAMMA, or SUFFIX_MAX_TOKENS for suffix decoding)."""
    from specdec.hub.default_pair import ASSETS_DIR, HEAD_DIRS, default_assets_dir

    if drafter is not None and drafter not in DRAFTERS:
        raise ConfigError(f"unknown drafter {drafter!r} for vLLM; choose one of {', '.join(DRAFTERS)} or none")
    gamma = _gamma(drafter, gamma)  # a bad γ is refused before anything is written
    tokenizer_dir = default_assets_dir() / "tokenizer"
    target_dir = default_assets_dir() / "target" if str(target) == "default" else Path(target)
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        copy_checkpoint(target_dir, tmp / "target", tokenizer_dir)
        spec, drafter_dir = None, None
        if drafter == "draft":
            draft_dir = default_assets_dir() / "draft" if str(draft) == "default" else Path(draft)
            copy_checkpoint(draft_dir, tmp / "draft", tokenizer_dir)
            drafter_dir = out / "draft"
        elif drafter is not None and DRAFTERS[drafter][1] is not None:  # a head, exported in vLLM's layout
            kind, fmt = drafter, DRAFTERS[drafter][1]
            head_dir = ASSETS_DIR / HEAD_DIRS[kind] if str(head) == "default" else Path(head)
            _export_head(kind, fmt, head_dir, target_dir, str(target) == "default", tmp / kind)
            drafter_dir = out / kind
        if drafter is not None:
            spec = speculative_config(drafter, gamma, drafter_dir)
        (tmp / SPEC_FILE).write_text(json.dumps(spec, indent=1) + "\n")
        from specdec.heads.common import replace_dir

        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return VLLMBundle(out, out / "target", drafter_dir, spec)


def _export_head(kind: str, fmt: str, head_dir: Path, target_dir: Path, default_target: bool, out: Path) -> None:
    from specdec.heads import EagleHead, MedusaHeads
    from specdec.heads.export import export_head

    if not (head_dir / "config.json").is_file():
        hint = (f"no {kind} head is shipped for the default target; train one with `specdec train-head --kind "
                f"{kind} --target default` and pass --head DIR" if default_target else
                "pass a directory saved by `specdec train-head`")
        raise ModelLoadError(f"{head_dir} holds no head ({hint})")
    if default_target:
        import specdec

        target, _, _ = specdec.load_default()
    else:
        from specdec.hub.loading import load_model

        target = load_model(str(target_dir), "cpu", "float32")
    head = (MedusaHeads if kind == "medusa" else EagleHead).load(head_dir, target)
    export_head(head, fmt, out, target=target)
