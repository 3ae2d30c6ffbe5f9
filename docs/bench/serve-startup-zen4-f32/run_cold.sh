#!/usr/bin/env bash
# serve start-up A/B: new (working tree) and old (HEAD worktree), cold then warm compile caches, alternating.
OLD=${OLD:-/tmp/old}  # a git worktree of the code before the change (59d530f); outputs under /tmp/su
cd /work/main
S="--servers specdec --dtype float32 --concurrency 1,8,32 --requests 8 --max-tokens 128 --prompt-tokens 64"
A="--drafter draft --compile --max-batch 32"
stamp=$(date +%s)
for phase in cold warm; do
  for side in new old; do
    src=/work/main/src; [ $side = old ] && src=$OLD/src
    echo "== $side $phase $(date +%T)"
    TORCHINDUCTOR_CACHE_DIR=/tmp/su/ind-$side-$stamp PYTHONPATH=$src taskset -c 1 /work/venv/bin/python \
      benchmarks/serve_vllm.py $S --specdec-args "$A" --log-dir /tmp/su/logs-$side-$phase \
      --json /tmp/su/$side-$phase.json > /tmp/su/$side-$phase.out 2>&1
    echo "rc=$?"; grep -E '^specdec ' /tmp/su/$side-$phase.out | cut -c1-220
    python3 -c "import json; print('startup_s', json.load(open('/tmp/su/$side-$phase.json'))['servers']['specdec']['startup_s'])"
    grep -c "compiled" /tmp/su/logs-$side-$phase/specdec.log; grep "ready" /tmp/su/logs-$side-$phase/specdec.log
  done
done
