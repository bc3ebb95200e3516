#!/usr/bin/env bash
# The small-recipe comparison on one H200, the seven models one after another (each alone on
# the GPU), from the repository root with the pydocs corpus in .device_data/pydocs/:
#   PYTHONPATH=$PWD/src bash results/lm/run_small.sh OUT_DIR        (about 6.5 minutes)
# MEASURE_130M=1 also measures the 130M presets' training throughput at 2,048 and 8,192 tokens.
set -uo pipefail
OUT=${1:-runs/small-compare-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$OUT/gpu.txt" 2>&1

if [ "${MEASURE_130M:-0}" = 1 ]; then
  timeout 140 python -m falcon_fwa.train.throughput --preset falcon-1a.3-130m "falcon-1a.3-130m:rule=1" transformer-124m \
      --seq-len 2048 8192 --batch-tokens 16384 --steps 5 --warmup 2 --max-seconds 20 --out "$OUT/throughput_130m.jsonl"
fi

# Same data, tokenizer, schedule and tokens for all seven; the step count is calibrated from each
# model's isolated throughput so that the seven trainings take 280 s together.
timeout 450 python -m falcon_fwa.train.compare \
    --configs configs/small/{falcon-1.3,falcon-1a.3,falcon-3a.3,gated_deltanet,deltanet,mamba2,transformer}.yaml \
    --names Falcon-1.3 Falcon-1A.3 Falcon-3A.3 "Gated DeltaNet" DeltaNet Mamba-2 Transformer \
    --out runs/small-compare --time-budget 280 --max-steps 1500 --set train.eval_batches=31
cp runs/small-compare/compare.json "$OUT/compare.json"
tar czf "$OUT/runs.tgz" runs/small-compare/main/*/log.jsonl runs/small-compare/main/*/summary.json 2>/dev/null
# then, here: python -m falcon_fwa.train.compare_report OUT_DIR/compare.json results/lm/small
