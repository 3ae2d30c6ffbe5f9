"""How much of real text a reduced draft vocabulary covers, per tokenizer and size, ranked three ways.

A draft restricted to a vocabulary V can only propose tokens of V, so the share of the target's tokens that fall
outside V bounds what the restriction costs in acceptance (FR-Spec's argument). This script measures that share on
the real tokenizers that llama.cpp's source tree ships as vocabulary-only GGUF files (Qwen2, Llama 3, Llama 2,
Phi-3, Gemma 4), on held-out text that shares nothing with the ranking's text:

- code: the standard library's packages (email/, json/, asyncio/, ...; their tests left out), where the ranking
  reads its top-level modules;
- prose: the package descriptions (METADATA) of the installed distributions, English markdown of another kind
  than pydoc's topic pages that the ranking reads.

Rankings of a vocabulary:
- `ids`: the N lowest token ids (no text; a byte-level BPE numbers its tokens in the order of its merges);
- `offline`: `specdec.frequent_tokens(tokenizer, N)`, the ranking specdec uses for a model of any tokenizer
  (hub/frequency.py: the interpreter's top-level stdlib modules and pydoc's topics);
- `held-out`: the N most frequent ids of the scored text itself (the best any N-token vocabulary can do there).

    python benchmarks/draft_vocab_coverage.py --vocab-dir .../llama.cpp/models --json out.json

Needs `gguf` (pip install gguf) for transformers to read the GGUF tokenizers.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

import numpy as np

TOKENIZERS = ("qwen2", "llama-bpe", "llama-spm", "phi-3", "gemma-4")
SIZES = (4096, 8192, 16384, 32768, 65536)


def held_out(limit_chars: int) -> dict[str, list[str]]:
    """{kind: texts}: stdlib packages' modules (no tests) and installed distributions' descriptions, in name
    order, up to `limit_chars` characters each."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = [p for p in sorted(stdlib.glob("*/**/*.py")) if not {"test", "tests", "idle_test"} & set(p.parts)]
    prose = sorted((dist.metadata.get_payload() or "" for dist in metadata.distributions()), key=len)
    out = {}
    for kind, pieces in (("code", (p.read_text(errors="replace") for p in code)), ("prose", iter(prose))):
        texts, size = [], 0
        for text in pieces:
            if size >= limit_chars:
                break
            if len(text) > 200:
                texts.append(text)
                size += len(text)
        out[kind] = texts
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-dir", required=True, help="llama.cpp's models/ folder (ggml-vocab-*.gguf)")
    parser.add_argument("--tokenizers", default=",".join(TOKENIZERS))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--limit-chars", type=int, default=1_500_000, help="held-out text per kind")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer  # noqa: PLC0415
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.disable_progress_bar()
    from specdec.hub.frequency import frequent_tokens, token_counts  # noqa: PLC0415

    texts = held_out(args.limit_chars)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {"python": sys.version.split()[0], "held_out_chars": {k: sum(map(len, v)) for k, v in texts.items()},
               "tokenizers": {}}
    for name in args.tokenizers.split(","):
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.vocab_dir, gguf_file=f"ggml-vocab-{name}.gguf")
        except Exception as error:  # noqa: BLE001 (a GGUF transformers cannot read: recorded, the rest go on)
            results["tokenizers"][name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            print(f"{name}: not loaded ({type(error).__name__})")
            continue
        width = len(tokenizer)
        entry = {"width": width, "kinds": {}}
        rankings = {}
        for n in (s for s in sizes if s < width):
            start = time.perf_counter()
            rankings[n] = frequent_tokens(tokenizer, n).numpy()
            entry.setdefault("ranking_s", {})[n] = round(time.perf_counter() - start, 2)
        for kind, scored in texts.items():
            counts = token_counts(tokenizer, scored)
            total = counts.sum()
            entry["kinds"][kind] = {"tokens": int(total), "distinct": int((counts > 0).sum()), "coverage": {
                n: {"ids": float(counts[:n].sum() / total), "offline": float(counts[ranking].sum() / total),
                    "held-out": float(np.sort(counts)[::-1][:n].sum() / total)}
                for n, ranking in rankings.items()}}
        results["tokenizers"][name] = entry
        print(f"{name} (width {width})")
        for kind, data in entry["kinds"].items():
            print(f"  {kind}: {data['tokens']} tokens, {data['distinct']} distinct")
            for n, row in data["coverage"].items():
                print(f"    N={n:6d}  ids {row['ids']:.4f}  offline {row['offline']:.4f}  "
                      f"held-out {row['held-out']:.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
