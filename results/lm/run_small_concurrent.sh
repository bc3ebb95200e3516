#!/usr/bin/env bash
# The exact commands of the concurrent device run recorded in results/lm/small.md (run once,
# stopped by its time limit); with the pydocs corpus in .device_data/pydocs/ (train.txt, val.txt):
#   PYTHONPATH=$PWD/src bash results/lm/run_small_concurrent.sh OUT_DIR
set -uo pipefail
OUT=${1:-runs/small-compare-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$OUT/gpu.txt" 2>&1

# 1. Training throughput (bf16, full AdamW steps, 16,384 tokens per step) of the 130M presets:
#    Falcon-1A (falcon-1a.3-130m), Falcon-1 (the same with rule 1) and the Transformer.
timeout 140 python -m falcon_fwa.train.throughput --preset falcon-1a.3-130m "falcon-1a.3-130m:rule=1" transformer-124m \
    --seq-len 2048 8192 --batch-tokens 16384 --steps 5 --warmup 2 --max-seconds 20 --out "$OUT/throughput_130m.jsonl"

# 2. Training throughput of the small models alone on the GPU (their seq_len 512 and batch 32).
timeout 65 python -m falcon_fwa.train.throughput --steps 8 --warmup 2 --max-seconds 8 --out "$OUT/throughput_small.jsonl" \
    --config configs/small/{falcon-1.3,falcon-1a.3,falcon-3a.3,gated_deltanet,deltanet,mamba2,transformer}.yaml

# 3. The comparison: all seven trained concurrently on the GPU, same data, tokenizer, tokens and
#    schedule; the step count is calibrated so that the slowest finishes in the time budget.
timeout 310 python -m falcon_fwa.train.compare \
    --configs configs/small/{falcon-1.3,falcon-1a.3,falcon-3a.3,gated_deltanet,deltanet,mamba2,transformer}.yaml \
    --names Falcon-1.3 Falcon-1A.3 Falcon-3A.3 "Gated DeltaNet" DeltaNet Mamba-2 Transformer \
    --out runs/small-compare --time-budget 160 --calib-steps 30 --max-steps 1500 \
    --set train.eval_batches=31 --concurrent
cp runs/small-compare/compare.json "$OUT/compare.json"
tar czf "$OUT/runs.tgz" runs/small-compare/*/*/summary.json runs/small-compare/*/*/log.jsonl \
    runs/small-compare/*/*/stdout.txt 2>/dev/null
