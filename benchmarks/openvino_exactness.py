"""Is OpenVINO GenAI's sampling exact? ov-plain and ov-speculative on the shipped default pair through specdec's
chi-square test (specdec.bench.openvino_exactness), next to specdec's own plain decoding and draft model on the
same prompt and settings (controls of the harness: check_exactness).

Settings: a 3-token continuation of a short code prompt, EOS ignored, float32, 1 thread; T = 1 with top-k 4
(64 continuations) and T = 0.7 with top-k 8, top-p 0.9 (at most 512). Needs pip install "specdec[openvino]" and
the export environment (specdec bench --openvino-setup) or cached exports.

Without a warp (T = 1, no top-k / top-p) the continuations cannot be enumerated (V = 8192); --unwarped N draws N
3-token continuations per method and tests the second token after the most frequent first token against the
target's exact next-token distribution there (Pearson chi-square, rare cells pooled).

Usage: python benchmarks/openvino_exactness.py [--samples 20000] [--alpha 1e-3] [--out results.json] [--unwarped 10000]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import numpy as np
import torch

import specdec
from specdec.bench.openvino_exactness import check_openvino_exactness
from specdec.bench.openvino_peer import OpenVINOPeer, OpenVINOSettings
from specdec.hub.default_pair import default_assets_dir
from specdec.exactness import check_exactness, multinomial_test, reference_warp

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "
SETTINGS = (dict(temperature=1.0, top_k=4, top_p=None), dict(temperature=0.7, top_k=8, top_p=0.9))


def second_token_check(peer, target, prompt, method, gamma, samples, alpha) -> dict:
    """T = 1, no warp: the second token of `samples` 3-token draws, after the most frequent first token, against
    the target's exact next-token distribution after it."""
    draws = [peer.run(method, gamma, prompt, max_new_tokens=3, temperature=1.0, seed=i).tokens for i in range(samples)]
    first = Counter(d[0] for d in draws).most_common(1)[0][0]
    seconds = [d[1] for d in draws if d[0] == first]
    with torch.no_grad():
        logits = target(torch.tensor([prompt + [first]])).logits[0, -1].double().numpy()  # [V]
    probs = reference_warp(logits[None], 1.0, None, None)[0]
    test = multinomial_test(np.bincount(seconds, minlength=len(probs)).astype(float), probs, alpha=alpha)
    return {"name": f"{method}" + (f" γ={gamma}" if gamma else ""), "first_token": int(first),
            "verdict": "PASS" if test.p_value >= alpha else "FAIL", **test.to_dict(),
            "most_common_seconds": Counter(seconds).most_common(3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--alpha", type=float, default=1e-3)
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--gammas", default="2,4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write every result (to_dict) here as JSON")
    parser.add_argument("--unwarped", type=int, default=0, metavar="N",
                        help="also the T = 1 check without a warp, on N draws per method (see above)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft, tokenizer = specdec.load_default()
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    root = default_assets_dir()
    peer = OpenVINOPeer(OpenVINOSettings(str(root / "target"), str(root / "draft")), dtype=torch.float32, threads=1,
                        speculative=True)
    gammas = [int(g) for g in args.gammas.split(",")]
    common = dict(max_new_tokens=args.max_new_tokens, samples=args.samples, seed=args.seed, alpha=args.alpha)
    results = []
    for setting in SETTINGS:
        runs = [("specdec plain", lambda: check_exactness(target, prompt, None, eos_token_id=[], **setting, **common)),
                ("specdec draft γ=2", lambda: check_exactness(target, prompt, specdec.DraftModel(draft), gamma=2,
                                                              eos_token_id=[], **setting, **common)),
                ("ov-plain", lambda: check_openvino_exactness(peer, target, prompt, method="ov-plain", **setting,
                                                              **common))]
        runs += [(f"ov-speculative γ={g}", lambda g=g: check_openvino_exactness(
            peer, target, prompt, method="ov-speculative", gamma=g, **setting, **common)) for g in gammas]
        for name, check in runs:
            start = time.perf_counter()
            result = check()
            row = dict(name=name, seconds=time.perf_counter() - start, **result.to_dict())
            results.append(row)
            lo, hi = result.tv_ci
            print(f"{result.verdict} {name:22s} T={setting['temperature']} top-k={setting['top_k']} "
                  f"top-p={setting['top_p']} n={result.samples} p={result.p_value:.3g} TV={result.tv:.4f} "
                  f"[{lo:.4f}, {hi:.4f}] detectable={result.detectable_tv:.4f} α={result.acceptance_rate:.2f} "
                  f"df={result.test.df} {' '.join(result.notes)}", flush=True)
    for method, gamma in ([("ov-plain", None)] + [("ov-speculative", g) for g in gammas]) if args.unwarped else []:
        row = second_token_check(peer, target, prompt, method, gamma, args.unwarped, args.alpha)
        results.append(row)
        print(f"{row['verdict']} {row['name']:22s} T=1.0 no warp: second token after {row['first_token']} "
              f"(n={row['n']}) p={row['p_value']:.3g} TV={row['tv']:.4f} detectable={row['detectable_tv']:.4f} "
              f"most common {row['most_common_seconds']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"prompt": PROMPT, "prompt_ids": prompt, "settings": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
