"""Train a LlamaForCausalLM from scratch on the tokenized stdlib train split.

The run directory ``out`` ends up holding: ``tokenizer/`` (unless an existing one was reused),
``cache/`` (uint16 token streams), ``checkpoint.pt`` (resume state), ``report.json`` and the
final model (``config.json`` + ``model.safetensors`` in 16 bits + tokenizer files), loadable with
``AutoModelForCausalLM.from_pretrained(out)``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.errors import ConfigError
from specdec.training.checkpoint import export_model
from specdec.training.data import load_token_data, sample_batch, sequential_batches
from specdec.training.evaluate import lm_loss, perplexity
from specdec.training.loop import LoopConfig, run_loop


@dataclass(frozen=True)
class ModelSpec:
    """Llama shape (vocab size comes from the tokenizer)."""

    hidden_size: int
    layers: int
    heads: int
    intermediate_size: int

    def validate(self) -> None:
        """Raise ConfigError when the shape is inconsistent."""
        if min(self.hidden_size, self.layers, self.heads, self.intermediate_size) < 1:
            raise ConfigError("--hidden-size, --layers, --heads and --intermediate-size must all be >= 1")
        if self.hidden_size % self.heads or (self.hidden_size // self.heads) % 2:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} must be divisible by --heads {self.heads} "
                "into an even head dimension (rotary embeddings); pick e.g. heads = hidden_size // 64"
            )


#: The shipped default pair (chosen with benchmarks/size_sweep.py; see the model card).
MODEL_SIZES: dict[str, ModelSpec] = {
    "target": ModelSpec(hidden_size=384, layers=6, heads=6, intermediate_size=1024),
    "draft": ModelSpec(hidden_size=128, layers=1, heads=2, intermediate_size=384),
}


@dataclass
class TrainConfig:
    """Everything one `specdec train` run depends on."""

    out: Path
    model: ModelSpec
    loop: LoopConfig
    batch_size: int = 8
    seq_len: int = 256
    device: str = "cpu"
    tokenizer: str | None = None
    eval_tokens: int = 32768
    save_dtype: str = "float16"
    resume: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def llama_config(spec: ModelSpec, tokenizer: Any, max_positions: int = 1024) -> Any:
    """A LlamaConfig of shape ``spec`` for ``tokenizer``'s vocabulary, embeddings tied."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def resolve_device(device: str) -> torch.device:
    """``device`` as a torch.device, with a clear error when CUDA is asked for but absent."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} requested but CUDA is not available; use --device cpu")
    return torch.device(device)


def save_dtype(name: str) -> torch.dtype:
    """torch dtype for --save-dtype."""
    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if name not in dtypes:
        raise ConfigError(f"--save-dtype must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


def hardware_summary() -> dict[str, Any]:
    """CPU model name, thread count and torch version, for reports."""
    from specdec.runtime.precision import cpu_model

    return {"cpu": cpu_model(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def train(cfg: TrainConfig, log=print) -> dict[str, Any]:
    """Train (or resume) a model as described by ``cfg``; export it and return the report."""
    from transformers import LlamaForCausalLM

    cfg.model.validate()
    if cfg.batch_size < 1 or cfg.seq_len < 2:
        raise ConfigError("--batch-size must be >= 1 and --seq-len >= 2")
    out = Path(cfg.out)
    device = resolve_device(cfg.device)
    dtype = save_dtype(cfg.save_dtype)
    torch.manual_seed(cfg.loop.seed)
    data = load_token_data(out, cfg.tokenizer)
    log(f"corpus: {len(data.train):,} train tokens, {len(data.heldout):,} held-out tokens, vocab {len(data.tokenizer)}")
    model = LlamaForCausalLM(llama_config(cfg.model, data.tokenizer, max(1024, cfg.seq_len))).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters ({asdict(cfg.model)})")

    def loss_at(step: int) -> torch.Tensor:
        batch = sample_batch(data.train, step, cfg.loop.seed, cfg.batch_size, cfg.seq_len).to(device)
        logits = model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))

    def evaluate(max_tokens: int | None = cfg.eval_tokens) -> dict[str, float]:
        loss = lm_loss(model, sequential_batches(data.heldout, 8, cfg.seq_len, max_tokens), device)
        return {"val_loss": loss, "val_ppl": perplexity(loss)}

    meta = {"model": asdict(cfg.model), "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "vocab": len(data.tokenizer)}
    summary = run_loop(model, cfg.loop, out, loss_at, evaluate, meta, cfg.resume, log)
    summary["final"] = evaluate(None)  # full held-out split for the reported number
    log(f"held-out (all {len(data.heldout):,} tokens): loss {summary['final']['val_loss']:.4f}, ppl {summary['final']['val_ppl']:.2f}")
    export_model(model, data.tokenizer, out, dtype)
    report = {
        "params": n_params,
        "model": asdict(cfg.model),
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "train_tokens": int(len(data.train)),
        "heldout_tokens": int(len(data.heldout)),
        "tokens_seen": cfg.loop.steps * cfg.batch_size * (cfg.seq_len - 1),
        "device": str(device),
        "hardware": hardware_summary(),
        **summary,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    return report
