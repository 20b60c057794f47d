# On the H200 (after `source benchmarks/gpu_env.sh`): the issue-4 acceptance runs on SmolLM2 in bf16.
# golden at O0; verify at O1, O2, O3 and with TF32; then a perturbed copy of the model -> changed.
set -u
OUT=${OUT:-/tmp/out}
G=/root/golden-gpu
python3 -m evalrun golden create smollm2-gpu --dtype bfloat16 --device cuda -O0 --dir $G --quiet --force --json > $OUT/create.json
IFS=';' read -ra VARIANT_LIST <<< "${VARIANTS--O1;-O2;-O3;-O0 --set tf32=true}"
for variant in "${VARIANT_LIST[@]}"; do
  [ -n "$variant" ] || continue
  name=$(echo "$variant" | tr -cd 'A-Za-z0-9')
  /usr/bin/time -f "%e s wall" python3 -m evalrun golden verify smollm2-gpu --dir $G $variant --quiet --format json \
    > $OUT/verify-$name.json 2>> $OUT/verify-times.txt
  echo "verify $variant: exit $?" >> $OUT/verify-times.txt
done
python3 - <<'PY'
import shutil
from safetensors.torch import load_file, save_file
from evalrun.models import converted_gguf_dir, smollm2_gguf_path
source, target = converted_gguf_dir(smollm2_gguf_path()), "/root/perturbed"
shutil.copytree(source, target, dirs_exist_ok=True)
state = load_file(f"{target}/model.safetensors")
state["model.layers.3.mlp.down_proj.weight"].mul_(1.001)
save_file(state, f"{target}/model.safetensors", metadata={"format": "pt"})
PY
