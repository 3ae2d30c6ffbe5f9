"""The server's identity table: greedy completions from `specdec serve` at 1, 8 and 32 concurrent streams, each
token-identical to the same prompt sent alone?

Starts `specdec serve` on the shipped default pair (its default drafter and load-based γ; `--dtype`, 1 thread,
`--compile` for the compiled batched path) as a subprocess on a free port. Sends each held-out code prompt
alone (one stream at a time: every round has 1 row), then all of them again from 8 and from 32 concurrent
streams (the openai client, temperature 0, `max_tokens` new tokens, `logprobs=0` so each token comes back as its
piece), and compares every stream's tokens with that prompt's lone output. The lone outputs are compared with
in-process plain decoding too (`specdec.plain_reference`: eager, or compiled with `--compile`, same dtype); a
divergence from it gets the plain pass's top-2 gap and margin there (`specdec.check_greedy`'s measures,
docs/exactness.md). The server stops at EOS (it has no switch to ignore it), and so does the reference.

Rows per round (did the batch form?) come from the server's `specdec:batch_size` histogram, read before and
after each phase: rounds, mean rows, and rounds per bucket.

    OMP_NUM_THREADS=1 python benchmarks/server_identity.py --out docs/bench/identity-bf16
    OMP_NUM_THREADS=1 python benchmarks/server_identity.py --serve-args=--fixed-gamma --label fixed-gamma --out docs/bench/identity-bf16
    OMP_NUM_THREADS=1 python benchmarks/server_identity.py --compile --out docs/bench/identity-bf16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import specdec
from specdec.bench.workloads import code_prompts
from specdec.engine.decoding import SpeculativeDecoder
from specdec.exactness import plain_reference
from specdec.exactness.greedy import NEAR_TIE_ULPS, PlainScores

BUCKET = re.compile(r'^specdec:batch_size_bucket\{le="([^"]+)"\} (\S+)$', re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch_histogram(metrics: str) -> dict:
    """The server's rows-per-round histogram: rounds, rows (summed over rounds), cumulative rounds per bucket."""
    def value(name: str) -> float:
        match = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.M)
        return float(match.group(1)) if match else 0.0

    return {"rounds": value("specdec:batch_size_count"), "rows": value("specdec:batch_size_sum"),
            "gamma_sum": value("specdec:gamma_chosen_sum"), "drafted": value("specdec:spec_decode_num_draft_tokens_total"),
            "accepted": value("specdec:spec_decode_num_accepted_tokens_total"),
            "buckets": {le: float(n) for le, n in BUCKET.findall(metrics)}}


def rows_per_round(before: dict, after: dict) -> dict:
    """A phase's rounds: how many, mean rows, mean γ cap, and rounds per rows bucket ('≤1', '2-2', '3-4', ...)."""
    rounds = after["rounds"] - before["rounds"]
    cumulative = {le: after["buckets"][le] - before["buckets"].get(le, 0.0) for le in after["buckets"]}
    per_bucket, low, below = {}, 1, 0.0
    for le, n in cumulative.items():
        if le == "+Inf":
            label = f">{low - 1}"
        else:
            high = int(float(le))
            label = f"{low}" if low == high else f"{low}-{high}"
            low = high + 1
        if n - below:
            per_bucket[label] = int(n - below)
        below = n
    return {"rounds": int(rounds), "mean_rows": round((after["rows"] - before["rows"]) / rounds, 2) if rounds else 0,
            "mean_gamma_cap": round((after["gamma_sum"] - before["gamma_sum"]) / rounds, 2) if rounds else 0,
            "rounds_by_rows": per_bucket, "drafted": int(after["drafted"] - before["drafted"]),
            "accepted": int(after["accepted"] - before["accepted"])}


class Server:
    """`specdec serve` in a subprocess on a free port, its log in a file."""

    def __init__(self, args: list[str], log: Path, start_timeout: float) -> None:
        import httpx2 as httpx
        import openai

        self.httpx = httpx
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--port", str(port), *args],
                                        stdout=subprocess.DEVNULL, stderr=self.log, env=env)
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"specdec serve did not start; its log: {log}\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=3600)

    def pieces(self, ids: list[int], max_tokens: int) -> list[str]:
        """A greedy completion of `ids`, as its tokens' pieces (each token decoded alone)."""
        out = self.client.completions.create(model=self.model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                             logprobs=0)
        return list(out.choices[0].logprobs.tokens)

    def histogram(self) -> dict:
        return batch_histogram(self.httpx.get(self.url + "/metrics").text)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(outputs: dict[str, list[str]], against: dict[str, list[str]]) -> tuple[list[dict], int]:
    """(per diverging prompt: its first differing position and both pieces there; tokens compared)."""
    divergences, compared = [], 0
    for name, got in outputs.items():
        want = against[name]
        at = first_difference(got, want)
        compared += len(want) if at is None else at + 1
        if at is not None:
            divergences.append({"prompt": name, "position": at, "want": want[at] if at < len(want) else None,
                                "got": got[at] if at < len(got) else None})
    return divergences, compared


def plain_pass_at(target, prompt: list[int], method: list[int], position: int, new_tokens: int,
                  compile: bool) -> dict:
    """The plain pass at a divergence: top-2 gap and the margin of the method's token, as check_greedy reports."""
    scores = PlainScores()
    scores.start(method)
    plain = SpeculativeDecoder(target, None, verify_fn=scores, max_new_tokens=new_tokens, temperature=0.0,
                               compile=compile)
    tokens = list(plain.stream(prompt))
    return scores.divergence("", position, tokens, method, target.dtype).to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", help="the server's and the reference's dtype (default "
                        "bfloat16)")
    parser.add_argument("--prompts", type=int, default=64, help="held-out code prompts (default 64)")
    parser.add_argument("--new-tokens", type=int, default=128, help="max_tokens per request (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="which held-out code prompts (default 0)")
    parser.add_argument("--streams", default="8,32", help="concurrent streams per phase, after the lone phase "
                        "(default 8,32)")
    parser.add_argument("--compile", action="store_true", help="serve with --compile (the reference is then "
                        "compiled plain decoding)")
    parser.add_argument("--serve-args", default="", help="more `specdec serve` arguments")
    parser.add_argument("--label", default="", help="a name for this server setting, in the file names and the "
                        "table (e.g. fixed-gamma with --serve-args=--fixed-gamma)")
    parser.add_argument("--start-timeout", type=float, default=1800, help="seconds to wait for the server "
                        "(--compile compiles every pass shape first)")
    parser.add_argument("--out", default=None, help="directory for server[-compiled].json and .md")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]

    specdec.set_threads(1)  # identity does not depend on the thread count; the machine is shared
    target, _, tokenizer = specdec.load_default(dtype=args.dtype)
    prompts = {p.name: p.ids for p in code_prompts(tokenizer, args.prompts, seed=args.seed)}
    start = time.time()
    reference = plain_reference(target, prompts, max_new_tokens=args.new_tokens, compile=args.compile)
    piece = tokenizer.batch_decode([[t] for t in range(len(tokenizer))])  # id -> the piece the server sends
    ids_of: dict[str, list[int]] = {}
    for t, p in enumerate(piece):
        ids_of.setdefault(p, []).append(t)
    plain = {name: [piece[t] for t in tokens] for name, tokens in zip(reference.names, reference.tokens)}
    plain_ids = dict(zip(reference.names, reference.tokens))
    print(f"plain reference: {time.time() - start:.0f} s", file=sys.stderr, flush=True)

    serve_args = ["--dtype", args.dtype, "--threads", "1", *(["--compile"] if args.compile else []),
                  *shlex.split(args.serve_args)]
    path = "compiled" if args.compile else "eager"
    name = f"server-{path}" + (f"-{args.label}" if args.label else "")
    log = Path(f"/tmp/specdec-{name.replace('server', 'server-identity')}.log")
    started = time.time()
    server = Server(serve_args, log, args.start_timeout)
    startup_s = time.time() - started
    results = []
    try:
        alone: dict[str, list[str]] = {}
        for n in [1, *streams]:
            before, t0 = server.histogram(), time.time()
            with ThreadPoolExecutor(n) as pool:
                outs = dict(zip(prompts, pool.map(lambda ids: server.pieces(ids, args.new_tokens),
                                                  prompts.values())))
            batches = rows_per_round(before, server.histogram())
            if n == 1:
                alone = outs
            vs_alone, compared = compare(outs, alone)
            vs_plain, _ = compare(outs, plain)
            for d in vs_plain:  # the plain pass there: a near-tie or a bug?
                got = [ids_of[p][0] for p in outs[d["prompt"]]]
                d["plain_pass"] = plain_pass_at(target, prompts[d["prompt"]], got, d["position"], args.new_tokens,
                                                args.compile)
                d["got_ids"] = ids_of.get(d["got"], [])
                d["want_id"] = plain_ids[d["prompt"]][d["position"]] if d["want"] is not None else None
            results.append({"streams": n, "prompts": len(prompts), "identical_to_alone": len(prompts) - len(vs_alone),
                            "identical_to_plain": len(prompts) - len(vs_plain), "tokens_compared": compared,
                            "tokens": sum(map(len, outs.values())), "divergences_from_alone": vs_alone,
                            "divergences_from_plain": vs_plain, **batches, "elapsed_s": round(time.time() - t0, 1)})
            r = results[-1]
            print(f"{n} streams: {r['identical_to_alone']}/{len(prompts)} identical to alone, "
                  f"{r['identical_to_plain']}/{len(prompts)} to plain; {r['rounds']} rounds, mean {r['mean_rows']} "
                  f"rows {r['rounds_by_rows']}, mean γ cap {r['mean_gamma_cap']}, "
                  f"{r['accepted']}/{r['drafted']} drafts accepted ({r['elapsed_s']:.0f} s)", file=sys.stderr, flush=True)
    finally:
        server.stop()
    near_ties = sum(g <= NEAR_TIE_ULPS for gaps in reference.gaps for g in gaps)
    meta = {"command": "OMP_NUM_THREADS=1 python " + shlex.join(sys.argv), "serve_args": serve_args,
            "dtype": args.dtype, "path": path, "label": args.label, "machine": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "load_avg": os.getloadavg(), "startup_s": round(startup_s, 1), "elapsed_s": round(time.time() - start, 1),
            "new_tokens": args.new_tokens, "seed": args.seed, "plain_steps": sum(map(len, reference.gaps)),
            "near_ties": near_ties, "near_tie_ulps": NEAR_TIE_ULPS}
    text = table(results, meta)
    print(text)
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
        (out / f"{name}.md").write_text(f"`{meta['command']}`\n\n{text}\n")


def table(results: list[dict], meta: dict) -> str:
    lines = [f"| dtype | server | streams | identical to the request alone | identical to in-process {meta['path']} "
             "plain | tokens compared | rounds | mean rows per round | rounds by rows | mean γ cap | drafts accepted | divergences |",
             "|:---|:---|---:|---:|---:|---:|---:|---:|:---|---:|---:|:---|"]
    for r in results:
        passes = {d["prompt"]: d["plain_pass"] for d in r["divergences_from_plain"]}
        shown = r["divergences_from_plain"] if r["streams"] == 1 else r["divergences_from_alone"]
        divs = "; ".join(
            f"{d['prompt']} @ {d['position']}: {d['want']!r} -> {d['got']!r}"
            + (f" (plain pass: gap {passes[d['prompt']]['gap']:.4g}, margin {passes[d['prompt']]['ulps']:.3g} ulp)"
               if passes.get(d["prompt"], {}).get("margin") is not None else "")
            for d in shown) or "none"
        alone = "(is the request alone)" if r["streams"] == 1 else f"{r['identical_to_alone']}/{r['prompts']}"
        buckets = ", ".join(f"{k}: {v}" for k, v in r["rounds_by_rows"].items())
        server = meta["path"] + (f" {meta['label']}" if meta["label"] else "")
        lines.append(f"| {meta['dtype']} | {server} | {r['streams']} | {alone} | "
                     f"{r['identical_to_plain']}/{r['prompts']} | {r['tokens_compared']} | {r['rounds']} | "
                     f"{r['mean_rows']} | {buckets} | {r['mean_gamma_cap']} | {r['accepted']}/{r['drafted']} | {divs} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
