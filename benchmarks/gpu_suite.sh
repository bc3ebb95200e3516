#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in stages that each fit in about 8 minutes:
#   bash benchmarks/gpu_suite.sh OUT_DIR tests     # kernel and fla-comparison tests (CUDA-only tests included)
#   bash benchmarks/gpu_suite.sh OUT_DIR kernels   # kernel timings against flash-linear-attention, decode step
#   bash benchmarks/gpu_suite.sh OUT_DIR lm        # the small language-model comparison and 130M throughput
#   bash benchmarks/gpu_suite.sh OUT_DIR addition  # the Table-3 lineup on variable-length addition
# Run from the repository root with falcon_fwa importable (pip install -e . or PYTHONPATH=$PWD/src) and,
# for the fla rows and tests, flash-linear-attention 0.6.0 installed. Logs and results land in OUT_DIR.
set -uo pipefail
OUT=${1:?usage: gpu_suite.sh OUT_DIR STAGE}
STAGE=${2:?usage: gpu_suite.sh OUT_DIR STAGE}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1
git rev-parse HEAD >> "$OUT/gpu.txt" 2>/dev/null

case "$STAGE" in
  tests)
    timeout 470 $PY -m pytest -q -p no:cacheprovider -rs tests/test_triton_chunk.py tests/test_triton_step.py \
        tests/test_triton_window.py tests/test_triton_dispatch.py tests/test_models_fla.py 2>&1 | tee "$OUT/gpu_tests.txt"
    ;;
  kernels)
    timeout 470 $PY benchmarks/bench_kernels.py --out "$OUT" --name h200 --allow-fla-gated --decode \
        --profile falcon-1a falcon-1 falcon-3a 2>&1 | tee "$OUT/bench_kernels.log"
    ;;
  lm)
    MEASURE_130M=1 bash results/lm/run_small.sh "$OUT" 2>&1 | tee "$OUT/lm.log"
    ;;
  addition)
    timeout 540 $PY -m falcon_fwa.cli addition-compare --preset paper --device cuda \
        --models Falcon-3A.3 Falcon-1A.3 Falcon-1.3 Transformer Mamba-2 --seeds 0 --jobs 5 --deadline 480 --partial \
        --runs "$OUT/addition_runs" --results "$OUT" --name paper 2>&1 | tee "$OUT/addition.log"
    ;;
  *)
    echo "unknown stage $STAGE: choose tests, kernels, lm or addition" >&2; exit 2;;
esac
