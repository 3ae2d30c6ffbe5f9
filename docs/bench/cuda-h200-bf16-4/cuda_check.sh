#!/usr/bin/env bash
# Device check 4: tests/test_cuda.py and `specdec bench --device cuda` (eager, compiled, compiled with CUDA graphs)
# in one call, each step under its own timeout so that what finished comes back. DEV=cpu rehearses it anywhere.
set -u
DEV=${DEV:-cuda}; PY=${PY:-python3}; BUDGET=${BUDGET:-520}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind
S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
left() { echo $(( BUDGET - $(el) )); }
LOG=$OUT/logs.txt

{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu
  grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile|avx512_vnni|avx_vnni' /proc/cpuinfo | sort | uniq -c
  $PY -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())'
} > "$LOG" 2>&1

B="$PY -m specdec bench --device $DEV --threads 4 --prompts code --dtype bfloat16 --gamma 4 --no-progress"
C="--num-prompts 2 --repeats 1 --max-new-tokens 32 --no-forward-costs"
COMPILED=plain-compiled,draft-compiled,dflash-compiled,suffix-compiled
EAGER=hf-plain,plain,draft,eagle,eagle3,dflash,dflash-tree,parallel,suffix,prompt-lookup

run() {  # name seconds command...: one step, its log appended to $LOG, its results.json to $OUT/name.json
  local name=$1 secs=$2; shift 2
  if (( secs < 30 )); then echo "== $name: skipped at $(el) s (${secs} s left)" >> "$LOG"; return; fi
  timeout "$secs" "$@" --out "/tmp/$name" > "/tmp/$name.log" 2>&1
  local rc=$?
  { echo "== $name: rc=$rc at $(el) s"; grep -E '^\||rror|skipping cudagraphs|compiled .* in ' "/tmp/$name.log" | head -60
    tail -5 "/tmp/$name.log"; } >> "$LOG"
  cp "/tmp/$name/results.json" "$OUT/$name.json" 2>/dev/null
}

# 1. The tests, beside a first compiled run (it compiles every shape on a fresh machine; rerun below from the cache).
SPECDEC_TEST_DEVICE=$DEV timeout 240 $PY -m pytest -q -m "not slow" tests/test_cuda.py -n 6 -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1 &
T=$!
run compiled-first 270 $B $C --methods $COMPILED &
W=$!
wait $T; echo "== tests: rc=$? at $(el) s; $(tail -1 "$OUT/tests.log")" >> "$LOG"
wait $W
# 2. Eager, alone: the methods of device check 3, 4 prompts x 64 tokens, with the bare passes' costs.
run eager $(( $(left) < 170 ? $(left) : 170 )) $B --num-prompts 4 --repeats 1 --max-new-tokens 64 --methods $EAGER
# 3. Compiled, alone, from the compile cache of step 1.
run compiled $(( $(left) < 150 ? $(left) : 150 )) $B $C --methods $COMPILED
# 4. The same two methods with inductor's CUDA graphs, while time is left.
TORCHINDUCTOR_CUDAGRAPHS=1 run cudagraphs "$(left)" $B $C --methods plain-compiled,draft-compiled
echo "== done at $(el) s" >> "$LOG"
cat "$LOG"
