"""Markdown table from a tree_fastpath.py run (prompts listed in --skip left out), ratios paired per prompt."""

import json
import statistics
import sys

path = sys.argv[1]
skip = set(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else set()
data = json.load(open(path))
rows = [r for r in data["rows"] if r["prompt"] not in skip]
methods = list(dict.fromkeys(r["method"] for r in rows))
chains = [m for m in methods if m.startswith("chain")]


def by(m):
    return {(r["prompt"], r["rep"]): r for r in rows if r["method"] == m}


plain = by("plain")
best_chain = max(chains, key=lambda m: statistics.mean(r["tok_s"] for r in by(m).values()))
print(f"prompts: {sorted({r['prompt'] for r in rows})}; load {min(r['load'] for r in rows):.1f}-{max(r['load'] for r in rows):.1f}; best chain {best_chain}")
print("| method | nodes / round | τ | tokens/s (mean) | vs plain-compiled | vs best chain | target ms / pass | draft ms / round |")
print("|:---|---:|---:|---:|---:|---:|---:|---:|")
for m in methods:
    mine = by(m)
    vs_plain = statistics.mean(mine[k]["tok_s"] / plain[k]["tok_s"] for k in mine)
    bc = by(best_chain)
    vs_chain = statistics.mean(mine[k]["tok_s"] / bc[k]["tok_s"] for k in mine)
    mean = lambda f: statistics.mean(r[f] for r in mine.values())
    print(f"| {m} | {mean('drafted_per_round'):.1f} | {mean('tau'):.2f} | {mean('tok_s'):.1f} | {vs_plain:.2f}x | "
          f"{vs_chain:.2f}x | {mean('target_ms'):.1f} | {mean('draft_ms'):.1f} |")
