#!/bin/bash
# Default pair, bfloat16, one core: this tree (main) against the PairsFma tree (proto), alternated.
cd /work/main
for round in 1 2; do  # then 3 4
  for side in main proto; do
    echo "== round $round $side $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
    PYTHONPATH=/work/$side/src flock /tmp/specdec-bench.lock taskset -c 1 /work/venv/bin/python -m specdec bench \
      --methods plain-compiled,draft-vocab-compiled --gamma 6,7 --threads 1 --prompts code --num-prompts 12 \
      --repeats 1 --no-progress --dtype bfloat16 --out /work/runs/pairsfma/e2e-$side-$round 2>&1 | grep -v Warn | tail -14
  done
done
