# On the H200 (after `source benchmarks/gpu_env.sh`): TF32 and perturbed verifies, capture overhead in
# CUDA-graph mode, and the -O bench on random:llama3-8b. Writes everything under $OUT.
set -u
G=/root/golden-gpu
python3 -m evalrun golden verify smollm2-gpu --dir $G --model /root/perturbed --quiet --format json > $OUT/verify-perturbed.json
echo "verify perturbed: exit $?" >> $OUT/times.txt
( time python3 -m evalrun golden verify smollm2-gpu --dir $G -O0 --set tf32=true --quiet --format json > $OUT/verify-tf32.json ) 2>> $OUT/times.txt
( time python3 -m evalrun run --dtype bfloat16 --device cuda -O0 --quiet --store /root/s.db > /dev/null ) 2>> $OUT/times.txt
python3 benchmarks/capture_overhead.py --model random:llama3-8b --device cuda --dtype bfloat16 --max-new-tokens 128 --repeats 5 --cudagraph > $OUT/capture-graph.json 2>> $OUT/times.txt
timeout 330 python3 -m evalrun bench --model random:llama3-8b --dtype bfloat16 --device cuda --prompts smoke --max-new-tokens 128 --matrix O0,O2 --json > $OUT/bench.json 2>> $OUT/times.txt
