#!/bin/bash
# alternated: for each round, previous then this tree, cold (new TMPDIR with the install's headers, new inductor
# cache) then warm (the same dirs again). One core (taskset -c 1).
cd /work/main
for round in 1 2; do
  for old in 1 0; do
    d=/tmp/nf-$round-$old; rm -rf $d; mkdir -p $d/tmp
    export TMPDIR=$d/tmp TORCHINDUCTOR_CACHE_DIR=$d/ind
    /work/venv/bin/python -m specdec.runtime.compiled > /dev/null
    echo "== round $round, cold"; OLD=$old taskset -c 1 /work/venv/bin/python docs/bench/layer-graphs-unfrozen-zen2/first_request.py 2>&1 | grep -v "^[VWI]1206"
  done
  for old in 1 0; do
    d=/tmp/nf-$round-$old; export TMPDIR=$d/tmp TORCHINDUCTOR_CACHE_DIR=$d/ind
    echo "== round $round, warm"; OLD=$old taskset -c 1 /work/venv/bin/python docs/bench/layer-graphs-unfrozen-zen2/first_request.py 2>&1 | grep -v "^[VWI]1206"
  done
done
