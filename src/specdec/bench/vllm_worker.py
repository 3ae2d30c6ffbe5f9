"""vLLM's offline engine, driven by specdec: run by the vLLM environment's python, never imported by specdec.

    <vllm-env>/bin/python vllm_worker.py        (started by specdec.bench.vllm_peer.VLLMWorker)

It reads one JSON request per line on stdin and writes one JSON reply per line on its stdout; everything
else vLLM prints goes to stderr (fd 1 is pointed there once the reply channel is kept aside). It imports
nothing of specdec (vLLM's environment has another transformers), only the standard library and vLLM.

Requests (every reply has "ok"; a failed request answers {"ok": false, "error": "Type: message"}):

* {"op": "start", "name", "model", "speculative_config" (dict or null), "dtype", "max_model_len",
  "max_num_seqs", "seed"}  ->  {"start_s"}: an engine (`vllm.LLM`, eager, prefix caching off) kept under
  `name`; with VLLM_ENABLE_V1_MULTIPROCESSING=0 its core runs in this process, so several engines start
  without importing vLLM again;
* {"op": "generate", "name", "prompts": [[ids]], "max_tokens", "temperature", "top_k", "top_p", "seed", "forget"}
  ->  {"outputs": [[ids]], "wall_s", "prefill_s": [s], "spec": {"drafts", "draft_tokens", "accepted", "accepted_per_pos"}}:
  the prompts as one batch, end-of-sequence ignored (exactly max_tokens each), greedy at temperature 0;
  "spec" is the change of vLLM's own spec-decode counters over this call. On a suffix decoding engine
  (speculative method "suffix") a prompt run before is first forgotten by the engine's suffix cache unless
  "forget" is false: its earlier runs' responses are evicted (untimed), so a rerun is drafted from the other
  requests' responses only, as specdec's SuffixCache does; a benchmark's repeats stay fair. Such an engine
  drafts a different number of tokens each round, so its reply also has "steps": per prompt, the [drafted,
  accepted] of every round that drafted (vLLM's per-request spec-decode metrics, "detailed");
* {"op": "stop", "name"}  ->  {}: the engine shut down and dropped;
* {"op": "exit"}  ->  {} and the process ends.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

#: vLLM's spec-decode counters (Counter metrics) and their per-position vector.
COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted": "vllm:spec_decode_num_accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """The spec-decode counters now, summed over every engine label (zeros for a plain engine)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {key: 0 for key in COUNTERS}
    per_pos: list[int] = []
    for metric in llm.get_metrics():
        for key, name in COUNTERS.items():
            if metric.name == name and isinstance(metric, Counter):
                out[key] += int(metric.value)
        if metric.name == PER_POSITION and isinstance(metric, Vector):
            per_pos += [0] * (len(metric.values) - len(per_pos))
            for i, v in enumerate(metric.values):
                per_pos[i] += int(v)
    out["accepted_per_pos"] = per_pos
    return out


def delta(after: dict, before: dict) -> dict:
    out = {key: after[key] - before[key] for key in COUNTERS}
    pos_before = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], pos_before)]
    return out


def forget_responses(worker, prefixes):
    """Run in vLLM's worker (LLM.collective_rpc): evict from the suffix decoding cache every response of a
    request whose id starts with one of `prefixes` (vLLM appends random characters to the ids it is given).
    Stops such a request first if the cache still holds it as active (vLLM stops finished requests lazily,
    at the next round). Returns how many responses were evicted."""
    cache = worker.model_runner.drafter.suffix_cache
    prefixes = tuple(prefixes)
    for req_id in [r for r in cache.active_requests if str(r).startswith(prefixes)]:
        cache.stop_request(req_id)
    evicted = [r for r in cache.cached_requests if str(r).startswith(prefixes)]
    for req_id in evicted:
        cache.evict_cached_response(req_id)
    return len(evicted)


class Engines:
    def __init__(self):
        self.engines = {}
        self.suffix = {}  # name -> {prompt: [request ids it ran under]} for suffix decoding engines

    def start(self, name, model, speculative_config=None, dtype="float32", max_model_len=512, max_num_seqs=1,
              seed=0):
        from vllm import LLM

        if name in self.engines:
            raise ValueError(f"an engine named {name!r} is already running")
        suffix = (speculative_config or {}).get("method") == "suffix"
        extra = {"per_request_spec_decode_metrics": "detailed"} if suffix else {}
        start = time.perf_counter()
        self.engines[name] = LLM(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                 seed=seed, enforce_eager=True, enable_prefix_caching=False,
                                 speculative_config=speculative_config, disable_log_stats=False, **extra)
        if suffix:
            self.suffix[name] = {}
        return {"start_s": time.perf_counter() - start}

    def generate(self, name, prompts, max_tokens, temperature=0.0, top_k=None, top_p=None, seed=0, forget=True):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self.engines[name]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k or 0,
                                top_p=1.0 if top_p is None else top_p, seed=seed if temperature > 0 else None,
                                ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts]
        runs = self.suffix.get(name)
        if runs is not None:
            earlier = [f"{rid}-" for ids in prompts for rid in runs.get(tuple(ids), [])]
            if earlier and forget:
                llm.collective_rpc(forget_responses, args=(earlier,))
        before = spec_counters(llm)
        start = time.perf_counter()
        results = llm.generate(batch, params, use_tqdm=False)
        wall = time.perf_counter() - start
        if runs is not None:
            for ids, result in zip(prompts, results):
                runs.setdefault(tuple(ids), []).append(result.request_id)
        outputs = [list(r.outputs[0].token_ids) for r in results]
        # the engine's own prompt pass: first token minus scheduling (engine-core timestamps)
        prefill = [r.metrics.first_token_ts - r.metrics.scheduled_ts if r.metrics is not None else None
                   for r in results]
        reply = {"outputs": outputs, "wall_s": wall, "prefill_s": prefill, "spec": delta(spec_counters(llm), before)}
        if runs is not None:
            metrics = [r.outputs[0].spec_decode_metrics for r in results]
            reply["steps"] = [[] if m is None else [list(pair) for pair in zip(m.per_step_drafted, m.per_step_accepted)]
                              for m in metrics]
        return reply

    def stop(self, name):
        llm = self.engines.pop(name)
        self.suffix.pop(name, None)
        llm.llm_engine.engine_core.shutdown()  # LLM has no shutdown of its own in 0.32; its core client does
        del llm
        gc.collect()
        return {}


def main() -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints go to stderr, the reply channel stays clean
    sys.stdout = sys.stderr
    engines = Engines()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.pop("op")
        try:
            if op == "exit":
                replies.write(json.dumps({"ok": True}) + "\n")
                return 0
            ops = {"start": engines.start, "generate": engines.generate, "stop": engines.stop}
            if op not in ops:
                raise ValueError(f"unknown op {op!r}; one of {', '.join([*ops, 'exit'])}")
            reply = ops[op](**request)
            reply["ok"] = True
        except Exception as exc:  # reported to specdec, which raises it there with vLLM's message
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
