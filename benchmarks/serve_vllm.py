"""`specdec serve` and `vllm serve` side by side: the same pair, prompts and concurrency, through the openai client.

Starts each server in turn on 127.0.0.1, both with --threads threads and in --dtype (float32 unless asked;
specdec's with `--drafter D --gamma G`, eager unless --specdec-args say `--compile`; vLLM's CPU build from the
vLLM environment with the same checkpoints, exported by `specdec export --format vllm --drafter D --gamma G`;
D = --drafter: the draft model, or suffix decoding, each engine's own with its defaults unless --gamma is given),
then for each concurrency c in --concurrency sends max(c, --requests) greedy streaming completions, c at a time,
of held-out prompts of the --prompts workload (token ids; `agent`'s in session order) and reports per server and
c: generated tokens/s over the wave, time to first token and inter-token latency (per request (last chunk -
first chunk) / (tokens - 1)), medians and p95, and
whether each request's text equals specdec's offline plain decoding of the same prompt (greedy, in --dtype; in
bfloat16 on the fast path, `compile=True`, whose bits the server's compiled passes give); for specdec, the rounds
its goodput policy ran at each γ cap (from its /metrics). vLLM's bfloat16 is its own arithmetic, so its texts may
part from specdec's there.

    python benchmarks/serve_vllm.py --concurrency 1,8,32 --max-tokens 128 --json serve_vllm.json

Needs the vLLM environment (`specdec bench --vllm-setup`, or --vllm-env DIR). Engine start-up is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def wait_healthy(url: str, server: subprocess.Popen, timeout: float) -> float:
    import httpx2 as httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"server at {url} did not become healthy (exit {server.poll()})")


def wave(client, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    """Every prompt once, `concurrency` requests in flight; per request: text, tokens, ttft, itl. A refused request
    ends the wave (SystemExit with the server's message)."""
    import openai

    results: list[dict] = [{} for _ in prompts]
    next_index = iter(range(len(prompts)))
    lock = threading.Lock()
    errors: list[Exception] = []

    def worker() -> None:
        while not errors:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            sent = time.perf_counter()
            first = last = None
            text, tokens = [], 0
            try:
                stream = client.completions.create(model=model, prompt=prompts[i], max_tokens=max_tokens,
                                                   temperature=0, stream=True, stream_options={"include_usage": True})
            except openai.APIError as exc:  # the server refused it: end the wave with its message
                errors.append(exc)
                return
            for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    first = first or now
                    last = now
                    text.append(chunk.choices[0].text)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            results[i] = {"text": "".join(text), "tokens": tokens, "ttft": (first or sent) - sent,
                          "itl": (last - first) / (tokens - 1) if first and tokens > 1 else None}

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"the server refused a request: {errors[0]}")
    return results, time.perf_counter() - start


def gamma_rounds(url: str) -> dict[str, float]:
    """specdec's server: rounds run so far per chosen γ cap, from its /metrics histogram (cumulative buckets)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    cumulative = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "specdec:gamma_chosen_bucket":
                cumulative[float(sample.labels["le"])] = sample.value
    out, below = {}, 0.0
    for le in sorted(cumulative):
        if le != float("inf"):
            out[str(int(le))] = cumulative[le] - below
            below = cumulative[le]
    return out


def summarize(results: list[dict], wall: float, reference: list[str]) -> dict:
    itls = [r["itl"] for r in results if r["itl"] is not None]
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1),
            "ttft_median_s": round(statistics.median(ttfts), 3), "ttft_p95_s": round(percentile(ttfts, 0.95), 3),
            "itl_median_ms": round(1000 * statistics.median(itls), 1) if itls else None,
            "itl_p95_ms": round(1000 * percentile(itls, 0.95), 1) if itls else None,
            "identical": sum(r["text"] == ref for r, ref in zip(results, reference)),
            "identical_per_request": [r["text"] == ref for r, ref in zip(results, reference)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", type=int, default=8, help="requests per wave at least (held-out prompts)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=None,
                        help="γ of both servers (default: 4 for the draft model; each engine's own for suffix)")
    parser.add_argument("--drafter", choices=("draft", "suffix"), default="draft",
                        help="what both servers draft with: the draft model, or suffix decoding")
    parser.add_argument("--prompts", choices=("code", "edit", "agent"), default="code",
                        help="the held-out workload (specdec bench's; --prompt-tokens sizes `code`'s)")
    parser.add_argument("--warmup-prompts", choices=("code", "edit", "agent"), default=None,
                        help="before the waves, one unmeasured wave of this workload at the highest concurrency "
                             "(--requests prompts), so that shapes compiled on first use are compiled before "
                             "timing (default: two short requests)")
    parser.add_argument("--servers", default="specdec,vllm")
    parser.add_argument("--threads", type=int, default=1, help="threads of each server (both alike)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="both servers' precision, and the reference's")
    parser.add_argument("--specdec-args", default="--no-compile",
                        help="extra `specdec serve` arguments (--drafter, --gamma, --threads and --dtype are set "
                             "by this script)")
    parser.add_argument("--vllm-env", default=None)
    parser.add_argument("--start-timeout", type=float, default=1800)
    parser.add_argument("--log-dir", default=None, help="servers' logs (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import openai

    import specdec
    from specdec.bench.runner import VLLM_DRAFT_ROOM
    from specdec.bench.vllm_env import default_vllm_env, run_environment, serve_command
    from specdec.bench.workloads import load_workload
    from specdec.hub.vllm_bundle import DEFAULT_GAMMA, write_vllm_bundle

    levels = [int(c) for c in args.concurrency.split(",")]
    target, _, tokenizer = specdec.load_default(dtype=args.dtype)
    prompts = [list(p.ids) for p in load_workload(args.prompts, tokenizer, max(max(levels), args.requests),
                                                  prompt_tokens=args.prompt_tokens)]
    warmup = prompts[:2] if args.warmup_prompts is None else [
        list(p.ids) for p in load_workload(args.warmup_prompts, tokenizer, args.requests, seed=1,
                                           prompt_tokens=args.prompt_tokens)]
    gamma = args.gamma if args.gamma is not None or args.drafter == "suffix" else DEFAULT_GAMMA
    gamma_args = ["--gamma", str(gamma)] if gamma is not None else []
    # specdec's offline plain decoding, greedy, stopping at end-of-sequence as both servers do; bfloat16 on the fast
    # path (float32's eager and compiled passes agree)
    compile_ = args.dtype == "bfloat16"
    reference = [tokenizer.decode(specdec.generate(target, p, max_new_tokens=args.max_tokens, compile=compile_,
                                                   eos_token_id=tokenizer.eos_token_id).tokens,
                                  skip_special_tokens=True)
                 for p in prompts]
    work = Path(args.log_dir or tempfile.mkdtemp(prefix="serve-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    report = {"dtype": args.dtype, "levels": levels, "max_tokens": args.max_tokens,
              "prompt_tokens": args.prompt_tokens, "gamma": gamma, "drafter": args.drafter, "prompts": args.prompts,
              "warmup_prompts": args.warmup_prompts,
              "servers": {}, "load_before": os.getloadavg()}
    for name in args.servers.split(","):
        port = free_port()
        environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
        if name == "specdec":
            # the precision of vLLM's and the reference's (`--dtype auto` would pick by the CPU)
            command = [sys.executable, "-m", "specdec", "serve", "--port", str(port), "--drafter", args.drafter,
                       *gamma_args, "--threads", str(args.threads), "--dtype", args.dtype,
                       *shlex.split(args.specdec_args)]
        else:
            env_dir = Path(args.vllm_env) if args.vllm_env else default_vllm_env()
            bundle = write_vllm_bundle(work / "bundle", drafter=args.drafter, gamma=gamma)
            longest = max(len(p) for p in prompts + warmup)  # and room past the last token for a round's drafts
            command = serve_command(env_dir, bundle.target, bundle.speculative_config, port=port, dtype=args.dtype,
                                    max_model_len=max(512, longest + args.max_tokens + VLLM_DRAFT_ROOM),
                                    max_num_seqs=max(levels))
            environ.pop("PYTHONPATH", None)
            environ.update(run_environment(env_dir, threads=args.threads))
        with open(work / f"{name}.log", "w") as log:
            server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environ)
            url = f"http://127.0.0.1:{port}"
            try:
                startup = wait_healthy(url, server, args.start_timeout)
                client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
                model = client.models.list().data[0].id
                wave(client, model, warmup, max(levels) if args.warmup_prompts else 2,
                     args.max_tokens if args.warmup_prompts else 8)  # not measured
                entry = {"command": command, "startup_s": round(startup, 1), "levels": {}}
                for c in levels:
                    batch = prompts[: max(c, args.requests)]
                    before = gamma_rounds(url) if name == "specdec" else {}
                    results, wall = wave(client, model, batch, c, args.max_tokens)
                    entry["levels"][str(c)] = summarize(results, wall, reference)
                    if name == "specdec":  # which γ cap the goodput policy ran, in rounds
                        after = gamma_rounds(url)
                        entry["levels"][str(c)]["rounds_by_gamma"] = {
                            g: after[g] - before.get(g, 0.0) for g in after if after[g] > before.get(g, 0.0)}
                    entry["levels"][str(c)]["load"] = os.getloadavg()
                    print(name, c, json.dumps({k: v for k, v in entry["levels"][str(c)].items()
                                               if k != "identical_per_request"}), flush=True)
                report["servers"][name] = entry
            finally:
                server.terminate()
                try:
                    server.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    server.kill()
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
