#!/usr/bin/env bash
# GPU benchmarks and GPU tests, for a device machine with the packages of ../shared/device/ installed:
#     export PYTHONPATH=/tmp/site && bash scripts/device_benchmarks.sh STAGE [ARGS]
#
# Stages:
#   gpu_tests [TEST_FILE...]          the tests marked gpu (default: all); output in $OUT/gpu-tests.txt
#   e2e NAME RECIPES SEEDS RUNS       benchmarks/e2e_compare.py on RECIPES (comma-separated) x SEEDS x
#                                     RUNS, steady-state steps profiled; tables and plots in $OUT,
#                                     the runs' own files (plans, summaries, logs) in one tarball
#   dense NAME PRESET PLAN [RUNS]     benchmarks/dense_part_step.py: the DHEN dense part's fwd+bwd,
#                                     bf16 / torchao / LoKA (PLAN: a dispatch_plan.json, or a static
#                                     mode such as all:scaled_mm:tensorwise) compiled;
#                                     RUNS: comma-separated (default: all of the script's runs)
#   inference NAME PRESET PLAN [RUNS] benchmarks/inference_throughput.py: a model's dense part (DHEN; INFERENCE_ARGS
#                                     "--model wukong" or "--model dcnv2" for those) forward only, bf16 /
#                                     torchao float8 inference / LoKA's serving form of PLAN (a dispatch_plan.json,
#                                     or a static mode such as all:scaled_mm:rowwise), batch sizes INFERENCE_BATCHES
#                                     (default 512,2048,8192)
#   job NAME OVERRIDE...              one training job on one GPU with these Hydra overrides (e.g.
#                                     model=dhen_xl device=cuda train.compile=reduce-overhead
#                                     train.log_every=5: its log has gpu_mem_gib per log step); set
#                                     TORCH_LOGS (e.g. cudagraphs) to see why graphs re-record; its
#                                     run folder and output in one tarball
#
# Settings (environment): E2E_STEPS (default 500), E2E_PROBE_WARMUP (default 100), E2E_NPROC (ranks per
# e2e run, default 1: one per GPU of a multi-GPU machine; over NVLink as the machine is, or with
# NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 over sockets), E2E_OVERRIDES
# (space-separated Hydra overrides for every e2e run, e.g. "train.reuse_batches=16"; with
# "train.profile_host_stacks=true" each run's rank0/host_stacks.txt says where the host's step time
# goes, benchmarks/host_stacks_diff.py compares two), E2E_REPLAY_PLAN (the dispatch_plan.json that
# loka_compile_default_replay runs pin), E2E_PROFILE_STEPS (profiled steps near each run's
# end, default 5; not timed), E2E_RUN_TIMEOUT (seconds one e2e run may take, default 300), DENSE_ARGS
# (more arguments of dense_part_step.py, e.g. "--top-kernels 400"), INFERENCE_ARGS (more arguments of
# inference_throughput.py, e.g. "--choose-at-batch"),
# E2E_DEVICE (the e2e driver's --device, default cuda; cpu runs the stage on a machine without a GPU),
# STAGE_DEADLINE_S (default 570: seconds from CALL_T0, the call's start in epoch seconds, default now).
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
unset TRITON_INTERPRET
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}  # one job per GPU must not take every host core
stage=${1:?usage: device_benchmarks.sh gpu_tests [FILES] | e2e NAME RECIPES SEEDS RUNS | dense NAME PRESET PLAN [RUNS] | inference NAME PRESET PLAN [RUNS] | job NAME OVERRIDE...}
DEADLINE=$(( ${CALL_T0:-$(date +%s)} + ${STAGE_DEADLINE_S:-570} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
if [ "$(left)" -lt 40 ]; then  # a stage chained after others: too little of the call is left to start it
  echo "=== $1: skipped, $(left) s left before the call's deadline (CALL_T0 + STAGE_DEADLINE_S)"
  exit 3
fi
WORK=$(mktemp -d /tmp/loka-bench.XXXXXX)
STEPS=${E2E_STEPS:-500}
WARMUP=${E2E_PROBE_WARMUP:-100}

# The project on the path as it is installed (kernels/ and recipes/ become subpackages).
source "$ROOT/scripts/installed_layout.sh" && use_installed_layout "$ROOT" "$WORK/site"
nvidia-smi --query-gpu=index,name,memory.total --format=csv

case $stage in
  gpu_tests)
    shift
    timeout $(( $(left) - 10 )) python3 -P -m pytest -q -m gpu -rfEs --log-level=WARNING -p no:cacheprovider -o addopts= "${@:-tests}" \
      > "$WORK/pytest-gpu.log" 2>&1
    echo "=== gpu tests: rc=$?"
    tail -c 60000 "$WORK/pytest-gpu.log" > "$OUT/gpu-tests.txt"
    tail -n 20 "$WORK/pytest-gpu.log"
    ;;
  e2e)
    name=${2:?e2e NAME RECIPES SEEDS RUNS}; recipes=${3:?}; seeds=${4:?}; runs=${5:?}
    extra=(); for o in ${E2E_OVERRIDES:-}; do extra+=(--override "$o"); done
    [ -n "${E2E_REPLAY_PLAN:-}" ] && extra+=(--replay-plan "$E2E_REPLAY_PLAN")
    # The driver rewrites its tables in $OUT after every run; the runs' own files and the driver's log are
    # packed at the end, or when the stage is stopped (device_per_gpu.sh's deadline), so a stopped
    # stage still returns the finished runs' tables and how far the unfinished one got.
    pack_e2e() { tail -n 30 "$WORK/$name.log"; tar -czf "$OUT/$name-runs.tar.gz" -C "$WORK" --exclude='site' runs "$name.log" 2>/dev/null; }
    trap 'echo "=== e2e $name: stopped"; pack_e2e; exit 143' TERM
    python3 -P benchmarks/e2e_compare.py "${extra[@]}" --device "${E2E_DEVICE:-cuda}" --out "$OUT" --runs-dir "$WORK/runs" \
      --name "$name" --recipes "$recipes" --seeds "$seeds" --runs "$runs" --steps "$STEPS" --probe-warmup "$WARMUP" \
      --nproc "${E2E_NPROC:-1}" --profile-start $(( STEPS - ${E2E_PROFILE_STEPS:-5} - 7 )) --profile-steps "${E2E_PROFILE_STEPS:-5}" \
      --run-timeout "${E2E_RUN_TIMEOUT:-300}" --max-seconds $(( $(left) - 25 )) > "$WORK/$name.log" 2>&1 &
    wait $!  # in the background, so that a TERM runs the trap at once instead of after the driver
    echo "=== e2e $name: rc=$?"
    trap - TERM
    pack_e2e
    ;;
  dense)
    name=${2:?dense NAME PRESET PLAN [RUNS]}; preset=${3:?}; plan=${4:?}; runs=${5:-}
    if [ -f "$plan" ]; then source_arg=(--plan "$plan"); else source_arg=(--mode "$plan"); fi
    timeout $(( $(left) - 10 )) python3 -P benchmarks/dense_part_step.py --preset "$preset" "${source_arg[@]}" \
      ${runs:+--runs "$runs"} ${DENSE_ARGS:-} --out "$OUT/$name" > "$WORK/$name.log" 2>&1
    echo "=== dense $name: rc=$?"
    grep -v "fbgemm_torch_compat\|cannot determine\|WARNING:root\|\[33m\|\[0m\|^\s*$" "$WORK/$name.log" | tail -n 30
    cp "$WORK/$name.log" "$OUT/$name.log"
    ;;
  inference)
    name=${2:?inference NAME PRESET PLAN [RUNS]}; preset=${3:?}; plan=${4:?}; runs=${5:-}
    if [ -f "$plan" ]; then source_arg=(--plan "$plan"); else source_arg=(--mode "$plan"); fi
    timeout $(( $(left) - 10 )) python3 -P benchmarks/inference_throughput.py --preset "$preset" "${source_arg[@]}" \
      --batch-sizes "${INFERENCE_BATCHES:-512,2048,8192}" ${runs:+--runs "$runs"} ${INFERENCE_ARGS:-} --out "$OUT/$name" \
      > "$WORK/$name.log" 2>&1
    echo "=== inference $name: rc=$?"
    grep -v "fbgemm_torch_compat\|cannot determine\|WARNING:root\|\[33m\|\[0m\|^\s*$" "$WORK/$name.log" | tail -n 30
    cp "$WORK/$name.log" "$OUT/$name.log"
    ;;
  job)
    name=${2:?job NAME OVERRIDE...}; shift 2
    mkdir -p "$WORK/runs/$name"
    ( cd "$WORK/runs/$name" && LOKA_RUN_DIR="$WORK/runs/$name" timeout $(( $(left) - 15 )) \
        python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m loka_job.train train.progress_bar=false "$@" ) \
      > "$WORK/$name.log" 2>&1
    echo "=== job $name: rc=$?"
    grep -h "step=\|Error\|re-record\|rerecord\|skipping cudagraphs" "$WORK/$name.log" "$WORK/runs/$name/rank0/train.log" 2>/dev/null \
      | cut -c1-300 | tail -n 40
    tar -czf "$OUT/$name-runs.tar.gz" -C "$WORK" --exclude='site' runs "$name.log" 2>/dev/null
    ;;
  *)
    echo "device_benchmarks.sh: unknown stage $stage (gpu_tests | e2e | dense | inference | job)" >&2
    exit 2
    ;;
esac
ls -la "$OUT"
