"""A target pass by op class: specdec's compiled pass, with and without its row-invariant kernels, against
OpenVINO's, on one checkpoint, at float32 and bfloat16, one thread.

    taskset -c 1 python benchmarks/op_classes.py                      # default target (takes the lock itself)
    taskset -c 1 python benchmarks/op_classes.py --random-llama 0.5b --dtypes bfloat16   # ~0.5B Llama
    taskset -c 1 python benchmarks/op_classes.py --model-dir CHECKPOINT --weights w8a8 --dtypes bfloat16 \
        --sides specdec --name NAME       # a packed format against OpenVINO's weights of the same bits
    python benchmarks/op_classes.py --table-from docs/bench/op-classes/default-target.json   # tables only

After a prefill of `--prompt-len` tokens, passes of 1 row and of γ+1 rows (γ from `--gamma`) are run on each side,
`--steps` passes in a row from that context (the context grows as in decoding), and the KV cache is rolled back
to the prompt for the next run; the sides and the row counts are interleaved, `--blocks` times. Compiles and
exports run outside the benchmark lock (`--lock`, default /tmp/specdec-bench.lock, taken with flock); every timed
or profiled section holds it. The sides:

- **specdec** (`specdec`): the fast path's compiled target pass, `StaticCausalLM(model, compile=True)` with its
  default inductor options (`specdec.runtime.compiled.COMPILE_OPTIONS`), timed around `StaticCausalLM.forward`
  (the adapter's host work included), rolled back with `crop`;
- **specdec, HF kernels** (`hf`): the same pass as it was before the row-invariant kernels, on a second copy of
  the model: `slot_cache.run_model` does not enter `rowwise.row_invariant` (this script swaps that name for a
  no-op context while it compiles and runs this side; the library is unchanged), so `F.linear` and
  `F.scaled_dot_product_attention` go to inductor and PyTorch's own kernels, and inductor is given the options of
  then (no `emulate_precision_casts`). It is not row-invariant: a low-precision pass's rounding depends on its
  row count (docs/exactness.md);
- **specdec, HF kernels, unfrozen** (`hf-unfrozen`): as `hf`, and also without `freezing` and
  `cpp.enable_concat_linear`: the fast path as it was before 5c12581 (freezing was asked for but froze nothing,
  the weights reaching inductor as graph inputs, so no linear ran on pre-packed weights);
- **OpenVINO**: the same checkpoint exported by the bench's own export path (`specdec.bench.openvino_export`,
  cached by content hash), compiled on CPU at `INFERENCE_PRECISION_HINT` and `KV_CACHE_PRECISION` of the dtype,
  `INFERENCE_NUM_THREADS` = `--threads`, run as the stateful model it is (input_ids, attention_mask,
  position_ids, beam_idx), timed around `InferRequest.infer`, rolled back by restoring the KV state saved after
  the prefill.

`--sides` picks the specdec sides (default all three; `specdec` always). The split by op class comes from each
side's own profiler, on a second build: for specdec the same passes compiled without `cpp_wrapper` (the C++ wrapper
hides inductor's kernels from `torch.profiler`) and with inductor's kernel profiling on, under `torch.profiler`; for
OpenVINO a compiled model with `PERF_COUNT`, read with `get_profiling_info()` before and after the profiled passes
(its counters are running means).

`--weights` loads specdec's side on packed weights of that format (`load_model(weights=...)`, runtime/weights.py;
the specdec side only: the HF-kernel sides run the model's own layers) and exports OpenVINO's at the same bits
(`OV_WEIGHTS`, as `benchmarks/ladder_peers.py` pairs them: int8 / w8a8 against INT8, int4 / w4a8 against INT4). The
bytes a one-row pass reads are then the packed weights' own. Classes:

| class | specdec | specdec, HF kernels (both) | OpenVINO |
|---|---|---|---|
| linear | `specdec::row_linear` and `specdec::packed_linear` but the LM head | the GEMM calls (`mkl::_mkl_linear`, `mkldnn::_linear_pointwise`, `aten::mm`/`addmm`) but the LM head | FullyConnected / MatMul but the LM head and the rotary table |
| LM head | the vocabulary-sized `specdec::row_linear` or `specdec::packed_linear` | the vocabulary-sized GEMM | the vocabulary-sized FullyConnected |
| attention | `specdec::row_attention` | the SDPA call, or its batched matmuls where inductor decomposed it | ScaledDotProductAttention(WithKVCache) (it also writes the KV cache) |
| norm + rope + pointwise | inductor's fused kernels (`cpp_fused_*`: norms, rotary, SiLU·up, residual adds, the KV-cache write, the embedding gather) | as specdec (and a decomposed attention's softmax) | RMS, MVN, RoPE, Eltwise, Subgraph and the elementwise nodes, the rotary table |
| rest | the profiled pass less the above: dynamo's guard check, the Python wrapper, allocations, the adapter's host work | as specdec | the pass less the above: the remaining nodes (embedding Gather, ReadValue / Assign of the KV state, shape nodes, reorders) and the runtime's own work |

Each class's figure is its median over the profiled passes (OpenVINO: the mean, all its counters give); "rest" is
the profiled pass (median; OpenVINO: mean wall time of the profiled passes) less the four. The
results JSON keeps each side's unprofiled wall time (median and minimum per pass) of the default build, the
profiling build's unprofiled wall time, and the profiled total, so the profiler's own cost can be read off.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script below

from ladder_peers import OV_PAIRS  # noqa: E402

CLASSES = ("linear", "LM head", "attention", "norm + rope + pointwise", "rest")
SIDES = ("specdec", "hf", "hf-unfrozen", "openvino")
SIDE_LABELS = {"specdec": "specdec", "hf": "specdec, HF kernels", "hf-unfrozen": "specdec, HF kernels, unfrozen",
               "openvino": "OpenVINO"}
#: Random Llama-shaped models (`--random-llama`): name -> LlamaConfig fields. 0.5b: 0.44B parameters (untied LM head).
RANDOM_LLAMA = {
    "0.5b": dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=4096, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False,
                 rms_norm_eps=1e-6),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHORT = {"float32": "f32", "bfloat16": "bf16"}
#: specdec's weight format (--weights) -> OpenVINO's export format at the same bits: ladder_peers.py's pairs.
OV_WEIGHTS = {None: "fp32", "float32": "fp32", **OV_PAIRS}
OV_PRECISION = {"float32": "f32", "bfloat16": "bf16"}
OV_LINEAR = ("FullyConnected", "FullyConnectedCompressed", "MatMul", "LLMMLP", "QKVProjection")
OV_POINTWISE = ("RMS", "MVN", "RoPE", "Eltwise", "Subgraph", "Multiply", "Add", "Subtract", "Divide", "Power",
                "Sqrt", "Swish", "SwishCPU", "Sigmoid", "Cos", "Sin", "ReduceMean", "Convert")
#: torch.profiler op names of the HF-kernels build: GEMMs and attention (anything else inside a pass that is not
#: an inductor kernel counts as "rest").
TORCH_LINEAR = ("mkl::_mkl_linear", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear")
TORCH_ATTENTION = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                   "aten::bmm", "aten::baddbmm")
#: Inductor options left out of the fast path's for a side: "hf" as before the row-invariant kernels
#: (emulate_precision_casts came with them); "hf-unfrozen" as when the issue measured the fast path (freezing was
#: asked for but froze nothing, the weights being graph inputs, and linears were not concatenated).
DROPPED_OPTIONS = {"specdec": (), "hf": ("emulate_precision_casts",),
                   "hf-unfrozen": ("emulate_precision_casts", "freezing", "cpp.enable_concat_linear")}


# -- the benchmark lock ---------------------------------------------------------------------------------------
class BenchLock:
    """flock on `path` around the timed sections only (compiles and exports run without it); records each hold."""

    def __init__(self, path: str | None):
        self.path = path
        self.holds: list[float] = []

    @contextlib.contextmanager
    def held(self):
        if not self.path:
            yield
            return
        with open(self.path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            start = time.perf_counter()
            try:
                yield
            finally:
                self.holds.append(time.perf_counter() - start)
                fcntl.flock(f, fcntl.LOCK_UN)


# -- models -------------------------------------------------------------------------------------------------
def random_llama_dir(name: str, root: Path) -> Path:
    """A random Llama-shaped checkpoint (seed 0, weights stored in bfloat16 so both dtypes see the same values),
    saved once under `root` and reused (the OpenVINO export is cached by its content hash)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = root / f"specdec-random-llama-{name}"
    if (out / "done").is_file():
        return out
    torch.manual_seed(0)
    config = LlamaConfig(**RANDOM_LLAMA[name], bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(out)
    (out / "done").write_text("")
    return out


def load(model_dir: Path, dtype: torch.dtype, weights: str | None = None):
    from specdec.hub.loading import load_model

    return load_model(model_dir, "cpu", dtype, weights=weights)


def weight_numel(model) -> int:
    """Weights a one-row pass reads: every parameter once, less the input embedding unless the LM head shares it
    (a pass gathers a few of its rows)."""
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p.data_ptr() == embed.data_ptr() and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel()
    return total


def parameter_count(model) -> int:
    """Parameters, packed linears' weights included (they are buffers)."""
    from specdec.runtime.weights import PackedLinear

    packed = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, PackedLinear))
    return sum(p.numel() for p in model.parameters()) + packed


def bytes_read(model) -> int:
    """Bytes a one-row pass reads of a model on packed weights: every parameter and buffer once (packed linears
    are buffers), less the input embedding unless the LM head is the same tensor (a pass gathers a few rows)."""
    from specdec.runtime.weights import PackedLinear

    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = not isinstance(head, PackedLinear) and head.weight.data_ptr() == embed.data_ptr()
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if t.data_ptr() in seen or (t.data_ptr() == embed.data_ptr() and not tied):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


# -- specdec ------------------------------------------------------------------------------------------------
def _no_kernels(linear: bool = False):
    return contextlib.nullcontext()


@contextlib.contextmanager
def pass_kernels(side: str):
    """The kernels a specdec pass is traced and run with: the fast path's own ("specdec"), or, for "hf", the
    fast path without `row_invariant` (PyTorch's and inductor's kernels, as before the row-invariant kernels).
    The HF side's compiled graphs guard on the name swapped here, so its passes run inside this context too."""
    if side == "specdec":
        yield
        return
    from specdec.runtime import slot_cache

    with mock.patch.object(slot_cache, "row_invariant", _no_kernels):
        yield


@contextlib.contextmanager
def compile_options(side: str, profiling: bool):
    """`compiled.COMPILE_OPTIONS` for a side's build: the fast path's, less `DROPPED_OPTIONS[side]`, less
    cpp_wrapper for a profiling build (the C++ wrapper hides inductor's kernels from torch.profiler), with
    inductor's kernel profiling on in a profiling build."""
    import torch._inductor.config as inductor_config

    from specdec.runtime import compiled

    dropped = (*DROPPED_OPTIONS[side], *(("cpp_wrapper",) if profiling else ()))
    options = {k: v for k, v in compiled.COMPILE_OPTIONS.items() if k not in dropped}
    with mock.patch.object(compiled, "COMPILE_OPTIONS", options), \
            inductor_config.patch({"cpp.enable_kernel_profile": profiling}):
        yield


class SpecdecSide:
    """A compiled fast-path target adapter after a prefill; `run` times `steps` passes of `rows` rows."""

    def __init__(self, model, side: str, prompt: torch.Tensor, rows: tuple[int, ...], capacity: int,
                 profiling: bool = False):
        from specdec.runtime.static_lm import StaticCausalLM

        self.model, self.side = model, side
        with compile_options(side, profiling), pass_kernels(side):
            self.adapter = StaticCausalLM(model, compile=True)
            self.adapter.buckets = tuple(sorted(rows))
            self.adapter.ensure_capacity(capacity)
            self.adapter.prefill(prompt)
            self.start = self.adapter.length
            start = time.perf_counter()
            self.adapter.precompile(sorted(rows))
            self.compile_s = time.perf_counter() - start

    def run(self, rows: int, steps: int, hook=None) -> list[float]:
        ids = torch.full((rows,), 7, dtype=torch.long)
        self.adapter.crop(self.start)
        times = []
        with pass_kernels(self.side):
            for _ in range(steps):
                start = time.perf_counter()
                if hook is None:
                    self.adapter.forward(ids)
                else:
                    with hook():
                        self.adapter.forward(ids)
                times.append(time.perf_counter() - start)
        return times


def torch_class(name: str, input_shapes, vocab: int) -> str | None:
    """The op class of one torch.profiler event of a specdec pass, or None (not one of the four)."""
    if name == "specdec::row_linear" or name in TORCH_LINEAR:
        lm_head = any(len(s) == 2 and vocab in s for s in input_shapes[1:])  # [V, H], or [H, V] unfrozen
        return "LM head" if lm_head else "linear"
    if name == "specdec::packed_linear":  # packed weights: [N / panel, ...] in every format
        panel = torch.ops.specdec.panel_width()
        packed = input_shapes[1]
        lm_head = len(packed) >= 2 and vocab <= packed[0] * panel < vocab + panel
        return "LM head" if lm_head else "linear"
    if name == "specdec::row_attention" or name in TORCH_ATTENTION:
        return "attention"
    if "cpp_fused" in name:
        return "norm + rope + pointwise"
    return None


def specdec_profile(side: SpecdecSide, rows: int, steps: int, vocab: int) -> list[dict[str, float]]:
    """Per profiled pass: seconds by op class, with "total" (the pass) and "guard" (dynamo's cache lookup). An
    event inside another classified event (aten::addmm under aten::linear) is counted once, in the outer one."""
    side.run(rows, 2)  # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        side.run(rows, steps, hook=lambda: torch.profiler.record_function("op_classes.pass"))
    events = list(prof.events())
    passes = sorted((e for e in events if e.name == "op_classes.pass"), key=lambda e: e.time_range.start)
    out = []
    for p in passes:
        lo, hi = p.time_range.start, p.time_range.end
        split = defaultdict(float)
        for e in events:
            if not (lo <= e.time_range.start and e.time_range.end <= hi):
                continue
            if e.name == "TorchDynamo Cache Lookup":
                split["guard"] += e.cpu_time_total
                continue
            cls = torch_class(e.name, e.input_shapes or [], vocab)
            if cls is None or _classified_ancestor(e, vocab):
                continue
            split[cls] += e.cpu_time_total
        split["total"] = p.cpu_time_total
        out.append({k: v * 1e-6 for k, v in split.items()})
    return out


def _classified_ancestor(event, vocab: int) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if torch_class(parent.name, parent.input_shapes or [], vocab) is not None:
            return True
        parent = parent.cpu_parent
    return False


def op_names(side: SpecdecSide, rows: int) -> dict[str, float]:
    """Every op name under one profiled pass with its total µs (kept in the JSON to check the classes)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        side.run(rows, 1)
    return {e.key: round(e.cpu_time_total, 1) for e in prof.key_averages()}


# -- OpenVINO -----------------------------------------------------------------------------------------------
class OpenVINOSide:
    """The exported checkpoint compiled on CPU, its request after the prefill with the KV state saved; `run` times
    `steps` passes of `rows` rows from there, `profile` splits them by op class on a second, profiling build."""

    def __init__(self, ir_dir: Path, dtype: str, threads: int, prompt: list[int]):
        import openvino as ov

        self.ov = ov
        self.core = ov.Core()
        self.model = self.core.read_model(str(ir_dir / "openvino_model.xml"))
        self.properties = {"INFERENCE_PRECISION_HINT": OV_PRECISION[dtype], "KV_CACHE_PRECISION": OV_PRECISION[dtype],
                           "INFERENCE_NUM_THREADS": threads}
        self.prompt = prompt
        self.request = self.core.compile_model(self.model, "CPU", self.properties).create_infer_request()
        self.request.reset_state()
        self.request.infer(self.feed(prompt, 0))
        self.saved = [(s, s.state.data.copy()) for s in self.request.query_state()]
        self.start = len(prompt)

    @staticmethod
    def feed(ids: list[int], past: int) -> dict:
        import numpy as np

        n = len(ids)
        return {"input_ids": np.asarray([ids], dtype=np.int64),  # [1, n]
                "attention_mask": np.ones((1, past + n), dtype=np.int64),  # [1, past + n]
                "position_ids": np.arange(past, past + n, dtype=np.int64)[None],  # [1, n]
                "beam_idx": np.zeros(1, dtype=np.int32)}  # [1]

    def run(self, rows: int, steps: int) -> list[float]:
        for state, data in self.saved:
            state.state = self.ov.Tensor(data)
        feeds = [self.feed([7] * rows, self.start + i * rows) for i in range(steps)]
        times = []
        for f in feeds:
            start = time.perf_counter()
            self.request.infer(f)
            times.append(time.perf_counter() - start)
        return times

    def profile(self, rows: int, steps: int, warm: int = 3) -> dict[str, float]:
        """Mean seconds per pass by op class over `steps` passes of `rows` rows after the prompt (and `warm`
        passes), on a fresh build with PERF_COUNT. The CPU plugin reports each node's mean time over every
        inference of the request so far (in whole microseconds), so the passes' own mean is recovered from the
        counters read before and after them: (n1 · mean1 - n0 · mean0) / steps."""
        request = self.core.compile_model(self.model, "CPU", {**self.properties, "PERF_COUNT": True}) \
            .create_infer_request()
        request.reset_state()
        request.infer(self.feed(self.prompt, 0))
        feeds = [self.feed([7] * rows, self.start + i * rows) for i in range(warm + steps)]
        for f in feeds[:warm]:
            request.infer(f)
        before = ov_classes(request.get_profiling_info())
        wall = 0.0
        for f in feeds[warm:]:
            start = time.perf_counter()
            request.infer(f)
            wall += time.perf_counter() - start
        after = ov_classes(request.get_profiling_info())
        n0, n1 = 1 + warm, 1 + warm + steps
        out = {c: (n1 * after.get(c, 0.0) - n0 * before.get(c, 0.0)) / steps for c in after}
        out["total"] = wall / steps
        out["rest"] = out["total"] - sum(out.get(c, 0.0) for c in CLASSES[:-1])
        return out


def ov_class(node_type: str, node_name: str) -> str | None:
    if node_type in OV_LINEAR:
        if "lm_head" in node_name:
            return "LM head"
        return "norm + rope + pointwise" if "rotary" in node_name else "linear"
    if node_type.startswith("ScaledDotProductAttention"):
        return "attention"
    if node_type in OV_POINTWISE:
        return "norm + rope + pointwise"
    return None


def ov_classes(info) -> dict[str, float]:
    """Seconds by op class from OpenVINO's per-node counters, with "nodes", the sum over every node."""
    split = defaultdict(float)
    for node in info:
        seconds = node.real_time.total_seconds()
        split["nodes"] += seconds
        cls = ov_class(node.node_type, node.node_name)
        if cls is not None:
            split[cls] += seconds
    return dict(split)


# -- summary ------------------------------------------------------------------------------------------------
def class_medians(splits: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds per class over the passes; rest = median total less the four classes."""
    out = {c: statistics.median(s.get(c, 0.0) for s in splits) for c in CLASSES[:-1]}
    for extra in ("total", "guard", "nodes"):
        if any(extra in s for s in splits):
            out[extra] = statistics.median(s.get(extra, 0.0) for s in splits)
    out["rest"] = out["total"] - sum(out[c] for c in CLASSES[:-1])
    return out


def summarise(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "n": len(times)}


def fmt_ms(x: float) -> str:
    return f"{1e3 * x:.3f}" if x < 0.01 else f"{1e3 * x:.2f}" if x < 0.1 else f"{1e3 * x:.1f}"


def table(results: dict) -> str:
    """The markdown table of one results JSON: a row per (dtype, rows, side), ms per pass by op class."""
    lines = ["| dtype | rows | side | " + " | ".join(CLASSES) + " | profiled | **wall** (median) | wall (min) |"
             + " profiling build, wall |",
             "|:---|---:|:---|" + "---:|" * (len(CLASSES) + 4)]
    for d in results["dtypes"]:
        for r in results["rows"]:
            for s in SIDES:
                run = results["runs"].get(f"{s}/{d}/{r}")
                if run is None:
                    continue
                build = run.get("profiling_build_wall")
                cells = [fmt_ms(run["classes"][c]) for c in CLASSES] + [
                    fmt_ms(run["classes"]["total"]), f"**{fmt_ms(run['wall']['median_s'])}**",
                    fmt_ms(run["wall"]["min_s"]), fmt_ms(build["median_s"]) if build else "–"]
                lines.append(f"| {SHORT[d]} | {r} | {SIDE_LABELS[s]} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    bandwidth = []
    for d in results["dtypes"]:
        for s in SIDES:
            run = results["runs"].get(f"{s}/{d}/1")
            if run is not None:
                gb = results["weight_bytes"][d] / run["wall"]["median_s"] / 1e9
                bandwidth.append(f"{SIDE_LABELS[s]} {SHORT[d]} {gb:.1f} GB/s")
    if results.get("weights"):
        read = ", ".join(f"{b / 1e6:.1f} MB in {d}" for d, b in results["weight_bytes"].items())
        text += f"\nBytes a one-row pass reads on {results['weights']} weights (packed, with the norms): {read}"
    else:
        text += (f"\nWeights read by a one-row pass: {results['weight_bytes']['float32'] / 1e6:.1f} MB in float32, "
                 f"{results['weight_bytes']['bfloat16'] / 1e6:.1f} MB in bfloat16")
    ov = (f"; OpenVINO's {results['openvino_weights']} export reads its own bytes, counted here as specdec's"
          if results.get("weights") and results.get("openvino_weights") else "")
    text += f"; achieved (these bytes ÷ median one-row wall time{ov}): {', '.join(bandwidth)}.\n"
    ratios = []
    for d in results["dtypes"]:
        for r in results["rows"]:
            runs = {s: results["runs"].get(f"{s}/{d}/{r}") for s in SIDES}
            if runs["specdec"] is None:
                continue
            own = runs["specdec"]["wall"]["median_s"]
            parts = [f"{SIDE_LABELS[s]} {runs[s]['wall']['median_s'] / own:.2f}x" for s in SIDES[1:]
                     if runs[s] is not None]
            if parts:
                ratios.append(f"{SHORT[d]} {r} rows: " + ", ".join(parts))
    if ratios:
        text += "\nWall time relative to specdec's pass (below 1: faster than specdec): " + "; ".join(ratios) + ".\n"
    return text


def markdown(results: dict) -> str:
    m = results["model"]
    holds = results.get("lock_holds_s") or []
    text = (f"# A target pass by op class: {results['name']}\n\n"
            f"`{results['command']}` ({results['when']}, {results.get('cpu', results['machine'])}, torch "
            f"{results['torch']}, OpenVINO {results.get('openvino') or '–'}; load average "
            f"{results['load_before']} before, {results['load_after']} after; pinned to CPU "
            f"{results.get('cpu_affinity', '?')}, timed sections under `flock {results.get('lock') or '(none)'}`"
            + (f", {len(holds)} holds of at most {max(holds):.0f} s" if holds else "") + "). "
            f"Model: {m['source']}, {m['parameters'] / 1e6:.1f}M parameters ({m['layers']} layers, hidden "
            f"{m['hidden']}, intermediate {m['intermediate']}, {m['heads']} heads / {m['kv_heads']} KV heads, "
            f"vocabulary {m['vocab']}). Prompt {results['prompt_len']} tokens, then {results['steps']} passes of "
            f"each row count from there, {results['blocks']} interleaved blocks; {results['threads']} thread on "
            f"every side. Rows per pass: 1 = a decoding step, γ+1 = a verification pass. Sides: specdec = the "
            f"compiled fast path as shipped (row-invariant kernels); specdec, HF kernels = the same compiled pass "
            f"without them (as before those kernels); OpenVINO = the optimum-intel export on OpenVINO's CPU "
            f"plugin. Classes: milliseconds per pass under each side's profiler (median over "
            f"{results['profile_steps']} profiled passes, a separate profiling build for specdec; OpenVINO: "
            f"the mean, from its per-node counters); profiled: the profiled pass, rest: that less the four "
            f"classes; wall: milliseconds per pass without a profiler (median and minimum over every timed pass).\n\n")
    return text + table(results)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    extra = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(extra) or 'no AVX-512'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", help="a causal-LM checkpoint directory (default: the shipped target)")
    parser.add_argument("--random-llama", choices=sorted(RANDOM_LLAMA), help="a random Llama-shaped model")
    parser.add_argument("--name", help="output name (default: default-target, or random-llama-SIZE)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--gamma", default="4", help="γ values (comma-separated): passes of γ+1 rows")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16, help="passes per row count and block")
    parser.add_argument("--blocks", type=int, default=8, help="interleaved repetitions")
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-openvino", action="store_true", help="specdec's sides only")
    parser.add_argument("--weights", choices=[f for f in OV_WEIGHTS if f], default=None,
                        help="specdec's side on packed weights of this format, OpenVINO's at the same bits (--sides "
                             "specdec only)")
    parser.add_argument("--sides", default="specdec,hf,hf-unfrozen",
                        help="specdec sides (comma-separated): specdec, hf (HF kernels), hf-unfrozen (HF kernels, "
                             "weights not frozen: the fast path as the issue measured it)")
    parser.add_argument("--lock", default="/tmp/specdec-bench.lock",
                        help="flock this file around the timed sections ('' for none)")
    parser.add_argument("--openvino-cache", help="export cache (default: $SPECDEC_OPENVINO_CACHE or ~/.cache)")
    parser.add_argument("--openvino-export-env", help="export environment (default: $SPECDEC_OPENVINO_EXPORT_ENV)")
    parser.add_argument("--out", default="docs/bench/op-classes", help="directory for NAME.md and NAME.json")
    parser.add_argument("--table-from", help="print the markdown of a results JSON and exit")
    args = parser.parse_args()
    if args.table_from:
        print(markdown(json.loads(Path(args.table_from).read_text())), end="")
        return

    from specdec.hub.default_pair import default_assets_dir
    from specdec.runtime import compiled

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    lock = BenchLock(args.lock or None)
    if args.random_llama:
        model_dir = random_llama_dir(args.random_llama, Path(tempfile.gettempdir()))
        name = args.name or f"random-llama-{args.random_llama}"
        source = f"random Llama-shaped (seed 0, bfloat16-valued weights), `--random-llama {args.random_llama}`"
    else:
        model_dir = Path(args.model_dir) if args.model_dir else default_assets_dir() / "target"
        name = args.name or ("default-target" if not args.model_dir else model_dir.name)
        source = "the shipped default target" if not args.model_dir else str(model_dir)
    rows = (1, *(int(g) + 1 for g in args.gamma.split(",")))
    dtypes = args.dtypes.split(",")
    sides = tuple(args.sides.split(","))
    if "specdec" not in sides or not set(sides) <= set(DROPPED_OPTIONS):
        parser.error(f"--sides: specdec and any of {sorted(set(DROPPED_OPTIONS) - {'specdec'})}")
    if args.weights and sides != ("specdec",):
        parser.error("--weights packs specdec's side only: add --sides specdec")
    ir_dir, ov_version = None, None
    timings = {}
    if not args.no_openvino:
        import openvino

        from specdec.bench.openvino_export import exported

        ov_version = openvino.__version__
        start = time.perf_counter()
        export = exported(model_dir, args.openvino_cache, args.openvino_export_env, OV_WEIGHTS[args.weights])
        ir_dir = export.path
        timings["openvino export (s)"] = time.perf_counter() - start
    load_before = os.getloadavg()
    g = torch.Generator().manual_seed(0)
    command = "python benchmarks/op_classes.py" + (f" --random-llama {args.random_llama}" if args.random_llama else "")
    command += f" --model-dir {args.model_dir}" if args.model_dir else ""
    command += f" --weights {args.weights}" if args.weights else ""
    command += f" --dtypes {args.dtypes} --gamma {args.gamma} --sides {args.sides}" + (
        " --no-openvino" if args.no_openvino else "")
    results = {"name": name, "command": command, "when": time.strftime("%Y-%m-%d %H:%M"),
               "machine": platform.machine(), "cpu": cpu_model(), "cpu_affinity": sorted(os.sched_getaffinity(0)),
               "torch": torch.__version__, "openvino": ov_version, "lock": args.lock or None, "rows": list(rows),
               "dtypes": dtypes, "prompt_len": args.prompt_len, "steps": args.steps, "blocks": args.blocks,
               "profile_steps": args.profile_steps, "threads": args.threads, "runs": {}, "weight_bytes": {},
               "weights": args.weights, "openvino_weights": None if args.no_openvino else OV_WEIGHTS[args.weights],
               "timings_s": timings, "openvino_ir": str(ir_dir) if ir_dir else None, "op_names": {}}
    capacity = args.prompt_len + max(args.steps, args.profile_steps + 2) * max(rows) + max(rows)
    for dtype in dtypes:
        models = {"specdec": load(model_dir, DTYPES[dtype], args.weights)}
        model = models["specdec"]
        for s in sides[1:]:
            models[s] = copy.deepcopy(model)  # compiled graphs are cached per model object
        config = model.config
        vocab = config.vocab_size
        prompt = torch.randint(8, vocab, (args.prompt_len,), generator=g)
        results["model"] = {"source": source, "parameters": parameter_count(model),
                            "layers": config.num_hidden_layers, "hidden": config.hidden_size,
                            "intermediate": config.intermediate_size, "heads": config.num_attention_heads,
                            "kv_heads": config.num_key_value_heads, "vocab": vocab}
        if args.weights:
            results["weight_bytes"][dtype] = bytes_read(model)
        else:
            results["weight_bytes"] = {"float32": 4 * weight_numel(model), "bfloat16": 2 * weight_numel(model)}
        built = {}
        for s in sides:
            built[s] = SpecdecSide(models[s], s, prompt, rows, capacity)
            timings[f"{s} compile {dtype} (s)"] = built[s].compile_s
        ov = None
        if ir_dir is not None:
            start = time.perf_counter()
            ov = OpenVINOSide(ir_dir, dtype, args.threads, prompt.tolist())
            timings[f"openvino compile + prefill {dtype} (s)"] = time.perf_counter() - start
        walls = defaultdict(list)
        with lock.held():
            start = time.perf_counter()
            for r in rows:  # warm every side
                for s in sides:
                    built[s].run(r, 2)
                if ov is not None:
                    ov.run(r, 2)
            for block in range(args.blocks):
                for r in rows:
                    order = [*sides, *(("openvino",) if ov is not None else ())]
                    order = order[block % len(order):] + order[:block % len(order)]  # rotate who goes first
                    for s in order:
                        walls[f"{s}/{dtype}/{r}"] += (ov.run(r, args.steps) if s == "openvino"
                                                      else built[s].run(r, args.steps))
            timings[f"timed passes {dtype} (s)"] = time.perf_counter() - start
            if ov is not None:
                start = time.perf_counter()
                for r in rows:
                    results["runs"][f"openvino/{dtype}/{r}"] = {
                        "wall": summarise(walls[f"openvino/{dtype}/{r}"]),
                        "classes": ov.profile(r, args.profile_steps)}
                timings[f"openvino profile {dtype} (s)"] = time.perf_counter() - start
        ov = None
        del built
        for s in sides:  # the profiling builds, one at a time
            compiled.COMPILED.pop(models[s], None)
            torch._dynamo.reset()
            start = time.perf_counter()
            prof = SpecdecSide(models[s], s, prompt, rows, capacity, profiling=True)
            timings[f"{s} profiling build {dtype} (s)"] = time.perf_counter() - start
            build_walls = defaultdict(list)
            with lock.held():
                start = time.perf_counter()
                for r in rows:
                    prof.run(r, 2)
                for _ in range(max(1, args.blocks // 2)):
                    for r in rows:
                        build_walls[r] += prof.run(r, args.steps)
                for r in rows:
                    splits = specdec_profile(prof, r, args.profile_steps, vocab)
                    results["runs"][f"{s}/{dtype}/{r}"] = {"wall": summarise(walls[f"{s}/{dtype}/{r}"]),
                                                           "profiling_build_wall": summarise(build_walls[r]),
                                                           "classes": class_medians(splits)}
                timings[f"{s} profile {dtype} (s)"] = time.perf_counter() - start
            for r in rows:
                results["op_names"][f"{s}/{dtype}/{r}"] = op_names(prof, r)
            del prof
        del models, model
        torch._dynamo.reset()
        print(f"{dtype} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    results["unplanned_recompiles"] = [str(k) for k in compiled.UNPLANNED_RECOMPILES]
    results["load_before"] = " ".join(f"{x:.2f}" for x in load_before)
    results["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results["lock_holds_s"] = [round(h, 1) for h in lock.holds]
    timings["total (s)"] = time.perf_counter() - t_start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    text = markdown(results)
    (out / f"{name}.md").write_text(text)
    print(text, end="")
    print("\n" + json.dumps(timings, indent=1))


if __name__ == "__main__":
    main()
