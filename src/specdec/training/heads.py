"""Training EAGLE and Medusa heads on a frozen target's own features (`specdec.train_head`).

Every step runs the frozen target over a batch of windows with ``output_hidden_states`` and takes its
last hidden states (the input of its LM head) as features f and its logits as soft labels.

* **EAGLE** (EAGLE-1 loss, EAGLE-3 "training-time test"): row t reads (embed(x_{t+1}), f_t) and must
  predict f_{t+1}: SmoothL1 to f_{t+1} plus 0.1 x soft cross-entropy of lm_head(prediction) against the
  target's distribution at t+1. Inputs get uniform noise. The head is then unrolled `ttt_steps - 1`
  more times the way it drafts: at unroll j, row t reads its own prediction from unroll j-1 at t-1 and
  attends to the true rows up to t-j plus its own chain of predicted rows (a 4D mask over the head's
  cache), so it learns to continue from its own features. Step j's loss is weighted 0.8^j.
* **EAGLE-3** (`--kind eagle3`): the same unrolled training-time test, but the head reads the target's
  fused low / mid / high features (`EagleHead.feature_layers`) and is trained on tokens only, as in
  EAGLE-3: soft cross-entropy of its own logits (own norm, target LM head) against the target's
  distribution, 0.8^j per unroll, no feature regression (its output need not match any target layer).
* **Medusa**: head k reads f_t and is fit (soft cross-entropy) to the target's distribution at t+k,
  i.e. of token t+k+1; weights 0.8^(k-1).
* **DFlash** (`--kind dflash`): random blocks [x_a, mask, ...] per window, all in one head pass, each row fit
  to the target's distribution at its position, weighted by DFlash's position decay; optionally on the
  target's own greedy continuations too (training/dflash.py).

The held-out report gives the loss and the teacher-forced acceptance proxy per draft depth: the share of
positions where the head's argmax equals the target's argmax at that depth (EAGLE: depth j = unroll j).
Data: the stdlib corpus (the default target's training split) or a text / JSONL file (`--data`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specdec.core.masks import additive_mask
from specdec.errors import ConfigError
from specdec.heads import DFlashHead, EagleHead, MedusaHeads
from specdec.hub.frequency import most_frequent
from specdec.training.data import cached_tokens, sample_batch, sequential_batches
from specdec.training.loop import LoopConfig, run_loop
from specdec.training.train import hardware_summary, resolve_device

KINDS = ("eagle", "eagle3", "medusa", "dflash")


@dataclass
class HeadTrainConfig:
    """Everything one `specdec train-head` run depends on."""

    kind: str
    out: Path
    loop: LoopConfig
    data: str | None = None  # None: the stdlib corpus; else a .txt or .jsonl file ("text" field)
    batch_size: int = 8
    seq_len: int = 256
    ttt_steps: int = 3  # EAGLE: 1 teacher-forced pass + unrolls on its own features
    feature_layers: tuple[int, ...] | None = None  # EAGLE-3: None = default_feature_layers(target)
    num_heads: int = 4  # Medusa
    noise: float = 0.2  # EAGLE: uniform noise amplitude on input features (x feature RMS)
    device: str = "cpu"
    eval_tokens: int = 16384
    save_dtype: str = "float16"
    resume: bool = False
    init: str | None = None  # a saved head directory to start from ('default': the shipped head); None: fresh init
    block_size: int = 16  # DFlash: the longest block (γ + 1 rows) it is trained for
    draft_layers: int = 1  # DFlash: decoder layers of the head
    anchors: int = 16  # DFlash: blocks per window and step
    decay: float | None = None  # DFlash: position decay of the loss (None: 7 for 16 rows, scaled)
    self_distill: int = 0  # DFlash: windows of the target's own greedy continuations to generate (0: none)
    self_distill_share: float = 0.5  # DFlash: share of each batch drawn from them
    prompt_len: int = 128  # DFlash: prompt tokens of each self-distillation window


# -- data ----------------------------------------------------------------------------------------------------

def _file_texts(path: Path) -> list[str]:
    if not path.is_file():
        raise ConfigError(f"--data {path} does not exist; pass a .txt file, a .jsonl file with a \"text\" field, "
                          "or omit --data for the stdlib corpus")
    raw = path.read_text(encoding="utf-8", errors="ignore")
    if path.suffix != ".jsonl":
        return [t for t in raw.split("\n\n") if t.strip()]
    texts = []
    for i, line in enumerate(raw.splitlines()):
        if not line.strip():
            continue
        try:
            texts.append(str(json.loads(line)["text"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--data {path}: line {i + 1} is not a JSON object with a \"text\" field ({exc})") from exc
    return texts


def token_streams(tokenizer: Any, data: str | None, cache_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token streams; a file's last ~3% of documents are held out."""
    if data is None:
        return cached_tokens(tokenizer, "train", cache_dir), cached_tokens(tokenizer, "heldout", cache_dir)
    from specdec.training.tokenizer import encode_corpus

    texts = _file_texts(Path(data))
    if len(texts) < 2:
        raise ConfigError(f"--data {data} has fewer than 2 documents; it needs a train and a held-out part")
    cut = max(1, len(texts) - max(1, len(texts) * 3 // 100))
    return encode_corpus(tokenizer, texts[:cut]), encode_corpus(tokenizer, texts[cut:])


# -- features and losses -------------------------------------------------------------------------------------

@torch.no_grad()
def target_features(target, batch: torch.Tensor, layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [B, L, H], logits [B, L, V]) of the frozen target on batch [B, L]; with `layers` (EAGLE-3)
    the features are those hidden-state indices side by side [B, L, len * H]."""
    out = target(input_ids=batch, output_hidden_states=True)
    if layers is None:
        return out.hidden_states[-1], out.logits.float()
    return torch.cat([out.hidden_states[i] for i in layers], dim=-1), out.logits.float()


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum p_target log q: rows [..., V]."""
    return -(torch.softmax(target_logits, -1) * torch.log_softmax(logits.float(), -1)).sum(-1).mean()


def _unroll_mask(n: int, step: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, n, (step+1) n] for unroll `step`: row t sees true rows <= t-step and, for
    each earlier unroll s in 1..step, that unroll's row t-step+s (its own chain)."""
    t = torch.arange(n, device=device)
    allowed = [t[None, :] <= (t[:, None] - step)]  # [n, n] true rows
    for s in range(1, step + 1):
        allowed.append(t[None, :] == (t[:, None] - step + s))
    allowed = torch.cat(allowed, dim=1)  # [n, (step+1) n]
    return additive_mask(allowed, dtype)[None, None]


def eagle_unrolls(head: EagleHead, target, batch: torch.Tensor, steps: int, noise: float):
    """Per unroll j: (predicted features [B, n, H], valid-from row j); plus targets (f_next, logits_next)."""
    feats, logits = target_features(target, batch, head.feature_layers)
    embeds = target.get_input_embeddings()(batch[:, 1:]).detach()  # [B, n, H], n = L - 1
    f_in, f_next, logits_next = feats[:, :-1], feats[:, 1:], logits[:, 1:]
    if noise > 0:
        scale = f_in.pow(2).mean().sqrt()
        f_in = f_in + (torch.rand_like(f_in) - 0.5) * noise * scale
    b, n, _ = f_in.shape
    positions = torch.arange(n, device=batch.device)[None].expand(b, n)
    cache = DynamicCache()
    preds = [head(embeds, f_in, positions, cache=cache)]
    for j in range(1, steps):
        shifted = torch.cat([torch.zeros_like(preds[-1][:, :1]), preds[-1][:, :-1]], dim=1)  # row t <- pred at t-1
        mask = _unroll_mask(n, j, f_in.dtype, batch.device).expand(b, 1, n, (j + 1) * n)
        preds.append(head(embeds, shifted, positions, attention_mask=mask, cache=cache))
    return preds, f_next, logits_next


def eagle_loss(head, target, batch, steps: int, noise: float) -> torch.Tensor:
    preds, f_next, logits_next = eagle_unrolls(head, target, batch, steps, noise)
    return _unrolled_loss(head, target, preds, f_next, logits_next)


def _unrolled_loss(head: EagleHead, target, preds, f_next, logits_next) -> torch.Tensor:
    """Sum over unrolls j of 0.8^j x (EAGLE-1/2: SmoothL1 to the next feature + 0.1 soft CE; EAGLE-3: soft CE)."""
    lm_head = target.get_output_embeddings()
    total = 0.0
    for j, pred in enumerate(preds):
        p, lg = pred[:, j:], logits_next[:, j:]
        ploss = soft_ce(head.logits(p, lm_head), lg)
        if head.feature_layers is None:
            total = total + 0.8**j * (F.smooth_l1_loss(p.float(), f_next[:, j:].float()) + 0.1 * ploss)
        else:
            total = total + 0.8**j * ploss
    return total


def medusa_loss(heads: MedusaHeads, target, batch) -> torch.Tensor:
    feats, logits = target_features(target, batch)
    lm_head = target.get_output_embeddings()
    hidden = heads(feats)  # [K, B, L, H]
    total = 0.0
    for k in range(1, heads.num_heads + 1):
        total = total + 0.8 ** (k - 1) * soft_ce(lm_head(hidden[k - 1][:, :-k]), logits[:, k:])
    return total


@torch.no_grad()
def evaluate_head(kind: str, head, target, batches: list[torch.Tensor], steps: int) -> dict[str, float]:
    """Held-out loss and teacher-forced acceptance proxy per depth (argmax agreement with the target)."""
    was = head.training
    head.eval()
    lm_head = target.get_output_embeddings()
    agree: dict[int, list[float]] = {}
    losses = []
    for batch in batches:
        if kind in ("eagle", "eagle3"):
            preds, f_next, logits_next = eagle_unrolls(head, target, batch, steps, 0.0)
            losses.append(float(_unrolled_loss(head, target, preds, f_next, logits_next)))
            for j, pred in enumerate(preds):
                hit = head.logits(pred[:, j:], lm_head).argmax(-1) == logits_next[:, j:].argmax(-1)
                agree.setdefault(j + 1, []).append(hit.float().mean().item())
        else:
            feats, logits = target_features(target, batch)
            hidden = head(feats)
            losses.append(float(medusa_loss(head, target, batch)))
            for k in range(1, head.num_heads + 1):
                hit = lm_head(hidden[k - 1][:, :-k]).argmax(-1) == logits[:, k:].argmax(-1)
                agree.setdefault(k, []).append(hit.float().mean().item())
    head.train(was)
    metrics = {"heldout_loss": float(np.mean(losses))}
    metrics.update({f"accept_d{d}": float(np.mean(v)) for d, v in sorted(agree.items())})
    return metrics


def draft_vocabulary(tokens: np.ndarray, size: int, vocab_size: int) -> torch.Tensor:
    """EAGLE-3's reduced draft vocabulary: the `size` most frequent ids of a token stream, ascending (ties: lower
    id first). Feed it to `EagleHead.with_draft_vocab`."""
    if not 0 < size <= vocab_size:
        raise ConfigError(f"a draft vocabulary needs 1..{vocab_size} tokens, got {size}")
    return most_frequent(np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size), size)  # of [V]


def chain_tau(metrics: dict[str, float]) -> float:
    """Teacher-forced proxy of τ for a chain as long as the depths measured: 1 + a1 + a1 a2 + ..."""
    tau, run = 1.0, 1.0
    for key in sorted(k for k in metrics if k.startswith("accept_d")):
        run *= metrics[key]
        tau += run
    return tau


def _initial_head(cfg: HeadTrainConfig, target):
    """A fresh head (seeded) or, with `--init DIR`, the saved head in DIR ('default': the shipped one)."""
    cls = {"medusa": MedusaHeads, "dflash": DFlashHead}.get(cfg.kind, EagleHead)
    if cfg.init is None:
        if cfg.kind == "dflash":
            return DFlashHead.init(target, seed=cfg.loop.seed, feature_layers=cfg.feature_layers,
                                   num_layers=cfg.draft_layers, block_size=cfg.block_size).float().train()
        if cfg.kind == "eagle":
            return EagleHead.init(target, seed=cfg.loop.seed)
        if cfg.kind == "eagle3":
            return EagleHead.init(target, seed=cfg.loop.seed, variant="eagle3", feature_layers=cfg.feature_layers)
        return MedusaHeads.init(target, num_heads=cfg.num_heads, seed=cfg.loop.seed)
    path = Path(cfg.init)
    if cfg.init == "default":
        from specdec.hub.default_pair import default_assets_dir

        path = default_assets_dir() / cfg.kind
    head = cls.load(path, target)
    if cfg.kind == "dflash":
        if head.block_size != cfg.block_size or head.num_layers != cfg.draft_layers:
            raise ConfigError(f"--init {cfg.init} holds a DFlash head of block size {head.block_size} with "
                              f"{head.num_layers} layers; pass --block-size {head.block_size} --draft-layers "
                              f"{head.num_layers}")
        return head.float().train()
    if cfg.kind != "medusa" and head.variant != cfg.kind:
        raise ConfigError(f"--init {cfg.init} holds a {head.variant!r} head but --kind is {cfg.kind!r}; pass "
                          f"--kind {head.variant}")
    if cfg.kind == "medusa" and head.num_heads != cfg.num_heads:
        raise ConfigError(f"--init {cfg.init} holds {head.num_heads} Medusa heads but --num-heads is "
                          f"{cfg.num_heads}; pass --num-heads {head.num_heads}")
    return head.float().train()


# -- the run -------------------------------------------------------------------------------------------------

def train_head(cfg: HeadTrainConfig, target, tokenizer, log=print) -> dict[str, Any]:
    """Train a head of `cfg.kind` for the frozen `target`; save it to `cfg.out/head` and return the report."""
    if cfg.kind not in KINDS:
        raise ConfigError(f"--kind must be one of {', '.join(KINDS)}, got {cfg.kind!r}")
    if cfg.ttt_steps < 1 or cfg.batch_size < 1 or cfg.seq_len < 8:
        raise ConfigError("train-head needs --ttt-steps >= 1, --batch-size >= 1 and --seq-len >= 8")
    device = resolve_device(cfg.device)
    save_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.save_dtype]
    out = Path(cfg.out)
    target = target.to(device=device, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    torch.manual_seed(cfg.loop.seed)
    head = _initial_head(cfg, target)
    train_tokens, heldout_tokens = token_streams(tokenizer, cfg.data, out / "cache")
    heldout = [b.to(device) for b in sequential_batches(heldout_tokens, 8, cfg.seq_len, cfg.eval_tokens)]
    if not heldout:
        raise ConfigError(f"held-out data has fewer than --seq-len {cfg.seq_len} tokens; lower --seq-len")

    cpu0 = time.process_time()
    generated = None
    heldout_own: list[torch.Tensor] = []
    if cfg.kind == "dflash" and cfg.self_distill:
        from specdec.training.dflash import self_distill_windows

        if not 0 < cfg.prompt_len < cfg.seq_len:
            raise ConfigError(f"--prompt-len must lie in 1..{cfg.seq_len - 1} (below --seq-len)")
        with torch.inference_mode():
            generated = self_distill_windows(target, train_tokens, cfg.self_distill, cfg.seq_len, cfg.prompt_len,
                                             cfg.loop.seed, out / "cache", log=log)
            # held-out prompts' greedy continuations: blocks rooted in them are what a greedy request verifies
            count = max(8, min(64, cfg.eval_tokens // cfg.seq_len))
            heldout_generated = self_distill_windows(target, heldout_tokens, count, cfg.seq_len, cfg.prompt_len,
                                                     cfg.loop.seed, out / "cache", log=log, split="heldout")
        heldout_own = [torch.from_numpy(heldout_generated[i : i + 8].astype(np.int64)).to(device)
                       for i in range(0, len(heldout_generated), 8)]

    def loss_at(step: int) -> torch.Tensor:
        if cfg.kind == "dflash":
            from specdec.training.dflash import anchors_at, decay_default, dflash_loss, mixed_batch

            batch = mixed_batch(train_tokens, generated, step, cfg.loop.seed, cfg.batch_size, cfg.seq_len,
                                cfg.self_distill_share).to(device)
            starts, sizes = anchors_at(step, cfg.loop.seed, cfg.batch_size, cfg.seq_len, cfg.anchors, cfg.block_size)
            return dflash_loss(head, target, batch, starts.to(device), sizes.to(device),
                               cfg.decay or decay_default(cfg.block_size))
        batch = sample_batch(train_tokens, step, cfg.loop.seed, cfg.batch_size, cfg.seq_len).to(device)
        if cfg.kind != "medusa":
            return eagle_loss(head, target, batch, cfg.ttt_steps, cfg.noise)
        return medusa_loss(head, target, batch)

    def evaluate() -> dict[str, float]:
        if cfg.kind == "dflash":
            from specdec.training.dflash import evaluate_dflash

            metrics = evaluate_dflash(head, target, heldout, cfg.anchors)
            if heldout_own:  # blocks rooted in the target's own continuations (after the prompt)
                own = evaluate_dflash(head, target, heldout_own, cfg.anchors, low=cfg.prompt_len)
                metrics.update({f"own_{key}": value for key, value in own.items()})
            return metrics
        return evaluate_head(cfg.kind, head, target, heldout, cfg.ttt_steps)

    meta = {"kind": cfg.kind, "data": cfg.data or "stdlib", "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
            "ttt_steps": cfg.ttt_steps, "num_heads": cfg.num_heads, "noise": cfg.noise, "init": cfg.init,
            "feature_layers": getattr(head, "feature_layers", None)}
    if cfg.kind == "dflash":
        meta.update(block_size=cfg.block_size, draft_layers=cfg.draft_layers, anchors=cfg.anchors,
                    decay=cfg.decay, self_distill=cfg.self_distill, self_distill_share=cfg.self_distill_share,
                    prompt_len=cfg.prompt_len)
    summary = run_loop(head, cfg.loop, out, loss_at, evaluate, meta, cfg.resume, log, desc=f"train-head {cfg.kind}")
    cpu_minutes = (time.process_time() - cpu0) / 60
    final = summary["final"]
    head.meta = {
        "data": cfg.data or "python stdlib (train split)", "steps": cfg.loop.steps,
        "train_tokens": cfg.loop.steps * cfg.batch_size * cfg.seq_len, "cpu_minutes_this_run": round(cpu_minutes, 1),
        "heldout": final, "teacher_forced_chain_tau": final.get("block_tau", chain_tau(final)),
        "settings": {**meta, "loop": asdict(cfg.loop)},
    }
    head.save(out / "head", dtype=save_dtype)
    report = {"config": head.meta["settings"], "final": final, "history": summary["history"],
              "cpu_minutes": cpu_minutes, "wall_seconds": summary["seconds"], "resumed_from": summary["resumed_from"],
              "device": str(device), "hardware": hardware_summary()}
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(out / "report.json")
    return report
