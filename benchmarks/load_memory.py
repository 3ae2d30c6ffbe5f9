"""Peak memory of `load(weights=...)` from a checkpoint: packed as it is read (hub/streamed.py) against the float
model loaded whole and then packed (`from_pretrained` + `pack_model`, what `load` did before).

    python benchmarks/load_memory.py --model qwen2.5-1.5b --weights int4,int8,bfloat16 --dir /tmp/ckpt --json out.json

The size ladder's random model of the shape (benchmarks/size_ladder.py) is saved once to --dir in bfloat16
(safetensors, shards of at most 2 GB), by a process of its own (a child's ru_maxrss counts its parent's memory).
Then, per format and way, in a fresh process each (so that the peak is that load's own): the load's wall time, the
process's peak resident memory (ru_maxrss: file pages mapped and read count too), the bytes the loaded model holds
(packed weights and every other tensor, each once), and their ratio. Two baselines, each a process that loads
nothing: `baseline` imports torch, transformers and specdec; `stack` also imports what every load of the
checkpoint's architecture imports (transformers' modeling module of its model type, and with it modeling_utils,
torch._dynamo and torch.distributed's tensor modules; specdec's kernels). A load's peak less the stack's is what
the model itself and its loading cost. Way `self-draft` loads the model streamed in bfloat16 and then makes
`SelfDraft(model, weights=WEIGHTS)`, the target's own weights quantized as its draft: its bytes are the target's and
the draft's, each tensor once. `--request N` then runs one greedy request of N new tokens after each load, on the
fast path (compiled; with the self-draft drafting), and records the process's peak after it against the model's
bytes and its key-value cache's (the request's tokens at the model's width and dtype): what a first request adds.
`--files bin` rewrites the checkpoint's shards as PyTorch's zip-format `.bin` files (with their index; the
safetensors removed) before the loads, as older releases ship their weights.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def model_bytes(*models) -> int:
    """Bytes of the models' tensors (parameters and buffers), each storage counted once."""
    seen, total = set(), 0
    for t in (t for model in models for t in (*model.parameters(), *model.buffers())):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def kv_bytes(model, tokens: int) -> int:
    """Bytes of `model`'s key-value cache for `tokens` positions: every layer's keys and values as specdec's slot
    cache lays them out (`kv_layout`, read from the model itself)."""
    from specdec.runtime.slot_cache import kv_layout

    return sum(math.prod(layer.lead) * (layer.key_dim + layer.value_dim) * layer.dtype.itemsize * tokens
               for layer in kv_layout(model))


def one(way: str, path: str, weights: str, request: int) -> dict:
    import torch

    from specdec.hub.loading import load_model, model_class
    from specdec.runtime.weights import pack_model

    torch.set_num_threads(1)
    before = peak_gb()
    start = time.perf_counter()
    drafter = None
    if way == "baseline":
        models = ()
    elif way == "stack":
        import importlib

        from transformers import AutoConfig

        from specdec.runtime.rowwise import load_kernel

        model_type = AutoConfig.from_pretrained(path).model_type
        importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        load_kernel()
        models = ()
    elif way == "streamed":
        models = (load_model(path, dtype=torch.bfloat16, weights=weights),)
    elif way == "self-draft":
        from specdec import SelfDraft

        target = load_model(path, dtype=torch.bfloat16, weights="bfloat16")
        drafter = SelfDraft(target, weights=weights)
        models = (target, drafter.model)
    else:
        models = (pack_model(model_class(path).from_pretrained(path, dtype=torch.bfloat16).eval(), weights),)
    seconds = time.perf_counter() - start
    run = {"way": way, "weights": weights, "load_s": seconds, "peak_rss_gb": peak_gb(), "rss_before_gb": before,
           "model_gb": model_bytes(*models) / 2**30}
    if request and models:
        import specdec

        vocab = models[0].config.get_text_config().vocab_size
        prompt = [(7 * i + 3) % (vocab - 10) + 10 for i in range(PROMPT_TOKENS)]
        start = time.perf_counter()
        out = specdec.generate(models[0], prompt, drafter=drafter, max_new_tokens=request, compile=True)
        run.update(request_tokens=len(out.tokens), request_s=time.perf_counter() - start,
                   request_peak_rss_gb=peak_gb(), kv_gb=kv_bytes(models[0], PROMPT_TOKENS + request) / 2**30)
    return run


#: The prompt of `--request`'s request, in tokens.
PROMPT_TOKENS = 128


def to_bin(directory: str) -> None:
    """The safetensors shards of checkpoint `directory` rewritten as zip-format `.bin` files, one shard in memory at
    a time, and its index as pytorch_model.bin.index.json; the safetensors removed."""
    import torch
    from safetensors.torch import load_file

    path = Path(directory)
    shards = {file.name: "pytorch_" + file.name.replace(".safetensors", ".bin") for file in path.glob("*.safetensors")}
    for name, bin_name in shards.items():
        torch.save(load_file(path / name), path / bin_name)
        (path / name).unlink()
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {key: shards[file] for key, file in data["weight_map"].items()}
        (path / "pytorch_model.bin.index.json").write_text(json.dumps(data))
        index.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--weights", default="int4,int8,bfloat16")
    parser.add_argument("--dir", help="where the checkpoint is saved (reused when present)")
    parser.add_argument("--ways", default="streamed,whole",
                        help="streamed (load(weights=...)), whole (from_pretrained + pack_model), self-draft (streamed "
                             "in bfloat16, then SelfDraft(weights=...)); comma-separated")
    parser.add_argument("--request", type=int, default=0, metavar="N",
                        help="after each load, one greedy request of N new tokens on the fast path (default: none)")
    parser.add_argument("--files", choices=["safetensors", "bin"], default="safetensors",
                        help="the checkpoint's weight files: as saved, or rewritten as .bin (default: safetensors)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", nargs=4, metavar=("WAY", "PATH", "WEIGHTS", "REQUEST"), help=argparse.SUPPRESS)
    parser.add_argument("--to-bin", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.to_bin:
        to_bin(args.to_bin)
        return
    if args.one:
        way, path, weights, request = args.one
        print(json.dumps(one(way, path, weights, int(request))))
        return
    if not args.dir:
        parser.error("--dir is required: where the checkpoint is saved (reused when present)")
    path = Path(args.dir)
    if not (path / "config.json").is_file():
        sys.path.insert(0, str(Path(__file__).parent))
        from size_ladder import save_checkpoint

        save_checkpoint(args.model, str(path))
    if args.files == "bin" and any(path.glob("*.safetensors")):  # (a process of its own, as the save)
        subprocess.run([sys.executable, __file__, "--to-bin", str(path)], check=True)
    if args.files == "safetensors" and not any(path.glob("*.safetensors")):
        parser.error(f"{path} holds .bin weights: use --files bin, or another --dir")
    runs, failed = [], []
    ways = [("baseline", "-"), ("stack", "-")]
    ways += [(way, w) for w in args.weights.split(",") for way in args.ways.split(",")]
    for way, weights in ways:
        proc = subprocess.run([sys.executable, __file__, "--one", way, str(path), weights, str(args.request)],
                              capture_output=True, text=True)
        if proc.returncode:
            print(f"{way} {weights}: failed\n{proc.stderr[-2000:]}", flush=True)
            failed.append(f"{way} {weights}")
            continue
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append(run)
        stack = next((r["peak_rss_gb"] for r in runs if r["way"] == "stack"), float("nan"))
        model = run["model_gb"] or float("nan")  # a baseline holds no model
        ratio, above = run["peak_rss_gb"] / model, (run["peak_rss_gb"] - stack) / model
        print(f"{way:>8} {weights:>8}: load {run['load_s']:6.1f} s, peak RSS {run['peak_rss_gb']:5.2f} GB, "
              f"model {run['model_gb']:5.2f} GB, peak / model {ratio:.2f}, less the stack's {above:.2f}", flush=True)
        if "request_s" in run:
            held = run["model_gb"] + run["kv_gb"]
            print(f"{'':>8} {'':>8}  then a request of {run['request_tokens']} tokens in {run['request_s']:.1f} s: "
                  f"peak RSS {run['request_peak_rss_gb']:5.2f} GB, model + KV {held:5.2f} GB, "
                  f"peak / (model + KV) {run['request_peak_rss_gb'] / held:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "files": args.files, "runs": runs}, f, indent=1)
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (above)")


if __name__ == "__main__":
    main()
