#!/usr/bin/env bash
# The embedding-comms step-time table on a machine with 2 GPUs, in one call: TorchRec's DLRM of
# shared/measurements.md section 3 with every comms variant of benchmarks/comms_step_time.py,
# over NVLink (NCCL's default) and with NCCL forced onto sockets (the network-bound regime).
#
# Usage, from the repository root on the GPU machine, once TorchRec and FBGEMM are installed
# (see ../shared/device/README.md):
#
#     export PYTHONPATH=/tmp/site && bash scripts/device_comms.sh
#
# Writes $OUT/nvlink/results.{json,md}, $OUT/sockets/results.{json,md} and $OUT/comms-logs.txt.
# Settings (environment): OUT (default ./device-out), COMMS_STEPS (default 60),
# COMMS_VARIANTS (default: every variant), COMMS_LIMIT_S (seconds per regime, default 240),
# COMMS_PROFILE_STEPS (profiled steps per variant after the timed ones, default 5; 0: off).

set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
unset TRITON_INTERPRET

# The project on the path as it is installed (kernels/ and recipes/ become subpackages).
source "$ROOT/scripts/installed_layout.sh" && use_installed_layout "$ROOT"

VARIANTS=${COMMS_VARIANTS:-fp32,torchrec_bf16,torchrec_fp8,loka_fp8,loka_fp8_bwd_fp8}
ARGS=(--steps "${COMMS_STEPS:-60}" --comms "$VARIANTS" --profile-steps "${COMMS_PROFILE_STEPS:-5}")
LIMIT=${COMMS_LIMIT_S:-240}
LOG="$OUT/comms-logs.txt"

run_regime() {  # run_regime NAME [ENV=VALUE...]
  local name=$1
  shift
  echo "=== $name ($*)" | tee -a "$LOG"
  env "$@" timeout --kill-after=10 "$LIMIT" python3 -P -m torch.distributed.run --nproc_per_node=2 \
    benchmarks/comms_step_time.py "${ARGS[@]}" --out "$OUT/$name" >> "$LOG" 2>&1
  echo "=== $name: rc=$?" | tee -a "$LOG"
  [ -f "$OUT/$name/results.md" ] && cat "$OUT/$name/results.md"
}

nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$LOG"
run_regime nvlink
run_regime sockets NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1
tail -n 40 "$LOG"
