#!/usr/bin/env bash
# old (HEAD) and new (the working tree) goodput policy, specdec's server alone, the serve_vllm float32 sequence, alternated
cd /work/main
for i in 1 2; do
  for side in old new; do
    src=/work/main/src; [ $side = old ] && src=/tmp/wt-old/src
    echo "== $side run $i $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$src flock /tmp/specdec-bench.lock /work/venv/bin/python benchmarks/serve_vllm.py --servers specdec --dtype float32 \
      --concurrency 1,8,32,8,32,8,32 --requests 8 --max-tokens 128 --prompt-tokens 64 \
      --specdec-args "--drafter draft --compile --max-batch 32" --json /tmp/sv/ab-$side-$i.json 2>&1 \
      | grep -E '^specdec [0-9]+ \{' | sed -E 's/"identical_per_request": \[[^]]*\], //; s/"load": \[[^]]*\]//'
  done
done
