set -u; export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
A="--device ${DEV:-cuda} --threads 4 --prompts code --dtype bfloat16 --gamma 4 --no-progress --num-prompts 2 --repeats 1 --max-new-tokens 32 --no-forward-costs --methods plain-compiled,draft-compiled"
S=$(date +%s)
timeout 100 python3 cg_exp.py $A --out /tmp/pywrap > /tmp/pywrap.log 2>&1; echo "pywrap rc=$? $(( $(date +%s)-S )) s"
grep -E '^\| (plain|draft)-compiled \| ' /tmp/pywrap.log | head -2; cp /tmp/pywrap/results.json $OUT/pywrap.json
TORCHINDUCTOR_CUDAGRAPHS=1 timeout $(( 215 - $(date +%s) + S )) python3 cg_exp.py $A --out /tmp/cg > /tmp/cg.log 2>&1; echo "cg rc=$? $(( $(date +%s)-S )) s"
grep -c "skipping cudagraphs" /tmp/cg.log; grep "skipping cudagraphs" /tmp/cg.log | head -3 | cut -c1-300
grep -E '^\| (plain|draft)-compiled \| ' /tmp/cg.log | head -2; cp /tmp/cg/results.json $OUT/cg.json; tail -3 /tmp/cg.log | cut -c1-400
