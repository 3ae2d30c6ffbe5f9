#!/bin/bash
# $1: label; $2: "headers" to run the install-time header step
cd /work/main
export HOME=$(mktemp -d) TMPDIR=$(mktemp -d)
P=/work/venv/bin/python
t0=$(date +%s.%N)
$P -m specdec.runtime.rowwise
t1=$(date +%s.%N)
if [ "$2" = headers ]; then $P -m specdec.runtime.compiled; fi
t2=$(date +%s.%N)
$P -m specdec demo > /work/runs/colddemo/$1.demo.txt 2>&1
t3=$(date +%s.%N)
python3 -c "print('$1: kernels %.1f s, headers %.1f s, demo %.1f s' % ($t1-$t0, $t2-$t1, $t3-$t2))"
tail -5 /work/runs/colddemo/$1.demo.txt
