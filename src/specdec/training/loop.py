"""The optimisation loop shared by training and distillation.

AdamW, linear warm-up then either cosine decay to ``min_lr_ratio * lr`` over the whole run or
"warm-up, stable, decay" (``wsd``: constant LR, then a cosine decay over the last ``decay_steps``
steps), gradient clipping, a tqdm bar,
periodic evaluation and checkpoints, and exact resume: the batch of each step is a pure function
of (seed, step) and the learning rate a pure function of step, so a resumed run replays the
uninterrupted one. With ``wsd`` the schedule of the first ``steps - decay_steps`` steps does not
depend on ``steps``, so a run may be resumed with a larger or smaller ``--steps`` (as long as the
decay has not started, ``--decay-steps`` too) and still equals a from-scratch run with that final ``--steps``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.errors import ConfigError
from specdec.training.checkpoint import load_checkpoint, restore_rng, save_checkpoint


@dataclass
class LoopConfig:
    """Optimiser and schedule settings of one run."""

    steps: int
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 200
    checkpoint_every: int = 100
    seed: int = 0
    schedule: str = "cosine"
    decay_steps: int = 0

    def validate(self) -> None:
        """Raise ConfigError on out-of-range settings."""
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.checkpoint_every < 1 or self.eval_every < 1:
            raise ConfigError("--warmup-steps must be >= 0, --checkpoint-every and --eval-every >= 1")
        if self.schedule not in ("cosine", "wsd"):
            raise ConfigError(f"--schedule must be 'cosine' or 'wsd', got {self.schedule!r}")
        if self.schedule == "wsd" and not 0 < self.decay_steps <= self.steps - self.warmup_steps:
            raise ConfigError("--schedule wsd needs 0 < --decay-steps <= --steps - --warmup-steps")


def lr_at(step: int, cfg: LoopConfig) -> float:
    """Learning rate of (0-based) ``step``: linear warm-up, then cosine to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        decay_start = cfg.steps - cfg.decay_steps
        if step < decay_start:
            return cfg.lr
        progress = (step - decay_start) / cfg.decay_steps
    else:
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg: LoopConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def _resumable(saved: dict, current: dict, saved_step: int, cfg: LoopConfig) -> bool:
    """Whether a checkpoint written with ``saved`` settings can continue under ``current`` ones.

    Identical settings always can; under ``wsd`` ``steps`` and ``decay_steps`` may differ while the
    checkpoint is still in the stable phase of both schedules (they agree up to that step).
    """
    if saved == current:
        return True
    if cfg.schedule != "wsd" or saved_step > cfg.steps - cfg.decay_steps:
        return False
    length_keys = ("steps", "decay_steps")
    strip = lambda m: {**m, "loop": {k: v for k, v in m["loop"].items() if k not in length_keys}}  # noqa: E731
    saved_loop = saved["loop"]
    stable = saved_step <= saved_loop["steps"] - saved_loop["decay_steps"]
    return stable and strip(saved) == strip(current)


def run_loop(
    model: torch.nn.Module,
    cfg: LoopConfig,
    out_dir: Path,
    loss_at: Callable[[int], torch.Tensor],
    evaluate: Callable[[], dict[str, float]],
    meta: dict,
    resume: bool = False,
    log: Callable[[str], None] = print,
    desc: str = "train",
) -> dict:
    """Optimise ``model`` for ``cfg.steps`` steps; ``loss_at(step)`` returns that step's loss.

    Writes ``out_dir/checkpoint.pt`` every ``checkpoint_every`` steps and at the end; with
    ``resume`` continues from it (``meta`` must match the checkpoint's). Returns a summary dict
    with the final evaluation, steps done and wall time of this invocation.
    """
    from tqdm import tqdm

    cfg.validate()
    out_dir.mkdir(parents=True, exist_ok=True)
    optimizer = make_optimizer(model, cfg)
    meta = {**meta, "loop": asdict(cfg)}
    start = 0
    if resume:
        state = load_checkpoint(out_dir)
        if state is None:
            log(f"no checkpoint in {out_dir}; starting from step 0")
        else:
            if not _resumable(state["meta"], meta, state["step"], cfg):
                raise ConfigError(
                    f"checkpoint in {out_dir} was written with different settings; rerun with the same "
                    "arguments as the interrupted run, or drop --resume / use a new --out"
                )
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            restore_rng(state)
            start = state["step"]
            log(f"resumed from step {start}")
    elif load_checkpoint(out_dir) is not None:
        raise ConfigError(f"{out_dir} already holds a checkpoint; pass --resume to continue it or use a new --out")
    model.train()
    t0 = time.perf_counter()
    history: list[dict] = []
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=desc, dynamic_ncols=True)
    for step in bar:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = loss_at(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}")
        done = step + 1
        if done % cfg.eval_every == 0 and done < cfg.steps:
            metrics = evaluate()
            history.append({"step": done, **metrics})
            log(f"step {done}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            model.train()
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            save_checkpoint(out_dir, model, optimizer, done, meta)
    bar.close()
    elapsed = time.perf_counter() - t0
    final = evaluate()
    model.eval()
    log(f"final (step {cfg.steps}): " + ", ".join(f"{k}={v:.4f}" for k, v in final.items()))
    return {"final": final, "history": history, "steps": cfg.steps, "resumed_from": start, "seconds": elapsed}
