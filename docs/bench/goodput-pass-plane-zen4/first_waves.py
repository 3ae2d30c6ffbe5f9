"""`specdec serve --drafter draft --gamma 4 --threads 1 --dtype float32 --compile --max-batch 32` as a new server
meets its load: two 8-token requests, a wave of 8 requests at one stream and one at 8 streams (128 tokens each),
then WAVES waves of 32 requests at 32 streams, measured. Per 32-stream wave: tokens/s, the rounds the server ran
and their mean time (its /metrics), inter-token latency and time to first token. 64-token held-out `code` prompts,
the server and this client not pinned. The code under test is the one `python -m specdec` imports (PYTHONPATH).

    WAVES=3 flock /tmp/specdec-bench.lock python docs/bench/goodput-pass-plane-zen4/first_waves.py
"""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serve_vllm import free_port, wait_healthy, wave  # noqa: E402

import specdec  # noqa: E402
from specdec.bench.workloads import load_workload  # noqa: E402

target, _, tokenizer = specdec.load_default(dtype="float32")
prompts = [list(p.ids) for p in load_workload("code", tokenizer, 32, prompt_tokens=64)]
port = free_port()
server = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--port", str(port), "--drafter", "draft",
                           "--gamma", "4", "--threads", "1", "--dtype", "float32", "--compile", "--max-batch", "32"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
url = f"http://127.0.0.1:{port}"


def rounds() -> tuple[float, float]:
    """The server's rounds so far and their summed seconds."""
    values = {}
    for family in text_string_to_metric_families(urllib.request.urlopen(url + "/metrics").read().decode()):
        for sample in family.samples:
            values[sample.name] = sample.value
    return values["specdec:round_seconds_count"], values["specdec:round_seconds_sum"]


try:
    print("healthy after", round(wait_healthy(url, server, 900), 1), "s", flush=True)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
    model = client.models.list().data[0].id
    wave(client, model, prompts[:2], 2, 8)
    for streams in (1, 8):
        wave(client, model, prompts[:8], streams, 128)
    for i in range(int(os.environ.get("WAVES", "3"))):
        count, seconds = rounds()
        results, wall = wave(client, model, prompts, 32, 128)
        after = rounds()
        count, seconds = after[0] - count, after[1] - seconds
        itls = sorted(r["itl"] for r in results if r["itl"])
        print(json.dumps({"wave": i, "tok_s": round(sum(r["tokens"] for r in results) / wall, 1),
                          "rounds": count, "round_ms": round(1e3 * seconds / count, 2),
                          "itl_med_ms": round(1e3 * itls[len(itls) // 2], 2),
                          "itl_p95_ms": round(1e3 * itls[int(0.95 * (len(itls) - 1))], 2),
                          "ttft_med_s": round(sorted(r["ttft"] for r in results)[len(results) // 2], 3)}), flush=True)
finally:
    server.terminate()
    server.wait()
