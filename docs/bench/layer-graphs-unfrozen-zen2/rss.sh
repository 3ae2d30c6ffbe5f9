#!/bin/bash
# After the A/B: each side once cold and once warm again, with the probe printing the peak RSS and the first
# request's compile seconds. One core (taskset -c 1).
cd /work/main
for phase in cold warm; do
  for old in 1 0; do
    d=/tmp/nf-rss-$old
    if [ $phase = cold ]; then rm -rf $d; mkdir -p $d/tmp; fi
    export TMPDIR=$d/tmp TORCHINDUCTOR_CACHE_DIR=$d/ind
    if [ $phase = cold ]; then /work/venv/bin/python -m specdec.runtime.compiled > /dev/null; fi
    echo "== $phase"; OLD=$old taskset -c 1 /work/venv/bin/python docs/bench/layer-graphs-unfrozen-zen2/first_request.py 2>&1 | grep -v "^[VWI]1206"
  done
done
rm -rf /tmp/nf-rss-*
