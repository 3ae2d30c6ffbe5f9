"""The table of docs/suffix.md from `specdec bench` results: per method τ, tokens/s, drafting and target time per round.

    python benchmarks/suffix_table.py RESULTS_JSON [RESULTS_JSON ...]

Drafting per round is the drafter's whole time (its reset with the prompt's indexing, proposals and commits) over
the rounds; target per round is the target's passes after the prefill over the same rounds (neither is split out
for a vLLM method: 0). Where the run has `vllm-suffix`, a last line compares specdec's `suffix-compiled` with it.
"""

import argparse
import json
import statistics
from pathlib import Path


def rows(results: dict) -> list[dict]:
    out = []
    for config in results["configs"]:
        runs = [r for r in results["runs"] if r["label"] == config["label"]]
        rounds = sum(r["rounds"] for r in runs) or 1
        out.append(dict(label=config["label"], tau=config["tau"], tps=config["tokens_per_s"],
                        tps_range=(config["tokens_per_s_min"], config["tokens_per_s_max"]),
                        draft_ms=1e3 * sum(r["draft_s"] for r in runs) / rounds,
                        target_ms=1e3 * sum(r["target_s"] for r in runs) / rounds,
                        drafted=config["mean_drafted_per_round"], identical=config["identical_to_plain"],
                        per_prompt={p: statistics.median(r["tokens_per_s"] for r in runs if r["prompt"] == p)
                                    for p in {r["prompt"] for r in runs}}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", metavar="RESULTS_JSON", help="`specdec bench --out` JSON files")
    for path in parser.parse_args().results:
        results = json.loads(Path(path).read_text())
        table = rows(results)
        lookups = [r for r in table if r["label"].startswith("prompt-lookup")]
        best = max(lookups, key=lambda r: r["tps"]) if lookups else None
        print(f"\n{path}: best prompt lookup {best['label'] if best else '-'}")
        print("| method | τ | drafted / round | tokens/s (median, range) | vs best prompt lookup | drafting / round | "
              "target / round | identical to plain |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for r in table:
            ratio = f"{r['tps'] / best['tps']:.2f}x" if best else "-"
            if best and r is not best:  # the range over prompts of the ratios of per-prompt medians
                per = [v / best["per_prompt"][p] for p, v in r["per_prompt"].items() if p in best["per_prompt"]]
                ratio += f" (per prompt {min(per):.2f}–{max(per):.2f})" if per else ""
            print(f"| {r['label']} | {r['tau']:.2f} | {r['drafted']:.1f} | {r['tps']:.1f} ({r['tps_range'][0]:.0f}–"
                  f"{r['tps_range'][1]:.0f}) | {ratio} | {r['draft_ms']:.3f} ms | {r['target_ms']:.2f} ms | "
                  f"{r['identical']} |")
        by_label = {r["label"]: r for r in table}
        ours, peer = by_label.get("suffix-compiled"), by_label.get("vllm-suffix")
        if ours and peer:
            per = [v / peer["per_prompt"][p] for p, v in ours["per_prompt"].items() if p in peer["per_prompt"]]
            print(f"\nsuffix-compiled ÷ vllm-suffix: {ours['tps'] / peer['tps']:.2f}x (per prompt {min(per):.2f}–"
                  f"{max(per):.2f}, median {statistics.median(per):.2f}x); τ {ours['tau']:.2f} against "
                  f"{peer['tau']:.2f}")


if __name__ == "__main__":
    main()
