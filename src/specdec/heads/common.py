"""What every head shares: the target's signature, and the config.json + model.safetensors checkpoint.

A head is trained for one target. Its checkpoint records the target's architecture, hidden size,
vocabulary and layer count; loading it beside another target raises `IncompatibleModelsError`, and a
missing, truncated or tampered file raises `ModelLoadError`. Files are written to a temporary directory
that is renamed into place, so a crash never leaves half a head on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from specdec.errors import IncompatibleModelsError, ModelLoadError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1


def target_signature(target: PreTrainedModel) -> dict[str, Any]:
    """What a head must agree on with its target: architecture family, hidden size, vocab, layer count."""
    config = target.config.get_text_config()
    head = target.get_output_embeddings()
    return {
        "model_type": config.model_type,
        "hidden_size": int(config.hidden_size),
        "vocab_size": int(head.out_features),  # (an nn.Linear, or a PackedLinear: load(weights=...))
        "num_hidden_layers": int(config.num_hidden_layers),
    }


def check_target(saved: dict[str, Any], target: PreTrainedModel, where: str) -> None:
    """Raise IncompatibleModelsError unless the head at `where` was trained for a target like `target`."""
    actual = target_signature(target)
    diffs = [f"{k} {saved.get(k)!r} vs {actual[k]!r}" for k in actual if saved.get(k) != actual[k]]
    if diffs:
        raise IncompatibleModelsError(
            f"the head in {where} was trained for another target ({'; '.join(diffs)}, head vs target); "
            "load it beside the target it was trained for, or train one for this target with `specdec train-head`"
        )


def write_head(out: str | Path, config: dict[str, Any], state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> Path:
    """Write config.json + model.safetensors into a temporary sibling directory, then rename it to `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tensors = {k: (v.detach().to("cpu", dtype) if dtype is not None and v.is_floating_point() else v.detach().cpu())
                   .contiguous() for k, v in state.items()}
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished directory `tmp` to `out`, replacing an older one there."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def read_head(path: str | Path, kind: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, tensors) of the head of `kind` saved in directory `path`; ModelLoadError if unreadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config_path, weights_path = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not config_path.is_file() or not weights_path.is_file():
        raise ModelLoadError(
            f"{path} is not a specdec head: it needs {CONFIG_NAME} and {WEIGHTS_NAME}; point at a directory "
            "written by `specdec train-head` (or head.save)"
        )
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON ({exc}); the head is corrupt: retrain or re-copy it") from exc
    if not isinstance(config, dict) or config.get("kind") != kind:
        found = config.get("kind") if isinstance(config, dict) else None
        raise ModelLoadError(
            f"{path} holds a {found!r} head, not a {kind!r} one; load it with the matching class "
            "(specdec.EagleHead or specdec.MedusaHeads)"
        )
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(
            f"{weights_path} is corrupt or truncated ({type(exc).__name__}: {exc}); retrain or re-copy the head"
        ) from exc
    return config, tensors


def load_state(module: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copy `tensors` into `module`; ModelLoadError naming missing, unexpected or misshapen keys."""
    own = module.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    shapes = [f"{k} {tuple(tensors[k].shape)} vs {tuple(own[k].shape)}"
              for k in own if k in tensors and tensors[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:5])}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:5])}")
        if shapes:
            parts.append(f"shape mismatch {', '.join(shapes[:5])}")
        raise ModelLoadError(f"the checkpoint in {where} does not fit the head ({'; '.join(parts)}); it is partial "
                             "or was written by another head layout: retrain or re-copy it")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(tensors[k].to(v.dtype))
