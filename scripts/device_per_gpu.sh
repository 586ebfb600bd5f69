#!/usr/bin/env bash
# Several independent GPU jobs at once on one multi-GPU machine, each pinned to its own GPUs, in one
# device call (one machine start serves them all):
#     export PYTHONPATH=/tmp/site && bash scripts/device_per_gpu.sh JOBS_FILE
#
# JOBS_FILE has one job a line: `GPUS NAME COMMAND...` (blank lines and `#` comments skipped).
# GPUS is CUDA_VISIBLE_DEVICES for the job (e.g. `0` or `2,3`); COMMAND runs under bash from the
# repository root with OUT set to the job's own folder, and may chain stages with `&&` or `;`, e.g.
#     0 wukong-large  E2E_STEPS=500 bash scripts/device_benchmarks.sh e2e NAME wukong_large 0 RUNS
# Jobs on different GPUs run side by side: each job's ratios are measured within its own sequence of
# runs on its GPU, while the other jobs share the host's CPUs (say so where the numbers are reported).
#
# Every job shares one deadline (CALL_T0, the call's start; STAGE_DEADLINE_S, default 570, as in
# device_benchmarks.sh). A job still running at the deadline is stopped there (its whole process tree),
# so that the summary and every job's folder are written before the device call's own limit: give the
# call a limit at least 30 s past the deadline. What comes back: $OUT/summary.txt (each job's exit
# status, or that the deadline stopped it, its duration and last lines) and $OUT/<NAME>.tar.gz (the
# job's folder, whatever it wrote before it ended), at most 7 jobs.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
jobs_file=${1:?usage: device_per_gpu.sh JOBS_FILE}
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
export CALL_T0=${CALL_T0:-$(date +%s)}
DEADLINE=$(( CALL_T0 + ${STAGE_DEADLINE_S:-570} ))
WORK=$(mktemp -d /tmp/loka-per-gpu.XXXXXX)

# Stop a process and everything under it (a job's e2e driver starts torchrun in a session of its own).
stop_tree() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do stop_tree "$child" "$2"; done
  kill "-$2" "$1" 2>/dev/null
}

names=()
pids=()
while read -r gpus name command; do
  case $gpus in ''|'#'*) continue ;; esac
  if [ -z "${command:-}" ]; then
    echo "device_per_gpu.sh: $jobs_file: line '$gpus $name' has no command (expected GPUS NAME COMMAND...)" >&2
    exit 2
  fi
  names+=("$name")
  mkdir -p "$WORK/$name"
  (
    start=$(date +%s)
    CUDA_VISIBLE_DEVICES=$gpus OUT="$WORK/$name" bash -c "$command" < /dev/null > "$WORK/$name.log" 2>&1
    echo "$? $(( $(date +%s) - start ))" > "$WORK/$name.rc"
  ) > /dev/null 2>&1 &
  pids+=($!)
done < "$jobs_file"
if [ "${#names[@]}" -gt 7 ]; then
  echo "device_per_gpu.sh: ${#names[@]} jobs; at most 7 come back (8 files a call)" >&2
fi

# Wait for every job, or for the deadline: then stop the jobs still running, politely first.
running() { local p; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
while running && [ "$(date +%s)" -lt "$DEADLINE" ]; do sleep 1; done
stopped=()
for i in "${!pids[@]}"; do
  if kill -0 "${pids[$i]}" 2>/dev/null; then
    stopped+=("${names[$i]}")
    stop_tree "${pids[$i]}" TERM
  fi
done
[ "${#stopped[@]}" -gt 0 ] && sleep 5 && for p in "${pids[@]}"; do stop_tree "$p" KILL; done
wait 2>/dev/null

for name in "${names[@]}"; do
  if [[ " ${stopped[*]} " == *" $name "* ]]; then
    status="stopped at the call's deadline (CALL_T0 + STAGE_DEADLINE_S = $(( DEADLINE - CALL_T0 )) s)"
  else
    read -r rc seconds < "$WORK/$name.rc"
    status="rc=$rc, ${seconds} s"
  fi
  {
    echo "=== $name: $status"
    tail -n 25 "$WORK/$name.log"
  } >> "$OUT/summary.txt"
  cp "$WORK/$name.log" "$WORK/$name/job.log"
  tar -czf "$OUT/$name.tar.gz" -C "$WORK" "$name"
done
cat "$OUT/summary.txt"
ls -la "$OUT"
