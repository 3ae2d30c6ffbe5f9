#!/usr/bin/env bash
# warm start-up A/B without kernel rebuilds: each side its own TORCH_EXTENSIONS_DIR, built first (untimed).
OLD=${OLD:-/tmp/old}  # a git worktree of the code before the change (59d530f); outputs under /tmp/su
cd /work/main
S="--servers specdec --dtype float32 --concurrency 1,8,32 --requests 8 --max-tokens 128 --prompt-tokens 64"
A="--drafter draft --compile --max-batch 32"
stamp=$(ls -d /tmp/su/ind-new-* | head -1 | sed 's/.*ind-new-//')
for side in old new; do
  src=/work/main/src; [ $side = old ] && src=$OLD/src
  TORCH_EXTENSIONS_DIR=/tmp/su/ext-$side PYTHONPATH=$src /work/venv/bin/python -c \
    "from specdec.runtime.rowwise import load_kernel; load_kernel()"
done
n=0
for side in old new new old; do
  n=$((n+1)); src=/work/main/src; [ $side = old ] && src=$OLD/src
  echo "== $side warm-$n $(date +%T)"
  TORCH_EXTENSIONS_DIR=/tmp/su/ext-$side TORCHINDUCTOR_CACHE_DIR=/tmp/su/ind-$side-$stamp PYTHONPATH=$src \
    taskset -c 1 /work/venv/bin/python benchmarks/serve_vllm.py $S --specdec-args "$A" \
    --log-dir /tmp/su/logs-$side-warm-$n --json /tmp/su/$side-warm-$n.json > /tmp/su/$side-warm-$n.out 2>&1
  echo "rc=$?"; grep -E '^specdec ' /tmp/su/$side-warm-$n.out | cut -c1-220
  python3 -c "import json; print('startup_s', json.load(open('/tmp/su/$side-warm-$n.json'))['servers']['specdec']['startup_s'])"
  grep -E "ready|built" /tmp/su/logs-$side-warm-$n/specdec.log
done
