"""DistillSpec-style distillation: fit the draft to the target's own next-token distributions.

The draft (initialised from a trained draft) reads windows of the train corpus, and at every
position minimises a divergence between the target's distribution p and its own q, both at
``temperature``:

* ``fkl`` (default): forward KL(p || q) = soft-label cross-entropy minus the target's entropy.
  Dense gradients on every vocabulary entry, well conditioned from the start, and an upper bound
  on the quantity speculative sampling pays for: 1 - alpha = TVD(p, q) <= sqrt(KL(p||q) / 2).
* ``tvd``: total variation 0.5 * sum |p - q| = 1 - alpha, i.e. directly maximising the expected
  acceptance; its gradient is sparse (only sign information), slower to converge from scratch.

Teacher-forced on real text (not on draft samples): generating on-policy data with the target
would cost more CPU than the whole distillation budget.

``parallel`` (`specdec distill --parallel`): the draft gets a mask token and learns PARD's parallel drafting,
γ tokens from γ − 1 masks in one pass (training/parallel.py); its export loads as `specdec.ParallelDraft`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.errors import ConfigError, IncompatibleModelsError, ModelLoadError
from specdec.training.checkpoint import export_model
from specdec.training.data import load_token_data, sample_batch, sequential_batches
from specdec.training.evaluate import acceptance_from_logits, forward_kl, perplexity
from specdec.training.loop import LoopConfig, run_loop
from specdec.training.train import hardware_summary, resolve_device, save_dtype

LOSSES = ("fkl", "tvd")


@dataclass
class DistillConfig:
    """Everything one `specdec distill` run depends on."""

    target: Path
    draft: Path
    out: Path
    loop: LoopConfig
    batch_size: int = 8
    seq_len: int = 256
    temperature: float = 1.0
    loss: str = "fkl"
    device: str = "cpu"
    eval_tokens: int = 32768
    save_dtype: str = "float16"
    resume: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    parallel: bool = False  # PARD: add a mask token and train γ − 1 masks per block (training/parallel.py)
    max_gamma: int = 8  # PARD: tokens per block (the root's row and max_gamma − 1 masks)
    anchors: int = 16  # PARD: blocks per window and step


def load_model(path: Path, device: torch.device) -> torch.nn.Module:
    """A saved causal LM in float32 on ``device``, or ModelLoadError naming the fix."""
    from transformers import AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise ModelLoadError(f"no model at {path} (config.json missing); train one first with `specdec train --out {path}`")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)


def divergence(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float, loss: str) -> torch.Tensor:
    """The distillation loss ``loss`` between target and draft logits at ``temperature``."""
    if loss == "fkl":
        return forward_kl(target_logits, draft_logits, temperature)
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    return 0.5 * (p - q).abs().sum(-1).mean()


@torch.no_grad()
def pair_metrics(target: torch.nn.Module, draft: torch.nn.Module, batches: list[torch.Tensor], device) -> dict[str, float]:
    """Held-out acceptance proxies (T=0, T=1), KL(target||draft) and the draft's own loss.

    One forward of each model per batch; every position of every window counts equally.
    """
    was_training = draft.training
    draft.eval()
    sums = {"alpha_T0": 0.0, "alpha_T1": 0.0, "kl_T1": 0.0, "draft_val_loss": 0.0}
    positions = 0
    for batch in batches:
        batch = batch.to(device)
        t_logits, d_logits = target(input_ids=batch).logits.float(), draft(input_ids=batch).logits.float()
        n = batch.numel()
        sums["alpha_T0"] += acceptance_from_logits(t_logits, d_logits, 0.0).sum().item()
        sums["alpha_T1"] += acceptance_from_logits(t_logits, d_logits, 1.0).sum().item()
        sums["kl_T1"] += forward_kl(t_logits, d_logits, 1.0).item() * n
        ce = F.cross_entropy(d_logits[:, :-1].reshape(-1, d_logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum")
        sums["draft_val_loss"] += ce.item() * n / (batch.size(0) * (batch.size(1) - 1))
        positions += n
    draft.train(was_training)
    metrics = {k: v / max(positions, 1) for k, v in sums.items()}
    metrics["draft_val_ppl"] = perplexity(metrics["draft_val_loss"])
    return metrics


def _parallel_draft(target, draft, cfg: DistillConfig, log) -> tuple[torch.nn.Module, int]:
    """The draft with its mask row (added here when the draft has the target's width; kept when it has one more
    row, e.g. to continue an adapted draft) and the mask's id (the target's vocabulary size)."""
    from specdec.drafters.parallel import ParallelDraft
    from specdec.runtime.causal_lm import vocab_size

    if isinstance(cfg.max_gamma, bool) or cfg.max_gamma < 2 or cfg.anchors < 1:
        raise ConfigError("--parallel needs --max-gamma >= 2 (the root's row and at least one mask) and --anchors >= 1")
    target_vocab, rows = vocab_size(target), vocab_size(draft)
    if rows == target_vocab:
        draft = ParallelDraft.adapt(draft)
        log(f"added the mask token: id {target_vocab}, the draft's row {target_vocab} (its logit is never read)")
    elif rows != target_vocab + 1:
        raise IncompatibleModelsError(
            f"--parallel needs a draft of the target's vocabulary ({target_vocab} rows) or one already adapted "
            f"({target_vocab + 1}: the mask row), got {rows}; train both with the same --tokenizer")
    return draft, target_vocab


def distill(cfg: DistillConfig, log=print) -> dict[str, Any]:
    """Distil ``cfg.draft`` towards ``cfg.target``; export to ``cfg.out`` and return the report."""
    if cfg.temperature <= 0:
        raise ConfigError(f"--temperature must be > 0 for distillation, got {cfg.temperature}")
    if cfg.loss not in LOSSES:
        raise ConfigError(f"--loss must be one of {LOSSES}, got {cfg.loss!r}")
    device = resolve_device(cfg.device)
    dtype = save_dtype(cfg.save_dtype)
    torch.manual_seed(cfg.loop.seed)
    target = load_model(cfg.target, device).eval()
    draft = load_model(cfg.draft, device)
    if cfg.parallel:
        draft, mask_token_id = _parallel_draft(target, draft, cfg, log)
    elif target.config.vocab_size != draft.config.vocab_size:
        raise IncompatibleModelsError(
            f"target vocab {target.config.vocab_size} != draft vocab {draft.config.vocab_size}; "
            "train both with the same --tokenizer"
        )
    for p in target.parameters():
        p.requires_grad_(False)
    out = Path(cfg.out)
    data = load_token_data(out, cfg.draft)
    heldout = sequential_batches(data.heldout, 8, cfg.seq_len, cfg.eval_tokens)

    def metrics() -> dict[str, float]:
        if not cfg.parallel:
            return pair_metrics(target, draft, heldout, device)
        from specdec.training.parallel import parallel_metrics

        return parallel_metrics(target, draft, heldout, cfg.max_gamma - 1, mask_token_id, cfg.anchors)

    before = metrics()
    log("before: " + ", ".join(f"{k}={v:.4f}" for k, v in before.items()))

    def loss_at(step: int) -> torch.Tensor:
        batch = sample_batch(data.train, step, cfg.loop.seed, cfg.batch_size, cfg.seq_len).to(device)
        if cfg.parallel:
            from specdec.training.parallel import mask_decay, parallel_loss, roots_at

            roots = roots_at(step, cfg.loop.seed, cfg.batch_size, cfg.seq_len, cfg.anchors).to(device)
            return parallel_loss(target, draft, batch, roots, cfg.max_gamma - 1, mask_token_id, cfg.temperature,
                                 cfg.loss, mask_decay(cfg.max_gamma))
        with torch.no_grad():
            t_logits = target(input_ids=batch).logits
        return divergence(t_logits, draft(input_ids=batch).logits, cfg.temperature, cfg.loss)

    meta = {"batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "temperature": cfg.temperature, "loss": cfg.loss,
            "target": str(cfg.target), "draft": str(cfg.draft)}
    if cfg.parallel:
        meta.update(parallel=True, max_gamma=cfg.max_gamma, anchors=cfg.anchors)
    summary = run_loop(draft, cfg.loop, out, loss_at, metrics, meta, cfg.resume, log,
                       desc="distill --parallel" if cfg.parallel else "distill")
    export_model(draft, data.tokenizer, out, dtype)
    report = {"before": before, "after": summary["final"], "config": {**meta, "loop": asdict(cfg.loop)},
              "eval_tokens": sum(b.numel() for b in heldout), "device": str(device),
              "hardware": hardware_summary(), **summary}
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    return report
