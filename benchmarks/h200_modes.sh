# NOT YET RUN (written when stop 6's device time was spent). On the H200, after `source benchmarks/gpu_env.sh`:
# issue #3's remaining GPU work in one call: run-to-run for every valid compilation x CUDA-graph combination
# on random:smollm2 in bf16, then the -O0..-O3 bench on random:llama3-8b with both transformers baselines.
# A device command may run 10 minutes: `bash benchmarks/h200_modes.sh modes`, then `... bench` in the next call.
set -u
OUT=${OUT:-/tmp/out}
STAGE=${1:-modes}
if [ "$STAGE" = modes ]; then
for c in none stock trace-once piecewise; do
  for g in none piecewise full full-decode-only full-and-piecewise; do
    if [ "$c" != piecewise ] && { [ "$g" = piecewise ] || [ "$g" = full-and-piecewise ]; }; then continue; fi
    for i in 1 2; do
      timeout 300 python3 -m evalrun run --model random:smollm2 --dtype bfloat16 --device cuda --prompts smoke \
        --compilation-mode $c --cudagraph-mode $g --strict-config --json --quiet --store /root/modes.db \
        > $OUT/mode-$c-$g-$i.json 2>> $OUT/modes.err
    done
    python3 -c "
import json, sys
a, b = (json.load(open('$OUT/mode-$c-$g-%d.json' % i)) for i in (1, 2))
print('$c', '$g', 'identical' if a['logits_digest'] == b['logits_digest'] else 'DIFFERENT',
      a['timings']['tokens_per_s'], a['evidence']['kernel_launches_per_decode_step'], a['evidence']['fallbacks'])
" >> $OUT/modes.txt 2>&1
  done
done
fi
[ "$STAGE" = bench ] && timeout 580 python3 -m evalrun bench --model random:llama3-8b --dtype bfloat16 --device cuda --prompts smoke \
  --max-new-tokens 128 --json > $OUT/bench-full.json 2>> $OUT/bench.err
