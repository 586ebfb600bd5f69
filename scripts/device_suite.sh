#!/usr/bin/env bash
# Everything that needs a GPU, in one call on the GPU machine: versions and backend availability,
# the GPU tests (pytest -m gpu), the GEMM benchmark; results and logs end up in $OUT.
#
# Usage, from the repository root on the GPU machine, once the packages are installed
# (see ../shared/device/README.md; pytest too, see below):
#
#     export PYTHONPATH=/tmp/site && bash scripts/device_suite.sh
#
# Every step runs under a time limit taken from one overall deadline, and a failing or timed-out
# step never stops the next one. What comes back in $OUT (at most 8 files):
#   summary.txt                    each step's exit status, duration and last lines
#   <date>-gemm-bench.json / .md   the benchmark (device, date, versions and command inside)
#   <date>-gemm-bench-fast-accum.json / .md   the target shapes with fast accumulation, time allowing
#   probe_overhead_cuda.json / .md  the Probe's cost per phase and over runs at the default cadence
#   device-suite-logs.tar.gz       full logs, JUnit XML of the test runs
#
# Settings (environment): OUT (default ./device-out), SUITE_DEADLINE_S (total seconds, default 450),
# SUITE_BENCH_ARGS (extra benchmark arguments, e.g. "--shapes 8192x2048x2048"), PYTHON (python3).
# pytest is not in the device image: put its wheels (pytest, pluggy, iniconfig, packaging) in
# .device/test-wheels/ (carried with the call) and this script installs them into /tmp/site.

set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/device-out}
DEADLINE=$(( $(date +%s) + ${SUITE_DEADLINE_S:-450} ))
WORK=$(mktemp -d /tmp/loka-suite.XXXXXX)
LOGS=$WORK/logs
SUMMARY=$WORK/summary.txt
mkdir -p "$OUT" "$LOGS" "$WORK/bench"
unset TRITON_INTERPRET  # the GPU run compiles the kernels

remaining() { echo $(( DEADLINE - $(date +%s) )); }

# run_step NAME LIMIT_SECONDS COMMAND...: at most LIMIT seconds, never past the deadline (minus
# a reserve for packing the results); its output goes to logs/NAME.log.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$(( $(remaining) - 25 ))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -le 5 ]; then
    echo "=== $name: not run, the suite's deadline is reached" | tee -a "$SUMMARY"
    return 0
  fi
  local t0
  t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  local note=""
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note=" (timed out)"; fi
  echo "=== $name: rc=$rc$note after $(( $(date +%s) - t0 ))s" | tee -a "$SUMMARY"
  tail -n 6 "$LOGS/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
  return 0
}

# The project on the path as it is installed (kernels/ and recipes/ become loka_torchrec
# subpackages, as pyproject.toml maps them), without pip and without touching the image's torch.
source "$ROOT/scripts/installed_layout.sh" && use_installed_layout "$ROOT" "$WORK/site"
# -P: the repository root is not put on sys.path, so `loka_torchrec` is the copy above.
PYP="$PY -P"

if ! $PYP -c "import pytest" 2>/dev/null && ls .device/test-wheels/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .device/test-wheels/*.whl >> "$LOGS/setup.log" 2>&1
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

cat > "$WORK/versions.py" <<'EOF'
import importlib, platform, subprocess, sys
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
for i in range(torch.cuda.device_count()):
    print(f"gpu{i}", torch.cuda.get_device_name(i), "sm%d%d" % torch.cuda.get_device_capability(i))
for name in ("triton", "pytest", "torchrec", "fbgemm_gpu", "fbgemm_gpu.experimental.gen_ai", "transformer_engine", "torchao"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', 'ok')}")
    except Exception as exc:
        print(f"{name}: NOT AVAILABLE ({type(exc).__name__}: {exc})")
import loka_torchrec.gemm.backends as backends
for module in ("fbgemm", "transformer_engine", "triton"):
    importlib.import_module(f"loka_torchrec.gemm.backends.{module}")
for name in backends.backend_names():
    print(f"backend {name}: {backends.get_backend(name).availability('cuda')}")
try:
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)
except Exception as exc:
    print("nvidia-smi:", exc)
EOF

PYTEST_ARGS=(-m gpu -rs -q -p no:cacheprovider -o addopts= --continue-on-collection-errors --durations=10)
OWN_TESTS=(tests/test_kernels_gpu.py tests/test_gpu_backends.py)

run_step versions 60 $PYP "$WORK/versions.py"
cp "$LOGS/versions.log" "$WORK/versions.txt" 2>/dev/null
sed 's/^/    /' "$WORK/versions.txt" >> "$SUMMARY"
run_step pytest_kernels_backends 150 $PYP -m pytest "${OWN_TESTS[@]}" "${PYTEST_ARGS[@]}" \
  --junitxml="$LOGS/pytest-kernels-backends.xml"
run_step pytest_other_gpu 100 $PYP -m pytest tests "${PYTEST_ARGS[@]}" \
  $(printf -- '--ignore=%s ' "${OWN_TESTS[@]}") --junitxml="$LOGS/pytest-other-gpu.xml"
# Probe overhead at LRM sizes (benchmarks/probe_overhead.py: per-phase costs and a direct run).
run_step probe_overhead 150 $PYP benchmarks/probe_overhead.py --device cuda --out "$WORK/bench"
BENCH_LIMIT=$(( $(remaining) - 25 ))
[ "$BENCH_LIMIT" -gt 240 ] && BENCH_LIMIT=240
# The benchmark stops starting new shapes 45 s before its limit, so it ends with its files written.
run_step gemm_bench "$BENCH_LIMIT" $PYP benchmarks/gemm_bench.py --out "$WORK/bench" \
  --max-seconds $(( BENCH_LIMIT > 60 ? BENCH_LIMIT - 45 : 15 )) --warmup-ms 5 --rep-ms 25 ${SUITE_BENCH_ARGS:-}

# With time left: the target shapes again with fast accumulation (the kernels' ceiling).
FAST_LIMIT=$(( $(remaining) - 30 ))
if [ "$FAST_LIMIT" -gt 60 ]; then
  run_step gemm_bench_fast_accum "$FAST_LIMIT" $PYP benchmarks/gemm_bench.py --out "$WORK/bench" \
    --name gemm-bench-fast-accum --sections gemm --fast-accum --shapes 8192x2048x2048,32768x4096x4096,8192x1024x1024 \
    --max-seconds $(( FAST_LIMIT - 30 )) --warmup-ms 5 --rep-ms 25
fi

cp "$WORK"/bench/*.json "$WORK"/bench/*.md "$OUT/" 2>/dev/null
echo "=== total: $(( ${SUITE_DEADLINE_S:-450} - $(remaining) ))s" | tee -a "$SUMMARY"
cp "$SUMMARY" "$OUT/summary.txt"
tar -czf "$OUT/device-suite-logs.tar.gz" -C "$WORK" logs summary.txt versions.txt bench 2>/dev/null
ls -la "$OUT"
exit 0
