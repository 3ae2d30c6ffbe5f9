#!/bin/bash
# round 2's warm runs again (the first try overlapped a test run on the other core), twice, alternated
cd /work/main
for again in 1 2; do
  for old in 1 0; do
    d=/tmp/nf-2-$old; export TMPDIR=$d/tmp TORCHINDUCTOR_CACHE_DIR=$d/ind
    echo "== round 2, warm, again $again"; OLD=$old taskset -c 1 /work/venv/bin/python docs/bench/layer-graphs-unfrozen-zen2/first_request.py 2>&1 | grep -v "^[VWI]1206"
  done
done
