"""vLLM's CPU build as a peer in `specdec bench` (`vllm-plain`, `vllm-speculative`), and the driver of its engines.

- `vllm-plain`: `vllm.LLM(target)`, one request at a time;
- `vllm-speculative`: the same with a speculative config of γ = --gamma drafts per round: the bench's draft
  model (`draft_model`), or, when `VLLMSettings.head` names an EAGLE / EAGLE-3 head, that head exported in
  vLLM's layout (`eagle` / `eagle3`);
- `vllm-suffix`: vLLM's suffix decoding (`suffix`, through the arctic-inference package in vLLM's
  environment) at vLLM's defaults: as many drafts a round as its match earns, at most 24; γ is not used. Its
  cache keeps earlier requests' responses, as specdec's `suffix` does; a rerun of a prompt first has its
  earlier runs' responses evicted (`vllm_worker.py`), as in specdec's cache, so repeats are drafted as the first
  run was.

vLLM runs in its own environment (`specdec.bench.vllm_env`), so its engines live in a worker process
(`vllm_worker.py`, run by that environment's python) that `VLLMWorker` starts and talks to through JSON lines.
The checkpoints are the bench's own, copied with their tokenizer into a bundle (`specdec.hub.vllm_bundle`),
at the bench's precision (float32 or bfloat16) and thread count. End-of-sequence is ignored, so every run
generates exactly `max_new_tokens`, and prefix caching is off, as for every other method. Engines start once,
before any timing; their start-up is reported apart (`describe()["engines"]`).

Counts come from vLLM's own spec-decode counters, read before and after each request: drafts (rounds), draft
tokens and accepted tokens, per position. vLLM drafts γ every round, also in the last rounds whose drafts
exceed `max_new_tokens`; its counters count them as drafted. Suffix decoding's rounds come from vLLM's
per-request metrics instead: the drafted and accepted count of each round that drafted; every other target
pass after the prompt's is a round that drafted nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.bench.openvino_peer import PeerRun
from specdec.errors import ConfigError, SpecdecError

VLLM_METHODS = ("vllm-plain", "vllm-speculative", "vllm-suffix")
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


class VLLMError(SpecdecError, RuntimeError):
    """vLLM refused a request or its worker died; the message is vLLM's own."""


class VLLMWorker:
    """A worker process in the vLLM environment holding named engines; `start`, `generate`, `stop`, `close`."""

    def __init__(self, env_dir: str | Path | None = None, *, threads: int = 1, log_path: str | Path | None = None,
                 kv_cache_gib: int | None = None):
        from specdec.bench.vllm_env import KV_CACHE_GIB, default_vllm_env, run_environment, vllm_python

        env_dir = (Path(env_dir) if env_dir is not None else default_vllm_env()).resolve()
        python = vllm_python(env_dir)
        environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        environ.update(run_environment(env_dir, threads=threads, kv_cache_gib=kv_cache_gib or KV_CACHE_GIB,
                                       in_process=True))
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="specdec-vllm-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self._log = self.log_path.open("w")
        self.env_dir = env_dir
        self.proc = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=environ, cwd=str(WORKER.parent))

    def request(self, op: str, **fields) -> dict[str, Any]:
        if self.proc.poll() is not None:
            raise VLLMError(f"the vLLM worker has exited (code {self.proc.returncode}); its log: {self.log_path}\n"
                            f"{self.log_tail()}")
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise VLLMError(f"the vLLM worker died during {op!r} (exit {self.proc.returncode}); its log: "
                            f"{self.log_path}\n{self.log_tail()}")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise VLLMError(f"vLLM refused {op} {fields.get('name', '')!r}: {reply['error']}")
        return reply

    def log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def start(self, name: str, model: str | Path, speculative_config: dict | None = None, *,
              dtype: str = "float32", max_model_len: int = 512, max_num_seqs: int = 1, seed: int = 0) -> float:
        """Start an engine; returns its start-up time in seconds."""
        return self.request("start", name=name, model=str(model), speculative_config=speculative_config,
                            dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                            seed=seed)["start_s"]

    def generate(self, name: str, prompts: Sequence[Sequence[int]], max_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 forget: bool = True) -> dict[str, Any]:
        """{"outputs": [[ids]], "wall_s", "prefill_s": [...], "spec": counter changes} for one batch (and
        "steps" from a suffix decoding engine: per prompt, [drafted, accepted] of each round that drafted).
        `forget`: a suffix decoding engine first evicts the responses of these prompts' earlier runs."""
        return self.request("generate", name=name, prompts=[list(map(int, p)) for p in prompts],
                            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            forget=forget)

    def stop(self, name: str) -> None:
        self.request("stop", name=name)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("exit")
                self.proc.wait(timeout=60)
            except (VLLMError, OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> VLLMWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def acceptance_by_position(spec: dict[str, Any]) -> list[float]:
    """vLLM's per-position acceptance: accepted at position i / drafts (every draft has γ positions)."""
    drafts = spec["drafts"]
    return [a / drafts for a in spec["accepted_per_pos"]] if drafts else []


def decode_stats(spec: dict[str, Any], gamma: int | None, new_tokens: int, wall_s: float, prefill_s: float | None,
                 steps: Sequence[Sequence[int]] | None = None):
    """A DecodeStats from one request's counter changes: each draft is a round of γ drafted tokens; or, given
    `steps` (suffix decoding: [drafted, accepted] of each round that drafted), those rounds, and one that
    drafted nothing for each other target pass after the prompt's."""
    from specdec.core.stats import DecodeStats

    s = DecodeStats(new_tokens=new_tokens, wall_s=wall_s, prefill_s=prefill_s or 0.0)
    if steps is not None:
        for drafted, accepted in steps:
            s.record_round(drafted, accepted, "recovered" if accepted < drafted else "bonus")
        committed = sum(1 + accepted for _, accepted in steps)  # tokens those rounds committed
        for _ in range(max(0, new_tokens - 1 - committed)):
            s.record_round(0, 0, "target_only")
        s.target_forwards = s.rounds
        s.draft_forwards = 0  # model-free
        return s
    if gamma is None:  # plain: one target pass per token after the prompt's
        s.target_forwards = max(0, new_tokens - 1)
        return s
    per_pos = list(spec["accepted_per_pos"]) + [0] * (gamma - len(spec["accepted_per_pos"]))
    s.rounds = s.target_forwards = spec["drafts"]
    s.draft_forwards = spec["draft_tokens"]
    s.drafted, s.accepted = spec["draft_tokens"], spec["accepted"]
    s.drafted_at = [spec["drafts"]] * gamma
    s.accepted_at = per_pos[:gamma]
    s.gammas = [gamma] * spec["drafts"]
    s.bonus = per_pos[gamma - 1] if gamma <= len(per_pos) else 0  # rounds that accepted every draft
    s.recovered = s.rounds - s.bonus
    return s


@dataclass(frozen=True)
class VLLMSettings:
    """The bench's checkpoints (copied into a bundle for vLLM) and where the vLLM environment is."""

    target_dir: str
    draft_dir: str | None = None  # vllm-speculative with the draft model
    head: str | None = None  # vllm-speculative with this EAGLE / EAGLE-3 head ('default': the shipped EAGLE head)
    env_dir: str | None = None  # None: vllm_env.default_vllm_env()
    work_dir: str | None = None  # where the bundles and the worker's log go (None: a temporary directory)

    def as_dict(self) -> dict[str, Any]:
        return {"target_dir": self.target_dir, "draft_dir": self.draft_dir, "head": self.head,
                "env_dir": self.env_dir, "work_dir": self.work_dir}


class VLLMPeer:
    """The worker and its engines: `vllm-plain`, and `vllm-speculative@γ` for each γ; `run` does one request."""

    def __init__(self, settings: VLLMSettings, *, dtype: torch.dtype, threads: int, gammas: Sequence[int],
                 plain: bool, speculative: bool, suffix: bool = False, max_model_len: int = 512):
        from specdec.hub.vllm_bundle import write_vllm_bundle

        if dtype not in DTYPES:
            raise ConfigError(f"the vLLM methods run at float32 or bfloat16, not {str(dtype).replace('torch.', '')}: "
                              "pass --dtype float32 or --dtype bfloat16")
        self.dtype, self.settings = DTYPES[dtype], settings
        self.work = Path(settings.work_dir or tempfile.mkdtemp(prefix="specdec-vllm-"))
        self.drafter = None
        if speculative:
            if settings.head is not None:
                self.drafter = _head_kind(settings.head)
            elif settings.draft_dir is not None:
                self.drafter = "draft"
            else:
                raise ConfigError("vllm-speculative needs the draft's checkpoint directory (--draft PATH) or an "
                                  "EAGLE head (--vllm-head DIR)")
        self.bundle = write_vllm_bundle(self.work / "bundle", drafter=self.drafter, target=settings.target_dir,
                                        draft=settings.draft_dir or "default", head=settings.head or "default",
                                        gamma=max(gammas) if gammas else 1)
        # One worker per engine: vLLM keeps its parallel state per process, so an engine started after another
        # in the same process leaves the first unusable. Workers import vLLM side by side, then start engines.
        names = (["vllm-plain"] if plain else []) + [f"vllm-speculative@{g}" for g in (gammas if speculative else [])]
        specs = {name: None if name == "vllm-plain" else
                 dict(self.bundle.speculative_config, num_speculative_tokens=int(name.rsplit("@", 1)[1]))
                 for name in names}
        if suffix:
            from specdec.bench.vllm_env import require_suffix_decoding
            from specdec.hub.vllm_bundle import speculative_config

            require_suffix_decoding(settings.env_dir)
            names.append("vllm-suffix")
            specs["vllm-suffix"] = speculative_config("suffix")  # vLLM's defaults
        self.workers: dict[str, VLLMWorker] = {}
        self.engines: dict[str, dict[str, Any]] = {}
        try:
            for name in names:
                self.workers[name] = VLLMWorker(settings.env_dir, threads=threads,
                                                log_path=self.work / f"{name.replace('@', '-')}.log")
            for name in names:
                seconds = self.workers[name].start(name, self.bundle.target, specs[name], dtype=self.dtype,
                                                   max_model_len=max_model_len)
                self.engines[name] = {"start_s": seconds, "speculative_config": specs[name]}
        except BaseException:
            self.close()
            raise

    def describe(self) -> dict[str, Any]:
        from specdec.bench.vllm_env import VLLM_PACKAGE, VLLM_VERSION

        return {"vllm": f"{VLLM_PACKAGE}=={VLLM_VERSION}", "dtype": self.dtype, "drafter": self.drafter,
                "prefix_caching": False, "engines": self.engines, "bundle": self.bundle.as_dict(),
                "logs": {name: str(w.log_path) for name, w in self.workers.items()}}

    def run(self, method: str, gamma: int | None, prompt_ids: Sequence[int], *, max_new_tokens: int,
            temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
            seed: int = 0) -> PeerRun:
        name = f"{method}@{gamma}" if method == "vllm-speculative" else method
        if name not in self.engines:
            raise ConfigError(f"no vLLM engine for {name} (started: {', '.join(self.engines)})")
        reply = self.workers[name].generate(name, [prompt_ids], max_new_tokens, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=seed)
        tokens = reply["outputs"][0]
        prefill = reply["prefill_s"][0]
        stats = decode_stats(reply["spec"], gamma if method == "vllm-speculative" else None, len(tokens),
                             reply["wall_s"], prefill, reply["steps"][0] if "steps" in reply else None)
        return PeerRun(tokens, reply["wall_s"], stats, prefill or 0.0,
                       {"vllm_drafts": reply["spec"]["drafts"], "vllm_accepted": reply["spec"]["accepted"]})

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


def _head_kind(head: str) -> str:
    """"eagle" or "eagle3": the kind of the head saved in directory `head` ('default': the shipped EAGLE head)."""
    from specdec.heads.common import read_head

    if head == "default":
        return "eagle"
    config, _ = read_head(head, "eagle")
    variant = config.get("variant", "eagle")
    if variant not in ("eagle", "eagle3"):
        raise ConfigError(f"{head}: vllm-speculative drafts with an EAGLE or EAGLE-3 head, not {variant!r}")
    return variant
