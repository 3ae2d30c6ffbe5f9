"""Load / soak test of `specdec serve`: N concurrent streaming clients x M requests each, bounded.

Starts `specdec serve` (the default pair unless --serve-args say otherwise) as a subprocess on 127.0.0.1,
drives it with the openai client (streaming, include_usage), and reports: aggregate generated tokens/s,
p50/p99 time-to-first-token and inter-token latency (per request: (last chunk - first chunk) / (tokens - 1)),
draft acceptance from /metrics, 5xx count, and the server's RSS before and after.

    python benchmarks/serve_load.py --clients 8 --requests 2 --max-tokens 128 --serve-args "--drafter none"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--serve-args", default="", help="extra `specdec serve` arguments")
    parser.add_argument("--warmup", type=int, default=1,
                        help="waves of --clients concurrent requests sent before measuring (so the allocator's "
                        "high-water mark for this concurrency is reached before RSS is read)")
    parser.add_argument("--phases", type=int, default=1,
                        help="run the measured load this many times back to back, reading the server's RSS after "
                        "each (growth that continues phase after phase is a leak; growth in the first only is the "
                        "allocator settling)")
    parser.add_argument("--start-timeout", type=float, default=1800,
                        help="seconds to wait for the server's /health (the compiled path compiles its passes first)")
    parser.add_argument("--server-log", default="/tmp/specdec-serve-load.log", help="the server's stderr goes here")
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args()

    import httpx2 as httpx
    import openai

    from specdec.bench.workloads import code_prompts
    from specdec.hub.default_pair import load_default

    _, _, tokenizer = load_default()
    prompts = [p.ids for p in code_prompts(tokenizer, max(args.clients * args.requests, 1), args.prompt_tokens)]

    port = free_port()
    cmd = [sys.executable, "-m", "specdec", "serve", "--port", str(port), *shlex.split(args.serve_args)]
    # The server's log goes to a file (a pipe nobody reads could fill up and block it).
    log_file = open(args.server_log, "w")  # noqa: SIM115 (closed with the server below)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_file, text=True)
    url = f"http://127.0.0.1:{port}"
    launched = time.perf_counter()
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                log_file.flush()
                with open(args.server_log) as f:
                    print(f.read()[-5000:], file=sys.stderr)
                return 1
            time.sleep(0.2)
        startup_s = time.perf_counter() - launched
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        for _ in range(args.warmup):
            wave = [threading.Thread(target=client.completions.create, kwargs=dict(
                model=model, prompt=prompts[i % len(prompts)], max_tokens=args.max_tokens, temperature=0))
                for i in range(args.clients)]
            for t in wave:
                t.start()
            for t in wave:
                t.join()
        rss_before = rss_mb(server.pid)
        metrics_before = httpx.get(url + "/metrics").text

        results, errors = [], []
        lock = threading.Lock()

        def worker(c: int) -> None:
            for r in range(args.requests):
                prompt = prompts[(c * args.requests + r) % len(prompts)]
                sent = time.perf_counter()
                first = last = None
                tokens = 0
                try:
                    stream = client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                                       temperature=args.temperature, stream=True,
                                                       stream_options={"include_usage": True})
                    for chunk in stream:
                        now = time.perf_counter()
                        if chunk.choices and chunk.choices[0].text:
                            first = first or now
                            last = now
                        if chunk.usage is not None:
                            tokens = chunk.usage.completion_tokens
                except openai.APIStatusError as exc:
                    with lock:
                        errors.append(exc.status_code)
                    continue
                with lock:
                    results.append({"ttft": (first or sent) - sent, "tokens": tokens,
                                    "itl": (last - first) / (tokens - 1) if first and tokens > 1 else None})

        start = time.perf_counter()
        rss_phases = []
        for _ in range(args.phases):
            threads = [threading.Thread(target=worker, args=(c,)) for c in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rss_phases.append(round(rss_mb(server.pid), 1))
        wall = time.perf_counter() - start
        metrics_after = httpx.get(url + "/metrics").text
        rss_after = rss_mb(server.pid)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log_file.close()

    def delta(name: str) -> float:
        return metric(metrics_after, name) - metric(metrics_before, name)

    drafted = delta("specdec:spec_decode_num_draft_tokens_total")
    accepted = delta("specdec:spec_decode_num_accepted_tokens_total")
    rounds = delta("specdec:batch_size_count")
    tokens = sum(r["tokens"] for r in results)
    itls = [r["itl"] for r in results if r["itl"] is not None]
    report = {
        "serve_args": args.serve_args, "clients": args.clients, "requests": len(results) + len(errors),
        "completed": len(results), "errors_5xx": sum(1 for e in errors if e >= 500), "errors_4xx": sum(1 for e in errors if 400 <= e < 500),
        "tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_s": round(percentile([r["ttft"] for r in results], 0.5), 3),
        "ttft_p99_s": round(percentile([r["ttft"] for r in results], 0.99), 3),
        "itl_p50_ms": round(1000 * percentile(itls, 0.5), 1), "itl_p99_ms": round(1000 * percentile(itls, 0.99), 1),
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "mean_batch": round(delta("specdec:batch_size_sum") / rounds, 2) if rounds else None,
        "mean_gamma_cap": round(delta("specdec:gamma_chosen_sum") / rounds, 2) if rounds else None,
        "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_after, 1),
        "rss_growth_mb": round(rss_after - rss_before, 1),
        "rss_after_each_phase_mb": rss_phases, "load": os.getloadavg(), "startup_s": round(startup_s, 1),
        "mean_tokens_per_request": round(statistics.mean(r["tokens"] for r in results), 1) if results else 0,
    }
    print(json.dumps(report))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, args.json)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
