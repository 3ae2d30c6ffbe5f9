#!/usr/bin/env bash
# A cold `make install` + `make demo`: a new clone, venv, HOME and TMPDIR (no pip, kernel, inductor or precision cache).
# Run alone: flock /tmp/specdec-bench.lock bash run.sh > log.txt
set -u
rm -rf /tmp/cold; mkdir -p /tmp/cold/home /tmp/cold/tmp; cd /tmp/cold
git clone -q /work/main repo; cd repo
export HOME=/tmp/cold/home TMPDIR=/tmp/cold/tmp PYTHONPATH=
python3 -m venv /tmp/cold/venv
echo "code of $(git rev-parse --short HEAD); $(date -u '+%F %T') UTC; load $(cut -d' ' -f1-3 /proc/loadavg)"
t0=$(date +%s); make install PYTHON=/tmp/cold/venv/bin/python 2>&1 | grep -v "WARNING: Running pip"; t1=$(date +%s)
make demo PYTHON=/tmp/cold/venv/bin/python 2>&1; t2=$(date +%s)
echo "install $((t1-t0)) s, demo $((t2-t1)) s; load $(cut -d' ' -f1-3 /proc/loadavg) at the end"
