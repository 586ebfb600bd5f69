#!/usr/bin/env bash
# The tests: same set-up as the main job, then pytest (GPU tests are skipped without a GPU).
# Two pytest-xdist workers (CI has 2 cores, and a test's ranks and compile jobs leave gaps the other
# worker fills; tests/conftest.py orders and groups the tests). Extra arguments go to pytest: `-n 0`
# runs in one process.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup_env.sh"
cd "$root"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --durations=15 "$@"
