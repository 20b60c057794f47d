# The verdict's GPU work as one background job (a device command may run 10 minutes at most).
# On the H200, after `source benchmarks/gpu_env.sh`:
#   setsid bash benchmarks/h200_calibrate.sh /root/res > /root/res.log 2>&1 < /dev/null &
# then poll /root/res/stages.txt in later calls and copy /root/res to $OUT. Stages, most needed first:
#   1. tests/test_gpu.py (random:tiny): every compilation x graph mode, CPU/GPU digests, run to run
#   2. calibration, SmolLM2-135M bf16, golden pinned at -O2: the whole corpus
#   3. calibration, SmolLM2-135M bf16, golden pinned at -O0: the other -O levels
#   4. calibration, random:llama3-8b bf16 (smoke prompts), golden at -O2: the other -O levels
#   (after 2) cost: verify that comes out identical, verify -O0 (both checks), a plain run; fresh processes
set -u
RES=${1:-/root/res}
mkdir -p "$RES"
stage() { echo "$(date +%T) $1" >> "$RES/stages.txt"; }
stage gpu-tests
timeout 400 python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_gpu.py > "$RES/gpu-tests.txt" 2>&1
stage calibrate-smollm2-o2
timeout 1200 python3 benchmarks/calibrate.py --device cuda --golden O2 --workdir /root/w1 \
  --out "$RES/calib-smollm2-o2.json" > "$RES/calib-smollm2-o2.txt" 2> "$RES/calib-smollm2-o2.log"
stage cost
W=/root/w1; G=calib-o2
( time python3 -m evalrun golden verify $G --dir $W --set keep_logits=none --quiet --json > "$RES/cost-identical.json" ) 2> "$RES/cost-identical.time"
( time python3 -m evalrun golden verify $G --dir $W --set keep_logits=none -O0 --quiet --json > "$RES/cost-o0.json" ) 2> "$RES/cost-o0.time"
( time python3 -m evalrun run -O2 --device cuda --quiet --store /root/s.db > /dev/null ) 2> "$RES/cost-run.time"
stage calibrate-smollm2-o0
timeout 600 python3 benchmarks/calibrate.py --device cuda --golden O0 --workdir /root/w2 --only drift \
  --cases=-O1,-O2,-O3,"batch 4" --out "$RES/calib-smollm2-o0.json" > "$RES/calib-smollm2-o0.txt" 2> "$RES/calib-smollm2-o0.log"
stage calibrate-8b-o2
timeout 900 python3 benchmarks/calibrate.py --device cuda --model random:llama3-8b --prompts smoke --golden O2 \
  --workdir /root/w3 --only drift,change --cases=-O0,-O1,-O3,"scale x(1+0.001)","scale x(1+0.01)" \
  --out "$RES/calib-8b-o2.json" > "$RES/calib-8b-o2.txt" 2> "$RES/calib-8b-o2.log"
stage done
