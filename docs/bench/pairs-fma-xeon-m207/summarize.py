"""Median tokens/s per method and side over the alternated runs, and per-prompt B/A ratios."""
import glob, json, statistics, sys
from collections import defaultdict
base = sys.argv[1] if len(sys.argv) > 1 else "/work/runs/pairsfma/e2e"
rate = defaultdict(lambda: defaultdict(list))  # side -> label -> [(prompt, tok/s)]
same = defaultdict(int)
for path in sorted(glob.glob(base + "-*/results.json")):
    side = path.split("/")[-2].split("-")[-2]
    for r in json.load(open(path))["runs"]:
        label = r["label"] + (f"@{r['gamma']}" if r["gamma"] else "")
        rate[side][label].append((r["prompt"], r["tokens_per_s"]))
        same[side] += r["identical_to_plain"]
for label in rate["main"]:
    a = defaultdict(list); b = defaultdict(list)
    for p, v in rate["main"][label]: a[p].append(v)
    for p, v in rate["proto"][label]: b[p].append(v)
    ratios = [statistics.median(b[p]) / statistics.median(a[p]) for p in a]
    print(f"{label:28s} main {statistics.median(v for _, v in rate['main'][label]):7.1f}  proto "
          f"{statistics.median(v for _, v in rate['proto'][label]):7.1f} tok/s  proto/main per prompt median "
          f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
print("identical to plain:", dict(same))
