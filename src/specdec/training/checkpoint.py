"""Training checkpoints (model, optimizer, step, RNG state) and the final 16-bit export."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(out_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, meta: dict) -> Path:
    """Atomically write ``out_dir/checkpoint.pt`` with everything needed to resume at ``step``."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "meta": meta,
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
    }
    path = out_dir / CHECKPOINT_NAME
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    return path


def load_checkpoint(out_dir: Path) -> dict[str, Any] | None:
    """The checkpoint in ``out_dir``, or None when there is none."""
    path = out_dir / CHECKPOINT_NAME
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the RNG states stored by :func:`save_checkpoint`."""
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])


def export_model(model: torch.nn.Module, tokenizer: Any, out_dir: Path, dtype: torch.dtype = torch.float16) -> None:
    """Save ``model`` in ``dtype`` as safetensors plus the tokenizer, loadable by from_pretrained."""
    import copy

    half = copy.deepcopy(model).to("cpu", dtype=dtype).eval()
    half.config.dtype = dtype
    half.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
