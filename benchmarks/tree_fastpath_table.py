"""Markdown table from a tree_fastpath.py run (prompts listed in SKIP left out), ratios paired per prompt.

    python benchmarks/tree_fastpath_table.py RUN.json [SKIP_PROMPTS (comma list)]
"""

import argparse
import json
import statistics


def table(path: str, skip: set[str]) -> None:
    data = json.load(open(path))
    rows = [r for r in data["rows"] if r["prompt"] not in skip]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    chains = [m for m in methods if m.startswith("chain")]

    def by(m):
        return {(r["prompt"], r["rep"]): r for r in rows if r["method"] == m}

    plain = by("plain")
    best_chain = max(chains, key=lambda m: statistics.mean(r["tok_s"] for r in by(m).values()))
    print(f"prompts: {sorted({r['prompt'] for r in rows})}; load {min(r['load'] for r in rows):.1f}-"
          f"{max(r['load'] for r in rows):.1f}; best chain {best_chain}")
    print("| method | nodes / round | τ | tokens/s (mean) | vs plain-compiled | vs best chain | target ms / pass "
          "| draft ms / round |")
    print("|:---|---:|---:|---:|---:|---:|---:|---:|")
    for m in methods:
        mine = by(m)
        vs_plain = statistics.mean(mine[k]["tok_s"] / plain[k]["tok_s"] for k in mine)
        bc = by(best_chain)
        vs_chain = statistics.mean(mine[k]["tok_s"] / bc[k]["tok_s"] for k in mine)

        def mean(f, mine=mine):
            return statistics.mean(r[f] for r in mine.values())

        print(f"| {m} | {mean('drafted_per_round'):.1f} | {mean('tau'):.2f} | {mean('tok_s'):.1f} | {vs_plain:.2f}x | "
              f"{vs_chain:.2f}x | {mean('target_ms'):.1f} | {mean('draft_ms'):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a JSON file benchmarks/tree_fastpath.py wrote")
    parser.add_argument("skip", nargs="?", default="", help="comma list of prompts to leave out")
    args = parser.parse_args()
    table(args.run, set(args.skip.split(",")) if args.skip else set())


if __name__ == "__main__":
    main()
