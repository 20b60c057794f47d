# The verdict's and bisect's GPU work as one background job (a device command may run 10 minutes at most,
# and a session has 30 minutes of device time). On the H200, after `source benchmarks/gpu_env.sh`:
#   setsid bash benchmarks/h200_calibrate.sh /root/res > /root/res.log 2>&1 < /dev/null &
# then poll /root/res/stages.txt in later calls and copy /root/res to $OUT.
#
# Workers run side by side on the one GPU (SmolLM2 leaves it mostly idle; compiling is CPU work, 16
# cores): verdicts do not depend on what else runs, but the seconds in these tables are under that load,
# so the cost figures come from the CPU tables instead. Every worker stops by the deadline (DEADLINE_S
# from the start). -O3 (max-autotune) comes last wherever it can: Inductor's autotuning made one -O3
# verify of SmolLM2 take 475 s alone; later -O3 runs of the same graphs hit Inductor's caches.
#   A  tests/test_gpu.py and the GPU bisect test (random:tiny), then the committed CPU golden on the GPU
#   B  SmolLM2-135M bf16, golden pinned at -O2, then four workers on copies of it: planted changes verified
#      at -O0 (bits differ, so the function check runs); dtypes, batch sizes, TF32, attention and faults
#      in the compiled run only; every compilation x graph combination; -O0 and -O3
#   C  SmolLM2-135M bf16, golden pinned at -O0: -O1, -O2, -O3
#   D  random:llama3-8b bf16 (smoke prompts), golden at -O2: -O0, -O1, a planted change, -O3
#   E  evalrun bisect --good O0 --bad O3 --until bits on SmolLM2 bf16 (with CompilerBisector alone beside
#      it), then --until verdict against B's golden
set -u
RES=${1:-/root/res}
DEADLINE_S=${DEADLINE_S:-1260}
mkdir -p "$RES"
START=$(date +%s)
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4}
source "$(dirname "$0")/h200_steps.sh"
calibrate() { timeout "$(left)" python3 benchmarks/calibrate.py --device cuda "$@"; }
CHANGES='scale x(1+0.0001),scale x(1+0.001),scale x(1+0.01),scale x(1+0.1),rope_theta x(1+0.01),rope_theta x(1-0.01),int8,norm_eps x10,mask_position,sign_flip,swap_layers'
EXEC='scale x(1+0.1) in the compiled run only,scale x(1+0.5) in the compiled run only,mask_position in the compiled run only'
DRIFT='batch 4,batch 16,tf32 on,attention eager,dtype float32,dtype float16'
COMBOS='none/full,none/full-decode-only,stock/none,stock/full,stock/full-decode-only,trace-once/none,trace-once/full,trace-once/full-decode-only,piecewise/none,piecewise/full,piecewise/full-decode-only'

worker_a() {
  stage "A gpu-tests"
  EVALRUN_STORE=/root/a.db timeout "$(left)" python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_gpu.py \
    tests/test_bisect.py > "$RES/gpu-tests.txt" 2>&1
  stage "A cross-device"
  for options in "--device cuda" "--device cuda --dtype bfloat16 -O2"; do
    EVALRUN_STORE=/root/a.db timeout "$(left)" python3 -m evalrun golden verify smollm2-cpu $options --quiet --json \
      >> "$RES/cross-device.json" 2>> "$RES/cross-device.err"
    echo "exit $?" >> "$RES/cross-device.err"
  done
  stage "A done"
}

worker_b() {
  stage "B golden-o2"
  EVALRUN_STORE=/root/b1.db calibrate --golden O2 --workdir /root/w1 --cases=-O1 --out "$RES/calib-o2-o1.json" \
    > "$RES/calib-o2-o1.txt" 2> "$RES/calib-o2-o1.log"
  for i in 2 3 4; do cp -r /root/w1 /root/w$i; done
  stage "B fan-out"
  EVALRUN_STORE=/root/b2.db calibrate --golden O2 --workdir /root/w2 --reuse --only change --change-opt O0 \
    --cases="$CHANGES" --out "$RES/calib-o2-changes.json" > "$RES/calib-o2-changes.txt" 2> "$RES/calib-o2-changes.log" &
  EVALRUN_STORE=/root/b3.db calibrate --golden O2 --workdir /root/w3 --reuse --only drift,exec --cases="$DRIFT,$EXEC" \
    --out "$RES/calib-o2-drift.json" > "$RES/calib-o2-drift.txt" 2> "$RES/calib-o2-drift.log" &
  EVALRUN_STORE=/root/b4.db calibrate --golden O2 --workdir /root/w4 --reuse --only drift --cases="$COMBOS" \
    --out "$RES/calib-o2-combos.json" > "$RES/calib-o2-combos.txt" 2> "$RES/calib-o2-combos.log" &
  EVALRUN_STORE=/root/b1.db calibrate --golden O2 --workdir /root/w1 --reuse --only drift --cases=-O0,-O3 \
    --out "$RES/calib-o2-levels.json" > "$RES/calib-o2-levels.txt" 2> "$RES/calib-o2-levels.log" &
  wait
  stage "B done"
}

worker_c() {
  stage "C golden-o0"
  EVALRUN_STORE=/root/c.db calibrate --golden O0 --workdir /root/w5 --only drift --cases=-O1,-O2,-O3 \
    --out "$RES/calib-o0.json" > "$RES/calib-o0.txt" 2> "$RES/calib-o0.log"
  stage "C done"
}

worker_d() {
  stage "D 8b"
  EVALRUN_STORE=/root/d.db calibrate --model random:llama3-8b --prompts smoke --golden O2 --workdir /root/w6 \
    --only drift,change --change-opt O0 --cases="-O0,-O1,scale x(1+0.001),-O3" \
    --out "$RES/calib-8b-o2.json" > "$RES/calib-8b-o2.txt" 2> "$RES/calib-8b-o2.log"
  stage "D done"
}

worker_e() {
  stage "E bisect bits"
  local common="--device cuda --dtype bfloat16 --prompts default --max-new-tokens 32 --store /root/e.db"
  ( time timeout "$(left)" python3 -m evalrun bisect --good O0 --bad O3 --until bits $common \
      --compare-compiler-bisector --json --plot "$RES/bisect-bits.png" ) > "$RES/bisect-bits.json" 2> "$RES/bisect-bits.err"
  echo "exit $?" >> "$RES/bisect-bits.err"
  stage "E bisect verdict"
  while [ ! -f /root/w1/calib-o2.oracle.npz ] && [ "$(left)" -gt 0 ]; do sleep 10; done
  ( time timeout "$(left)" python3 -m evalrun bisect --good O0 --bad O3 --until verdict --golden calib-o2 \
      --golden-dir /root/w1 $common --skip compiler --json ) > "$RES/bisect-verdict.json" 2> "$RES/bisect-verdict.err"
  echo "exit $?" >> "$RES/bisect-verdict.err"
  stage "E done"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$RES/gpu.txt" 2>&1
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> "$RES/gpu.txt" 2>&1
worker_a & worker_b & worker_c & worker_d & worker_e &
wait
stage done
