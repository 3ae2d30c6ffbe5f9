"""Same-session A/B of the compiled float32 server (the default pair, draft γ 4, one thread): the old code (a worktree
whose src/ is $OLD_SRC, on PYTHONPATH) against this checkout, alternated, two starts each; 8 held-out `code` prompts
of 64 tokens, 128 greedy tokens, waves at 1 and 8 streams. Run from the repository root:

    git worktree add /tmp/wt-old <old rev>
    OLD_SRC=/tmp/wt-old/src flock /tmp/specdec-bench.lock python docs/bench/serve-host-work-zen4/ab.py
"""
import json, os, subprocess, sys, time, statistics
sys.path.insert(0, "benchmarks")
from serve_vllm import wave, wait_healthy, free_port
import openai, specdec
from specdec.bench.workloads import load_workload
_, _, tok = specdec.load_default()
prompts = [list(p.ids) for p in load_workload("code", tok, 32, prompt_tokens=64)]
out = {}
for rep in range(2):
    for side in ("old", "new"):
        env = dict(os.environ)
        if side == "old":
            env["PYTHONPATH"] = os.environ["OLD_SRC"]
        port = free_port()
        cmd = [sys.executable, "-m", "specdec", "serve", "--port", str(port), "--drafter", "draft", "--gamma", "4",
               "--threads", "1", "--dtype", "float32", "--max-batch", "32", "--compile"]
        srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", srv, 900)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
            model = client.models.list().data[0].id
            wave(client, model, prompts[:8], 8, 128)
            for c in (1, 8, 1, 8, 1, 8):
                results, wall = wave(client, model, prompts[:8], c, 128)
                assert all(r["tokens"] == 128 for r in results)
                out.setdefault(side, {}).setdefault(c, []).append(round(sum(r["tokens"] for r in results) / wall, 1))
        finally:
            srv.terminate(); srv.wait()
        print(side, rep, json.dumps(out[side]), flush=True)
for c in (1, 8):
    o, n = statistics.median(out["old"][c]), statistics.median(out["new"][c])
    print(f"{c} streams: old {o} new {n} new/old {n / o:.3f}")
print(json.dumps({"load": os.getloadavg()}))
