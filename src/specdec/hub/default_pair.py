"""The shipped default (target, draft) pair, trained on the Python stdlib (see assets/default/MODEL_CARD.md)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ModelLoadError

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets" / "default"
REQUIRED = ("target/config.json", "target/model.safetensors", "draft/config.json", "draft/model.safetensors",
            "tokenizer/tokenizer.json")


def default_assets_dir() -> Path:
    """Directory holding ``target/`` and ``draft/`` (the models), ``tokenizer/`` (their one tokenizer, with a
    plain chat template), the heads and ``MODEL_CARD.md``."""
    return ASSETS_DIR


def assets_present(root: Path | None = None) -> bool:
    """True when every file :func:`load_default` needs is in place."""
    base = root or ASSETS_DIR
    return all((base / rel).is_file() for rel in REQUIRED)


#: The ranking `frequent_tokens` reads: the default tokenizer's ids, most frequent in the training data first.
FREQUENCY_FILE = "tokenizer/tokens_by_frequency.json"


@functools.cache
def _read_ranking(path: Path) -> tuple[int, ...]:
    return tuple(json.loads(path.read_text())["ids"])


def token_ranking(root: Path | None = None) -> tuple[int, ...]:
    """Every id of the default tokenizer, most frequent in the training data first (read once per process): its
    length is the vocabulary width the ranking fits."""
    path = (root or ASSETS_DIR) / FREQUENCY_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default pair's token ranking is missing ({path}); reinstall specdec")
    return _read_ranking(path)


def frequent_tokens(n: int, root: Path | None = None) -> torch.Tensor:
    """The `n` most frequent tokens of the default pair's training data, as ascending ids [n]: a draft vocabulary
    for the default draft (`DraftModel(draft, draft_vocab=frequent_tokens(2048))`)."""
    ids = token_ranking(root)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= len(ids):
        from specdec.errors import ConfigError

        raise ConfigError(f"a draft vocabulary of the default pair holds 1..{len(ids)} tokens, got {n!r}")
    return torch.tensor(sorted(ids[:n]), dtype=torch.long)


def _load_model(path: Path, device: str | torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """One causal LM from ``path``, cast to ``dtype`` on ``device``, in eval mode."""
    from specdec.hub.loading import load_model

    return load_model(path, str(device), dtype)


def load_default(
    device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32, root: Path | None = None
) -> tuple[Any, Any, Any]:
    """Load the default ``(target, draft, tokenizer)``; weights are stored in 16 bits, cast to ``dtype``
    ("auto": bfloat16 where the device computes it natively, else float32; see runtime/precision.py).

    Raises ModelLoadError when the assets are missing (e.g. a source checkout without them).
    """
    from specdec.hub.loading import check_device, resolve_dtype

    check_device(device)
    dtype = resolve_dtype(dtype, str(device))
    if not isinstance(dtype, torch.dtype):  # "checkpoint": the shipped weights are 16-bit; decode in float32
        dtype = torch.float32
    base = Path(root) if root is not None else ASSETS_DIR
    missing = [rel for rel in REQUIRED if not (base / rel).is_file()]
    if missing:
        raise ModelLoadError(
            f"default model assets missing under {base}: {', '.join(missing)}; reinstall specdec, or rebuild "
            "them with the `specdec train` / `specdec distill` commands in MODEL_CARD.md"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base / "tokenizer"))
    target = _load_model(base / "target", device, dtype)
    draft = _load_model(base / "draft", device, dtype)
    return target, draft, tokenizer


HEAD_DIRS = {"eagle": "eagle", "medusa": "medusa", "eagle3": "eagle3", "dflash": "dflash"}
#: Heads every install ships; the others are returned when their directory is present.
REQUIRED_HEADS = ("eagle", "medusa")


def head_shipped(name: str, root: Path | None = None) -> bool:
    """Whether the head `name` (a key of HEAD_DIRS) is shipped for the default target."""
    return ((root or ASSETS_DIR) / HEAD_DIRS[name] / "model.safetensors").is_file()


def load_default_heads(target: Any = None, root: Path | None = None) -> dict[str, Any]:
    """{"eagle": EagleHead, "medusa": MedusaHeads, "eagle3": EagleHead (EAGLE-3), "dflash": DFlashHead} trained for
    the default target (loaded if not given); "eagle3" and "dflash" where shipped."""
    from specdec.heads import DFlashHead, EagleHead, MedusaHeads

    base = Path(root) if root is not None else ASSETS_DIR
    if target is None:
        target, _, _ = load_default(root=base)
    missing = [HEAD_DIRS[name] for name in REQUIRED_HEADS if not (base / HEAD_DIRS[name] / "model.safetensors").is_file()]
    if missing:
        raise ModelLoadError(
            f"default heads missing under {base}: {', '.join(missing)}; reinstall specdec, or train them with "
            "`specdec train-head --kind eagle|medusa --target default` (see the cards in assets/default)"
        )
    heads = {"eagle": EagleHead.load(base / HEAD_DIRS["eagle"], target),
             "medusa": MedusaHeads.load(base / HEAD_DIRS["medusa"], target)}
    if head_shipped("eagle3", base):
        heads["eagle3"] = EagleHead.load(base / HEAD_DIRS["eagle3"], target)
    if head_shipped("dflash", base):
        heads["dflash"] = DFlashHead.load(base / HEAD_DIRS["dflash"], target)
    return heads


#: The default draft adapted to PARD drafting (`specdec distill --parallel`; assets/default/parallel/CARD.md).
PARALLEL_DIR = "parallel"


def parallel_shipped(root: Path | None = None) -> bool:
    """Whether an adapted (mask-token) draft is shipped for the default pair."""
    return ((root or ASSETS_DIR) / PARALLEL_DIR / "model.safetensors").is_file()


def load_default_parallel(target: Any = None, root: Path | None = None) -> Any:
    """The default draft adapted to parallel drafting (one mask row past the vocabulary), in the dtype and on the
    device of `target` (float32 on the CPU when not given); ModelLoadError where none is shipped."""
    base = Path(root) if root is not None else ASSETS_DIR
    if not parallel_shipped(base):
        raise ModelLoadError(
            f"no parallel (PARD) draft is shipped under {base}: adapt one with `specdec distill --parallel "
            "--target TARGET --draft DRAFT --out DIR` and pass it as --draft DIR (ParallelDraft(model))")
    param = next(target.parameters()) if target is not None else None
    device = param.device if param is not None else "cpu"
    dtype = param.dtype if param is not None else torch.float32
    return _load_model(base / PARALLEL_DIR, device, dtype)


#: The shipped encoder-decoder pair (a BART target and draft trained on denoising stdlib code, see
#: assets/seq2seq/CARD.md), by name: `specdec.load(DEFAULT_SEQ2SEQ)`, `specdec generate --target default-seq2seq`.
DEFAULT_SEQ2SEQ = "default-seq2seq"
SEQ2SEQ_DIR = Path(__file__).resolve().parents[1] / "assets" / "seq2seq"
#: target/ and draft/ hold the models; tokenizer/ their one tokenizer (the default pair's plus <mask>).
SEQ2SEQ_REQUIRED = ("target/config.json", "target/model.safetensors", "draft/config.json", "draft/model.safetensors",
                    "tokenizer/tokenizer.json")


def load_default_seq2seq(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                         root: Path | None = None) -> tuple[Any, Any, Any]:
    """Load the shipped seq2seq ``(target, draft, tokenizer)`` (16-bit weights upcast to ``dtype``). The source is
    a chunk of Python with some tokens replaced by ``<mask>``, one per token; the output is the whole chunk.
    ModelLoadError when the assets are missing."""
    from specdec.hub.loading import check_device, load_model, load_tokenizer

    check_device(device)
    base = Path(root) if root is not None else SEQ2SEQ_DIR
    missing = [rel for rel in SEQ2SEQ_REQUIRED if not (base / rel).is_file()]
    if missing:
        raise ModelLoadError(
            f"shipped seq2seq assets missing under {base}: {', '.join(missing)}; reinstall specdec, or rebuild them "
            "with `specdec train --recipe seq2seq-pair` (see assets/seq2seq/CARD.md)"
        )
    target = load_model(base / "target", str(device), dtype)
    draft = load_model(base / "draft", str(device), dtype)
    return target, draft, load_tokenizer(base / "tokenizer")
