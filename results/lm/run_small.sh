#!/usr/bin/env bash
# The small-recipe comparison on one H200, in one command of under 10 minutes, from the
# repository root with the pydocs corpus in .device_data/pydocs/:
#   PYTHONPATH=$PWD/src bash results/lm/run_small.sh OUT_DIR        (about 8.5 minutes)
# 1. (MEASURE_130M=1, the default) training throughput of the 130M presets at 2,048 and 8,192
#    tokens: every preset at 2,048 first, then at 8,192; at most 100 s after start-up.
# 2. The seven small recipes one after another (each alone on the GPU), on the same data,
#    tokenizer, schedule and tokens. The step count is calibrated (steady-state step time of
#    each model after its compile steps, plus its setup, evaluation and save costs) to fill 90%
#    of what the 380 s deadline leaves after calibration; the deadline also stops the model in
#    progress at a step boundary (marked partial) and leaves later ones not run.
# Results land in OUT_DIR as they come (throughput rows one by one, compare.json after every
# model), so whatever kills this script, what finished is there.
# Then, here: python -m falcon_fwa.train.compare_report OUT_DIR/compare.json results/lm/small
set -uo pipefail
OUT=${1:-runs/small-compare-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$SECONDS
CHILD=
finish() {
  tar czf "$OUT/runs.tgz" runs/small-compare/main/*/log.jsonl runs/small-compare/main/*/summary.json \
      runs/small-compare/calibration/*/log.jsonl 2>/dev/null
  echo "run_small.sh: $((SECONDS - START)) s in all" >> "$OUT/gpu.txt"
}
trap finish EXIT
trap '[ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null; exit 143' TERM INT
step() { "$@" & CHILD=$!; wait "$CHILD"; }  # in the background, so that a TERM is handled at once
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$OUT/gpu.txt" 2>&1

if [ "${MEASURE_130M:-1}" = 1 ]; then
  step timeout -k 5 120 python -m falcon_fwa.train.throughput \
      --preset falcon-1a.3-130m "falcon-1a.3-130m:rule=1" transformer-124m --seq-len 2048 8192 \
      --batch-tokens 16384 --warmup 2 --steps 5 --min-steps 3 --max-seconds 10 --deadline 100 --profile 25 \
      --out "$OUT/throughput_130m.jsonl" > >(tee "$OUT/throughput_130m.log") 2>&1
  echo "throughput: $((SECONDS - START)) s" >> "$OUT/gpu.txt"
fi

step timeout -k 10 430 python -m falcon_fwa.train.compare \
    --configs configs/small/{falcon-1.3,falcon-1a.3,falcon-3a.3,gated_deltanet,deltanet,mamba2,transformer}.yaml \
    --names Falcon-1.3 Falcon-1A.3 Falcon-3A.3 "Gated DeltaNet" DeltaNet Mamba-2 Transformer \
    --out runs/small-compare --results "$OUT/compare.json" --deadline 380 --max-steps 1500 \
    --set train.eval_batches=31 --set log.progress=false > >(tee "$OUT/compare.log") 2>&1
echo "compare: $((SECONDS - START)) s" >> "$OUT/gpu.txt"
