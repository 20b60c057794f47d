# The verdict's GPU work as one background job (a device command may run 10 minutes at most).
# On the H200, after `source benchmarks/gpu_env.sh`:
#   setsid bash benchmarks/h200_calibrate.sh /root/res > /root/res.log 2>&1 < /dev/null &
# then poll /root/res/stages.txt in later calls and copy /root/res to $OUT. Stages, most needed first;
# each has a time limit so that the later ones still run within the session's device time. -O3 cases
# come last in each stage: Inductor's autotuning made one -O3 verify of SmolLM2 take 475 s.
#   1. tests/test_gpu.py (random:tiny): every compilation x graph mode, CPU/GPU digests, run to run
#   2. SmolLM2-135M bf16, golden pinned at -O2: planted changes verified at -O0 (bits differ, so the
#      function check runs), every -O level and compilation x graph combination, dtypes, batch sizes,
#      TF32, attention; faults in the compiled run only
#   3. SmolLM2-135M bf16, golden pinned at -O0: the other -O levels
#   4. random:llama3-8b bf16 (smoke prompts), golden at -O2: the other -O levels, a planted change
#   5. the committed CPU golden verified on the GPU (another device: float32 and bfloat16 -O2)
set -u
RES=${1:-/root/res}
mkdir -p "$RES"
stage() { echo "$(date +%T) $1" >> "$RES/stages.txt"; }
CHANGES='scale x(1+0.0001),scale x(1+0.001),scale x(1+0.01),rope_theta x(1+0.01),rope_theta x(1-0.01),int8,norm_eps x10,mask_position,sign_flip,swap_layers'
EXEC='scale x(1+0.1) in the compiled run only,scale x(1+0.5) in the compiled run only,mask_position in the compiled run only'
DRIFT='batch 4,batch 16,tf32 on,attention eager,dtype float32,dtype float16'
COMBOS='none/full,none/full-decode-only,stock/none,stock/full,stock/full-decode-only,trace-once/none,trace-once/full,trace-once/full-decode-only,piecewise/none,piecewise/full,piecewise/full-decode-only'
stage gpu-tests
timeout 240 python3 -m pytest -p no:cacheprovider -q -x -m gpu tests/test_gpu.py > "$RES/gpu-tests.txt" 2>&1
stage calibrate-smollm2-o2
timeout 900 python3 benchmarks/calibrate.py --device cuda --golden O2 --workdir /root/w1 --change-opt O0 \
  --cases="-O0,-O1,scale x(1+0.001),scale x(1+0.01),$CHANGES,$DRIFT,$COMBOS,$EXEC,-O3" \
  --out "$RES/calib-smollm2-o2.json" > "$RES/calib-smollm2-o2.txt" 2> "$RES/calib-smollm2-o2.log"
stage calibrate-smollm2-o0
timeout 420 python3 benchmarks/calibrate.py --device cuda --golden O0 --workdir /root/w2 --only drift \
  --cases=-O1,-O2,-O3 --out "$RES/calib-smollm2-o0.json" > "$RES/calib-smollm2-o0.txt" 2> "$RES/calib-smollm2-o0.log"
stage calibrate-8b-o2
timeout 420 python3 benchmarks/calibrate.py --device cuda --model random:llama3-8b --prompts smoke --golden O2 \
  --workdir /root/w3 --only drift,change --change-opt O0 --cases=-O0,-O1,"scale x(1+0.001)",-O3 \
  --out "$RES/calib-8b-o2.json" > "$RES/calib-8b-o2.txt" 2> "$RES/calib-8b-o2.log"
stage cross-device
for options in "--device cuda" "--device cuda --dtype bfloat16 -O2"; do
  ( time python3 -m evalrun golden verify smollm2-cpu $options --quiet --json ) >> "$RES/cross-device.json" 2>> "$RES/cross-device.err"
done
stage done
