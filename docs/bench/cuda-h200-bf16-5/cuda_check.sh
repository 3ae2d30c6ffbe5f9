#!/usr/bin/env bash
# Device check 5: the compiled path as CUDA graphs. tests/test_cuda.py (the compiled tests assert no graph skipped)
# beside a first compiled run, then `specdec bench --device cuda` compiled with CUDA graphs (the default now) and
# without (graphs_off.py), each from its compile cache, alternately. Each step has its own timeout so that what
# finished comes back. DEV=cpu rehearses it anywhere.
set -u
DEV=${DEV:-cuda}; PY=${PY:-python3}; BUDGET=${BUDGET:-480}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind
S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
left() { echo $(( BUDGET - $(el) )); }
LOG=$OUT/logs.txt

{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu
  grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile|avx512_vnni|avx_vnni' /proc/cpuinfo | sort | uniq -c
  $PY -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())'
} > "$LOG" 2>&1

A="--device $DEV --threads 4 --prompts code --dtype bfloat16 --gamma 4 --no-progress --no-forward-costs"
A="$A --num-prompts 4 --repeats 2 --max-new-tokens 64"
ON="$PY -m specdec bench $A"; OFF="$PY $HERE/graphs_off.py $A"
TWO=plain-compiled,draft-compiled
ALL=plain-compiled,draft-compiled,dflash-compiled,suffix-compiled

run() {  # name seconds command...: one step, its log appended to $LOG, its results.json to $OUT/name.json
  local name=$1 secs=$2; shift 2
  if (( secs < 40 )); then echo "== $name: skipped at $(el) s (${secs} s left)" >> "$LOG"; return; fi
  timeout "$secs" "$@" --out "/tmp/$name" > "/tmp/$name.log" 2>&1
  local rc=$?
  { echo "== $name: rc=$rc at $(el) s"; grep -E '^\||rror|cudagraph|compiled .* in ' "/tmp/$name.log" | cut -c1-400 | head -40
    tail -4 "/tmp/$name.log" | cut -c1-400; } >> "$LOG"
  cp "/tmp/$name/results.json" "$OUT/$name.json" 2>/dev/null
}
cap() { local c=$1; (( $(left) < c )) && c=$(left); echo "$c"; }

# 1. The tests, beside the first compiled runs (graphs on, then off: every shape compiled on a fresh machine).
SPECDEC_TEST_DEVICE=$DEV timeout 260 $PY -m pytest -q -m "not slow" tests/test_cuda.py -n 6 -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1 &
T=$!
{ run on-first 200 $ON --methods $TWO; run off-first "$(cap 200)" $OFF --methods $TWO; } &
W=$!
wait $T; echo "== tests: rc=$? at $(el) s; $(tail -1 "$OUT/tests.log")" >> "$LOG"
grep -E "^(FAILED|ERROR)|cudagraph" "$OUT/tests.log" | cut -c1-300 | head -20 >> "$LOG"
wait $W
# 2. Alone, from the compile cache, alternately: on, off, on (with DFlash and suffix decoding), off.
run on-1 "$(cap 70)" $ON --methods $TWO
run off-1 "$(cap 70)" $OFF --methods $TWO
run on-all "$(cap 120)" $ON --methods $ALL
run off-2 "$(cap 70)" $OFF --methods $TWO
echo "== done at $(el) s" >> "$LOG"
cat "$LOG"
