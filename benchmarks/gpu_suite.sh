#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in stages that each fit in about 8 minutes:
#   bash benchmarks/gpu_suite.sh OUT_DIR tests     # kernel and layer tests on the GPU (CUDA-only tests included)
#   bash benchmarks/gpu_suite.sh OUT_DIR tests-full  # every rule at the full benchmark shape, bf16 and fp32
#   bash benchmarks/gpu_suite.sh OUT_DIR fla       # fla 0.6.0 against the native op (baselines, fwd and grads), and its
#       delta-rule calls against the textbook recurrence (benchmarks/check_fla_delta.py)
#   bash benchmarks/gpu_suite.sh OUT_DIR diagnose  # per-quantity errors of rule 1 (fp32/bf16) under several WY warp counts
#   bash benchmarks/gpu_suite.sh OUT_DIR profile   # per-kernel device time of each Falcon kernel op
#   bash benchmarks/gpu_suite.sh OUT_DIR kernels   # kernel timings against flash-linear-attention at B=8 T=2048 (split over 2 GPUs)
#   bash benchmarks/gpu_suite.sh OUT_DIR kernels-long  # the same at B=2 T=8192, with per-kernel profiles
#   BASE_SRC=DIR bash benchmarks/gpu_suite.sh OUT_DIR ab  # a change against the tree in DIR (its src/), side by side
#   bash benchmarks/gpu_suite.sh OUT_DIR warm      # compile WARM_OPS (default: fla's autotuned ops) into Triton's cache;
#       run it in the background beside a stage that needs no timing, e.g. `(... warm &); ... tests; wait; ... kernels`:
#       fla's chunk_gla needs more than 270 s of compiling for its fwd+bwd on a fresh machine
#   bash benchmarks/gpu_suite.sh OUT_DIR host      # host enqueue time against device time of the fast rows
#   bash benchmarks/gpu_suite.sh OUT_DIR decode    # whole-model decoding tokens/s, fused step vs PyTorch step (eager, CUDA graphs)
#   bash benchmarks/gpu_suite.sh OUT_DIR short-prompts  # prompt passes without gradients: fused recurrent vs chunk kernels
#   bash benchmarks/gpu_suite.sh OUT_DIR lm        # the small language-model comparison and 130M throughput
#   bash benchmarks/gpu_suite.sh OUT_DIR multigpu  # DDP/FSDP2 scaling over the GPUs of the machine
#   bash benchmarks/gpu_suite.sh OUT_DIR addition  # the Table-3 lineup on variable-length addition
#   bash benchmarks/gpu_suite.sh OUT_DIR addition-step  # ms per training step of that lineup at batch 128 and 512
# COMMIT=<sha> records that commit in the multigpu results (a copied tree may carry stale git metadata).
# Run from the repository root with falcon_fwa importable (pip install -e . or PYTHONPATH=$PWD/src) and,
# for the fla rows and tests, flash-linear-attention 0.6.0 installed. Logs and results land in OUT_DIR.
set -uo pipefail
OUT=${1:?usage: gpu_suite.sh OUT_DIR STAGE}
STAGE=${2:?usage: gpu_suite.sh OUT_DIR STAGE}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: stages change directory
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1
git rev-parse HEAD >> "$OUT/gpu.txt" 2>/dev/null

# Compiled kernels and autotuning results persist across fresh machines: Triton's cache lives in
# TRITON_CACHE_DIR (default .triton_cache/), is seeded from .triton_cache.tgz when that file was carried
# along, and is packed into OUT/triton_cache.tgz at the end of every stage (skipped above 15 MiB). Keyed by
# source, options, target and Triton version, a cached kernel is only reused where it is the same kernel.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz -C "$TRITON_CACHE_DIR" 2>/dev/null
pack_triton_cache() {
  # a failed tar (e.g. "file changed as we read it" while another stage compiles into the same cache) leaves
  # no partial archive behind: one would be returned with the outputs and can exceed what comes back
  tar czf "$OUT/triton_cache.tgz.part" -C "$TRITON_CACHE_DIR" . 2>/dev/null || { rm -f "$OUT/triton_cache.tgz.part"; return; }
  if [ "$(stat -c %s "$OUT/triton_cache.tgz.part")" -le $((15 * 1024 * 1024)) ]; then
    mv "$OUT/triton_cache.tgz.part" "$OUT/triton_cache.tgz"
  else
    rm -f "$OUT/triton_cache.tgz.part"; echo "triton cache above 15 MiB: not packed" >&2
  fi
}
trap pack_triton_cache EXIT

# stop_group_after SECONDS PID: wait for PID; past SECONDS, TERM then KILL its whole process group.
stop_group_after() {
  local limit=$1 pid=$2 waited=0
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$limit" ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
  fi
  wait "$pid" 2>/dev/null
}

case "$STAGE" in
  tests)
    # One process per core: most of the time is the first-call compilation of each kernel variant.
    # -v prints every result as it comes, so a cut-off run still says which tests failed.
    # In a session of its own, so that the timeout stops the xdist workers too (left running, they would
    # share the GPU with whatever stage comes next).
    setsid $PY -m pytest -v -n ${JOBS:-16} -p no:cacheprovider -rfEs --durations=30 --timeout 300 --junitxml="$OUT/gpu_tests.xml" \
        tests/test_triton_chunk.py tests/test_triton_recurrent.py tests/test_triton_window.py tests/test_triton_column.py \
        tests/test_triton_column_delta.py tests/test_triton_sliding_delta.py tests/test_triton_wy_forward.py tests/test_triton_wy_backward.py tests/test_triton_sliding_inplace.py tests/test_triton_dispatch.py \
        tests/test_triton_step_sizes.py tests/test_layers.py > "$OUT/gpu_tests.txt" 2>&1 &
    stop_group_after ${TESTS_TIMEOUT:-350} $!
    tail -n 40 "$OUT/gpu_tests.txt"
    ;;
  tests-full)
    # every rule at the full benchmark shape B=8 T=2048 H=16 K=V=128, bf16 and fp32, against the float64
    # recurrence run one batch row at a time (18-20 GB per row in float64): at most 4 workers fit on one H200
    setsid $PY -m pytest -v -n ${JOBS:-4} -p no:cacheprovider -rfEs --durations=20 --timeout 480 \
        --junitxml="$OUT/gpu_tests_full.xml" tests/test_triton_full_shape.py > "$OUT/gpu_tests_full.txt" 2>&1 &
    stop_group_after ${TESTS_TIMEOUT:-500} $!
    tail -n 30 "$OUT/gpu_tests_full.txt"
    ;;
  fla)
    # fla against the native op, row by row into a markdown report (a cut-off run keeps its rows); alone, so
    # that its gradient rows are reached (beside the kernel tests it was cut off before them twice). On a fresh
    # machine fla's first-call compiling and autotuning make it take 421 s (H100, fortieth run; at 300 s it
    # stopped after the forward rows).
    timeout ${FLA_TIMEOUT:-450} $PY tests/test_models_fla.py "$OUT/fla_compare.md" > "$OUT/fla_compare.log" 2>&1
    tail -n 30 "$OUT/fla_compare.md"
    # fla's two delta-rule calls against the textbook recurrence at the baselines' head dims (keys of 32 were
    # wrong on Hopper: thirty-eighth and thirty-ninth runs), one process per shape
    timeout ${FLA_DELTA_TIMEOUT:-120} $PY benchmarks/check_fla_delta.py --keys 32 64 128 --values 64 128 --lengths 256 \
        --out "$OUT/fla_delta.json" 2>&1 | tee "$OUT/fla_delta.log"
    ;;
  diagnose)
    # Rule 1 in fp32 and bf16 at the benchmark shape: every quantity's error, under three warp settings of
    # the WY kernels (how the fp32 failure at T=2048, K=V=128 was traced to shared memory).
    for dt in fp32 bf16; do
      timeout 120 $PY benchmarks/diagnose_kernels.py --rule 1 --dtype $dt --out "$OUT/diagnose_rule1_$dt.json" \
          2>&1 | tee -a "$OUT/diagnose.log"
    done
    ;;
  profile)
    # Device time per kernel of each Falcon kernel op, fwd+bwd at B=8 T=2048 H=16 K=V=128.
    timeout 170 $PY benchmarks/bench_kernels.py --out "$OUT" --name h200 --shapes 0 --ops \
        --profile falcon-1 falcon-1a falcon-2 falcon-2a falcon-3 falcon-3a 2>&1 | tee "$OUT/profile.log"
    ;;
  kernels)
    # BENCH_OPS narrows the rows (default: every Falcon kernel, the fla counterparts, SDPA and the PyTorch forms).
    # ROW_TIMEOUT covers compilation: fla's autotuned rows need more than 150 s of it on a fresh machine.
    # With two or more GPUs (and no BENCH_OPS) the rows are split over two processes, one per GPU, each timing
    # its own fla reference rows: every ratio is then taken between rows of one process (the `process` key).
    # PAIRED=N adds N rounds of each Falcon op timed in alternation with its fla counterpart (--paired): the
    # ratio that holds up when the host is busy. CUDAGRAPH=1 adds each row replayed from a CUDA graph
    # (--cudagraph, graph_ms): the device's work alone.
    KOPTS="--allow-fla-gated --shapes 0 --row-timeout ${ROW_TIMEOUT:-150} ${PAIRED:+--paired $PAIRED} ${CUDAGRAPH:+--cudagraph}"
    PROFILE_OPTS="${BENCH_PROFILE:+--profile $BENCH_PROFILE}"
    if [ -z "${BENCH_OPS:-}" ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-480} $PY benchmarks/bench_kernels.py --out "$OUT" --name h200-gpu0 \
          --tag gpu0 --decode $KOPTS $PROFILE_OPTS \
          --ops falcon-1 fla-gated-delta-rule falcon-1a fla-simple-gla falcon-3a falcon-2a fla-gla sdpa \
          > "$OUT/bench_kernels_gpu0.log" 2>&1 &
      CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_TIMEOUT:-480} $PY benchmarks/bench_kernels.py --out "$OUT" --name h200-gpu1 \
          --tag gpu1 $KOPTS --ops fla-gated-delta-rule falcon-2 falcon-3 fla-delta-rule torch-chunk-1A torch-chunk-1 \
          torch-chunk-3A torch-chunk-2A torch-chunk-2 torch-chunk-3 > "$OUT/bench_kernels_gpu1.log" 2>&1 &
      wait
      grep -h " ms  peak\|^failed: " "$OUT"/bench_kernels_gpu*.log
    else
      timeout ${BENCH_TIMEOUT:-480} $PY benchmarks/bench_kernels.py --out "$OUT" --name h200 --decode $KOPTS $PROFILE_OPTS \
          --ops ${BENCH_OPS:-falcon-2a fla-gla falcon-2 fla-gated-delta-rule falcon-3 falcon-1 falcon-1a fla-simple-gla \
                falcon-3a fla-delta-rule sdpa torch-chunk-1A torch-chunk-1 torch-chunk-3A torch-chunk-2A torch-chunk-2 torch-chunk-3} \
          2>&1 | tee "$OUT/bench_kernels.log"
    fi
    ;;
  warm)
    # one process per op, timings discarded: only the compiled kernels, in TRITON_CACHE_DIR, are kept
    for op in ${WARM_OPS:-fla-gla fla-gated-delta-rule fla-simple-gla}; do
      timeout ${WARM_TIMEOUT:-400} $PY benchmarks/bench_kernels.py --out "$OUT/warm" --name "warm-$op" --allow-fla-gated \
          --shapes 0 --row-timeout ${WARM_TIMEOUT:-400} --ops "$op" > "$OUT/warm-$op.log" 2>&1 &
    done
    wait
    ;;
  ab)
    # A change against a base tree, side by side on this GPU: BASE_SRC holds the base's src/ (e.g. from
    # `git archive BASE src | tar x -C DIR`). AB_ROUNDS rounds, each a process of the base then one of this
    # tree, time AB_OPS (fwd and fwd+bwd, eager and from a CUDA graph) at the first benchmark shape; the first
    # round also profiles each op per kernel. Rows: OUT/ab-{base,new}-<round>.{json,md} (tag = tree, round),
    # recording BASE_COMMIT and COMMIT where given (a copied tree may carry no git metadata).
    BASE=${BASE_SRC:?ab needs BASE_SRC=DIR, a tree whose src/ is the base}
    OPS_AB=${AB_OPS:-falcon-1 falcon-3}
    for r in $(seq 1 ${AB_ROUNDS:-2}); do
      for tree in base new; do
        SRC=$PWD/src; SHA=${COMMIT:-}
        [ "$tree" = base ] && SRC=$(cd "$BASE" && pwd)/src && SHA=${BASE_COMMIT:-}
        PROF=""; [ "$r" = 1 ] && PROF="--profile $OPS_AB"
        PYTHONPATH=$SRC${PYTHONPATH:+:$PYTHONPATH} timeout ${AB_TIMEOUT:-240} $PY benchmarks/bench_kernels.py \
            ${SHA:+--commit $SHA} --out "$OUT" --name ab-$tree-$r --tag $tree-$r --shapes 0 --cudagraph --allow-fla-gated \
            --row-timeout ${ROW_TIMEOUT:-150} --ops $OPS_AB $PROF > "$OUT/ab-$tree-$r.log" 2>&1
        grep -h " ms  peak\|^profile" "$OUT/ab-$tree-$r.log" | sed "s/^/$tree-$r /"
      done
    done
    ;;
  kernels-long)
    # each Falcon row next to its fla counterpart; rule 3 profiled per kernel. fla's autotuning of chunk_gla's
    # backward took more than 260 s on a fresh machine at this shape, hence the longer row limit.
    timeout 480 $PY benchmarks/bench_kernels.py --out "$OUT" --name h200-8k --allow-fla-gated --shapes 1 \
        --ops falcon-1a fla-simple-gla falcon-1 fla-gated-delta-rule falcon-3a sdpa falcon-2a fla-gla falcon-3 falcon-2 \
        fla-delta-rule --row-timeout ${ROW_TIMEOUT:-300} --profile falcon-3 2>&1 | tee "$OUT/bench_kernels.log"
    ;;
  host)
    # fla's rows first: each row compiles (and fla autotunes) on first use
    timeout ${HOST_TIMEOUT:-300} $PY benchmarks/host_overhead.py > "$OUT/host_overhead.txt" 2>&1
    grep "do_bench\| failed: " "$OUT/host_overhead.txt"
    ;;
  decode)
    timeout ${DECODE_TIMEOUT:-240} $PY benchmarks/bench_decode.py --presets falcon-1a.3-130m falcon-3a.3-130m transformer-124m \
        --batch 1 64 --out "$OUT" --name h200-decode 2>&1 | tee "$OUT/bench_decode.log"
    # the recurrent models' steps replayed from CUDA graphs, fused kernel against the PyTorch step
    timeout ${DECODE_TIMEOUT:-240} $PY benchmarks/bench_decode.py --presets falcon-3a.3-130m falcon-1a.3-130m \
        --batch 1 64 --cuda-graphs --out "$OUT" --name h200-decode-fused-graphs 2>&1 | tee -a "$OUT/bench_decode.log"
    # the same under torch.compile (fewer, fused launches per token: batch 1 is bound by the host)
    timeout ${DECODE_TIMEOUT:-240} $PY benchmarks/bench_decode.py --presets falcon-1a.3-130m transformer-124m \
        --batch 1 64 --compile default --out "$OUT" --name h200-decode-compiled 2>&1 | tee -a "$OUT/bench_decode.log"
    ;;
  short-prompts)
    timeout ${SHORT_TIMEOUT:-300} $PY benchmarks/bench_short_prompts.py --out "$OUT" --name h200-short-prompts 2>&1 \
        | tee "$OUT/short_prompts.log"
    ;;
  lm)
    MEASURE_130M=1 bash results/lm/run_small.sh "$OUT" 2>&1 | tee "$OUT/lm.log"
    ;;
  addition)
    # a fresh folder of runs unless ADDITION_RUNS names one (finished runs there are skipped, not retrained)
    RUNS=${ADDITION_RUNS:-$(mktemp -d /tmp/addition_runs.XXXXXX)}; mkdir -p "$RUNS" "$OUT/addition_runs"
    # ADDITION_ARGS passes budget overrides to every model alike (e.g. "--hidden-size 512 --num-heads 8 --steps 4000")
    timeout ${ADDITION_TIMEOUT:-540} $PY -m falcon_fwa.cli addition-compare --preset paper --device cuda \
        --models Falcon-3A.3 Falcon-1A.3 Falcon-1.3 Transformer Mamba-2 --seeds 0 --jobs 5 --deadline ${ADDITION_DEADLINE:-480} --partial \
        --runs "$RUNS" --results "$OUT" --name paper ${ADDITION_ARGS:-} 2>&1 | tee "$OUT/addition.log"
    # OUT keeps each run's results.json and log.txt; the checkpoints and per-run plots stay in RUNS
    (cd "$RUNS" && find . \( -name results.json -o -name log.txt \) -exec cp --parents {} "$OUT/addition_runs/" \;)
    ;;
  addition-step)
    # both float32 matmul settings side by side: exact fp32 products (FMA units) and TF32 tensor cores
    timeout ${STEP_TIMEOUT:-240} $PY benchmarks/bench_addition_step.py --batch 128 512 --profile 12 \
        --matmul-precision highest high \
        --out "$OUT" --name h200-addition-step 2>&1 | tee "$OUT/addition_step.log"
    ;;
  multigpu)
    # DDP and FSDP2 at 1 and every larger GPU count of the machine (up to 4), Falcon-1A.3 and the Transformer,
    # small recipe at its per-GPU batch; rows into MULTIGPU_RUNS/multigpu.{json,md} after every run, copied to
    # OUT at the end. The rows stay beside the run folders (default runs/scaling), so the same stage launched
    # again on the same machine, with a fresh OUT, goes on from the finished runs (a sweep past the deadline).
    NGPU=$(nvidia-smi -L | wc -l)
    COUNTS="1"; for n in 2 4; do [ "$n" -le "$NGPU" ] && COUNTS="$COUNTS $n"; done
    RUNS=${MULTIGPU_RUNS:-runs/scaling}
    timeout ${MULTIGPU_TIMEOUT:-560} $PY -m falcon_fwa.cli scaling \
        --configs configs/small/falcon-1a.3.yaml configs/small/transformer.yaml --names Falcon-1A.3 Transformer \
        --gpus $COUNTS --strategies ddp fsdp2 --noise-seeds 0 1 --steps ${MULTIGPU_STEPS:-120} \
        --deadline ${MULTIGPU_DEADLINE:-520} --out "$RUNS" --results "$RUNS/multigpu" \
        --set train.eval_batches=16 ${COMMIT:+--commit $COMMIT} 2>&1 | tee "$OUT/multigpu.log"
    cp "$RUNS/multigpu.json" "$RUNS/multigpu.md" "$OUT/" 2>/dev/null
    tar czf "$OUT/multigpu_logs.tgz" "$RUNS"/*.log 2>/dev/null
    ;;
  *)
    echo "unknown stage $STAGE: choose tests, tests-full, fla, diagnose, profile, kernels, kernels-long, warm, ab, host, decode, short-prompts, lm, multigpu, addition or addition-step" >&2; exit 2;;
esac
