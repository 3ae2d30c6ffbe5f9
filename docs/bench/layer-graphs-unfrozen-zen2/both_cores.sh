#!/bin/bash
# Cold, both cores free to compile (no taskset; decoding on one thread as in the probe): previous, then this tree.
cd /work/main
for old in 1 0; do
  d=/tmp/nf-2c-$old; rm -rf $d; mkdir -p $d/tmp
  export TMPDIR=$d/tmp TORCHINDUCTOR_CACHE_DIR=$d/ind
  /work/venv/bin/python -m specdec.runtime.compiled > /dev/null
  echo "== cold, both cores"; OLD=$old /work/venv/bin/python docs/bench/layer-graphs-unfrozen-zen2/first_request.py 2>&1 | grep -v "^[VWI]1206"
  rm -rf $d
done
