#!/usr/bin/env bash
# One device session in calls of under 10 minutes each. On a 2-GPU machine (nvidia-h200-x2):
#
#   bash scripts/device_session.sh comms    GPU tests of comms, guard and DMPCollection; then the
#                                           comms step-time table, NVLink and sockets
#   bash scripts/device_session.sh single   the single-GPU comparison: two streams of runs, one
#                                           per GPU (recipes split between them), 2 seeds
#   bash scripts/device_session.sh multi    2-rank runs: FP8 comms on/off over NVLink and over
#                                           sockets, and LoKA under DMPCollection
#
# On one GPU (nvidia-h100-x1 or nvidia-h200), one stream of runs at a time:
#
#   bash scripts/device_session.sh graphs     GPU tests of the CUDA-graphed FP8 layer and the layer
#                                             check; LokaLinear host/device time eager vs graphed at
#                                             two shapes; DHEN large: bf16, loka, loka_graphs, 2 seeds
#   bash scripts/device_session.sh dlrm       DLRM large: bf16, loka, loka_graphs, 2 seeds
#   bash scripts/device_session.sh graphs_check  the CUDA-graph GPU tests; DHEN large with every GEMM
#                                             forced to FP8, eager and graphed (E2E_STEPS=150)
#   bash scripts/device_session.sh baselines  DHEN large, seed 0: bf16 (again, for the ratios),
#                                             bf16_nomods, TE, torchao x3
#   bash scripts/device_session.sh hstu       HSTU large: bf16, loka (2 seeds), TE, torchao rowwise
#   bash scripts/device_session.sh harness    DHEN large, seed 0: what the job's timing and data
#                                             loading do to the step. bf16 timed as before
#                                             (synchronized per step, batches made in the loop),
#                                             with loader workers only, and as the job now runs
#                                             (workers, no per-step sync); under the latter also
#                                             loka, loka_graphs, torchao rowwise and every GEMM
#                                             forced to FP8 with graphs (E2E_STEPS=260 suggested)
#   bash scripts/device_session.sh dense      GPU tests of dense CUDA graphs; DHEN large seed 0:
#                                             bf16, bf16_graphs, loka_dense_graphs, and every GEMM
#                                             forced to FP8 under dense graphs
#   bash scripts/device_session.sh dense2     DHEN large seed 1 and DLRM large seed 0: bf16,
#                                             bf16_graphs, loka_dense_graphs
#   bash scripts/device_session.sh baselines2 DHEN large seed 0: bf16, bf16_graphs, bf16_nomods, TE,
#                                             torchao tensorwise and rowwise_with_gw_hp
#   bash scripts/device_session.sh hstu2      GPU tests (dense graphs, metrics, layer graphs); HSTU
#                                             large bf16 vs loka, deterministic, 2 seeds; DLRM large
#                                             seed 1: bf16, bf16_graphs, loka_dense_graphs
#   bash scripts/device_session.sh final      dense-graph GPU tests; DLRM large seed 0 with the
#                                             default loader workers; DHEN torchao rowwise_with_gw_hp
#   bash scripts/device_session.sh budget     the Probe's cost under its monitoring budget and with
#                                             capped error draws: DHEN large seeds 0 and 1 (bf16_graphs,
#                                             loka_dense_graphs), DLRM large seed 0 (loka_dense_graphs)
#   bash scripts/device_session.sh budget2    the same after the cheaper planning step: DHEN large seeds
#                                             0 and 1, DLRM large seed 0 (loka_dense_graphs)
#   bash scripts/device_session.sh hstu4      dense-graph GPU tests; HSTU large seed 0: bf16, bf16_graphs,
#                                             loka_dense_graphs (modules with ever-new shapes give up)
#   bash scripts/device_session.sh final2     DHEN large seeds 0 and 1 in one call: bf16, bf16_graphs,
#                                             loka_dense_graphs
#   bash scripts/device_session.sh hstu_baselines  HSTU large seed 0: TE, torchao rowwise and
#                                             rowwise_with_gw_hp, bf16 with dense graphs
#   bash scripts/device_session.sh dlrm_baselines  DLRM large seed 0: TE, torchao tensorwise, rowwise
#                                             and rowwise_with_gw_hp, bf16_nomods
#   bash scripts/device_session.sh planprof   where the planning step's time goes: DHEN large, 24 steps
#                                             (plan after 20) under cProfile, twice: with an empty
#                                             Triton cache, then with the cache the first run filled
#   bash scripts/device_session.sh hstu3      HSTU large, deterministic, seed 1: bf16 and loka; seed 0:
#                                             loka with dense graphs
#   bash scripts/device_session.sh compiled RECIPE [SEEDS]  the compiled comparison (e2e_compare.py's
#                                             default runs: bf16 eager and compiled in both modes,
#                                             torchao compiled, TE, loka_compile) on one recipe, e.g.
#                                             `compiled dhen_xl 0`; runs the deadline cuts are listed
#                                             as not run (split seeds over calls, then combine_results.py)
#
# Run from the repository root with the packages installed (../shared/device/README.md):
#     export PYTHONPATH=/tmp/site && bash scripts/device_session.sh comms
# Results go to $OUT (at most 8 files come back; logs are packed into one tarball per stage).
# Settings (environment): E2E_STEPS (default 300), E2E_PROBE_WARMUP (default 100),
# E2E_SEEDS (default 0,1), STAGE_DEADLINE_S (default 570: seconds from CALL_T0, the call's start
# time in epoch seconds, default now; set CALL_T0 when the same call installs packages first).

set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
unset TRITON_INTERPRET
# 8 intra-op threads per job: two jobs with PyTorch's default (one thread per host core each) ran
# about 13x slower per step on the 32-core host (benchmarks/results/H200/README.md).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
stage=${1:?usage: device_session.sh comms|single|multi}
DEADLINE=$(( ${CALL_T0:-$(date +%s)} + ${STAGE_DEADLINE_S:-570} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
WORK=$(mktemp -d /tmp/loka-session.XXXXXX)
STEPS=${E2E_STEPS:-300}
WARMUP=${E2E_PROBE_WARMUP:-100}
SEEDS=${E2E_SEEDS:-0,1}
E2E=(--steps "$STEPS" --probe-warmup "$WARMUP" --profile-start $(( STEPS - 12 )) --profile-steps 5)

# The project on the path as it is installed (kernels/ and recipes/ become subpackages).
source "$ROOT/scripts/installed_layout.sh" && use_installed_layout "$ROOT" "$WORK/site"
if ! python3 -c "import pytest" 2>/dev/null && ls .device/test-wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/test-wheels/*.whl > /dev/null 2>&1
fi

e2e() {  # e2e NAME LIMIT_S ARGS...: one benchmarks/e2e_compare.py invocation, its files in $OUT
  local name=$1 limit=$2
  shift 2
  local cap=$(( $(left) - 15 ))
  [ "$limit" -gt "$cap" ] && limit=$cap
  echo "=== $name (limit ${limit}s): $*"
  python3 -P benchmarks/e2e_compare.py --out "$OUT" --runs-dir "$WORK/runs-$name" --name "$name" \
    --max-seconds $(( limit - 20 )) "${E2E[@]}" "$@" > "$WORK/$name.log" 2>&1
  echo "=== $name: rc=$?"
  tail -n 25 "$WORK/$name.log"
}

gpu_tests() {  # gpu_tests LIMIT_S TEST_FILE...: the GPU tests; the whole output (a failed capture's logged traceback included) to $OUT/gpu-tests-$stage.txt
  local limit=$1
  shift
  timeout "$limit" python3 -P -m pytest -q -m gpu -rs -p no:cacheprovider -o addopts= "$@" > "$WORK/pytest-gpu.log" 2>&1
  grep -v "_fbgemm_torch_compat_table\|cannot determine compatibility" "$WORK/pytest-gpu.log" | tail -c 60000 > "$OUT/gpu-tests-$stage.txt"
  tail -n 15 "$WORK/pytest-gpu.log"
}

# At most 8 files come back from a call: between packed_begin and packed_end the e2e files go to
# $WORK/results, and only their tables (.md) come back as they are, the rest in one tarball.
packed_begin() {
  RESULTS=$OUT
  OUT=$WORK/results && mkdir -p "$OUT"
}
packed_end() {
  cp "$OUT"/*.md "$RESULTS"/
  tar -czf "$RESULTS/$stage-results.tar.gz" -C "$OUT" .
  OUT=$RESULTS
}

pack() {  # the runs' own files (plans, events, probe logs, summaries) and the logs, in one tarball
  tar -czf "$OUT/$stage-logs.tar.gz" -C "$WORK" --exclude='site' . 2>/dev/null
  ls -la "$OUT"
}

nvidia-smi --query-gpu=index,name,memory.total --format=csv
case $stage in
  comms)
    timeout 75 python3 -P -m pytest -q -m gpu -rs -p no:cacheprovider -o addopts= \
      tests/test_comms_kernel.py tests/test_step_guard.py tests/test_layer_check.py \
      2>&1 | tail -n 30 | tee "$WORK/pytest-gpu.log"
    # Where a LokaLinear step's host time goes, at a DHEN-large shape (cProfile + torch profiler).
    prof=(benchmarks/profile_step.py --cases linear --shape 8192x2048x1024 --choices scaled_mm:rowwise,te:blockwise --reps 30)
    {
      echo "# ${prof[*]} on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), $(date -u '+%F %H:%M UTC')"
      echo "# command: python3 -P ${prof[*]}   (scripts/device_session.sh comms)"
      timeout 90 python3 -P "${prof[@]}" 2>&1
    } > "$OUT/profile-linear.txt"
    echo "=== profile_step: rc=$?"
    COMMS_LIMIT_S=$(( ($(left) - 30) / 2 )) OUT="$OUT/comms" bash scripts/device_comms.sh > "$WORK/comms.log" 2>&1
    tail -n 60 "$WORK/comms.log"
    mv "$OUT/comms/nvlink/results.md" "$OUT/comms-nvlink.md" 2>/dev/null
    mv "$OUT/comms/nvlink/results.json" "$OUT/comms-nvlink.json" 2>/dev/null
    mv "$OUT/comms/sockets/results.md" "$OUT/comms-sockets.md" 2>/dev/null
    mv "$OUT/comms/sockets/results.json" "$OUT/comms-sockets.json" 2>/dev/null
    mv "$OUT/comms/comms-logs.txt" "$WORK/" 2>/dev/null
    rm -rf "$OUT/comms"
    ;;
  single)
    # Two independent streams, one per GPU, at the same time (32 host cores: the streams do not
    # share a GPU; host-side contention is the only coupling).
    limit=$(( $(left) - 20 ))
    CUDA_VISIBLE_DEVICES=0 e2e e2e-gpu0 "$limit" --recipes dhen_large --seeds "$SEEDS" \
      --runs bf16,loka,bf16_nomods,te,torchao_rowwise,torchao_tensorwise,torchao_rowwise_with_gw_hp \
      --one-seed-runs bf16_nomods,te,torchao_rowwise,torchao_tensorwise,torchao_rowwise_with_gw_hp --run-timeout 150 &
    CUDA_VISIBLE_DEVICES=1 e2e e2e-gpu1 "$limit" --recipes hstu_large,dlrm_large --seeds "$SEEDS" \
      --runs bf16,loka,te,torchao_rowwise --one-seed-runs te,torchao_rowwise --run-timeout 150 &
    wait
    ;;
  multi)
    limit=$(( ($(left) - 30) / 2 ))
    e2e e2e-2gpu-nvlink "$limit" --nproc 2 --recipes dhen_large --seeds 0 \
      --runs bf16,loka,loka_comms_off,loka_dmpc --run-timeout 120
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 e2e e2e-2gpu-sockets "$(( $(left) - 60 ))" --nproc 2 \
      --recipes dhen_large --seeds 0 --runs bf16,loka,loka_comms_off --run-timeout 120
    # With what is left: the 2-rank DMPCollection test (replicas' tables agree after the syncs).
    timeout $(( $(left) - 10 )) python3 -P -m pytest -q -m gpu -rs -p no:cacheprovider -o addopts= \
      tests/test_dmp_collection.py 2>&1 | tail -n 15 | tee "$WORK/pytest-dmp.log"
    ;;
  graphs)
    gpu_tests 150 tests/test_layer_graph.py tests/test_layer_check.py
    # Host and device time of one FP8 layer step, eager against CUDA-graphed, at a DHEN-large
    # shape and at a larger one.
    for shape in 8192x2048x1024 32768x2048x2048; do
      prof=(benchmarks/profile_step.py --cases linear --shape "$shape" --choices scaled_mm:rowwise,triton:rowwise --graphs --reps 30)
      {
        echo "# ${prof[*]} on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), $(date -u '+%F %H:%M UTC')"
        echo "# command: python3 -P ${prof[*]}   (scripts/device_session.sh graphs)"
        timeout 60 python3 -P "${prof[@]}" 2>&1 | grep -v "_fbgemm_torch_compat_table\|cannot determine compatibility\|^ *\[0m\|^ *\[33m\|^WARNING:root:$\|^ *$"
      } > "$OUT/profile-linear-graphs-$shape.txt"
      grep "^=== linear" "$OUT/profile-linear-graphs-$shape.txt"
    done
    e2e e2e-dhen-1gpu "$(( $(left) - 20 ))" --recipes dhen_large --seeds "$SEEDS" --runs bf16,loka,loka_graphs --run-timeout 100
    ;;
  graphs_check)
    # The CUDA-graph GPU tests, then DHEN large with every GEMM forced to FP8 (no layer check, no
    # step-time guard), eager against graphed: do the captures hold in a real DMP job, and what do
    # they change there. Shorter runs (E2E_STEPS, default here 150).
    gpu_tests 100 tests/test_layer_graph.py
    e2e e2e-dhen-forced-fp8 "$(( $(left) - 20 ))" --recipes dhen_large --seeds 0 --runs loka,loka_graphs --run-timeout 90 \
      --override loka.dispatch.mode=all:scaled_mm:rowwise --override loka.dispatch.layer_check_reps=0 \
      --override loka.dispatch.step_guard_window=0
    ;;
  dlrm)
    e2e e2e-dlrm-1gpu "$(( $(left) - 20 ))" --recipes dlrm_large --seeds "$SEEDS" --runs bf16,loka,loka_graphs --run-timeout 100
    ;;
  baselines)
    e2e e2e-dhen-1gpu-baselines "$(( $(left) - 20 ))" --recipes dhen_large --seeds 0 \
      --runs bf16,bf16_nomods,te,torchao_rowwise,torchao_tensorwise,torchao_rowwise_with_gw_hp --run-timeout 100
    ;;
  hstu)
    e2e e2e-hstu-1gpu "$(( $(left) - 20 ))" --recipes hstu_large --seeds "$SEEDS" \
      --runs bf16,loka,te,torchao_rowwise --one-seed-runs te,torchao_rowwise --run-timeout 100
    ;;
  harness)
    gpu_tests 60 tests/test_metrics.py
    packed_begin
    e2e e2e-dhen-timing-sync-inline 100 --recipes dhen_large --seeds 0 --runs bf16 --run-timeout 90 \
      --override train.step_sync=true --override train.data_workers=0
    e2e e2e-dhen-timing-sync-workers 100 --recipes dhen_large --seeds 0 --runs bf16 --run-timeout 90 \
      --override train.step_sync=true
    e2e e2e-dhen-1gpu "$(( $(left) - 120 ))" --recipes dhen_large --seeds 0 \
      --runs bf16,loka,loka_graphs,torchao_rowwise --run-timeout 90
    e2e e2e-dhen-forced-fp8-graphs "$(( $(left) - 20 ))" --recipes dhen_large --seeds 0 --runs loka_graphs --run-timeout 90 \
      --override loka.dispatch.mode=all:scaled_mm:rowwise --override loka.dispatch.layer_check_reps=0 \
      --override loka.dispatch.step_guard_window=0
    packed_end
    ;;
  dense)
    # Dense CUDA graphs (loka.dispatch.dense_graphs): their GPU tests, then DHEN large, seed 0:
    # bf16, bf16 with dense graphs, LoKA with dense graphs, and every GEMM forced to FP8 with dense
    # graphs (no layer check, no guard): what FP8 adds once the step is GPU-bound.
    gpu_tests 120 tests/test_module_graph.py tests/test_layer_graph.py
    packed_begin
    e2e e2e-dhen-1gpu-dense "$(( $(left) - 110 ))" --recipes dhen_large --seeds 0 \
      --runs bf16,bf16_graphs,loka_dense_graphs --run-timeout 100
    e2e e2e-dhen-forced-fp8-dense "$(( $(left) - 20 ))" --recipes dhen_large --seeds 0 --runs loka_dense_graphs \
      --run-timeout 90 --override loka.dispatch.mode=all:scaled_mm:rowwise --override loka.dispatch.layer_check_reps=0 \
      --override loka.dispatch.step_guard_window=0
    packed_end
    ;;
  dense2)
    # The second seed of DHEN large and DLRM large, bf16 / bf16 with dense graphs / LoKA with them.
    packed_begin
    e2e e2e-dhen-1gpu-dense-seed1 "$(( ($(left) - 20) / 2 ))" --recipes dhen_large --seeds 1 \
      --runs bf16,bf16_graphs,loka_dense_graphs --run-timeout 100
    e2e e2e-dlrm-1gpu-dense "$(( $(left) - 20 ))" --recipes dlrm_large --seeds 0 \
      --runs bf16,bf16_graphs,loka_dense_graphs --run-timeout 100
    packed_end
    ;;
  baselines2)
    # DHEN large, seed 0, as the job now runs (loader workers, no per-step sync): bf16, bf16 with
    # dense graphs, bf16 without Mods, Transformer Engine, torchao tensorwise and rowwise_with_gw_hp
    # (torchao rowwise: stage harness). Needs the te and torchao profiles installed.
    packed_begin
    e2e e2e-dhen-1gpu-baselines "$(( $(left) - 20 ))" --recipes dhen_large --seeds 0 \
      --runs bf16,bf16_graphs,bf16_nomods,te,torchao_tensorwise,torchao_rowwise_with_gw_hp --run-timeout 100
    packed_end
    ;;
  hstu2)
    # The dense-graph and metrics GPU tests; HSTU large bf16 vs LoKA with deterministic kernels on
    # two seeds (is the NE difference LoKA's?); DLRM large seed 1: bf16, bf16_graphs, loka_dense_graphs.
    gpu_tests 100 tests/test_module_graph.py tests/test_metrics.py tests/test_layer_graph.py
    packed_begin
    e2e e2e-hstu-1gpu-deterministic "$(( ($(left) - 20) / 2 + 30 ))" --recipes hstu_large --seeds 0,1 --runs bf16,loka \
      --deterministic --run-timeout 100
    e2e e2e-dlrm-1gpu-dense-seed1 "$(( $(left) - 20 ))" --recipes dlrm_large --seeds 1 \
      --runs bf16,bf16_graphs,loka_dense_graphs --run-timeout 100
    packed_end
    ;;
  final)
    # The dense-graph GPU tests; DLRM large seed 0 again with the default loader workers (8 on a
    # 16-core host: 26 tables a batch are slow to make); DHEN large torchao rowwise_with_gw_hp.
    gpu_tests 60 tests/test_module_graph.py
    packed_begin
    e2e e2e-dlrm-1gpu-dense-workers8 "$(( $(left) - 110 ))" --recipes dlrm_large --seeds 0 \
      --runs bf16,bf16_graphs,loka_dense_graphs --run-timeout 90
    e2e e2e-dhen-1gpu-torchao-gw-hp "$(( $(left) - 20 ))" --recipes dhen_large --seeds 0 \
      --runs torchao_rowwise_with_gw_hp --run-timeout 100
    packed_end
    ;;
  budget)
    # The Probe's cost with the budgeted monitoring cadence (loka.probe.monitor_budget) and capped
    # error draws (loka.probe.error_rows); the plan's seconds by part are in each run's record.
    gpu_tests 60 tests/test_probe_quantify.py
    packed_begin
    e2e e2e-dhen-1gpu-budget "$(( $(left) - 70 ))" --recipes dhen_large --seeds 0,1 \
      --runs bf16_graphs,loka_dense_graphs --run-timeout 100
    e2e e2e-dlrm-1gpu-budget "$(( $(left) - 20 ))" --recipes dlrm_large --seeds 0 --runs loka_dense_graphs --run-timeout 60
    packed_end
    ;;
  budget2)
    # The Probe's cost after the planning step got cheaper (8 draws, backends imported at start).
    gpu_tests 90 tests/test_probe_quantify.py tests/test_module_graph.py
    packed_begin
    e2e e2e-dhen-1gpu-budget2 "$(( $(left) - 70 ))" --recipes dhen_large --seeds 0,1 --runs loka_dense_graphs --run-timeout 100
    e2e e2e-dlrm-1gpu-budget2 "$(( $(left) - 20 ))" --recipes dlrm_large --seeds 0 --runs loka_dense_graphs --run-timeout 60
    packed_end
    ;;
  hstu4)
    # Dense graphs on HSTU after modules whose input shapes never repeat stop forming keys:
    # bf16, bf16 with dense graphs and LoKA with them, seed 0, in one call.
    gpu_tests 60 tests/test_module_graph.py
    packed_begin
    e2e e2e-hstu-1gpu-dense-giveup "$(( $(left) - 20 ))" --recipes hstu_large --seeds 0 \
      --runs bf16,bf16_graphs,loka_dense_graphs --run-timeout 110
    packed_end
    ;;
  final2)
    # DHEN large with the session's final code, both seeds, in one call: bf16, bf16 with dense
    # graphs, LoKA with them (same-call ratios for the README).
    packed_begin
    e2e e2e-dhen-1gpu-final "$(( $(left) - 10 ))" --recipes dhen_large --seeds 0,1 \
      --runs bf16,bf16_graphs,loka_dense_graphs --run-timeout 70
    packed_end
    ;;
  hstu_baselines)
    packed_begin
    e2e e2e-hstu-1gpu-baselines "$(( $(left) - 20 ))" --recipes hstu_large --seeds 0 \
      --runs te,torchao_rowwise,torchao_rowwise_with_gw_hp,bf16_graphs --run-timeout 110
    packed_end
    ;;
  dlrm_baselines)
    packed_begin
    e2e e2e-dlrm-1gpu-baselines "$(( $(left) - 20 ))" --recipes dlrm_large --seeds 0 \
      --runs te,torchao_tensorwise,torchao_rowwise,torchao_rowwise_with_gw_hp,bf16_nomods --run-timeout 90
    packed_end
    ;;
  planprof)
    export TRITON_CACHE_DIR=$WORK/triton-cache
    for run in cold warm; do
      LOKA_RUN_DIR=$WORK/planprof-$run timeout 200 python3 -P -m cProfile -o "$WORK/plan-$run.prof" -m loka_torchrec.train \
        model=dhen_large device=cuda loka.enabled=true loka.probe.enabled=true loka.mods.preset=all \
        loka.dispatch.dense_graphs=true loka.probe.warmup_steps=20 train.steps=24 train.progress_bar=false seed=0 \
        > "$WORK/planprof-$run.log" 2>&1
      echo "=== planprof $run: rc=$?"
      {
        echo "# cProfile of: python3 -P -m cProfile -m loka_torchrec.train model=dhen_large device=cuda loka.enabled=true loka.probe.enabled=true loka.mods.preset=all loka.dispatch.dense_graphs=true loka.probe.warmup_steps=20 train.steps=24 seed=0"
        echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), $(date -u '+%F %H:%M UTC'), Triton cache: $run (scripts/device_session.sh planprof)"
        grep -h "probe cost\|step time" "$WORK/planprof-$run.log"
        python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print('seconds', json.dumps(s['loka']['seconds']))" "$WORK/planprof-$run/summary.json"
        python3 -c "
import pstats, sys
p = pstats.Stats(sys.argv[1])
p.sort_stats('cumulative').print_stats('loka_torchrec|kernels|triton|fbgemm|torch/cuda|cholesky|linalg', 70)
p.sort_stats('tottime').print_stats(40)
" "$WORK/plan-$run.prof"
      } > "$OUT/planprof-$run.txt" 2>&1
      grep "^seconds\|probe cost" "$OUT/planprof-$run.txt"
    done
    ;;
  hstu3)
    packed_begin
    e2e e2e-hstu-1gpu-deterministic-seed1 "$(( ($(left) - 20) * 2 / 3 ))" --recipes hstu_large --seeds 1 --runs bf16,loka \
      --deterministic --run-timeout 130
    e2e e2e-hstu-1gpu-dense "$(( $(left) - 20 ))" --recipes hstu_large --seeds 0 --runs loka_dense_graphs --run-timeout 110
    packed_end
    ;;
  compiled)
    recipe=${2:?usage: device_session.sh compiled RECIPE [SEEDS]}
    packed_begin
    e2e "e2e-compiled-$recipe" "$(( $(left) - 20 ))" --recipes "$recipe" --seeds "${3:-$SEEDS}" --run-timeout 240
    packed_end
    ;;
  *)
    echo "device_session.sh: unknown stage $stage (compiled RECIPE [SEEDS] | comms | single | multi | graphs | graphs_check | dlrm | baselines | hstu | harness | dense | dense2 | baselines2 | hstu2 | final | budget | budget2 | hstu4 | final2 | hstu_baselines | dlrm_baselines | planprof | hstu3)" >&2
    exit 2
    ;;
esac
pack
