#!/bin/bash
# $1: label, $2: "headers" to build the install-time headers first (untimed). A new TMPDIR and inductor cache.
cd /work/main
export TMPDIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
P=/work/venv/bin/python
if [ "$2" = headers ]; then $P -m specdec.runtime.compiled; fi
t0=$(date +%s.%N)
/work/venv/bin/specdec serve --drafter draft --compile --max-batch 32 --dtype bfloat16 --port 8765 > /work/runs/servestart/$1.log 2>&1 &
pid=$!
until curl -sf localhost:8765/health >/dev/null; do sleep 0.5; if ! kill -0 $pid 2>/dev/null; then echo died; break; fi; done
t1=$(date +%s.%N)
python3 -c "print('$1: start-up %.1f s' % ($t1-$t0))"
kill $pid; wait $pid 2>/dev/null
