# The GPU halves of the model-family and invariance work, as one background job on one H200
# (after `source benchmarks/gpu_env.sh`; random models only, no GGUF needed):
#   setsid bash benchmarks/h200_families_invariance.sh /root/res2 > /root/res2.log 2>&1 < /dev/null &
# Workers side by side, each under the deadline:
#   A  every family's tiny checkpoint in bfloat16 on CUDA against transformers' bfloat16 envelope
#   B  evalrun invariance on random:smollm2 bf16 (smoke prompts), default engine then batch_invariant=true
#   C  the batch-invariant mode's cost at batch 1 and 16 (tokens/s, one process, alternating)
#   D  a cold and a warm -O2 run in fresh processes (compile caches under EVALRUN_CACHE)
set -u
RES=${1:-/root/res2}
DEADLINE_S=${DEADLINE_S:-330}
mkdir -p "$RES"
START=$(date +%s)
left() { echo $(( START + DEADLINE_S - $(date +%s) )); }
stage() { echo "$(date +%T) +$(( $(date +%s) - START ))s $1" >> "$RES/stages.txt"; }
INV="--model random:smollm2 --device cuda --dtype bfloat16 --prompts smoke --max-new-tokens 32 --batch-sizes 1,4,16 --repeats 2"
( stage "A families"; EVALRUN_STORE=/root/a2.db timeout "$(left)" python3 -m pytest -p no:cacheprovider -q -s -m gpu \
    tests/test_model_support.py tests/test_invariance.py > "$RES/families.txt" 2>&1; stage "A done" ) &
( stage "B invariance"
  EVALRUN_STORE=/root/b2.db timeout "$(left)" python3 -m evalrun invariance $INV --json > "$RES/inv-default.json" 2> "$RES/inv-default.err"
  EVALRUN_STORE=/root/b2.db timeout "$(left)" python3 -m evalrun invariance $INV --set batch_invariant=true --json \
    > "$RES/inv-batch-invariant.json" 2> "$RES/inv-batch-invariant.err"
  stage "B done" ) &
( stage "C cost"; EVALRUN_STORE=/root/c2.db timeout "$(left)" python3 benchmarks/batch_invariant_cost.py --model random:smollm2 \
    --device cuda --dtype bfloat16 -O0 --batch-sizes 1,16 --rounds 3 > "$RES/cost.txt" 2>&1; stage "C done" ) &
( stage "D warm"
  for run in cold warm; do
    EVALRUN_CACHE=/root/cc EVALRUN_STORE=/root/d2.db timeout "$(left)" python3 -m evalrun run -O2 --model random:smollm2 \
      --prompts smoke --max-new-tokens 32 --json --quiet > "$RES/o2-$run.json" 2> "$RES/o2-$run.err"
  done
  stage "D done" ) &
wait
stage done
