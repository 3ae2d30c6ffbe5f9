"""Timed runs of every method on every prompt, interleaved so machine drift hits all methods alike.

A *config* is a method at one γ (or at none, for methods without a fixed γ). For each prompt the runner
does `warmup` untimed passes over all configs, then `repeats` timed rounds; in each round every config
runs once, in an order rotated from round to round (round-robin), so a slow phase of a shared machine is
spread over all methods instead of landing on one.

Every method generates exactly `max_new_tokens` tokens: end-of-sequence is disabled for all of them alike
(`eos_token_id=[]` for specdec, `eos_token_id=None` for `transformers.generate`), rather than suppressed
with `min_new_tokens`, which would change the distribution being sampled.

Hugging Face runs are counted by hooks on the models, never by reading HF internals: a forward pre-hook
on the target records, for each call, how many tokens went in and how long the cache already was. Round i
feeds the last committed token plus the drafts, so drafted_i = cache_len_i + n_in_i - committed_i, and the
next call's cache length tells how many of them were kept. The assistant's `generate` (HF's drafting step)
is timed by wrapping it on the instance for the duration of the run.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.bench.openvino_peer import OV_METHODS, OpenVINOSettings
from specdec.bench.vllm_peer import VLLM_METHODS, VLLMSettings
from specdec.errors import ConfigError

#: Peers: `transformers.generate` with no drafting, with the draft model as assistant (γ fixed, schedule
#: "constant"), with HF's out-of-the-box assistant settings, and with HF's prompt lookup.
#: hf-plain-f32: HF `generate` on a float32 copy of the target whatever --dtype is (what a user of transformers
#: gets on a CPU by default), the baseline a low-precision run is compared with.
HF_METHODS = ("hf-plain", "hf-plain-f32", "hf-assisted", "hf-assisted-heuristic", "hf-prompt-lookup",
              "hf-plain-compiled")
#: Methods whose γ is not set by --gamma (run once, not once per γ).
GAMMA_FREE = ("plain", "hf-plain", "hf-plain-f32", "hf-assisted-heuristic", "hf-plain-compiled", "draft-tree", "draft-tree-auto",
              "ov-plain", "vllm-plain", "vllm-suffix", "suffix")
#: The longest prompt vLLM's engines take when the bench is not told its prompts, and the room past a request's
#: last token left for a round's drafts (tokens).
VLLM_PROMPT_TOKENS, VLLM_DRAFT_ROOM = 512, 64
#: A run slower than this many times the fastest run of the same config and prompt is reported as stalled.
SLOW_RUN_FACTOR = 3.0
#: Methods that need the draft model.
NEEDS_DRAFT_MODEL = ("draft", "draft-auto", "draft-heuristic", "draft-vocab", "draft-vocab-auto",
                     "draft-vocab-heuristic", "hf-assisted", "hf-assisted-heuristic", "draft-tree",
                     "draft-tree-auto",
                     "multi-draft", "multi-draft-specinfer", "multi-draft-spectr",
                     "draft-tli", "draft-tli-auto", "draft-tli-heuristic",
                     "draft-slem", "draft-slem-auto", "draft-slem-heuristic", "ov-speculative")
#: specdec kinds that draft with the draft model through its own tokenizer.
CROSS_VOCAB_KINDS = ("draft-tli", "draft-slem")
#: Suffixes of specdec methods whose γ a policy picks: gamma="auto", or transformers' +2/-1 heuristic.
POLICY_SUFFIXES = ("-auto", "-heuristic")
#: A specdec method on the fast path (slot KV cache, compiled passes): "plain-compiled", "draft-compiled", ...
COMPILED = "-compiled"
#: Drafters whose fast path is measured (model-free drafters only compile the target).
COMPILED_KINDS = ("draft", "draft-vocab", "prompt-lookup", "bigram", "draft-tree", "eagle", "eagle-chain", "eagle3", "eagle3-chain",
                  "self-draft-int8", "self-draft-int4", "self-draft-w4a8", "self-draft-w8a8", "suffix", "dflash",
                  "dflash-tree", "parallel")
#: "draft-tree-auto": DraftTree(max_nodes="auto"), its node budget chosen online (not gamma="auto").
TREE_AUTO = "draft-tree-auto"
#: Methods that run on specdec's CPU kernels only (SelfDraft's quantized copy): refused up front on a GPU.
CPU_ONLY_PREFIX = "self-draft-"


def is_compiled(method: str) -> bool:
    return not method.startswith("hf-") and method.endswith(COMPILED)


def is_openvino(method: str) -> bool:
    """The OpenVINO GenAI peer's methods (`specdec.bench.openvino_peer`; they need the openvino extra)."""
    return method in OV_METHODS


def is_vllm(method: str) -> bool:
    """vLLM's CPU build as a peer (`specdec.bench.vllm_peer`; it needs the vLLM environment)."""
    return method in VLLM_METHODS


def is_peer(method: str) -> bool:
    """A method of an engine other than specdec and transformers (OpenVINO GenAI, vLLM)."""
    return is_openvino(method) or is_vllm(method)


def plain_on_path(method: str) -> str:
    """The plain decoding `method`'s greedy output is held to: the peer's own (ov-plain, vllm-plain), else
    specdec's on the same path (plain-compiled for a compiled method, plain for an eager one)."""
    if is_openvino(method):
        return "ov-plain"
    if is_vllm(method):
        return "vllm-plain"
    return "plain-compiled" if is_compiled(method) else "plain"


def _base(method: str) -> str:
    """The method without its -compiled suffix."""
    return method[: -len(COMPILED)] if is_compiled(method) else method


def _policy_suffix(method: str) -> str | None:
    if method.startswith("hf-") or is_peer(method):
        return None
    method = _base(method)
    return next((suffix for suffix in POLICY_SUFFIXES if method.endswith(suffix)), None)


def available_methods() -> list[str]:
    """Every method name `--methods` accepts, specdec drafters first (read from DRAFTER_KINDS), the OpenVINO
    and vLLM peers' last."""
    from specdec.drafters import DRAFTER_KINDS

    names = ["plain", *DRAFTER_KINDS]
    names += [f"{kind}{suffix}" for suffix in POLICY_SUFFIXES for kind in DRAFTER_KINDS]
    names += ["plain-compiled"] + [f"{kind}{suffix}-compiled" for suffix in ("", *POLICY_SUFFIXES)
                                   for kind in COMPILED_KINDS if kind in DRAFTER_KINDS]
    return names + list(HF_METHODS) + list(OV_METHODS) + list(VLLM_METHODS)


def listed_methods() -> list[str]:
    """The methods `--list-methods` shows: available_methods() less the EAGLE-3 / DFlash / parallel ones when no such
    head or adapted draft is shipped for the default target (as `generate` / `serve` list --drafter; still accepted
    by name, for a BenchSettings whose drafter_options give a head_path / parallel_draft), and less the MTP ones (they
    need a target with MTP layers, DeepSeek-V3 and kin, not the default pair; accepted by name)."""
    from specdec.hub.default_pair import head_shipped, parallel_shipped

    hidden = [name for name, shipped in (("eagle3", head_shipped("eagle3")), ("dflash", head_shipped("dflash")),
                                         ("parallel", parallel_shipped())) if not shipped]
    return [m for m in available_methods() if not m.startswith((*hidden, "mtp"))]


def is_gamma_free(method: str) -> bool:
    return _base(method) in GAMMA_FREE or method in GAMMA_FREE or _policy_suffix(method) is not None


def parse_methods(spec: str | Sequence[str]) -> list[str]:
    """A comma list of method names, validated, duplicates dropped. "all" = every listed method
    (`listed_methods`) except the OpenVINO and vLLM peers', which need an optional extra or environment and are
    run only when named."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    known = available_methods()
    out: list[str] = []
    for name in names:
        expanded = [m for m in listed_methods() if not is_peer(m)] if name == "all" else [name]
        for method in expanded:
            if method not in known:
                raise ConfigError(f"unknown method {method!r}; choose from: {', '.join(known)} (or 'all')")
            if method not in out:
                out.append(method)
    if not out:
        raise ConfigError("--methods is empty")
    return out


def parse_gammas(spec: str | int | Sequence[int]) -> list[int]:
    """"4" → [4]; "1,2,4" → [1, 2, 4]; "1..8" → [1, ..., 8]; pieces may be mixed ("1..4,8")."""
    if isinstance(spec, int):
        values = [spec]
    elif isinstance(spec, str):
        values = []
        for piece in (p.strip() for p in spec.split(",")):
            try:
                if ".." in piece:
                    lo, hi = (int(x) for x in piece.split("..", 1))
                    if hi < lo:
                        raise ValueError
                    values.extend(range(lo, hi + 1))
                elif piece:
                    values.append(int(piece))
            except ValueError:
                hint = " (for an adaptive γ use a method like draft-auto)" if "auto" in piece else ""
                raise ConfigError(f"--gamma: cannot read {piece!r}; give an integer, a list 1,2,4 or a range "
                                  f"1..8{hint}") from None
    else:
        values = [int(v) for v in spec]
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"--gamma needs integers >= 1, got {spec!r}")
    return sorted(set(values))


@dataclass(frozen=True)
class Config:
    method: str
    gamma: int | None  # None: the method sets γ itself (or drafts nothing)

    @property
    def label(self) -> str:
        return self.method if self.gamma is None else f"{self.method}@{self.gamma}"

    @property
    def is_hf(self) -> bool:
        return self.method.startswith("hf-")

    @property
    def is_openvino(self) -> bool:
        return is_openvino(self.method)

    @property
    def is_vllm(self) -> bool:
        return is_vllm(self.method)

    @property
    def kind(self) -> str | None:
        """The specdec drafter kind, or None for plain / HF / OpenVINO / vLLM methods."""
        method = _base(self.method)
        if self.is_hf or is_peer(self.method) or method == "plain":
            return None
        suffix = _policy_suffix(method)
        return method[: -len(suffix)] if suffix else method


def make_configs(methods: Sequence[str], gammas: Sequence[int]) -> list[Config]:
    return [Config(m, None) if is_gamma_free(m) else Config(m, g) for m in methods
            for g in ([None] if is_gamma_free(m) else gammas)]


@dataclass
class BenchSettings:
    methods: list[str]
    gammas: list[int] = field(default_factory=lambda: [4])
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    repeats: int = 3
    warmup: int = 1
    seed: int = 0
    device: str = "cpu"
    forward_costs: bool = True  # also time bare forward passes of 1..γ+1 tokens (a few seconds)
    drafter_options: dict[str, Any] = field(default_factory=dict)
    #: The checkpoints' directories and the export cache, for the ov-* methods (the CLI fills it in).
    openvino: OpenVINOSettings | None = None
    #: The checkpoints' directories, the EAGLE head and the vLLM environment, for the vllm-* methods.
    vllm: VLLMSettings | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["openvino"] = self.openvino.as_dict() if self.openvino is not None else None
        out["vllm"] = self.vllm.as_dict() if self.vllm is not None else None
        return out


def _sync(device: torch.device | str) -> None:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------- HF hooks


class HFCounter:
    """Hooks on the target (and the assistant) for one `generate` call: calls, tokens in, cache lengths,
    time in forwards; time in the assistant's `generate` (HF's whole drafting step)."""

    def __init__(self, target, assistant=None, device: str = "cpu"):
        self.target, self.assistant, self.cuda = target, assistant, str(device).startswith("cuda")
        self.calls: list[list[float]] = []  # [tokens in, cache length before, seconds]
        self.draft_forwards = 0
        self.draft_s = 0.0
        self._handles: list = []
        self._t0 = 0.0

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("decoder_input_ids")  # an encoder-decoder target: the decoder's tokens
        ids = kwargs.get("input_ids") if ids is None else ids
        if ids is None and args:
            ids = args[0]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # the keyword's name by transformers version
        cache_len = int(cache.get_seq_length()) if cache is not None else 0
        if cache is None and kwargs.get("position_ids") is not None:
            cache_len = int(kwargs["position_ids"].reshape(-1)[0])
        self.calls.append([int(ids.shape[-1]), cache_len, 0.0])
        self._t0 = self._now()

    def _post(self, module, args, kwargs, output):
        self.calls[-1][2] = self._now() - self._t0

    def _draft_pre(self, module, args, kwargs):
        self.draft_forwards += 1

    def __enter__(self) -> HFCounter:
        self._handles.append(self.target.register_forward_pre_hook(self._pre, with_kwargs=True))
        self._handles.append(self.target.register_forward_hook(self._post, with_kwargs=True))
        if self.assistant is not None:
            self._handles.append(self.assistant.register_forward_pre_hook(self._draft_pre, with_kwargs=True))
            original = self.assistant.generate

            def timed_generate(*args, **kwargs):
                t = self._now()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.draft_s += self._now() - t

            self.assistant.generate = timed_generate  # instance attribute: shadows the method for this run
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.assistant is not None and "generate" in self.assistant.__dict__:
            del self.assistant.generate

    def stats(self, prompt_len: int, final_len: int):
        """A `DecodeStats` rebuilt from the calls: round i drafted cache_len + n_in - committed tokens, and
        kept (next committed - committed - 1) of them. The first call also prefills the prompt: its time
        goes to `prefill_s`, and `target_s` covers the other calls."""
        from specdec.core.stats import DecodeStats

        s = DecodeStats()
        committed = prompt_len
        for i, (n_in, cache_len, _seconds) in enumerate(self.calls):
            if i > 0:
                committed = cache_len + 1  # the cache holds all but the last committed token
            drafted = max(0, cache_len + n_in - committed)
            nxt = self.calls[i + 1][1] + 1 if i + 1 < len(self.calls) else final_len
            accepted = max(0, min(drafted, nxt - committed - 1))
            s.record_round(drafted, accepted, "recovered" if accepted < drafted else "bonus")
        s.new_tokens = final_len - prompt_len
        s.target_forwards = len(self.calls)
        s.draft_forwards = self.draft_forwards
        s.prefill_s = self.calls[0][2] if self.calls else 0.0
        s.target_s = sum(c[2] for c in self.calls[1:])
        s.draft_s = self.draft_s
        return s


# --------------------------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    tokens: list[int]
    wall_s: float
    stats: Any  # DecodeStats
    timed_forwards: int  # target forwards whose time is in stats.target_s
    target_prefill_s: float  # the target's prompt pass (HF: its first call, which also verifies drafts)
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific counters kept in the run's record


class Bench:
    """The models, drafters and settings; `run(config, prompt_ids, seed)` does one generation."""

    def __init__(self, target, draft, settings: BenchSettings, pad_token_id: int | None = None,
                 tokenizers: tuple | None = None, longest_prompt: int | None = None):
        from specdec.runtime.causal_lm import CachedCausalLM
        from specdec.runtime.seq2seq_lm import CachedSeq2SeqLM, is_encoder_decoder

        # (draft tokenizer, target tokenizer) when the draft has its own vocabulary: the draft-tli/-slem
        # drafters and HF's universal assisted generation translate between them.
        self.tokenizers = tokenizers
        self.target, self.draft, self.settings = target, draft, settings
        self.longest_prompt = longest_prompt  # tokens: what vLLM's engines are sized for (max_model_len)
        self.device = str(next(target.parameters()).device)
        cpu_only = [m for m in settings.methods if m.startswith(CPU_ONLY_PREFIX)]
        if cpu_only and not self.device.startswith("cpu"):
            raise ConfigError(f"{', '.join(cpu_only)} run on specdec's CPU kernels only (int8 / int4 weights); "
                              f"drop them from --methods on {self.device}, or run the bench with --device cpu")
        # An encoder-decoder target: each prompt is the source its encoder reads; the decoder starts from its
        # start token in specdec and in HF alike.
        self.seq2seq = is_encoder_decoder(target)
        self.target_lm = CachedSeq2SeqLM(target) if self.seq2seq else CachedCausalLM(target)
        self._target_fast = None
        self._target_f32 = None
        self.pad_token_id = pad_token_id if pad_token_id is not None else _pad_id(target)
        self._drafters: dict[str, Any] = {}
        self._draft_generation_config = copy.deepcopy(draft.generation_config) if draft is not None else None
        for method in settings.methods:
            if _base(method) in NEEDS_DRAFT_MODEL and draft is None:
                raise ConfigError(f"method {method!r} needs a draft model: pass --draft PATH")
        self.openvino = self._openvino_peer()
        self.vllm = self._vllm_peer()

    def _openvino_peer(self):
        """The OpenVINO peer when an ov-* method is asked for (exports happen here, before any timing)."""
        methods = [m for m in self.settings.methods if is_openvino(m)]
        if not methods:
            return None
        from specdec.bench.openvino_peer import OpenVINOPeer, require_openvino

        require_openvino(methods)
        if self.seq2seq:
            raise ConfigError(f"{', '.join(methods)}: OpenVINO GenAI's LLMPipeline runs decoder-only models; "
                              "this target is an encoder-decoder")
        if "ov-speculative" in methods and self.tokenizers is not None:
            raise ConfigError("ov-speculative needs a draft with the target's tokenizer (OpenVINO GenAI has no "
                              "cross-vocabulary drafting)")
        if self.settings.openvino is None:
            raise ConfigError(f"{', '.join(methods)} export the bench's checkpoints: give their directories "
                              "(BenchSettings(openvino=OpenVINOSettings(target_dir=..., draft_dir=...)))")
        ov = self.settings.openvino
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[ov.dtype] if ov.dtype else \
            next(self.target.parameters()).dtype
        return OpenVINOPeer(ov, dtype=dtype,
                            threads=torch.get_num_threads(), speculative="ov-speculative" in methods)

    def _vllm_peer(self):
        """vLLM's engines when a vllm-* method is asked for (all started here, before any timing)."""
        methods = [m for m in self.settings.methods if is_vllm(m)]
        if not methods:
            return None
        from specdec.bench.vllm_peer import VLLMPeer

        if self.seq2seq:
            raise ConfigError(f"{', '.join(methods)}: the vLLM peer runs decoder-only models; this target is an "
                              "encoder-decoder")
        if "vllm-speculative" in methods and self.tokenizers is not None:
            raise ConfigError("vllm-speculative needs a draft with the target's tokenizer")
        if self.settings.vllm is None:
            raise ConfigError(f"{', '.join(methods)} serve the bench's checkpoints: give their directories "
                              "(BenchSettings(vllm=VLLMSettings(target_dir=..., draft_dir=...)))")
        longest = self.longest_prompt if self.longest_prompt is not None else VLLM_PROMPT_TOKENS
        return VLLMPeer(self.settings.vllm, dtype=next(self.target.parameters()).dtype,
                        threads=torch.get_num_threads(), gammas=self.settings.gammas,
                        plain="vllm-plain" in methods, speculative="vllm-speculative" in methods,
                        suffix="vllm-suffix" in methods,
                        max_model_len=longest + self.settings.max_new_tokens + VLLM_DRAFT_ROOM)

    def close(self) -> None:
        """Stop the peers' engines (the vLLM workers)."""
        if self.vllm is not None:
            self.vllm.close()

    def drafter(self, kind: str, compiled: bool = False, tree_auto: bool = False):
        key = (kind, compiled, tree_auto)
        if key not in self._drafters:
            from specdec.drafters import make_drafter

            options = dict(self.settings.drafter_options.get(kind, {}))
            if tree_auto:
                options["max_nodes"] = "auto"
            if kind in CROSS_VOCAB_KINDS or (kind == "draft" and self.tokenizers is not None):
                if self.tokenizers is None:
                    raise ConfigError(f"method {kind!r} needs the draft's tokenizer: pass --draft-tokenizer PATH")
                options.update(draft_tokenizer=self.tokenizers[0], target_tokenizer=self.tokenizers[1])
            self._drafters[key] = make_drafter(kind, target=self.target, draft=self.draft, **options)
        return self._drafters[key]

    def target_adapter(self, compiled: bool):
        """The target's adapter: eager (CachedCausalLM) or the fast path (StaticCausalLM, compiled)."""
        if not compiled:
            return self.target_lm
        if self._target_fast is None:
            from specdec.runtime.static_lm import fast_adapter

            self._target_fast = fast_adapter(self.target, True)
        return self._target_fast

    def run(self, config: Config, prompt_ids: list[int], seed: int) -> RunResult:
        if config.is_openvino:
            return self._run_openvino(config, prompt_ids, seed)
        if config.is_vllm:
            return self._run_vllm(config, prompt_ids, seed)
        return self._run_hf(config, prompt_ids, seed) if config.is_hf else self._run_specdec(config, prompt_ids, seed)

    def _run_openvino(self, config: Config, prompt_ids: list[int], seed: int) -> RunResult:
        s = self.settings
        run = self.openvino.run(config.method, config.gamma, prompt_ids, max_new_tokens=s.max_new_tokens,
                                temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed)
        return RunResult(run.tokens, run.wall_s, run.stats, max(0, run.stats.target_forwards - 1), run.prefill_s,
                         run.extra)

    def _run_vllm(self, config: Config, prompt_ids: list[int], seed: int) -> RunResult:
        s = self.settings
        run = self.vllm.run(config.method, config.gamma, prompt_ids, max_new_tokens=s.max_new_tokens,
                            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed)
        return RunResult(run.tokens, run.wall_s, run.stats, 0, run.prefill_s, run.extra)

    def _run_specdec(self, config: Config, prompt_ids: list[int], seed: int) -> RunResult:
        from specdec.engine.decoding import SpeculativeDecoder

        s = self.settings
        compiled = is_compiled(config.method)
        tree_auto = _base(config.method) == TREE_AUTO
        drafter = self.drafter(config.kind, compiled, tree_auto) if config.kind else None
        suffix = _policy_suffix(config.method)
        if tree_auto:
            gamma = None  # the tree's depth; the budget is the drafter's own (max_nodes="auto")
        elif suffix == "-heuristic":
            from specdec.engine.adaptive import HeuristicGamma

            gamma = HeuristicGamma()
        else:
            gamma = "auto" if suffix == "-auto" else config.gamma  # None: the drafter's default (a tree's depth)
        decoder = SpeculativeDecoder(
            self.target_adapter(compiled), drafter, gamma=gamma, max_new_tokens=s.max_new_tokens,
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, eos_token_id=[], seed=seed, compile=compiled,
            encoder_inputs={"input_ids": [prompt_ids]} if self.seq2seq else None,
        )
        ids = None if self.seq2seq else torch.tensor(prompt_ids, dtype=torch.long)
        _sync(self.device)
        start = time.perf_counter()
        tokens = list(decoder.stream(ids))
        _sync(self.device)
        wall = time.perf_counter() - start
        # DecodeStats.prefill_s also covers the drafter's reset (counted in draft_s too): take the target's own.
        return RunResult(tokens, wall, decoder.stats, decoder.stats.target_forwards, decoder.target.prefill_s)

    def hf_kwargs(self, config: Config) -> dict[str, Any]:
        """The `generate` keyword arguments of an HF config (the assistant's settings go on its config)."""
        s = self.settings
        kwargs: dict[str, Any] = dict(max_new_tokens=s.max_new_tokens, eos_token_id=None,
                                      pad_token_id=self.pad_token_id, use_cache=True, do_sample=not s.greedy)
        if not s.greedy:
            # HF's own defaults would add top_k=50: pass the warps explicitly, off unless asked for.
            kwargs.update(temperature=s.temperature, top_k=s.top_k or 0, top_p=s.top_p or 1.0)
        if config.method == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = config.gamma
        elif config.method in ("hf-assisted", "hf-assisted-heuristic"):
            kwargs["assistant_model"] = self.draft
            if self.tokenizers is not None:  # universal assisted generation: HF translates through text
                kwargs.update(assistant_tokenizer=self.tokenizers[0], tokenizer=self.tokenizers[1])
        elif config.method == "hf-plain-compiled":
            # HF's own fast path: its static cache, and its automatic compile of the decoding forward, which
            # it enables on CPUs only when asked (_compile_all_devices); cudagraphs do not apply on a CPU.
            from transformers import CompileConfig

            compile_config = CompileConfig()  # HF's defaults (the bench's timing hooks need fullgraph=False)
            compile_config._compile_all_devices = True  # a class attribute HF reads, not an init argument
            kwargs["cache_implementation"] = "static"
            kwargs["compile_config"] = compile_config
        return kwargs

    def _float32_target(self):
        """The target in float32 (itself when it already is), for hf-plain-f32."""
        if self.target.dtype == torch.float32:
            return self.target
        if self._target_f32 is None:
            self._target_f32 = copy.deepcopy(self.target).float()
        return self._target_f32

    def _configure_assistant(self, config: Config) -> None:
        if self.draft is None:
            return
        # Restore the draft's own settings before every run: HF's "heuristic" schedule writes its
        # adapted num_assistant_tokens back into them, which would leak from one run into the next.
        self.draft.generation_config = copy.deepcopy(self._draft_generation_config)
        if config.method == "hf-assisted":
            gc = self.draft.generation_config
            gc.num_assistant_tokens = config.gamma
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0  # no early stop: exactly γ drafts, like specdec

    def effective_assistant_settings(self) -> dict[str, Any]:
        """What HF uses for `hf-assisted-heuristic`: the draft's generation config over HF's defaults."""
        if self.draft is None:
            return {}
        from transformers import GenerationConfig

        defaults = GenerationConfig._get_default_generation_params()
        gc = self._draft_generation_config
        return {name: getattr(gc, name, None) if getattr(gc, name, None) is not None else defaults.get(name)
                for name in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                             "assistant_confidence_threshold")}

    def _run_hf(self, config: Config, prompt_ids: list[int], seed: int) -> RunResult:
        self._configure_assistant(config)
        kwargs = self.hf_kwargs(config)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)
        assistant = self.draft if "assistant_model" in kwargs else None
        model = self._float32_target() if config.method == "hf-plain-f32" else self.target
        torch.manual_seed(seed)
        # The timing hooks would run inside HF's compiled call and recompile it every step: none there.
        hooked = config.method != "hf-plain-compiled"
        counter = HFCounter(model, assistant, self.device)
        with counter if hooked else contextlib.nullcontext(), torch.inference_mode():
            _sync(self.device)
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, **kwargs)
            _sync(self.device)
            wall = time.perf_counter() - start
        prompt_len = 1 if self.seq2seq else ids.shape[1]  # seq2seq: the output starts with the decoder start token
        tokens = out[0, prompt_len:].tolist()
        if hooked:
            stats = counter.stats(prompt_len, out.shape[1])
        else:  # one forward per token; no per-call timings
            from specdec.core.stats import DecodeStats

            stats = DecodeStats(new_tokens=len(tokens), target_forwards=len(tokens))
        stats.wall_s = wall
        return RunResult(tokens, wall, stats, max(0, stats.target_forwards - 1), stats.prefill_s)


def _pad_id(model) -> int:
    for source in (model.generation_config, model.config):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return 0


# --------------------------------------------------------------------------------------------- forward costs


def forward_costs(target, draft, prompt_ids: list[int], sizes: Sequence[int], repeats: int = 15) -> dict[str, Any]:
    """Median milliseconds of one cached forward pass after `prompt_ids`, for each number of new tokens in
    `sizes` (target) and for one token (draft): what a verification pass of γ+1 tokens costs next to a
    plain one-token pass, without any decode loop around it."""
    from specdec.runtime.causal_lm import CachedCausalLM
    from specdec.runtime.seq2seq_lm import CachedSeq2SeqLM, is_encoder_decoder

    def measure(model, n: int) -> float:
        lm = CachedSeq2SeqLM(model) if is_encoder_decoder(model) else CachedCausalLM(model)
        # Timing only: ids past a (cross-vocabulary) draft's embedding wrap around into it.
        ids = torch.tensor(prompt_ids, dtype=torch.long) % lm.vocab_size
        new = torch.tensor((list(prompt_ids) * (n // max(1, len(prompt_ids)) + 1))[:n], dtype=torch.long)
        new = new % lm.vocab_size
        if isinstance(lm, CachedSeq2SeqLM):  # the prompt is the source; the decoder holds as many tokens
            lm.reset(encoder_inputs={"input_ids": ids})
        lm.prefill(ids)
        times = []
        for _ in range(repeats + 2):
            _sync(lm.device)
            start = time.perf_counter()
            lm.forward(new, last_only=False)
            _sync(lm.device)
            times.append(time.perf_counter() - start)
            lm.crop(len(prompt_ids))
        return 1e3 * statistics.median(times[2:])

    out: dict[str, Any] = {"target_ms": {n: measure(target, n) for n in sorted(set(sizes) | {1})}}
    if draft is not None:
        out["draft_ms"] = {1: measure(draft, 1)}
    base = out["target_ms"][1]
    out["verify_cost"] = {n: ms / base for n, ms in out["target_ms"].items()}
    return out


# --------------------------------------------------------------------------------------------- the loop


def run_benchmark(target, draft, prompts, settings: BenchSettings, *, pad_token_id: int | None = None,
                  progress: bool = True, on_run: Callable[[dict], None] | None = None,
                  tokenizers: tuple | None = None) -> dict[str, Any]:
    """Run every config on every prompt; return raw runs, per-config summaries and outputs.

    `prompts`: `BenchPrompt`s (or anything with `.name` and `.ids`).
    """
    import transformers

    if settings.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {settings.repeats}")
    if settings.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {settings.warmup}")
    configs = make_configs(settings.methods, settings.gammas)
    _check_lengths(target, prompts, settings.max_new_tokens)
    bench = Bench(target, draft, settings, pad_token_id, tokenizers,
                  longest_prompt=max((len(p.ids) for p in prompts), default=0))
    reference_config = Config("hf-plain", None)
    need_reference = settings.greedy and reference_config not in configs
    per_prompt = settings.warmup + settings.repeats
    total = len(prompts) * (per_prompt * len(configs) + int(need_reference))
    bar = _progress(total, progress)
    runs: list[dict[str, Any]] = []
    outputs: dict[str, dict[str, list[int]]] = {c.label: {} for c in configs}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # HF warns on every assisted call; keep the bars readable
    try:
        for p_index, prompt in enumerate(prompts):
            reference = None
            if need_reference:
                bar.set_description(f"{prompt.name} reference hf-plain", refresh=False)
                reference = bench.run(reference_config, list(prompt.ids), settings.seed).tokens
                bar.update(1)
            prompt_runs: list[dict[str, Any]] = []
            for repeat in range(-settings.warmup, settings.repeats):
                shift = (repeat + p_index) % len(configs)
                order = configs[shift:] + configs[:shift]  # round-robin, rotated each round
                seed = settings.seed * 1_000_003 + p_index * 1_009 + max(repeat, 0)
                for config in order:
                    bar.set_description(f"{prompt.name} {'warm-up' if repeat < 0 else f'rep {repeat + 1}'} "
                                        f"{config.label}", refresh=False)
                    result = bench.run(config, list(prompt.ids), seed)
                    bar.update(1)
                    if repeat < 0:
                        continue
                    record = _record(config, prompt, p_index, repeat, result)
                    prompt_runs.append(record)
                    outputs[config.label].setdefault(prompt.name, result.tokens)
                    if on_run:
                        on_run(record)
            if settings.greedy and reference is None:
                reference = outputs[reference_config.label][prompt.name]
            # Plain decoding on each path: a compiled method is held to plain-compiled, an eager one to plain
            # (bit-identity in low precision is promised per path: docs/exactness.md), a peer's to its own plain.
            for record in prompt_runs:
                tokens = record.pop("_tokens")
                record["identical_to_hf_plain"] = tokens == reference if settings.greedy else None
                plain = outputs.get(plain_on_path(record["method"]), {}).get(prompt.name) if settings.greedy else None
                record["identical_to_plain"] = tokens == plain if plain is not None else None
            runs.extend(prompt_runs)
    finally:
        bar.close()
        bench.close()
        transformers.logging.set_verbosity(verbosity)
    summaries = [summarize(config, [r for r in runs if r["label"] == config.label]) for config in configs]
    add_speedups(summaries)
    costs = None
    if settings.forward_costs and prompts:
        needs_draft = any(_base(m) in NEEDS_DRAFT_MODEL for m in settings.methods)
        costs = forward_costs(target, draft if needs_draft else None, list(prompts[0].ids),
                              [g + 1 for g in settings.gammas])
    return {
        "forward_costs": costs,
        "settings": settings.as_dict(),
        "configs": summaries,
        "runs": runs,
        "outputs": outputs,
        "hf_assisted_heuristic_settings": bench.effective_assistant_settings()
        if "hf-assisted-heuristic" in settings.methods else None,
        "openvino": bench.openvino.describe() if bench.openvino is not None else None,
        "vllm": bench.vllm.describe() if bench.vllm is not None else None,
    }


def _check_lengths(target, prompts, max_new_tokens: int) -> None:
    from specdec.errors import PromptError
    from specdec.runtime.causal_lm import context_length

    limit = context_length(target)
    for prompt in prompts:
        if limit is not None and len(prompt.ids) + max_new_tokens > limit:
            raise PromptError(f"prompt {prompt.name} ({len(prompt.ids)} tokens) + --max-new-tokens "
                              f"{max_new_tokens} exceeds the target's context of {limit} tokens")


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_description(self, text: str, refresh: bool = True) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    import sys

    from tqdm.auto import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, unit="run", dynamic_ncols=True, leave=True, mininterval=0.2 if tty else 10.0)


def _record(config: Config, prompt, p_index: int, repeat: int, result: RunResult) -> dict[str, Any]:
    s = result.stats
    new_tokens = len(result.tokens)
    return {
        "label": config.label, "method": config.method, "gamma": config.gamma, "prompt": prompt.name,
        "prompt_index": p_index, "repeat": repeat, "wall_s": result.wall_s, "new_tokens": new_tokens,
        "tokens_per_s": new_tokens / result.wall_s if result.wall_s > 0 else 0.0,
        "target_forwards": s.target_forwards, "timed_forwards": result.timed_forwards,
        "draft_forwards": s.draft_forwards, "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted,
        "rejections": s.recovered, "drafted_at": list(s.drafted_at), "accepted_at": list(s.accepted_at),
        "target_prefill_s": result.target_prefill_s, "target_s": s.target_s, "draft_s": s.draft_s,
        "target_all_s": result.target_prefill_s + s.target_s,
        "other_s": max(0.0, result.wall_s - result.target_prefill_s - s.target_s - s.draft_s),
        "tau": s.mean_accepted_tokens, "alpha": s.acceptance_rate,
        **result.extra,
        "_tokens": result.tokens,
    }


def _pos_sum(rows: list[list[int]]) -> list[int]:
    out: list[int] = []
    for row in rows:
        out.extend([0] * (len(row) - len(out)))
        for i, v in enumerate(row):
            out[i] += v
    return out


def _run_cost_ratio(r: dict[str, Any]) -> float | None:
    if not r["drafted"] or not r["timed_forwards"] or r["target_s"] <= 0 or r["draft_s"] <= 0:
        return None
    return (r["draft_s"] / r["drafted"]) / (r["target_s"] / r["timed_forwards"])


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(config: Config, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Speed: medians over all (prompt, repeat) runs. Counts (α, τ, acceptance by position): pooled, ratios
    of sums. Timings inside a run (c, time per target forward, time shares): medians of the per-run values,
    so that one run stalled by a busy machine cannot skew them (`slow_runs` counts such runs)."""
    def total(key: str) -> float:
        return sum(r[key] for r in runs)

    drafted, accepted, rejections = total("drafted"), total("accepted"), total("rejections")
    forwards, timed = total("target_forwards"), total("timed_forwards")
    target_s, draft_s, wall = total("target_s"), total("draft_s"), total("wall_s")
    drafted_at, accepted_at = _pos_sum([r["drafted_at"] for r in runs]), _pos_sum([r["accepted_at"] for r in runs])
    per_forward = _median(r["target_s"] / r["timed_forwards"] for r in runs
                          if r["timed_forwards"] and r["target_s"] > 0)
    cost_ratio = _median(_run_cost_ratio(r) for r in runs)
    shares = {name: _median(r[key] / r["wall_s"] for r in runs if r["wall_s"] > 0) for name, key in (
        ("target_share", "target_all_s"), ("draft_share", "draft_s"), ("other_share", "other_s"))}
    fastest: dict[str, float] = {}
    for r in runs:
        fastest[r["prompt"]] = min(fastest.get(r["prompt"], float("inf")), r["wall_s"])
    slow = [f"{r['prompt']}#{r['repeat']}" for r in runs if r["wall_s"] > SLOW_RUN_FACTOR * fastest[r["prompt"]]]
    identical = [r.get("identical_to_hf_plain") for r in runs]
    return {
        "label": config.label, "method": config.method, "gamma": config.gamma, "runs": len(runs),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs) if runs else 0.0,
        "tokens_per_s_min": min((r["tokens_per_s"] for r in runs), default=0.0),
        "tokens_per_s_max": max((r["tokens_per_s"] for r in runs), default=0.0),
        "wall_s_median": statistics.median(r["wall_s"] for r in runs) if runs else 0.0,
        "new_tokens": total("new_tokens"), "target_forwards": forwards, "timed_forwards": timed,
        "draft_forwards": total("draft_forwards"),
        "tau": total("new_tokens") / forwards if forwards else 0.0,
        "drafted": drafted, "accepted": accepted, "rejections": rejections,
        "alpha": accepted / drafted if drafted else None,
        # per-token acceptance probability (the α of Leviathan's i.i.d. model): accepted over tested, where a
        # round tests its accepted drafts plus the one it rejects; drafts after a rejection are never tested.
        "alpha_token": accepted / (accepted + rejections) if drafted and accepted + rejections else None,
        "mean_drafted_per_round": drafted / total("rounds") if total("rounds") else 0.0,
        "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at)],
        "drafted_at": drafted_at, "accepted_at": accepted_at,
        "target_s": target_s, "draft_s": draft_s, "wall_s": wall,
        "target_prefill_s": total("target_prefill_s"),
        "target_s_per_forward": per_forward, "cost_ratio": cost_ratio,
        "other_s": total("other_s"), **shares, "slow_runs": slow,
        "identical_to_hf_plain": None if any(v is None for v in identical) else all(identical),
        "identical_to_plain": _all_or_none([r.get("identical_to_plain") for r in runs]),
    }


def _all_or_none(values: list) -> bool | None:
    return None if not values or any(v is None for v in values) else all(values)


def add_speedups(summaries: list[dict[str, Any]]) -> None:
    by_label = {s["label"]: s for s in summaries}
    for ref in ("hf-plain", "plain"):
        base = by_label.get(ref, {}).get("tokens_per_s")
        for s in summaries:
            s[f"speedup_vs_{ref.replace('-', '_')}"] = s["tokens_per_s"] / base if base else None
