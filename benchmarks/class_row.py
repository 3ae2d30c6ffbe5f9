"""The per-CPU-class row of BENCHMARKS.md from one `specdec bench` run's results.json (no timing of its own).

    python benchmarks/class_row.py docs/bench/cpu-code-bf16-ov-NAME/results.json

"Best" is the configuration (method and γ) with the highest median tokens/s over every run of the bench; each
ratio is then the median, over prompts, of that prompt's median tokens/s for one side over the other's, with its
range (the README's and BENCHMARKS.md's rule). specdec's side is every method that is neither a peer's (`ov-*`,
`vllm-*`) nor Hugging Face's (`hf-*`); its own plain decoding is the plain method on the best method's path
(`plain-compiled` for a compiled method, else `plain`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

PEERS = {"OpenVINO": "ov-", "vLLM": "vllm-"}


def per_prompt(runs: list[dict]) -> dict[str, dict[str, float]]:
    """{label: {prompt: median tokens/s over its repeats}}."""
    table: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        table[run["label"]][run["prompt"]].append(run["tokens_per_s"])
    return {label: {p: statistics.median(v) for p, v in prompts.items()} for label, prompts in table.items()}


def best(per: dict[str, dict[str, float]], labels: list[str]) -> str | None:
    """The label of `labels` whose runs' median tokens/s is highest (the median over its prompts' medians)."""
    return max(labels, key=lambda label: statistics.median(per[label].values()), default=None)


def ratio(per: dict[str, dict[str, float]], top: str, bottom: str) -> tuple[float, float, float]:
    """(median, min, max) over the prompts both ran of top's tokens/s ÷ bottom's."""
    values = [per[top][p] / per[bottom][p] for p in per[top] if p in per[bottom]]
    return statistics.median(values), min(values), max(values)


def class_row(results: dict) -> dict:
    per = per_prompt(results["runs"])
    labels = list(per)
    ours = [label for label in labels
            if not label.startswith(("hf-", *PEERS.values())) and not label.startswith(("plain", "plain-"))]
    top = best(per, ours)
    row = {"specdec_best": top, "specdec_best_tokens_per_s": statistics.median(per[top].values()), "vs": {}}
    plain = "plain-compiled" if top.split("@")[0].endswith("-compiled") else "plain"
    candidates = {"HF generate float32": "hf-plain-f32", "HF generate": "hf-plain", "own plain": plain}
    for peer, prefix in PEERS.items():
        theirs = best(per, [label for label in labels if label.startswith(prefix) and "plain" not in label])
        if theirs:
            candidates[f"{peer} speculative best ({theirs})"] = theirs
        theirs_plain = best(per, [label for label in labels if label.startswith(prefix) and "plain" in label])
        if theirs_plain:
            candidates[f"{peer} plain"] = theirs_plain
    for name, label in candidates.items():
        if label in per:
            median, low, high = ratio(per, top, label)
            row["vs"][name] = {"label": label, "tokens_per_s": statistics.median(per[label].values()),
                               "ratio_median": median, "ratio_min": low, "ratio_max": high}
    if plain in per:
        for peer, prefix in PEERS.items():
            theirs_plain = best(per, [label for label in labels if label.startswith(prefix) and "plain" in label])
            if theirs_plain:
                median, low, high = ratio(per, plain, theirs_plain)
                row[f"own plain ÷ {peer} plain"] = {"ratio_median": median, "ratio_min": low, "ratio_max": high}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a specdec bench results.json")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    row = class_row(results)
    machine = results.get("machine", {})
    print(f"{machine.get('cpu')} ({machine.get('cpu_family_model')}), kernels {machine.get('kernel_tier')}, "
          f"{results['settings']['methods']}")
    print(f"specdec best: {row['specdec_best']} at {row['specdec_best_tokens_per_s']:.1f} tokens/s (median)")
    for name, vs in row["vs"].items():
        print(f"  ÷ {name}: {vs['ratio_median']:.2f}x ({vs['ratio_min']:.2f}–{vs['ratio_max']:.2f}); "
              f"{vs['label']} at {vs['tokens_per_s']:.1f} tokens/s")
    for name, value in row.items():
        if name.startswith("own plain ÷"):
            print(f"  {name}: {value['ratio_median']:.2f}x ({value['ratio_min']:.2f}–{value['ratio_max']:.2f})")


if __name__ == "__main__":
    main()
