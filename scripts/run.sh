#!/usr/bin/env bash
# The main job: 2 CPU ranks (gloo), synthetic data, the default recipe (TorchRec DLRM) with LoKA on.
# Extra arguments are Hydra overrides, e.g. `scripts/run.sh model=dcn train.steps=500`.
#
# On a CPU, FP8 GEMMs are real but no faster than fp32, so this demo turns the speed gate off
# (loka.dispatch.min_speedup=0) to show FP8 running wherever it is accurate enough; the plan and
# the summary report the measured speedups as they are. GPU runs keep the 1.05x gate.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup_env.sh"
cd "$root"
export LOKA_RUN_DIR=${LOKA_RUN_DIR:-outputs/$(date +%Y-%m-%d)/$(date +%H-%M-%S)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$root/.venv/bin/torchrun" --standalone --nproc_per_node=2 -m loka_job.train \
  device=cpu loka.dispatch.min_speedup=0 "$@"
