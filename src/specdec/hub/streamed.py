"""`load(weights=...)` straight from a checkpoint, one linear layer at a time: the float model is never whole.

`from_pretrained` and then `pack_model` hold the whole float model before the first layer is packed: for a model of
8B parameters in bfloat16, 16 GB on the way to 4.5 GB of int4 weights. Here instead:

1. the model is built with empty parameters (`no_init_weights`: allocated, never written, so never resident);
2. every tensor but the linear layers' weights (embeddings, norms, biases) is read into its place;
3. `pack_model` packs the linear layers in order, each reading its weight from the checkpoint just before (its
   `fill`) and dropping it just after; a weight of more than READ_CHUNK bytes is read a chunk of rows at a time
   while it is packed (`Rows`), so it is never whole in memory.

Peak memory: the packed weights, the other tensors, and one layer's float weight or one chunk of it. Each tensor (and
each chunk) is read through its own short-lived mapping of its file, so the pages read do not stay counted in the
process's resident memory.

The model is the one `from_pretrained(dtype=...)` and `pack_model` give, tensor for tensor (tests/test_quantize.py).
Only a checkpoint this reads exactly as `from_pretrained` does is streamed: a causal LM in safetensors (one file, or
shards with their index; a local directory, or a hub id's snapshot in the hub cache) whose tensors have the model's
own names and shapes (a tied LM head may be left out). For anything else `load_streamed` returns None and the
caller loads the float model whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: A linear layer's weight of more than this many bytes (in the model's dtype) is read a chunk of at most this many
#: bytes of rows at a time while it is packed. Read whole, the untied LM head of Llama-3.1-8B's shape (1 GB in
#: bfloat16) was most of what a streamed load held above the model and the process (BENCHMARKS.md).
READ_CHUNK = 64 << 20


def weight_files(directory: Path) -> list[str]:
    """The safetensors files a checkpoint directory's weights are in: those its index names, else model.safetensors
    (present or not)."""
    index = directory / INDEX
    return sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [SINGLE]


def local_checkpoint(path: str | Path, cache_only: bool) -> Path | None:
    """The local directory of checkpoint `path`: the path itself, or for a hub id its snapshot in the hub cache,
    fetched first where the hub can be reached: its configurations, then the safetensors files its index names (or
    model.safetensors), as from_pretrained fetches them (cache_only: the cache alone). None when the hub refuses."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    try:
        local = Path(snapshot_download(str(path), allow_patterns=["*.json"], local_files_only=cache_only))
        return Path(snapshot_download(str(path), allow_patterns=weight_files(local), local_files_only=cache_only))
    except Exception:  # noqa: BLE001 (any refusal, the hub client's network errors included: from_pretrained then
        return None  # loads or reports what is wrong, in its own words)


def checkpoint_tensors(path: Path) -> dict[str, tuple[Path, list[int]]] | None:
    """tensor name -> (its safetensors file, its shape) for a checkpoint directory; None when it has no safetensors."""
    from safetensors import safe_open

    files = [path / name for name in weight_files(path)]
    if not all(file.is_file() for file in files):
        return None  # none, or a shard missing (a hub snapshot cached in part): from_pretrained's business
    tensors = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                tensors[name] = (file, f.get_slice(name).get_shape())
    return tensors


def read(file: Path, name: str, dtype: torch.dtype, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Tensor `name` of `file` in `dtype` (a floating tensor; others as stored), or its rows [r0, r1) alone, through
    a mapping closed after."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        tensor = f.get_tensor(name) if rows is None else f.get_slice(name)[rows[0] : rows[1]]
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


class Rows:
    """Rows of the tensor `name` of `file` in `dtype`, read a chunk of rows at a time (READ_CHUNK bytes at most,
    or the rows asked for), each chunk through a mapping of its own: a `PackedLinear.pack` reader, whose calls ask
    for consecutive blocks of rows."""

    def __init__(self, file: Path, name: str, shape: list[int], dtype: torch.dtype):
        self.file, self.name, self.dtype, self.n = file, name, dtype, shape[0]
        self.chunk_rows = max(1, READ_CHUNK // max(1, shape[1] * dtype.itemsize))
        self.start, self.chunk = 0, None  # the rows read last: [start, start + len(chunk))

    def __call__(self, r0: int, r1: int) -> torch.Tensor:
        if self.chunk is None or r0 < self.start or r1 > self.start + self.chunk.shape[0]:
            self.chunk = None  # (freed before the next chunk is read)
            end = min(self.n, max(r1, r0 + self.chunk_rows))
            self.start, self.chunk = r0, read(self.file, self.name, self.dtype, (r0, end))
        return self.chunk[r0 - self.start : r1 - self.start]


def load_streamed(path: str | Path, dtype: torch.dtype, weights: str) -> nn.Module | None:
    """The causal LM at `path` with its linear layers packed in format `weights`, read layer by layer (see the
    module docstring); None when the checkpoint is not one this reads exactly as from_pretrained does."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    from specdec.runtime.weights import pack_model

    path = Path(path)
    if not path.is_dir() or not isinstance(dtype, torch.dtype):
        return None
    tensors = checkpoint_tensors(path)
    config = AutoConfig.from_pretrained(str(path)) if tensors is not None else None
    if config is None or config.is_encoder_decoder:
        return None
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # (skipped under no_init_weights; from_pretrained ties after loading)
    state = model.state_dict(keep_vars=True)  # name -> its empty tensor; tied tensors under each of their names
    if set(tensors) - set(state):
        return None  # tensors the model does not have: renamed or extra keys, from_pretrained's business
    names: dict[int, list[str]] = {}  # one entry per tensor object, with every name it has
    for name, tensor in state.items():
        names.setdefault(id(tensor), []).append(name)
    source: dict[int, str] = {}  # tensor object -> the name the checkpoint holds it under
    for key, group in names.items():
        stored = [n for n in group if n in tensors and list(state[n].shape) == tensors[n][1]]
        if not stored:
            return None  # missing from the checkpoint, or of another shape
        source[key] = stored[0]
    linear_weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    with torch.no_grad():
        for key, group in names.items():
            if all(n in linear_weights for n in group):
                continue  # a linear layer's own weight: read when it is packed
            target = state[group[0]]
            target.copy_(read(tensors[source[key]][0], source[key], target.dtype))

    def fill(name: str, linear: nn.Linear) -> Rows | None:
        stored = source[id(state[f"{name}.weight"])]
        file, shape = tensors[stored]
        if linear.weight.numel() * linear.weight.element_size() > READ_CHUNK:
            return Rows(file, stored, shape, linear.weight.dtype)  # read while it is packed, a chunk at a time
        linear.weight = nn.Parameter(read(file, stored, linear.weight.dtype), requires_grad=False)
        return None

    pack_model(model, weights, fill=fill)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    return model.eval()
