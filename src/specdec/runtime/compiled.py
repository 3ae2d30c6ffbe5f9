"""The fast path's compiled shapes: which models and machines can take it (`fast_path_problem`, with a
`FastPathWarning` when they cannot), the inductor options, and the registry of compiled callables shared by
every adapter of one model object (`compile_once`), each compiled once per shape key and logged with its time.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import re
import time
import types
import warnings
import weakref

import torch
from transformers import PreTrainedModel

from specdec.runtime.causal_lm import context_length
from specdec.runtime.compute_once import ComputeOnce
from specdec.runtime.fuse_linears import FuseRowLinears, weights_fingerprint
from specdec.runtime.layer_graphs import LayerRegions
from specdec.runtime.rowwise import row_invariant, vector_isa_proven
from specdec.runtime.shared_kv_heads import ShareKVHeads

log = logging.getLogger("specdec.fastpath")

#: Query lengths a verification pass is padded to when the decoder has not planned its own.
DEFAULT_BUCKETS = (1, 2, 3, 5, 9, 17, 33)
#: Cache sizes are rounded up to a multiple of this, so nearby requests share compiled shapes.
CACHE_ROUND = 256

#: Inductor options measured on the default pair (docs/fastpath.md). `freezing` folds the weights in as
#: constants (only valid while they do not change: inference), which lets inductor pre-pack them for oneDNN /
#: MKL; `cpp.enable_concat_linear` then runs the linears that share an input (q/k/v, gate/up) as one (and
#: `Compiled.options` adds the graph pass that does the same for the row-invariant linear's calls).
#: `cpp_wrapper_build_separate` compiles the C++ wrapper (one straight-line call per kernel of every layer: 5,300
#: lines at 24 layers) at -O1 apart from the kernels, which keep -O3 and their flags, so the same bits: at the
#: Qwen2.5-0.5B shape on a Zen 4 core it halved a pass's compile (58 -> 31 s) at the same pass time (docs/fastpath.md).
COMPILE_OPTIONS = {"freezing": True, "cpp_wrapper": True, "cpp.enable_concat_linear": True,
                   "emulate_precision_casts": True, "cpp_wrapper_build_separate": True}

#: A CUDA model's passes run as CUDA graphs (inductor's graph trees): one replay per pass instead of a launch per
#: kernel, which is what bounds a small model's pass on a GPU. They need the Python wrapper, and inputs that a pass
#: writes (the cache's keys and values) at static addresses (`slot_cache.static_address`); the weights stay the
#: graph's inputs, not frozen constants, since freezing would make the static cache a constant of the graph too.
#: Off, a CUDA pass compiles as a CPU one does (the C++ wrapper, frozen weights).
CUDA_GRAPHS = True
CUDA_GRAPH_OPTIONS = {"triton.cudagraphs": True, "freezing": False, "cpp_wrapper": False,
                      "cpp_wrapper_build_separate": False}

#: A model compiled by layer (runtime/layer_graphs.py): its weights stay inputs of the graph, since one region serves
#: every layer, so freezing has nothing to fold, and `runtime/fuse_linears.py`'s pass is left out with the hash of
#: the weights that keys it (the layers' linears were never fused or packed). With freezing on, AOTAutograd's cache
#: refused every such graph and a new process traced each again: at the Qwen2.5-0.5B shape on a Zen 2 core a warm
#: first request compiled in 9.5 s without it against 16.0 s with it, at the same decoding speed (docs/fastpath.md).
LAYER_GRAPH_OPTIONS = {"freezing": False}


def static_cache_problem(model: PreTrainedModel) -> str | None:
    """Why `model` cannot run on the static cache, or None when it can."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    limit = context_length(model)
    # A window at least as long as the model's context never hides a key: plain causal attention.
    if window and getattr(config, "use_sliding_window", True) is not False and (limit is None or window < limit):
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None or any(t != "full_attention" for t in layer_types):
            return (f"{type(model).__name__} uses sliding-window attention (window {window} < context "
                    f"{limit}), whose rolling cache the slot cache does not model")
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        return f"{type(model).__name__} mixes attention types {sorted(set(layer_types))}"
    if getattr(config, "add_cross_attention", False):
        return f"{type(model).__name__} has cross-attention"
    return None


def compiler_problem() -> str | None:
    """Why torch.compile cannot run here, or None."""
    import shutil  # noqa: PLC0415

    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++/clang++) on PATH, which inductor needs on a CPU"
    return None


class Compiled:
    """Compiled callables of one model, keyed by shape; shared by every adapter of that model object."""

    def __init__(self, model: PreTrainedModel):
        self.fns: dict[tuple, object] = {}
        self.compile_s: dict[tuple, float] = {}
        self.copies: dict[tuple, torch.Tensor] = {}  # the weight copies its graphs share (runtime/fuse_linears.py)
        self._model = weakref.ref(model)
        self._weights: str | None = None
        self.layers = LayerRegions(model)  # traced as one region (runtime/layer_graphs.py), or none: whole
        self.padded_one_rows = 0  # one-row passes run padded on a graph of symbolic row count (static_lm.py)
        self.cuda_graphs = CUDA_GRAPHS and any(p.device.type == "cuda" for p in model.parameters())

    def options(self) -> dict:
        """Inductor options for this model's passes: COMPILE_OPTIONS, the graph pass that fuses and packs their
        linears (runtime/fuse_linears.py), its copies of the weights shared by all of them and named in inductor's
        cache key by their values (hashed once per model object), the one that hands grouped-query attention its
        key/value heads unrepeated (runtime/shared_kv_heads.py), and the one that computes each rotary table once
        per pass (runtime/compute_once.py). A model whose layer is one region runs a Python wrapper, which
        inductor's C++ wrapper would be for nested regions, and neither freezes nor fuses (LAYER_GRAPH_OPTIONS,
        runtime/layer_graphs.py). A CUDA model's passes run as CUDA graphs (CUDA_GRAPH_OPTIONS). On a CPU whose
        vector ISAs the kernels' own build has proven, inductor skips probing them (`rowwise.vector_isa_proven`)."""
        wrapper = CUDA_GRAPH_OPTIONS if self.cuda_graphs else cpu_wrapper_options(python_wrapper=bool(self.layers))
        passes = {"post_grad_custom_pre_pass": ShareKVHeads(), "post_grad_custom_post_pass": ComputeOnce(),
                  "guard_filter_fn": argument_guards}
        if self.layers:
            return {**COMPILE_OPTIONS, **wrapper, **LAYER_GRAPH_OPTIONS, **passes}
        if self._weights is None:
            self._weights = weights_fingerprint(self._model())
        return {**COMPILE_OPTIONS, **wrapper, "joint_custom_pre_pass": FuseRowLinears(shared=self.copies,
                                                                                weights=self._weights), **passes}


#: Where a guard's name passes through what a compiled pass has frozen: a module's submodules, parameters, buffers
#: or hooks, or a model's config.
_FROZEN_STATE = re.compile(r"\._(modules|parameters|buffers)\[|\.config\b|__mro__|_hooks")


def cpu_wrapper_options(python_wrapper: bool) -> dict:
    """A CPU model's inductor options beyond COMPILE_OPTIONS: the Python wrapper for a model compiled by layer
    (inductor's C++ wrapper does not take nested regions, runtime/layer_graphs.py), and, where this process's own
    kernels have proven the CPU's vector ISAs, no probe of them by inductor (`rowwise.vector_isa_proven`)."""
    wrapper = {"cpp_wrapper": False, "cpp_wrapper_build_separate": False} if python_wrapper else {}
    if vector_isa_proven():  # inductor's own probe of the CPU's vector ISAs would find what the kernels did
        wrapper = {**wrapper, "cpp.vec_isa_ok": True}
    return wrapper


def precompile_headers() -> float:
    """Build inductor's precompiled headers for the fast path's CPU builds now, as `make install` does (after the
    kernels: `python -m specdec.runtime.compiled`), so that a first request does not: one for the kernels under
    the Python wrapper (a model compiled by layer), and the C++ wrapper's two (its own, at -O1, and its kernels').
    Inductor keys each by its compiler command line and keeps it in its directory under the temporary directory
    (about 150 MB each), where every later process of this machine and user finds it. A tiny pointwise function is
    compiled in each wrapper to make them. On one core of a Zen 2 they took 14.5 s, and a self-drafted 1.5B model's
    first request went from 68.0-68.7 to 63.2 s (docs/fastpath.md). Returns the seconds it took."""
    start = time.perf_counter()
    x = torch.linspace(-4, 4, 1536, dtype=torch.bfloat16)
    for python_wrapper in (True, False):
        fn = torch.compile(lambda v: torch.nn.functional.silu(v.float()).to(v.dtype) * v,
                           options={**COMPILE_OPTIONS, **cpu_wrapper_options(python_wrapper)})
        with torch.inference_mode():
            fn(x)
        torch.compiler.reset()
    return time.perf_counter() - start


def argument_guards(entries) -> list[bool]:
    """Dynamo's guards a compiled pass keeps (its `guard_filter_fn`): those on the call's arguments (the inputs'
    and cache tensors' shapes, strides and dtypes, the flags), not those on the model's modules, parameters, config
    or hooks, nor on globals. Freezing folds the weights into the graph, and tracing the modules' attributes and
    the globals the forward reads, so a guard on them checks nothing the graph still reads; they were nearly all of
    a call's guard check: 1.1-1.3 ms of a 28 ms one-row pass at the Qwen2.5-0.5B shape, 0.13 ms without them
    (one Zen 4 core, torch.profiler's "TorchDynamo Cache Lookup"; docs/fastpath.md)."""
    return [not entry.is_global and not _FROZEN_STATE.search(entry.name) for entry in entries]


COMPILED: weakref.WeakKeyDictionary[PreTrainedModel, Compiled] = weakref.WeakKeyDictionary()
_compile_s_total = 0.0  # every first call's seconds, in this process (`compile_seconds`)


def compile_seconds() -> float:
    """Seconds this process has spent so far compiling fast-path passes (the first call of each shape, for
    every model, those since freed too): the difference across a call is the compile time it paid."""
    return _compile_s_total


def raise_recompile_limit() -> None:
    # One code object serves every shape (each its own cache entry), so allow more than dynamo's default 8.
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < 64:
            setattr(cfg, name, 64)
    if hasattr(cfg, "accumulated_recompile_limit") and cfg.accumulated_recompile_limit < 1024:
        cfg.accumulated_recompile_limit = 1024


def compile_once(model: PreTrainedModel, key: tuple, fn, dynamic: bool = False):
    """`fn` compiled for the shape `key` (fullgraph, static shapes, COMPILE_OPTIONS): once per model object and
    process, shared by every adapter of that model; its first call is timed and logged. The shapes are static but
    for the dimensions its caller marked symbolic (`torch._dynamo.mark_dynamic`), which dynamic=True says it does."""
    entry = entry_for(model)
    compiled = entry.fns.get(key)
    if compiled is None:
        raise_recompile_limit()
        options = entry.options()
        compiled = entry.fns[key] = Timed(
            torch.compile(_entry_point(fn), fullgraph=True, dynamic=False, options=options), key,
            type(model).__name__, entry, freeze=options["freezing"])
    return compiled


def entry_for(model: PreTrainedModel) -> Compiled:
    """`model`'s registry of compiled callables (made on first use)."""
    entry = COMPILED.get(model)
    if entry is None:
        entry = COMPILED[model] = Compiled(model)
    return entry


def _entry_point(fn):
    """`fn` called through a function with a code object of its own. Dynamo keeps compiled graphs per code object
    and checks a call against each entry there; a code object per shape key leaves one entry, the key's own."""

    def entry_point(*args):
        return fn(*args)

    code = entry_point.__code__.replace()  # the same bytecode, another code object
    return types.FunctionType(code, entry_point.__globals__, entry_point.__name__, None, entry_point.__closure__)


def compile_head_round(head: torch.nn.Module, key: tuple, fn, **static):
    """A draft head's round `fn(*args, **static)` compiled for the shape `key` as the target's passes are
    (`compile_once`, keyed on the head): under the row-invariant linear, so the head's projections and the
    target's LM head it reads run on packed weights (runtime/fuse_linears.py)."""
    return compile_once(head, key, functools.partial(_row_invariant_call, fn, **static))


def _row_invariant_call(fn, *args, **static):
    with row_invariant(linear=True):
        return fn(*args, **static)


def by_layer(model: PreTrainedModel) -> bool:
    """Whether `model`'s passes compile one graph per decoder layer (runtime/layer_graphs.py)."""
    return bool(entry_for(model).layers)


def is_compiled(model: PreTrainedModel, key: tuple) -> bool:
    """Whether the callable for `key` of `model` has been compiled (and run once) in this process."""
    entry = COMPILED.get(model)
    fn = entry.fns.get(key) if entry is not None else None
    return fn is not None and fn.done


class Timed:
    """A compiled callable that logs how long its first call (the compile) took."""

    def __init__(self, fn, key: tuple, model_name: str, entry: Compiled, freeze: bool):
        self.fn, self.key, self.model_name, self.entry = fn, key, model_name, entry
        self.freeze = freeze  # inductor's `freezing` option for this callable (`_compiling`)
        self.done = False

    def __call__(self, *args):
        if self.entry.cuda_graphs:
            return self._replay(*args)
        return self._call(*args)

    def _replay(self, *args):
        """A call of a pass that runs as a CUDA graph: each call its own step of inductor's graph trees (which may
        then reuse the previous step's output memory), its outputs copied out of the graph's memory pool, so that a
        caller may keep them across the next pass (a draft's probabilities across the target's)."""
        torch.compiler.cudagraph_mark_step_begin()
        return _copied(self._call(*args))

    def _call(self, *args):
        if self.done:
            # The key already chose the graph (its own code object, `_entry_point`, with the guards on its
            # arguments alone, `argument_guards`), so dynamo need not re-check every guard. A call that matches
            # no entry raises instead of recompiling, and is retried with full guards: a recompile, flagged as
            # unplanned.
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return self.fn(*args)
            except RuntimeError as error:
                if "skip_guard_eval_unsafe" not in str(error):
                    raise
            graphs = _graphs_compiled()
            with self._compiling():  # a recompile is traced as the compile was: the same graph, the same rounding
                out = self.fn(*args)
            if _graphs_compiled() != graphs:  # a guard failed (a global a model reads changed): compiled again
                _unplanned_recompile(self)
            return out
        start = time.perf_counter()
        with self._compiling():
            out = self.fn(*args)
        elapsed = time.perf_counter() - start
        self.done = True
        _freeze_heap()
        self.entry.compile_s[self.key] = elapsed
        global _compile_s_total
        _compile_s_total += elapsed
        log.info("compiled %s %s in %.1f s", self.model_name, _describe(self.key), elapsed)
        return out

    @contextlib.contextmanager
    def _compiling(self):
        """What a call that compiles runs under. Where inductor freezes (a model compiled whole on a CPU), dynamo
        traces the model's parameters as constants for it: `options` reaches inductor only, so dynamo's flag is set
        for the compile alone, from the same `freezing` option, so that the two cannot disagree. One region per
        layer: the layers called through it, their parameters inputs (runtime/layer_graphs.py, LAYER_GRAPH_OPTIONS).
        As CUDA graphs: the parameters inputs, at static addresses (CUDA_GRAPH_OPTIONS)."""
        with torch._dynamo.config.patch(prepare_freezing=self.freeze), self.entry.layers.routed(), \
                warnings.catch_warnings():
            # torch.fx's note on the symbolic row count (runtime/static_lm.py), about inductor's own nodes
            warnings.filterwarnings("ignore", message="Raw SymInt value", category=UserWarning)
            yield


def _copied(out):
    """`out` (a pass's tensors, in tuples or lists) with each tensor copied."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_copied(item) for item in out)
    return out


def _freeze_heap() -> None:
    """After a compile: collect, then move every surviving object to the collector's permanent generation. A
    compile leaves hundreds of thousands of long-lived objects (graphs, guards, code caches); without this, each
    full collection re-traverses them all, which measured 12-16% of a decoding round of the default pair. Objects
    frozen stay allocated even if they become cyclic garbage later (`gc.unfreeze()` undoes it)."""
    gc.collect()
    gc.freeze()


#: Shapes that dynamo compiled again after their first call (a guard on an argument failed; frozen like the first
#: compile, so the same graph and rounding, but seconds of compiling). The fast path's own state must never cause
#: one (tests check). Guards on the model and on globals are not kept (`argument_guards`), so loading a model of
#: another class after compiling, which changes a registry transformers' forward reads, no longer does.
UNPLANNED_RECOMPILES: list[tuple] = []


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _unplanned_recompile(timed: Timed) -> None:
    if not UNPLANNED_RECOMPILES:
        log.warning("dynamo recompiled %s %s after a guard failed (seconds of compiling, not part of any shape's "
                    "first call). TORCH_LOGS=recompiles names the guard", timed.model_name, _describe(timed.key))
    UNPLANNED_RECOMPILES.append(timed.key)


def _describe(key: tuple) -> str:
    if key[0] == "batch-pass":  # batch_static.StaticBatchedCausalLM
        return f"batched pass of {key[1]} rows x {key[2]} tokens (cache {key[3]} slots)"
    if key[0] == "verify":
        return (f"pass of {key[1]} tokens with warp and rejection rule (T={key[4].temperature}, top_k={key[4].top_k}, "
                f"top_p={key[4].top_p}, cache {key[2]} slots{', hidden' if key[3] else ''})")
    if key[0] == "prefill":
        return f"prefill pass of {key[1]} tokens (cache {key[2]} slots{', hidden' if key[3] else ''})"
    if key[0] == "pass":
        return f"pass of {key[1]} tokens (cache {key[2]} slots{', hidden' if key[3] else ''}{', tree' if key[4] else ''})"
    if key[0] in ("block", "eagle"):  # a draft head's round (drafters/block.py, drafters/eagle.py)
        return (f"{key[0]} head round (pad {key[1]}, depth {key[2]}, top_k={key[3]}, max_nodes={key[4]}, "
                f"cache {key[5]} slots)")
    if key[0].startswith("tree"):
        return (f"{key[0]} draft (top_k={key[1]}, depth={key[2]}, {'greedy' if key[3].greedy else 'sampling'}, "
                f"cache {key[4]} slots)")
    return f"γ={key[1]} draft steps ({'greedy' if key[2].greedy else 'sampling'}, cache {key[3]} slots)"


def fast_path_problem(model: PreTrainedModel, compile: bool) -> str | None:
    """Why `model` cannot take the fast path (static cache, and compiling when asked), or None."""
    problem = static_cache_problem(model)
    if problem is None and compile:
        problem = compiler_problem()
    return problem


class FastPathWarning(UserWarning):
    """The fast path (compile=True) was asked for but this model or machine cannot take it."""


def main() -> None:
    """`python -m specdec.runtime.compiled`: build inductor's precompiled headers for the fast path
    (`precompile_headers`)."""
    problem = compiler_problem()
    if problem is not None:
        raise SystemExit(f"specdec: inductor's headers not precompiled: {problem}")
    print(f"specdec: inductor's precompiled headers ready in {precompile_headers():.1f} s")


if __name__ == "__main__":
    main()
