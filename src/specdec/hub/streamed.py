"""`load(weights=...)` straight from a checkpoint, one linear layer at a time: the float model is never whole.

`from_pretrained` and then `pack_model` hold the whole float model before the first layer is packed: for a model of
8B parameters in bfloat16, 16 GB on the way to 4.5 GB of int4 weights. Here instead:

1. the model is built with empty parameters (`no_init_weights`: allocated, never written, so never resident);
2. every tensor but the linear layers' weights (embeddings, norms, biases) is read into its place;
3. `pack_model` packs the linear layers in order, each reading its weight from the checkpoint just before (its
   `fill`) and dropping it just after; a weight of more than READ_CHUNK bytes is read a chunk of rows at a time
   while it is packed (`Rows`), so it is never whole in memory;
4. a mixture-of-experts layer's experts, which the checkpoint keeps one key per expert and projection and
   from_pretrained stacks (gate_proj and up_proj of every expert into one gate_up_proj), are packed one expert at a
   time, each expert's matrix read just before (`fill_experts`); the first two of one layer per experts class are
   also written into its stacked parameter, for `pack_model`'s check of the experts' forward.

Peak memory: the packed weights, the other tensors, and one layer's float weight or one chunk of it. Each tensor (and
each chunk) is read through its own short-lived mapping of its file, so the pages read do not stay counted in the
process's resident memory: safetensors' reader maps each itself; in a `.bin`, the place of each tensor's bytes is
found once per file (`pickled_layout`) and each read maps them (`read`), so the file's pickle is parsed once.

The model is the one `from_pretrained(dtype=...)` and `pack_model` give, tensor for tensor (tests/test_quantize.py).
Only a checkpoint this reads exactly as `from_pretrained` does is streamed: a causal LM or an encoder-decoder (a
local directory, or a hub id's snapshot in the hub cache) in the files `from_pretrained` would read, safetensors or
else PyTorch's zip-format `.bin` (one file, or shards with their index), whose keys `from_pretrained`'s own renaming
(transformers' conversion mapping: legacy names, the base model's prefix added or stripped) gives each of the
model's tensors at its shape (a tied LM head may be left out; keys the model has no tensor for are left unread, as
`from_pretrained` leaves them). A checkpoint whose tensors are converted on load otherwise than by stacking experts
(split, or merged another way) or quantized (a `quantization_config`), or that leaves out a tensor the model computes
itself (Marian's sinusoidal positions), or a `.bin` in the legacy format, is not: there `load_streamed` returns None
and the caller loads the float model whole.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch
from torch import nn

#: The weight files from_pretrained reads from a directory, in its order of preference: one safetensors file, else
#: the safetensors shards an index names, else the same of PyTorch's pickled `.bin` format.
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLED, PICKLED_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
#: A linear layer's weight of more than this many bytes (in the model's dtype) is read a chunk of at most this many
#: bytes of rows at a time while it is packed. Read whole, the untied LM head of Llama-3.1-8B's shape (1 GB in
#: bfloat16) was most of what a streamed load held above the model and the process (BENCHMARKS.md).
READ_CHUNK = 64 << 20


def weight_files(directory: Path) -> list[str] | None:
    """The files a checkpoint directory's weights are in, as from_pretrained picks them (SINGLE, INDEX, PICKLED,
    PICKLED_INDEX, the first present; an index: the files it names, present or not); None for none of them."""
    for name in (SINGLE, INDEX, PICKLED, PICKLED_INDEX):
        if (directory / name).is_file():
            index = name.endswith(".index.json")
            return sorted(set(json.loads((directory / name).read_text())["weight_map"].values())) if index else [name]
    return None


def local_checkpoint(path: str | Path, cache_only: bool) -> Path | None:
    """The local directory of checkpoint `path`: the path itself, or for a hub id its snapshot in the hub cache,
    fetched first where the hub can be reached: its configurations (indexes among them), then the weight files
    from_pretrained would fetch (those the index names; without one, model.safetensors, else pytorch_model.bin)
    (cache_only: the cache alone). None when the hub refuses."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    def fetch(patterns: list[str]) -> Path:
        return Path(snapshot_download(str(path), allow_patterns=patterns, local_files_only=cache_only))

    try:
        local = fetch(["*.json"])
        if not (local / INDEX).is_file():
            local = fetch([SINGLE])  # (where the hub has it; from_pretrained fetches it before any .bin)
        return fetch(weight_files(local) or [PICKLED])
    except Exception:  # noqa: BLE001 (any refusal, the hub client's network errors included: from_pretrained then
        return None  # loads or reports what is wrong, in its own words)


@dataclass(frozen=True)
class Stored:
    """Where a checkpoint holds a tensor: its file and shape; in a `.bin`, also the offset of its bytes in the file
    and its dtype, where it is read straight from the file (safetensors' own reader finds them itself)."""

    file: Path
    shape: tuple[int, ...]
    offset: int | None = None
    dtype: torch.dtype | None = None


def checkpoint_tensors(path: Path) -> dict[str, Stored] | None:
    """tensor name -> where it is stored, for a checkpoint directory; None when it has no weight files this reads
    (none, a shard missing as in a hub snapshot cached in part, or a `.bin` this cannot lay out: `pickled_layout`)."""
    from safetensors import safe_open

    files = [path / name for name in weight_files(path) or []]
    if not files or not all(file.is_file() and (file.suffix == ".safetensors" or zipfile.is_zipfile(file))
                            for file in files):
        return None  # from_pretrained's business
    tensors = {}
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(str(file), "pt") as f:
                tensors.update((name, Stored(file, tuple(f.get_slice(name).get_shape()))) for name in f.keys())
        else:
            layout = pickled_layout(file)
            if layout is None:
                return None
            tensors.update(layout)
    return tensors


def pickled_layout(file: Path) -> dict[str, Stored] | None:
    """Where each tensor of a zip-format `.bin` (torch.save) is: None unless each is contiguous, little-endian and
    stored uncompressed. The file's pickle is parsed once, here, by torch.load(mmap=True), which maps the whole file
    as one storage and each of its records (one per storage) as a slice of that: a tensor's storage's address less
    the mapping's is its record's offset, which the zip archive's directory gives; no tensor data is read."""
    with zipfile.ZipFile(file) as archive, open(file, "rb") as f:
        records = {}  # offset of a storage record's data in the file -> its compression
        for info in archive.infolist():
            if PurePosixPath(info.filename).parent.name == "data":
                f.seek(info.header_offset + 26)  # the record's local header: its name's and extra field's lengths
                name_length, extra_length = struct.unpack("<HH", f.read(4))
                records[info.header_offset + 30 + name_length + extra_length] = info.compress_type
        byteorder = [n for n in archive.namelist() if PurePosixPath(n).name == "byteorder"]
        little = all(archive.read(n) == b"little" for n in byteorder)
    tensors = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    stored = {name: t for name, t in tensors.items() if t.numel()}
    if not (little and records and stored and all(compress == zipfile.ZIP_STORED for compress in records.values())):
        return None
    base = min(t.untyped_storage().data_ptr() for t in stored.values()) - min(records)
    layout = {name: Stored(file, tuple(t.shape), None, t.dtype) for name, t in tensors.items() if not t.numel()}
    for name, t in stored.items():
        if not t.is_contiguous() or t.untyped_storage().data_ptr() - base not in records:
            return None
        offset = t.untyped_storage().data_ptr() - base + t.storage_offset() * t.element_size()
        layout[name] = Stored(file, tuple(t.shape), offset, t.dtype)
    return layout


def read(stored: Stored, name: str, dtype: torch.dtype, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Tensor `name` in `dtype` (a floating tensor; others as stored), or its rows [r0, r1) alone, on a mapping of its
    own of the bytes it is read from (safetensors' reader maps them itself), freed with the tensor or its copy in
    `dtype`."""
    from safetensors import safe_open

    if stored.dtype is None:
        with safe_open(str(stored.file), "pt") as f:
            tensor = f.get_tensor(name) if rows is None else f.get_slice(name)[rows[0] : rows[1]]
        return tensor.to(dtype) if tensor.is_floating_point() else tensor
    shape = (rows[1] - rows[0], *stored.shape[1:]) if rows else stored.shape
    length = math.prod(shape) * stored.dtype.itemsize
    if not length:
        tensor = torch.empty(shape, dtype=stored.dtype)
    else:
        start = stored.offset + (rows[0] * math.prod(stored.shape[1:]) * stored.dtype.itemsize if rows else 0)
        page = start - start % mmap.ALLOCATIONGRANULARITY  # (a mapping starts on a page)
        with open(stored.file, "rb") as f:  # a private mapping, as torch.frombuffer wants one it may write to
            mapping = mmap.mmap(f.fileno(), start + length - page, offset=page, access=mmap.ACCESS_COPY)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=length, offset=start - page)
        tensor = tensor.view(stored.dtype).view(shape)  # (it holds the mapping: unmapped when it goes)
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def stored_names(model: nn.Module, state: dict[str, torch.Tensor],
                 keys) -> tuple[dict[str, str], dict[str, list[list[str]]]] | None:
    """(model tensor name -> the checkpoint key holding it, stacked experts): each of `keys` renamed as from_pretrained
    renames it (transformers' conversion mapping for the model, then the base model's prefix added or stripped); keys
    that name no tensor of the model are left out, as from_pretrained leaves them. Stacked experts: a tensor that
    from_pretrained merges from one key per expert (`MergeModulelist`, along the experts), and per expert from
    several keys one after the other (`Concatenate`, along its rows: gate_proj then up_proj into gate_up_proj) ->
    for each of those sources, its keys by expert. None when a key would be converted otherwise (split, or merged in
    another way) or two keys name one tensor: only from_pretrained reads those."""
    import re

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    names: dict[str, str] = {}
    experts: dict[str, dict[tuple[int, int], str]] = {}  # tensor name -> (source, expert) -> key
    for key in keys:
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if name not in state and key in state:  # renamed away from a name of the model: as from_pretrained, kept
            name, converted = rename_source_key(key, [], [], model.base_model_prefix, state)
        if converted is not None:
            converter = next(c for c in converters if converted in c.source_patterns)
            ops = [(type(op), op.dim) for op in converter.operations]
            expert = re.search(re.escape(converted).replace(r"\*", r"(\d+)"), key)
            if ops not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]) or expert is None:
                return None
            source = (converter.source_patterns.index(converted), int(expert.group(1)))
            if name not in state or source in experts.setdefault(name, {}):
                return None
            experts[name][source] = key
            continue
        if name in names:
            return None
        if name in state:
            names[name] = key
    stacked = {}
    for name, sources in experts.items():  # every source of every expert, or nothing
        count = 1 + max(j for j, _ in sources)  # (a source missing altogether leaves the count short below)
        stacked[name] = [[sources.get((j, e)) for e in range(state[name].shape[0])] for j in range(count)]
        if len(sources) != count * state[name].shape[0] or name in names:
            return None
    return names, stacked


def _stacked_shapes(tensor: torch.Tensor, sources: list[list[str]], tensors: dict[str, Stored]) -> bool:
    """Do the keys `sources` (per source, by expert) hold the stacked experts `tensor` [E, N, K]: per expert, rows of
    K that the sources' add up to N?"""
    shapes = [{tensors[key].shape for key in keys} for keys in sources]
    return (all(len(s) == 1 and len(next(iter(s))) == 2 and next(iter(s))[1] == tensor.shape[2] for s in shapes)
            and sum(next(iter(s))[0] for s in shapes) == tensor.shape[1])


class Rows:
    """Rows of the tensor `name` stored at `stored`, in `dtype`, read a chunk of rows at a time (READ_CHUNK bytes at
    most, or the rows asked for), each chunk a read of its own: a `PackedLinear.pack` reader, whose calls ask for
    consecutive blocks of rows."""

    def __init__(self, stored: Stored, name: str, dtype: torch.dtype):
        self.stored, self.name, self.dtype, self.n = stored, name, dtype, stored.shape[0]
        self.chunk_rows = max(1, READ_CHUNK // max(1, stored.shape[1] * dtype.itemsize))
        self.start, self.chunk = 0, None  # the rows read last: [start, start + len(chunk))

    def __call__(self, r0: int, r1: int) -> torch.Tensor:
        if self.chunk is None or r0 < self.start or r1 > self.start + self.chunk.shape[0]:
            self.chunk = None  # (freed before the next chunk is read)
            end = min(self.n, max(r1, r0 + self.chunk_rows))
            self.start, self.chunk = r0, read(self.stored, self.name, self.dtype, (r0, end))
        return self.chunk[r0 - self.start : r1 - self.start]


def load_streamed(path: str | Path, dtype: torch.dtype, weights: str) -> nn.Module | None:
    """The model at `path` (of the auto class its config loads through: `hub.loading.auto_class_of`) with its linear
    layers packed in format `weights`, read layer by layer (see the module docstring); None when the checkpoint is
    not one this reads exactly as from_pretrained does."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.initialization import no_init_weights

    from specdec.hub.loading import auto_class_of
    from specdec.runtime.weights import pack_model

    path = Path(path)
    if not path.is_dir() or not isinstance(dtype, torch.dtype):
        return None
    tensors = checkpoint_tensors(path)
    config = AutoConfig.from_pretrained(str(path)) if tensors is not None else None
    if config is None or "quantization_config" in config.to_dict():
        return None
    with no_init_weights():
        model = auto_class_of(config).from_config(config, dtype=dtype)
    model.tie_weights()  # (skipped under no_init_weights; from_pretrained ties after loading)
    state = model.state_dict(keep_vars=True)  # name -> its empty tensor; tied tensors under each of their names
    found = stored_names(model, state, tensors)
    if found is None:
        return None
    stored_as, stacked = found
    if not all(_stacked_shapes(state[name], sources, tensors) for name, sources in stacked.items()):
        return None

    def expert_rows(name: str, e: int) -> torch.Tensor:
        """Expert e's matrix of the stacked experts `name` [N, K]: its sources' rows one after the other."""
        return torch.cat([read(tensors[keys[e]], keys[e], state[name].dtype) for keys in stacked[name]])

    names: dict[int, list[str]] = {}  # one entry per tensor object, with every name it has
    for name, tensor in state.items():
        names.setdefault(id(tensor), []).append(name)
    source: dict[int, str] = {}  # tensor object -> the key the checkpoint holds it under
    for key, group in names.items():
        stored = [stored_as[n] for n in group if n in stored_as and state[n].shape == tensors[stored_as[n]].shape]
        if not stored and not any(n in stacked for n in group):
            return None  # missing from the checkpoint, or of another shape
        source[key] = stored[0] if stored else None
    linear_weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    with torch.no_grad():
        for key, group in names.items():
            if all(n in linear_weights for n in group):
                continue  # a linear layer's own weight: read when it is packed
            target = state[group[0]]
            if source[key] is None:  # stacked experts: read when packed (`fill_experts`)
                continue
            target.copy_(read(tensors[source[key]], source[key], target.dtype))

    def fill(name: str, linear: nn.Linear) -> Rows | None:
        key = source[id(state[f"{name}.weight"])]
        if linear.weight.numel() * linear.weight.element_size() > READ_CHUNK:
            return Rows(tensors[key], key, linear.weight.dtype)  # read while it is packed, a chunk at a time
        linear.weight = nn.Parameter(read(tensors[key], key, linear.weight.dtype), requires_grad=False)
        return None

    def fill_experts(name: str) -> Callable[[int, int], torch.Tensor]:
        stacks = (f"{name}.gate_up_proj", f"{name}.down_proj")
        return lambda j, e: expert_rows(stacks[j], e)

    pack_model(model, weights, fill=fill, fill_experts=fill_experts)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    return model.eval()
