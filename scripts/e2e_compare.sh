#!/usr/bin/env bash
# The end-to-end comparison (benchmarks/e2e_compare.py): bf16 eager and under torch.compile,
# torchao (compiled), Transformer Engine and LoKA (compiled) on the GPU-sized recipes, one
# training job per recipe x run x seed; speed-ups are over the faster bf16 compile mode. Arguments
# go to the driver (see its --help), e.g. on one H100, two recipes, profiling 5 steady-state steps:
#
#     scripts/e2e_compare.sh --nproc 1 --recipes dhen_large,dhen_xl --seeds 0,1 --steps 400 \
#         --probe-warmup 100 --profile-start 390 --profile-steps 5 --max-seconds 3000
#
# Writes <date>-e2e.json/.md/.png to $OUT (default benchmarks/results). Where the project is not
# installed (e.g. a GPU image with only torch/torchrec), it is put on PYTHONPATH as installed:
# kernels/ and recipes/ become loka_torchrec subpackages, as pyproject.toml maps them.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
if ! $PY -P -c "import loka_job.recipes, loka_torchrec.kernels" 2>/dev/null; then
  source "$ROOT/scripts/installed_layout.sh" && use_installed_layout "$ROOT"
  echo "e2e_compare.sh: using the project from $LOKA_SITE" >&2
fi
exec $PY -P benchmarks/e2e_compare.py --out "${OUT:-$ROOT/benchmarks/results}" "$@"
