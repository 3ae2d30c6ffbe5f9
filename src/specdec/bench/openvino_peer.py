"""OpenVINO GenAI as a peer in `specdec bench`: `ov-plain` and `ov-speculative`.

- `ov-plain`: `openvino_genai.LLMPipeline(target_ir, "CPU")`;
- `ov-speculative`: the same with `draft_model=openvino_genai.draft_model(draft_ir, "CPU")`, γ drafts per
  round (`num_assistant_tokens`, from `--gamma`).

Both run the IRs of the very checkpoints the bench loads (`openvino_export.exported`: float32 weights, cached
by content hash), at the bench's precision and thread count: a float32 target runs with
`INFERENCE_PRECISION_HINT=f32` and `KV_CACHE_PRECISION=f32`, a bfloat16 one with `bf16` for both, and
`INFERENCE_NUM_THREADS` is torch's thread count (the bench's `--threads`), for the target and the draft.
Prompts go in as token ids and tokens come back as ids (OpenVINO's tokenizer is not on the timed path).
End-of-sequence is ignored (`ignore_eos`, no stop tokens) so every run generates exactly `max_new_tokens`
tokens, like every other method of the bench. Prefix caching is off: each run computes its prompt's prefill,
as specdec's and HF's methods do (OpenVINO's default scheduler would serve a repeated prompt from cache).

Counts and timings come from OpenVINO's own metrics (`perf_metrics`, and `extended_perf_metrics` per model
for speculative decoding): the target's steps, the tokens each step produced, the time of each step. A
speculative step that produced n tokens accepted n - 1 drafts; it drafted γ, or fewer when fewer tokens
were left (`max_new_tokens` - produced - 1), so rounds are rebuilt from the steps, like HF's from its calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ConfigError, SpecdecError
from specdec.runtime import cpuinfo

OV_METHODS = ("ov-plain", "ov-speculative")
#: The one install command named when OpenVINO GenAI is missing.
INSTALL = 'pip install "specdec[openvino]"'
#: torch dtype of the bench's models -> the OpenVINO CPU plugin's precision for compute and KV cache.
PRECISIONS = {torch.float32: "f32", torch.bfloat16: "bf16"}


class OpenVINOMissing(SpecdecError, ImportError):
    """An `ov-*` method was asked for, and OpenVINO GenAI is not installed."""


def require_openvino(methods: Sequence[str]) -> None:
    """Raise OpenVINOMissing (one line, the install command) when `methods` name an `ov-*` method and
    `openvino_genai` cannot be imported; nothing otherwise."""
    wanted = [m for m in methods if m in OV_METHODS]
    if not wanted:
        return
    try:
        import openvino_genai  # noqa: F401
    except ImportError:
        verb = "needs" if len(wanted) == 1 else "need"
        raise OpenVINOMissing(f"{', '.join(wanted)} {verb} OpenVINO GenAI, which is not installed: "
                              f"{INSTALL}") from None


@dataclass(frozen=True)
class OpenVINOSettings:
    """Where the bench's checkpoints are (to export them) and where exports are cached and made."""

    target_dir: str
    draft_dir: str | None = None  # ov-speculative needs it
    cache_dir: str | None = None  # None: openvino_export.default_cache_dir()
    export_env: str | None = None  # None: openvino_export.default_export_env()
    # The peer's precision ("float32" / "bfloat16"); None: the bench's --dtype. Set it where the peer cannot run
    # the bench's precision (OpenVINO's AVX2 CPU plugin refuses a bfloat16 KV cache) to time specdec at its own
    # precision against the peer at its best in one run.
    dtype: str | None = None
    # The target's weights in OpenVINO (openvino_export.WEIGHT_FORMATS): "fp32" (converted to the precision above
    # by the CPU plugin), or weight-only "int8" / "int4" to set beside specdec's formats of the same bits.
    weights: str = "fp32"

    def as_dict(self) -> dict[str, Any]:
        return {"target_dir": self.target_dir, "draft_dir": self.draft_dir, "cache_dir": self.cache_dir,
                "export_env": self.export_env, "dtype": self.dtype, "weights": self.weights}


def device_properties(dtype: torch.dtype, threads: int) -> dict[str, Any]:
    """The CPU plugin's properties for a run at `dtype` on `threads` threads."""
    if dtype not in PRECISIONS:
        names = ", ".join(str(d).replace("torch.", "") for d in PRECISIONS)
        raise ConfigError(f"the OpenVINO methods run at {names}, not {str(dtype).replace('torch.', '')}: "
                          "pass --dtype float32 or --dtype bfloat16")
    precision = PRECISIONS[dtype]
    return {"INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": precision,
            "INFERENCE_NUM_THREADS": int(threads)}


def require_precision(precision: str, threads: int) -> None:
    """Raise ConfigError (before anything is exported) when the CPU plugin cannot run `precision` here: its
    bf16 needs native bf16 (`BF16` in the plugin's OPTIMIZATION_CAPABILITIES; AVX512_BF16 or AMX), and on
    other CPUs it refuses a bf16 KV cache. On a CPU with AMX, OpenVINO GenAI 2026.4's bf16 pipeline on one
    thread stops the whole process with a floating point exception (SIGFPE) as it is built; on two threads it
    runs (seen on a Xeon with AMX, BENCHMARKS.md), so that case is refused here by name instead."""
    if precision != "bf16":
        return
    import openvino as ov

    capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    if "BF16" not in capabilities:
        raise ConfigError("OpenVINO's CPU plugin has no bfloat16 on this CPU (its capabilities: "
                          f"{', '.join(capabilities)}; it needs AVX512_BF16 or AMX): pass --openvino-dtype "
                          "float32 to run the OpenVINO methods in float32 beside specdec's bfloat16")
    if threads == 1 and "amx_bf16" in cpuinfo.flags():
        raise ConfigError("OpenVINO's CPU plugin stops the process with a floating point exception when it "
                          "builds a bfloat16 pipeline on one thread on a CPU with AMX (OpenVINO "
                          f"{ov.get_version()}): pass --threads 2 or more, or --openvino-dtype float32")


@dataclass(frozen=True)
class PeerRun:
    """One generation: tokens, wall time, counts and timings (a `DecodeStats`), the target's prefill time."""

    tokens: list[int]
    wall_s: float
    stats: Any  # DecodeStats
    prefill_s: float
    extra: dict[str, Any] = field(default_factory=dict)  # OpenVINO's own counters, kept for the record


class OpenVINOPeer:
    """The exported target (and draft) and their pipelines, built on first use; `run` does one generation."""

    def __init__(self, settings: OpenVINOSettings, *, dtype: torch.dtype, threads: int, speculative: bool):
        from specdec.bench.openvino_export import exported

        self.properties = device_properties(dtype, threads)
        require_precision(self.properties["INFERENCE_PRECISION_HINT"], threads)
        if speculative and settings.draft_dir is None:
            raise ConfigError("ov-speculative needs the draft's checkpoint directory: pass --draft PATH")
        self.target_export = exported(settings.target_dir, settings.cache_dir, settings.export_env,
                                      settings.weights)
        self.draft_export = (exported(settings.draft_dir, settings.cache_dir, settings.export_env)
                             if speculative else None)
        self._plain = None
        self._speculative = None

    def describe(self) -> dict[str, Any]:
        import openvino
        import openvino_genai

        return {"openvino": openvino.get_version(), "openvino_genai": openvino_genai.__version__,
                "device": "CPU", "properties": dict(self.properties), "prefix_caching": False,
                "target": self.target_export.as_dict(),
                "draft": self.draft_export.as_dict() if self.draft_export is not None else None}

    def _scheduler(self):
        import openvino_genai as og

        config = og.SchedulerConfig()
        config.enable_prefix_caching = False
        return config

    def pipeline(self, speculative: bool):
        import openvino_genai as og

        if speculative and self._speculative is None:
            if self.draft_export is None:
                raise ConfigError("ov-speculative needs the draft's checkpoint directory: pass --draft PATH")
            draft = og.draft_model(str(self.draft_export.path), "CPU", **self.properties)
            self._speculative = og.LLMPipeline(str(self.target_export.path), "CPU", draft_model=draft,
                                               scheduler_config=self._scheduler(), **self.properties)
        if not speculative and self._plain is None:
            self._plain = og.LLMPipeline(str(self.target_export.path), "CPU", scheduler_config=self._scheduler(),
                                         **self.properties)
        return self._speculative if speculative else self._plain

    @staticmethod
    def generation_config(*, max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
                          seed: int, gamma: int | None):
        """A fresh config (nothing read from the checkpoint's generation_config.json): EOS ignored, no stop
        tokens, greedy at temperature 0, else sampling with the bench's warp, seeded."""
        import openvino_genai as og

        gc = og.GenerationConfig()
        gc.max_new_tokens = max_new_tokens
        gc.ignore_eos = True
        gc.stop_token_ids = set()
        gc.do_sample = temperature > 0.0
        if gc.do_sample:
            gc.temperature = temperature
            if top_k is not None:
                gc.top_k = top_k
            gc.top_p = 1.0 if top_p is None else top_p
            gc.rng_seed = seed
        if gamma is not None:
            gc.num_assistant_tokens = gamma
        return gc

    def run(self, method: str, gamma: int | None, prompt_ids: Sequence[int], *, max_new_tokens: int,
            temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
            seed: int = 0) -> PeerRun:
        import numpy as np
        import openvino as ov

        speculative = method == "ov-speculative"
        if speculative and gamma is None:
            raise ConfigError("ov-speculative needs γ (--gamma)")
        pipe = self.pipeline(speculative)
        config = self.generation_config(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                        top_p=top_p, seed=seed, gamma=gamma if speculative else None)
        ids = ov.Tensor(np.asarray([list(prompt_ids)], dtype=np.int64))  # [1, prompt]
        start = time.perf_counter()
        result = pipe.generate(ids, config)
        wall = time.perf_counter() - start
        tokens = [int(t) for t in result.tokens[0]]
        if speculative:
            stats, prefill, extra = speculative_stats(result.extended_perf_metrics, gamma, max_new_tokens)
        else:
            stats, prefill, extra = plain_stats(result.perf_metrics)
        stats.new_tokens = len(tokens)
        stats.wall_s = wall
        return PeerRun(tokens, wall, stats, prefill, extra)


def plain_stats(metrics) -> tuple[Any, float, dict[str, Any]]:
    """DecodeStats of a plain run from OpenVINO's per-token inference times (µs; the first is the prefill)."""
    from specdec.core.stats import DecodeStats

    steps = [1e-6 * d for d in metrics.raw_metrics.token_infer_durations]
    s = DecodeStats(target_forwards=len(steps))
    s.prefill_s = steps[0] if steps else 0.0
    s.target_s = sum(steps[1:])
    return s, s.prefill_s, {}


def speculative_stats(metrics, gamma: int, max_new_tokens: int) -> tuple[Any, float, dict[str, Any]]:
    """DecodeStats of a speculative run from the per-model metrics: the target's steps (tokens produced,
    time), the draft's total time. The first step is the prefill (one token); each later step is a round."""
    from specdec.core.stats import DecodeStats

    main, draft = metrics.main_model_metrics.raw_metrics, metrics.draft_model_metrics.raw_metrics
    produced = [int(n) for n in main.m_batch_sizes]  # tokens per target step
    seconds = [1e-6 * d for d in main.m_durations]  # per target step
    s = DecodeStats(target_forwards=len(produced), draft_forwards=len(draft.m_batch_sizes))
    done = produced[0] if produced else 0
    for n in produced[1:]:
        drafted = max(0, min(gamma, max_new_tokens - done - 1))
        accepted = min(drafted, n - 1)
        s.record_round(drafted, accepted, "recovered" if accepted < drafted else "bonus")
        done += n
    s.prefill_s = seconds[0] if seconds else 0.0
    s.target_s = sum(seconds[1:])
    s.draft_s = 1e-6 * sum(draft.m_durations)
    extra = {"ov_draft_tokens": int(metrics.get_num_draft_tokens()),
             "ov_accepted_tokens": int(metrics.get_num_accepted_tokens())}
    return s, s.prefill_s, extra


def checkpoint_dir(name: str | Path) -> Path:
    """A local checkpoint directory for `name`: the directory itself, or a hub id's snapshot in the local
    Hugging Face cache (the bench loaded it just before)."""
    path = Path(name)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(name), local_files_only=True))
    except Exception as exc:  # huggingface_hub raises several kinds for "not in the local cache"
        raise ConfigError(f"the OpenVINO and vLLM methods run a local checkpoint, and {name!r} is neither a directory "
                          f"nor in the local Hugging Face cache ({type(exc).__name__}): download it first or "
                          "pass its directory") from None
