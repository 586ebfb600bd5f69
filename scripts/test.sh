#!/usr/bin/env bash
# The tests: same set-up as the main job, then pytest (GPU tests are skipped without a GPU).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup_env.sh"
cd "$root"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
